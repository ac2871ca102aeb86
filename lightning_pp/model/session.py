"""One Trainer run (fit, validate, test or predict) on this rank's assembled stage: the transfers, the step driver,
the logged values' recorder, the hand-over of each step's gradients to Lightning and their synchronization, the
checkpoints and what the monitor reads. The strategy opens a session in ``setup`` and closes it at ``teardown``; its
hooks call the session."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_pp import _compat
from lightning_pp._logging import get_logger
from lightning_pp.checkpoint.state import StageCheckpoints
from lightning_pp.model.assembly import (
    StageAssembly,
    check_initialized,
    place_outside_weights,
    placement_of,
    set_aside_example_input,
    shard_outside_weights,
)
from lightning_pp.model.batches import BatchGuard
from lightning_pp.model.callbacks import adapt_callbacks
from lightning_pp.model.eager import EagerLink
from lightning_pp.model.logs import HookLogs, LogRecorder
from lightning_pp.model.results import outputs_read
from lightning_pp.model.step import StepDriver
from lightning_pp.model.summary import summarize_whole_model
from lightning_pp.monitor.telemetry import PipelineTelemetry
from lightning_pp.options import PipelineOptions
from lightning_pp.parallel.ending import SigtermAtStepStart
from lightning_pp.parallel.grads import add_to_grads
from lightning_pp.pipedream.step import DelayedUpdates, SigtermAtNextStep, refuse_for_delayed_updates
from lightning_pp.pipedream.stream import stream_cuts
from lightning_pp.run import RunContext
from lightning_pp.runtime.p2p import StageP2P, connect_stages
from lightning_pp.schedule.actions import Schedule
from lightning_pp.schedule.build import StepSchedules

__all__ = ["StageSession", "release"]

log = get_logger(__name__)

Collective = Callable[[str], AbstractContextManager[None]]


def _logs_around_optimizer_step(module: pl.LightningModule) -> bool:
    """Whether the module or a callback overrides a hook around the optimizer step, where it may log."""
    hooks = ("on_after_backward", "on_before_optimizer_step")
    callbacks = module.trainer.callbacks  # type: ignore[attr-defined]
    return (any(is_overridden(hook, module) for hook in hooks)
            or any(is_overridden(hook, callback, pl.Callback) for hook in hooks for callback in callbacks))


def release(assembly: StageAssembly) -> None:
    """Destroy the groups the assembly created, stop observing the placement, undo the gradient patches, remove the
    side outputs' recording hooks: what a run leaves behind (also when its setup failed half-way)."""
    created = assembly.groups.created
    if dist.is_initialized():  # the default group is Lightning's to destroy
        for group in created:
            dist.destroy_process_group(group)
    created.clear()
    if assembly.placing is not None:
        assembly.placing.cancel()
    assembly.grads.uninstall()
    assembly.partition.view.sides.remove()
    view = assembly.partition.view
    view.eager, view.rank_of = None, int  # outside a run, the blocks refuse to run again


def _not_on_last_stage(module: pl.LightningModule, schedules: Callable[[int, bool], Schedule],
                       microbatches: int) -> set[str]:
    """The state entries the last stage does not hold (weights used before the blocks only)."""
    placement = placement_of(module)
    last_rank = schedules(microbatches, False).stage_to_rank[-1]
    return placement.missing_keys(last_rank) if placement is not None else set()


