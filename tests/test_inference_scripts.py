"""generate.py and --predict, run as users run them.

generate.py under the Galaxy plan at world 2 (uneven shares; for the greedy tokens, the plan
plan.py search --objective latency wrote) writes one JSON line per prompt, in input order, whose
tokens are Hugging Face generate's greedy ones, alone or in the chat template, or with --num_beams
its best beams;
a stop string cuts the text; bad input is one line and exit status 2 before any process group.
pretrain_galaxy.py --predict at world 2 (under the plan plan.py search --objective latency wrote for
the classifier) writes Hugging Face's class probabilities and the accuracy; "train": false predicts
the test set with pretrain_bert.py.
"""
import json

import pytest
import torch

from support.generation_runners import hf_generate
from support.script_runner import run_script, run_scripts
from support.tiny_models import make_tiny_bert_with_minilm_tokenizer

from galaxy.planner import cli as plan_cli


PAD, NEW = 24, 8
PROMPTS = ["The for statement is used to", "Lists", "A class definition defines"]
GALAXY = dict(att_parallel_method="TP", con_parallel_method="SP", mlp_parallel_method="TP",
              tp_num_attention_heads_list=[2, 2], tp_intermediate_size_list=[200, 144], seq_scatter_list=[14, 10])
CLASSES = ["a", "b", "c"]


@pytest.fixture(scope="module")
def lm(tmp_path_factory, sharp_lm):
    tmp = tmp_path_factory.mktemp("gen_script")
    path = sharp_lm("llama")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return dict(tmp=tmp, model_dir=path, prompts=str(prompts))


def config(job, name, **keys) -> str:
    path = job["tmp"] / f"{name}.json"
    path.write_text(json.dumps(dict(model_path=job["model_dir"], pad_size=PAD, batch_size=2, timeout_s=60, **keys)))
    return str(path)


def read_jsonl(path):
    return [json.loads(line) for line in open(path)]


def latency_planned(job) -> str:
    """plan.py search --objective latency's config for two devices at speeds 2:1 (synthetic profile)
    and the model's own profile: a plan with uneven shares, the quicker rank taking more."""
    tmp, base = job["tmp"], config(job, "latency-base")
    devices = tmp / "devices.json"
    devices.write_text(json.dumps({"format": "galaxy-devices", "version": 1, "link": {"latency_s": 1e-5,
                                   "bytes_per_s": 1e9}, "devices": [{"name": f"dev{i}", "gemm_flops_per_s": rate,
                                                                    "memory_mib": 4000} for i, rate in enumerate((2e9, 1e9))]}))
    out = str(tmp / "latency.json")
    plan_cli.main(["profile-model", "--config_file", base, "--out", str(tmp / "model.json")])
    plan_cli.main(["search", "--objective", "latency", "--config_file", base, "--devices", str(devices), "--model",
                   str(tmp / "model.json"), "--new_tokens", str(NEW), "--out", out, "--json", str(tmp / "plans.json")])
    planned = json.loads(open(out).read())
    best = json.loads((tmp / "plans.json").read_text())["plans"][0]        # --json: training's fields and the parts
    assert best["keys"] == {k: planned[k] for k in best["keys"]}
    assert best["predicted_step_s"] == pytest.approx(best["prefill_s"] + (NEW - 1) * best["decode_s_per_token"],
                                                     abs=1e-6)   # (predicted_step_s: 6 decimals)
    splits = [planned[k] for k in ("tp_num_attention_heads_list", "tp_intermediate_size_list", "seq_scatter_list")
              if k in planned]
    assert planned["dp_deg"] == 1 and planned["_planned"]["objective"] == "latency", planned
    assert splits and all(s[0] >= s[1] for s in splits) and any(s[0] > s[1] for s in splits), planned
    return out


def test_generate_writes_hf_greedy_tokens_in_order(lm):
    """Under the plan plan.py search --objective latency wrote (uneven shares at world 2)."""
    out = lm["tmp"] / "out.jsonl"
    run_script("generate.py", latency_planned(lm), 2, "--prompts", lm["prompts"], "--out", str(out),
               "--max_new_tokens", str(NEW))
    records = read_jsonl(out)
    want = [hf_generate("llama", lm["model_dir"], [p], NEW)[0] for p in PROMPTS]
    assert [r["prompt"] for r in records] == PROMPTS
    assert [r["completion_tokens"] for r in records] == want
    for r in records:
        assert r["finish_reason"] == ("stop" if len(r["completion_tokens"]) < NEW else "length")


