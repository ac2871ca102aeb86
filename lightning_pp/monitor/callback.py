"""PipelineMonitor: where each stage's time goes (compute, communication, bubble), measured, next to the prediction."""

from __future__ import annotations

import io
import json
import math
import numbers
import os
import socket
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from typing_extensions import override

from lightning_pp._logging import get_logger
from lightning_pp.errors import PipelineConfigError
from lightning_pp.monitor.memory import (
    AllocatorPeakMeter,
    SavedTensorMeter,
    optimizer_state_size,
    stage_parameter_bytes,
    step_memory_meter,
)
from lightning_pp.monitor.telemetry import PipelineTelemetry, StagesOfRank
from lightning_pp.parallel.topology import receive_object, send_object
from lightning_pp.schedule.actions import Action, Schedule
from lightning_pp.schedule.simulate import simulate
from lightning_pp.schedule.timeline import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    COMM_TRANSFER,
    COMM_WAIT,
    COMPUTE_CATEGORIES,
    FORWARD,
    Timeline,
    TimelineEvent,
)

__all__ = ["PipelineMonitor", "draw_timelines", "to_chrome_trace"]

log = get_logger(__name__)

_ROWS_TAG = 12  # a timed step's rows, sent to global rank 0 (on the object group)

_COLOURS = {FORWARD: "#4c72b0", BACKWARD: "#dd8452", BACKWARD_INPUT: "#c44e52", BACKWARD_WEIGHT: "#8172b3",
            COMM_WAIT: "#c8c8c8", COMM_TRANSFER: "#55a868"}
_MIB = 2**20


