"""Checkpoints, resume and export under pipeline parallelism (pp_deg > 1) are those of pp_deg 1.

A tiny 4-layer BERT cut into 2 uneven stages ([1, 3], 2 micro-batches, 1F1B) at world 2 trains 6
steps saving at step 3 (AdamW, linear schedule with warm-up, clipping, shuffled data, an epoch
boundary after step 5), then resumes from step 3:
  - under the same layout the losses of steps 4..6 repeat the uninterrupted run's bit for bit,
    with dropout too (each stage's random stream is saved and restored);
  - the pp2 checkpoint resumes serially and under the other split ([3, 1], GPipe), a serial
    checkpoint resumes under pp2: losses within 1e-5 of the uninterrupted run, and the sliced
    optimizer state gathers back to exactly the saved tensors;
  - a pp2 checkpoint folder holds the files, tensor names and shapes of a serial one.
A pp2 x Galaxy 2 checkpoint resumes exactly under mesh_rank_order [2, 0, 3, 1] (streams by position).
Exports under pp2 load in transformers (full weights, merged LoRA) and peft (LoRA adapter) and
give the trained pipeline's logits; adapter / side exports equal a serial run's. Llama (untied
embeddings) and Qwen2 (q/k/v biases, tied embeddings) as pipelines resume exactly and export HF
folders that give the pipeline's logits in transformers' LlamaForCausalLM / Qwen2ForCausalLM.
Dropout: the two stages draw different masks, and the ranks of one stage's Galaxy group the same.
"""
import json
import os

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from support.parity import HF_LOADERS, rel_err
from support.trainer_support import make_workspace, step_losses, train_on_rank, write_config

from galaxy.train.checkpoint import step_dir_name

EXACT = dict(num_epochs=2, max_steps=6, save_interval=3, lr_schedule="linear", warmup_steps=2, clip_grad=1.0)
RESUMED = {**EXACT, "save_interval": None}
PP2 = dict(pp_deg=2, num_microbatches=2, stage_num_hidden_layers_list=[1, 3])
PP2_OTHER = dict(pp_deg=2, num_microbatches=2, stage_num_hidden_layers_list=[3, 1], pipeline_schedule="gpipe")
PAD = 16


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("pp_ckpt"), n_train=40, num_hidden_layers=4)


def run(pool, ws, name, after=None, **keys):
    """Train on every rank of the pool; (losses by step, rank 0's after(trainer))."""
    results = pool.run(train_on_rank, write_config(ws, name, **keys), "galaxy", None, after)
    return step_losses(os.path.join(ws["root"], name, "metrics.jsonl")), results[0][2]


def save_dir(ws, name):
    return os.path.join(ws["root"], name, "ck")


def checkpoint(ws, name, step=3):
    return os.path.join(save_dir(ws, name), step_dir_name(step))


def max_diff(a, b, steps=(4, 5, 6)):
    assert all(k in b for k in steps), sorted(b)
    return max(abs(a[k] - b[k]) for k in steps)


# --- resume -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
def test_pp2_resume_repeats_the_uninterrupted_run_exactly(dist_pool, ws, dropout):
    pool, tag = dist_pool(2), f"pp2-d{dropout}"
    full, _ = run(pool, ws, f"{tag}-full", save_dir=save_dir(ws, f"{tag}-full"), dropout=dropout, **EXACT, **PP2)
    resumed, _ = run(pool, ws, f"{tag}-resumed", resume=checkpoint(ws, f"{tag}-full"), dropout=dropout,
                     **RESUMED, **PP2)
    assert sorted(resumed) == [4, 5, 6]
    assert max_diff(full, resumed) == 0.0
    if dropout:     # the masks matter: without them restored, the losses could not repeat
        assert max_diff(full, layouts(dist_pool, ws)["pp2"]) > 1e-3
        saved = load_file(os.path.join(checkpoint(ws, f"{tag}-full"), "rng.safetensors"))
        assert not torch.equal(saved["cpu"], saved["cpu.stage1"])


MESHES_W4 = {"pp2-x-galaxy2": dict(tp_num_attention_heads_list=[4, 2], tp_intermediate_size_list=[60, 36],
                                    seq_scatter_list=[9, 7]),
             "pp2-x-dp2": dict(dp_deg=2)}


