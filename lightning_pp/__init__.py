"""lightning_pp: pipeline parallelism for PyTorch Lightning, by changing only the Trainer's strategy."""

from lightning_pp.errors import (
    PipelineBatchError,
    PipelineCheckpointError,
    PipelineCommError,
    PipelineConfigError,
    PipelineScheduleError,
    PipelineTimeoutError,
)
from lightning_pp.monitor import PipelineMonitor
from lightning_pp.strategy import PipelineParallelStrategy
from lightning_pp.topology import PipelineLayout

__all__ = [
    "PipelineBatchError",
    "PipelineCheckpointError",
    "PipelineCommError",
    "PipelineConfigError",
    "PipelineLayout",
    "PipelineMonitor",
    "PipelineParallelStrategy",
    "PipelineScheduleError",
    "PipelineTimeoutError",
]
