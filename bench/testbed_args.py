"""Command-line pieces of the benches whose ranks the edge testbed starts (`python -m galaxy.edge
run ... -- python bench/X.py ...` appends --world, --rank and --init_method to every rank's
command line)."""
from __future__ import annotations


def add_rank_arguments(p) -> None:
    """--world, --rank, --init_method, as galaxy.edge run passes them (one rank alone without)."""
    p.add_argument("--world", type=int, default=1, help="set by galaxy.edge run")
    p.add_argument("--rank", type=int, default=0, help="set by galaxy.edge run")
    p.add_argument("--init_method", default=None, help="set by galaxy.edge run")


def check_plan_arguments(p, args) -> None:
    """--plans / --plan_file as the plan benches take them; p.error on a mistake."""
    if "serial" in args.plans and args.world != 1:
        p.error("--plans serial runs on one rank (a one-device cluster)")
    if not args.plans and not args.plan_file:
        p.error("name a plan: --plans or --plan_file")
    if any("=" not in f for f in args.plan_file):
        p.error("--plan_file takes NAME=CONFIG.json")