@pytest.mark.parametrize("mesh", list(MESHES_W4))
def test_world4_pipeline_meshes_resume_exactly_with_dropout(dist_pool, ws, mesh):
    """Stages that are Galaxy groups (sharded streams saved per rank, shards gathered per stage)
    or DDP replicas (only replica 0 gathers): exact resume, and the checkpoint holds the serial
    one's tensors (names and shapes; dropout makes the values differ)."""
    pool, tag = dist_pool(4), f"w4-{mesh}"
    keys = {**PP2, **MESHES_W4[mesh], "dropout": 0.1}
    full = w4_full(pool, ws, mesh)
    resumed, _ = run(pool, ws, f"{tag}-resumed", resume=checkpoint(ws, f"{tag}-full"), **RESUMED, **keys)
    assert sorted(resumed) == [4, 5, 6]
    assert max_diff(full, resumed) == 0.0
    layouts(dist_pool, ws)
    for name in ("model/model.safetensors", "optimizer.safetensors"):
        ours, theirs = (load_file(os.path.join(checkpoint(ws, run_), name)) for run_ in (f"{tag}-full", "x-serial"))
        assert ours.keys() == theirs.keys() and all(ours[k].shape == theirs[k].shape for k in theirs), name
    rng = sorted(load_file(os.path.join(checkpoint(ws, f"{tag}-full"), "rng.safetensors")))
    assert rng == ["cpu", "cpu.stage1"] + ([f"sharded.{r}" for r in range(4)] if "galaxy" in mesh else [])


_w4_full: dict = {}


def w4_full(pool, ws, mesh: str) -> dict:
    """The losses of MESHES_W4[mesh]'s uninterrupted run with dropout, saving at step 3 (once a session)."""
    if mesh not in _w4_full:
        tag = f"w4-{mesh}"
        _w4_full[mesh] = run(pool, ws, f"{tag}-full", save_dir=save_dir(ws, f"{tag}-full"), **EXACT, **PP2,
                             **MESHES_W4[mesh], dropout=0.1)[0]
    return _w4_full[mesh]


def test_a_checkpoint_resumes_exactly_under_another_rank_order(dist_pool, ws):
    """mesh_rank_order [2, 0, 3, 1]: the processes started as ranks 2 and 0 resume stage 0's Galaxy
    ranks 0 and 1, whoever held them when saving. The checkpoint is the whole model and each sharded
    dropout stream is saved by mesh position (sharded.{position}), so losses repeat bit for bit."""
    order = [2, 0, 3, 1]
    full = w4_full(dist_pool(4), ws, "pp2-x-galaxy2")
    resumed, _ = run(dist_pool(4, tuple(order)), ws, "w4-placed-resumed", mesh_rank_order=order, dropout=0.1,
                     resume=checkpoint(ws, "w4-pp2-x-galaxy2-full"), **RESUMED, **PP2, **MESHES_W4["pp2-x-galaxy2"])
    assert sorted(resumed) == [4, 5, 6]
    assert max_diff(full, resumed) == 0.0


def probe_optimizer_state(trainer):
    """Right after a resume: the state every stage loaded, gathered back to rank 0 (else None)."""
    from galaxy.train.optim_state import gather_optimizer_state
    regathered = gather_optimizer_state(trainer.model, trainer.optimizer, trainer.mesh)[0]
    return None if regathered is None else (trainer.job.resume.optimizer_tensors(), regathered)


_layouts: dict = {}


def layouts(dist_pool, ws) -> dict:
    """The uninterrupted 6-step runs (saving at 3) of pp2 [1, 3] and serial, run once per module."""
    if not _layouts:
        _layouts["pp2"] = run(dist_pool(2), ws, "x-pp2", save_dir=save_dir(ws, "x-pp2"), **EXACT, **PP2)[0]
        _layouts["serial"] = run(dist_pool(1), ws, "x-serial", save_dir=save_dir(ws, "x-serial"), **EXACT)[0]
    return _layouts


@pytest.mark.parametrize("source,world,layout", [("pp2", 1, {}), ("pp2", 2, PP2_OTHER), ("serial", 2, PP2_OTHER)],
                         ids=["pp2-to-serial", "pp2-to-other-split", "serial-to-pp2"])
