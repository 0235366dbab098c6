"""Pipeline parallelism on torch.distributed.pipelining: stage split, stage module, runner.

The runner (galaxy.pipeline.runner) is imported where a pipeline is built, not here: its
torch.distributed.pipelining import costs about as much as torch's own, and the stage helpers
in this package are read by every run (checkpoints, exports).
"""
