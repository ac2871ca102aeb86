"""``schedule="auto"``'s closed loop: measure the chosen configuration over the first training steps and, where the
schedule's measured time misses the prediction by more than :data:`MISS`, say so and re-choose from the measured
costs. (The step's time outside the schedule, the optimizer's and Lightning's loop's, is the same for every
configuration: it is measured and reported apart, and added to the predictions from then on.)

Training batches ``0 .. WARMUP-1`` are left out (the first builds the optimizer's state and connects the transfers);
the whole step (one ``training_step`` start to the next, Lightning's loop and the optimizer included) is timed over the
next :data:`WINDOWS` batches, and the batch after them runs with the runtime's timeline, as ``PipelineMonitor`` times
one. At the start of the next batch every rank hands what it measured to global rank 0, which decides and tells every
rank (:func:`rechoose`): all switch before that same batch. The measured costs (:func:`calibrate`) are the
prediction's, each stage's forward and backward moved to what they took, the runtime's own time per action as
measured between actions, and the step's time outside the schedule. A switch keeps every block where it is (the
split, the stages of each rank, activation checkpointing) and what the user fixed: the schedule and the micro-batch
count may change, which changes no result for a loss averaged over samples (a schedule computes what one device does;
a batch's gradient is the same over any count of micro-batches). Micro-batches stay as they are where the module
computes batch statistics (batch norm), whose result depends on them. Where a configuration that places blocks
otherwise is predicted faster, the log names it, to be set for the next run.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from lightning_pp._logging import get_logger
from lightning_pp.options import PipelineOptions
from lightning_pp.schedule.timeline import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    TimelineEvent,
)
from lightning_pp.tuning.search import Candidate, MeasuredCosts, candidate_schedule, search, stage_costs

__all__ = ["MISS", "AutoChoice", "AutoSearch", "Rechoice", "StepMeasurement", "calibrate", "rechoose"]

log = get_logger(__name__)

MISS = 0.25  # a schedule's measured time this far from the prediction (either way) re-chooses
WARMUP, WINDOWS = 1, 3  # batches left out, whole steps timed; the next one runs timed, the one after it decides
_BETTER = 0.95  # a switch must be predicted at least 5 % faster than staying
Sink = Callable[[list[TimelineEvent], int], None]


@dataclass(frozen=True)
class AutoSearch:
    """What ``schedule="auto"`` searched (on global rank 0): the measured costs, the pipeline's ranks, the batch, the
    memory budget and what the user fixed (None: searched)."""

    costs: MeasuredCosts
    num_ranks: int
    batch_size: int
    max_memory: float | None
    microbatches: int | None
    stages_per_rank: int | None
    balance: tuple[int, ...] | None
    recompute: bool | None


@dataclass
class StepMeasurement:
    """One rank's measurements: ``windows`` (seconds of whole steps); of the timed step, its samples, per (stage,
    category) the seconds and count of its compute, the schedule's wall time on this rank, the seconds its events
    cover and the count of its actions."""

    windows: list[float] = field(default_factory=list)
    samples: int = 0
    compute: dict[tuple[int, str], tuple[float, int]] = field(default_factory=dict)
    wall: float = 0.0
    covered: float = 0.0
    actions: int = 0

    def read(self, events: list[TimelineEvent], samples: int) -> None:
        self.samples = samples
        totals: dict[tuple[int, str], list[float]] = defaultdict(list)
        for event in events:
            if event.category in (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT):
                totals[(event.stage, event.category)].append(event.duration)
        self.compute = {key: (sum(values), len(values)) for key, values in totals.items()}
        if events:
            self.wall = max(e.end for e in events) - min(e.start for e in events)
            self.covered = sum(e.duration for e in events)
            self.actions = len({(e.action.stage, e.action.microbatch, e.action.type) for e in events})


@dataclass(frozen=True)
class Rechoice:
    """Rank 0's decision: the measured step, whether it missed the prediction by more than :data:`MISS`, the candidate
    to run now (``switch``: a new one), and the log line."""

    measured_s: float
    missed: bool
    chosen: Candidate
    switch: bool
    message: str


def calibrate(costs: MeasuredCosts, current: Candidate, batch_size: int,
              measured: Sequence[StepMeasurement]) -> MeasuredCosts:
    """``costs`` moved to what the stages of ``current`` measured: each stage's difference between its measured and
    its predicted forward (and backward) is spread over its blocks as a time per call, the same at every micro-batch
    size (what a miss usually is: allocations, launches, the interpreter; it makes fewer micro-batches pay); the
    runtime's time per action from the gaps between a rank's actions; the time outside the schedule from the whole
    step less the schedule's wall time. ``batch_size``: the timed step's, where it did not say."""
    stages = len(current.balance)
    size = next((r.samples for r in measured if r.samples), batch_size) / current.microbatches
    predicted = stage_costs(costs, stages, size, current.recompute, current.balance)
    seconds: dict[tuple[int, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for rank in measured:
        for key, (total, count) in rank.compute.items():
            seconds[key][0] += total
            seconds[key][1] += count

    def per_microbatch(stage: int, categories: tuple[str, ...], counted: tuple[str, ...]) -> float | None:
        """Seconds of ``categories`` per micro-batch (those of ``counted`` are one per micro-batch: DualPipeV runs
        some backwards whole, B, and some split, I then W)."""
        count = sum(seconds[(stage, c)][1] for c in counted if (stage, c) in seconds)
        return sum(seconds[(stage, c)][0] for c in categories if (stage, c) in seconds) / count if count else None

    forward, backward = [0.0] * stages, [0.0] * stages  # the difference per call, per stage
    for s in range(stages):
        got = per_microbatch(s, (FORWARD,), (FORWARD,))
        forward[s] = got - predicted.forward[s] if got is not None else 0.0
        got = per_microbatch(s, (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT), (BACKWARD, BACKWARD_INPUT))
        backward[s] = got - predicted.input_backward[s] - predicted.weight_backward[s] if got is not None else 0.0
        if current.recompute:  # the backward's recomputed forward: its difference is the forward's, counted there
            backward[s] -= forward[s]
    stage_of = [s for s, count in enumerate(current.balance) for _ in range(count)]
    i_now, w_now = costs.at(size, costs.input_backward), costs.at(size, costs.weight_backward)

    def moved(values: tuple[list[float], list[float]], by: list[float], share: list[float]) -> Any:
        return tuple([x + by[stage_of[k]] * share[k] / current.balance[stage_of[k]] for k, x in enumerate(v)]
                     for v in values)

    input_share = [i / (i + w) if i + w > 0 else 1.0 for i, w in zip(i_now, w_now, strict=True)]
    per_action = [(r.wall - r.covered) / r.actions for r in measured if r.actions]
    windows = [w for r in measured for w in r.windows]
    wall = max((r.wall for r in measured), default=0.0)
    return dataclasses.replace(
        costs, forward=moved(costs.forward, forward, [1.0] * len(stage_of)),
        input_backward=moved(costs.input_backward, backward, input_share),
        weight_backward=moved(costs.weight_backward, backward, [1 - x for x in input_share]),
        framework_s=max(0.0, statistics.median(per_action)) if per_action else costs.framework_s,
        outside_s=max(0.0, statistics.median(windows) - wall) if windows else costs.outside_s)


def _describe(candidate: Candidate) -> str:
    return f"{candidate.schedule} m={candidate.microbatches} ({1e3 * candidate.step_s:.1f} ms)"


def rechoose(searched: AutoSearch, current: Candidate, measured: Sequence[StepMeasurement],
             keep_microbatches: bool) -> Rechoice:
    """Compare the schedule's measured wall time with ``current``'s prediction (the time outside the schedule is the
    same for every configuration, and reported apart); past :data:`MISS`, re-choose from the calibrated costs among
    the configurations that keep every block where it is (``keep_microbatches``: the count too). ``chosen``'s
    prediction then includes the measured time outside the schedule."""
    windows = [w for r in measured for w in r.windows]
    schedule_s = max((r.wall for r in measured), default=0.0)
    if not windows or not schedule_s:
        return Rechoice(0.0, False, current, False, "schedule='auto' could not time its training steps (an "
                        "evaluation ran within each of steps 1-4, or no step ran its schedule); its choice stays")
    step = statistics.median(windows)
    outside, miss = max(0.0, step - schedule_s), schedule_s / current.step_s - 1
    said = (f"schedule='auto' predicted {1e3 * current.step_s:.1f} ms for the schedule of {current.schedule} "
            f"m={current.microbatches} split={list(current.balance)} and measured {1e3 * schedule_s:.1f} ms "
            f"({100 * miss:+.0f} %); the whole step took {1e3 * step:.1f} ms, {1e3 * outside:.1f} ms of it outside the "
            f"schedule (the optimizer, Lightning's loop)")
    if abs(miss) <= MISS:
        return Rechoice(step, False, dataclasses.replace(current, step_s=current.step_s + outside), False, said)
    costs = calibrate(searched.costs, current, searched.batch_size, measured)
    ranks, v = searched.num_ranks, current.stages_per_rank

    def placement(c: Candidate) -> tuple[Any, ...]:
        schedule = candidate_schedule(c.schedule, ranks, c.microbatches, c.stages_per_rank)
        assert schedule is not None  # (searched: it builds)
        return c.balance, c.recompute, schedule.stage_to_rank

    microbatches, placed = (current.microbatches if keep_microbatches else searched.microbatches), placement(current)
    here = [c for c in search(costs, ranks, searched.batch_size, max_memory=searched.max_memory,
                              microbatches=microbatches, stages_per_rank=v, balance=current.balance,
                              recompute=current.recompute) if placement(c) == placed]
    staying = next(c for c in here if (c.schedule, c.microbatches) == (current.schedule, current.microbatches))
    best = here[0]
    switch = best is not staying and best.step_s < _BETTER * staying.step_s
    chosen = best if switch else staying
    lines = [f"{said}: more than {100 * MISS:.0f} % off. From the measured costs it predicts {_describe(staying)}; "
             + (f"switching to {_describe(best)} from this step on, every block where it is" if switch else
                f"staying with it, within {100 * (1 - _BETTER):.0f} % of the fastest that keeps every block where it "
                f"is")]
    anywhere = search(costs, ranks, searched.batch_size, max_memory=searched.max_memory, microbatches=microbatches,
                      stages_per_rank=searched.stages_per_rank, balance=searched.balance,
                      recompute=searched.recompute)[0]
    if placement(anywhere) != placed and anywhere.step_s < _BETTER * chosen.step_s:
        lines.append(f"A configuration that places blocks otherwise is predicted faster: {anywhere.describe()}. A run "
                     f"cannot switch to it; name it for the next one: schedule={anywhere.schedule!r}, "
                     f"microbatches={anywhere.microbatches}, balance={list(anywhere.balance)}"
                     + (f", stages_per_rank={anywhere.stages_per_rank}" if anywhere.stages_per_rank > 1 else "")
                     + (", activation_checkpointing=True" if anywhere.recompute else ""))
    return Rechoice(step, True, chosen, switch, "\n".join(lines))


class AutoChoice:
    """``schedule="auto"``'s choice on this rank: the concrete ``options`` runs use, the ``chosen`` candidate (None:
    the default configuration, nothing measured) and, over a fit's first training steps, the closed loop (see the
    module's docstring): the session calls :meth:`before_training_step` at the start of each training step."""

    def __init__(self, options: PipelineOptions, chosen: Candidate | None = None, searched: AutoSearch | None = None,
                 rank: int = 0, keep_microbatches: bool = False, object_group: Callable[[], Any] = lambda: None
                 ) -> None:
        self.options, self.chosen = options, chosen
        self.measured_s: float | None = None  # the median whole step the loop measured
        self.searched, self.rank, self.keep_microbatches = searched, rank, keep_microbatches
        self.object_group = object_group
        self._steps = 0
        self._last_start: float | None = None  # the latest training step's start, while its window counts
        self._measurement = StepMeasurement()

    def before_training_step(self, sink: Sink | None, collective: Callable[[str], AbstractContextManager[None]]
                             ) -> tuple[Sink | None, PipelineOptions | None]:
        """The timing sink for this step (the monitor's, or one that also reads the events), and the options to run
        from this step on where the loop switched (else None)."""
        step, self._steps = self._steps, self._steps + 1
        if self.chosen is None or step > WARMUP + WINDOWS + 1:
            return sink, None
        if WARMUP <= step <= WARMUP + WINDOWS:
            now = time.perf_counter()
            if self._last_start is not None:
                self._measurement.windows.append(now - self._last_start)
            self._last_start = now
        if step == WARMUP + WINDOWS:  # timed: the events give the stages' costs

            def read(events: list[TimelineEvent], samples: int) -> None:
                self._measurement.read(events, samples)
                if sink is not None:
                    sink(events, samples)

            return read, None
        if step != WARMUP + WINDOWS + 1:
            return sink, None
        return sink, self._decide(collective)

    def evaluation_step(self) -> None:
        """An evaluation step ran (validation within the epoch): the training step window it falls in is not one."""
        self._last_start = None

    def _decide(self, collective: Callable[[str], AbstractContextManager[None]]) -> PipelineOptions | None:
        group = self.object_group()
        everyone: list[Any] = [None] * dist.get_world_size(group)
        decision: list[Any] = [None]
        assert self.chosen is not None  # (measured)
        chosen = self.chosen
        with collective("schedule='auto' comparing its prediction with the measured steps"):
            dist.gather_object(self._measurement, everyone if self.rank == 0 else None, dst=0, group=group)
            if self.rank == 0:
                assert self.searched is not None  # (rank 0 searched)
                decision[0] = rechoose(self.searched, chosen, everyone, self.keep_microbatches)
            dist.broadcast_object_list(decision, src=0, group=group)
        rechoice: Rechoice = decision[0]
        (log.warning if rechoice.missed else log.info)(rechoice.message)
        self.measured_s = rechoice.measured_s or None
        self.chosen = rechoice.chosen  # (missed: predicted from what it measured)
        if not rechoice.switch:
            return None
        self.options = dataclasses.replace(self.options, schedule=self.chosen.schedule,  # type: ignore[arg-type]
                                           microbatches=self.chosen.microbatches)
        return self.options