def test_checkpoints_resume_across_pipeline_layouts(dist_pool, ws, source, world, layout):
    full = layouts(dist_pool, ws)
    assert max_diff(full["pp2"], full["serial"], range(1, 7)) <= 1e-5    # the same training, to rounding
    name = f"x-{source}-to-w{world}"
    resumed, (saved, regathered) = _resume_with_probe(dist_pool(world), ws, name, checkpoint(ws, f"x-{source}"),
                                                      layout)
    assert saved.keys() == regathered.keys()
    assert all(torch.equal(saved[k], regathered[k]) for k in saved), "optimizer state changed in transit"
    assert sorted(resumed) == [4, 5, 6]
    assert max_diff(full[source], resumed) <= 1e-5, (full[source], resumed)


def _resume_with_probe(pool, ws, name, ckpt, layout):
    results = pool.run(train_on_rank, write_config(ws, name, resume=ckpt, **RESUMED, **layout), "galaxy",
                       probe_optimizer_state)
    return step_losses(os.path.join(ws["root"], name, "metrics.jsonl")), results[0][1]


def test_a_pipeline_checkpoint_is_laid_out_as_a_serial_one(dist_pool, ws):
    layouts(dist_pool, ws)
    pp2, serial = checkpoint(ws, "x-pp2"), checkpoint(ws, "x-serial")

    def files(root):
        return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)
    assert files(pp2) == files(serial)
    for name in ("model/model.safetensors", "optimizer.safetensors"):
        ours, theirs = load_file(os.path.join(pp2, name)), load_file(os.path.join(serial, name))
        assert ours.keys() == theirs.keys(), name
        for key in theirs:
            assert ours[key].shape == theirs[key].shape, key
            if theirs[key].abs().max() < 1e-10:     # e.g. a key bias: no gradient but rounding noise
                assert ours[key].abs().max() < 1e-10, key
            else:                                   # 3 AdamW steps apart by rounding only
                assert rel_err(ours[key], theirs[key]) <= 1e-4, (key, rel_err(ours[key], theirs[key]))
    state = [json.load(open(os.path.join(d, "trainer_state.json"))) for d in (pp2, serial)]
    assert state[0].keys() == state[1].keys()
    assert state[0]["optimizer_groups"] == state[1]["optimizer_groups"]
    assert (state[0]["layout"]["plan"]["pp"], state[0]["layout"]["stages"]) == (2, [[0, 1], [1, 4]])
    assert (state[1]["layout"]["plan"]["pp"], state[1]["layout"]["stages"]) == (1, [[0, 4]])
    assert sorted(load_file(os.path.join(pp2, "rng.safetensors"))) == ["cpu", "cpu.stage1"]
    assert sorted(load_file(os.path.join(serial, "rng.safetensors"))) == ["cpu"]


# --- PEFT: resume and export ---------------------------------------------------------------------

PEFT = {"lora": dict(use_lora=True, lora_dim=4, lora_alpha=8, lora_target_modules=["query", "value", "dense"]),
        "adapter": dict(use_adapter=True, adapter_reduction_dim=8),
        "side": dict(use_side=True, side_reduction_factor=4),
        "side_only": dict(use_side_only=True, side_reduction_factor=4)}


@pytest.mark.parametrize("method", list(PEFT))
def test_peft_under_pp2_resumes_exactly_and_exports_what_serial_exports(dist_pool, ws, method):
    keys, tag = {**PEFT[method], "learning_rate": 1e-2}, f"peft-{method}"
    full, _ = run(dist_pool(2), ws, f"{tag}-pp2", save_dir=save_dir(ws, f"{tag}-pp2"),
                  export_dir=os.path.join(ws["root"], f"{tag}-pp2", "export"), **EXACT, **PP2, **keys)
    resumed, _ = run(dist_pool(2), ws, f"{tag}-resumed", resume=checkpoint(ws, f"{tag}-pp2"), **RESUMED, **PP2, **keys)
    assert sorted(resumed) == [4, 5, 6]
    assert max_diff(full, resumed) == 0.0
    serial, _ = run(dist_pool(1), ws, f"{tag}-serial", **RESUMED, **keys,
                    export_dir=os.path.join(ws["root"], f"{tag}-serial", "export"))
    assert max_diff(full, serial, range(1, 7)) <= 1e-5
    weights = "adapter_model.safetensors" if method == "lora" else "peft_model.safetensors"
    ours, theirs = (load_file(os.path.join(ws["root"], f"{tag}-{which}", "export", weights))
                    for which in ("pp2", "serial"))
    assert ours.keys() == theirs.keys()
    assert all(any(f"layer.{i}." in k for k in ours) for i in range(4)), sorted(ours)   # both stages' layers
    # One scale for the whole export: AdamW turns the rounding noise of gradients that are 0 in
    # exact arithmetic (key biases) into steps of its own, so tiny tensors differ relatively more.
    scale = max(t.abs().max() for t in theirs.values())
    assert max((ours[k] - theirs[k]).abs().max() for k in theirs) <= 1e-5 * scale