def _step_count(name: str, value: object, example: str) -> int:
    """``value`` as an int, or ``PipelineConfigError`` naming the argument (a bool is refused: ``True`` is no count)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise PipelineConfigError(
            f"PipelineMonitor({name}={value!r}): {name} must be an int (a number of optimizer steps), got "
            f"{type(value).__name__}; e.g. {example}."
        )
    return int(value)


class PipelineMonitor(pl.Callback):
    """Measure every action of the pipeline schedule and report where each stage's time went.

    Every ``logging_interval`` optimizer steps, each stage times each action of its schedule (timing is off on the
    other steps and costs nothing there), the timings travel to global rank 0 and are logged through
    ``trainer.logger``, under the measured step's number. They travel point to point, without a barrier (no rank
    waits for another's step to end, which ``schedule="pipedream_2bw"``, whose steps end at different times on each
    rank, would pay for): each rank sends its rows when its measured step ends, and rank 0 logs them when its next
    batch ends (or at the end of training):

    - ``pipeline/stage{s}/forward_ms``, ``backward_ms``: compute time of stage ``s`` in the step;
      ``backward_input_ms`` and ``backward_weight_ms`` too when its schedule splits the backward (I and W actions).
    - ``pipeline/stage{s}/comm_wait_ms``: time blocked until the peer's header arrived, and waiting at the end of
      the step for the last sends to leave.
    - ``pipeline/stage{s}/comm_transfer_ms``: time receiving the tensor once its header was there, and posting sends.
    - ``pipeline/stage{s}/idle_ms``: framework time: the gaps between stage ``s``'s own timed intervals within its
      span, from the start of its first action to the end of its last (the final wait for its sends included), i.e.
      that span minus compute minus communication. Time before its first action and after its last (the last
      stage waiting for the first stage's final backward, say) is schedule bubble, not framework time: it is in
      ``bubble_fraction``, not here. Within the span, waiting for a peer is ``comm_wait_ms``, also not idle.
    - ``pipeline/stage{s}/framework_us_per_action``: ``idle_ms`` in microseconds per compute action (F, B, I and W
      each count one; transfers do not) of stage ``s`` in the step.
    - ``pipeline/stage{s}/bubble_fraction``: share of the step's wall time stage ``s`` did not compute (its idle
      time, communication and everything before its first and after its last action). This, ``idle_ms`` and
      ``framework_us_per_action`` are logged when each rank holds one stage; a rank's time is not split between its
      stages.
    - ``pipeline/rank{r}/bubble_fraction``: share of the step's wall time pipeline rank ``r`` computed nothing (for
      one stage per rank, the same as stage ``r``'s).
    - ``pipeline/rank{r}/grad_sync_ms``: after the schedule, averaging pipeline rank ``r``'s gradients over its
      data-parallel replicas and summing those of weights several stages hold (the slowest replica; not part of
      ``step_ms``).
    - ``pipeline/bubble_fraction``: the same over all ranks, the headline number.
    - ``pipeline/predicted_bubble_fraction``: the simulator's bubble for this schedule, fed with the measured costs
      of every action; ``pipeline/bubble_fraction_error`` is measured minus predicted.
    - ``pipeline/step_ms`` (wall time of the pipelined step) and ``pipeline/samples_per_sec``; with
      ``schedule="auto"``, ``pipeline/auto_predicted_step_ms``, the step it predicted for its choice before training
      (far from ``step_ms``: its measurements did not describe the run).
    - ``pipeline/stage{s}/peak_memory_mb``: the step's peak memory in MiB (2**20 bytes), from the start of the
      training batch to its end (the optimizer step included). On CUDA, the caching allocator's peak above what was
      allocated when the step began (activations, gradients, transfer buffers, the optimizer's temporaries, and on the
      first step its state); the allocator serves the whole process, so with several stages per rank each of them
      reports the rank's peak. Measured steps reset the allocator's peak statistics, so a peak read elsewhere
      (``DeviceStatsMonitor``) counts from the latest measured step. On CPU, which has no allocator to ask, the peak
      bytes of activation storage saved for backward (autograd's saved tensors, each storage counted once while a
      saved reference to it is alive, parameters and views of them excluded), charged to the stage whose work saved
      it.
    - ``pipeline/stage{s}/param_memory_mb``: MiB of the parameters stage ``s`` holds when the step is logged: its
      blocks' and, on the rank's lowest-numbered stage, the weights outside the blocks that the rank holds (a tied
      weight counts once), the shard this rank holds where they are sharded (FSDP2, tensor parallelism); with
      ``schedule="pipedream_2bw"`` also the older version of the weights the stage keeps for its backwards left over
      to the next step.
    - ``pipeline/stage{s}/optimizer_state_mb``: MiB of the optimizer state of those parameters when the step is
      logged (after its optimizer step; Adam: two moments and a step count per parameter), the shard this rank
      holds where the state is sharded.

    Every ``timeline_every_n_steps`` steps it also logs the image ``pipeline/timeline`` (measured and predicted
    timelines, stages x time; when the logger can take images) and, with ``trace_dir``, writes a Chrome-trace file
    ``pipeline_step{N}.json`` (one track per stage; open it in ui.perfetto.dev) and ``pipeline_step{N}.png``.
    Without a logger, a per-stage summary table is logged at the end of ``fit``. With data-parallel replicas, the
    pipeline of lane 0 (replica 0, tensor-parallel rank 0) is measured (the others run the same schedule on other
    samples or shards).

    Ranks on global rank 0's host share its clock (``time.perf_counter`` is the system-wide monotonic clock); those on
    other hosts are aligned to it once at the start of training, after a barrier (to within the barrier's exit skew,
    tens of microseconds to a millisecond).
    On CPU each action is timed with ``time.perf_counter``; on CUDA with events on the current stream, so the times
    are those of the kernels, not of their launches (see :class:`lightning_pp.runtime.executor.EventClock`; timing a
    step costs two device synchronisations). On CPU, counting saved tensors runs a Python hook for each one, which adds
    a few microseconds to each forward's time on measured steps (untimed steps have no hooks).

    Args:
        logging_interval: Measure and log every this many optimizer steps.
        timeline_every_n_steps: Draw the timeline (and write the trace) every this many steps; must be a multiple
            of ``logging_interval``. ``0`` turns pictures and traces off.
        trace_dir: Folder for trace files and timeline pictures; ``None`` writes none.

    Raises:
        PipelineConfigError: On construction, for an argument of the wrong type (the step counts are ints, not bools
            or floats; ``trace_dir`` is a str, an ``os.PathLike`` or ``None``) or value; when training starts, if the
            Trainer's strategy is not a ``PipelineParallelStrategy``.
    """

    # its batch-end hooks read no step outputs, so they need not travel to every stage (see model/results.py)
    ignores_step_outputs = True

    def __init__(self, logging_interval: int = 10, timeline_every_n_steps: int = 100,
                 trace_dir: str | Path | None = None) -> None:
        logging_interval = _step_count("logging_interval", logging_interval, "logging_interval=10")
        timeline_every_n_steps = _step_count("timeline_every_n_steps", timeline_every_n_steps,
                                             "timeline_every_n_steps=100, or 0 for no pictures")
        if logging_interval < 1:
            raise PipelineConfigError(
                f"PipelineMonitor: logging_interval={logging_interval} must be at least 1 step; "
                f"e.g. logging_interval=10."
            )
        if timeline_every_n_steps < 0 or (timeline_every_n_steps and timeline_every_n_steps % logging_interval):
            raise PipelineConfigError(
                f"PipelineMonitor: timeline_every_n_steps={timeline_every_n_steps} must be 0 or a multiple of "
                f"logging_interval={logging_interval}; e.g. timeline_every_n_steps={10 * logging_interval}."
            )
        # a PathLike whose path is bytes would make Path() raise a bare TypeError
        if trace_dir is not None and not (isinstance(trace_dir, str | os.PathLike)
                                          and isinstance(os.fspath(trace_dir), str)):
            raise PipelineConfigError(
                f"PipelineMonitor(trace_dir={trace_dir!r}): trace_dir must be a folder path (str or os.PathLike) "
                f"or None, got {type(trace_dir).__name__}; e.g. trace_dir=\"lightning_logs/pipeline_traces\", or "
                f"leave it out to write no trace files."
            )
        self.logging_interval = logging_interval
        self.timeline_every_n_steps = timeline_every_n_steps
        self.trace_dir = Path(trace_dir) if trace_dir is not None else None
        self._clock_offsets: list[float] = [0.0]
        self._events: list[TimelineEvent] | None = None
        self._samples = 0
        self._meter: SavedTensorMeter | AllocatorPeakMeter | None = None  # the measured step's memory meter
        self._metering = ExitStack()  # holds the meter's measurement open from batch start to batch end
        self.history: list[dict[str, float]] = []  # the metrics of every measured step (on global rank 0)
        # global rank 0: the latest timed step, until every rank's rows of it have arrived (see _log's arguments)
        self._unlogged: tuple[int, Any, int, Schedule, PipelineTelemetry] | None = None
        # the other ranks: their rows on the way, each send with the number of the batch end that posted it
        self._sends: list[tuple[int, dist.Work, torch.Tensor]] = []
        self._batch_ends = 0  # batch ends since training started

    @staticmethod
    def _telemetry(trainer: pl.Trainer) -> PipelineTelemetry:
        """What the strategy shows of the pipeline (see :class:`~lightning_pp.monitor.telemetry.PipelineTelemetry`)."""
        telemetry = getattr(trainer.strategy, "telemetry", None)
        if not isinstance(telemetry, PipelineTelemetry):
            raise PipelineConfigError(
                f"PipelineMonitor needs Trainer(strategy=PipelineParallelStrategy(...)), got "
                f"{type(trainer.strategy).__name__}."
            )
        return telemetry

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        telemetry = self._telemetry(trainer)
        self._unlogged, self._sends, self._batch_ends = None, [], 0
        if _distributed():
            dist.barrier(group=telemetry.object_group)
            now = time.perf_counter()
            clocks: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(clocks, (_clock_source(), now), group=telemetry.object_group)
            self._clock_offsets = clock_offsets(clocks)

    def _measuring(self, trainer: pl.Trainer) -> bool:
        return trainer.global_step % self.logging_interval == 0

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        telemetry = self._telemetry(trainer)
        measuring = self._measuring(trainer)
        telemetry.timing_sink = self._receive if measuring else None
        self._stop_meter()
        if measuring:
            view = _stage_view(telemetry)
            # packs only happen in forward passes, which set the view's stage first
            self._meter = step_memory_meter(pl_module, telemetry.device, stage_of=lambda: view.stage)
            self._metering.enter_context(self._meter.measure())

    def _stop_meter(self) -> SavedTensorMeter | AllocatorPeakMeter | None:
        """End the measured step's memory measurement (if one is open); return its meter."""
        self._metering.close()
        meter, self._meter = self._meter, None
        return meter

    def _stage_memory(self, telemetry: PipelineTelemetry, trainer: pl.Trainer, module: pl.LightningModule,
                      meter: SavedTensorMeter | AllocatorPeakMeter | None) -> dict[int, tuple[int, int, int]]:
        """Per stage of this rank: (peak bytes of the step, parameter bytes held now, optimizer state bytes)."""
        view = _stage_view(telemetry)
        blocks = {stage: view.blocks_of(stage) for stage in view.stages}
        params = stage_parameter_bytes(module, blocks)
        params[min(view.stages)] += telemetry.kept_weight_bytes  # pipedream_2bw: the older version too
        state = stage_parameter_bytes(module, blocks, size=optimizer_state_size(trainer.optimizers))
        if isinstance(meter, SavedTensorMeter):
            return {stage: (meter.stage_peaks.get(stage, 0), params[stage], state[stage]) for stage in view.stages}
        peak = meter.peak if meter is not None else 0  # the allocator's peak is the rank's: every stage reports it
        return {stage: (peak, params[stage], state[stage]) for stage in view.stages}

    def _receive(self, events: list[TimelineEvent], samples: int) -> None:
        self._events = events
        self._samples = samples

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        telemetry = self._telemetry(trainer)
        telemetry.timing_sink = None
        meter = self._stop_meter()
        if self._unlogged is not None:  # global rank 0: the previous timed step's rows have arrived by now
            self._log(trainer, *self._unlogged)
            self._unlogged = None
        self._batch_ends += 1
        self._reap_sends()
        if self._events is None:
            return
        events, self._events = self._events, None
        grad_sync_ms, telemetry.last_grad_sync_ms = telemetry.last_grad_sync_ms, None
        step = trainer.global_step - 1  # the step that was just taken
        # the pipeline of lane 0 (the others run the same schedule on other samples or shards)
        rows = ([(e.stage, e.rank, str(e.action), e.category, e.start, e.end) for e in events]
                if telemetry.lane == 0 else [])
        own_memory = self._stage_memory(telemetry, trainer, pl_module, meter) if telemetry.lane == 0 else {}
        mine = (telemetry.stage, rows, grad_sync_ms, own_memory)  # telemetry.stage: this rank's place in its pipeline
        schedule = telemetry.last_schedule
        assert schedule is not None  # set by the timed training step whose events these are
        unlogged = (step, mine, self._samples, schedule, telemetry)
        if not _distributed():
            self._log(trainer, *unlogged)
        elif trainer.is_global_zero:
            self._unlogged = unlogged  # logged at the next batch's end, when every rank's rows are there
        else:
            self._sends += [(self._batch_ends, work, buffer)
                            for work, buffer in send_object(mine, 0, telemetry.object_group, _ROWS_TAG)]

    def _reap_sends(self) -> None:
        """Wait for the rows sent at least two batch ends ago, and let go of their buffers: at most two timed steps'
        sends stay in flight.

        A gloo send reports ``is_completed()`` only once waited for, so polling would hold every timed step's rows until
        training ends. Waiting here cannot block: rows sent at batch end ``b`` are received by global rank 0 at its
        batch end ``b + 1``, and this rank has reached batch end ``b + 2`` only after its batch ``b + 2`` ran, whose
        forwards (or the gradient sync with its replicas) needed what rank 0 computed after its batch end ``b + 1``
        (the SIGTERM broadcast at the batch's start, where Lightning does it, orders them too).
        """
        kept = []
        for posted_at, work, buffer in self._sends:
            if posted_at <= self._batch_ends - 2:
                work.wait()
            elif not work.is_completed():
                kept.append((posted_at, work, buffer))
        self._sends = kept

    def _log(self, trainer: pl.Trainer, step: int, mine: Any, samples: int, schedule: Schedule,
             telemetry: PipelineTelemetry) -> None:
        """Global rank 0: log a timed step from every rank's rows (``mine``: its own; the others' are received)."""
        gathered = [mine] + [receive_object(rank, telemetry.object_group, _ROWS_TAG)
                             for rank in range(1, dist.get_world_size() if _distributed() else 1)]
        timeline = Timeline(schedule.num_ranks, stage_to_rank=schedule.stage_to_rank)
        sync_ms: dict[int, float] = {}
        memory: dict[int, tuple[int, int, int]] = {}  # stage -> (peak, parameter, optimizer state) bytes
        for rank, (stage, rank_rows, rank_sync_ms, rank_memory) in enumerate(gathered):
            memory.update(rank_memory)
            offset = self._clock_offsets[rank] if rank < len(self._clock_offsets) else 0.0
            timeline.events += [TimelineEvent(s, Action.parse(a), c, b - offset, e - offset, rank=r)
                                for s, r, a, c, b, e in rank_rows]
            if rank_sync_ms is not None:  # the slowest replica of the pipeline rank
                sync_ms[stage] = max(sync_ms.get(stage, 0.0), rank_sync_ms)
        predicted = simulate(schedule, _measured_costs(timeline))
        metrics = stage_metrics(timeline, predicted, samples, sync_ms, memory)
        if telemetry.auto_choice is not None:  # what schedule='auto' predicts (its closed loop's, once that ran)
            metrics["pipeline/auto_predicted_step_ms"] = 1e3 * telemetry.auto_choice.step_s
        if telemetry.auto_measured_step_s is not None:  # the whole step its closed loop measured
            metrics["pipeline/auto_measured_step_ms"] = 1e3 * telemetry.auto_measured_step_s
        self.history.append({"step": float(step), **metrics})
        if trainer.loggers:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
        if self.timeline_every_n_steps and step % self.timeline_every_n_steps == 0:
            self._draw(trainer, timeline, predicted, schedule, step)

    def _draw(self, trainer: pl.Trainer, measured: Timeline, predicted: Timeline, schedule: Schedule,
              step: int) -> None:
        figure = draw_timelines(measured, predicted, title=f"{schedule.name}, {schedule.num_stages} stages x "
                                                           f"{schedule.num_microbatches} micro-batches, step {step}")
        if self.trace_dir is not None:
            self.trace_dir.mkdir(parents=True, exist_ok=True)
            (self.trace_dir / f"pipeline_step{step}.json").write_text(json.dumps(to_chrome_trace(measured)))
            figure.savefig(self.trace_dir / f"pipeline_step{step}.png", dpi=100)
        for logger in trainer.loggers:
            add_image = getattr(getattr(logger, "experiment", None), "add_image", None)
            if callable(add_image):
                buffer = io.BytesIO()
                figure.savefig(buffer, format="png", dpi=100)
                import numpy as np
                from PIL import Image

                image = torch.from_numpy(np.array(Image.open(buffer).convert("RGB")))
                add_image("pipeline/timeline", image, step, dataformats="HWC")
        import matplotlib.pyplot as plt

        plt.close(figure)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop_meter()
        self._unlogged, self._sends = None, []

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._unlogged is not None:
            self._log(trainer, *self._unlogged)
            self._unlogged = None
        for _, work, _ in self._sends:
            work.wait()
        self._sends = []
        if trainer.is_global_zero and not trainer.loggers and self.history:
            schedule = self._telemetry(trainer).last_schedule
            assert schedule is not None  # there is history: a measured training step ran
            log.info(summary_table(self.history, schedule.stage_to_rank))


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _clock_source() -> str:
    """What identifies this machine's monotonic clock: its boot id on Linux (containers on one machine share it, and
    two machines never do, even under one host name), else the host name."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def clock_offsets(readings: list[tuple[str, float]]) -> list[float]:
    """Each rank's clock minus global rank 0's, from (clock source, ``perf_counter``) read by every rank right after
    a barrier. Zero on rank 0's machine: its ranks share one clock, and a correction would only add the barrier's exit
    skew."""
    host_zero, clock_zero = readings[0]
    return [0.0 if host == host_zero else clock - clock_zero for host, clock in readings]


def _stage_view(telemetry: PipelineTelemetry) -> StagesOfRank:
    """The rank's view of the block container: its stages, their blocks, and the stage the current pass runs."""
    assert telemetry.view is not None  # set up before training starts
    return telemetry.view


