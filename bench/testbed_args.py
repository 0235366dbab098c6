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


def start_ranks(args) -> None:
    """This rank's gloo process group (the testbed's rendezvous, or a one-rank group through a
    file); with args.comm_wait, waits that poll or block as the scripts' launch chooses them."""
    import tempfile

    import torch.distributed as dist

    if args.init_method:
        from galaxy.distributed.interface import bind_to_rendezvous
        bind_to_rendezvous(args.init_method)
    init = args.init_method or f"file://{tempfile.mkstemp()[1]}"
    dist.init_process_group("gloo", init_method=init, world_size=args.world, rank=args.rank)
    if getattr(args, "comm_wait", None) is not None:
        from galaxy.distributed import waiting       # a sleeping waiter wakes late
        from galaxy.launch import ranks_and_cores_on_this_host
        waiting.set_polling(waiting.choose_poll(args.comm_wait, "gloo", *ranks_and_cores_on_this_host()))


def start_plan_bench(p):
    """The plan benches' start: the rank arguments added, the command line parsed and its plans
    checked, torch's threads set (args.threads) and this rank's process group started; -> args."""
    import torch

    add_rank_arguments(p)
    args = p.parse_args()
    check_plan_arguments(p, args)
    torch.set_num_threads(args.threads)
    start_ranks(args)
    return args
