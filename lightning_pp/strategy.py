"""PipelineParallelStrategy: Lightning's hooks translated into calls of the schedule, runtime and P2P core."""

from __future__ import annotations

import dataclasses
import os
import signal
import textwrap
from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning.pytorch.utilities.types import STEP_OUTPUT
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer
from typing_extensions import override

from lightning_pp import _compat
from lightning_pp.checkpoint.state import PENDING_GRADIENT_KEY, StageCheckpoints
from lightning_pp.hooks.collectives import ReplicaCollectives
from lightning_pp.hooks.data import PipelineDataHooks
from lightning_pp.hooks.loops import LoopHooks
from lightning_pp.model.assembly import (
    assemble_stage,
    refuse_unsupported,
    setup_optimizers_everywhere,
)
from lightning_pp.model.session import StageSession, release
from lightning_pp.monitor.telemetry import PipelineTelemetry
from lightning_pp.options import (
    Backend,
    Balance,
    DataParallelMode,
    OutsideWeights,
    PipelineOptions,
    ScheduleName,
    StateDictType,
    documented_arguments,
)
from lightning_pp.parallel.ending import AgreedSigterm, listen_first, stop_listening
from lightning_pp.parallel.failures import FailureSignal, naming_failures
from lightning_pp.parallel.grads import enabled_scaler
from lightning_pp.parallel.sharding import BlockSharding, is_sharded_module
from lightning_pp.parallel.topology import (
    PipelineLayout,
    create_device_mesh,
    start_process_group,
)
from lightning_pp.run import RunContext
from lightning_pp.runtime.allocator import keep_freed_cpu_memory
from lightning_pp.schedule import StepSchedules
from lightning_pp.tuning.autotune import choose_configuration
from lightning_pp.tuning.balance import balance_for
from lightning_pp.tuning.closed_loop import AutoChoice

__all__ = ["PipelineParallelStrategy"]

StrPath = str | os.PathLike[str]


