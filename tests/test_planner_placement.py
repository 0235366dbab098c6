"""The planner's placement of devices on the mesh (mesh_rank_order) and 1f1b's warm-ups per stage
(pipeline_warmup_list): the pipeline timeline by hand, a placed plan against the same plan on
devices listed in that order, and the memory a deeper warm-up holds."""
from dataclasses import replace

import pytest
from test_planner import FREE_LINK, P, device, synthetic_model  # noqa: F401

from galaxy.planner.cost import CostModel
from galaxy.planner.pipeline_time import stage_ends
from galaxy.planner.placement import device_orders, placed_link
from galaxy.planner.profiles import check_link
from galaxy.planner.warmup import cover, normal


def test_warmups_change_the_timeline_as_worked_by_hand():
    """Two stages, F = B = 1 s, a 1 s hop, 2 micro-batches. Torch's warm-ups (2, 1): stage 0 runs F0
    [0, 1] and F1 [1, 2]; stage 1 F0 [2, 3], B0 [3, 4], F1 [4, 5], B1 [5, 6]; B0 reaches stage 0
    at 5 and B1 at 7: it ends at 8. Warm-ups (1, 1): stage 0 waits for B0 before F1, so F1 [6, 7]
    reaches stage 1 at 8: it ends at 10 and stage 0 at 12."""
    assert stage_ends((1.0, 1.0), (1.0, 1.0), 1.0, 2, "1f1b") == (8.0, 6.0)
    assert stage_ends((1.0, 1.0), (1.0, 1.0), 1.0, 2, "1f1b", (2, 1)) == (8.0, 6.0)
    assert stage_ends((1.0, 1.0), (1.0, 1.0), 1.0, 2, "1f1b", (1, 1)) == (12.0, 10.0)


def test_warmups_are_made_non_increasing_and_torchs_is_none():
    assert normal((2, 5, 1), 3, 8) == (5, 5, 1)       # a stage waits for no more than its upstream sends
    assert normal((3, 2, 1), 3, 8) is None             # torch's own: pp - p
    assert normal((9, 3, 1), 3, 4) == (4, 3, 1)        # at most m
    # the round trip below stage 0: stage 1's F + B (3 s) and two hops of 0.5 s, over its own 2 s (F + B)
    # in the steady state (1 + 4 / 2 = 3), over its forward of 0.5 s before the first backward (1 + 4 / 0.5 = 9)
    passes = [(0.5, 1.5, 0.5), (1.0, 2.0, 0.0)]
    assert cover(passes, True) == [3, 1] and cover(passes, False) == [9, 1]


def test_a_placed_plan_is_the_plan_on_devices_listed_in_that_order():
    """Mesh position i holds launch rank order[i]: the estimate equals the unplaced plan's on a cost
    model over the devices (and link pairs) in that order, every per-rank figure handed back by
    launch rank."""
    link = check_link({"latency_s": 1e-3, "bytes_per_s": 1e8, "pairs": [
        {"ranks": [0, 1], "latency_s": 1e-3, "bytes_per_s": 1e8}, {"ranks": [0, 2], "latency_s": 2e-3, "bytes_per_s": 3e7},
        {"ranks": [1, 2], "latency_s": 1e-3, "bytes_per_s": 5e7}]}, "link")
    devices = [device(3e10, name="quick"), device(1e10, name="slow"), device(2e10, name="middle")]
    model = synthetic_model(act_per_token=1000.0)
    order = (1, 2, 0)
    cost = CostModel(model, devices, link, batch_size=6)
    there = CostModel(model, [devices[i] for i in order], placed_link(link, order), batch_size=6)
    plan = P(3, 1, "TP", "TP", "SP", (12,), (1536,), (48,), (1, 2, 3), 6, "1f1b")
    placed, unplaced = cost.estimate(replace(plan, rank_order=order)), there.estimate(plan)
    assert placed.step_s == unplaced.step_s
    for name in ("memory_mib", "compute_s", "sent_bytes"):
        mine, theirs = getattr(placed, name), getattr(unplaced, name)
        assert [mine[rank] for rank in order] == theirs
    assert cost.estimate_memory(replace(plan, rank_order=order)) == placed.memory_mib
    assert cost.stage_ranks(replace(plan, rank_order=order), 0) == [1]
    assert placed.step_s != cost.estimate(plan).step_s        # the order matters here


def test_orders_of_identical_devices_are_searched_once():
    same = CostModel(synthetic_model(), [device(1e10)] * 3, FREE_LINK, batch_size=6)
    assert device_orders(same) == [(0, 1, 2)]
    mixed = CostModel(synthetic_model(), [device(1e10), device(1e10), device(2e10)], FREE_LINK, batch_size=6)
    assert device_orders(mixed) == [(0, 1, 2), (0, 2, 1), (2, 0, 1)]


def test_a_deeper_warm_up_holds_as_many_micro_batches_as_gpipe():
    """Stage 0 running all m forwards first holds m micro-batches' activations, as gpipe does; torch's
    warm-up holds pp of them."""
    cost = CostModel(synthetic_model(act_per_token=4096.0), [device(1e10)] * 2, FREE_LINK, batch_size=8)
    one = P(2, 1, "TP", "TP", "SP", (12,), (1536,), (48,), (3, 3), 8, "1f1b")
    deep = cost.estimate_memory(replace(one, warmup=(8, 1)))[0]
    assert deep == pytest.approx(cost.estimate_memory(replace(one, schedule="gpipe"))[0], rel=1e-12)
    assert deep > cost.estimate_memory(one)[0]
