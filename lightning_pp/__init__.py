"""lightning_pp: pipeline parallelism for PyTorch Lightning, by changing only the Trainer's strategy."""

from lightning_pp.errors import PipelineCommError, PipelineConfigError, PipelineScheduleError, PipelineTimeoutError
from lightning_pp.monitor import PipelineMonitor
from lightning_pp.strategy import PipelineParallelStrategy

__all__ = [
    "PipelineCommError",
    "PipelineConfigError",
    "PipelineMonitor",
    "PipelineParallelStrategy",
    "PipelineScheduleError",
    "PipelineTimeoutError",
]
