"""FLOPs, latency, activation and communication accounting of one training step.

    from galaxy.profiler import profile_model
    report = profile_model(model, batch, grad_sync=sync)      # a ProfileReport
    report.totals.fwd_flops, report.sub_blocks, report.comm, report.to_json()

See docs/profiling.md for the counting convention and the JSON schema.
"""
from galaxy.distributed.comm_bytes import plan_comm_bytes, ring_bytes
from galaxy.models.bert import bert_matmul_flops, bert_plan_comm_bytes
from galaxy.models.llama import llama_matmul_flops, llama_plan_comm_bytes
from galaxy.profiler.comm import CommRecorder
from galaxy.profiler.profile import loss_of, profile_model
from galaxy.profiler.report import ModuleStats, ProfileReport, SubBlockStats, Totals
from galaxy.profiler.table import comm_table, module_table, sub_block_table, summary

__all__ = ["profile_model", "loss_of", "ProfileReport", "ModuleStats", "SubBlockStats", "Totals",
           "CommRecorder", "ring_bytes", "bert_matmul_flops", "llama_matmul_flops", "plan_comm_bytes",
           "bert_plan_comm_bytes", "llama_plan_comm_bytes", "module_table", "sub_block_table", "comm_table", "summary"]
