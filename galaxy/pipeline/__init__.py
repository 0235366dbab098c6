"""Pipeline parallelism on torch.distributed.pipelining: stage split, stage module, runner."""
from galaxy.pipeline.build import build_pipeline, build_runner
from galaxy.pipeline.runner import PipelineRunner

__all__ = ["PipelineRunner", "build_pipeline", "build_runner"]
