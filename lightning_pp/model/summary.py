"""The model summary Lightning prints when ``fit`` starts, for the whole pipelined model.

Lightning's ``ModelSummary`` callback counts the parameters of the module it is given; on a pipeline stage that is the
stage's own (global rank 0 prints stage 0's). Here each layer's count, the totals and the model's size are those of the
whole model: every rank names its parameters and their sizes, the names are gathered, and a parameter several stages
hold (a tied embedding and head) counts once, as on one device. Rank 0 then logs each stage's own count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelSummary as ModelSummaryCallback
from lightning.pytorch.utilities.model_summary import ModelSummary, get_human_readable_count

from lightning_pp import _compat
from lightning_pp._logging import get_logger

__all__ = ["PipelineSummary", "summarize_whole_model"]

log = get_logger(__name__)


class PipelineSummary(ModelSummary):
    """Lightning's summary of ``model`` with the parameter counts of ``held``: every parameter of the whole model by
    name, as (elements, trainable)."""

    def __init__(self, model: pl.LightningModule, max_depth: int, held: dict[str, tuple[int, bool]]) -> None:
        self._held = held
        super().__init__(model, max_depth=max_depth)

    def _count(self, prefix: str = "", trainable_only: bool = False) -> int:
        return sum(numel for name, (numel, trainable) in self._held.items()
                   if (not prefix or name.startswith(prefix + ".")) and (trainable or not trainable_only))

    @property
    def param_nums(self) -> list[int]:
        return [self._count(name) for name in self.layer_names]

    @property
    def total_parameters(self) -> int:
        return self._count()

    @property
    def trainable_parameters(self) -> int:
        return self._count(trainable_only=True)


def summarize_whole_model(trainer: pl.Trainer, stage_of: Callable[[int], int], object_group: Callable[[], Any]
                          ) -> Callable[[], None]:
    """Make the trainer's model summary callbacks summarize the whole model (their summary gathers over every rank:
    Lightning builds it on every rank when ``fit`` starts). Returns what undoes it."""
    def summary(callback: ModelSummaryCallback, module: pl.LightningModule) -> PipelineSummary:
        own = {name: (p.numel(), p.requires_grad) for name, p in module.named_parameters()}
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, own, group=object_group())
        held = {name: count for rank_held in gathered for name, count in rank_held.items()}
        if dist.get_rank() == 0:
            per_stage: dict[int, int] = {}
            for rank, rank_held in enumerate(gathered):
                per_stage[stage_of(rank)] = sum(numel for numel, _ in rank_held.values())
            counts = ", ".join(f"stage {stage}: {get_human_readable_count(count)}"
                               for stage, count in sorted(per_stage.items()))
            log.info(f"parameters per stage ({counts}); weights several stages hold count on each")
        return PipelineSummary(module, _compat.summary_depth(callback), held)

    callbacks = trainer.callbacks  # type: ignore[attr-defined]
    undos = [_compat.replace_summary(callback, summary) for callback in callbacks
             if isinstance(callback, ModelSummaryCallback)]

    def undo() -> None:
        for undo_one in undos:
            undo_one()

    return undo