def dev_batch(tokenizer, path, n=6):
    with open(path, encoding="utf-8") as f:
        texts = [line.rsplit("\t", 1)[0] for line in f][:n]
    return tokenizer(texts, padding="max_length", truncation=True, max_length=PAD, return_tensors="pt")


def runner_logits(trainer):
    """The trained model's logits on dev texts (under PP: the pipeline's, on every stage)."""
    enc = dev_batch(trainer.job.tokenizer, trainer.cfg.dev_path)
    trainer.runner.eval()
    with torch.no_grad():
        logits, _ = trainer.runner(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"])
    return logits                                       # [6, classes]


@pytest.mark.parametrize("what", ["full", "lora", "merge_lora"])
def test_pp2_exports_load_in_transformers_and_peft_with_the_pipelines_logits(dist_pool, ws, what):
    from transformers import AutoTokenizer, BertForSequenceClassification
    out = os.path.join(ws["root"], f"export-{what}", "export")
    keys = {} if what == "full" else {**PEFT["lora"], "merge_lora": what == "merge_lora"}
    _, theirs = run(dist_pool(2), ws, f"export-{what}", after=runner_logits, export_dir=out, max_steps=3,
                    learning_rate=1e-2, **PP2, **keys)
    if what == "lora":
        from peft import PeftModel
        model = PeftModel.from_pretrained(BertForSequenceClassification.from_pretrained(ws["model_dir"]), out)
    else:
        model = BertForSequenceClassification.from_pretrained(out)
        assert not any("lora" in k for k in load_file(os.path.join(out, "model.safetensors")))
    enc = dev_batch(AutoTokenizer.from_pretrained(ws["model_dir"]), ws["dev"])
    with torch.no_grad():
        ours = model.eval()(**enc).logits
        start = BertForSequenceClassification.from_pretrained(ws["model_dir"]).eval()(**enc).logits
    assert rel_err(ours, theirs) < 1e-5
    assert rel_err(start, theirs) > 1e-3        # training moved the weights: the export is not the start


# --- Llama --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_ws(tmp_path_factory):
    import pydoc_data.topics

    from galaxy.assets.tiny_llama import write_tiny_llama
    root = tmp_path_factory.mktemp("pp_llama")
    model_dir = write_tiny_llama(str(root / "model"), vocab_size=512, seed=1)   # untied embeddings
    lines = [" ".join(t.split()[:max(4, 28 - i)]) for i, t in enumerate(list(pydoc_data.topics.topics.values())[:24])]
    (root / "train.txt").write_text("\n".join(lines) + "\n")
    return dict(root=str(root), model_dir=model_dir, train=str(root / "train.txt"))


@pytest.fixture(scope="module")
def tied_llama_dir(llama_ws):
    """The tiny Llama with tie_word_embeddings: lm_head is embed_tokens (one tensor on disk)."""
    from transformers import AutoTokenizer, LlamaForCausalLM
    path = os.path.join(llama_ws["root"], "tied-model")
    model = LlamaForCausalLM.from_pretrained(llama_ws["model_dir"])
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(llama_ws["model_dir"]).save_pretrained(path)
    return path


def llama_config(ws, name, **keys):
    cfg = dict(model_path=ws["model_dir"], train_path=ws["train"], pad_size=24, batch_size=8, learning_rate=1e-2,
               optimizer="adamw", max_steps=3, shuffle=True, dropout=0.0, timeout_s=60, pp_deg=2,
               num_microbatches=2, stage_num_hidden_layers_list=[3, 1],
               metrics_file=os.path.join(ws["root"], name, "metrics.jsonl"))
    path = os.path.join(ws["root"], f"{name}.json")
    with open(path, "w") as f:
        json.dump({**cfg, **keys}, f)
    return path


LLAMA_IDS = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))


