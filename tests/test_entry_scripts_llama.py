"""finetune_llama.py and finetune_pp_llama.py, run as users run them, report HF's losses and
generate HF's tokens, for Llama, Qwen2 and GPT-2.

A tiny Llama (grouped-query attention, a BPE tokenizer trained by galaxy.assets.tiny_llama)
trains 3 SGD steps on a .txt file: serial, the Galaxy plan at world 2 (uneven shares, whole K/V
groups), and a 2-stage pipeline with 4 micro-batches. The losses in metrics_file must equal HF
LlamaForCausalLM trained on the same batches (mean over the global batch's label tokens).
--generate under the Galaxy plan must print HF generate's greedy tokens. A tiny Qwen2
(galaxy.assets.tiny_qwen2: q/k/v biases, tied embeddings) trains with finetune_llama.py under the
Galaxy plan at world 2 and reports HF Qwen2ForCausalLM's losses.

A tiny GPT-2 (galaxy.assets.tiny_gpt2: same tokenizer recipe, GPT-2's <|endoftext|>, no pad token)
trains 3 AdamW steps under the Galaxy plan at world 2 (heads 3 / 1) with checkpoints and an export:
HF's losses, a resume under other shares (heads 1 / 3) continuing within rounding with the
optimizer state intact, an export GPT2LMHeadModel loads (Conv1D weights transposed back) with
galaxy's logits; greedy generation under the plan gives HF generate's tokens.
"""
import json

import pytest
import torch

from support.parity import HF_LOADERS
from support.script_runner import run_script
from support.trainer_support import probe_optimizer_state, step_losses, train_on_rank

from galaxy.data.causal_lm import encode_lm_sample
from galaxy.assets.tiny_gpt2 import write_tiny_gpt2
from galaxy.assets.tiny_llama import write_tiny_llama
from galaxy.assets.tiny_qwen2 import write_tiny_qwen2
from galaxy.train.metrics import read_metrics

STEPS, BATCH, PAD, LR = 3, 8, 24, 0.5
GALAXY = dict(att_parallel_method="TP", con_parallel_method="SP", mlp_parallel_method="TP",
              tp_num_attention_heads_list=[2, 2], tp_intermediate_size_list=[200, 144], seq_scatter_list=[13, 11])


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """jobs(family) -> its tiny model (galaxy.assets.tiny_*) and a .txt training file, written once."""
    import pydoc_data.topics
    made = {}

    def get(family):
        if family not in made:
            tmp = tmp_path_factory.mktemp(f"{family}_entry")
            write = {"llama": write_tiny_llama, "qwen2": write_tiny_qwen2, "gpt2": write_tiny_gpt2}[family]
            model_dir = write(str(tmp / "model"), vocab_size=512, seed=1)
            lines = [" ".join(t.split()[:max(4, 28 - i)])
                     for i, t in enumerate(list(pydoc_data.topics.topics.values())[:BATCH * STEPS])]
            train = tmp / "train.txt"
            train.write_text("\n".join(lines) + "\n")
            made[family] = dict(tmp=tmp, model_dir=model_dir, train=str(train), lines=lines, family=family)
        return made[family]
    return get


@pytest.fixture(scope="module")
def job(jobs):
    return jobs("llama")


@pytest.fixture(scope="module")
def gpt2_job(jobs):
    return jobs("gpt2")


def write_config(job, name, **extra):
    cfg = dict(model_path=job["model_dir"], train_path=job["train"], pad_size=PAD, batch_size=BATCH,
               learning_rate=LR, optimizer="sgd", max_steps=STEPS, shuffle=False, timeout_s=60,
               metrics_file=str(job["tmp"] / f"{name}.jsonl"))
    cfg.update(extra)
    path = job["tmp"] / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path), cfg["metrics_file"]