class PipelineParallelStrategy(ReplicaCollectives, PipelineDataHooks, LoopHooks):
    """Train a LightningModule pipeline-parallel: its container of repeated blocks is split into stages, one or more
    per device, and the world holds one pipeline or several data-parallel replicas of it.

    The container (an ``nn.Sequential``, ``nn.ModuleList`` or ``nn.ModuleDict`` of transformer layers, MLP blocks) is
    found automatically or named with ``blocks``; each stage keeps a contiguous run of blocks, and the weights outside
    them (embeddings, heads, norms) are kept where they are used (``outside_weights``), tied ones included. Each batch
    is split into ``microbatches`` that the schedule runs through the stages; every stage runs the user's own step,
    with other stages' blocks as stand-ins, and the last stage goes on to the loss: results equal one device's.

    With ``pipeline_parallel_size=P`` and ``tensor_parallel_size=T`` the world (``devices x num_nodes``) holds
    ``world / (P x T)`` data-parallel replicas of the pipeline, each loading its own shard of the data; every stage's
    gradients are averaged over its replicas once per optimizer step, as DDP does, or its blocks are sharded over them
    with FSDP2 (``data_parallel_mode="fsdp"``). Each stage is split over T ranks by the tensor-parallel plan the module
    applies in ``configure_model``. Tensor-parallel ranks, then replicas, of a stage sit on neighbouring ranks
    (:attr:`layout`, :attr:`device_mesh`). A module built under ``trainer.init_module(empty_init=True)`` is on the meta
    device: each rank materializes only what it holds.

    Raises:
        PipelineConfigError: for an argument of the wrong type or value, a world size that is not a multiple of
            ``pipeline_parallel_size x tensor_parallel_size``, sharding the pipeline cannot run, a ``balance`` that
            does not fit the container or the number of stages, a module without a block container, or manual
            optimization.

    Example:
        ``trainer = L.Trainer(accelerator="cpu", devices=2, strategy=PipelineParallelStrategy(schedule="1f1b"))``

    Every argument but Lightning's own (``accelerator`` ... ``precision_plugin``) is a field of
    :class:`~lightning_pp.options.PipelineOptions`; the list below is made from its field docstrings.
    """

    strategy_name = "pipeline"

    def __init__(  # the arguments of PipelineOptions, then Lightning's own (LightningCLI reads this signature)
        self, *, schedule: ScheduleName | os.PathLike[str] = "1f1b", pipeline_parallel_size: int | None = None,
        stages_per_rank: int | None = None, microbatches: int | None = None, blocks: str | None = None,
        balance: Sequence[int] | Balance | None = None, timeout: timedelta = default_pg_timeout,
        transfer_timeout: float = 300.0, state_dict_type: StateDictType = "full",
        process_group_backend: Backend | None = None, reuse_cpu_memory: bool = True,
        microbatch_weight: Callable[[Any], Any] | None = None, activation_checkpointing: bool | int = False,
        outside_weights: OutsideWeights = "where_used", carry_block_outputs: bool = False,
        data_parallel_mode: DataParallelMode = "ddp", tensor_parallel_size: int = 1, max_memory: float | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None, checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        given = locals()  # every argument above: PipelineOptions' fields are checked there, as given
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self.options = PipelineOptions(**{f.name: given[f.name] for f in dataclasses.fields(PipelineOptions) if f.init})
        self._auto: AutoChoice | None = None  # schedule="auto"'s choice (its concrete options), once made
        self._process_group_backend = process_group_backend  # chosen from the device in setup_environment if None
        self._num_nodes = 1
        self._session: StageSession | None = None  # this rank's stage during a Trainer run, from setup to teardown
        self._closed_checkpoints: StageCheckpoints | None = None  # the latest run's, once it ended
        # pipedream_2bw: the gradient the latest fit left unapplied (by name), for checkpoints saved after it
        self._unapplied_gradient: dict[str, torch.Tensor] = {}
        # a gloo group over the world for object collectives where the default group is not gloo (None: the default)
        self.object_group: Any = None
        self._accumulating = False  # inside Lightning's block_backward_sync: gradients not synchronized yet
        self._failures: FailureSignal | None = None
        self._schedules: StepSchedules | None = None
        self.telemetry = PipelineTelemetry()  # what PipelineMonitor reads, and its request for a timed step
        # the ranks as a DeviceMesh ("pipeline_parallel", "data_parallel", "tensor_parallel"), also the module's
        # `device_mesh` from configure_model on; None until the process group exists
        self.device_mesh: Any = None

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
        """Ranks per pipeline: ``pipeline_parallel_size``, or by default one per process in the job (over
        ``tensor_parallel_size``). (Each holds ``stages_per_rank`` stages; :attr:`stage` is this rank's place in its
        pipeline.)"""
        return self.options.pipeline_parallel_size or max(1, self._world // self.options.tensor_parallel_size)

    @property
    def num_replicas(self) -> int:
        """Data-parallel replicas of the pipeline."""
        return max(1, self._world // (self.num_stages * self.options.tensor_parallel_size))

    @property
    def layout(self) -> PipelineLayout:
        """Which global rank holds which stage of which replica and tensor-parallel shard."""
        return PipelineLayout(self.num_stages, self.num_replicas, self.options.tensor_parallel_size)

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
    def resolved_options(self) -> PipelineOptions:
        """The options runs use: :attr:`options` (the user's, as checked on construction: schedule names in our
        spelling, the schedule's default ``stages_per_rank``), with ``schedule="auto"`` made concrete once the first
        run chose (later runs keep the choice, and its closed loop's switch)."""
        return self._auto.options if self._auto is not None else self.options

    @property
    def microbatches(self) -> int:
        options = self.resolved_options
        return options.microbatches if options.microbatches is not None else 2 * self.num_stages

    @override
    def _configure_launcher(self) -> None:
        self.options.check_world(self.num_stages, self.num_processes, self.num_nodes)  # before any worker starts
        assert self.cluster_environment is not None
        self._launcher = _compat._SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        # again, before the process group exists (torchrun starts every rank itself)
        self.options.check_world(self.num_stages, self.num_processes, self.num_nodes)
        backend = self._process_group_backend or _compat._get_default_process_group_backend_for_device(self.root_device)
        self.options.check_backend(backend, self.root_device)
        super().setup_environment()
        if self.options.reuse_cpu_memory and self.root_device.type == "cpu":
            keep_freed_cpu_memory()
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self._world)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        self._process_group_backend = backend
        self.object_group = start_process_group(self.cluster_environment, backend, self.options.timeout,
                                                self._world, self.global_rank)
        self.agree_sampler_seed(self.object_group)  # one shuffle for every stage, however each rank was seeded
        self.device_mesh = create_device_mesh(self.layout, self.root_device.type)
        if self.lightning_module is not None:  # configure_model, which runs next, may read it
            _compat.set_module_device_mesh(self.lightning_module, self.device_mesh)
        if self._world > 1:
            self._failures = FailureSignal.for_this_fit(_compat._default_store(), self.global_rank,
                                                        grace=self.options.transfer_timeout + 5)
            if self.lightning_module is not None:  # told before any callback's on_exception runs a collective
                listen_first(self.lightning_module.trainer, self.on_exception)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self._session = None  # the previous run's was closed at its teardown
        self.accelerator.setup(trainer)
        module = self.lightning_module
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self._unapplied_gradient = {}  # a new stream (a resumed one gets its checkpoint's)
        refuse_unsupported(module, fitting, self.options.tensor_parallel_size)
        run = RunContext(self.resolved_options, self.layout, self.global_rank, self.root_device, trainer,
                         self.precision_plugin, fitting, self._new_group, self._collective, lambda: self.object_group)
        if run.options.schedule == "auto":  # made concrete once, at the first run's start (fit's, to measure)
            self._auto = choose_configuration(run, module)
            run = dataclasses.replace(run, options=self._auto.options, auto=self._auto)
        options = run.options
        self._schedules = StepSchedules(str(options.schedule), self.num_stages, run.microbatches,  # this world's
                                        options.stages_per_rank or 1, options.schedule_file is not None)
        schedule = self._schedules(run.microbatches, False)  # raises for a count it cannot run
        assembly = assemble_stage(
            run, module, schedule, balance=balance_for(run, module), to_device=self._convert_and_move,
            sharding=BlockSharding.over(self.device_mesh, options.data_parallel_mode == "fsdp", module,
                                        str(getattr(self.precision_plugin, "precision", "32-true"))))
        try:
            if fitting:
                setup_optimizers_everywhere(lambda: self.setup_optimizers(trainer), module, assembly.partition,
                                            self.stage, self._world, self.object_group)
            self.setup_precision_plugin()
            assembly.grads.install(self.precision_plugin, enabled_scaler(self.precision_plugin))
            if fitting:
                _compat._optimizers_to_device(self.optimizers, self.root_device)
            self._session = StageSession(run, module, assembly, self._schedules, self.telemetry)
        except BaseException:
            release(assembly)  # teardown has no session to close
            raise

    def _convert_and_move(self) -> None:
        assert self.model is not None
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()

    def _new_group(self, ranks: list[int]) -> Any:
        return dist.new_group(ranks, backend=self._process_group_backend, timeout=self.options.timeout)

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``empty_init=True`` builds on the meta device; setup materializes what each stage holds (see
        :mod:`lightning_pp.model.materialize`)."""
        meta = (torch.device("meta"), self.precision_plugin.tensor_init_context()) if empty_init else ()
        with ExitStack() as stack:
            for context in meta or (super().tensor_init_context(empty_init),):
                stack.enter_context(context)
            yield

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

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
        """Make this rank's failure end the whole job: tell the other ranks, take down the launched ones (first among
        the callbacks' on_exception, see lightning_pp.parallel.ending; again here, a no-op)."""
        if isinstance(exception, AgreedSigterm):
            return  # every rank stops at this step: nothing failed
        if self._failures is not None:
            self._failures.report(f"{self._where()} failed: {type(exception).__name__}: {str(exception)[:2000]}")
        launcher = self.launcher
        if isinstance(launcher, _compat._SubprocessScriptLauncher) and launcher.procs:
            launcher.kill(signal.SIGKILL)

    # ------------------------------------------------------------------------------------------------ the step

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
        assert self._session is not None
        return self._session.run_step(step_name, args, kwargs, self._collective, enabled_scaler(self.precision_plugin))

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Hand over the gradients the schedule computed; never back-propagate ``closure_loss`` again."""
        module = self.lightning_module
        assert module is not None and self._session is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self._session.hand_over_grads(not self._accumulating, self.optimizers, self._collective)
        with self._session.hook_logs(self._collective):  # on_after_backward
            closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        assert self._session is not None
        with self._session.hook_logs(self._collective):  # on_before_optimizer_step (and the closure's backward)
            return super().optimizer_step(optimizer, closure, model, **kwargs)

    # ------------------------------------------------------------------------------------------------ checkpoints

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # load into the partitioned module and the stage's optimizers

    @property
    def _checkpoints(self) -> StageCheckpoints:
        checkpoints = self._session.checkpoints if self._session is not None else self._closed_checkpoints
        assert checkpoints is not None
        return checkpoints

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {} if self._failed("A checkpoint") else self._checkpoints.module_state(self.options.state_dict_type)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        full = self.options.state_dict_type == "full"
        return {} if self._failed("A checkpoint") else self._checkpoints.optimizer_state(optimizer, full=full)

    def _failed(self, what: str) -> bool:  # a failed job saves nothing (OnExceptionCheckpoint): its ranks meet no more
        return self._failures is not None and self._failures.skips(what)

    @override
    def barrier(self, name: str | None = None) -> None:
        if not self._failed(f"The barrier {name}"):
            super().barrier(name)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: StrPath, storage_options: Any = None) -> None:
        if self._failed(f"Saving {filepath}"):
            return
        if self.resolved_options.schedule == "pipedream_2bw" and "optimizer_states" in checkpoint:  # not weights only
            pending = self._session.pending_gradient(self._collective) if self._session is not None else None
            self._checkpoints.add_pending_gradient(checkpoint, self._unapplied_gradient if pending is None else pending,
                                                   full=self.options.state_dict_type == "full")
        if self.options.state_dict_type == "full":
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        else:
            self._checkpoints.save_sharded(checkpoint, str(filepath))

    @override
    def load_checkpoint(self, checkpoint_path: StrPath, weights_only: bool | None = None) -> dict[str, Any]:
        return self._checkpoints.load(str(checkpoint_path), weights_only, self.optimizers, super().load_checkpoint)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self._checkpoints.load_module_state(checkpoint, strict)
        if self._session is not None:
            self._session.restore_pending_gradient(checkpoint.get(PENDING_GRADIENT_KEY, {}))

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self._checkpoints.load_optimizer_states(self.optimizers, checkpoint["optimizer_states"])

    @override
    def teardown(self) -> None:
        if self._session is not None:
            self._session.close()  # and let go: it holds the run's groups, which free their threads only then
            self._closed_checkpoints, self._session = self._session.checkpoints, None  # for saves after the run
        if self.object_group is not None and dist.is_initialized():
            dist.destroy_process_group(self.object_group)
        self.object_group = None  # the mesh stays: blocks sharded over it gather through it after fit too
        if self._failures is not None:
            self._failures.stop()
            self._failures = None
        stop_listening(self.lightning_module)
        if is_sharded_module(self.lightning_module):  # as ModelParallelStrategy: shards stay on their devices
            self.precision_plugin.teardown()
        else:
            super().teardown()


# the arguments, described once beside PipelineOptions' fields
PipelineParallelStrategy.__doc__ = "\n".join([PipelineParallelStrategy.__doc__ or "",
                                              textwrap.indent(documented_arguments(), "    ")])
StrategyRegistry.register(
    PipelineParallelStrategy.strategy_name,
    PipelineParallelStrategy,
    description="Pipeline parallelism over the LightningModule's block container (lightning_pp)",
)
