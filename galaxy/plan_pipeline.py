"""A plan's pipeline keys checked: stages (stage_num_hidden_layers_list), micro-batches and the
schedule, for a model's layers and a batch."""
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
    even = work.rows is not None and plan.replica_rows is None
    if stages > 1 and even and (work.rows // plan.dp) % plan.microbatches:
        problems.append(f"num_microbatches {plan.microbatches} does not divide the "
                        f"{work.rows // plan.dp} rows per replica (batch_size / dp_deg); "
                        "choose a divisor")
    return problems


