"""Pipeline parallelism on torch.distributed.pipelining: stage split, stage module, runner."""
from galaxy.pipeline.runner import PipelineRunner

__all__ = ["PipelineRunner"]
