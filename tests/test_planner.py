"""plan.py and galaxy.planner: the cost model and the search on synthetic profiles whose optimum
is known by hand, the profile files, the CLI end to end on tiny models, a searched config training
under pretrain_galaxy.py with HF's losses, and profile-devices on a real 2-process gloo group."""
import json
from dataclasses import replace

import pytest

from support.script_runner import run_script
from support.tiny_models import make_tiny_bert_with_minilm_tokenizer
from test_entry_scripts import hf_losses, job, write_config  # noqa: F401  (job: the module fixture)

from galaxy.config import apply_preset, load_config, validate_for_world
from galaxy.models.shape import read_model_shape
from galaxy.planner import cli
from galaxy.plan import Plan
from galaxy.planner.cost import CostModel
from galaxy.planner.draw import step_parts
from galaxy.planner.memory_model import FULL_ACTIVATION_SLACK, KEPT_GRADIENTS_MAX, MIB
from galaxy.planner.model_terms import FRAGMENT_SHARE, FRAGMENTED_MICROBATCHES
from galaxy.planner.device_compute import DeviceCompute, model_signature
from galaxy.planner.device_profile import MEAN_WINDOW_S, measure_compute
from galaxy.planner.link_model import link_time
from galaxy.planner.pipeline_time import hop_time, stage_ends, stage_order
from galaxy.planner.profiles import (ProfileError, check_cluster, check_device, check_link, compose, fit_link,
                                     load_devices, write_json)
from galaxy.planner.overlap_time import HIDE_RATE, STREAM_COST
from galaxy.planner.search import Searcher, proportional, search
from galaxy.planner.table import table
from galaxy.planner.writer import plan_keys
from galaxy.train.metrics import read_metrics

FREE_LINK = check_link({"latency_s": 0.0, "bytes_per_s": 1e15}, "free link")
ATT_F, MLP_F = 6e7, 1.2e8          # forward matrix FLOPs per row of a whole sub-block
PER_HEAD, PER_COLUMN = 49152, 769  # parameters per head / per MLP column


