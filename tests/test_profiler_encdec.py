"""The profiler on the encoder-decoders (BART; T5 v1.0 and gated v1.1), against their closed forms
(galaxy.models.encdec_forms through the registry's matmul_flops and plan_comm_bytes).

Serial: FlopCounterMode's count of galaxy's model (forward and backward) equals the closed form
exactly, on source rows of 12 tokens and target rows of 9, per sub-block too (a decoder layer's
ATT over T x T, XATT with Q from T tokens and K/V from the S source tokens); Hugging Face's own
BartForConditionalGeneration counts the same; profile_flops.py --model t5 says "exact".
World 2 (uneven heads 3 / 1, columns 64 / 32, source tokens 7 / 5, target tokens 4 / 5): BART
and T5 under the 8 ATT x MLP x CON plans, each with the XATT method of the 2^(4-1) design the
parity tests use, T5 v1.1 under two of them; T5 at world 3 under three plans. Every rank's bytes
per collective kind equal the closed form; each sub-block's FLOPs summed over the ranks equal
the serial count, except an SP XATT's K/V projections, which every rank computes from the whole
memory.
"""
import itertools
import json
from argparse import Namespace
from dataclasses import replace

import pytest
import torch.distributed as dist

from support.script_runner import run_script
from support.tiny_models import TINY_SEQ, TINY_TARGET, tiny_encdec_cls_batch, tiny_seq2seq_batch

from galaxy.distributed.group import GalaxyGroup
from galaxy.models.build import load_hf_config
from galaxy.models.registry import FAMILIES
from galaxy.parallel.grad_sync import GradientSync
from galaxy.plan import Plan
from galaxy.profiler import profile_model
from galaxy.runtime.assemble import build_model

B = 3
SHARES = {   # heads, MLP columns, source tokens, target tokens
    2: ((3, 1), (64, 32), (7, 5), (4, 5)),
    3: ((2, 1, 1), (40, 32, 24), (5, 4, 3), (2, 4, 3)),
}


def xatt_of(att, mlp, con):
    return "TP" if (att == mlp) == (con == "SP") else "SP"


COMBOS = [Plan(a, m, c, xatt=xatt_of(a, m, c)) for a, m, c in itertools.product(("TP", "SP"), ("TP", "SP"),
                                                                                 ("SP", "None"))]
WORLD3 = [Plan("TP", "TP", "SP", xatt="TP"), Plan("SP", "SP", "SP", xatt="SP"), Plan("TP", "SP", "None", xatt="SP")]
FAMILY_DIRS = {"bart": dict(family="bart"), "t5": dict(family="t5"), "t5-v1.1": dict(family="t5", v1_1=True)}


@pytest.fixture(scope="module")
def model_dir(tiny_lm_dir):
    return lambda name: tiny_lm_dir(**FAMILY_DIRS[name])


def family_of_name(name: str) -> str:
    return FAMILY_DIRS[name]["family"]


def serial_parts(model_dir):
    cfg = load_hf_config(model_dir)
    return FAMILIES[cfg.model_type].matmul_flops(cfg, B, TINY_SEQ, target=TINY_TARGET)


def per_layer_flops(parts, cfg):
    """{(layer, sub-block): forward FLOPs} of the serial model, from the closed form's parts."""
    enc = cfg.encoder_layers if cfg.model_type == "bart" else cfg.num_layers
    dec = cfg.decoder_layers if cfg.model_type == "bart" else cfg.num_decoder_layers
    out = {}
    for i in range(enc):
        out[i, "att"] = (parts["encoder_qkv"] + parts["encoder_attention"] + parts["encoder_out"]) // enc
        out[i, "mlp"] = parts["encoder_mlp"] // enc
    for i in range(enc, enc + dec):
        out[i, "att"] = (parts["decoder_qkv"] + parts["decoder_attention"] + parts["decoder_out"]) // dec
        out[i, "xatt"] = (parts["cross_q"] + parts["cross_kv"] + parts["cross_attention"] + parts["cross_out"]) // dec
        out[i, "mlp"] = parts["decoder_mlp"] // dec
    return out