def _measured_costs(timeline: Timeline) -> Any:
    """Per-action cost for the simulator: measured compute, and measured transfer time (waiting is not a cost)."""
    costs: dict[Action, float] = {}
    for event in timeline.events:
        if event.category in COMPUTE_CATEGORIES or (event.category == COMM_TRANSFER and not event.action.is_compute):
            costs[event.action] = costs.get(event.action, 0.0) + event.duration
    return lambda action: costs.get(action, 0.0)


def stage_metrics(measured: Timeline, predicted: Timeline, samples: int,
                  grad_sync_ms: dict[int, float] | None = None,
                  memory: dict[int, tuple[int, int, int]] | None = None) -> dict[str, float]:
    """The logged numbers of one measured step (see :class:`PipelineMonitor` for their meaning); ``memory`` maps a
    stage to its peak bytes in the step, the bytes of its parameters and those of their optimizer state."""
    wall = measured.makespan
    one_per_rank = measured.stage_to_rank == tuple(range(measured.num_ranks))
    split = {kind for kind in (BACKWARD_INPUT, BACKWARD_WEIGHT) if any(e.category == kind for e in measured.events)}
    metrics: dict[str, float] = {}
    for stage in range(measured.num_stages):
        forward = measured.stage_total(stage, [FORWARD])
        backward = measured.stage_total(stage, [BACKWARD])
        backward_input = measured.stage_total(stage, [BACKWARD_INPUT])
        backward_weight = measured.stage_total(stage, [BACKWARD_WEIGHT])
        wait = measured.stage_total(stage, [COMM_WAIT])
        transfer = measured.stage_total(stage, [COMM_TRANSFER])
        prefix = f"pipeline/stage{stage}/"
        metrics[prefix + "forward_ms"] = 1e3 * forward
        metrics[prefix + "backward_ms"] = 1e3 * backward
        if BACKWARD_INPUT in split:
            metrics[prefix + "backward_input_ms"] = 1e3 * backward_input
        if BACKWARD_WEIGHT in split:
            metrics[prefix + "backward_weight_ms"] = 1e3 * backward_weight
        metrics[prefix + "comm_wait_ms"] = 1e3 * wait
        metrics[prefix + "comm_transfer_ms"] = 1e3 * transfer
        if one_per_rank:  # stage s is rank s: its span holds only its own events
            busy = forward + backward + backward_input + backward_weight + wait + transfer
            idle = max(0.0, measured.span(stage) - busy)
            actions = sum(1 for e in measured.events if e.stage == stage and e.category in COMPUTE_CATEGORIES)
            metrics[prefix + "idle_ms"] = 1e3 * idle
            metrics[prefix + "framework_us_per_action"] = 1e6 * idle / max(1, actions)
            metrics[prefix + "bubble_fraction"] = measured.bubble_fraction(stage)
        if memory and stage in memory:
            peak, params, state = memory[stage]
            metrics[prefix + "peak_memory_mb"] = peak / _MIB
            metrics[prefix + "param_memory_mb"] = params / _MIB
            metrics[prefix + "optimizer_state_mb"] = state / _MIB
    for rank in range(measured.num_ranks):
        metrics[f"pipeline/rank{rank}/bubble_fraction"] = measured.bubble_fraction(rank)
        if grad_sync_ms and rank in grad_sync_ms:
            metrics[f"pipeline/rank{rank}/grad_sync_ms"] = grad_sync_ms[rank]
    metrics["pipeline/bubble_fraction"] = measured.bubble_fraction()
    metrics["pipeline/predicted_bubble_fraction"] = predicted.bubble_fraction()
    metrics["pipeline/bubble_fraction_error"] = metrics["pipeline/bubble_fraction"] - predicted.bubble_fraction()
    metrics["pipeline/step_ms"] = 1e3 * wall
    metrics["pipeline/samples_per_sec"] = samples / wall if wall > 0 else 0.0
    return metrics


