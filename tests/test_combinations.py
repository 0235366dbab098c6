"""Every valid config trains: the combination test (docs/testing.md, "The combination test").

Over the config space of tests/support/combinations.py (family x optimizer x PEFT method x mesh
x activation checkpointing x mixed precision x gradient accumulation x clipping x communication
overlap), rows in which every pair of values of every two factors meets (tests/support/covering.py)
run as users run them, from the entry scripts (the shared command drivers, torch imported once per
driver). A row either trains 2 steps with finite losses equal to the serial run of the same config
(within 1e-5 in fp32, dropout off; 2e-2 under bf16), or holds a pair Galaxy refuses
(combinations.REFUSED) and exits 2 before any process group starts, one "error:" line per problem,
the expected one among them. Any other outcome fails the test, naming the row.

Combinations the whole product found failing (combinations.FOUND) run too.
GALAXY_COMBINATIONS=all runs the whole product instead of the pairs, and
GALAXY_COMBINATIONS_SHARD=i/n only its i-th of n slices (for several machines).
"""
import itertools
import math
import os
import time

import pytest

from support import combinations as space
from support.covering import all_pairs, pairwise, product
from support.script_runner import run_scripts

from galaxy.train.metrics import read_metrics


def chosen_rows() -> list[dict]:
    """The rows to run: pairwise (or the whole product), the refused pairs in rows of their own."""
    if os.environ.get("GALAXY_COMBINATIONS", "pairs") == "all":
        rows = product(space.FACTORS)
    else:
        rows = pairwise(space.FACTORS, set(space.REFUSED))
        for (a, b) in space.REFUSED:      # the first row with one value, given the other
            rows.append({**next(r for r in rows if r[a[0]] == a[1]), b[0]: b[1]})
        rows += space.FOUND
    shard = os.environ.get("GALAXY_COMBINATIONS_SHARD")
    if shard:
        i, n = map(int, shard.split("/"))
        rows = rows[i::n]
    return rows


def jobs_of(rows: list[dict], models: dict, folder) -> list[tuple[str, dict]]:
    """(job name, {"row", "job", "metrics"}) for every row and every serial twin a row needs, the
    two-rank jobs first so that the one-rank ones run two at a time."""
    wanted = {space.name(r): r for r in rows}
    for row in rows:
        if row["mesh"] != "serial" and space.refusal(row) is None:
            twin = space.serial_twin(row)
            wanted.setdefault(space.name(twin), twin)
    jobs = []
    for key, row in wanted.items():
        script, config, world, metrics = space.config(row, models[row["family"]], str(folder))
        jobs.append((key, {"row": row, "job": (script, config, world), "metrics": metrics}))
    return sorted(jobs, key=lambda item: -item[1]["job"][2])


def judge(row: dict, outcome: list[tuple], metrics: str, script: str) -> str | None:
    """What is wrong with how the row ran (None: nothing), in one line of facts."""
    expected = space.refusal(row)
    codes = [code for code, _, _ in outcome]
    errors = [line for _, _, err in outcome for line in err.splitlines() if line.startswith(f"{script}: error: ")]
    tail = " | ".join(outcome[0][2].strip().splitlines()[-3:])
    if expected is not None:
        if codes != [2] * len(codes) or any("Traceback" in err for _, _, err in outcome):
            return f"should be refused with '{expected}', exited {codes}: {tail}"
        if not any(expected in line for line in errors):
            return f"refused without '{expected}': {errors}"
        return None
    if codes != [0] * len(codes):
        return f"exited {codes}: {tail}"
    losses = [r["loss"] for r in read_metrics(metrics) if "step" in r and "event" not in r]
    if len(losses) != space.STEPS or not all(math.isfinite(x) for x in losses):
        return f"losses {losses}"
    return None


def compare(row: dict, losses: dict) -> str | None:
    """Against the serial twin's losses, within combinations.tolerance."""
    if row["mesh"] == "serial" or space.refusal(row) is not None:
        return None
    ours, ref = losses[space.name(row)], losses.get(space.name(space.serial_twin(row)))
    if ref is None:
        return "its serial twin did not train"
    off = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(ours, ref))
    return None if off <= space.tolerance(row) else f"losses {ours} off the serial run's {ref} by {off:.2e}"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return space.make_models(str(tmp_path_factory.mktemp("combination_models")))


def test_every_combination_trains_or_is_refused(models, tmp_path):
    rows, start = chosen_rows(), time.perf_counter()
    jobs = jobs_of(rows, models, tmp_path)
    # Without matplotlib (run_scripts' default) the trainer skips its loss plot: 0.7 s of a 1.5 s run.
    outcomes = run_scripts([job["job"] for _, job in jobs], timeout=300)
    failures, losses = [], {}
    for (key, job), outcome in zip(jobs, outcomes):
        problem = judge(job["row"], outcome, job["metrics"], job["job"][0])
        if problem is None and space.refusal(job["row"]) is None:
            losses[key] = [r["loss"] for r in read_metrics(job["metrics"]) if "step" in r and "event" not in r]
        failures += [f"{key}: {problem}"] if problem else []
        print(key, [c for c, _, _ in outcome], losses.get(key))
    failures += [f"{space.name(r)}: {p}" for r in rows
                 if space.name(r) in losses and (p := compare(r, losses)) is not None]
    print(f"{len(rows)} combinations, {len(jobs)} runs, {time.perf_counter() - start:.0f} s")
    assert not failures, f"{len(failures)} of {len(rows)} combinations failed:\n" + "\n".join(failures)


def test_pairwise_rows_hold_every_allowed_pair_and_no_refused_one():
    forbidden = set(space.REFUSED)
    rows = pairwise(space.FACTORS, forbidden)
    met = {pair for row in rows for pair in itertools.combinations(row.items(), 2)}
    assert set(all_pairs(space.FACTORS, forbidden)) <= met
    assert not met & forbidden
    assert rows == pairwise(space.FACTORS, forbidden)                  # deterministic
    assert len(rows) == 30 == len(space.FACTORS["mesh"]) * len(space.FACTORS["peft"])   # the least possible
    assert len(product(space.FACTORS, forbidden)) == math.prod(map(len, space.FACTORS.values())) * 11 // 12
