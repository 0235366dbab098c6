"""finetune_bart.py, finetune_t5.py and their pipeline and data-parallel siblings, run as users run
them, report Hugging Face's losses; the sequence-to-sequence data formats read the same pairs.

A tiny T5 and a tiny BART (galaxy.assets.tiny_t5 / tiny_bart, on a byte-level BPE trained here on
the training lines, so that no test waits for the full tokenizer) train 3 SGD steps of 8 pairs
(source 24 tokens, target 8): T5 under the Galaxy plan at world 2 (heads 3 / 1, MLP columns 80 /
48, source tokens 13 / 11, target tokens 5 / 3) on a JSONL file, BART serially on a TSV file,
finetune_pp_t5.py (stages [1, 3]: a boundary inside the encoder) and finetune_pp_bart.py ([3, 1]:
inside the decoder) with 2 micro-batches, finetune_dp_t5.py (dp 2), dropout off. The losses in
metrics_file must equal HF's ...ForConditionalGeneration trained on the same batches. In the same
call, generate.py completes two prompts with the T5 under the Galaxy plan and as 2 pipeline stages
(boundary inside the encoder), and finetune_bart.py --generate one with the BART, serially:
Hugging Face generate's greedy tokens. Side-tuning through the scripts (finetune_t5_side.py under
the Galaxy plan, finetune_pp_t5.py side-only) reports its serial runs' losses; generating with it
is refused.
"""
import json

import pytest
import torch

from support.parity import HF_LOADERS
from support.script_runner import run_scripts
from support.sharp_seq2seq import hf_seq2seq_generate

from galaxy.data import DataError
from galaxy.data.pydoc_topics import pydoc_titles_dataset, pydoc_topics_dataset
from galaxy.data.seq2seq import encode_pairs, read_pairs
from galaxy.train.metrics import read_metrics

STEPS, BATCH, PAD, TARGET, LR = 3, 8, 24, 8, 0.5
PROMPTS, NEW = ["The for statement", "def f(): return x"], 6
# finetune_pp_*.py: 2 stages (pp_deg = world), T5's boundary inside the encoder, 2 micro-batches (GPipe).
PIPELINE = dict(stage_num_hidden_layers_list=[1, 3], num_microbatches=2)
GALAXY = dict(att_parallel_method="TP", con_parallel_method="SP", mlp_parallel_method="TP",
              tp_num_attention_heads_list=[3, 1], tp_intermediate_size_list=[80, 48], seq_scatter_list=[13, 11],
              decoder_seq_scatter_list=[5, 3])