def llama_logits(trainer):
    trainer.runner.eval()
    with torch.no_grad():
        logits, _ = trainer.runner(LLAMA_IDS, torch.ones_like(LLAMA_IDS))
    return logits                                       # [2, 24, vocab]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_llama_pipeline_resumes_exactly_and_exports_an_hf_folder(dist_pool, llama_ws, family):
    from galaxy.assets.tiny_qwen2 import write_tiny_qwen2
    ws, pool = llama_ws, dist_pool(2)
    model = ws["model_dir"] if family == "llama" else \
        write_tiny_qwen2(os.path.join(ws["root"], "qwen2-model"), vocab_size=512, seed=1)   # tied embeddings
    full_run, resumed_run = f"{family}-full", f"{family}-resumed"
    save, export = os.path.join(ws["root"], full_run, "ck"), os.path.join(ws["root"], full_run, "export")
    results = pool.run(train_on_rank, llama_config(ws, full_run, model_path=model, save_dir=save, save_interval=2,
                                                   export_dir=export), "galaxy", None, llama_logits, "causal_lm")
    pool.run(train_on_rank, llama_config(ws, resumed_run, model_path=model, resume=os.path.join(save, step_dir_name(2))),
             "galaxy", None, None, "causal_lm")
    full, resumed = (step_losses(os.path.join(ws["root"], n, "metrics.jsonl")) for n in (full_run, resumed_run))
    assert sorted(resumed) == [3] and resumed[3] == full[3]
    with torch.no_grad():
        ours = HF_LOADERS[family](export).eval()(LLAMA_IDS).logits
    for rank, (_, _, theirs) in enumerate(results):
        assert rel_err(ours, theirs) < 1e-5, rank


# --- dropout streams ------------------------------------------------------------------------------

def first_step_dropout_masks(config_path):
    """The masks of every training-mode F.dropout call in one pipeline training step, in order."""
    import torch.nn.functional as F

    from galaxy.config import apply_preset, load_config, validate_for_world
    from galaxy.models.shape import read_model_shape
    from galaxy.launch import DistEnv
    from galaxy.train.trainer import Trainer, prepare_classifier
    cfg = apply_preset(load_config(config_path), "tp")
    validate_for_world(cfg, dist.get_world_size(), dist.get_rank(), read_model_shape(cfg.model_path))
    env = DistEnv(rank=dist.get_rank(), world=dist.get_world_size(), backend="gloo", device=torch.device("cpu"),
                  timeout_s=cfg.timeout_s, local_rank=dist.get_rank(), launch_rank=dist.get_rank())
    trainer = Trainer(prepare_classifier(cfg), env)
    masks, original = [], F.dropout

    def recording(x, p=0.5, training=True, inplace=False):
        out = original(x, p, training, inplace)
        if training and p > 0:
            masks.append(out == 0)
        return out
    F.dropout = recording
    try:
        trainer.train_step(next(iter(trainer.batches)), 1)
    finally:
        F.dropout = original
    return trainer.mesh.pp_rank, masks


def test_pipeline_stages_draw_their_own_dropout_masks(dist_pool, ws):
    """pp 2 x Galaxy 2 (world 4), CON replicated (tp plan): stage 0 draws for the embeddings and
    layer 0, stage 1 for layers 1-3 and the classifier. The two Galaxy ranks of a stage draw the
    same masks (replicated activations); the stages draw different ones (with one seed for both,
    stage 1's first layer would drop exactly what stage 0's embeddings dropped)."""
    config = write_config(ws, "masks", dropout=0.3, max_steps=1, pp_deg=2, num_microbatches=1,
                          pipeline_schedule="gpipe", stage_num_hidden_layers_list=[1, 3],
                          tp_num_attention_heads_list=[4, 2], tp_intermediate_size_list=[60, 36])
    (s0, a), (s0b, b), (s1, c), (s1b, d) = dist_pool(4).run(first_step_dropout_masks, config)
    assert (s0, s0b, s1, s1b) == (0, 0, 1, 1)
    for one, other in ((a, b), (c, d)):
        assert len(one) == len(other) > 0
        assert all(torch.equal(x, y) for x, y in zip(one, other)), "ranks of one stage drew different masks"
    assert len(a) == 3 and len(c) == 3 * 2 + 1      # embeddings + 1 layer x 2 CONs; 3 layers x 2 CONs + classifier
    shared = [(x, y) for x in a for y in c if x.shape == y.shape]
    assert shared and not any(torch.equal(x, y) for x, y in shared), "two stages drew the same mask"


