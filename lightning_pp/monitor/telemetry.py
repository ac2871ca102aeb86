"""What :class:`~lightning_pp.monitor.callback.PipelineMonitor` reads of a running pipeline, and how it asks for a timed
step.

The strategy owns one :class:`PipelineTelemetry` (``strategy.telemetry``) for its whole life and fills it in at setup
and after each step; the monitor talks to it alone, so the monitor (a Lightning callback, like the strategy an edge of
the package) needs nothing of the strategy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from lightning_pp.schedule.actions import Schedule
from lightning_pp.schedule.timeline import TimelineEvent


class StagesOfRank(Protocol):
    """What a monitor reads of the rank's stages (the model adapter's ``StageView`` is one)."""

    stage: int  # the stage the current (or next) pass runs
    stages: tuple[int, ...]  # the rank's stages

    def blocks_of(self, stage: int) -> list[torch.nn.Module]: ...

__all__ = ["PipelineTelemetry"]


@dataclass
class PipelineTelemetry:
    """This rank's pipeline as a monitor sees it. Filled by the strategy at setup, except where noted."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # the rank's device
    stage: int = 0  # this rank's place in its pipeline
    lane: int = 0  # which copy of the pipeline this rank belongs to (data-parallel replica, tensor-parallel rank)
    object_group: Any = None  # the group for object collectives (None: the default group)
    view: StagesOfRank | None = None  # the rank's stages and their blocks; which stage a pass runs
    # set by the monitor: receives the next training step's timed events and its sample count (None: not timed)
    timing_sink: Callable[[list[TimelineEvent], int], None] | None = None
    last_schedule: Schedule | None = None  # the latest training step's schedule (set after each step)
    last_grad_sync_bytes: int = 0  # gradient bytes all-reduced at the latest optimizer step (set after each one)
    last_grad_sync_ms: float | None = None  # the gradient sync of the latest timed step (set after each timed step)
    auto_choice: Any = None  # schedule="auto"'s choice and prediction (a lightning_pp.tuning.search.Candidate), or None
    auto_first_choice: Any = None  # its choice and prediction before the closed loop measured the first steps
    auto_measured_step_s: float | None = None  # the step the closed loop measured (set at its decision)
    kept_weight_bytes: int = 0  # pipedream_2bw: the older version of the weights kept now (set at each optimizer step)