def small_bpe(lines):
    """A byte-level BPE of ~400 tokens with tiny_llama's special tokens, trained on `lines`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from galaxy.assets.tiny_llama import SPECIAL
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from galaxy.assets.tiny_bart import write_tiny_bart
    from galaxy.assets.tiny_t5 import write_tiny_t5
    tmp = tmp_path_factory.mktemp("encdec_entry")
    pairs = pydoc_titles_dataset("train")[:BATCH * STEPS]
    lines = [text for pair in pairs for text in pair]
    (tmp / "train.jsonl").write_text("".join(json.dumps({"source": s, "target": t}) + "\n" for s, t in pairs))
    (tmp / "train.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in pairs))
    return dict(tmp=tmp, pairs=pairs, t5=write_tiny_t5(str(tmp / "t5"), bpe=small_bpe(lines), seed=1),
                bart=write_tiny_bart(str(tmp / "bart"), bpe=small_bpe(lines), seed=1))


def write_config(work, family, data, name=None, **extra):
    name = name or family
    cfg = dict(model_path=work[family], train_path=str(work["tmp"] / data), pad_size=PAD, target_pad_size=TARGET,
               batch_size=BATCH, learning_rate=LR, optimizer="sgd", max_steps=STEPS, shuffle=False, timeout_s=60,
               dropout=0.0, metrics_file=str(work["tmp"] / f"{name}.jsonl"), **extra)
    path = work["tmp"] / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path), cfg["metrics_file"]


def hf_losses(work, family):
    """HF's model (eval mode: no dropout) trained with SGD on the scripts' batches."""
    from transformers import AutoTokenizer
    model = HF_LOADERS[family](work[family]).eval()
    tok = AutoTokenizer.from_pretrained(work[family])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = model(**encode_pairs(tok, work["pairs"][step * BATCH:(step + 1) * BATCH], PAD, TARGET)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_scripts_report_hf_losses_and_generate_hf_tokens(work):
    runs = [("t5", "finetune_t5.py", 2, "train.jsonl", GALAXY), ("bart", "finetune_bart.py", 1, "train.tsv", {}),
            ("t5", "finetune_pp_t5.py", 2, "train.tsv", PIPELINE), ("bart", "finetune_pp_bart.py", 2, "train.jsonl",
                                                                    {**PIPELINE, "stage_num_hidden_layers_list": [3, 1]}),
            ("t5", "finetune_dp_t5.py", 2, "train.jsonl", {})]
    configs = [write_config(work, family, data, f"{family}-{script}", **extra)
               for family, script, _, data, extra in runs]
    prompts, completions = work["tmp"] / "prompts.jsonl", work["tmp"] / "completions.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    pp_config, _ = write_config(work, "t5", "train.jsonl", "t5-generate-pp", pp_deg=2, **PIPELINE)
    pp_completions = work["tmp"] / "completions_pp.jsonl"
    generating = [("generate.py", configs[0][0], 2, "--prompts", str(prompts), "--out", str(completions),
                   "--max_new_tokens", str(NEW)),
                  ("finetune_bart.py", configs[1][0], 1, "--generate", PROMPTS[1], "--max_new_tokens", str(NEW)),
                  ("generate.py", pp_config, 2, "--prompts", str(prompts), "--out", str(pp_completions),
                   "--max_new_tokens", str(NEW))]
    results = run_scripts([(script, config, world) for (_, script, world, _, _), (config, _) in zip(runs, configs)]
                          + generating)
    for what, outcome in zip([r[1] for r in runs] + [g[0] for g in generating], results):
        for rank, (code, out, err) in enumerate(outcome):
            assert code == 0, f"{what} rank {rank} exited {code}:\n{out}\n{err}"
    want = [hf_seq2seq_generate(work["t5"], [p], NEW)[0] for p in PROMPTS]
    for out in (completions, pp_completions):       # a Galaxy group of 2, then 2 pipeline stages
        assert [json.loads(line)["completion_tokens"] for line in out.read_text().splitlines()] == want, out
    printed = results[len(runs) + 1][0][1].splitlines()[-1]
    assert printed == f"generated token ids: {hf_seq2seq_generate(work['bart'], PROMPTS[1:], NEW)[0]}", printed
    for (family, *_), (_, metrics_file) in zip(runs, configs):
        steps = [r for r in read_metrics(metrics_file) if "event" not in r]
        assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
        for r, ref in zip(steps, hf_losses(work, family)):
            assert abs(r["loss"] - ref) <= 1e-5 * abs(ref), (family, r["loss"], ref)


def test_seq2seq_formats_read_the_same_pairs(tmp_path):
    (tmp_path / "a.tsv").write_text("def f(): pass\tfunction\nx = 1\twith\ttabs\tassignment\n")
    (tmp_path / "b.jsonl").write_text('{"source": "def f(): pass", "target": "function"}\n\n'
                                      '{"input": "x = 1\\twith\\ttabs", "output": "assignment"}\n')
    (tmp_path / "c.json").write_text('[{"instruction": "Name it", "input": "def f(): pass", "output": "function"},'
                                     ' {"instruction": "x = 1\\twith\\ttabs", "output": "assignment"}]')
    want = [("def f(): pass", "function"), ("x = 1\twith\ttabs", "assignment")]
    assert read_pairs(str(tmp_path / "a.tsv")) == want
    assert read_pairs(str(tmp_path / "b.jsonl")) == want
    assert read_pairs(str(tmp_path / "c.json")) == [("Name it\n\ndef f(): pass", "function"), want[1]]
    (tmp_path / "d.jsonl").write_text('{"source": "a", "target": "b"}\n{"text": "a"}\n')
    with pytest.raises(DataError, match=r"d.jsonl:2: a record with fields \['text'\] fits no format"):
        read_pairs(str(tmp_path / "d.jsonl"))
    (tmp_path / "e.tsv").write_text("no tab here\n")
    with pytest.raises(DataError, match="e.tsv:1: missing tab between source and target"):
        read_pairs(str(tmp_path / "e.tsv"))


def test_pydoc_titles_are_the_topics_passages():
    for split in ("train", "dev", "test"):
        titles, topics = pydoc_titles_dataset(split), pydoc_topics_dataset(split)[0]
        assert [s for s, _ in titles] == [s for s, _ in topics]
    assert {t for _, t in pydoc_titles_dataset("train")} >= {"assert", "string methods", "for"}


def test_an_encoder_decoder_stage_split_counts_both_stacks():
    from galaxy.plan import Plan, Workload
    work = Workload(heads=4, kv_heads=4, columns=128, layers=4, tokens=24, target_tokens=8)
    assert Plan(pp=2, microbatches=2, stages=(1, 3)).problems(2, work) == []
    assert Plan(pp=2, microbatches=2, stages=(2, 3)).problems(2, work) == [
        "stage_num_hidden_layers_list sums to 5 but the model has 4 layers (the encoder's, then the decoder's); "
        "make the entries add up to 4"]


def test_side_tuning_scripts_under_plans_and_pipelines_equal_serial(work):
    """finetune_t5_side.py (use_side) under the Galaxy plan at world 2, and finetune_pp_t5.py
    (use_side_only, a boundary inside the encoder) report their serial runs' losses, and the Galaxy
    run exports the serial run's side network (galaxy_peft.json + peft_model.safetensors)."""
    from safetensors.torch import load_file
    side = {"side_reduction_factor": 4}
    runs = [("finetune_t5_side.py", 1, dict(use_side=True, **side)),
            ("finetune_t5_side.py", 2, dict(use_side=True, **side, **GALAXY)),
            ("finetune_t5.py", 1, dict(use_side_only=True, **side)),
            ("finetune_pp_t5.py", 2, dict(use_side_only=True, **side, **PIPELINE))]
    configs = [write_config(work, "t5", "train.jsonl", f"side-{i}", export_dir=str(work["tmp"] / f"side-{i}"), **extra)
               for i, (_, _, extra) in enumerate(runs)]
    results = run_scripts([(script, config, world) for (script, world, _), (config, _) in zip(runs, configs)])
    for (script, *_), outcome in zip(runs, results):
        for rank, (code, out, err) in enumerate(outcome):
            assert code == 0, f"{script} rank {rank} exited {code}:\n{out}\n{err}"
    losses = [[r["loss"] for r in read_metrics(metrics) if "event" not in r] for _, metrics in configs]
    for serial, parallel in ((0, 1), (2, 3)):
        assert len(losses[parallel]) == STEPS
        assert max(abs(a - b) / abs(b) for a, b in zip(losses[parallel], losses[serial])) < 1e-5, losses
    serial, galaxy = (load_file(str(work["tmp"] / f"side-{i}" / "peft_model.safetensors")) for i in (0, 1))
    assert set(serial) == set(galaxy) and any(k.startswith("side.decoder.") for k in serial)
    assert max(((galaxy[k] - t).abs().max() / t.abs().max().clamp_min(1e-3)).item() for k, t in serial.items()) < 1e-5


