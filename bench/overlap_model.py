"""The planner's overlap model against bench/overlap_paired.py's measurements (docs/planning.md,
"Overlap"): for each link and batch, the Galaxy plan's predicted step under every measured
batch_streams x comm_chunks variant (galaxy.planner.cost on a devices profile taken in that link)
beside the measured median, the variant the model ranks first and the measured fastest; then
HIDE_RATE refitted on the measurements alone (each variant's unshaped step as compute', its bytes
/ the link's rate as comm).

    .venv/bin/python bench/overlap_model.py --model MODEL.json \\
        --case 300 DEV300.json '/tmp/link/op_s300new*_b*.json' '/tmp/link/op_unshaped*_b*.json' \\
        --case 1000 DEV1G.json '/tmp/link/op_s1g*_b*.json' '/tmp/link/op_unshaped*_b*.json'

A case: the link's rate in Mbit/s, its devices profile (plan.py profile-devices inside the
testbed), the shaped runs' --json files and the unshaped runs' (globs; medians over the runs).
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from galaxy.plan import Plan                                          # noqa: E402
from galaxy.planner import overlap_time                               # noqa: E402
from galaxy.planner.cost import CostModel                             # noqa: E402
from galaxy.planner.profiles import compose                           # noqa: E402

# bench/overlap_paired.py's variants: (batch_streams, comm_chunks)
SHAPE = {"galaxy-c1": (1, 1), "galaxy-c2": (1, 2), "galaxy-c4": (1, 4),
         "galaxy-s2": (2, 1), "galaxy-s3": (3, 1), "galaxy-s4": (4, 1),
         "galaxy-s2-c2": (2, 2), "galaxy-s4-c2": (4, 2)}


def galaxy_plan(layers: int, heads: int, columns: int, tokens: int, streams: int, chunks: int) -> Plan:
    """The Galaxy preset on two equal ranks (ATT TP, MLP TP, CON SP, even shares), as the bench runs it."""
    half = lambda n: (n // 2, n - n // 2)                             # noqa: E731
    return Plan(att="TP", mlp="TP", con="SP", pp=1, dp=1, heads=half(heads), columns=half(columns),
                tokens=half(tokens), stages=(layers,), microbatches=1, schedule="1f1b", checkpoint=(),
                dp_sharding="none", batch_streams=streams, comm_chunks=chunks)


def medians(pattern: str) -> dict:
    """{(batch, variant): median over the files of each file's median step, seconds}."""
    runs = defaultdict(list)
    for f in sorted(glob.glob(pattern)):
        doc = json.loads(Path(f).read_text())
        for variant, row in doc["rows"].items():
            runs[doc["args"]["batch_size"], variant].append(row["median_ms"] / 1e3)
    return {k: statistics.median(v) for k, v in runs.items()}


def pass_rule(compute: float, comm: float, streams: int, chunks: int, rate: float) -> float:
    """One pass under galaxy.planner.overlap_time's rule, HIDE_RATE = rate."""
    h = (streams - 1) + (chunks - 1) / chunks
    return max(compute, comm) + min(compute, comm) / (1 + rate * h)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model profile (plan.py profile-model)")
    ap.add_argument("--case", nargs=4, action="append", required=True,
                    metavar=("MBIT", "DEVICES", "SHAPED_GLOB", "UNSHAPED_GLOB"))
    args = ap.parse_args(argv)
    model = json.loads(Path(args.model).read_text())
    hf = model["hf_config"]
    dims = (hf["num_hidden_layers"], hf["num_attention_heads"], hf["intermediate_size"], model["pad_size"])
    fit_rows = []                               # (compute', comm, streams, chunks, measured step)
    for mbit, devices, shaped_glob, unshaped_glob in args.case:
        clus = compose([devices], None)
        shaped, unshaped = medians(shaped_glob), medians(unshaped_glob)
        for batch in sorted({b for b, _ in shaped}):
            cost = CostModel(model, clus["devices"], clus["link"], batch_size=batch)
            cells, pred, meas = [], {}, {}
            for variant, (n, c) in SHAPE.items():
                if (batch, variant) not in shaped or n > batch:
                    continue
                est = cost.estimate(galaxy_plan(*dims, n, c))
                pred[variant], meas[variant] = est.step_s, shaped[batch, variant]
                cells.append(f"{variant[7:]} {1e3 * est.step_s:5.0f}/{1e3 * meas[variant]:5.0f} "
                             f"{est.step_s / meas[variant]:.2f}")
                if (batch, variant) in unshaped:
                    comm = max(est.sent_bytes) * 8 / (float(mbit) * 1e6)
                    fit_rows.append((unshaped[batch, variant], comm, n, c, meas[variant]))
            print(f"{mbit:>5} Mbit/s batch {batch}: predicted/measured ms  " + "   ".join(cells))
            print(f"{'':>20} model ranks first {min(pred, key=pred.get)[7:]}, measured fastest "
                  f"{min(meas, key=meas.get)[7:]} ({meas[min(pred, key=pred.get)] / min(meas.values()):.3f} of it)")
    if fit_rows:
        def sq(rate):
            return sum(math.log(sum(pass_rule(cp * w, cm / 2, n, c, rate) for w in (1 / 3, 2 / 3)) / m) ** 2
                       for cp, cm, n, c, m in fit_rows)
        best = min((r / 10 for r in range(10, 200)), key=sq)
        print(f"HIDE_RATE refitted on {len(fit_rows)} medians (forward 1/3 of compute', each pass half "
              f"the comm): {best:.1f}, rms {100 * math.sqrt(sq(best) / len(fit_rows)):.0f}% "
              f"(in use: {overlap_time.HIDE_RATE})")


if __name__ == "__main__":
    main()
