"""The step driver: the user's training / validation / test / predict step run over micro-batches through a schedule.

Every stage runs the user's step for every micro-batch (:mod:`lightning_pp.model.stage` makes the blocks of other
stages stand-ins). Training: the last stage's step goes on to the loss, which is weighted by the micro-batch's share of
the samples (or of what ``microbatch_weight`` counts, such as tokens), so gradients equal one device's for losses that
average over the batch. Evaluation: the micro-batches run
through the blocks only; the last stage then runs the user's step once on the whole batch with the blocks' joined
outputs, so every logged value and every returned prediction is what one device computes.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities import move_data_to_device
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_pp.errors import PipelineConfigError
from lightning_pp.model.logs import LogRecorder, replay
from lightning_pp.model.results import ResultExchange
from lightning_pp.model.sides import Sides, joined_sides, with_sides
from lightning_pp.model.stage import SeveralPasses, StageOutput, StageView
from lightning_pp.parallel.topology import StageGroups
from lightning_pp.pipedream.step import DelayedUpdates, refuse_accumulation
from lightning_pp.runtime.executor import run_stage, step_clock
from lightning_pp.runtime.microbatch import batch_size, merge_microbatches, split_batch
from lightning_pp.runtime.p2p import StageP2P
from lightning_pp.runtime.remote import refuse_reached, refuse_remote
from lightning_pp.schedule.actions import Schedule
from lightning_pp.schedule.timeline import TimelineEvent

__all__ = ["StepDriver", "StepRandomness"]

# what an evaluation forward on the last stage hands the runtime (nothing to send)
_NOTHING = torch.empty(0, device="cpu")
_AGAIN = object()  # the last stage's evaluation result when the step passed through the blocks several times


def _no_forward(stage: int, mb: int, received: Any) -> Any:
    raise AssertionError(f"a drain runs backwards only, not the forward of stage {stage}, micro-batch {mb}")


class StepRandomness:
    """The same random numbers on every stage for the same (step, micro-batch), and the generators left untouched.

    Before each micro-batch the CPU generator (and the stage's CUDA generator) is seeded from the generator's state at
    the start of the step, the step's index and the micro-batch, so a value drawn before the blocks (the noise of a
    denoiser) is the same on every stage, whichever stage uses it. Where this stage's own blocks start, the stream is
    reseeded per stage, so dropout masks of different stages are independent. Afterwards the generators are restored:
    a step leaves them as it found them, so a shuffling sampler draws the same batches on every stage and, when the
    step itself uses no randomness, the same as on one device.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._base = b""

    def begin_step(self, step_index: int) -> None:
        state = torch.get_rng_state().numpy().tobytes()
        self._base = hashlib.blake2b(state + step_index.to_bytes(8, "little"), digest_size=16).digest()

    def _seed(self, *parts: int) -> None:
        digest = hashlib.blake2b(self._base + b"".join(p.to_bytes(8, "little") for p in parts), digest_size=8)
        seed = int.from_bytes(digest.digest(), "little") >> 1
        torch.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)

    @contextmanager
    def pass_(self, microbatch: int) -> Iterator[None]:
        """One run of the user's step: micro-batch ``microbatch`` (or the whole batch: ``-1``)."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            self._seed(microbatch + 1)
            yield

    def blocks_start(self, microbatch: int, stage: int) -> None:
        self._seed(microbatch + 1, stage + 1)


class StepDriver:
    """Runs one stage's part of each pipelined step; the strategy calls :meth:`run` from its step hooks."""

    def __init__(self, module: pl.LightningModule, view: StageView, p2p: StageP2P | None, recorder: LogRecorder,
                 device: torch.device, schedule_for: Callable[[int, bool], Schedule], microbatches: int,
                 microbatch_weight: Callable[[Any], Any] | None = None, groups: StageGroups | None = None,
                 position: int = 0, outside: Callable[[], list[torch.nn.Parameter]] | None = None) -> None:
        self.module = module
        self.view = view
        self.p2p = p2p
        self.recorder = recorder
        self.device = device
        self.schedule_for = schedule_for
        self.microbatches = microbatches
        self.microbatch_weight = microbatch_weight
        self.groups = groups  # None with one stage
        self.position = position  # this rank's place in its pipeline (the rank of its schedule)
        self.last_stage = view.num_stages - 1
        self.holds_last = self.last_stage in view.stages
        # the weights outside the blocks this rank holds now, which every stage's pass may use (asked each time: an
        # FSDP2 unit's are the gathered ones while it is gathered)
        self.outside = outside or list
        self.randomness = StepRandomness(device)
        self.steps_run = 0  # pipelined steps so far (the same count on every stage): seeds their random numbers
        self.trained = False  # whether a training step ran (the first one checks what stood in for remote outputs)
        self.last_schedule: Schedule | None = None
        # this step's gradients, handed to Lightning in the strategy's `backward`
        self.pending_grads: list[tuple[torch.nn.Parameter, Tensor]] = []
        self._warned_small_batch = False
        self._exchange = (ResultExchange(groups, p2p.results_group if p2p is not None else None)
                          if groups is not None else None)
        self.delayed: DelayedUpdates | None = None  # schedule="pipedream_2bw": the stream between steps
        self._send_outputs: dict[str, bool] = {}  # per step name: whether the outputs go to every stage
        # the evaluation steps that passed through the blocks several times: from then on they run eagerly
        self._several_passes: set[str] = set()

    def decide_outputs(self, step_name: str, read_here: bool) -> bool:
        """Agree with the pipeline's other stages (every stage calls this) whether ``step_name``'s outputs are sent to
        every stage: when any stage reads them. Returns the decision."""
        send = self._exchange.agree(read_here) if self._exchange is not None else read_here
        self._send_outputs[step_name] = send
        return send

    def run(self, step_name: str, args: tuple[Any, ...], kwargs: dict[str, Any], *, accumulation: int,
            scaler: torch.amp.GradScaler | None, collective: Callable[[str], AbstractContextManager[None]],
            timing_sink: Callable[[list[TimelineEvent], int], None] | None) -> Any:
        """Run the user's ``step_name`` over micro-batches; return what it returns on one device. The last stage's
        loss and ``self.log`` calls reach every stage; its outputs (what an evaluation step returns, a training step's
        dict entries beyond the loss) only where :meth:`decide_outputs` said so, elsewhere the other stages return
        ``None`` (training: the loss alone)."""
        if step_name in self._several_passes:
            return self._run_eagerly(step_name, args, kwargs)
        if self.delayed is not None and step_name == "training_step":
            refuse_accumulation(accumulation)
        step = _Step(self, step_name, args, kwargs, accumulation=accumulation, scaler=scaler)
        events: list[TimelineEvent] | None = [] if step.training and timing_sink is not None else None
        if self._exchange is not None:
            self._exchange.expect()
        self._run_schedule(step, events)
        result: Any = None
        extra: dict[str, Any] | None = None
        records: list[Any] = []
        if step.finished is not None:  # posted before the schedule ended (pipedream_2bw's last stage)
            result, extra, records = step.finished
        elif self.holds_last and step.training:
            result, extra, records = step.finish_training()
        elif self.holds_last:
            result, records = step.finish_evaluation()
        result, extra, records = self._share_results(step, result, extra, records, collective)
        if result is _AGAIN:  # the step passed through the blocks several times: every stage runs it eagerly
            self._several_passes.add(step_name)
            return self._run_eagerly(step_name, args, kwargs)
        replay(self.module, records, updated_here=self.holds_last)
        if events is not None and timing_sink is not None:
            timing_sink(events, step.total)
        return step.returned(result, extra)

    def _run_eagerly(self, step_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """An evaluation step on the whole batch on every rank, each pass through the blocks run eagerly (see
        :mod:`lightning_pp.model.eager`): what several passes need (generation)."""
        self.steps_run += 1
        self.randomness.begin_step(self.steps_run)
        with self.view.eager_step(), self.randomness.pass_(-1):
            result = getattr(self.module, step_name)(*args, **kwargs)
        refuse_remote(result, f"What {step_name} returned")
        return move_data_to_device(result, self.device)

    def _run_schedule(self, step: _Step, events: list[TimelineEvent] | None) -> None:
        """Run this rank's actions of ``step``'s schedule; a training step's gradients end in :attr:`pending_grads`."""
        params: list[torch.nn.Parameter] = []
        previous: list[Tensor | None] = []
        if step.training:
            # Lightning zeroes gradients between training_step and backward: keep this step's gradients aside and
            # hand them over in the strategy's `backward`, leaving earlier (accumulated) gradients to Lightning
            params = [p for p in self.module.parameters() if p.requires_grad]
            previous = [p.grad for p in params]
            for p in params:
                p.grad = None
            self.last_schedule = step.schedule
        self.steps_run += 1
        self.randomness.begin_step(self.steps_run)
        clock = step_clock(self.device) if events is not None else None
        handed: list[tuple[torch.nn.Parameter, Tensor]] | None = None
        try:
            if step.training and self.delayed is not None:  # a cut of the never-draining stream (pipedream_2bw)
                count = step.schedule.num_microbatches
                handed = self.delayed.run_step(params, functools.partial(
                    run_stage, rank=self.position, forward=lambda stage, mb, got: step.forward(stage, mb % count, got),
                    p2p=self.p2p, training=True, params=self._parameters_of, events=events, clock=clock),
                    count, after_forwards=self._post_early(step))
                self.last_schedule = self.delayed.last_schedule
            else:
                run_stage(step.schedule, self.position, step.forward, self.p2p, training=step.training,
                          params=self._parameters_of, events=events, clock=clock)
        finally:
            self.view.on_blocks_start = None
        if step.training:
            self.trained = True
            self.pending_grads = handed if handed is not None else [(p, p.grad) for p in params if p.grad is not None]
            for p, grad in zip(params, previous, strict=True):
                p.grad = grad

    def _share_results(self, step: _Step, result: Any, extra: dict[str, Any] | None, records: list[Any],
                       collective: Callable[[str], AbstractContextManager[None]],
                       ) -> tuple[Any, dict[str, Any] | None, list[Any]]:
        """The last stage's result, extra entries and log records, as every stage of the pipeline receives them
        (every stage calls this); the outputs only where :meth:`decide_outputs` said so. Unchanged with one stage."""
        if self._exchange is None:
            return result, extra, records
        with collective("sharing the step's results from the pipeline's last stage"):
            sent_loss, records, sent, again = self._exchange.share(
                result if step.training else None, records, extra if step.training else result,
                self._send_outputs.get(step.name, True) and result is not _AGAIN, again=result is _AGAIN,
                posted=step.posted)
        if again:
            return _AGAIN, None, []
        return (sent_loss, sent, records) if step.training else (sent, None, records)

    def _post_early(self, step: _Step) -> Callable[[], None] | None:
        """pipedream_2bw, on the last stage: once its last forward has run, the batch's loss and logged values are
        known; posting them then, before the backwards, lets the other stages end their step without waiting for the
        last stage's. That matters on NCCL too: there the last stage's final send of a step waits for the first
        stage's next step, so the first stage must not wait for anything the last stage does after it (a timed step's
        synchronize, say). Reading the loss makes the host wait for the last forward on the device (not for the
        transfers). None on the other stages."""
        exchange = self._exchange
        if not self.holds_last or exchange is None:
            return None

        def post() -> None:
            step.finished = result, extra, records = step.finish_training()
            step.posted = exchange.post(result, records, extra, self._send_outputs.get(step.name, True))
        return post

    def drain(self) -> None:
        """pipedream_2bw: back up what the latest training step left in flight (every rank at once)."""
        if self.delayed is not None and self.delayed.open:
            self.delayed.drain([p for p in self.module.parameters() if p.requires_grad], functools.partial(
                run_stage, rank=self.position, forward=_no_forward, p2p=self.p2p, training=True,
                params=self._parameters_of))

    def _parameters_of(self, stage: int) -> list[torch.nn.Parameter]:
        """The weights a pass through ``stage`` can reach: its blocks' and those outside the blocks."""
        blocks = self.view.blocks_of(stage)
        return [p for block in blocks for p in block.parameters()] + self.outside()

    def _shares(self, microbatches: list[Any], sizes: list[int]) -> list[float]:
        """Each micro-batch's share of the batch's loss: its samples, or what ``microbatch_weight`` says."""
        if self.microbatch_weight is None:
            return [float(size) for size in sizes]
        shares = [float(self.microbatch_weight(mb)) for mb in microbatches]
        if not all(math.isfinite(share) and share >= 0 for share in shares) or sum(shares) <= 0:
            raise PipelineConfigError(
                f"microbatch_weight gave {shares} for micro-batches of {sizes} samples; it must give each micro-batch "
                f"a finite, non-negative weight (what its loss averages over, e.g. its tokens that are not ignored), "
                f"not all zero."
            )
        return shares

    def _microbatch_count(self, batch: Any) -> int:
        """The configured count, or fewer for a batch with fewer samples (a last, partial batch)."""
        size = batch_size(batch)
        if size >= self.microbatches:
            return self.microbatches
        if not self._warned_small_batch:
            self._warned_small_batch = True
            rank_zero_warn(
                f"A batch of {size} samples is split into {size} micro-batches instead of {self.microbatches} "
                f"(PipelineParallelStrategy(microbatches={self.microbatches})); results are unchanged, the pipeline "
                f"is less busy. Use batches of at least {self.microbatches} samples.")
        return size


class _Step:
    """One call of the user's step on this rank: its micro-batches and their weights, and what the last stage keeps
    of each micro-batch until the step finishes (training: losses and other returned entries; evaluation: the blocks'
    outputs)."""

    def __init__(self, driver: StepDriver, step_name: str, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                 accumulation: int, scaler: torch.amp.GradScaler | None) -> None:
        self.driver = driver
        self.name = step_name
        self.training = step_name == "training_step"
        self.user_step = getattr(driver.module, step_name)
        self.batch, self.rest, self.kwargs = args[0], args[1:], kwargs
        self.schedule = driver.schedule_for(driver._microbatch_count(self.batch), not self.training)
        self.microbatches, self.sizes = split_batch(self.batch, self.schedule.num_microbatches)
        self.total = sum(self.sizes)
        self.shares = (driver._shares(self.microbatches, self.sizes) if self.training
                       else [float(size) for size in self.sizes])
        self.weights = [share / sum(self.shares) / accumulation for share in self.shares]
        self.scaler = scaler
        self.losses: dict[int, Tensor] = {}  # training: the last stage's micro-batch losses
        self.extras: dict[int, dict[str, Any]] = {}  # training: the other entries of a dict training_step returned
        self.block_outputs: dict[int, Any] = {}  # evaluation on the last stage: what the blocks gave per micro-batch
        self.block_sides: dict[int, Sides] = {}  # ... and what hooks inside every stage's blocks recorded
        # training results known, and posted, before the schedule ended (pipedream_2bw's last stage)
        self.finished: tuple[float, dict[str, Any] | None, list[Any]] | None = None
        self.posted: Any = None

    def forward(self, stage: int, mb: int, received: Any) -> Any:
        """Micro-batch ``mb`` through the user's step as ``stage`` (the runtime's forward): what the blocks send on,
        or on the last stage the weighted loss (training) or nothing (evaluation: the blocks' output is kept)."""
        driver, view = self.driver, self.driver.view
        last_pass = stage == driver.last_stage
        stop_after_blocks = not (last_pass and self.training)
        view.on_blocks_start = lambda: driver.randomness.blocks_start(mb, stage)
        recording = driver.recorder.recording(driver.module, mb if last_pass and self.training else None)
        with view.microbatch(stage, received, stop_after_blocks), driver.randomness.pass_(mb), recording:
            try:
                output = self.user_step(self.microbatches[mb], *self.rest, **self.kwargs)
            except StageOutput as end:
                self._refuse_placeholders(end.output)
                if not last_pass:
                    return with_sides(end.output, end.sides)
                self.block_outputs[mb], self.block_sides[mb] = end.output, end.sides
                return _NOTHING
        if stop_after_blocks or view.last_block_calls == 0:
            raise PipelineConfigError(
                f"{self.name} returned on pipeline stage {stage} without running its blocks "
                f"{view.local.start}-{view.local.stop - 1} of `{view.container_name}`. A pipelined step must run "
                f"every block of the container once per micro-batch (through the model's forward or a loop)."
            )
        refuse_remote(output, f"What {self.name} returned")
        self._refuse_placeholders(output)
        return self._weighted_loss(mb, output)

    def _refuse_placeholders(self, output: Any) -> None:
        """On the first training step (the structure of a step does not change): the pass's result must not depend on
        what stood in for another stage's DTensor outputs (a skip connection across stages; see
        :func:`~lightning_pp.runtime.remote.remote_placeholder`)."""
        placeholders = self.driver.view.placeholders
        if placeholders and self.training and not self.driver.trained:
            refuse_reached(output, placeholders, f"What {self.name} computed on stage {self.driver.view.stage}")

    def _weighted_loss(self, mb: int, output: Any) -> Tensor:
        """Keep what training_step returned for micro-batch ``mb``; its loss weighted by the micro-batch's share (and
        scaled for fp16), for the runtime to back-propagate."""
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if not isinstance(loss, Tensor):
            raise PipelineConfigError(
                f"training_step returned {type(output).__name__}; with PipelineParallelStrategy it must return "
                f"the loss tensor or a dict with a 'loss' tensor (skipping a step by returning None is not "
                f"supported)."
            )
        self.losses[mb] = loss.detach()  # read once after the step: a read per micro-batch would stall a GPU
        if isinstance(output, Mapping) and len(output) > 1:
            self.extras[mb] = {k: v.detach() if isinstance(v, Tensor) else v for k, v in output.items() if k != "loss"}
        return self.scaler.scale(loss * self.weights[mb]) if self.scaler is not None else loss * self.weights[mb]

    def finish_training(self) -> tuple[float, dict[str, Any] | None, list[Any]]:
        """The last stage's training result: the loss averaged over the micro-batches by their shares, the other
        returned entries merged over them, and the step's log records."""
        records = self.driver.recorder.combine(self.shares)
        order = sorted(self.losses)
        values = torch.stack([self.losses[mb] for mb in order]).double().tolist()
        loss = sum(value * self.shares[mb] for value, mb in zip(values, order, strict=True)) / sum(self.shares)
        extra = merge_microbatches([self.extras[mb] for mb in order], self.sizes) if self.extras else None
        return loss, extra, records

    def finish_evaluation(self) -> tuple[Any, list[Any]]:
        """The last stage's evaluation result: the user's step run once on the whole batch with the blocks' joined
        outputs (so every logged value and prediction is one device's), and its log records."""
        driver = self.driver
        order = range(len(self.microbatches))
        joined = merge_microbatches([self.block_outputs[mb] for mb in order], self.sizes)
        recorded = [self.block_sides[mb] for mb in order]
        sides = joined_sides(recorded, self.sizes) if any(recorded) else []
        recording = driver.recorder.recording(driver.module, 0)
        try:
            with driver.view.finishing(joined, sides), driver.randomness.pass_(-1), recording:
                result = self.user_step(self.batch, *self.rest, **self.kwargs)
        except SeveralPasses:  # generation: the step runs again, eagerly, on every stage
            driver.recorder.combine([self.total])  # what it logged so far is dropped
            return _AGAIN, []
        refuse_remote(result, f"What {self.name} returned")
        return result, driver.recorder.combine([self.total])

    def returned(self, result: Any, extra: dict[str, Any] | None) -> Any:
        """What the user's step returns on one device, on this rank's device, from what the last stage shared."""
        device = self.driver.device
        if not self.training:
            return move_data_to_device(result, device)
        loss = torch.tensor(result, dtype=torch.get_default_dtype(), device=device)
        # what training_step returned on one device: the loss, and any other entries merged over micro-batches
        return {"loss": loss, **move_data_to_device(extra, device)} if extra else loss