def test_generate_num_beams_writes_hf_best_beams(lm):
    """--num_beams 3 --length_penalty 2 --early_stopping true under the Galaxy plan at world 2, two
    prompts a batch (6 beam rows): each line holds Hugging Face's best beam for its prompt."""
    out = lm["tmp"] / "beams.jsonl"
    run_script("generate.py", config(lm, "galaxy", **GALAXY), 2, "--prompts", lm["prompts"], "--out", str(out),
               "--max_new_tokens", str(NEW), "--num_beams", "3", "--length_penalty", "2", "--early_stopping", "true")
    want = [hf_generate("llama", lm["model_dir"], [p], NEW, num_beams=3, length_penalty=2.0, early_stopping=True)[0]
            for p in PROMPTS]
    assert want != [hf_generate("llama", lm["model_dir"], [p], NEW)[0] for p in PROMPTS]
    assert [r["completion_tokens"] for r in read_jsonl(out)] == want


def test_chat_template_and_stop_string(lm):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(lm["model_dir"])
    chat = "### Human: Lists\n### Assistant: "               # galaxy's template: the tokenizer has none
    want = hf_generate("llama", lm["model_dir"], [chat], NEW)[0]
    out = json.loads(run_script("generate.py", config(lm, "serial"), 1, "--prompt", "Lists", "--chat",
                                "--max_new_tokens", str(NEW))[0].splitlines()[0])
    assert out["completion_tokens"] == want and out["prompt"] == "Lists"
    text = tok.decode(want, skip_special_tokens=True)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    out = json.loads(run_script("generate.py", config(lm, "serial"), 1, "--prompt", "Lists", "--chat", "--stop",
                                stop, "--max_new_tokens", str(NEW))[0].splitlines()[0])
    assert out["finish_reason"] == "stop" and out["completion"] == text[:text.index(stop)]
    assert out["completion_tokens"] == want[:len(out["completion_tokens"])]


BAD = [
    ("generate.py", ("--prompts", "missing.jsonl"), "missing.jsonl: no such file"),
    ("generate.py", ("--prompt", "x", "--prompts", "y"), "give exactly one of --prompt TEXT and --prompts FILE"),
    ("generate.py", ("--prompt", "word " * 30), "more than the 24 of pad_size"),
    ("generate.py", ("--prompt", "x", "--max_new_tokens", "600"), "exceed the model's 512 positions"),
    ("generate.py", ("--prompt", "x", "--top_p", "0"), "--top_p must be in (0, 1]"),
    ("generate.py", ("--prompt", "x", "--num_beams", "2", "--temperature", "0.7"),
     "--num_beams 2 searches beams without sampling (Hugging Face's do_sample=False): drop --temperature"),
    ("generate.py", ("--prompt", "x", "--num_beams", "3", "--stop", "y"), "--stop is not applied under beam search"),
    ("generate.py", ("--prompt", "x", "--length_penalty", "2"), "--length_penalty and --early_stopping apply to beam"),
    ("serve.py", ("--port", "0"), "--port must be 1..65535, got 0"),
]


def test_bad_input_is_one_line_exit_2(lm):
    """Each mistake stops every rank before the rendezvous (no peer is waited for); a prompt in
    chunks under a plan whose CON splits tokens too."""
    cfg, chunked = config(lm, "bad", **GALAXY), config(lm, "chunked", **GALAXY, prefill_chunks=2)
    bad = BAD + [("generate.py", ("--prompt", "x"), "prefill_chunks 2 cuts the prompt into chunks, but an SP "
                                                     "sub-block splits every pass's tokens")]
    outcomes = run_scripts([(script, chunked if i == len(BAD) else cfg, 2, *extra)
                            for i, (script, extra, _) in enumerate(bad)], timeout=120)
    for (script, extra, line), ranks in zip(bad, outcomes):
        for code, out, err in ranks:
            assert code == 2 and line in err and len(err.strip().splitlines()) == 1, (script, extra, code, out, err)


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("predict")
    model_dir = str(tmp / "model")
    make_tiny_bert_with_minilm_tokenizer(model_dir, len(CLASSES))
    rows = [("for loops iterate over items", "a"), ("the class statement defines", "b"), ("names bind", "c"),
            ("an expression is evaluated", "b"), ("lambda", "a")]
    inputs = tmp / "inputs.tsv"
    inputs.write_text("".join(f"{t}\t{y}\n" for t, y in rows))
    return dict(tmp=tmp, model_dir=model_dir, inputs=str(inputs), rows=rows)