@pytest.mark.parametrize("name", list(FAMILY_DIRS))
def test_serial_matches_closed_form(model_dir, name):
    path = model_dir(name)
    cfg = load_hf_config(path)
    model = build_model(path, Plan(), GalaxyGroup.serial(4, 96, TINY_SEQ), dropout=0.0)
    report = profile_model(model, tiny_seq2seq_batch(0, batch=B), repeats=0)
    parts = serial_parts(path)
    assert report.totals.fwd_flops == parts["total"]
    assert report.totals.bwd_flops == 2 * parts["total"]
    expected = per_layer_flops(parts, cfg)
    subs = {(s.layer, s.name): s for s in report.sub_blocks}
    assert [s.name for s in report.sub_blocks if s.layer == 2] == ["att", "con1", "xatt", "conx", "mlp", "con2"]
    for key, s in subs.items():
        assert (s.fwd_flops, s.bwd_flops) == (expected.get(key, 0), 2 * expected.get(key, 0)), key
    # the rest is the LM head's (its weight applied by the model: the tied table's F.linear)
    assert report.totals.fwd_flops - sum(s.fwd_flops for s in report.sub_blocks) == parts["lm_head"]
    assert parts["lm_head"] == 2 * B * TINY_TARGET * 48 * cfg.vocab_size


def test_hugging_face_bart_counts_the_same(model_dir):
    """The closed form against transformers' own model (sdpa attention) on the same batch."""
    from transformers import BartForConditionalGeneration
    hf = BartForConditionalGeneration.from_pretrained(model_dir("bart"), attn_implementation="sdpa")
    report = profile_model(hf, tiny_seq2seq_batch(0, batch=B), repeats=0)
    assert report.totals.fwd_flops == serial_parts(model_dir("bart"))["total"]


def test_classifier_matches_closed_form(model_dir):
    """BART's classifier: its decoder reads the source (T = S), its head one token per row."""
    path = model_dir("bart")
    cfg = load_hf_config(path)
    model = build_model(path, Plan(), GalaxyGroup.serial(4, 96, TINY_SEQ), dropout=0.0, task="classification",
                        num_labels=3)
    report = profile_model(model, tiny_encdec_cls_batch(0, batch=B), repeats=0)
    cls = FAMILIES["bart"].matmul_flops(cfg, B, TINY_SEQ, 3, target=TINY_TARGET)
    lm = FAMILIES["bart"].matmul_flops(cfg, B, TINY_SEQ, target=TINY_SEQ)
    assert (report.totals.fwd_flops, report.totals.bwd_flops) == (cls["total"], 2 * cls["total"])
    assert cls["total"] - cls["classifier"] == lm["total"] - lm["lm_head"]
    assert cls["classifier"] == 2 * B * 48 * 48 + 2 * B * 48 * 3


def test_classifier_comm_world2(dist_pool, model_dir):
    """The classifier under CON SP (the pooled tokens' [b, h] all-reduce) and CON None, world 2."""
    path, plans = model_dir("bart"), [COMBOS[0], COMBOS[3]]
    shares = (*SHARES[2][:3], SHARES[2][2])          # the decoder reads the source: its shares too
    ranks = dist_pool(2).run(profile_rank, path, plans, shares, True)
    cfg = load_hf_config(path)
    for p, plan in enumerate(plans):
        resolved = Plan(plan.att, plan.mlp, plan.con, xatt=plan.xatt, tokens=shares[2], decoder_tokens=shares[3])
        expected = FAMILIES["bart"].plan_comm_bytes(resolved, cfg, B, shares[2], num_labels=3)
        lm_head = FAMILIES["bart"].plan_comm_bytes(resolved, cfg, B, shares[2])
        assert expected and (expected != lm_head) == (plan.con == "SP")      # the heads differ at a CON SP exit
        for rank, reports in enumerate(ranks):
            assert reports[p].comm["by_kind"] == expected, (plan, rank)


def test_profile_flops_follows_the_config_task(tmp_path, model_dir):
    """A BART config with "task": "classification" profiles the classifier the trainer builds."""
    from galaxy.config import load_config
    from galaxy.profiler.cli import closed_form_flops, prepare
    config = tmp_path / "classify.json"
    config.write_text(json.dumps(dict(model_path=model_dir("bart"), task="classification", pad_size=TINY_SEQ,
                                      batch_size=B, class_list=["a", "b", "c"])))
    job = prepare(load_config(str(config)), Namespace(model="bart", compare_deepspeed=False, repeats=1, warmup=0,
                                                      depth=1))
    assert (job.task_kind, job.num_labels) == ("classification", 3)
    cfg = load_hf_config(model_dir("bart"))
    assert closed_form_flops(job) == FAMILIES["bart"].matmul_flops(cfg, B, TINY_SEQ, 3)["total"]


