"""PipelineParallelStrategy: Lightning's hooks translated into calls of the schedule, runtime and P2P core."""

from __future__ import annotations

import logging
import os
import signal
import textwrap
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import ReduceOp
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning.pytorch.utilities.types import STEP_OUTPUT
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_pp import _compat
from lightning_pp._allocator import keep_freed_cpu_memory
from lightning_pp._failures import FailureSignal, naming_failures
from lightning_pp._logs import LogRecorder
from lightning_pp.actions import Schedule
from lightning_pp.checkpoint import StageCheckpoints
from lightning_pp.grads import add_to_grads
from lightning_pp.model.assembly import (
    StageAssembly,
    assemble_stage,
    is_assembled,
    place_outside_weights,
    placement_of,
    setup_optimizers_everywhere,
)
from lightning_pp.model.balance import resolve_balance
from lightning_pp.model.placement import WeightPlacement
from lightning_pp.model.results import outputs_read
from lightning_pp.model.step import StepDriver
from lightning_pp.options import PipelineOptions, check, documented_arguments
from lightning_pp.p2p import StageP2P, connect_stages
from lightning_pp.schedules import StepSchedules
from lightning_pp.telemetry import PipelineTelemetry
from lightning_pp.topology import PipelineLayout, start_process_group

__all__ = ["PipelineParallelStrategy"]


log = logging.getLogger(__name__)


