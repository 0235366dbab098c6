"""A plan's pipeline keys checked: stages (stage_num_hidden_layers_list), micro-batches, the
schedule and its warm-ups (pipeline_warmup_list), for a model's layers and a batch; and the
placement of launched processes on the mesh (mesh_rank_order)."""
from __future__ import annotations


def pipeline_problems(plan, work) -> list[str]:
    """What is wrong with `plan`'s pipeline keys (stages, micro-batches, schedule) for `work`
    (a galaxy.plan.Workload), one line each naming the key and the fix."""
    stages, given, problems = plan.pp, plan.stages, []
    if given is not None:
        if len(given) != stages:
            problems.append(f"stage_num_hidden_layers_list has {len(given)} entries but pp_deg is "
                            f"{stages}; give one layer count per stage")
        elif sum(given) != work.layers:
            both = "" if work.target_tokens is None else " (the encoder's, then the decoder's)"
            problems.append(f"stage_num_hidden_layers_list sums to {sum(given)} but the model has "
                            f"{work.layers} layers{both}; make the entries add up to {work.layers}")
        if given and min(given) < 1:
            problems.append("stage_num_hidden_layers_list entries must be at least 1")
    elif stages > work.layers:
        problems.append(f"pp_deg {stages} exceeds the model's {work.layers} layers; use at most "
                        f"{work.layers} stages")
    if stages > 1 and plan.schedule == "1f1b" and plan.microbatches < stages:
        problems.append(f"num_microbatches is {plan.microbatches} but the 1f1b schedule needs at least "
                        f"pp_deg = {stages}; raise num_microbatches (it must divide batch_size / dp_deg) "
                        f"or set pipeline_schedule to gpipe")
    problems += warmup_problems(plan)
    even = work.rows is not None and plan.replica_rows is None
    if stages > 1 and even and (work.rows // plan.dp) % plan.microbatches:
        problems.append(f"num_microbatches {plan.microbatches} does not divide the "
                        f"{work.rows // plan.dp} rows per replica (batch_size / dp_deg); "
                        "choose a divisor")
    return problems




def warmup_problems(plan) -> list[str]:
    """pipeline_warmup_list: one count per stage, each 1..num_microbatches, never rising from one
    stage to the next (a stage that waited for more forwards than its upstream neighbour runs
    before its first backward would wait for a forward that neighbour holds back: a deadlock)."""
    w = plan.warmup
    if w is None:
        return []
    if plan.pp == 1 or plan.schedule != "1f1b":
        return [f"pipeline_warmup_list sets 1f1b's warm-up per stage, but this plan runs "
                f"{'no pipeline' if plan.pp == 1 else 'the gpipe schedule'}; remove the key"]
    if len(w) != plan.pp:
        return [f"pipeline_warmup_list has {len(w)} entries but pp_deg is {plan.pp}; give one forward count "
                f"per stage"]
    problems = []
    bad = [i for i, n in enumerate(w) if not 1 <= n <= plan.microbatches]
    if bad:
        problems.append(f"pipeline_warmup_list[{bad[0]}] is {w[bad[0]]}; each stage runs 1 to num_microbatches "
                        f"= {plan.microbatches} forwards before its first backward")
    rise = [i for i in range(1, len(w)) if w[i] > w[i - 1]]
    if rise:
        i = rise[0]
        problems.append(f"pipeline_warmup_list rises from stage {i - 1} ({w[i - 1]}) to stage {i} ({w[i]}); "
                        f"a stage may not wait for more forwards than the one before it sends ahead: make the "
                        f"list non-increasing")
    return problems


def rank_order_problems(order, world: int) -> list[str]:
    """mesh_rank_order: every launch rank 0..world-1 exactly once."""
    if order is None:
        return []
    if sorted(order) != list(range(world)):
        return [f"mesh_rank_order {list(order)} must hold every launch rank 0..{world - 1} once (mesh position i "
                f"is held by the process started as rank mesh_rank_order[i]); fix the list or remove the key"]
    return []