def summary_table(history: Sequence[dict[str, float]], stage_to_rank: Sequence[int]) -> str:
    """Per-stage means over the measured steps, as a text table (backward: B, or I + W when split), with the highest
    peak memory of those steps and the parameters' and optimizer state's memory at the last one (MiB). With several
    stages per rank, idle time belongs to a rank, not a stage (n/a), and the bubble and gradient sync are the rank's."""

    def mean(key: str, missing: float = math.nan) -> float:
        return sum(h.get(key, missing) for h in history) / len(history)

    synced = all("pipeline/rank0/grad_sync_ms" in h for h in history)
    metered = all("pipeline/stage0/peak_memory_mb" in h for h in history)
    header = f"{'stage':>5} | {'forward ms':>10} | {'backward ms':>11} | {'comm wait ms':>12} | " \
             f"{'transfer ms':>11} | {'idle ms':>8} | {'bubble':>6}" + (f" | {'grad sync ms':>12}" if synced else "") \
             + (f" | {'peak memory MiB':>15} | {'params MiB':>10} | {'optimizer MiB':>13}" if metered else "")
    lines = [f"PipelineMonitor: mean over {len(history)} measured steps", header, "-" * len(header)]
    for stage, rank in enumerate(stage_to_rank):
        p, r = f"pipeline/stage{stage}/", f"pipeline/rank{rank}/"
        backward = mean(p + "backward_ms") + mean(p + "backward_input_ms", 0.0) + mean(p + "backward_weight_ms", 0.0)
        idle = f"{mean(p + 'idle_ms'):>8.2f}" if all(p + "idle_ms" in h for h in history) else f"{'n/a':>8}"
        lines.append(f"{stage:>5} | {mean(p + 'forward_ms'):>10.2f} | {backward:>11.2f} | "
                     f"{mean(p + 'comm_wait_ms'):>12.2f} | {mean(p + 'comm_transfer_ms'):>11.2f} | "
                     f"{idle} | {mean(r + 'bubble_fraction'):>6.3f}"
                     + (f" | {mean(r + 'grad_sync_ms'):>12.2f}" if synced else "")
                     + (f" | {max(h[p + 'peak_memory_mb'] for h in history):>15.3f} | "
                        f"{history[-1][p + 'param_memory_mb']:>10.3f} | "
                        f"{history[-1][p + 'optimizer_state_mb']:>13.3f}" if metered else ""))
    lines.append(f"step {mean('pipeline/step_ms'):.2f} ms, {mean('pipeline/samples_per_sec'):.1f} samples/s, "
                 f"bubble {mean('pipeline/bubble_fraction'):.3f} measured vs "
                 f"{mean('pipeline/predicted_bubble_fraction'):.3f} predicted")
    return "\n".join(lines)


