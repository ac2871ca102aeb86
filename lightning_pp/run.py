"""What the strategy's setup resolves for one Trainer run, built once (:class:`RunContext`) and passed to what
assembles and runs the stage, instead of long argument lists. May import: ``options``, ``parallel``."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision

from lightning_pp.options import PipelineOptions
from lightning_pp.parallel.topology import PipelineLayout

__all__ = ["RunContext"]


@dataclass(frozen=True)
class RunContext:
    """One Trainer run (fit, validate, test or predict) on this rank, as setup resolved it."""

    options: PipelineOptions
    """Concrete: the user's, with ``schedule="auto"`` made concrete once chosen (the strategy keeps the user's as
    given)."""
    layout: PipelineLayout
    rank: int
    """This process's global rank."""
    device: torch.device
    trainer: pl.Trainer
    precision: Precision
    fitting: bool
    new_group: Callable[[list[int]], Any]
    """Creates a process group of the job's backend over the given global ranks."""
    collective: Callable[[str], AbstractContextManager[None]]
    """Wraps a collective so that a failure or a peer's is raised naming it."""
    object_group: Callable[[], Any]
    """The group for object collectives now (None: the default group)."""
    auto: Any = None
    """``schedule="auto"``'s choice made for this run, with its closed loop (a
    :class:`~lightning_pp.tuning.closed_loop.AutoChoice`; None: the options were concrete)."""

    @property
    def microbatches(self) -> int:
        """Micro-batches of a full batch: the option, or twice the ranks per pipeline."""
        return self.options.microbatches if self.options.microbatches is not None else 2 * self.layout.num_stages

    @property
    def stage(self) -> int:
        """This rank's position in its pipeline."""
        return self.layout.stage_of(self.rank)