def hf_probabilities(bert):
    from transformers import AutoTokenizer, BertForSequenceClassification
    model = BertForSequenceClassification.from_pretrained(bert["model_dir"]).eval()
    tok = AutoTokenizer.from_pretrained(bert["model_dir"])
    enc = tok([t for t, _ in bert["rows"]], padding="max_length", truncation=True, max_length=16, return_tensors="pt")
    with torch.no_grad():
        return torch.softmax(model(**enc).logits, -1)


def classifier_planned(bert, capsys) -> str:
    """plan.py search --objective latency's config for the classifier on two devices at speeds 2:1
    (synthetic profile) and the model's own profile: one forward a request, uneven shares."""
    tmp, base = bert["tmp"], bert["tmp"] / "base.json"
    base.write_text(json.dumps(dict(model_path=bert["model_dir"], class_list=CLASSES, pad_size=16, batch_size=2,
                                    dropout=0.0, timeout_s=60)))
    devices = tmp / "devices.json"
    devices.write_text(json.dumps({"format": "galaxy-devices", "version": 1, "link": {"latency_s": 1e-5,
                                   "bytes_per_s": 1e9}, "devices": [{"name": f"dev{i}", "gemm_flops_per_s": rate,
                                                                    "memory_mib": 4000} for i, rate in enumerate((2e9, 1e9))]}))
    out = str(tmp / "latency.json")
    plan_cli.main(["profile-model", "--config_file", str(base), "--out", str(tmp / "model.json")])
    plan_cli.main(["search", "--objective", "latency", "--config_file", str(base), "--devices", str(devices), "--model",
                   str(tmp / "model.json"), "--out", out])
    assert f"classify with: python pretrain_galaxy.py --config_file {out} --world 2" in capsys.readouterr().out
    planned = json.loads(open(out).read())
    splits = [planned[k] for k in ("tp_num_attention_heads_list", "tp_intermediate_size_list", "seq_scatter_list")
              if k in planned]
    assert planned["_planned"]["task"] == "classification" and planned["_planned"]["new_tokens"] == 0, planned
    assert splits and all(s[0] >= s[1] for s in splits) and any(s[0] > s[1] for s in splits), planned
    return out


def test_predict_writes_hf_probabilities_and_accuracy(bert, capsys):
    """Under the plan plan.py search --objective latency wrote for the classifier (uneven shares at world 2)."""
    out = bert["tmp"] / "predictions.jsonl"
    (code, _, err), _ = run_scripts([("pretrain_galaxy.py", classifier_planned(bert, capsys), 2, "--predict",
                                      bert["inputs"], "--out", str(out))])[0]
    assert code == 0, err
    records, want = read_jsonl(out), hf_probabilities(bert)
    assert [r["text"] for r in records] == [t for t, _ in bert["rows"]]
    assert torch.allclose(torch.tensor([r["probabilities"] for r in records]), want, atol=1e-5)
    assert [r["label"] for r in records] == [CLASSES[i] for i in want.argmax(-1).tolist()]
    right = sum(r["label"] == y for r, (_, y) in zip(records, bert["rows"]))
    assert f"accuracy {right / 5:.4f} ({right} of 5)" in err


def test_train_false_predicts_the_test_set(bert):
    cfg = bert["tmp"] / "no_train.json"
    cfg.write_text(json.dumps(dict(model_path=bert["model_dir"], class_list=CLASSES, train_path=bert["inputs"],
                                   test_path=bert["inputs"], pad_size=16, batch_size=2, train=False)))
    out = run_script("pretrain_bert.py", str(cfg), 1)[0]
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(records) == 5 and torch.allclose(torch.tensor([r["probabilities"] for r in records]),
                                                hf_probabilities(bert), atol=1e-5)