def _row_names(timeline: Timeline) -> list[str]:
    """``stage s`` per row for one stage per rank, else ``rank r (stages a, b)``."""
    if timeline.stage_to_rank == tuple(range(timeline.num_ranks)):
        return [f"stage {rank}" for rank in range(timeline.num_ranks)]
    return [f"rank {rank} (stages {', '.join(str(s) for s, r in enumerate(timeline.stage_to_rank) if r == rank)})"
            for rank in range(timeline.num_ranks)]


def to_chrome_trace(timeline: Timeline) -> dict[str, Any]:
    """Chrome-trace / Perfetto JSON: one track (thread) per rank, one complete event per action interval."""
    start = timeline.start
    events: list[dict[str, Any]] = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": name}}
        for rank, name in enumerate(_row_names(timeline))
    ]
    several = timeline.stages_per_rank > 1
    for event in timeline.events:
        events.append({
            "name": str(event.action) if several else f"{event.action.type.value}{event.action.microbatch}",
            "cat": event.category, "ph": "X",
            "pid": 0, "tid": event.rank, "ts": 1e6 * (event.start - start), "dur": 1e6 * event.duration,
            "args": {"action": str(event.action), "microbatch": event.action.microbatch},
        })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def draw_timelines(measured: Timeline, predicted: Timeline | None = None, title: str = "") -> Any:
    """Ranks x time, forward / backward (B, I, W) / waiting / transfer in distinct colours, micro-batch numbers on
    bars (the whole action, ``4F1``, when a rank holds several stages)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    panels = [("measured", measured)] + ([("predicted from measured costs", predicted)] if predicted else [])
    figure, axes = plt.subplots(len(panels), 1, figsize=(12, 1.2 + 0.7 * measured.num_ranks * len(panels)),
                                squeeze=False)
    for axis, (label, timeline) in zip(axes[:, 0], panels, strict=True):
        scale = 1e3  # seconds -> ms; the prediction uses measured costs, so it is in seconds too
        several = timeline.stages_per_rank > 1
        for event in timeline.events:
            left, width = scale * (event.start - timeline.start), scale * event.duration
            axis.broken_barh([(left, width)], (event.rank - 0.4, 0.8), facecolors=_COLOURS[event.category])
            if event.category in COMPUTE_CATEGORIES and width > 0.02 * scale * timeline.makespan / 4:
                text = str(event.action) if several else str(event.action.microbatch)
                axis.text(left + width / 2, event.rank, text, ha="center", va="center", fontsize=7, color="white")
        axis.set_yticks(range(timeline.num_ranks), _row_names(timeline))
        axis.invert_yaxis()
        axis.set_xlim(0, scale * timeline.makespan)
        axis.set_title(f"{label}: bubble {timeline.bubble_fraction():.3f}", fontsize=9, loc="left")
        axis.set_xlabel("ms", fontsize=8)
    legend = [Patch(color=c, label=k.replace("_", " ")) for k, c in _COLOURS.items()]
    figure.legend(handles=legend, loc="upper right", ncol=6, fontsize=8)
    if title:
        figure.suptitle(title, fontsize=10, x=0.01, ha="left")
    figure.tight_layout(rect=(0, 0, 1, 0.93))
    return figure
