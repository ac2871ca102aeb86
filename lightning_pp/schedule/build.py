"""Building a named schedule (a generator's or a CSV file's) for a pipeline, and the schedules of one pipeline by
micro-batch count and direction, each built once (:class:`StepSchedules`)."""

from __future__ import annotations

import contextlib

from lightning_pp.errors import PipelineConfigError
from lightning_pp.schedule.actions import Schedule
from lightning_pp.schedule.files import load_csv
from lightning_pp.schedule.generators import GENERATORS
from lightning_pp.schedule.lowering import finish_schedule, forward_sweep

__all__ = ["StepSchedules", "build_schedule"]


def _counts(num_ranks: int, num_microbatches: int, stages_per_rank: int) -> None:
    for label, value in (("num_ranks", num_ranks), ("num_microbatches", num_microbatches),
                         ("stages_per_rank", stages_per_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PipelineConfigError(
                f"A schedule needs at least one rank, one micro-batch and one stage per rank, got {label}={value!r}; "
                f"pass a positive int."
            )


def build_schedule(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    forward_only: bool = False,
    stages_per_rank: int | None = None,
) -> Schedule:
    """Generate (or load), lower and validate the schedule ``name`` for ``num_ranks`` ranks.

    Args:
        name: A generator of :data:`GENERATORS` (``"naive"``, ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``,
            ``"zb_h1"``), or the path of a ``.csv`` file in torch.distributed.pipelining's format (see
            :func:`load_csv`).
        num_ranks: Ranks in the pipeline (for one stage per rank, the number of stages).
        num_microbatches: Micro-batches per step.
        forward_only: Keep only the forwards (evaluation).
        stages_per_rank: Stages each rank holds (default 1; for a CSV file, read off the file when left out, checked
            when given).

    Raises:
        PipelineConfigError: An unknown name, counts below one, or counts the generator cannot run (the error names
            the rule and a fix).
        PipelineScheduleError: A CSV file whose schedule is inconsistent (with the grid, the broken cell marked).
    """
    if name.lower().endswith(".csv"):
        return load_csv(name, num_ranks, num_microbatches, forward_only=forward_only, stages_per_rank=stages_per_rank)
    if name not in GENERATORS:
        raise PipelineConfigError(
            f"Unknown schedule {name!r}. Valid schedules: {', '.join(sorted(GENERATORS))}, or the path of a .csv "
            f"file (one row of actions per rank, as torch.distributed.pipelining writes them)."
        )
    stages_per_rank = 1 if stages_per_rank is None else stages_per_rank
    _counts(num_ranks, num_microbatches, stages_per_rank)
    compute = GENERATORS[name](num_ranks, num_microbatches, stages_per_rank)
    return finish_schedule(name, compute, num_microbatches, forward_only)


class StepSchedules:
    """The schedules of one pipeline (``name`` on ``num_ranks`` ranks, ``stages_per_rank`` stages each), by micro-batch
    count and direction, each built once. ``microbatches`` is the count of a full batch.

    A last, short batch that the schedule cannot split into its count (interleaved 1F1B's rule, a file's fixed count)
    is evaluated with a forward sweep over the same stages and trained with the largest count the schedule runs below
    it (DualPipeV, which needs 2p micro-batches, with ZB-V's lists: the same V); none is an error naming the batch.
    """

    def __init__(self, name: str, num_ranks: int, microbatches: int, stages_per_rank: int, fixed_count: bool) -> None:
        self.name, self.num_ranks, self.microbatches = name, num_ranks, microbatches
        self.stages_per_rank, self.fixed_count = stages_per_rank, fixed_count
        self._built: dict[tuple[int, bool], Schedule] = {}

    def switch(self, name: str, microbatches: int) -> None:
        """Build ``name``'s schedules from now on, ``microbatches`` for a full batch (``schedule="auto"``'s closed
        loop: a schedule that keeps each stage on its rank)."""
        self.name, self.microbatches = name, microbatches
        self._built.clear()

    def __call__(self, count: int, forward_only: bool) -> Schedule:
        key = (count, forward_only)
        if key not in self._built:
            self._built[key] = self._build(count, forward_only)
        return self._built[key]

    def _build(self, count: int, forward_only: bool) -> Schedule:
        try:
            return build_schedule(self.name, self.num_ranks, count, forward_only=forward_only,
                                  stages_per_rank=self.stages_per_rank)
        except PipelineConfigError as error:
            if count >= self.microbatches:
                raise
            why = str(error)
        if forward_only:
            return forward_sweep(self(self.microbatches, False).stage_to_rank, count)
        if self.name == "dualpipev":
            return build_schedule("zbv", self.num_ranks, count, stages_per_rank=self.stages_per_rank)
        for fewer in range(count - 1, 0, -1) if not self.fixed_count else []:
            with contextlib.suppress(PipelineConfigError):
                return build_schedule(self.name, self.num_ranks, fewer, stages_per_rank=self.stages_per_rank)
        raise PipelineConfigError(
            f"A training batch of {count} samples cannot be split into micro-batches that schedule={self.name!r} runs "
            f"on {self.num_ranks} ranks ({why}). Use batches of at least {self.microbatches} samples "
            f"(DataLoader(drop_last=True) for a short last batch)."
        )
