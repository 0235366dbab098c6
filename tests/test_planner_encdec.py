"""plan.py profile-model on the encoder-decoders (BART, T5): the version-2 model profile, one
section per stack, checked against Hugging Face's own models (parameters), the closed forms of
galaxy.models.encdec_forms (FLOPs), galaxy.profiler's count of the whole layers (activation bytes)
and the bench at shares the linear forms were not fitted on; under each PEFT method against
galaxy's own model; the cost model by hand and the search against a brute force over pipelines."""
import json

import pytest
import torch
from transformers import AutoConfig, BartForConditionalGeneration, T5ForConditionalGeneration

from test_entry_scripts_encdec import work  # noqa: F401  (the module fixture: tiny T5 and BART with data)

from galaxy.planner import cli
from galaxy.planner.encdec_bench import EncDecBench
from galaxy.planner.model_profile import ModelProfileError, check_model_profile

SOURCE, TARGET = 12, 6
HF_CLASS = {"bart": BartForConditionalGeneration, "t5": T5ForConditionalGeneration}


@pytest.fixture(scope="module")
def profiles(tmp_path_factory, tiny_lm_dir):
    """family -> (model folder, the profile-model document at SOURCE / TARGET tokens)."""
    out = {}
    for family in ("bart", "t5"):
        folder = tmp_path_factory.mktemp(family)
        model_path = tiny_lm_dir(family)
        base = folder / "base.json"
        base.write_text(json.dumps(dict(model_path=model_path, pad_size=SOURCE, target_pad_size=TARGET,
                                        batch_size=3)))
        cli.main(["profile-model", "--config_file", str(base), "--out", str(folder / "model.json")])
        out[family] = (model_path, json.loads((folder / "model.json").read_text()))
    return out