class StageSession:
    """This rank's stage during one Trainer run (``run``), from its assembly to its teardown."""

    def __init__(self, run: RunContext, module: pl.LightningModule, assembly: StageAssembly,
                 schedules: StepSchedules, telemetry: PipelineTelemetry) -> None:
        self.module, self.assembly, self.schedules, self.telemetry = module, assembly, schedules, telemetry
        layout, rank, device, options, fitting = run.layout, run.rank, run.device, run.options, run.fitting
        self.layout, self.rank, self.device, self.stage = layout, rank, device, run.stage
        microbatches = run.microbatches
        self.new_group, self.object_group = run.new_group, run.object_group
        object_group = run.object_group
        partition, groups = assembly.partition, assembly.groups
        partition.view.sides.every_block = options.carry_block_outputs
        pipelined = layout.num_stages > 1
        p2p: StageP2P | None = None
        if pipelined:  # first: the one part that can fail (then the strategy releases the assembly)
            stage_to_rank = schedules(microbatches, False).stage_to_rank
            p2p = connect_stages(groups, stage_to_rank, device, options.transfer_timeout, lambda ranks: (
                dist.new_group(ranks, backend="gloo", timeout=options.timeout)))
        if pipelined:
            self._connect_eager(options, stage_to_rank, p2p)
        self.recorder = LogRecorder()
        self.recorder.attach(module, groups if pipelined else None)
        self._hook_logs = HookLogs(groups.pipeline) if pipelined and _logs_around_optimizer_step(module) else None
        self.driver = StepDriver(module, partition.view, p2p, self.recorder, device, schedules, microbatches,
                                 options.microbatch_weight, groups if pipelined else None, position=self.stage,
                                 outside=lambda: partition.shared_tensors(module)[0])
        # every stage's batch checked against the others' (in the results' gloo group, see model/batches.py)
        self.batches = BatchGuard(
            (p2p.results_group if p2p.results_group is not None else groups.pipeline) if p2p is not None else None,
            rank, layout.stage_of, options.transfer_timeout, lambda: module.trainer,
            (layout.num_replicas, layout.replica_of(rank)))
        self._sigterm: SigtermAtNextStep | None = None  # pipedream_2bw: the SIGTERM agreement without a barrier
        self._undo_sigterm: Callable[[], None] = lambda: None
        if pipelined and fitting and options.schedule == "pipedream_2bw":
            refuse_for_delayed_updates(module.trainer)
            assert p2p is not None  # (pipelined)
            cuts = stream_cuts(layout.num_stages, microbatches, sends_across_steps=not p2p.on_device_streams)
            self.driver.delayed = DelayedUpdates(cuts, self.stage)
        self.checkpoints = StageCheckpoints(
            module, partition, lambda: _not_on_last_stage(module, schedules, schedules.microbatches),
            world=layout.world_size, rank=rank, stage=self.stage, lane=layout.lane_of(rank),
            num_stages=layout.num_stages, rank_of=layout.rank, object_group=object_group, device=device)
        checkpoints = self.checkpoints  # (closures that outlive the run hold no session: it holds the run's groups)
        adapt_callbacks(module.trainer, module, gather=lambda: checkpoints.module_state("full"),
                        num_replicas=layout.num_replicas, split=pipelined, fitting=fitting)
        self._undo_summary = summarize_whole_model(module.trainer, layout.stage_of, object_group) if pipelined else None
        # until training starts (see set_aside_example_input)
        self._example_input = set_aside_example_input(module, rank) if fitting and pipelined else None
        telemetry.device, telemetry.stage, telemetry.lane = device, self.stage, layout.lane_of(rank)
        telemetry.object_group, telemetry.view = object_group(), partition.view
        # schedule="auto" chose for this run: its closed loop watches the first training steps
        self.auto = run.auto if fitting and pipelined and run.auto is not None else None
        if run.auto is not None:
            telemetry.auto_choice = telemetry.auto_first_choice = run.auto.chosen

    def _connect_eager(self, options: PipelineOptions, stage_to_rank: Sequence[int], p2p: StageP2P | None) -> None:
        """Passes through the blocks outside the pipelined micro-batches (see :mod:`lightning_pp.model.eager`)."""
        view, layout, lane = self.assembly.partition.view, self.layout, self.layout.lane_of(self.rank)
        view.eager = EagerLink(self.assembly.groups.pipeline, self.device, options.transfer_timeout,
                               where=lambda: f"stage {self.stage} (rank {self.rank})",
                               hook=lambda: _compat.current_hook(self.module),
                               mesh_of=p2p.mesh_of if p2p is not None else None,
                               host_group=p2p.results_group if p2p is not None else None)  # NCCL: headers on the host
        view.rank_of = lambda stage: layout.rank(stage_to_rank[stage], lane)
        placement = self.assembly.placement
        if placement is not None:
            placement.share_through = view.sharing_outputs
            placement.global_rank_of = lambda position: layout.rank(position, lane)

    def start_loop(self, step_name: str, collective: Collective) -> None:
        """At the start of a loop (after a checkpoint was restored): refuse what a meta-device build left
        uninitialized, and send the step's outputs from the last stage to the others only if something there reads
        them."""
        if self.assembly.materialized:
            with collective("agreeing that every weight built on the meta device is initialized"):
                check_initialized(self.assembly, self.module, self.layout, self.rank, self.object_group())
        if self.layout.num_stages == 1:
            return
        if step_name == "training_step" and self.driver.delayed is not None:  # no barrier between its steps
            self._sigterm = SigtermAtNextStep(self.module.trainer, self.object_group())
            self._undo_sigterm = _compat.replace_sigterm_handling(self.module.trainer, self._sigterm)
        elif step_name == "training_step":  # a SIGTERM stops every rank at the same step (parallel.ending)
            self._restore_sigterm()  # (a second fit of this run's Trainer)
            agree = SigtermAtStepStart(self.module.trainer, self.object_group())
            self._undo_sigterm = _compat.replace_sigterm_handling(self.module.trainer, agree, record=agree.record)
        with collective(f"agreeing whether the stages read what {step_name} returns"):
            sent = self.driver.decide_outputs(step_name, outputs_read(self.module.trainer, step_name))
        if not sent and step_name == "predict_step" and self.rank == 0:
            log.info(f"The predictions stay on the pipeline's last stage (rank {self.assembly.groups.last_stage_rank}):"
                     f" nothing on the other stages reads them (return_predictions=False, no prediction writer, no "
                     f"on_predict_batch_end hook), so predict_step returns None there.")

    def run_step(self, step_name: str, args: tuple[Any, ...], kwargs: dict[str, Any], collective: Collective,
                 scaler: torch.amp.GradScaler | None) -> Any:
        """The user's ``step_name`` run pipelined; what it returns on one device."""
        training = step_name == "training_step"
        timing_sink = self.telemetry.timing_sink
        if training and self.auto is not None:
            timing_sink, switched = self.auto.before_training_step(timing_sink, collective)
            self.telemetry.auto_choice, self.telemetry.auto_measured_step_s = self.auto.chosen, self.auto.measured_s
            if switched is not None:  # every rank, before this same step
                assert switched.microbatches is not None
                self.schedules.switch(str(switched.schedule), switched.microbatches)
                self.driver.microbatches = switched.microbatches
                for logger in self.module.trainer.loggers:  # (they write on global rank 0 only)
                    logger.log_hyperparams({"pipeline_auto/schedule": switched.schedule,
                                            "pipeline_auto/microbatches": switched.microbatches})
        elif self.auto is not None:
            self.auto.evaluation_step()
        placing = self.assembly.placing
        if training and placing is not None and placing.wants_observation():
            placing.observe()
        with self.batches.checking(step_name, args):
            result = self.driver.run(
                step_name, args, kwargs, collective=collective,
                accumulation=self.module.trainer.accumulate_grad_batches if training else 1,
                scaler=scaler if training else None, timing_sink=timing_sink)
        if training:
            self.telemetry.last_schedule = self.driver.last_schedule
        return result

    def hand_over_grads(self, optimizer_step: bool, optimizers: Sequence[Any], collective: Collective) -> None:
        """Add the step's gradients to the parameters' (Lightning zeroed them after the step). At the optimizer step,
        as DDP's backward: after the first observed step, keep the weights outside the blocks only where they are used;
        then average over the replicas and sum the weights several stages hold."""
        add_to_grads(self.driver.pending_grads)
        self.driver.pending_grads = []
        if not optimizer_step:
            return
        if self.driver.delayed is not None:  # before the optimizer step replaces the weights in place
            self.telemetry.kept_weight_bytes = self.driver.delayed.keep_weights()
        assembly = self.assembly
        if assembly.placing is not None and assembly.placing.observation is not None:
            delayed = self.driver.delayed  # pipedream_2bw hands over the previous batch's: show the observed one's
            with collective("agreeing on which ranks use the weights outside the blocks"), (
                    delayed.showing_latest_grads() if delayed is not None else nullcontext()):
                place_outside_weights(assembly, optimizers, self.device, self.new_group)
        timed = self.telemetry.timing_sink is not None and self.layout.world_size > 1
        if assembly.sharding is not None:
            with collective("the blocks' gradient reduce-scatter over the replicas (FSDP2)"):
                assembly.sharding.reduce_grads()
        with collective("the gradient all-reduce (replicas' average, weights several stages hold)"):
            # pipedream_2bw: a weight frozen since the handed batch ran still gets that batch's gradient
            handed = self.driver.delayed.handed_weights if self.driver.delayed is not None else set()
            params = [p for p in self.module.parameters() if p.requires_grad or p in handed]
            sync_ms = assembly.grads.synchronize(params, timed)
        if self.driver.delayed is not None and self.driver.delayed.restored:
            self.driver.delayed.hand_over_restored(self.module)
        if assembly.to_shard is not None:
            with collective("sharding the weights outside the blocks over the replicas (FSDP2)"):
                shard_outside_weights(assembly, optimizers)
        self.telemetry.last_grad_sync_bytes = assembly.grads.last_bytes
        if timed:  # for PipelineMonitor
            self.telemetry.last_grad_sync_ms = sync_ms

    def drain(self) -> None:
        """``pipedream_2bw``: back up what the stream left in flight (before validation, whose passes then have the
        transfers to themselves, and before a checkpoint; every rank at once)."""
        self.driver.drain()
        self.telemetry.kept_weight_bytes = 0

    def end_fit(self, collective: Collective) -> dict[str, torch.Tensor]:
        """``pipedream_2bw``: end the stream at the end of fit (drained; Lightning's SIGTERM handling given back);
        returns the last batch's gradient, which fit leaves unapplied, for a checkpoint saved after it (see
        :meth:`pending_gradient`)."""
        if self.driver.delayed is None:
            return {}
        unapplied = self.pending_gradient(collective) or {}
        self.driver.delayed = None
        if self._sigterm is not None:
            self._sigterm.finish()
            self._sigterm = None
        self._restore_sigterm()
        return unapplied

    def pending_gradient(self, collective: Collective) -> dict[str, torch.Tensor] | None:
        """``pipedream_2bw``: the gradient the next optimizer step applies, by parameter name, synchronized as the
        hand-over will synchronize it (every rank calls this at once: it drains the stream first). For a checkpoint,
        so that a run resumed from it goes on as the uninterrupted run. None without a stream (another schedule, or
        not fitting); empty after a step that failed half-way (what was in flight is lost)."""
        delayed = self.driver.delayed
        if delayed is None:
            return None
        if delayed.restored:  # resumed, no step since
            return dict(delayed.restored)
        if delayed.broken:
            return {}
        self.drain()
        # trainable now or during the latest batch (frozen since: its gradient is applied all the same)
        params = [p for p in self.module.parameters() if p.requires_grad or p in delayed.previous]
        live = {p: p.grad for p in params}
        for p in params:
            pending = delayed.previous.get(p)
            p.grad = pending.clone() if pending is not None else None
        try:
            with collective("synchronizing pipedream_2bw's pending gradient for a checkpoint"):
                self.assembly.grads.synchronize(params)
            name_of = {id(p): name for name, p in self.module.named_parameters()}
            return {name_of[id(p)]: p.grad.detach().cpu() for p in params if p.grad is not None}
        finally:
            for p in params:
                p.grad = live[p]

    def restore_pending_gradient(self, saved: dict[str, torch.Tensor]) -> None:
        """``pipedream_2bw``: the entries of a checkpoint's pending gradient for the weights this rank holds, for the
        first optimizer step. Another schedule fitting from it has no gradient pending between steps: it is dropped,
        with a warning."""
        delayed = self.driver.delayed
        if delayed is not None:
            held = dict(self.module.named_parameters())
            delayed.restored = {name: value for name, value in saved.items() if name in held}
        elif saved and self.module.trainer.state.fn == TrainerFn.FITTING and self.rank == 0:
            log.warning("the checkpoint holds schedule='pipedream_2bw''s gradient of its last batch, "
                        "not applied yet; this run's schedule applies every batch's gradient in its own step, so that "
                        "one is dropped (the run resumes as pipedream_2bw would without it).")

    def _restore_sigterm(self) -> None:
        """Give Lightning its SIGTERM handling back (once)."""
        self._undo_sigterm()
        self._undo_sigterm = lambda: None

    def end_loop(self) -> None:
        """At the end of a loop: blocks sharded over the replicas give up the weights their passes gathered."""
        if self.assembly.sharding is not None:
            self.assembly.sharding.reshard()

    def hook_logs(self, collective: Collective) -> AbstractContextManager[None]:
        """Where ``self.log`` in the hooks around the optimizer step is combined over the pipeline (see
        :class:`~lightning_pp.model.logs.HookLogs`)."""
        return self._hook_logs.combining(self.module, collective) if self._hook_logs is not None else nullcontext()

    def restore_example_input(self) -> None:
        if self._example_input is not None:
            self.module.example_input_array = self._example_input
            self._example_input = None

    def close(self) -> None:
        """Release the assembly (see :func:`release`), undo the summary's and the logs' patches, give the module its
        ``example_input_array`` back."""
        self.restore_example_input()
        self._restore_sigterm()
        release(self.assembly)
        self.recorder.detach()
        if self._undo_summary is not None:
            self._undo_summary()
            self._undo_summary = None