def test_generating_with_a_side_tuned_encoder_decoder_is_refused(work, capsys):
    """Side-tuning has no cache and is refused, as for the other families: one line, exit 2,
    before any process group (--check)."""
    from galaxy import launch
    from galaxy.inference.generate_job import add_generate_arguments, prepare_generate, run_generate
    for method in ("use_side", "use_side_only"):
        config, _ = write_config(work, "t5", "train.jsonl", **{method: True})
        with pytest.raises(SystemExit) as e:
            launch.main(preset="galaxy", train_fn=run_generate, script="generate.py", prepare_fn=prepare_generate,
                        add_arguments=add_generate_arguments,
                        argv=["--config_file", config, "--world", "2", "--rank", "0", "--prompt", "x", "--check"])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        what = method[4:].replace("_", "-")
        assert err == (f"generate.py: error: {what}-tuning runs its side network over whole sequences and has no "
                       "KV cache; generate with use_lora, use_adapter or full weights"), err


CLASSES = ["a", "b", "c"]


def classifier_folder(work, family):
    """HF's ...ForSequenceClassification of the tiny model (its backbone, a head HF draws), saved
    with the tiny tokenizer: what both the script and the reference start from."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    path = str(work["tmp"] / f"{family}_cls")
    torch.manual_seed(5)
    AutoModelForSequenceClassification.from_pretrained(work[family], num_labels=len(CLASSES)).save_pretrained(path)
    AutoTokenizer.from_pretrained(work[family]).save_pretrained(path)
    return path


def hf_classifier_losses(model_dir, texts, labels):
    """HF's classifier (eval mode) trained with SGD on the script's batches; and the model."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        enc = tok(texts[rows], padding="max_length", truncation=True, max_length=PAD, return_tensors="pt")
        loss = model(**enc, labels=torch.tensor(labels[rows])).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model, tok