def _hf_model(model_path, family):
    torch.manual_seed(0)
    return HF_CLASS[family](AutoConfig.from_pretrained(model_path)).eval()


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_parameters_equal_hugging_faces_model(profiles, family):
    """Each stack's layer, each sub-block whole and per head / column, and the whole model, as
    Hugging Face's classes hold them (BART's final_logits_bias is a buffer there, a frozen
    parameter here)."""
    model_path, doc = profiles[family]
    hf = _hf_model(model_path, family)
    stacks = {"encoder": hf.get_encoder(), "decoder": hf.get_decoder()}
    for name, stack in stacks.items():
        section = doc["stacks"][name]
        layers = stack.layers if family == "bart" else stack.block
        assert section["layers"] == len(layers)
        if family == "bart":
            att, xatt = layers[0].self_attn, getattr(layers[0], "encoder_attn", None)
            mlp = (layers[0].fc1, layers[0].fc2)
            out_bias = att.out_proj.bias.numel()
        else:
            att, xatt = layers[0].layer[0].SelfAttention, (layers[0].layer[1].EncDecAttention if name == "decoder"
                                                          else None)
            mlp = (layers[0].layer[-1].DenseReluDense,)
            out_bias = 0
        heads = doc["hf_config"].get("encoder_attention_heads") or doc["hf_config"]["num_heads"]
        att_whole = _numel(att) - (att.relative_attention_bias.weight.numel()
                                   if getattr(att, "has_relative_attention_bias", False) else 0)
        # a head's q, k, v rows and out columns; the out bias is whole on every rank
        assert section["params"]["att_tp"] == [out_bias, (att_whole - out_bias) / heads]
        assert section["params"]["att_sp"] == att_whole
        columns = section["units"]["mlp_tp"][0]
        mlp_whole = sum(_numel(m) for m in mlp)
        mlp_bias = layers[0].fc2.bias.numel() if family == "bart" else 0
        assert section["params"]["mlp_tp"] == [mlp_bias, (mlp_whole - mlp_bias) / columns]
        if xatt is not None:
            assert section["params"]["xatt_tp"] == [out_bias, (_numel(xatt) - out_bias) / heads]
        # T5's position bias table sits in Hugging Face's first layer, in galaxy beside the layers
        assert section["per_layer"] == _numel(layers[0]) - (_numel(att) - att_whole)
        p = section["params"]
        assert p["att_sp"] + p["mlp_sp"] + p["con"] + p.get("xatt_sp", 0) == section["per_layer"]
    frozen_bias = hf.final_logits_bias.numel() if family == "bart" else 0
    assert doc["params"]["total"] == hf.num_parameters() + frozen_bias


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_flops_per_sub_block_equal_the_closed_form_by_hand(profiles, family):
    """The profiler's count of one encoder and one decoder layer equals the closed form; the
    decoder's ATT runs on the T target tokens, its XATT's K/V on the S source tokens."""
    _, doc = profiles[family]
    assert doc["profiler"]["flops_match_closed_form"] is True
    hf = doc["hf_config"]
    h = hf.get("d_model")
    a = h if family == "bart" else hf["num_heads"] * hf["d_kv"]
    S, T = SOURCE, TARGET
    by_hand = {"encoder": 3 * 2 * S * h * a + 4 * S * S * a + 2 * S * a * h,
               "decoder": 3 * 2 * T * h * a + 4 * T * T * a + 2 * T * a * h}
    for stack, flops in by_hand.items():
        assert doc["stacks"][stack]["flops_per_row"]["att"]["fwd"] == flops
    xatt = 2 * T * h * a + 2 * 2 * S * h * a + 4 * T * S * a + 2 * T * a * h
    assert doc["stacks"]["decoder"]["flops_per_row"]["xatt"]["fwd"] == xatt
    assert doc["flops_per_row"]["head"]["fwd"] == 2 * T * h * hf["vocab_size"]


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_activation_bytes_are_linear_in_the_share(profiles, family):
    """The linear forms (fitted at half and all of each kind's units) give the bytes a fresh
    bench saves at one unit and at a third of the units, each kind of each stack."""
    model_path, doc = profiles[family]
    bench = EncDecBench(model_path, source=SOURCE, target=TARGET, seed=3)
    for stack, section in doc["stacks"].items():
        for kind, (c0, c1) in section["act_bytes_per_row"].items():
            total = section["units"][kind][0]
            for u in (1, max(1, total // 3)):
                measured = bench.saved_bytes(stack, kind, u, 2) / 2
                assert c0 + c1 * u == pytest.approx(measured, rel=1e-9), (stack, kind, u)


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_whole_layer_bytes_equal_the_profilers(profiles, family):
    """At the whole share, each sub-block saves what galaxy.profiler counts for it in the whole
    one-layer-per-stack model (one row), the bytes a layer's memory is costed from."""
    from galaxy.profiler.cli import synthetic_batch
    from galaxy.profiler.profile import profile_model as profiler_run

    model_path, doc = profiles[family]
    bench = EncDecBench(model_path, source=SOURCE, target=TARGET)
    batch = synthetic_batch("seq2seq", 1, SOURCE, doc["hf_config"]["vocab_size"], None, 0, "cpu", target=TARGET)
    report = profiler_run(bench.model, batch, repeats=0)
    counted = {(s.layer, s.name): s.act_bytes for s in report.sub_blocks}
    for layer, stack in enumerate(("encoder", "decoder")):
        section = doc["stacks"][stack]
        for name, kind in (("att", "att_tp"), ("mlp", "mlp_tp"), ("xatt", "xatt_tp")):
            if kind in section["act_bytes_per_row"]:
                c0, c1 = section["act_bytes_per_row"][kind]
                assert c0 + c1 * section["units"][kind][0] == pytest.approx(counted[(layer, name)], rel=1e-9), \
                    (stack, name)


def test_version_two_reads_and_search_refuses_what_it_cannot_cost(profiles, tmp_path, capsys):
    """check_model_profile reads the version-2 profile (and refuses one without a stack's
    section); search refuses, with one line and exit 2, a profile taken at another
    target_pad_size and more stages than devices."""
    model_path, doc = profiles["t5"]
    assert check_model_profile(doc, "t5.json") is doc
    broken = {**doc, "stacks": {"encoder": doc["stacks"]["encoder"]}}
    with pytest.raises(ModelProfileError, match="has no 'decoder' 'layers'"):
        check_model_profile(broken, "t5.json")
    model, devices = tmp_path / "model.json", tmp_path / "devices.json"
    model.write_text(json.dumps(doc))
    devices.write_text(json.dumps({"format": "galaxy-devices", "version": 1, "link": None, "devices": [
        {"name": "d", "memory_mib": 1000, "gemm_flops_per_s": 1e9}]}))
    cases = [(dict(target_pad_size=TARGET + 2), [], f"model profile {model} was taken for target_pad_size {TARGET}, "
              f"the config has {TARGET + 2}; run plan.py profile-model on this config"),
             (dict(target_pad_size=TARGET), ["--pp", "2"], "--pp 2 does not divide the world of 1 devices; give "
              "a divisor of 1")]
    for keys, extra, line in cases:
        base = tmp_path / "base.json"
        base.write_text(json.dumps(dict(model_path=model_path, pad_size=SOURCE, batch_size=3, **keys)))
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["search", "--config_file", str(base), "--devices", str(devices), "--model", str(model),
                      "--out", str(tmp_path / "planned.json"), *extra])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.strip() == f"plan.py search: error: {line}"


def test_search_refuses_a_profile_of_another_method(profiles, tmp_path, capsys):
    """A LoRA config searched with a profile taken for full fine-tuning: one line, exit 2."""
    model_path, doc = profiles["bart"]
    model, devices, base = tmp_path / "model.json", tmp_path / "devices.json", tmp_path / "lora.json"
    model.write_text(json.dumps(doc))
    devices.write_text(json.dumps({"format": "galaxy-devices", "version": 1, "link": None, "devices": [
        {"name": "d", "memory_mib": 1000, "gemm_flops_per_s": 1e9}]}))
    base.write_text(json.dumps(dict(model_path=model_path, pad_size=SOURCE, target_pad_size=TARGET, batch_size=3,
                                    use_lora=True)))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["search", "--config_file", str(base), "--devices", str(devices), "--model", str(model),
                  "--out", str(tmp_path / "planned.json")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"plan.py search: error: model profile {model} was taken for full fine-tuning, the config asks for LoRA r 8 "
        "on q_proj, v_proj; run plan.py profile-model on this config")


# --- the cost model (galaxy.planner.encdec_cost) -------------------------------------------------

def _device(rate):
    return {"name": f"{rate:g}", "gemm_flops_per_s": rate, "memory_mib": 1e6, "baseline_mib": 0.0,
            "optimizer_s_per_param": {"adamw": 0.0, "sgd": 0.0}}


def _flops(fwd, memory=0):
    return {"fwd": fwd, "bwd": 2 * fwd, "fwd_elementwise": 0, "bwd_elementwise": 0, **({"fwd_memory": memory}
                                                                                        if memory else {})}


def _synthetic(profiles):
    """The tiny BART's profile with hand-written FLOPs: ATT 6e6, MLP 9e6 (encoder), ATT 3e6, XATT
    5e6 of which 2e6 the memory's K/V, MLP 4e6 (decoder), head 1e6; CONs none."""
    _, doc = profiles["bart"]
    doc = json.loads(json.dumps(doc))
    doc["stacks"]["encoder"]["flops_per_row"] = {"att": _flops(6e6), "mlp": _flops(9e6), "con": _flops(0)}
    doc["stacks"]["decoder"]["flops_per_row"] = {"att": _flops(3e6), "xatt": _flops(5e6, 2e6), "mlp": _flops(4e6),
                                                 "con": _flops(0)}
    doc["flops_per_row"]["head"] = _flops(1e6)
    return doc


def _plan(**kw):
    from galaxy.plan import Plan
    return Plan(**{"att": "TP", "mlp": "TP", "con": "SP", "heads": (3, 1), "columns": (72, 24), "tokens": (9, 3),
                   "decoder_tokens": (3, 3), "xatt": "TP", "checkpoint": (), "stages": (4,), **kw})


def test_step_time_of_two_unequal_devices_by_hand(profiles):
    """Devices at 3e9 and 1e9 FLOP/s, a free link, 4 rows: heads 3:1 and columns 72:24 balance every
    TP sub-block (each takes its whole FLOPs / 4e9, backward twice the forward); the head on 3 + 3
    target tokens waits for the slow rank; under XATT SP the slow rank sets XATT's time too, the
    memory's K/V whole on both ranks."""
    from galaxy.planner.encdec_cost import EncDecCostModel
    from galaxy.planner.profiles import check_link

    free = check_link({"latency_s": 0.0, "bytes_per_s": 1e15}, "free")
    doc = _synthetic(profiles)
    cost = EncDecCostModel(doc, [_device(3e9), _device(1e9)], free, batch_size=4)
    rows, enc, dec = 4, 2, 2
    balanced = 3 * (enc * (6e6 + 9e6) + dec * (3e6 + 5e6 + 4e6)) * rows / 4e9   # forward and backward
    head = 3 * max(1e6 * 3 / 6 / 3e9, 1e6 * 3 / 6 / 1e9) * rows       # the head reads the decoder's 3 + 3 tokens
    est = cost.estimate(_plan())
    assert est.step_s - est.comm_s == pytest.approx(balanced + head, rel=1e-12)
    assert est.comm_s < 1e-9
    xatt_tp = 3 * dec * 5e6 * rows / 4e9
    xatt_sp = 3 * dec * (2e6 + 3e6 * 3 / 6) * rows / 1e9              # the slow rank's 3 queries
    est = cost.estimate(_plan(xatt="SP"))
    assert est.step_s - est.comm_s == pytest.approx(balanced - xatt_tp + xatt_sp + head, rel=1e-12)


def test_recomputation_adds_a_forward_and_keeps_the_carry(profiles):
    """Recomputing the first layer (the encoder's) adds its forward to the step and replaces its
    saved bytes by its input carry, plus one layer's while it is rebuilt."""
    from galaxy.planner.encdec_cost import EncDecCostModel
    from galaxy.planner.profiles import check_link

    free = check_link({"latency_s": 0.0, "bytes_per_s": 1e15}, "free")
    cost = EncDecCostModel(_synthetic(profiles), [_device(3e9), _device(1e9)], free, batch_size=4)
    plain, recomputed = cost.estimate(_plan()), cost.estimate(_plan(checkpoint=(0,)))
    extra = (recomputed.step_s - recomputed.comm_s) - (plain.step_s - plain.comm_s)
    assert extra == pytest.approx((6e6 + 9e6) * 4 / 4e9, rel=1e-12)
    k = cost.kinds(_plan(), 0)
    layer, _ = cost.layer_acts("encoder", k["encoder"])
    carry = cost.carry * 9 * cost.hidden * 4
    total_plain, _, none = cost.acts_per_row(_plan(), 0)
    total_ckpt, _, rebuilt = cost.acts_per_row(_plan(checkpoint=(0,)), 0)
    assert none == 0 and total_plain - total_ckpt == pytest.approx(layer - carry)
    assert rebuilt == max(layer, cost.layer_acts("decoder", k["decoder"])[0])


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_parameters_per_rank_equal_the_sharded_model(profiles, family):
    """Each rank's parameters under uneven TP shares equal a galaxy model whose every ATT, XATT
    and MLP (and T5's position bias tables) is sharded by its own shard_tp to that rank's heads
    and columns."""
    import copy

    from galaxy.models.build import load_hf_config, model_class
    from galaxy.models.registry import family_of
    from galaxy.planner.encdec_cost import EncDecCostModel

    model_path, doc = profiles[family]
    cost = EncDecCostModel(doc, [_device(1e9)] * 2, None, batch_size=4)
    hf = load_hf_config(model_path)
    with torch.device("meta"):
        whole = model_class(family_of(hf.model_type), "seq2seq")(hf)
    for xatt in ("TP", "SP"):
        plan = _plan(xatt=xatt)
        for j in range(2):
            model = copy.deepcopy(whole)
            for name in getattr(model, "att_params", ()):      # T5's position bias tables, as apply_plan splits them
                getattr(model, name).shard_tp(plan.heads, j)
            for layer in model.layers:
                layer.att.shard_tp(plan.heads, j)
                layer.mlp.shard_tp(plan.columns, j)
                if xatt == "TP" and hasattr(layer, "xatt"):
                    layer.xatt.shard_tp(plan.heads, j)
            held = sum(p.numel() for p in model.parameters())
            assert cost.params_of(plan, j) == held, (xatt, j)


def test_bytes_sent_are_the_closed_forms(profiles):
    """A rank's bytes a step are the family's closed form (galaxy.models.encdec_forms) at the
    micro-batch's rows, every micro-batch's and the gradient sync's once."""
    from galaxy.models.encdec_forms import encdec_plan_comm_bytes
    from galaxy.models.bart import encdec_shape
    from galaxy.planner.encdec_cost import EncDecCostModel, _hf_config
    from galaxy.planner.profiles import check_link

    _, doc = profiles["bart"]
    link = check_link({"latency_s": 1e-4, "bytes_per_s": 1e8}, "link")
    cost = EncDecCostModel(doc, [_device(1e9)] * 2, link, batch_size=4)
    shape = encdec_shape(_hf_config(doc["hf_config"]))
    for xatt, con in (("TP", "SP"), ("SP", "SP"), ("TP", "None")):
        plan = _plan(xatt=xatt, con=con)
        at = lambda b: sum(v["sent"] for v in encdec_plan_comm_bytes(   # noqa: E731
            plan, shape, source_shares=plan.tokens, target_shares=plan.decoder_tokens, batch=b).values())
        assert cost.estimate(plan).sent_bytes == [at(4)] * 2
        two = cost.estimate(_plan(xatt=xatt, con=con, microbatches=2)).sent_bytes[0]
        assert two == 2 * at(2) - (at(4) - 2 * (at(4) - at(2)))       # twice a half batch, the sync once


def test_search_splits_by_speed_and_caps_by_memory(profiles):
    """Devices at 3e9 and 1e9 FLOP/s, a free link, one Galaxy group: the best plan splits heads
    3:1 and columns 72:24 (what balances them, by hand) and is no slower than the hand-balanced
    TP plan; a budget that the fast rank's share does not fit moves units off it."""
    from galaxy.planner.encdec_cost import EncDecCostModel
    from galaxy.planner.encdec_search import search_encdec
    from galaxy.planner.profiles import check_link

    free = check_link({"latency_s": 0.0, "bytes_per_s": 1e15}, "free")
    cost = EncDecCostModel(_synthetic(profiles), [_device(3e9), _device(1e9)], free, batch_size=4)
    result = search_encdec(cost, [1e6, 1e6], meshes=[(1, 1)])
    best = result.ranked[0]
    assert best.step_s <= cost.estimate(_plan()).step_s * (1 + 1e-9)
    if best.plan.att == "TP":
        assert best.plan.heads == (3, 1)
    if best.plan.mlp == "TP":
        assert best.plan.columns == (72, 24)
    need = cost.estimate(_plan()).memory_mib
    budgets = [need[0] - 0.02, need[1] + 5]          # rank 0 short of the balanced plan by 0.02 MiB
    capped = search_encdec(cost, budgets, meshes=[(1, 1)]).ranked[0]
    assert all(m <= b for m, b in zip(capped.memory_mib, budgets))
    assert capped.plan != best.plan


# --- pipelines ---------------------------------------------------------------------------------------

def test_pipeline_split_across_the_stacks_by_hand(profiles):
    """Two stages on devices at 1e9 and 2e9 FLOP/s, a free link: an encoder layer costs 15e6 FLOPs
    a row, a decoder layer 12e6, the head 1e6, so the splits 1 | 3, 2 | 2, 3 | 1 give the stages
    15 | 20, 30 | 12.5, 42 | 6.5 (x 3 x rows / 1e9 s): the search puts one encoder layer on the slow
    device and the other beside both decoder layers. Its ranks compute those seconds, and stage 0
    sends its carry (the source and the target stream inside the encoder) each micro-batch and the
    tied weight's gradient; a boundary past the encoder sends the encoder's output instead."""
    from galaxy.distributed.comm_bytes import ring_bytes
    from galaxy.planner.encdec_cost import EncDecCostModel
    from galaxy.planner.encdec_search import search_encdec
    from galaxy.planner.profiles import check_link

    free = check_link({"latency_s": 0.0, "bytes_per_s": 1e15}, "free")
    doc = _synthetic(profiles)
    cost = EncDecCostModel(doc, [_device(1e9), _device(2e9)], free, batch_size=4)
    best = search_encdec(cost, [1e6, 1e6], meshes=[(2, 1)]).ranked[0]
    assert best.plan.stages == (1, 3)
    assert best.compute_s == [pytest.approx(3 * 15e6 * 4 / 1e9), pytest.approx(3 * 40e6 * 4 / 2e9)]
    n, h, m = doc["carry_tensors"], cost.hidden, best.plan.microbatches
    carry = 4 / m * 4 * n * (SOURCE + TARGET) * h                     # rows x fp32 x tokens x width
    tied = ring_bytes("all_reduce", doc["params"]["tied"], 4, 2)
    assert best.sent_bytes == [m * carry + tied] * 2                  # the carry forward, its gradient back
    past = cost.boundary_bytes(_plan(heads=(4,), columns=(96,), tokens=(SOURCE,), decoder_tokens=(TARGET,),
                                     pp=2, stages=(3, 1)), 3, 1)
    assert past == (4 * (SOURCE + n * TARGET) * h,) * 2


def test_boundary_tensors_per_micro_batch_by_hand(profiles):
    """memory_model's boundary tensors (model_terms.boundary_ends) in the encoder-decoder's model: a
    1f1b pipeline split inside the encoder (stages 1 | 3) keeps, for each micro-batch past the ones
    in flight, the carry (n source and n target tensors [rows, tokens, d_model] fp32) and its
    gradient, at each rank's CON tokens (9 and 3 source, 3 target), x (1 + slack) on CPU. Going from
    FRAGMENTED_MICROBATCHES to 4 more micro-batches of one row each adds 4 of them on both stages
    and nothing else (from there on the heap's fragments, model_terms.fragmented, stay)."""
    from galaxy.planner.encdec_cost import EncDecCostModel
    from galaxy.planner.memory_model import CPU_ACTIVATION_SLACK
    from galaxy.planner.model_terms import FRAGMENTED_MICROBATCHES
    from galaxy.planner.profiles import check_link

    free = check_link({"latency_s": 0.0, "bytes_per_s": 1e15}, "free")
    doc = _synthetic(profiles)
    n, h = doc["carry_tensors"], doc["hf_config"]["d_model"]

    def memory(m):
        cost = EncDecCostModel(doc, [_device(1e9)] * 4, free, batch_size=m)
        return cost.estimate_memory(_plan(pp=2, stages=(1, 3), microbatches=m, schedule="1f1b"))

    grown = [b - a for a, b in zip(memory(FRAGMENTED_MICROBATCHES), memory(FRAGMENTED_MICROBATCHES + 4))]
    carry = [2 * 4 * n * (source + 3) * h for source in (9, 3)]     # forward + gradient, per row
    want = [4 * (1 + CPU_ACTIVATION_SLACK) * c / 2 ** 20 for c in carry] * 2      # ranks (stage, j)
    assert grown == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("rates, latency", [((1e9, 2e9), 1e-4), ((2e9, 1e9), 3e-2)])
def test_pipeline_search_equals_a_brute_force_over_splits(profiles, rates, latency):
    """Every two-stage plan of the 2 + 2 layers (3 splits x 1, 2, 4 micro-batches, 1F1B when there
    are at least 2): the search's best is the fastest of them, on a quick and on a slow link."""
    from galaxy.planner.encdec_cost import EncDecCostModel
    from galaxy.planner.encdec_search import search_encdec
    from galaxy.planner.profiles import check_link

    link = check_link({"latency_s": latency, "bytes_per_s": 1e8}, "link")
    cost = EncDecCostModel(_synthetic(profiles), [_device(r) for r in rates], link, batch_size=4)
    found = search_encdec(cost, [1e6, 1e6], meshes=[(2, 1)]).ranked[0]
    every = [cost.estimate(_plan(heads=(4,), columns=(96,), tokens=(SOURCE,), decoder_tokens=(TARGET,), pp=2,
                                 stages=(a, 4 - a), microbatches=m, schedule="1f1b" if m >= 2 else "gpipe")).step_s
             for a in (1, 2, 3) for m in (1, 2, 4)]
    assert found.step_s == pytest.approx(min(every), rel=1e-12)


# --- PEFT methods and FSDP (galaxy.planner.encdec_method, encdec_terms) -----------------------------

METHODS = ("lora", "adapter", "side", "side_only")
SERIAL = _plan(heads=(4,), columns=(96,), tokens=(SOURCE,), decoder_tokens=(TARGET,))


@pytest.fixture(scope="module")
def method_profiles(profiles):
    """(family, method) -> the family's profile with that method's "peft" section (the configs'
    defaults: LoRA r 8 on the family's q / v targets, adapters 64 wide, side width hidden / 8)."""
    from types import SimpleNamespace

    from galaxy.models.build import load_hf_config
    from galaxy.planner.encdec_method import encdec_method_section
    out = {}
    for family in ("bart", "t5"):
        model_path, doc = profiles[family]
        hf = load_hf_config(model_path)
        for method in METHODS:
            cfg = SimpleNamespace(model_path=model_path, dropout=None, seed=0, **{f"use_{method}": True})
            out[family, method] = {**doc, "peft": encdec_method_section(cfg, hf, "seq2seq", None, SOURCE, TARGET)}
    return out


def _method_cost(doc, devices, link=None):
    from galaxy.planner.encdec_cost import EncDecCostModel
    return EncDecCostModel(doc, devices, link, batch_size=4, method=doc["peft"]["signature"])


def _galaxy_model(model_path, method, plan, j):
    """Galaxy's own model (meta device) as rank j of `plan` builds it, the method applied."""
    from galaxy.distributed.group import GalaxyGroup
    from galaxy.models.build import load_hf_config, model_class
    from galaxy.models.registry import family_of
    from galaxy.parallel.plan import apply_plan
    from galaxy.peft import PeftOptions, apply_peft

    hf = load_hf_config(model_path)
    with torch.device("meta"):
        model = model_class(family_of(hf.model_type), "seq2seq")(hf)
    group = GalaxyGroup(j, plan.group, None, plan.heads, plan.columns, plan.tokens,
                        plan.decoder_tokens if plan.group > 1 else None)
    apply_plan(model, plan, group)
    apply_peft(model, PeftOptions(method), seed=0)
    return model


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_parameters_under_each_method_equal_the_galaxy_models(method_profiles, family):
    """Under LoRA, adapters, side-tuning and side-only: the whole model's parameters and those that
    train, and each rank's under uneven shares (heads 3:1, columns 72:24, tokens 9:3 and 3:3; ATT
    and XATT TP, then SP), equal galaxy's own model with the plan and the method applied."""
    model_path = method_profiles[family, "lora"]["model_path"]
    for method in METHODS:
        doc = method_profiles[family, method]
        cost = _method_cost(doc, [_device(1e9)] * 2)
        serial = _galaxy_model(model_path, method, SERIAL, 0)
        assert doc["peft"]["params"]["total"] == sum(p.numel() for p in serial.parameters()), method
        assert doc["peft"]["trainable"]["total"] == sum(p.numel() for p in serial.parameters() if p.requires_grad)
        for att in ("TP", "SP"):
            plan = _plan(att=att, xatt=att)
            for j in range(2):
                model = _galaxy_model(model_path, method, plan, j)
                assert cost.params_of(plan, j) == sum(p.numel() for p in model.parameters()), (method, att, j)
                assert cost.trainable_of(plan, j) == sum(p.numel() for p in model.parameters() if p.requires_grad), \
                    (method, att, j)


def test_memory_and_data_parallel_bytes_under_lora_and_fsdp_by_hand(method_profiles):
    """T5 under LoRA at dp 2 (AdamW, a fused step, a CUDA device: activations and state simply
    add): every rank's memory is the weights (a 1/2 shard under FSDP, plus two gathered layers
    under "full", plus every weight under "no_reshard"), the trained parameters' gradients and
    two moments (sharded alike), DDP's or FSDP's copy of the trained gradients, and the
    activations, which sharding leaves alone; DDP sends the trained gradients' all-reduce, FSDP
    gathers every weight in forward and backward and reduce-scatters the trained gradients.
    Full fine-tuning, the same plan, trains and syncs every weight."""
    from galaxy.distributed.comm_bytes import ring_bytes

    from galaxy.planner.encdec_cost import EncDecCostModel
    from galaxy.planner.profiles import check_link

    doc = method_profiles["t5", "lora"]
    device = {**_device(1e9), "device": "cuda", "optimizer_fused": True}
    link = check_link({"latency_s": 1e-4, "bytes_per_s": 1e8}, "link")
    cost = _method_cost(doc, [device] * 2, link)
    n, t = doc["peft"]["params"]["total"], doc["peft"]["trainable"]["total"]
    serial = _plan(**{**SERIAL.__dict__, "dp": 2})
    total, biggest, _ = cost.acts_per_row(serial, 0)
    acts = 2 * (total + biggest)                 # 2 rows a replica
    layer = max(cost.layer_params(s, cost.kinds(serial, 0)[s]) for s in ("encoder", "decoder"))
    weights = {"none": n, "full": n / 2 + 2 * layer, "no_reshard": n / 2 + n}
    for shard, w in weights.items():
        held = t if shard == "none" else t / 2
        est = cost.estimate(_plan(**{**serial.__dict__, "dp_sharding": shard}))
        want = 4 * (w + held + 2 * held + t) + acts
        assert est.memory_mib == [pytest.approx(want / 2 ** 20, rel=1e-12)] * 2, shard
        gathers = {"none": 0, "full": 2, "no_reshard": 1}[shard]      # forward and backward, or once
        sent = ring_bytes("all_reduce", t, 4, 2) if shard == "none" else \
            gathers * ring_bytes("all_gather", n // 2, 4, 2) + ring_bytes("reduce_scatter", t // 2, 4, 2)
        assert est.sent_bytes == [sent] * 2, shard
    full = EncDecCostModel(doc, [device] * 2, link, batch_size=4)
    assert full.trainable_of(serial, 0) == full.params_of(serial, 0) == doc["params"]["total"]
    assert full.estimate(serial).sent_bytes == [ring_bytes("all_reduce", doc["params"]["total"], 4, 2)] * 2


# --- the shared table's gradient: rows in place (galaxy.parallel.embedding_grad) ---------------------

def _untied(doc):
    """The profile as an untied T5 v1.1's would count it: no weight held by both ends."""
    return {**doc, "params": {**doc["params"], "tied": 0}}


def test_shared_table_switches_where_the_runtime_switches_it(profiles, method_profiles, tiny_lm_dir):
    """The rule on the first stage, against galaxy.parallel.embedding_grad's own pick of the
    tables of the model as built (m > 1): at pp 1 tied BART stays dense, untied T5 v1.1 switches;
    BART's first stage of two switches (the tied copy lives on the last); never one micro-batch,
    FSDP's replicas, or a method that freezes the table."""
    from galaxy.models.build import load_hf_config, model_class, tie_as_checkpoint
    from galaxy.models.registry import family_of
    from galaxy.models.weights import LazyCheckpoint
    from galaxy.parallel.embedding_grad import vocabulary_embeddings
    from galaxy.pipeline.stage import keep_stage
    from galaxy.planner.encdec_cost import EncDecCostModel

    def switched(model_path, stage=None):    # the model as galaxy.runtime.assemble builds it
        hf, family = load_hf_config(model_path), family_of(load_hf_config(model_path).model_type)
        with LazyCheckpoint(model_path) as checkpoint:
            hf = tie_as_checkpoint(hf, checkpoint, family)
        with torch.device("meta"):
            model = model_class(family, "seq2seq")(hf)
            return bool(vocabulary_embeddings(keep_stage(model, *stage) if stage else model))

    bart = EncDecCostModel(profiles["bart"][1], [_device(1e9)] * 4, None, batch_size=4)
    v1_1 = EncDecCostModel(_untied(profiles["t5"][1]), [_device(1e9)] * 4, None, batch_size=4)
    two = _plan(**{**SERIAL.__dict__, "microbatches": 2})
    assert bart.rows_accumulate_in_place(two) is switched(profiles["bart"][0]) is False
    assert v1_1.rows_accumulate_in_place(two) is switched(tiny_lm_dir("t5", v1_1=True)) is True
    piped = _plan(**{**two.__dict__, "pp": 2, "stages": (1, 3)})
    assert bart.rows_accumulate_in_place(piped) is switched(profiles["bart"][0], (range(0, 1), True, False)) is True
    assert not bart.rows_accumulate_in_place(_plan(**{**piped.__dict__, "microbatches": 1}))
    assert not bart.rows_accumulate_in_place(_plan(**{**piped.__dict__, "dp": 2, "dp_sharding": "full"}))
    assert bart.rows_accumulate_in_place(_plan(**{**piped.__dict__, "dp": 2}))
    lora = _method_cost(method_profiles["bart", "lora"], [_device(1e9)] * 4)
    assert not lora.rows_accumulate_in_place(piped)


def test_shared_table_backward_and_accumulation_by_hand(profiles):
    """One device adding a gradient element in a s (grad_accumulate_s_per_param), m = 2 micro-batches
    of 2 rows: the table's backward (V x d zeroed, 2 x (S + T) rows of d added) and the additions
    into .grad, as the rank's compute beyond the same plan at a = 0. Dense (tied BART, pp 1): the
    block each micro-batch, every parameter added once. Switched (untied, pp 1; BART's stage 0 of
    two): the block once, the rows each micro-batch, every parameter but the table added once;
    BART's last stage adds all of its own."""
    from galaxy.planner.encdec_cost import EncDecCostModel
    from galaxy.planner.profiles import check_link

    a, free = 1e-9, check_link({"latency_s": 0.0, "bytes_per_s": 1e15}, "free")
    _, doc = profiles["bart"]
    V, d = doc["hf_config"]["vocab_size"], doc["hf_config"]["d_model"]
    block, looked_up = V * d * a, 2 * (SOURCE + TARGET) * d * a
    two = _plan(**{**SERIAL.__dict__, "microbatches": 2})
    piped = _plan(**{**two.__dict__, "pp": 2, "stages": (1, 3)})

    def extra(doc, plan, world=1):
        at = [EncDecCostModel(doc, [{**_device(1e9), "grad_accumulate_s_per_param": rate}] * world, free,
                              batch_size=4) for rate in (a, 0.0)]
        (with_a, est), (_, none) = ((c, c.estimate(plan)) for c in at)
        return with_a, [x - y for x, y in zip(est.compute_s, none.compute_s)], est.sub_block_s

    cost, dense, sub_s = extra(doc, two)
    assert dense[0] == pytest.approx(2 * (block + looked_up) + cost.params_of(two, 0) * a, rel=1e-9)
    assert sub_s[0]["EMB"] == pytest.approx(2 * (block + looked_up), rel=1e-9)
    cost, switched, sub_s = extra(_untied(doc), two)
    assert switched[0] == pytest.approx(block + 2 * looked_up + (cost.params_of(two, 0) - V * d) * a, rel=1e-9)
    assert sub_s[0]["EMB"] == pytest.approx(block + 2 * looked_up, rel=1e-9)
    cost, stages, _ = extra(doc, piped, world=2)
    assert stages[0] == pytest.approx(block + 2 * looked_up + (cost.params_of(piped, 0, p=0) - V * d) * a, rel=1e-9)
    assert stages[1] == pytest.approx(cost.params_of(piped, 0, p=1) * a, rel=1e-9)


def test_kept_dense_table_gradients_only_where_the_lookup_stays_dense(profiles):
    """A heap that keeps freed memory (freed_memory_kept) keeps memory_model's kept_gradient_blocks
    of the V x d table on the first stage where the lookup stays dense (tied BART at pp 1, 4
    micro-batches: min(m - 2, 4) = 2 blocks), none where its rows accumulate in place (pp 2)."""
    from galaxy.planner.encdec_cost import EncDecCostModel
    from galaxy.planner.profiles import check_link

    free = check_link({"latency_s": 0.0, "bytes_per_s": 1e15}, "free")
    _, doc = profiles["bart"]
    block = doc["hf_config"]["vocab_size"] * doc["hf_config"]["d_model"] * 4 / 2 ** 20
    four = _plan(**{**SERIAL.__dict__, "microbatches": 4})
    for plan, world, blocks in ((four, 1, [2]), (_plan(**{**four.__dict__, "pp": 2, "stages": (1, 3)}), 2, [0, 0])):
        kept, plain = (EncDecCostModel(doc, [{**_device(1e9), "freed_memory_kept": flag}] * world, free,
                                       batch_size=4).estimate_memory(plan) for flag in (True, False))
        assert [k - p for k, p in zip(kept, plain)] == pytest.approx([b * block for b in blocks], rel=1e-9)


# --- end to end: profile-model, profile-devices on 2 gloo ranks, search, train -----------------------

def test_searched_t5_config_trains_with_hf_losses(work, tmp_path):              # noqa: F811
    """plan.py's three steps on the entry scripts' tiny T5 (tests/test_entry_scripts_encdec.py)
    write a config for one Galaxy group of 2 (--dp 1, rank 1's GEMM rate halved in the measured
    profile) whose every key galaxy.config accepts and whose shares favour rank 0;
    finetune_t5.py --world 2 trains it with Hugging Face's losses (1e-5 relative), each rank's
    peak memory within 10% of the search's prediction. Then under LoRA with --pp 2: the searched
    pipeline trains with the serial LoRA run's losses."""
    from support.script_runner import launch, run_scripts
    from test_entry_scripts_encdec import hf_losses, write_config

    from galaxy.train.metrics import read_metrics

    base, metrics_file = write_config(work, "t5", "train.jsonl", name="planned-base", distributed_backend="gloo")
    model, devices, out = (str(tmp_path / n) for n in ("model.json", "devices.json", "planned.json"))
    cli.main(["profile-model", "--config_file", base, "--out", model])
    results = launch(["plan.py", "profile-devices"], base, 2, "--out", devices, "--quick", timeout=240)
    for rank, (code, stdout, stderr) in enumerate(results):
        assert code == 0, f"rank {rank} exited {code}:\n{stdout}\n{stderr}"
    measured = json.loads(open(devices).read())
    assert "compute" not in measured["devices"][0]       # timed by its GEMM rate
    # rank 1 made half as fast (a profile is a file to edit): the shares must follow
    measured["devices"][1]["gemm_flops_per_s"] = measured["devices"][0]["gemm_flops_per_s"] / 2
    open(devices, "w").write(json.dumps(measured))
    cli.main(["search", "--config_file", base, "--devices", devices, "--model", model, "--pp", "1", "--dp", "1",
              "--out", out])
    planned = json.loads(open(out).read())
    assert planned["dp_deg"] == 1 and planned["pp_deg"] == 1 and planned["xatt_parallel_method"] in ("TP", "SP")
    splits = [planned[k] for k in ("tp_num_attention_heads_list", "tp_intermediate_size_list", "seq_scatter_list",
                                   "decoder_seq_scatter_list") if k in planned]
    assert splits and all(s[0] > s[1] for s in splits), planned      # the faster rank takes more
    # fresh processes (not the command drivers, whose peak RSS spans earlier runs): each rank's peak
    results = launch("finetune_t5.py", out, 2, timeout=240)
    for rank, (code, stdout, stderr) in enumerate(results):
        assert code == 0, f"rank {rank} exited {code}:\n{stdout}\n{stderr}"
    records = read_metrics(metrics_file)
    done = [r for r in records if r.get("event") == "done"][-1]
    for measured, predicted in zip(done["peak_memory_mib"], planned["_planned"]["predicted_memory_mib"]):
        assert abs(measured - predicted) <= 0.1 * measured, (done["peak_memory_mib"], planned["_planned"])
    steps = [r for r in records if "step" in r and "event" not in r]
    want = hf_losses(work, "t5")
    assert len(steps) == len(want)
    for r, ref in zip(steps, want):
        assert abs(r["loss"] - ref) <= 1e-5 * abs(ref), (r["loss"], ref)
    # Under LoRA (the config's default q / v targets): profile-model and search for the method on the
    # same devices as two pipeline stages; the planned run reports the serial LoRA run's losses
    # (both on the drivers)
    lora_base, lora_metrics = write_config(work, "t5", "train.jsonl", name="planned-lora", distributed_backend="gloo",
                                           use_lora=True)
    serial, serial_metrics = write_config(work, "t5", "train.jsonl", name="serial-lora", use_lora=True)
    lora_model, lora_out = str(tmp_path / "lora_model.json"), str(tmp_path / "lora_planned.json")
    cli.main(["profile-model", "--config_file", lora_base, "--out", lora_model])
    cli.main(["search", "--config_file", lora_base, "--devices", devices, "--model", lora_model, "--pp", "2",
              "--out", lora_out])
    planned = json.loads(open(lora_out).read())
    assert planned["use_lora"] and planned["pp_deg"] == 2 and sum(planned["stage_num_hidden_layers_list"]) == 4
    for (script, *_), outcome in zip([("lora", 2), ("serial", 1)], run_scripts([("finetune_t5.py", lora_out, 2),
                                                                               ("finetune_t5.py", serial, 1)])):
        for rank, (code, stdout, stderr) in enumerate(outcome):
            assert code == 0, f"{script} rank {rank} exited {code}:\n{stdout}\n{stderr}"
    losses = [[r["loss"] for r in read_metrics(m) if "event" not in r] for m in (lora_metrics, serial_metrics)]
    assert len(losses[0]) == len(want) and losses[1][0] == pytest.approx(want[0], rel=1e-5)    # B = 0: the base model
    assert max(abs(a - b) / abs(b) for a, b in zip(*losses)) < 1e-5, losses