def hf_losses(job, optimizer="sgd", lr=LR):
    """HF's model (eval mode: no dropout) trained on the script's batches with its optimizer."""
    from transformers import AutoTokenizer
    model = HF_LOADERS[job["family"]](job["model_dir"]).eval()
    tok = AutoTokenizer.from_pretrained(job["model_dir"])
    opt = (torch.optim.SGD if optimizer == "sgd" else torch.optim.AdamW)(model.parameters(), lr=lr)
    losses = []
    for step in range(STEPS):
        rows = [encode_lm_sample(tok, line, None, PAD) for line in job["lines"][step * BATCH:(step + 1) * BATCH]]
        ids, mask, labels = (torch.stack(t) for t in zip(*rows))
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("family,script,world,extra", [
    ("llama", "finetune_llama.py", 1, {}),
    ("llama", "finetune_llama.py", 2, GALAXY),
    ("llama", "finetune_pp_llama.py", 2, dict(stage_num_hidden_layers_list=[3, 1], num_microbatches=4)),
    ("qwen2", "finetune_llama.py", 2, GALAXY),
], ids=["serial", "galaxy-w2", "pp-w2", "qwen2-galaxy-w2"])
def test_llama_script_reports_hf_losses(jobs, family, script, world, extra):
    job = jobs(family)
    config, metrics_file = write_config(job, f"{script[:-3]}-{world}", **extra)
    run_script(script, config, world)
    steps = [r for r in read_metrics(metrics_file) if "event" not in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r, ref in zip(steps, hf_losses(job)):
        assert abs(r["loss"] - ref) <= 1e-5 * abs(ref), (r["loss"], ref)


def test_generate_prints_hf_greedy_tokens(job):
    from transformers import AutoTokenizer, LlamaForCausalLM
    prompt = "The assert statement"
    tok = AutoTokenizer.from_pretrained(job["model_dir"])
    enc = tok(prompt, return_tensors="pt")
    want = LlamaForCausalLM.from_pretrained(job["model_dir"]).generate(**enc, max_new_tokens=6, do_sample=False)
    want = want[0, enc["input_ids"].shape[1]:].tolist()
    config, _ = write_config(job, "generate", **GALAXY)
    out = run_script("finetune_llama.py", config, 2, "--generate", prompt, "--max_new_tokens", "6")[0]
    assert f"generated token ids: {want}" in out, out


def test_checkpoint_resume_and_export_for_llama(job):
    """The trainer's checkpoints and export serve causal LMs too: resuming from step 2 of the 3-step
    run repeats step 3 exactly, and the export loads in HF with galaxy's logits."""
    import shutil
    from transformers import LlamaForCausalLM

    from galaxy.distributed.group import GalaxyGroup
    from galaxy.runtime.assemble import build_model
    from galaxy.plan import Plan
    tmp = job["tmp"]
    save, export = tmp / "save", tmp / "export"
    config, full_metrics = write_config(job, "ckpt-full", save_dir=str(save), save_interval=2,
                                        export_dir=str(export))
    run_script("finetune_llama.py", config, 1)
    shutil.copytree(save, tmp / "save2")
    shutil.rmtree(tmp / "save2" / "step-00000003")
    (tmp / "save2" / "latest").write_text("step-00000002\n")
    config, resumed_metrics = write_config(job, "ckpt-resumed", save_dir=str(tmp / "save2"),
                                           resume="latest")
    run_script("finetune_llama.py", config, 1)
    full = {r["step"]: r["loss"] for r in read_metrics(full_metrics) if "event" not in r}
    resumed = {r["step"]: r["loss"] for r in read_metrics(resumed_metrics) if "event" not in r}
    assert sorted(resumed) == [3]
    assert max(abs(full[k] - resumed[k]) for k in resumed) <= 1e-6

    ids = torch.randint(3, 500, (2, PAD), generator=torch.Generator().manual_seed(0))
    hf = LlamaForCausalLM.from_pretrained(str(export))(ids).logits
    ours, _ = build_model(str(export), Plan(), GalaxyGroup.serial(4, 344, PAD))(ids)
    assert ((hf - ours).abs().max() / hf.abs().max()).item() < 1e-5


GPT2_GALAXY = dict(att_parallel_method="TP", con_parallel_method="SP", mlp_parallel_method="TP",
                   tp_num_attention_heads_list=[3, 1], tp_intermediate_size_list=[300, 212], seq_scatter_list=[13, 11])
GPT2_OTHER = {**GPT2_GALAXY, "tp_num_attention_heads_list": [1, 3], "tp_intermediate_size_list": [200, 312],
              "seq_scatter_list": [10, 14]}
ADAM_LR = 1e-3


def test_gpt2_galaxy_run_reports_hf_losses_resumes_and_exports(gpt2_job, dist_pool):
    """finetune_llama.py at world 2 on GPT-2 (AdamW, GPT-2's dropouts off through the dropout key),
    checkpoints at step 2, export at the end; then a resume from step 2 under other shares."""
    import shutil
    from transformers import GPT2LMHeadModel

    from galaxy.distributed.group import GalaxyGroup
    from galaxy.runtime.assemble import build_model
    from galaxy.plan import Plan
    tmp = gpt2_job["tmp"]
    save, export = tmp / "save", tmp / "export"
    config, metrics = write_config(gpt2_job, "gpt2-galaxy", optimizer="adamw", learning_rate=ADAM_LR, dropout=0.0,
                                   save_dir=str(save), save_interval=2, export_dir=str(export), **GPT2_GALAXY)
    run_script("finetune_llama.py", config, 2)
    full = step_losses(metrics)
    assert sorted(full) == [1, 2, 3]
    for step, ref in enumerate(hf_losses(gpt2_job, "adamw", ADAM_LR), start=1):
        assert abs(full[step] - ref) <= 1e-5 * abs(ref), (step, full[step], ref)

    # Resume from step 2 under other head, column and token shares: the AdamW state of c_attn
    # (gathered block by block) slices to the new shares and gathers back unchanged.
    shutil.copytree(save, tmp / "save2")
    shutil.rmtree(tmp / "save2" / "step-00000003")
    config, resumed_metrics = write_config(gpt2_job, "gpt2-resumed", optimizer="adamw", learning_rate=ADAM_LR,
                                           dropout=0.0, save_dir=str(tmp / "save2"), resume="latest", **GPT2_OTHER)
    (_, (saved, regathered), _), _ = dist_pool(2).run(train_on_rank, config, "galaxy", probe_optimizer_state, None,
                                                      "causal_lm")
    assert any(k.startswith("layers.0.att.c_attn.weight/") for k in saved)
    assert saved.keys() == regathered.keys() and all(torch.equal(saved[k], regathered[k]) for k in saved)
    resumed = step_losses(resumed_metrics)
    assert sorted(resumed) == [3] and abs(resumed[3] - full[3]) <= 1e-5 * abs(full[3])

    ids = torch.randint(1, 500, (2, PAD), generator=torch.Generator().manual_seed(0))
    hf = GPT2LMHeadModel.from_pretrained(str(export))(ids).logits
    ours, _ = build_model(str(export), Plan(), GalaxyGroup.serial(4, 512, PAD)).eval()(ids)   # no dropout
    assert ((hf - ours).abs().max() / hf.abs().max()).item() < 1e-5
    start = GPT2LMHeadModel.from_pretrained(gpt2_job["model_dir"])(ids).logits
    assert ((hf - start).abs().max() / hf.abs().max()).item() > 1e-3      # the export is the trained model


def generate_on_rank(model_dir, prompt, max_new_tokens, plan, shares):
    from transformers import AutoTokenizer

    from galaxy.runtime.assemble import build_model
    from galaxy.runtime.generate import greedy_generate
    from support.parity import world_group
    model = build_model(model_dir, plan, world_group(*shares))
    return greedy_generate(model, AutoTokenizer.from_pretrained(model_dir), prompt, max_new_tokens, PAD)


def test_gpt2_generation_under_a_plan_is_hf_greedy(gpt2_job, dist_pool):
    from transformers import AutoTokenizer, GPT2LMHeadModel

    from galaxy.plan import Plan
    prompt = "The assert statement"
    tok = AutoTokenizer.from_pretrained(gpt2_job["model_dir"])
    enc = tok(prompt, return_tensors="pt")
    want = GPT2LMHeadModel.from_pretrained(gpt2_job["model_dir"]).generate(**enc, max_new_tokens=8, do_sample=False)
    want = want[0, enc["input_ids"].shape[1]:].tolist()
    shares = ((3, 1), (300, 212), (13, 11))
    got = dist_pool(2).run(generate_on_rank, gpt2_job["model_dir"], prompt, 8, Plan.preset("galaxy"), shares)
    assert got == [want, want]

