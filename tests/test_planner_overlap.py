"""galaxy.planner's overlap model on profiles recorded inside the edge testbed (tests/profiles/:
two one-core devices joined at 300 Mbit/s, `plan.py profile-devices --quick` at 8 x 128, and
all-MiniLM-L6-v2's model profile): the predicted step of the Galaxy plan under every
batch_streams x comm_chunks, worked out here from the profile's own table and link figures, and
the search's pick."""
import json
import pathlib

import pytest

from galaxy.plan import Plan
from galaxy.planner.cost import CostModel
from galaxy.planner.device_compute import DeviceCompute
from galaxy.planner.link_model import link_time
from galaxy.planner.overlap_time import CHUNK_COST, HIDE_RATE, STREAM_COST, overlap_choices
from galaxy.planner.profiles import check_link, compose
from galaxy.planner.search import Searcher

PROFILES = pathlib.Path(__file__).parent / "profiles"
DEVICES = str(PROFILES / "edge_two_equal_300m_quick.json")
MODEL = json.loads((PROFILES / "minilm_pad128_model.json").read_text())
FREE = check_link({"latency_s": 0.0, "bytes_per_s": 1e15}, "free link")
HEADS, COLUMNS, TOKENS, LAYERS = 6, 768, 64, 6
GALAXY = Plan(att="TP", mlp="TP", con="SP", pp=1, dp=1, heads=(HEADS,) * 2, columns=(COLUMNS,) * 2,
              tokens=(TOKENS,) * 2, stages=(LAYERS,), microbatches=1, schedule="1f1b", checkpoint=(),
              dp_sharding="none")


def cluster():
    clus = compose([DEVICES], None)
    return clus["devices"], clus["link"]


def table_seconds(device: dict, kind: str, units: int, rows: int) -> tuple[float, float]:
    """The --quick table's (fwd, bwd) at a measured share, taken at 8 rows: in proportion to rows."""
    t = device["compute"]["kinds"][kind]
    (measured,) = device["compute"]["rows"]
    i = t["units"].index(units)
    return t["fwd_s"][i][0] * rows / measured, t["bwd_s"][i][0] * rows / measured


def pass_compute(devices, rows: int) -> tuple[float, float]:
    """Forward and backward of one step, the slower device at every sub-block (ATT, CON, MLP, CON)
    of the 6 layers, then the embeddings and the head."""
    fwd = bwd = 0.0
    for kind, units in (("att_tp", HEADS), ("con", TOKENS), ("mlp_tp", COLUMNS), ("con", TOKENS)):
        times = [table_seconds(d, kind, units, rows) for d in devices]
        fwd += LAYERS * max(t[0] for t in times)
        bwd += LAYERS * max(t[1] for t in times)
    for kind in ("embed", "head"):
        times = [table_seconds(d, kind, 128, rows) for d in devices]
        fwd, bwd = fwd + max(t[0] for t in times), bwd + max(t[1] for t in times)
    return fwd, bwd


def pass_comm(cost, link, rows: int) -> tuple[float, float]:
    """One pass's boundary collectives, half of each kind's calls and bytes of the 6 layers (the
    model's closed forms): (their time on the profiled link, of it the bytes at the link fit's rate)."""
    forms = cost.comm(GALAXY.att, GALAXY.mlp, GALAXY.con, GALAXY.tokens)
    wire_bytes = {kind: rows * (LAYERS * f["a_layer"] + f["a_fixed"]) for kind, f in forms.items()}
    comm = sum(0.5 * link_time(link, kind, 2, wire_bytes[kind], LAYERS * f["c_layer"] + f["c_fixed"])
               for kind, f in forms.items())
    return comm, sum(0.5 * b / link["fit"][kind]["bytes_per_s"] for kind, b in wire_bytes.items())


def test_a_one_row_table_costs_other_batches_in_proportion_to_rows():
    """A --quick profile measures the config's batch only (8 rows): batch 2 takes a quarter of it,
    not all of it (the old constant made batch 2's compute batch 8's)."""
    devices, _ = cluster()
    dc = DeviceCompute(devices[0], MODEL, use_tables=True)
    for rows in (1, 2, 4, 8, 16):
        assert dc("mlp_tp", COLUMNS, rows) == pytest.approx(table_seconds(devices[0], "mlp_tp", COLUMNS, rows), rel=1e-12)


@pytest.mark.parametrize("batch", [2, 4, 8])
def test_recorded_profile_step_and_pick_follow_the_pass_rule(batch):
    """Each pass takes cpu + max(compute', wire) + min(compute', wire) / (1 + HIDE_RATE h): compute'
    the pass's table compute times the streams' and chunks' costs, wire its collectives' bytes at
    the link's rate, cpu the rest of their time; the once-per-step work (optimizer, the Galaxy sum)
    is what the one-stream plan adds to its two passes. The search picks the least."""
    devices, link = cluster()
    cost, free = (CostModel(MODEL, devices, lk, batch_size=batch) for lk in (link, FREE))
    fwd, bwd = pass_compute(devices, batch)
    comm, wire = pass_comm(cost, link, batch)
    assert 0 < wire < comm
    once = cost.estimate(GALAXY).step_s - (fwd + comm) - (bwd + comm)
    assert 0 <= once < 0.1 * (fwd + bwd)          # the optimizer and the sum's one all-reduce
    want = {}
    for trial in overlap_choices(GALAXY, batch):
        n, c = trial.batch_streams, trial.comm_chunks
        share = 1 / (1 + HIDE_RATE * ((n - 1) + (c - 1) / c))
        scale = (1 + STREAM_COST * (n - 1)) * (1 + CHUNK_COST * (c - 1))
        want[n, c] = sum(comm - wire + max(w * scale, wire) + share * min(w * scale, wire) for w in (fwd, bwd)) + once
        assert cost.estimate(trial).step_s == pytest.approx(want[n, c], rel=1e-9)
    assert free.estimate(GALAXY).step_s == pytest.approx(fwd + bwd + once, rel=0.02)   # the sum's call, ~free
    searcher = Searcher(cost, [1e6, 1e6])
    _, best = searcher.with_overlap(*searcher.evaluate(GALAXY))
    assert (best.plan.batch_streams, best.plan.comm_chunks) == min(want, key=want.get)
    assert best.step_s == pytest.approx(min(want.values()), rel=1e-9)


def test_more_streams_win_where_the_link_outlasts_compute():
    """At 300 Mbit/s the link time of a batch-8 step (~1 s) exceeds its compute, and every extra
    stream's exposed share falls by more than its 13% of compute costs: the recorded profile picks
    4 streams (measured fastest there, 1107-1121 ms against 2 streams' 1161-1182), 2 at batch 2
    where the rows allow no more."""
    devices, link = cluster()
    for batch, streams in ((8, 4), (2, 2)):
        searcher = Searcher(CostModel(MODEL, devices, link, batch_size=batch), [1e6, 1e6])
        _, best = searcher.with_overlap(*searcher.evaluate(GALAXY))
        assert best.plan.batch_streams == streams