def synthetic_model(layers=6, heads=12, intermediate=1536, seq=48, act_per_token=0.0, kv_heads=None):
    """A hand-written model profile (BERT's shape for the closed forms): FLOPs only in ATT and MLP,
    parameters proportional to heads / columns, activations act_per_token bytes per token and
    sub-block, nothing outside the layers."""
    flops = lambda f: {"fwd": f, "bwd": 2 * f, "fwd_elementwise": 0, "bwd_elementwise": 0}  # noqa: E731
    kv = kv_heads or heads
    return {
        "format": "galaxy-model-profile", "version": 1, "model_type": "bert", "family": "bert",
        "task": "classification", "num_labels": 2, "pad_size": seq, "dropout": 0.0,
        "hf_config": {"model_type": "bert", "hidden_size": 384, "num_hidden_layers": layers,
                      "num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": intermediate,
                      "vocab_size": 1000, "max_position_embeddings": 512},
        "carry_tensors": 1,
        "units": {"att_tp": [heads, heads // kv], "att_sp": [seq, 1], "mlp_tp": [intermediate, 1],
                  "mlp_sp": [seq, 1], "con": [seq, 1], "embed": [seq, seq], "head": [seq, 1]},
        "params": {"embed": 0, "head": 0, "tied": 0, "other": 0,
                   "layer": {"att_tp": [0, PER_HEAD], "mlp_tp": [0, PER_COLUMN], "att_sp": PER_HEAD * heads,
                             "mlp_sp": PER_COLUMN * intermediate, "con": 0}},
        "act_bytes_per_row": {"att_tp": [seq * act_per_token, 0], "mlp_tp": [seq * act_per_token, 0],
                              "att_sp": [0, act_per_token], "mlp_sp": [0, act_per_token],
                              "con": [0, act_per_token], "embed": [0, 0], "head": [0, 0]},
        "flops_per_row": {"att": flops(ATT_F), "mlp": flops(MLP_F), "con": flops(0), "head": flops(0)},
    }


def device(rate, memory=1e6, name=None):
    return {"name": name or f"{rate:g} FLOP/s", "gemm_flops_per_s": rate, "memory_mib": memory, "baseline_mib": 0.0,
            "optimizer_s_per_param": {"adamw": 0.0, "sgd": 0.0}}


def P(pp, dp, att, mlp, con, heads, columns, tokens, stages, microbatches=1, schedule="1f1b", checkpoint=(),
      dp_sharding="none"):
    """A resolved plan, as the planner's tests write it: checkpoint = recomputed leading layers per stage."""
    plan = Plan(att=att, mlp=mlp, con=con, pp=pp, dp=dp, heads=heads, columns=columns, tokens=tokens, stages=stages,
                microbatches=microbatches, schedule=schedule, checkpoint=(), dp_sharding=dp_sharding)
    return plan.with_stage_checkpoints(checkpoint) if checkpoint else plan


def galaxy_plan(heads, columns, tokens, layers=6, **kw):
    return P(1, 1, "TP", "TP", "SP", tuple(heads), tuple(columns), tuple(tokens), (layers,), **kw)


# --- the cost model ----------------------------------------------------------------------------------

def test_step_time_of_a_balanced_split_by_hand():
    """Speeds 2:1, shares 2:1, a free link: each sub-block takes the same time on both ranks,
    F x rows x share / rate, so a step is layers x rows x 3 (F_att + F_mlp) / 3 / R."""
    R, rows = 1e10, 16
    cost = CostModel(synthetic_model(), [device(2 * R), device(R)], FREE_LINK, batch_size=rows)
    est = cost.estimate(galaxy_plan((8, 4), (1024, 512), (32, 16)))
    want = 6 * rows * 3 * (ATT_F + MLP_F) / 3 / R
    assert est.step_s == pytest.approx(want, rel=1e-6)                  # (the free link's bytes: 1e-8)
    even = cost.estimate(galaxy_plan((6, 6), (768, 768), (24, 24)))
    assert even.step_s == pytest.approx(1.5 * want, rel=1e-6)          # the slow rank does half


def test_pipeline_bubble_and_memory_in_flight_by_hand():
    """pp 2 on equal devices, 3 layers a stage, m micro-batches: (m + pp - 1) stage times; 1f1b keeps
    pp - stage micro-batches of activations in flight, gpipe all m; each stage keeps the boundary's
    carry [48, 384] fp32 and its gradient of the m - in flight others until the step ends."""
    R, rows, m = 1e10, 16, 4
    model = synthetic_model(act_per_token=1000.0)
    cost = CostModel(model, [device(R), device(R)], FREE_LINK, batch_size=rows)
    plan = P(2, 1, "TP", "TP", "SP", (12,), (1536,), (48,), (3, 3), m, "1f1b")
    t_stage = 3 * (rows / m) * 3 * (ATT_F + MLP_F) / R
    assert cost.estimate(plan).step_s == pytest.approx((m + 1) * t_stage, rel=1e-9)
    # saved bytes (+ backward's working space), x (1 + slack) on CPU (the allocator's, galaxy.planner.cost);
    # the slack also over the heap's fragments: FRAGMENT_SHARE of the micro-batches short of
    # min(FRAGMENTED_MICROBATCHES, m) (model_terms.fragmented)
    per_mb = lambda n: (rows / m) * 48 * 1000.0 * (3 * 4 * n + 1)    # noqa: E731

    def act(inflight):
        spread = inflight + FRAGMENT_SHARE * max(0, min(FRAGMENTED_MICROBATCHES, m) - inflight)
        return per_mb(inflight) + FULL_ACTIVATION_SLACK * per_mb(spread)
    weights = 20 * 3 * (12 * PER_HEAD + 1536 * PER_COLUMN)   # fp32 weight, grad, 2 AdamW moments, AdamW's temporary
    held = lambda past: (1 + FULL_ACTIVATION_SLACK) * (rows / m) * past * 2 * 48 * 384 * 4   # noqa: E731
    assert act(m) == pytest.approx((1 + FULL_ACTIVATION_SLACK) * per_mb(m))       # gpipe: all in flight
    assert act(1) > (1 + FULL_ACTIVATION_SLACK) * per_mb(1)
    mem = cost.estimate(plan).memory_mib
    assert mem[0] * MIB == pytest.approx(weights + act(2) + held(m - 2), rel=1e-9)
    assert mem[1] * MIB == pytest.approx(weights + act(1) + held(m - 1), rel=1e-9)
    gpipe = cost.estimate(P(2, 1, "TP", "TP", "SP", (12,), (1536,), (48,), (3, 3), m, "gpipe")).memory_mib
    assert gpipe[1] * MIB == pytest.approx(weights + act(m), rel=1e-9)


def test_pipeline_boundary_tensors_grow_with_micro_batches_by_hand():
    """What a stage keeps per micro-batch past its backward (model_terms.boundary_ends): a middle
    stage two carries and two gradients ([rows / m, tokens, 384] fp32 each, at its Galaxy rank's
    CON tokens), an end stage one of each, x (1 + slack) on CPU; nothing under gpipe (all in flight)
    or without a pipeline. Free of activations (act_per_token 0) and weights' dependence on m."""
    rows, m = 24, 12
    model = synthetic_model(act_per_token=0.0)
    cost = CostModel(model, [device(1e10)] * 6, FREE_LINK, batch_size=rows)
    carry = (rows / m) * 384 * 4 * (1 + FULL_ACTIVATION_SLACK)    # bytes per token of one micro-batch's carry
    weights = lambda layers: 20 * layers * (6 * PER_HEAD + 768 * PER_COLUMN)   # noqa: E731  (half the heads)

    def mem(pp, schedule, micro=m):
        stages = (6 // pp,) * pp
        plan = P(pp, 1, "TP", "TP", "SP", (6, 6), (768, 768), (40, 8), stages, micro, schedule)
        return [x * MIB - weights(6 // pp) for x in cost.estimate_memory(plan)]

    # stages 0, 1, 2 (Galaxy ranks 0, 1: 40 and 8 CON tokens); 1f1b in flight 3, 2, 1
    want = [(m - 3) * 2, (m - 2) * 4, (m - 1) * 2]
    got = mem(3, "1f1b")
    for p in range(3):
        for j, tokens in enumerate((40, 8)):
            assert got[2 * p + j] == pytest.approx(want[p] * tokens * carry, rel=1e-9)
    assert mem(3, "gpipe") == pytest.approx([0.0] * 6, abs=1e-6)
    assert mem(1, "1f1b", 1) == pytest.approx([0.0] * 2, abs=1e-6)


def test_step_splits_into_compute_communication_and_idle_per_rank():
    """What `plan.py search --png` draws per rank. dp 2 on equal devices over a link of bandwidth B
    (no latency): compute is the whole batch's half, communication DDP's all-reduce of every
    gradient, 2 (n - 1) / n x 4 bytes x params / B, and nothing idles. A 2:1 pipeline split over
    speeds 1:1 leaves the quick stage idle and neither stage communicating: the hops between
    stages travel behind compute (galaxy.pipeline.overlap_schedule), a wait for one is idle."""
    R, rows, B = 1e10, 16, 1e8
    link = check_link({"latency_s": 0.0, "bytes_per_s": B}, "link")
    cost = CostModel(synthetic_model(), [device(R), device(R)], link, batch_size=rows)
    est = cost.estimate(P(1, 2, "TP", "TP", "None", (12,), (1536,), (48,), (6,), dp_sharding="none"))
    params = 6 * (12 * PER_HEAD + 1536 * PER_COLUMN)
    compute = 6 * (rows / 2) * 3 * (ATT_F + MLP_F) / R
    assert est.compute_s == pytest.approx([compute] * 2, rel=1e-9)
    assert est.comm_rank_s == pytest.approx([4 * params / B] * 2, rel=1e-9)
    assert est.step_s == pytest.approx(compute + 4 * params / B, rel=1e-9)
    busy, comm, idle = step_parts(est)
    assert idle == pytest.approx([0.0, 0.0], abs=1e-12)
    pipe = cost.estimate(P(2, 1, "TP", "TP", "SP", (12,), (1536,), (48,), (4, 2), 1))
    busy, comm, idle = step_parts(pipe)
    for r in range(2):
        assert busy[r] + comm[r] + idle[r] == pytest.approx(pipe.step_s, rel=1e-12)
    assert busy[1] == pytest.approx(busy[0] / 2, rel=1e-9) and idle[1] > idle[0] >= 0.0
    assert comm == [0.0, 0.0]


def test_pipeline_schedule_by_hand():
    """Equal stages: (m + pp - 1)(F + B) under both schedules. A slow first stage hides a quick last
    one (its work and both hops fit under the first stage's next forward): m (F0 + B0), where the
    closed form sum t_p + (m - 1) max t_p says more. A slow last stage waits only for the first
    forward and is waited on for the last backward: F0 + hop + m (F1 + B1) + hop + B0."""
    assert stage_order("1f1b", 0, 2, 4) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3),
                                            ("B", 2), ("B", 3)]                  # torch's warm-up: pp - stage
    assert stage_order("1f1b", 1, 2, 4)[:4] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    for schedule, pp, m in [("gpipe", 2, 1), ("gpipe", 3, 4), ("1f1b", 2, 2), ("1f1b", 3, 5), ("1f1b", 4, 8)]:
        assert max(stage_ends((1.0,) * pp, (2.0,) * pp, 0.0, m, schedule)) == (m + pp - 1) * 3.0
    fwd, bwd, hop = (3.0, 1.0), (6.0, 1.0), 0.5
    assert stage_ends(fwd, bwd, hop, 2, "1f1b")[0] == 2 * (3.0 + 6.0) < (9.0 + 2.0) + 9.0
    assert max(stage_ends((1.0, 3.0), (1.0, 6.0), hop, 2, "1f1b")) == 1.0 + hop + 2 * 9.0 + hop + 1.0


def test_a_slow_link_carries_one_micro_batch_at_a_time():
    """Hops of 3 s between stages of 1 s (gpipe, 4 micro-batches): the link, not the stages, sets
    the pace. Forwards arrive at 4, 7, 10, 13 (each waits for the one before on the link), so
    stage 1 ends at 18; its gradients arrive back at 18, 21, 24, 27 and stage 0 ends at 28. A send
    that took no link time after the one before would have ended stage 0 at 22."""
    assert stage_ends((1.0, 1.0), (1.0, 1.0), 3.0, 4, "gpipe") == (28.0, 18.0)


def test_a_hop_is_the_slowest_pairs_wire_time():
    """The receiver posted its receive when the step began, so a hop is its bytes over the pair's
    rate: 2 MB at 50 MB/s is 40 ms (the pair's 4 ms per-call latency and its measured blocking
    sends are not in it); a boundary's hop is its slowest pair's (the other pair: 100 MB/s, 20 ms)."""
    pair = lambda ranks, rate: {"ranks": ranks, "bytes_per_s": rate, "latency_s": 0.004,   # noqa: E731
                                "measured": [{"bytes": 4096, "seconds": 0.0041}, {"bytes": 4194304, "seconds": 0.09}]}
    link = {"fit": {"send_recv": {"latency_s": 0.005, "bytes_per_s": 1e8}}, "pairs": [pair([0, 1], 5e7), pair([2, 3], 1e8)]}
    assert hop_time(link, 2e6, [(2, 3)]) == pytest.approx(0.02, rel=1e-12)
    assert hop_time(link, 2e6, [(0, 1), (2, 3)]) == pytest.approx(0.04, rel=1e-12)


def test_gradient_accumulation_adds_a_pass_over_the_gradients_per_micro_batch():
    rate = 2e-9
    model = synthetic_model()
    plan = P(1, 1, "TP", "TP", "SP", (12,), (1536,), (48,), (6,), 4)
    times = [CostModel(model, [dict(device(1e10), grad_accumulate_s_per_param=a)], None, batch_size=8)
             .estimate(plan).step_s for a in (0.0, rate)]
    params = 6 * (12 * PER_HEAD + 1536 * PER_COLUMN)
    assert times[1] - times[0] == pytest.approx(3 * params * rate, rel=1e-9)
    with pytest.raises(ProfileError, match="'grad_accumulate_s_per_param' must be a number, 0 or more"):
        check_device(dict(device(1e10), grad_accumulate_s_per_param=-1), "dev")


def test_checkpointing_trades_activations_for_a_forward():
    R, rows = 1e10, 8
    model = synthetic_model(act_per_token=1e5)
    cost = CostModel(model, [device(R)], None, batch_size=rows)
    base = P(1, 1, "TP", "TP", "SP", (12,), (1536,), (48,), (6,))
    none, two = cost.estimate(base), cost.estimate(base.with_stage_checkpoints((2,)))
    fwd_layer = rows * (ATT_F + MLP_F) / R
    assert two.step_s - none.step_s == pytest.approx(2 * fwd_layer, rel=1e-9)
    saved_per_layer = rows * 4 * 48 * 1e5 - rows * 48 * 384 * 4          # four sub-blocks' bytes - the input carry
    # one layer is rebuilt at a time; the CPU slack stays that of every layer's activations (backward
    # still rebuilds them all), so the saving counts once
    assert (none.memory_mib[0] - two.memory_mib[0]) * MIB == pytest.approx(
        2 * saved_per_layer - rows * 4 * 48 * 1e5, rel=1e-9)
    cuda = CostModel(model, [dict(device(R), device="cuda")], None, batch_size=rows)
    none, two = cuda.estimate(base), cuda.estimate(base.with_stage_checkpoints((2,)))
    assert (none.memory_mib[0] - two.memory_mib[0]) * MIB == pytest.approx(
        2 * saved_per_layer - rows * 4 * 48 * 1e5, rel=1e-9)                # no slack on CUDA


def test_sharded_data_parallel_divides_state_over_replicas():
    model = synthetic_model()
    cost = CostModel(model, [device(1e10), device(1e10)], FREE_LINK, batch_size=8)
    plain = P(1, 2, "TP", "TP", "SP", (12,), (1536,), (48,), (6,))
    n = 6 * (12 * PER_HEAD + 1536 * PER_COLUMN)
    full = cost.estimate(replace(plain, dp_sharding="full")).memory_mib[0] * MIB
    keep = cost.estimate(replace(plain, dp_sharding="no_reshard")).memory_mib[0] * MIB
    ddp = cost.estimate(plain).memory_mib[0] * MIB
    assert ddp == pytest.approx(4 * n * 6)            # weights, grads, 2 moments, DDP buckets, AdamW's temporary
    # shards of weights, grads, 2 moments, AdamW's temporary; the unsharded gradients before their
    # reduce-scatter; no_reshard: the gathered weights, full: two gathered layers
    assert keep == pytest.approx(4 * (5 * n / 2 + n + n))
    assert full == pytest.approx(4 * (5 * n / 2 + n + 2 * n / 6))


def test_summed_gradients_and_a_fused_step_by_hand():
    """No activations: a rank's state is fp32 weights, grads, 2 AdamW moments and an unfused step's
    temporary per parameter it holds; under SP the Galaxy group sums every layer weight's gradient,
    flattened into its buckets (one more copy); a fused step keeps no temporary."""
    n_layer = PER_HEAD * 12 + PER_COLUMN * 1536
    sp = P(1, 1, "SP", "SP", "SP", (12, 0), (1536, 0), (24, 24), (6,))
    tp = galaxy_plan((6, 6), (768, 768), (24, 24))
    unfused = CostModel(synthetic_model(), [device(1e10), device(1e10)], FREE_LINK, batch_size=8)
    fused = CostModel(synthetic_model(), [{**device(1e10), "optimizer_fused": True}] * 2, FREE_LINK, batch_size=8)
    assert unfused.estimate(sp).memory_mib[0] * MIB == pytest.approx(4 * 6 * n_layer * (5 + 1))
    assert fused.estimate(sp).memory_mib[0] * MIB == pytest.approx(4 * 6 * n_layer * (4 + 1))
    assert fused.estimate(tp).memory_mib[1] * MIB == pytest.approx(4 * 6 * n_layer / 2 * 4)   # nothing summed


def test_kept_heap_holds_the_dense_embedding_gradients_a_steady_state_splits():
    """Where the lookup stays dense (a head tied to the table on the same stage, FSDP), a CPU heap
    that keeps freed memory (cpu_allocator keep) holds one more dense embedding gradient, on the
    rank that holds the embeddings, for each backward after the first whose predecessor was
    followed by a forward (1f1b's steady state, plain accumulation), at most KEPT_GRADIENTS_MAX;
    none where every backward comes after the last forward (gpipe, 1f1b with m <= its warm-up).
    Where the rows accumulate into .grad in place (galaxy.parallel.embedding_grad), none."""
    def blocks(**keys):
        plan = P(2 if "schedule" in keys else 1, 1, "TP", "TP", "SP", (12,), (1536,), (48,),
                 (3, 3) if "schedule" in keys else (6,), **keys)
        return [CostModel.kept_gradient_blocks(plan, p) for p in range(plan.pp)]
    # 1f1b over 2 stages: 2 warm-up forwards, then B0 F2 B1 F3 B2 B3: B2 comes after B1's split
    assert blocks(microbatches=4, schedule="1f1b")[0] == 1
    assert blocks(microbatches=2, schedule="1f1b")[0] == 0           # B0 B1 after the last forward
    assert blocks(microbatches=4, schedule="gpipe")[0] == 0
    assert blocks(microbatches=12, schedule="1f1b")[0] == KEPT_GRADIENTS_MAX    # 9 would grow; capped

    def extra(model, **keys):
        plain = CostModel(model, [device(1e10)] * 2, FREE_LINK, batch_size=24)
        kept = CostModel(model, [{**device(1e10), "freed_memory_kept": True}] * 2, FREE_LINK, batch_size=24)
        plan = P(2 if "schedule" in keys else 1, 1, "TP", "TP", "SP", (12,), (1536,), (48,),
                 (3, 3) if "schedule" in keys else (6,), **keys)
        return [round((k - p) * MIB / (4 * E), 6) for k, p in zip(kept.estimate(plan).memory_mib,
                                                                   plain.estimate(plan).memory_mib)]
    E = 1_000_000
    tied = synthetic_model()
    tied["params"].update(embed=E, head=E, tied=E)                # one table, the head's weight too
    assert extra(tied, microbatches=4) == [2]                      # F B F B F B F B: B2 and B3
    assert extra(tied, microbatches=2) == [0]
    assert extra(tied) == [0]
    untied = synthetic_model()
    untied["params"]["embed"] = E
    assert extra(untied, microbatches=4) == [0]                    # rows in place: no fresh gradient
    assert extra(untied, microbatches=12, schedule="1f1b") == [0, 0]
    assert extra(tied, microbatches=12, schedule="1f1b") == [0, 0]   # the first stage's own copy


def test_rows_in_place_zero_the_table_once_a_step(monkeypatch):
    """The word embedding's backward under rows in place: the measured dense backward's intercept
    at 0 rows (the zeroed block) once a step, the rest per micro-batch; the embedding's parameters
    leave the m - 1 additions into .grad. A one-row table has no intercept: all per micro-batch."""
    model = synthetic_model()
    model["params"]["embed"] = E = 1_000_000
    table = {"embed": {"units": [48], "fwd_s": [[0.001, 0.002]], "bwd_s": [[0.004, 0.006]]}}
    dev = {**device(1e10), "grad_accumulate_s_per_param": 1e-9,
           "compute": {"rows": [1, 3], "kinds": table, "model": model_signature(model)}}
    embed = DeviceCompute(dev, model, True)
    assert embed.rows_in_place(48, 1) == pytest.approx((0.003, 0.001))
    assert embed.rows_in_place(48, 6) == pytest.approx((0.003, 0.006))
    one = {**dev, "compute": {**dev["compute"], "rows": [3],
                              "kinds": {"embed": {"units": [48], "fwd_s": [[0.002]], "bwd_s": [[0.006]]}}}}
    assert DeviceCompute(one, model, True).rows_in_place(48, 3) == pytest.approx((0.0, 0.006))
    plan = P(1, 1, "TP", "TP", "SP", (12,), (1536,), (48,), (6,), microbatches=4)      # 6 rows a micro-batch
    rows = CostModel(model, [dev], FREE_LINK, batch_size=24).estimate(plan).compute_s[0]
    monkeypatch.setattr(CostModel, "rows_accumulate_in_place", lambda self, plan: False)
    dense = CostModel(model, [dev], FREE_LINK, batch_size=24).estimate(plan).compute_s[0]
    # dense: 4 backwards at 6 rows (0.009 s each) and 3 additions of E parameters (0.001 s each);
    # rows in place: one zeroing (0.003 s) and 4 x 6 rows (0.006 s)
    assert dense - rows == pytest.approx(4 * 0.009 + 3 * E * 1e-9 - (0.003 + 4 * 0.006))


def test_dp_sharding_is_written_for_replicas_only():
    plan = P(1, 2, "TP", "TP", "SP", (12,), (1536,), (48,), (6,), dp_sharding="full")
    assert plan.to_keys(6)["dp_sharding"] == "full"
    assert "dp_sharding" not in P(1, 1, "TP", "TP", "SP", (12,), (1536,), (48,), (6,)).to_keys(6)


def test_streams_hide_collectives_behind_the_other_streams_compute_by_hand():
    """galaxy.planner.overlap_time on the Galaxy plan, equal devices, a link whose collectives take
    a little more than a forward's compute: with n streams each pass's compute costs (1 + STREAM_COST
    (n - 1)) and the pass takes the larger of compute' and comm plus 1 / (1 + HIDE_RATE (n - 1)) of
    the smaller."""
    R, rows = 1e10, 16
    slow = check_link({"latency_s": 0.0, "bytes_per_s": 1e7}, "slow link")
    plan = galaxy_plan((6, 6), (768, 768), (24, 24))

    def step(link, batch, streams=1):
        cost = CostModel(synthetic_model(), [device(R)] * 2, link, batch_size=batch)
        return cost.estimate(replace(plan, batch_streams=streams)).step_s
    free = step(FREE_LINK, rows)
    # a pass's collectives (each pass moves the same bytes, in proportion to the rows; the
    # once-per-step Galaxy sum cancels between the two batches)
    comm = ((step(slow, 2 * rows) - step(FREE_LINK, 2 * rows)) - (step(slow, rows) - free)) / 2
    once = step(slow, rows) - free - 2 * comm
    fwd, bwd = free / 3, 2 * free / 3                      # backward: twice the forward's FLOPs
    for n in (2, 3):
        work = [t * (1 + STREAM_COST * (n - 1)) for t in (fwd, bwd)]
        share = 1 / (1 + HIDE_RATE * (n - 1))
        want = sum(max(w, comm) + share * min(w, comm) for w in work) + once
        assert step(slow, rows, n) == pytest.approx(want, rel=1e-7)      # (the free link: 1e-8)
    assert fwd * (1 + STREAM_COST) < comm < 2 * fwd * (1 + 2 * STREAM_COST)   # a forward link-bound at 2 and 3


@pytest.mark.parametrize("bytes_per_s,streams", [(1e15, 1), (1e7, 2)])
def test_search_chooses_batch_streams_by_the_link(bytes_per_s, streams):
    """Over an unshaped link overlap only costs compute: 1 stream, 1 chunk. Over a link whose
    collectives take longer than a forward's compute, 2 streams (3 cost more compute than they
    hide; chunks hide less), and the written config's keys carry them."""
    link = check_link({"latency_s": 0.0, "bytes_per_s": bytes_per_s}, "link")
    searcher = Searcher(CostModel(synthetic_model(), [device(1e10)] * 2, link, batch_size=16), [1e6, 1e6])
    _, best = searcher.with_overlap(*searcher.evaluate(galaxy_plan((6, 6), (768, 768), (24, 24))))
    assert (best.plan.batch_streams, best.plan.comm_chunks) == (streams, 1)
    assert plan_keys(best, 6).get("batch_streams", 1) == streams and "comm_chunks" not in plan_keys(best, 6)
    assert f"{streams} 1" in table([best]).splitlines()[1]


# --- the search -----------------------------------------------------------------------------------------

def test_two_to_one_speeds_give_two_to_one_shares():
    cost = CostModel(synthetic_model(), [device(2e10), device(1e10)], FREE_LINK, batch_size=16)
    best = search(cost, [1e6, 1e6]).ranked[0].plan
    assert best.group == 2 and best.pp == best.dp == 1
    used = {"heads": best.heads if best.att == "TP" else None, "columns": best.columns if best.mlp == "TP" else None,
            "tokens": best.tokens if "SP" in (best.att, best.mlp, best.con) else None}
    want = {"heads": (8, 4), "columns": (1024, 512), "tokens": (32, 16)}
    assert any(used.values())
    for name, shares in used.items():
        if shares is not None:
            assert shares == want[name], (name, shares)


def test_a_memory_cap_moves_shares_off_the_proportional_split():
    """The fast rank cannot hold 2/3 of the weights: it gets as much as its budget allows, no more."""
    model = synthetic_model()
    per_head, per_col = 20 * 6 * PER_HEAD, 20 * 6 * PER_COLUMN          # bytes per unit: 6 layers, AdamW
    total = (12 * per_head + 1536 * per_col) / MIB
    budgets = [0.55 * total, total]                                      # proportional needs 0.67
    cost = CostModel(model, [device(2e10), device(1e10)], FREE_LINK, batch_size=16)
    res = search(cost, budgets, meshes=[(1, 1)], methods=[("TP", "TP", "SP")])
    est = res.ranked[0]
    assert est.fits(budgets)
    h0, c0 = est.plan.heads[0], est.plan.columns[0]
    assert (h0 * per_head + c0 * per_col) / MIB <= budgets[0]
    assert h0 / 12 < 2 / 3 or c0 / 1536 < 2 / 3
    assert budgets[0] - est.memory_mib[0] < per_head / MIB              # no head's worth of room left unused
    even = cost.estimate(galaxy_plan((6, 6), (768, 768), (24, 24)))
    assert est.step_s < even.step_s


def test_memory_short_of_activations_turns_on_the_fewest_recomputed_layers():
    model = synthetic_model(act_per_token=2e5)
    cost = CostModel(model, [device(1e10)], None, batch_size=8)
    plan = P(1, 1, "TP", "TP", "SP", (12,), (1536,), (48,), (6,))
    need = cost.estimate(plan).memory_mib[0]
    lean = cost.estimate(plan.with_stage_checkpoints((6,))).memory_mib[0]
    budget = (need + lean) / 2
    k = Searcher(cost, [budget]).fit_checkpointing(plan).recomputed_in_stage(0)
    assert 0 < k < 6
    assert cost.estimate(plan.with_stage_checkpoints((k,))).memory_mib[0] <= budget
    assert cost.estimate(plan.with_stage_checkpoints((k - 1,))).memory_mib[0] > budget
    best = search(cost, [budget]).ranked[0]             # the search may also cut micro-batches instead
    assert best.fits([budget]) and best.step_s <= cost.estimate(plan.with_stage_checkpoints((k,))).step_s


def test_unequal_stages_get_layers_by_speed():
    cost = CostModel(synthetic_model(), [device(2e10), device(1e10)], FREE_LINK, batch_size=16)
    best = search(cost, [1e6, 1e6], meshes=[(2, 1)]).ranked[0].plan
    assert best.stages == (4, 2)


@pytest.mark.parametrize("rates, latency", [((2e10, 1e10), 1e-4), ((2e10, 1e10), 3e-2), ((1e10, 3e10), 1e-4)])
def test_pipeline_search_finds_the_best_stage_split_and_micro_batches(rates, latency):
    """Every two-stage plan of 6 layers under either schedule, either order of the devices and
    every 1f1b warm-up, brute force: the search's best is the fastest of them. On the slow link,
    5 : 1 wins, which loads the stage that is already the slower one at the proportional 4 : 2 (the
    quick last stage and its hops then hide under the first's forwards)."""
    link = check_link({"latency_s": latency, "bytes_per_s": 1e9}, "link")
    cost = CostModel(synthetic_model(), [device(r) for r in rates], link, batch_size=8)
    found = search(cost, [1e6, 1e6], meshes=[(2, 1)]).ranked[0]
    plans = [replace(P(2, 1, "TP", "TP", "SP", (12,), (1536,), (48,), (a, 6 - a), m, schedule), rank_order=order,
                     warmup=warmup)
             for a in range(1, 6) for m in (1, 2, 4, 8) for schedule in ("1f1b", "gpipe") for order in (None, (1, 0))
             for warmup in ([None] + [(w0, w1) for w0 in range(1, m + 1) for w1 in range(1, w0 + 1)]
                            if schedule == "1f1b" else [None])
             if m >= 2 or schedule == "gpipe"]
    every = {p: cost.estimate(p).step_s for p in plans}
    assert found.step_s == pytest.approx(min(every.values()), rel=1e-12)
    if rates[0] < rates[1]:       # the quicker device first: placing pipelines is what finds it
        assert found.plan.rank_order == (1, 0)
        assert found.step_s < min(t for p, t in every.items() if p.rank_order is None)


def test_llama_heads_stay_in_whole_kv_groups():
    model = synthetic_model(heads=8, kv_heads=2, intermediate=96, seq=12)   # groups of 4 query heads
    cost = CostModel(model, [device(3e10), device(1e10)], FREE_LINK, batch_size=4)
    for est in search(cost, [1e6, 1e6], top=20).ranked:
        if est.plan.att == "TP" and est.plan.group > 1:
            assert all(h % 4 == 0 and h > 0 for h in est.plan.heads), est.plan.heads


def test_24_layers_at_world_8_search_estimates_a_bounded_number_of_plans():
    """The search's cost is the plans it estimates (about 1 ms each, 10 s at this size on a loaded
    2-core host: a wall-clock bound here would time the host, so the work is bounded instead; plan.py
    prints the seconds). About 13,000 today: 7,000 in launch order, the rest the two best pipelined
    meshes under 3 more orders of the devices (galaxy.planner.placement); the bound leaves room for
    moves, not for enumerating more orders or meshes."""
    model = synthetic_model(layers=24, heads=16, intermediate=4096, seq=128)
    model["hf_config"]["hidden_size"] = 1024
    devices = [device(r) for r in (4e10, 2e10, 2e10, 1e10, 4e10, 2e10, 3e10, 1e10)]
    cost = CostModel(model, devices, check_link({"latency_s": 5e-5, "bytes_per_s": 1e9}, "link"), batch_size=16)
    res = search(cost, [d["memory_mib"] for d in devices])
    assert res.ranked and 100 < res.tried <= 20_000


def test_proportional_split_in_whole_units():
    assert proportional(12, 1, [2, 1]) == (8, 4)
    assert proportional(8, 2, [3, 1]) == (6, 2)
    assert proportional(5, 1, [100, 1, 1]) == (3, 1, 1)
    assert sum(proportional(1536, 1, [1, 1.3, 2.2])) == 1536


# --- profile files --------------------------------------------------------------------------------------

def test_link_fit_recovers_latency_and_bandwidth():
    a, bw = 3e-5, 2e9
    measured = [{"kind": k, "group": 2, "bytes": b, "uneven": False, "seconds": a * (2 if k == "all_reduce" else 1) + b / bw}
                for k in ("all_gather", "reduce_scatter", "all_reduce") for b in (1024, 65536, 1 << 22)]
    fit = fit_link(measured)
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        assert fit[kind]["latency_s"] == pytest.approx(a, rel=1e-6)
        assert fit[kind]["bytes_per_s"] == pytest.approx(bw, rel=1e-6)
    link = check_link({"measured": measured}, "link")
    assert link["fit"]["send_recv"] == link["fit"]["all_gather"]
    assert link_time(link, "all_reduce", 4, 1e6, 2) == pytest.approx(2 * a * 6 + 1e6 / bw, rel=1e-6)


def test_link_time_reads_the_measured_points_between_their_sizes():
    # A link whose calls cost more in the middle sizes than a straight line through the ends says:
    # what a gloo link over loopback measures (its 2-parameter fit runs low at 1 MiB).
    pts = {1024: 2e-4, 1 << 18: 8e-4, 1 << 20: 1.3e-3, 1 << 22: 2.0e-3}
    measured = [{"kind": "all_reduce", "group": 2, "bytes": b, "uneven": False, "seconds": t} for b, t in pts.items()]
    measured += [{"kind": k, "group": 2, "bytes": b, "uneven": u, "seconds": t * (1.5 if u else 1)}
                 for k in ("all_gather", "reduce_scatter") for b, t in pts.items() for u in (False, True)]
    link = check_link({"measured": measured}, "link")
    fit = link["fit"]["all_reduce"]
    # two calls of 640 KiB each: 0.8 ms + (640 - 256) / (1024 - 256) of the way to 1.3 ms
    per = 8e-4 + (640 - 256) / (1024 - 256) * (1.3e-3 - 8e-4)
    assert link_time(link, "all_reduce", 2, 2 * 640 * 1024, 2) == pytest.approx(2 * per, rel=1e-9)
    assert link_time(link, "all_reduce", 2, 1 << 20, 1) == pytest.approx(1.3e-3, rel=1e-9)     # on a point
    assert link_time(link, "all_reduce", 2, 100, 1) == pytest.approx(2e-4, rel=1e-9)          # below: the smallest
    big = (1 << 22) + 1e6                                                                     # past: + the fit's bandwidth
    assert link_time(link, "all_reduce", 2, big, 1) == pytest.approx(2e-3 + 1e6 / fit["bytes_per_s"], rel=1e-9)
    # uneven shares read the padded (uneven) points; an all-reduce has none and reads the even ones
    assert link_time(link, "all_gather", 2, 1 << 20, 1, uneven=True) == pytest.approx(1.5 * 1.3e-3, rel=1e-9)
    assert link_time(link, "all_gather", 2, 1 << 20, 1) == pytest.approx(1.3e-3, rel=1e-9)
    assert link_time(link, "all_reduce", 2, 1 << 20, 1, uneven=True) == pytest.approx(1.3e-3, rel=1e-9)
    # another group size, or bytes without calls (a once-per-step volume), use the fit
    assert link_time(link, "all_reduce", 4, 1 << 20, 1) == pytest.approx(
        fit["latency_s"] * 6 + (1 << 20) / fit["bytes_per_s"], rel=1e-9)
    assert link_time(link, "all_reduce", 2, 1 << 20, 0) == pytest.approx((1 << 20) / fit["bytes_per_s"], rel=1e-9)
    # a hand-written link (no measured points) is its fit everywhere
    hand = check_link({"latency_s": 1e-4, "bytes_per_s": 1e9}, "link")
    assert link_time(hand, "all_reduce", 2, 1e6, 1) == pytest.approx(2e-4 + 1e-3, rel=1e-9)


def test_unequal_links_per_pair_by_hand():
    """Three devices through one switch, on links of 4B, B and B bytes/s (no latency): the world's
    collectives run at B; a send between ranks 0 and 1, and a collective over them alone, at 4B;
    a three-stage pipeline pays each boundary's own send, F0 + h01 + F1 + h12 + F2 + B2 + h12 + ..."""
    B = 1.25e7
    one = {"latency_s": 0.0, "bytes_per_s": B}
    pairs = [{"ranks": [0, 1], "latency_s": 0.0, "bytes_per_s": 4 * B},
             {"ranks": [0, 2], "latency_s": 0.0, "bytes_per_s": B}, {"ranks": [2, 1], "latency_s": 0.0, "bytes_per_s": B}]
    link = check_link({"fit": {k: dict(one) for k in ("all_gather", "reduce_scatter", "all_reduce", "send_recv")},
                       "pairs": pairs}, "link")
    assert link_time(link, "send_recv", 2, 1e6, 1, ranks=(1, 0)) == pytest.approx(1e6 / (4 * B), rel=1e-12)
    assert link_time(link, "send_recv", 2, 1e6, 1, ranks=(1, 2)) == pytest.approx(1e6 / B, rel=1e-12)
    assert link_time(link, "all_reduce", 2, 1e6, 3, ranks=(0, 1)) == pytest.approx(1e6 / (4 * B), rel=1e-12)
    assert link_time(link, "all_reduce", 3, 1e6, 3, ranks=(0, 1, 2)) == pytest.approx(1e6 / B, rel=1e-12)
    assert link_time(link, "all_reduce", 3, 1e6, 3) == pytest.approx(1e6 / B, rel=1e-12)    # no ranks: the world
    R, rows = 1e10, 16
    cost = CostModel(synthetic_model(), [device(R)] * 3, link, batch_size=rows)
    est = cost.estimate(P(3, 1, "TP", "TP", "SP", (12,), (1536,), (48,), (2, 2, 2), 1, "gpipe"))
    carry = rows * 48 * 384 * 4
    layers = 6 * rows * 3 * (ATT_F + MLP_F) / R
    assert est.step_s == pytest.approx(layers + 2 * (carry / (4 * B) + carry / B), rel=1e-9)
    # dp 3 replicas all-reduce over every link; a Galaxy group of ranks 0 and 1 beside a lone rank
    # is not a mesh, so a 2-rank group is timed on a 4-device world: ranks (0, 1) and (2, 3)
    quad = check_link({"fit": link["fit"], "pairs": pairs + [{"ranks": [a, 3], "latency_s": 0.0, "bytes_per_s": B}
                                                            for a in (0, 1, 2)]}, "link")
    cost4 = CostModel(synthetic_model(), [device(R)] * 4, quad, batch_size=rows)
    est4 = cost4.estimate(P(2, 1, "TP", "TP", "None", (6, 6), (768, 768), (48, 48), (3, 3), 1, "gpipe"))
    slow = CostModel(synthetic_model(), [device(R)] * 4, check_link({"fit": link["fit"]}, "link"), batch_size=rows)
    est_slow = slow.estimate(P(2, 1, "TP", "TP", "None", (6, 6), (768, 768), (48, 48), (3, 3), 1, "gpipe"))
    assert est4.step_s < est_slow.step_s          # stage 0's group is on the quick pair; stage 1's is not
    with pytest.raises(ProfileError, match=r"pairs\[0\]: 'ranks' must be two different ranks"):
        check_link({"fit": link["fit"], "pairs": [{"ranks": [1, 1], "latency_s": 0.0, "bytes_per_s": B}]}, "link")


def test_profiles_round_trip_and_compose(tmp_path):
    fast, slow = device(2e10, 4000, "fast box"), device(1e10, 2000, "slow box")
    link = {"backend": "gloo", "world": 2, "fit": {k: {"latency_s": 1e-4, "bytes_per_s": 1e9}
                                                   for k in ("all_gather", "reduce_scatter", "all_reduce", "send_recv")}}
    (tmp_path / "fast.json").write_text(json.dumps(fast))       # a device profiled alone: one DEVICE object
    write_json(str(tmp_path / "slow.json"), {"format": "galaxy-devices", "version": 1, "devices": [slow], "link": None})
    write_json(str(tmp_path / "pair.json"), {"format": "galaxy-devices", "version": 1, "devices": [fast, slow],
                                             "link": link})
    devices, got = load_devices(str(tmp_path / "pair.json"))
    assert [d["name"] for d in devices] == ["fast box", "slow box"] and got["fit"] == link["fit"]
    three = compose([str(tmp_path / "fast.json"), str(tmp_path / "slow.json"), str(tmp_path / "slow.json")],
                    str(tmp_path / "pair.json"))                 # the link taken from a 2-rank profile
    assert [d["name"] for d in three["devices"]] == ["fast box", "slow box", "slow box"]
    write_json(str(tmp_path / "three.json"), three)
    again = check_cluster(json.loads((tmp_path / "three.json").read_text()), "three.json")
    assert again["devices"] == three["devices"] and again["link"]["fit"] == link["fit"]
    with pytest.raises(ProfileError, match="give --link"):
        compose([str(tmp_path / "fast.json"), str(tmp_path / "slow.json")])
    (tmp_path / "bad.json").write_text(json.dumps(dict(fast, memory_mib=-1)))
    with pytest.raises(ProfileError, match="'memory_mib' must be a positive number"):
        compose([str(tmp_path / "bad.json")])


def test_compose_on_the_command_line(tmp_path, capsys):
    (tmp_path / "a.json").write_text(json.dumps(device(2e10, 4000, "a")))
    (tmp_path / "link.json").write_text(json.dumps({"latency_s": 5e-5, "bytes_per_s": 1e9}))
    cli.main(["profile-devices", "--compose", str(tmp_path / "a.json"), str(tmp_path / "a.json"),
              "--link", str(tmp_path / "link.json"), "--out", str(tmp_path / "c.json")])
    doc = check_cluster(json.loads((tmp_path / "c.json").read_text()), "c.json")
    assert len(doc["devices"]) == 2 and doc["link"]["fit"]["all_reduce"]["bytes_per_s"] == 1e9


# --- the CLI end to end on tiny models ------------------------------------------------------------------

def _base(tmp_path, model_dir, **extra) -> str:
    cfg = {"model_path": model_dir, "pad_size": 12, "batch_size": 4, "max_steps": 2, "timeout_s": 30, **extra}
    path = tmp_path / "base.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _devices(tmp_path, memory=(4000, 2000), rates=(2e9, 1e9), link=(1e-5, 1e9)) -> str:
    doc = {"format": "galaxy-devices", "version": 1,
           "devices": [device(r, m, f"dev{i}") for i, (r, m) in enumerate(zip(rates, memory))],
           "link": {"latency_s": link[0], "bytes_per_s": link[1]}}
    path = tmp_path / "devices.json"
    path.write_text(json.dumps(doc))
    return str(path)


def _plan(tmp_path, base, devices, *extra) -> tuple[str, str]:
    cli.main(["profile-model", "--config_file", base, "--out", str(tmp_path / "model.json")])
    out = str(tmp_path / "planned.json")
    cli.main(["search", "--config_file", base, "--devices", devices, "--model", str(tmp_path / "model.json"),
              "--out", out, *extra])
    return out, str(tmp_path / "model.json")


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_cli_profiles_searches_and_writes_a_valid_config(family, tmp_path, tiny_bert_dir, tiny_lm_dir, capsys):
    model_dir = tiny_bert_dir if family == "bert" else tiny_lm_dir("llama")
    base = _base(tmp_path, model_dir, **({"class_list": ["a", "b", "c"]} if family == "bert" else {}))
    out, model_path = _plan(tmp_path, base, _devices(tmp_path), "--png", str(tmp_path / "plan.png"))
    printed = capsys.readouterr().out
    assert "equal to the closed form" in printed and "wrote" in printed
    table = printed[printed.index(" #"):printed.index(f"wrote {out}")].splitlines()
    assert len(table) == 6                                          # the header, the best and the next four
    assert (tmp_path / "plan.png").stat().st_size > 1000
    written = json.loads(open(out).read())
    assert written["max_steps"] == 2 and written["timeout_s"] == 30    # the base's keys carried over
    cfg = apply_preset(load_config(out), "galaxy")
    shape = read_model_shape(model_dir)
    for rank in range(2):
        validate_for_world(cfg, 2, rank, shape)
    if cfg.att_parallel_method == "TP" and cfg.tp_num_attention_heads_list:
        group = shape["num_attention_heads"] // shape["num_key_value_heads"]
        assert all(h % group == 0 for h in cfg.tp_num_attention_heads_list)
    profile = json.loads(open(model_path).read())
    assert profile["profiler"]["flops_match_closed_form"] is True


def test_nothing_fits_exits_2_with_one_line(tmp_path, tiny_bert_dir, capsys):
    base = _base(tmp_path, tiny_bert_dir, class_list=["a", "b", "c"])
    with pytest.raises(SystemExit) as exit_info:
        _plan(tmp_path, base, _devices(tmp_path), "--memory_mib", "0.2", "0.1")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("plan.py search: error: no plan fits the memory budgets")
    assert "rank 0" in err[0] and "short by" in err[0] and "its budget is 0.19 MiB after 5% headroom" in err[0]
    assert not (tmp_path / "planned.json").exists()


def test_search_refuses_a_model_profile_of_another_pad_size(tmp_path, tiny_bert_dir, capsys):
    base = _base(tmp_path, tiny_bert_dir, class_list=["a", "b", "c"])
    _plan(tmp_path, base, _devices(tmp_path))
    other = _base(tmp_path, tiny_bert_dir, class_list=["a", "b", "c"], pad_size=16)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["search", "--config_file", other, "--devices", _devices(tmp_path), "--model",
                  str(tmp_path / "model.json"), "--out", str(tmp_path / "x.json")])
    assert exit_info.value.code == 2
    assert "pad_size 12" in capsys.readouterr().err


def test_search_keeps_to_the_meshes_asked_for(tmp_path, tiny_bert_dir, capsys):
    base = _base(tmp_path, tiny_bert_dir, class_list=["a", "b", "c"])

    def meshes_printed():
        out = capsys.readouterr().out
        start = out.index(" #")
        rows = out[start:out.index("wrote", start)].splitlines()[1:]
        return {row.split()[2] for row in rows}
    _plan(tmp_path, base, _devices(tmp_path), "--top", "40")
    assert meshes_printed() - {"1x1x2"}                     # unrestricted, pipelines or replicas rank too
    out, _ = _plan(tmp_path, base, _devices(tmp_path), "--top", "40", "--pp", "1", "--dp", "1")
    assert meshes_printed() == {"1x1x2"}
    written = json.loads(open(out).read())
    assert written["pp_deg"] == 1 and written["dp_deg"] == 1
    _plan(tmp_path, base, _devices(tmp_path), "--pp", "2")
    assert {m.split("x")[0] for m in meshes_printed()} == {"2"}
    with pytest.raises(SystemExit) as exit_info:
        _plan(tmp_path, base, _devices(tmp_path), "--pp", "3")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["plan.py search: error: --pp 3 does not divide the world of 2 devices; give a divisor of 2"]


# --- a searched config trains with HF's losses ---------------------------------------------------------

def test_searched_config_trains_with_hf_losses(job, tmp_path):        # noqa: F811
    """The entry-script parity test (tests/test_entry_scripts.py) with a config the planner wrote:
    two devices at speeds 2:1 and a fast link give uneven shares."""
    base, metrics_file = write_config(job, "planner-base")
    devices = _devices(tmp_path, rates=(2e9, 1e9), link=(0.0, 1e12))
    out, _ = _plan(tmp_path, base, devices)
    planned = json.loads(open(out).read())
    splits = [planned[k] for k in ("tp_num_attention_heads_list", "tp_intermediate_size_list", "seq_scatter_list")
              if k in planned]
    assert splits and all(s[0] > s[1] for s in splits), planned      # the faster rank takes more
    run_script("pretrain_galaxy.py", out, 2)
    steps = [r for r in read_metrics(metrics_file) if "step" in r and "event" not in r]
    want = hf_losses(job)
    assert len(steps) == len(want)
    for r, ref in zip(steps, want):
        assert abs(r["loss"] - ref) <= 1e-5 * abs(ref), (r["loss"], ref)


class _TimeSlicedBench:
    """A sub-block bench whose every point takes 1 ms forward and 1 ms backward, except each fourth
    call, which loses a 4 ms scheduler slice in each (a core shared with other work): 3 ms a pass
    on average. Nothing runs; the calls are counted."""
    task = "classification"
    units = {"att_tp": (4, 1), "att_sp": (8, 1), "mlp_tp": (8, 1), "mlp_sp": (8, 1), "con": (8, 1),
             "embed": (8, 1), "head": (8, 1)}

    def __init__(self):
        self.calls = {}

    def runner(self, kind, units, rows):
        key = (kind, units, rows)
        self.calls[key] = 0

        def run():
            self.calls[key] += 1
            t = 0.009 if self.calls[key] % 4 == 0 else 0.001
            return t, t
        return run


@pytest.mark.parametrize("statistic", ["median", "mean"])
def test_mean_profile_times_each_point_over_a_window_of_slices(statistic):
    bench = _TimeSlicedBench()
    table = measure_compute(bench, 8, quick=True, repeats=3, warmup=1, statistic=statistic)
    fwd = [t for kind in table["kinds"].values() for row in kind["fwd_s"] for t in row]
    if statistic == "median":            # 3 rounds after the warm-up call: 1, 1, 9 ms -> the lucky 1 ms
        assert set(bench.calls.values()) == {4}
        assert fwd == pytest.approx([0.001] * len(fwd))
    else:                                # rounds go on until a point has run MEAN_WINDOW_S (0.1 s)
        for calls in bench.calls.values():
            timed = calls - 1
            assert 0.002 * timed + 0.016 * (calls // 4) >= MEAN_WINDOW_S
            assert timed <= 3 or 0.002 * (timed - 1) + 0.016 * ((calls - 1) // 4) < MEAN_WINDOW_S
        assert fwd == pytest.approx([0.003] * len(fwd), rel=0.1)     # what a step pays on average


# --- profile-devices on a real process group ------------------------------------------------------------

def test_profile_devices_on_two_gloo_ranks(tmp_path):
    # with a tokenizer: the baseline is a process holding training's modules and tokenizer
    model_dir = make_tiny_bert_with_minilm_tokenizer(str(tmp_path / "model"), 3)
    base = _base(tmp_path, model_dir, class_list=["a", "b", "c"], distributed_backend="gloo",
                 tp_num_attention_heads_list=[1, 2, 3],               # a plan for world 3: profiling drops it
                 timeout_s=120)           # a driver started for this run imports torch while rank 0 waits
    out = tmp_path / "devices.json"
    # on the command drivers (support.script_runner): `python plan.py profile-devices ...` on each rank
    stdout = run_script(["plan.py", "profile-devices"], base, 2, "--out", str(out), "--quick")
    assert f"wrote {out}" in stdout[0]
    doc = check_cluster(json.loads(out.read_text()), str(out))
    assert len(doc["devices"]) == 2
    for d in doc["devices"]:
        assert d["memory_mib"] > 0 and d["baseline_mib"] > 0 and d["gemm_flops_per_s"] > 0
        assert d["decode_flops_per_s"] > 0          # one token's product, what decode steps are timed by
        assert d["grad_accumulate_s_per_param"] > 0 and d["optimizer_s_per_param"]["adamw"] > 0
        assert set(d["compute"]["kinds"]) == {"att_tp", "att_sp", "mlp_tp", "mlp_sp", "con", "embed", "head"}
        assert d["compute"]["model"]["pad_size"] == 12
    kinds = {m["kind"] for m in doc["link"]["measured"]}
    assert kinds == {"all_gather", "reduce_scatter", "all_reduce", "send_recv"}
    assert any(m["uneven"] for m in doc["link"]["measured"])
    for fit in doc["link"]["fit"].values():
        assert fit["bytes_per_s"] > 0 and fit["latency_s"] >= 0


def test_encoder_decoder_method_flags_are_checked_before_any_process_group(tmp_path, tiny_lm_dir, capsys):
    """BART / T5 are profiled under any one PEFT method (tests/test_planner_encdec.py); two method
    flags at once: profile-devices says so in one line, exit 2, before any process group starts."""
    command = "profile-devices"
    base = tmp_path / "t5.json"
    base.write_text(json.dumps(dict(model_path=tiny_lm_dir("t5"), pad_size=12, batch_size=3, use_lora=True,
                                    use_adapter=True)))
    capsys.readouterr()                  # the fixture's own output
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--config_file", str(base), "--out", str(tmp_path / "out.json")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"plan.py {command}: error: ") and "use_lora and use_adapter are all true" in err, err
    assert "\n" not in err
