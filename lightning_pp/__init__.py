"""lightning_pp: pipeline parallelism for PyTorch Lightning, by changing only the Trainer's strategy.

What ``__all__`` names is the public API; every other module and name may change between releases."""

from lightning_pp._logging import configure as _configure_logging
from lightning_pp.errors import (
    PipelineBatchError,
    PipelineCheckpointError,
    PipelineCommError,
    PipelineConfigError,
    PipelineScheduleError,
    PipelineTimeoutError,
)
from lightning_pp.monitor.callback import PipelineMonitor
from lightning_pp.options import PipelineOptions
from lightning_pp.parallel.topology import PipelineLayout
from lightning_pp.runtime.microbatch import whole
from lightning_pp.strategy import PipelineParallelStrategy

__all__ = [
    "PipelineBatchError",
    "PipelineCheckpointError",
    "PipelineCommError",
    "PipelineConfigError",
    "PipelineLayout",
    "PipelineMonitor",
    "PipelineOptions",
    "PipelineParallelStrategy",
    "PipelineScheduleError",
    "PipelineTimeoutError",
    "__version__",
    "whole",
]

__version__ = "0.1.0"

_configure_logging()