def profile_rank(model_dir, plans, shares, classify=False):
    """classify: the 3-class classifier (its decoder reads the source: target shares = source's)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = GalaxyGroup(rank, world, dist.group.WORLD, *shares)
    batch = tiny_encdec_cls_batch(0, batch=B) if classify else tiny_seq2seq_batch(0, batch=B)
    task = dict(task="classification", num_labels=3) if classify else {}
    reports = []
    for plan in plans:
        model = build_model(model_dir, plan, group, dropout=0.0, **task)
        reports.append(profile_model(model, batch, grad_sync=GradientSync(model, group.pg), repeats=0))
    return reports


def check(ranks, model_dir, plans, shares):
    cfg = load_hf_config(model_dir)
    comm = FAMILIES[cfg.model_type].plan_comm_bytes
    serial = per_layer_flops(serial_parts(model_dir), cfg)
    parts = serial_parts(model_dir)
    dec = len([k for k in serial if k[1] == "xatt"])
    for p, plan in enumerate(plans):
        resolved = replace(plan, tokens=shares[2], decoder_tokens=shares[3])
        expected = comm(resolved, cfg, B, shares[2], comm_chunks=plan.comm_chunks)
        assert expected
        for rank, reports in enumerate(ranks):
            assert reports[p].comm["by_kind"] == expected, (plan, rank)
        if plan.comm_chunks > 1:      # a chunked ATT runs its projections outside its forward: the layer's row has them
            continue
        for key, flops in serial.items():
            total = sum(next(s.fwd_flops for s in reports[p].sub_blocks if (s.layer, s.name) == key)
                        for reports in ranks)
            if key[1] == "xatt" and plan.xatt == "SP":     # each rank projects K/V from the whole memory
                flops += (len(ranks) - 1) * parts["cross_kv"] // dec
            assert total == flops, (plan, key)


@pytest.mark.parametrize("name", ["bart", "t5"])
def test_world2_uneven_comm_matches_closed_form(dist_pool, model_dir, name):
    path = model_dir(name)
    check(dist_pool(2).run(profile_rank, path, COMBOS, SHARES[2]), path, COMBOS, SHARES[2])


def test_world2_t5_v1_1_comm(dist_pool, model_dir):
    """Gated MLP (3 [h, I] weights summed under MLP SP), untied LM head: two plans, the Galaxy
    plan's TP ATT and MLP in 2 chunks of the sequence each (XATT's transitions are not chunked)."""
    path, plans = model_dir("t5-v1.1"), [replace(COMBOS[0], comm_chunks=2), COMBOS[4]]
    check(dist_pool(2).run(profile_rank, path, plans, SHARES[2]), path, plans, SHARES[2])


@pytest.mark.parametrize("name", ["t5"])
def test_world3_comm_matches_closed_form(dist_pool, model_dir, name):
    path = model_dir(name)
    check(dist_pool(3).run(profile_rank, path, WORLD3, SHARES[3]), path, WORLD3, SHARES[3])


def test_profile_flops_t5_says_exact(tmp_path, model_dir):
    """profile_flops.py --model t5 on a config with target_pad_size: the closed-form line says exact."""
    config = tmp_path / "profile.json"
    config.write_text(json.dumps(dict(model_path=model_dir("t5"), pad_size=TINY_SEQ, target_pad_size=TINY_TARGET,
                                      batch_size=B)))
    out = tmp_path / "report.json"
    # on a command driver (support.script_runner): run as `python profile_flops.py ...`, torch imported once
    stdout, = run_script("profile_flops.py", str(config), 1, "--model", "t5", "--json", str(out), "--repeats", "1",
                         "--warmup", "0", "--depth", "1")
    assert "(exact)" in stdout and "XATT (xatt)" in stdout
    doc = json.loads(out.read_text())
    assert doc["closed_form"]["fwd_flops"] == doc["totals"]["fwd_flops"] == serial_parts(model_dir("t5"))["total"]