def test_classifier_scripts_report_hf_losses_and_export(work):
    """task: classification: T5 under the Galaxy plan at world 2 (the decoder's 24 tokens split
    11 / 13), BART serially, 3 SGD steps of 8 rows of 3 classes: the losses of HF's classifiers
    on the same batches; the T5 export loads in T5ForSequenceClassification with HF's weights."""
    texts = [s for s, _ in work["pairs"]]
    labels = [i % len(CLASSES) for i in range(len(texts))]
    (work["tmp"] / "cls.tsv").write_text("".join(f"{t}\t{CLASSES[y]}\n" for t, y in zip(texts, labels)))
    plan = {**GALAXY, "decoder_seq_scatter_list": [11, 13]}
    runs = [("t5", "finetune_t5.py", 2, plan), ("bart", "finetune_bart.py", 1, {})]
    folders = {family: classifier_folder(work, family) for family, *_ in runs}
    configs = []
    for family, _, _, extra in runs:
        config, _ = write_config(work, family, "cls.tsv", **extra, task="classification", class_list=CLASSES,
                                       export_dir=str(work["tmp"] / f"{family}_cls_export"))
        cfg = json.loads(open(config).read())
        metrics = str(work["tmp"] / f"{family}_cls.jsonl")
        cfg.update(model_path=folders[family], metrics_file=metrics)
        del cfg["target_pad_size"]
        open(config, "w").write(json.dumps(cfg))
        configs.append((config, metrics))
    results = run_scripts([(script, config, world) for (_, script, world, _), (config, _) in zip(runs, configs)])
    for (family, *_), (_, metrics_file), outcome in zip(runs, configs, results):
        for rank, (code, out, err) in enumerate(outcome):
            assert code == 0, f"{family} rank {rank} exited {code}:\n{out}\n{err}"
        steps = [r for r in read_metrics(metrics_file) if "event" not in r]
        want, model, tok = hf_classifier_losses(folders[family], texts, labels)
        for r, ref in zip(steps, want):
            assert abs(r["loss"] - ref) <= 1e-5 * abs(ref), (family, r["loss"], ref)
        assert len(steps) == STEPS
        from transformers import AutoModelForSequenceClassification
        exported = AutoModelForSequenceClassification.from_pretrained(str(work["tmp"] / f"{family}_cls_export"))
        enc = tok(texts[:4], padding="max_length", truncation=True, max_length=PAD, return_tensors="pt")
        with torch.no_grad():
            got, ref = exported.eval()(**enc).logits, model(**enc).logits
        assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5, family
        assert exported.config.id2label == dict(enumerate(CLASSES))
