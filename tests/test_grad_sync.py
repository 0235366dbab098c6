"""GradientSync's buckets started during backward give exactly the synchronous sums.

World 2, tiny BERT under ATT SP / MLP SP / CON SP (every weight is a "sum" parameter), a bucket
cap small enough for several buckets. One model syncs with early starts, a twin without; per
step both run the same backward passes (1, 1, 2 accumulated, 2, 2, 1) and must end with identical
gradients. Checked along the way: buckets start inside backward once the number of passes per
step is known (never in the first step, nor in the first step after it changes), each step
issues one all-reduce per bucket when nothing is redone, and a gradient changed after backward
(as DDP's write-back does) is caught: the bucket is redone and early starts switch off.
"""

from support.parity import world_group
from support.tiny_models import tiny_batch

from galaxy.parallel.grad_sync import GradientSync
from galaxy.plan import Plan
from galaxy.profiler.comm import CommRecorder
from galaxy.runtime.assemble import build_model

PASSES = (1, 1, 2, 2, 2, 1)
TAMPER_STEP = 4


def early_vs_synchronous(model_dir):
    group = world_group((3, 3), (48, 48), (7, 5))
    plan = Plan("SP", "SP", "SP")
    early, plain = (build_model(model_dir, plan, group, num_labels=3, dropout=0.0) for _ in range(2))
    cap = 12_000 * 4                               # a layer is ~19k elements: one bucket per layer
    sync_e = GradientSync(early, group.pg, bucket_cap_bytes=cap)
    sync_p = GradientSync(plain, group.pg, bucket_cap_bytes=cap, overlap=False)
    out = {"buckets": len(sync_e.buckets), "steps": []}
    for step, passes in enumerate(PASSES):
        with CommRecorder() as rec:
            for i in range(passes):
                batch = tiny_batch(seed=10 * step + i)
                rec.phase = "backward"
                early(**batch)[1].backward()
                plain(**batch)[1].backward()
            if step == TAMPER_STEP:                # a write-back after backward, as DDP's
                for m in (early, plain):
                    m.layers[0].att.query.weight.grad.mul_(2)
            rec.phase = "grad_sync"
            sync_e()
        sync_p()
        worst = max((a.grad - b.grad).abs().max().item()
                    for a, b in zip(early.parameters(), plain.parameters()) if a.grad is not None)
        by_phase = rec.stats.to_dict()["by_phase"]
        # Under this plan the only all-reduces are the gradient sync's (both twins' K/V gathers
        # are all-gathers and reduce-scatters); the twin's sync runs outside the recorder.
        started = by_phase.get("backward", {}).get("all_reduce", {}).get("calls", 0)
        at_call = by_phase.get("grad_sync", {}).get("all_reduce", {}).get("calls", 0)
        out["steps"].append({"worst": worst, "started": started, "at_call": at_call,
                             "overlap": sync_e.overlap})
        for m in (early, plain):
            m.zero_grad(set_to_none=True)
    return out


def test_early_starts_equal_synchronous_sums(dist_pool, tiny_bert_dir):
    for rank, out in enumerate(dist_pool(2).run(early_vs_synchronous, tiny_bert_dir)):
        n, steps = out["buckets"], out["steps"]
        assert n >= 2, "the test needs several buckets"
        for k, s in enumerate(steps):
            assert s["worst"] == 0.0, (rank, k, s)
        # Step 0: passes unknown; step 2: started after its first pass of 2 (1 was learned), redone;
        # step 4: one bucket's gradient changed after backward, redone, early starts off after it.
        assert [s["started"] for s in steps] == [0, n, n, n, n, 0], (rank, steps)
        assert [s["at_call"] for s in steps] == [n, 0, n, 0, 1, n], (rank, steps)
        assert [s["overlap"] for s in steps] == [True] * 4 + [False] * 2, (rank, steps)