class PipelineParallelStrategy(ParallelStrategy):
    """Train a LightningModule pipeline-parallel: its container of repeated blocks is split into stages, one per device,
    and the world holds one pipeline or several data-parallel replicas of it.

    The container (an ``nn.Sequential``, ``nn.ModuleList`` or ``nn.ModuleDict``: transformer layers, MLP blocks) is
    found automatically or named with ``blocks``. Each stage keeps a contiguous run of blocks. The weights outside the
    container (embeddings, heads, norms) start from rank 0's values; from the first training step on, each is kept
    only on the ranks that use it (``outside_weights``), with its gradient summed over them, so weights tied across
    the blocks (embedding and head) train correctly.

    Per optimizer step, each batch is split into ``microbatches`` micro-batches and run through the stages by the
    chosen schedule. Every stage runs the user's step for every micro-batch: the blocks of other stages are weightless
    stand-ins, this stage's first block takes the activation received from the previous stage, and after its last
    block a non-last stage ends the step; the last stage goes on to the head and the loss with the user's own code.
    Each micro-batch's loss is weighted by its share of the samples, so for losses that average over the batch (every
    torch loss by default) gradients and the returned loss equal single-device training. Validation, test and predict
    run the micro-batches through the blocks with the forward-only schedule, then the user's step once on the whole
    batch on the last stage, so logged values and predictions equal one device's.

    With ``pipeline_parallel_size=P`` each pipeline has ``P`` stages and the world (``devices x num_nodes``) holds
    ``world / P`` data-parallel replicas of it: each replica loads its own shard of the data, and every stage's
    gradients are averaged over its replicas once per optimizer step, as DDP does. Replicas of a stage sit on
    neighbouring ranks (``rank = stage * replicas + replica``; see :class:`~lightning_pp.PipelineLayout` and
    :attr:`layout`), so gradient all-reduces stay inside a node and only point-to-point transfers cross nodes.

    Raises:
        PipelineConfigError: for an argument of the wrong type or value, a world size that is not a multiple of
            ``pipeline_parallel_size``, a ``balance`` that does not fit the container or the number of stages, a
            module without a block container, or manual optimization.

    Example:
        ``trainer = L.Trainer(accelerator="cpu", devices=2, strategy=PipelineParallelStrategy(schedule="1f1b"))``

    Every argument but Lightning's own (``accelerator`` ... ``precision_plugin``) is a field of
    :class:`~lightning_pp.options.PipelineOptions`; the list below is made from its field docstrings.
    """

    strategy_name = "pipeline"

    def __init__(  # the arguments of PipelineOptions, then Lightning's own (LightningCLI reads this signature)
        self, *, schedule: str | os.PathLike[str] = "1f1b", pipeline_parallel_size: int | None = None,
        stages_per_rank: int | None = None, microbatches: int | None = None, blocks: str | None = None,
        sequential: str | None = None, balance: Sequence[int] | str | None = None, timeout: float = 300.0,
        process_group_timeout: float | timedelta | None = None, checkpoint_format: str = "full",
        process_group_backend: str | None = None, reuse_cpu_memory: bool = True,
        microbatch_weight: Callable[[Any], Any] | None = None, activation_checkpointing: bool | int = False,
        outside_weights: str = "where_used", accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None, cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None, precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self.options = PipelineOptions(
            schedule=schedule, pipeline_parallel_size=pipeline_parallel_size, stages_per_rank=stages_per_rank,
            microbatches=microbatches, blocks=blocks, sequential=sequential, balance=balance, timeout=timeout,
            process_group_timeout=process_group_timeout, checkpoint_format=checkpoint_format,
            process_group_backend=process_group_backend, reuse_cpu_memory=reuse_cpu_memory,
            microbatch_weight=microbatch_weight, activation_checkpointing=activation_checkpointing,
            outside_weights=outside_weights)
        self._process_group_backend = process_group_backend  # chosen from the device in setup_environment if None
        self._placement: WeightPlacement | None = None
        self._num_nodes = 1
        self._assembly: StageAssembly | None = None
        self._checkpoints: StageCheckpoints | None = None
        self._driver: StepDriver | None = None
        self._hidden_example_input: Any = None  # example_input_array while fit starts (see _prepare_module)
        self._p2p: StageP2P | None = None
        # a gloo group over the world for object collectives where the default group is not gloo (None: the default)
        self.object_group: Any = None
        self._accumulating = False  # inside Lightning's block_backward_sync: gradients not synchronized yet
        self._failures: FailureSignal | None = None
        self._schedules: StepSchedules | None = None
        self._log_recorder = LogRecorder()
        self.telemetry = PipelineTelemetry()  # what PipelineMonitor reads, and its request for a timed step

    # ------------------------------------------------------------------------------------------------ Lightning wiring

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def num_stages(self) -> int:
        """Ranks per pipeline: ``pipeline_parallel_size``, or by default one per process in the job. (Each holds
        ``stages_per_rank`` stages; :attr:`stage` is this rank's place in its pipeline.)"""
        return self.options.pipeline_parallel_size or max(1, self._world)

    @property
    def num_replicas(self) -> int:
        """Data-parallel replicas of the pipeline."""
        return max(1, self._world // self.num_stages)

    @property
    def layout(self) -> PipelineLayout:
        """Which global rank holds which stage of which replica."""
        return PipelineLayout(self.num_stages, self.num_replicas)

    @property
    def stage(self) -> int:
        return self.layout.stage_of(self.global_rank)

    @property
    def replica(self) -> int:
        return self.layout.replica_of(self.global_rank)

    @property
    def _world(self) -> int:
        return self.num_nodes * self.num_processes

    @property
    def schedule_name(self) -> str:
        return str(self.options.schedule)

    @property
    def stages_per_rank(self) -> int:
        assert self.options.stages_per_rank is not None  # set on construction
        return self.options.stages_per_rank

    @property
    def checkpoint_format(self) -> str:
        return self.options.checkpoint_format

    @property
    def last_schedule(self) -> Schedule | None:
        """The schedule of the latest training step."""
        return self.telemetry.last_schedule

    @property
    def timeout(self) -> float:
        """Seconds a stage waits for a peer's transfer (see :class:`~lightning_pp.options.PipelineOptions`)."""
        return self.options.transfer_timeout

    @property
    def process_group_timeout(self) -> timedelta:
        return self.options.group_timeout

    @property
    def microbatches(self) -> int:
        return self.options.microbatches if self.options.microbatches is not None else 2 * self.num_stages

    @property
    def last_grad_sync_bytes(self) -> int:
        """Gradient bytes this rank all-reduced at the latest optimizer step (replicas' average, shared weights)."""
        return self._assembly.grads.last_bytes if self._assembly is not None else 0

    @property
    def is_distributed(self) -> bool:
        # With one data-parallel replica there is nothing to shard or to sync: saying "not distributed" keeps the
        # user's DataLoader as it is (Lightning would inject an always-shuffling DistributedSampler) and makes
        # `sync_dist` a no-op, both exactly as on one device. Stages agree on shuffled batches because every step
        # leaves the CPU random generator as it found it (see StepRandomness). With replicas, as DDP.
        return self.num_replicas > 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every stage of a pipeline loads the same samples: shard over the replicas only
        return {"num_replicas": self.num_replicas, "rank": self.replica}

    def _check_layout(self) -> None:
        """Errors every rank raises alike before any collective (the world size is known from here on)."""
        self.options.check_world(self.num_stages, self.num_processes, self.num_nodes)

    @override
    def _configure_launcher(self) -> None:
        self._check_layout()  # in the launching process, before any worker starts
        assert self.cluster_environment is not None
        self._launcher = _compat._SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        self._check_layout()  # again before the process group exists (torchrun starts every rank itself)
        backend = self._process_group_backend or _compat._get_default_process_group_backend_for_device(
            self.root_device
        )
        self.options.check_backend(backend, self.root_device)
        super().setup_environment()
        if self.options.reuse_cpu_memory and self.root_device.type == "cpu":
            keep_freed_cpu_memory()
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self._world)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        self._process_group_backend = backend
        self._schedules = None  # built for this world
        self.object_group = start_process_group(self.cluster_environment, backend, self.process_group_timeout,
                                                self._world, self.global_rank)
        if self._world > 1:
            self._failures = FailureSignal.for_this_fit(_compat._default_store(), self.global_rank,
                                                        grace=self.timeout + 5)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._prepare_module(module, fitting)
        schedule = self._schedule(self.microbatches, forward_only=False)  # raises for a count it cannot run
        place_where_used = fitting and self.num_stages > 1 and self.options.outside_weights == "where_used"
        assembly = self._assembly = assemble_stage(
            module, schedule, self.layout, self.global_rank, blocks=self.options.blocks_name,
            balance=self._balance_for(trainer, module), recompute_every=self.options.recompute_every,
            device=self.root_device, new_group=self._new_group, to_device=self._convert_and_move,
            place_where_used=place_where_used)
        self._placement = assembly.placement if place_where_used else None
        if fitting:
            setup_optimizers_everywhere(lambda: self.setup_optimizers(trainer), module, assembly.partition,
                                        self.stage, self._world, self.object_group)
        self.setup_precision_plugin()
        assembly.grads.install(self.precision_plugin, self._grad_scaler())
        if fitting:
            _compat._optimizers_to_device(self.optimizers, self.root_device)
        self._connect(module, schedule, assembly)

    def _prepare_module(self, module: pl.LightningModule, fitting: bool) -> None:
        """Refuse manual optimization; set ``example_input_array`` aside while fit starts: Lightning's model summary
        (and a logger's graph) run the module on it outside the pipelined step, where other stages' blocks cannot
        run. It is back once training starts."""
        check(not (fitting and not module.automatic_optimization),
              f"{type(module).__name__} uses manual optimization (automatic_optimization=False), which "
              f"PipelineParallelStrategy does not support: the schedule runs forward and backward itself. Use "
              f"automatic optimization, where Lightning calls the optimizers after the pipelined step.")
        if fitting and self.num_stages > 1 and module.example_input_array is not None:
            self._hidden_example_input = module.example_input_array
            module.example_input_array = None
            if self.global_rank == 0:
                log.info("example_input_array is set aside until training starts: the model summary is shown without "
                         "input and output sizes (a pipeline cannot run the whole model outside its steps).")

    def _connect(self, module: pl.LightningModule, schedule: Schedule, assembly: StageAssembly) -> None:
        """The parts that run a step on the assembled stage: transfers, logging, the step driver, checkpoints and
        what the monitor reads."""
        partition, groups = assembly.partition, assembly.groups
        pipeline_groups = groups if self.num_stages > 1 else None
        self._log_recorder.attach(module, pipeline_groups)
        if self.num_stages > 1:
            self._p2p = connect_stages(groups, schedule.stage_to_rank, self.root_device, self.timeout, lambda ranks: (
                dist.new_group(ranks, backend="gloo", timeout=self.process_group_timeout)))
        self._driver = StepDriver(module, partition.view, self._p2p, self._log_recorder, self.root_device,
                                  self._schedule, self.microbatches, self.options.microbatch_weight, pipeline_groups,
                                  position=self.stage, shared=assembly.shared)
        self._checkpoints = StageCheckpoints(
            module, partition, self._not_on_last_stage, world=self._world, rank=self.global_rank, stage=self.stage,
            replica=self.replica, num_stages=self.num_stages, rank_of=self.layout.rank,
            object_group=lambda: self.object_group, device=self.root_device)
        telemetry = self.telemetry
        telemetry.device, telemetry.stage, telemetry.replica = self.root_device, self.stage, self.replica
        telemetry.object_group, telemetry.view = self.object_group, partition.view

    def _balance_for(self, trainer: pl.Trainer, module: pl.LightningModule) -> list[int] | None:
        """Blocks per stage for the split: the user's list, ``None`` for an even split, or what ``balance="params"`` /
        ``"time"`` give (the same on every rank: ``"time"`` measures on global rank 0 and broadcasts). Nothing is
        measured for a module an earlier run split (that split is kept) or for a single stage."""
        options = self.options
        num_stages = self.num_stages * self.stages_per_rank
        if options.balance_by not in ("params", "time") or num_stages == 1 or is_assembled(module):
            return options.balance_list
        return resolve_balance(options.balance_by, module, options.blocks_name, num_stages, trainer,
                               device=self.root_device, microbatches=self.microbatches,
                               precision=self.precision_plugin, recompute_every=options.recompute_every,
                               global_rank=self.global_rank, world_size=self._world, collective=self._collective,
                               object_group=self.object_group)

    def _convert_and_move(self) -> None:
        assert self.model is not None
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def barrier(self, name: str | None = None) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=self.object_group)
        return box[0]

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """Reduce over the data-parallel replicas (``group`` None), as DDP reduces over its ranks: ``self.log(...,
        sync_dist=True)`` and torchmetrics see one value per replica. Every stage of a pipeline holds its replica's
        value (the last stage's, replayed), so each stage reduces within its own replica group."""
        if not isinstance(tensor, Tensor):
            return tensor
        if group is None:
            if self.num_replicas == 1:
                return tensor
            assert self._assembly is not None
            group = self._assembly.groups.replicas
        return _compat._sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Gather over the data-parallel replicas (``group`` None): one entry per replica, as DDP gives one per rank;
        with one replica the tensor itself, as on one device."""
        if group is None:
            if self.num_replicas == 1:
                return tensor
            assert self._assembly is not None
            group = self._assembly.groups.replicas
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Agree over every rank of the job (every stage of every replica), e.g. on stopping early."""
        votes = torch.tensor(int(decision), device=self.root_device)
        if self._world > 1:
            votes = _compat._sync_ddp_if_available(votes, None, reduce_op="sum")
        return bool(votes == self._world) if all else bool(votes)

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's accumulation steps run in here: their gradients are synchronized with the optimizer step's."""
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def _where(self) -> str:
        replica = f"replica {self.replica}, " if self.num_replicas > 1 else ""
        return f"stage {self.stage} ({replica}rank {self.global_rank})"

    def _collective(self, what: str) -> AbstractContextManager[None]:
        return naming_failures(self._where, what, self._failures)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Make this rank's failure end the whole job: tell the other ranks, and take down the launched ones."""
        if self._failures is not None:
            self._failures.report(f"{self._where()} failed: {type(exception).__name__}: {str(exception)[:2000]}")
            self._failures = None
            if self.global_rank == 0:
                time.sleep(1.5)  # rank 0 hosts the store: let the other ranks read the flag before this process ends
        launcher = self.launcher
        if isinstance(launcher, _compat._SubprocessScriptLauncher) and launcher.procs:
            launcher.kill(signal.SIGKILL)

    # ------------------------------------------------------------------------------------------------ the step

    @override
    def on_train_start(self) -> None:
        self._restore_example_input()
        self._decide_outputs("training_step")

    def _restore_example_input(self) -> None:
        if self._hidden_example_input is not None and self.lightning_module is not None:
            self.lightning_module.example_input_array = self._hidden_example_input
            self._hidden_example_input = None

    @override
    def on_validation_start(self) -> None:
        self._decide_outputs("validation_step")

    @override
    def on_test_start(self) -> None:
        self._decide_outputs("test_step")

    @override
    def on_predict_start(self) -> None:
        self._decide_outputs("predict_step")

    def _decide_outputs(self, step_name: str) -> None:
        """Send the step's outputs from the last stage to the others only if something there reads them."""
        module = self.lightning_module
        if self._driver is None or module is None or self.num_stages == 1:
            return
        with self._collective(f"agreeing whether the stages read what {step_name} returns"):
            sent = self._driver.decide_outputs(step_name, outputs_read(module.trainer, step_name))
        if not sent and step_name == "predict_step" and self.global_rank == 0:
            assert self._assembly is not None
            last_rank = self._assembly.groups.last_stage_rank
            log.info(f"The predictions stay on the pipeline's last stage (rank {last_rank}): "
                     f"nothing on the other stages reads them (return_predictions=False, no prediction writer, no "
                     f"on_predict_batch_end hook), so predict_step returns None there.")

    def _schedule(self, num_microbatches: int, forward_only: bool) -> Schedule:
        """The schedule of a batch of ``num_microbatches`` (the world size is known from setup on)."""
        if self._schedules is None:
            self._schedules = StepSchedules(self.schedule_name, self.num_stages, self.microbatches,
                                            self.stages_per_rank, fixed_count=self.options.schedule_file is not None)
        return self._schedules(num_microbatches, forward_only)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.train_step_context():
            return self._pipelined_step("training_step", args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.val_step_context():
            return self._pipelined_step("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.test_step_context():
            return self._pipelined_step("test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._pipelined_step("predict_step", args, kwargs)

    def _pipelined_step(self, step_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        assert self._driver is not None and self._assembly is not None and self.lightning_module is not None
        training = step_name == "training_step"
        if training and self._placement is not None and self._placement.wants_observation():
            self._placement.observe()
        result = self._driver.run(
            step_name, args, kwargs, collective=self._collective,
            accumulation=self.lightning_module.trainer.accumulate_grad_batches if training else 1,
            scaler=self._grad_scaler() if training else None,
            timing_sink=self.telemetry.timing_sink,
        )
        if training:
            self.telemetry.last_schedule = self._driver.last_schedule
        return result

    def _grad_scaler(self) -> torch.amp.GradScaler | None:
        scaler = getattr(self.precision_plugin, "scaler", None)
        return scaler if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled() else None

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Hand over the gradients the schedule computed; never back-propagate ``closure_loss`` again."""
        module = self.lightning_module
        assert module is not None and self._driver is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        add_to_grads(self._driver.pending_grads)
        self._driver.pending_grads = []
        if not self._accumulating:  # the optimizer step's backward, as DDP's
            assert self._assembly is not None
            if self._placement is not None and self._placement.observation is not None:
                with self._collective("agreeing on which ranks use the weights outside the blocks"):
                    self._driver.shared = place_outside_weights(self._assembly, self.optimizers, self.root_device,
                                                                self._new_group)
            timed = self.telemetry.timing_sink is not None and self._world > 1
            with self._collective("the gradient all-reduce (replicas' average, weights several stages hold)"):
                sync_ms = self._assembly.grads.synchronize([p for p in module.parameters() if p.requires_grad], timed)
            if timed:  # for PipelineMonitor
                self.telemetry.last_grad_sync_ms = sync_ms
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    # ------------------------------------------------------------------------------------------------ checkpoints

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # load into the partitioned module and the stage's optimizers

    def _not_on_last_stage(self) -> set[str]:
        """The state entries the last stage does not hold (weights used before the blocks only)."""
        placement = placement_of(self.lightning_module) if self.lightning_module is not None else None
        last_rank = self._schedule(self.microbatches, False).stage_to_rank[-1]
        return placement.missing_keys(last_rank) if placement is not None else set()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None and self._checkpoints is not None
        if self.options.checkpoint_format == "sharded" or self.num_stages == 1:
            return self.lightning_module.state_dict()
        return self._checkpoints.full_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self._checkpoints is not None
        return self._checkpoints.optimizer_state(optimizer, full=self.options.checkpoint_format == "full")

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if self.options.checkpoint_format == "full":
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        else:
            assert self._checkpoints is not None
            self._checkpoints.save_sharded(checkpoint, str(filepath))

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        if not os.path.isdir(str(checkpoint_path)):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        assert self._checkpoints is not None
        return self._checkpoints.load_sharded(str(checkpoint_path), bool(weights_only))

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self._checkpoints is not None
        self._checkpoints.load_module_state(checkpoint["state_dict"], strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self._checkpoints is not None
        self._checkpoints.load_optimizer_states(self.optimizers, checkpoint["optimizer_states"])

    def _new_group(self, ranks: list[int]) -> Any:
        return dist.new_group(ranks, backend=self._process_group_backend, timeout=self.process_group_timeout)

    @override
    def teardown(self) -> None:
        created = self._assembly.groups.created if self._assembly is not None else []
        if dist.is_initialized():  # the default group is Lightning's to destroy
            for group in created:
                dist.destroy_process_group(group)
        created.clear()
        if self.object_group is not None and dist.is_initialized():
            dist.destroy_process_group(self.object_group)
        self.object_group = None
        if self._placement is not None:
            self._placement.cancel()
        if self._assembly is not None:
            self._assembly.grads.uninstall()
        self._p2p = None
        if self._failures is not None:
            self._failures.stop()
            self._failures = None
        self._log_recorder.detach()
        self._restore_example_input()
        super().teardown()



# the arguments, described once beside PipelineOptions' fields
PipelineParallelStrategy.__doc__ = "\n".join([PipelineParallelStrategy.__doc__ or "",
                                              textwrap.indent(documented_arguments(), "    ")])
StrategyRegistry.register(
    PipelineParallelStrategy.strategy_name,
    PipelineParallelStrategy,
    description="Pipeline parallelism over the LightningModule's block container (lightning_pp)",
)