def test_tied_llama_pipeline_checkpoints_and_exports_the_one_tied_weight(dist_pool, llama_ws, tied_llama_dir):
    """tie_word_embeddings under pp2: the two stages' copies are written once, under the
    embedding's name, as pp_deg 1 writes them; resuming gives both copies that one state."""
    from transformers import LlamaForCausalLM
    ws, pool = llama_ws, dist_pool(2)
    save, export = os.path.join(ws["root"], "tied", "ck"), os.path.join(ws["root"], "tied", "export")
    results = pool.run(train_on_rank, llama_config(ws, "tied", model_path=tied_llama_dir, save_dir=save,
                                                   save_interval=2, export_dir=export),
                       "galaxy", None, llama_logits, "causal_lm")
    resume = os.path.join(save, step_dir_name(2))
    pool.run(train_on_rank, llama_config(ws, "tied-resumed", model_path=tied_llama_dir, resume=resume),
             "galaxy", None, None, "causal_lm")
    full, resumed = (step_losses(os.path.join(ws["root"], n, "metrics.jsonl")) for n in ("tied", "tied-resumed"))
    assert sorted(resumed) == [3] and resumed[3] == full[3]
    written = load_file(os.path.join(export, "model.safetensors"))
    assert "model.embed_tokens.weight" in written and "lm_head.weight" not in written
    optimizer = load_file(os.path.join(save, step_dir_name(2), "optimizer.safetensors"))
    assert not any(k.startswith("lm_head") for k in optimizer)
    with torch.no_grad():
        ours = LlamaForCausalLM.from_pretrained(export).eval()(LLAMA_IDS).logits
    for rank, (_, _, theirs) in enumerate(results):
        assert rel_err(ours, theirs) < 1e-5, rank


# --- what a stage takes from a checkpoint -----------------------------------------------------------

def test_stage_owns_its_layers_and_present_modules(ws):
    from galaxy.distributed.group import GalaxyGroup
    from galaxy.runtime.assemble import build_model
    from galaxy.plan import Plan
    from galaxy.pipeline.stage import keep_stage
    from galaxy.pipeline.stage_state import stage_owns

    def whole():
        return build_model(ws["model_dir"], Plan(), GalaxyGroup.serial(6, 96, PAD), num_labels=6)
    first = keep_stage(whole(), range(0, 1), first=True, last=False)
    last = keep_stage(whole(), range(1, 4), first=False, last=True)
    names = [n for n, _ in whole().named_parameters()]
    for name in names:      # every parameter has exactly one owner
        assert stage_owns(first, name) != stage_owns(last, name), name
    assert stage_owns(first, "embeddings.word_embeddings.weight") and not stage_owns(last, "embeddings.LayerNorm.bias")
    assert stage_owns(last, "classifier.weight") and not stage_owns(first, "classifier.weight")
    assert stage_owns(first, "layers.0.att.query.weight") and not stage_owns(first, "layers.3.att.query.weight")
    # No stage owns a layer the model does not have: each claims it, so its "not a parameter" error fires.
    assert stage_owns(first, "layers.9.att.query.weight") and stage_owns(last, "layers.9.att.query.weight")
    assert stage_owns(whole(), "anything.at.all")        # pp_deg 1: everything is the model's


def resume_error(config_path):
    """The error every rank raises while resuming (None if it resumes)."""
    try:
        train_on_rank(config_path)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("bogus,owner", [("layers.2.att.bogus.weight", 1), ("bogus.weight", None)],
                         ids=["stage-1-layer", "no-stage"])
def test_state_for_a_parameter_no_stage_has_is_refused_on_every_stage(dist_pool, ws, tmp_path, bogus, owner):
    import shutil

    from safetensors.torch import save_file

    from galaxy.train.manifest import write_manifest
    layouts(dist_pool, ws)
    broken = str(tmp_path / "broken")
    shutil.copytree(checkpoint(ws, "x-pp2"), broken)
    path = os.path.join(broken, "optimizer.safetensors")
    save_file({**load_file(path), f"{bogus}/exp_avg": torch.zeros(3)}, path)
    write_manifest(broken)      # a well-formed checkpoint (not a damaged one) that holds too much
    errors = dist_pool(2).run(resume_error, write_config(ws, f"broken-{owner}", resume=broken, **RESUMED, **PP2))
    lacks = f"checkpoint has optimizer state for parameters the model lacks: ['{bogus}']"
    if owner is None:       # left by both stages
        assert errors == [lacks, lacks]
    else:                   # stage 1 refuses it; stage 0 says so instead of waiting for stage 1
        assert errors == [f"pipeline stage 1: {lacks}", lacks]
