"""PipelineParallelStrategy: Lightning's hooks translated into calls of the schedule, runtime and P2P core."""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities import move_data_to_device
from lightning.fabric.utilities.distributed import ReduceOp
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning.pytorch.utilities.types import STEP_OUTPUT
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_pp import _compat
from lightning_pp._allocator import keep_freed_cpu_memory
from lightning_pp._logs import LogRecord, LogRecorder, replay
from lightning_pp.checkpoint import NAMES_KEY, indexed_to_named, load_named, merge_named, named_state, named_to_indexed
from lightning_pp.errors import PipelineConfigError
from lightning_pp.microbatch import merge_microbatches, split_batch
from lightning_pp.p2p import StageP2P
from lightning_pp.partition import stage_layer_ranges, uniform_balance, validate_balance
from lightning_pp.runtime import run_stage, step_clock
from lightning_pp.schedules import SCHEDULES, Schedule, build_schedule
from lightning_pp.simulate import TimelineEvent

__all__ = ["PipelineParallelStrategy"]

log = logging.getLogger(__name__)


_AGREEING_SCALERS: weakref.WeakSet[torch.amp.GradScaler] = weakref.WeakSet()  # scalers already patched
_NOTHING = torch.empty(0)  # what an evaluation forward on the last stage hands the runtime (nothing to send)


class _SequentialOutput(BaseException):
    """Raised by the first stage's sequential to stop the user's step once the stage's output exists.

    A BaseException, so that an ``except Exception`` in the user's step cannot swallow it.
    """

    def __init__(self, output: Tensor) -> None:
        super().__init__()
        self.output = output


class _StageSequential(nn.Sequential):
    """The layers of one stage, under their original names so state-dict keys match the full model's.

    Called from the user's step it does what the stage needs: on the first stage it runs its layers and stops the step
    (the rest belongs to later stages); on the last stage it ignores its argument and applies its layers to the
    activation received from the previous stage, so the user's loss code runs unchanged.
    """

    def __init__(self, layers: OrderedDict[str, nn.Module], stage: int, num_stages: int, attribute: str,
                 full_param_order: dict[str, int], full_state_keys: list[str], full_layer_names: list[str]) -> None:
        super().__init__(layers)
        self.full_layer_names = full_layer_names  # every layer of the unpartitioned sequential, in order
        self.stage = stage
        self.num_stages = num_stages
        self.attribute = attribute
        # the unpartitioned model's layout, which full checkpoints follow
        self.full_param_order = full_param_order
        self.full_state_keys = full_state_keys
        self.received: Tensor | None = None
        self.calls = 0
        self.in_user_step = False  # set by the strategy while the user's step runs on this stage
        self._applying = False

    def run_layers(self, input: Any) -> Any:
        """Apply this stage's layers (what a middle stage does with a received activation)."""
        self._applying = True
        try:
            return super().forward(input)
        finally:
            self._applying = False

    @override
    def __getitem__(self, index: Any) -> Any:
        """``self.layers[i]`` means layer ``i`` of the full sequential, as before partitioning."""
        if not isinstance(index, int):
            return super().__getitem__(index)
        name = self.full_layer_names[index]
        if name not in self._modules:
            raise PipelineConfigError(
                f"Layer {index} of `self.{self.attribute}` lives on another pipeline stage; stage {self.stage} holds "
                f"layers {list(self._modules)}. Check `{index!r} in self.{self.attribute}._modules` first, or act "
                f"on it from code that runs on every stage."
            )
        return self._modules[name]

    @override
    def __iter__(self) -> Iterator[nn.Module]:
        if self.in_user_step and not self._applying:
            raise PipelineConfigError(
                f"The step iterates over `self.{self.attribute}`, which holds only the layers "
                f"{list(self._modules)} of pipeline stage {self.stage}. Call `self.{self.attribute}(x)` once instead; "
                f"the pipeline applies the other stages' layers."
            )
        return super().__iter__()

    @override
    def forward(self, input: Any) -> Any:
        if not self.in_user_step:
            if self.num_stages == 1:
                return self.run_layers(input)
            raise PipelineConfigError(
                f"`self.{self.attribute}` holds only the layers {list(self._modules)} of pipeline stage {self.stage}; "
                f"it can only be called inside a pipelined training, validation, test or predict step, not from "
                f"other hooks (such as on_validation_epoch_end). Compute what you need inside the step and log it. "
                f"(Lightning's model summary also runs a forward pass when the module sets `example_input_array`: "
                f"pass Trainer(enable_model_summary=False) or leave `example_input_array` unset.)"
            )
        self.calls += 1
        if self.calls > 1:
            raise PipelineConfigError(
                f"The step called `self.{self.attribute}` {self.calls} times; a pipelined step must call the "
                f"partitioned sequential exactly once per micro-batch."
            )
        if self.num_stages == 1:
            return self.run_layers(input)
        if self.stage == 0:
            raise _SequentialOutput(self.run_layers(input))
        return self.run_layers(self.received)  # the last stage: layers applied to the received activation


@contextmanager
def _stage_rng(stage: int, step_index: int) -> Iterator[None]:
    """Give each stage its own CPU random stream inside a step, and leave the generator as the step found it.

    Stages consume random numbers differently (dropout in their own layers), which would otherwise make a shuffling
    sampler draw different batches on different stages. The stream's seed is derived from the generator's state and
    the step's index without drawing from the generator, so a step that uses no randomness leaves it exactly as one
    device would (a shuffling sampler then draws the same epochs as single-device training).
    """
    before_step = torch.get_rng_state()
    digest = hashlib.blake2b(before_step.numpy().tobytes(), digest_size=8)
    digest.update(step_index.to_bytes(8, "little") + stage.to_bytes(4, "little"))
    torch.default_generator.manual_seed(int.from_bytes(digest.digest(), "little") >> 1)
    try:
        yield
    finally:
        torch.set_rng_state(before_step)


def _destroy_gloo_process_group() -> None:
    """Registered with ``atexit`` on gloo: shut the process group down while the interpreter is still whole.

    Left to the interpreter's finalisation, gloo's worker threads can release tensors (and so take the GIL) after
    Python is gone, which now and then aborts the process ("terminate called without an active exception").
    """
    if dist.is_initialized() and dist.get_backend() == "gloo":
        dist.destroy_process_group()


def _find_sequential(module: nn.Module, name: str | None) -> tuple[str, nn.Sequential]:
    candidates = [child_name for child_name, child in module.named_children() if isinstance(child, nn.Sequential)]
    if name is None:
        if len(candidates) != 1:
            found = f"found {len(candidates)}: {candidates}" if candidates else "found none"
            raise PipelineConfigError(
                f"PipelineParallelStrategy partitions an nn.Sequential that is a direct attribute of "
                f"{type(module).__name__}, and {found}. "
                + ("Name the one to partition: PipelineParallelStrategy(sequential=...)."
                   if candidates else "Put the repeated layers (e.g. transformer blocks) in an nn.Sequential "
                   "attribute, or name a nested one with PipelineParallelStrategy(sequential='model.blocks').")
            )
        name = candidates[0]
    try:
        found_module = module.get_submodule(name)
    except AttributeError:
        found_module = None
    if not isinstance(found_module, nn.Sequential):
        raise PipelineConfigError(
            f"PipelineParallelStrategy(sequential={name!r}): {type(module).__name__} has no nn.Sequential at "
            f"{name!r}. Direct nn.Sequential attributes: {candidates or 'none'}."
        )
    return name, found_module


class PipelineParallelStrategy(ParallelStrategy):
    """Train a LightningModule's ``nn.Sequential`` pipeline-parallel: one stage of consecutive layers per device.

    Per optimizer step, each batch is split into ``microbatches`` micro-batches and run through the stages by the
    chosen schedule. The first stage runs the user's ``training_step`` up to the call of the sequential, the middle
    stages run only their layers, the last stage runs the user's step on the received activation and computes the
    loss with the user's own code. Parameters outside the sequential are replicated on every stage and their gradients
    summed over the pipeline, so weights tied across the sequential (embedding and head) train correctly. Every stage
    loads the same batch. Validation, test and predict steps run the same way through the forward-only schedule.

    Each micro-batch's loss is weighted by its share of the batch's samples, so for losses that average over the batch
    (every torch loss by default) gradients, the returned loss and logged values equal single-device training. A batch
    that does not divide evenly is split like ``torch.tensor_split``.

    Args:
        schedule: ``"naive"`` (one micro-batch at a time), ``"gpipe"`` (all forwards, then all backwards) or
            ``"1f1b"`` (one forward one backward; activation memory bounded by the number of stages).
        microbatches: Micro-batches per batch; ``None`` means twice the number of stages.
        sequential: Name (dotted for nested modules) of the ``nn.Sequential`` to partition; by default the only
            ``nn.Sequential`` that is a direct attribute of the LightningModule.
        balance: Layers per stage, summing to the sequential's length; by default an even split.
        timeout: Seconds a stage waits for a peer's transfer (and for collectives) before raising
            :class:`~lightning_pp.PipelineTimeoutError` naming the stage, the action and the peer.
        checkpoint_format: ``"full"`` gathers the whole model and optimizer on global rank 0 into one file that
            plain single-device Lightning loads; ``"sharded"`` writes a folder with one file per stage (nothing is
            gathered). Both resume on any number of stages, as do single-device checkpoints.
        process_group_backend: ``"gloo"`` or ``"nccl"``; by default chosen from the device.
        reuse_cpu_memory: On CPU (Linux, glibc), keep freed memory in each stage's process instead of returning it to
            the operating system, so the buffers of every micro-batch reuse pages rather than page-faulting fresh ones
            in (15-30 % of the compute time of a 1024-wide MLP stage). The process keeps its peak memory.

    Raises:
        PipelineConfigError: for an unknown schedule, ``microbatches < 1``, a bad ``balance``, a world size that does
            not match ``balance``, a module without a unique sequential, or manual optimization.

    Example::

        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=PipelineParallelStrategy(schedule="1f1b"))
        trainer.fit(model, train_dataloader)
    """

    strategy_name = "pipeline"

    def __init__(
        self,
        *,
        schedule: str = "1f1b",
        microbatches: int | None = None,
        sequential: str | None = None,
        balance: Sequence[int] | None = None,
        timeout: float = 300.0,
        checkpoint_format: str = "full",
        process_group_backend: str | None = None,
        reuse_cpu_memory: bool = True,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if schedule not in SCHEDULES:
            raise PipelineConfigError(
                f"Unknown schedule {schedule!r}. Valid schedules: {', '.join(sorted(SCHEDULES))}."
            )
        if microbatches is not None and (not isinstance(microbatches, int) or microbatches < 1):
            raise PipelineConfigError(
                f"microbatches={microbatches!r}, but at least 1 micro-batch per batch is needed; pass a positive "
                f"integer, or None for twice the number of stages."
            )
        if balance is not None and (not balance or any(not isinstance(n, int) or n < 1 for n in balance)):
            raise PipelineConfigError(
                f"balance={list(balance)} must list at least one layer for every stage (positive integers)."
            )
        if timeout <= 0:
            raise PipelineConfigError(f"timeout={timeout} must be a positive number of seconds.")
        if checkpoint_format not in ("full", "sharded"):
            raise PipelineConfigError(
                f"checkpoint_format={checkpoint_format!r}; use 'full' (one file plain Lightning loads) or 'sharded' "
                f"(a folder with one file per stage, nothing gathered on one rank)."
            )
        self.checkpoint_format = checkpoint_format
        self.schedule_name = schedule
        self._microbatches = microbatches
        self._sequential_name = sequential
        self._balance = list(balance) if balance is not None else None
        self.timeout = float(timeout)
        self._process_group_backend = process_group_backend
        self._reuse_cpu_memory = reuse_cpu_memory
        self._num_nodes = 1
        self._stage_module: _StageSequential | None = None
        self._replicated: list[nn.Parameter] = []
        self._pending_grads: list[tuple[nn.Parameter, Tensor]] = []  # this step's gradients, handed over in backward
        self._p2p: StageP2P | None = None
        self._schedules: dict[tuple[int, bool], Schedule] = {}
        self._steps_run = 0  # pipelined steps so far (the same count on every stage): seeds their random streams
        self._log_recorder = LogRecorder()
        # set by PipelineMonitor: receives a timed step's events and sample count; None keeps the timing off
        self.timing_sink: Callable[[list[TimelineEvent], int], None] | None = None
        self.last_schedule: Schedule | None = None

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
        """One stage per process in the job."""
        return self.num_nodes * self.num_processes

    @property
    def stage(self) -> int:
        return self.global_rank

    @property
    def microbatches(self) -> int:
        return self._microbatches if self._microbatches is not None else 2 * self.num_stages

    @property
    def is_distributed(self) -> bool:
        # With one data-parallel replica there is nothing to shard or to sync: saying "not distributed" keeps the
        # user's DataLoader as it is (Lightning would inject an always-shuffling DistributedSampler) and makes
        # `sync_dist` a no-op, both exactly as on one device. Stages agree on shuffled batches because every step
        # leaves the CPU random generator in the same state on every stage (see `_stage_rng`).
        return False

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every stage of the one pipeline loads the same samples: a single data-parallel replica
        return {"num_replicas": 1, "rank": 0}

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._launcher = _compat._SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        # checked before the process group exists, so a bad configuration fails on every rank without waiting
        if self._balance is not None and len(self._balance) != self.num_stages:
            raise PipelineConfigError(
                f"balance={self._balance} describes {len(self._balance)} stages but the Trainer runs "
                f"{self.num_stages} processes (one stage each). Use Trainer(devices={len(self._balance)}) or give "
                f"{self.num_stages} layer counts."
            )
        super().setup_environment()
        if self._reuse_cpu_memory and self.root_device.type == "cpu":
            keep_freed_cpu_memory()
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_stages)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        backend = self._process_group_backend or _compat._get_default_process_group_backend_for_device(
            self.root_device
        )
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        _compat._init_dist_connection(
            self.cluster_environment, backend, timeout=timedelta(seconds=self.timeout)
        )
        if backend == "gloo":
            atexit.unregister(_destroy_gloo_process_group)  # once, however many fits this process runs
            atexit.register(_destroy_gloo_process_group)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        if trainer.state.fn == TrainerFn.FITTING and not module.automatic_optimization:
            raise PipelineConfigError(
                f"{type(module).__name__} uses manual optimization (automatic_optimization=False), which "
                f"PipelineParallelStrategy does not support: the schedule runs forward and backward itself. Use "
                f"automatic optimization, where Lightning calls the optimizers after the pipelined step."
            )
        self._partition(module)
        assert self.model is not None
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self._setup_optimizers_on_every_stage(trainer)
        self.setup_precision_plugin()
        # Lightning clips by the norm of this stage's gradients; the right norm spans every stage
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_global_norm  # type: ignore[method-assign]
        scaler = self._grad_scaler()
        if scaler is not None and scaler not in _AGREEING_SCALERS:
            # a stage that finds inf/NaN must make every stage skip the step and back off the scale alike
            local_unscale = scaler.unscale_
            scaler.unscale_ = lambda optimizer: self._unscale_agreeing(scaler, local_unscale, optimizer)  # type: ignore[method-assign]
            _AGREEING_SCALERS.add(scaler)
        if trainer.state.fn == TrainerFn.FITTING:
            _compat._optimizers_to_device(self.optimizers, self.root_device)
        self._log_recorder.attach(module, last_stage_rank=self.num_stages - 1 if self.num_stages > 1 else None)
        if self.num_stages > 1:
            # one group for activations, one for gradients (see StageP2P); new_group is collective: every rank calls it
            groups = (self._new_group(), self._new_group())
            self._p2p = StageP2P(self.stage, list(range(self.num_stages)), self.root_device, self.timeout, groups)

    def _setup_optimizers_on_every_stage(self, trainer: pl.Trainer) -> None:
        """``configure_optimizers`` sees only this stage's parameters, so it may fail on some stages alone (an empty
        parameter list): make any stage's failure an error on every stage, so that no rank is left waiting."""
        error: Exception | None = None
        try:
            self.setup_optimizers(trainer)
        except Exception as caught:
            if self.num_stages == 1:
                raise
            error = caught
        if self.num_stages == 1:
            return
        stage_module = self._stage_module
        assert stage_module is not None and self.lightning_module is not None
        report = None
        if error is not None:
            params = list(self.lightning_module.parameters())
            total, trainable = sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
            report = (f"stage {self.stage} ({type(error).__name__}: {error}; it holds layers "
                      f"{list(stage_module._modules)} of `{stage_module.attribute}` and {total} parameters, "
                      f"{trainable} trainable, counting those outside the sequential)")
        reports: list[str | None] = [None] * self.num_stages
        dist.all_gather_object(reports, report)
        failed = [r for r in reports if r is not None]
        if failed:
            raise PipelineConfigError(
                f"configure_optimizers failed on {len(failed)} pipeline stage(s): {'; '.join(failed)}. Each stage's "
                f"optimizer gets only that stage's parameters; a stage without any (or, when configure_optimizers "
                f"keeps only parameters with requires_grad, without trainable ones) gets an empty list. Pass "
                f"PipelineParallelStrategy(balance=[...]) so that every stage holds layers with trainable weights."
            ) from error

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
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        if isinstance(tensor, Tensor):
            return _compat._sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------------------------------------ partitioning

    def _partition(self, module: pl.LightningModule) -> None:
        """Keep only this stage's layers of the sequential; everything else stays, replicated on every stage."""
        name, sequential = _find_sequential(module, self._sequential_name)
        if isinstance(sequential, _StageSequential):
            if (sequential.stage, sequential.num_stages) != (self.stage, self.num_stages):
                raise PipelineConfigError(
                    f"`{name}` was already partitioned for stage {sequential.stage} of {sequential.num_stages}; "
                    f"this run is stage {self.stage} of {self.num_stages}. Build a fresh module for a new layout."
                )
            self._stage_module = sequential
        else:
            layers = list(sequential.named_children())
            balance = (
                validate_balance(self._balance, len(layers), self.num_stages)
                if self._balance is not None
                else uniform_balance(len(layers), self.num_stages)
            )
            self._check_no_shared_parameters(module, name, sequential, balance)
            local = stage_layer_ranges(balance)[self.stage]
            stage_module = _StageSequential(
                OrderedDict(layers[i] for i in local), self.stage, self.num_stages, name,
                full_param_order={n: i for i, (n, _) in enumerate(module.named_parameters())},
                full_state_keys=list(module.state_dict()),
                full_layer_names=[layer_name for layer_name, _ in layers],
            )
            parent_name, _, attribute = name.rpartition(".")
            setattr(module.get_submodule(parent_name) if parent_name else module, attribute, stage_module)
            self._stage_module = stage_module
            log.info(f"Pipeline stage {self.stage}: layers {list(local)} of `{name}` ({len(layers)} layers)")
        stage_ids = {id(p) for p in self._stage_module.parameters()}
        self._replicated = [p for p in module.parameters() if id(p) not in stage_ids and p.requires_grad]

    @staticmethod
    def _check_no_shared_parameters(
        module: nn.Module, name: str, sequential: nn.Sequential, balance: list[int]
    ) -> None:
        owner: dict[int, str] = {}
        children = list(sequential.children())
        for index, stage_range in enumerate(stage_layer_ranges(balance)):
            for i in stage_range:
                for p in children[i].parameters():
                    if owner.setdefault(id(p), f"stage {index}") != f"stage {index}":
                        raise PipelineConfigError(
                            f"A parameter of `{name}` is shared between {owner[id(p)]} and stage {index}; stages "
                            f"cannot share weights. Choose a balance that keeps sharing layers on one stage."
                        )
        inside = set(owner)
        sequential_prefix = name + "."
        for param_name, p in module.named_parameters(remove_duplicate=False):
            if not param_name.startswith(sequential_prefix) and id(p) in inside:
                raise PipelineConfigError(
                    f"Parameter `{param_name}` is shared with a layer of `{name}`; a weight inside the partitioned "
                    f"sequential cannot also be used outside it. Move the tied layer out of `{name}`."
                )

    # ------------------------------------------------------------------------------------------------ the step

    def _schedule(self, num_microbatches: int, forward_only: bool) -> Schedule:
        key = (num_microbatches, forward_only)
        if key not in self._schedules:
            self._schedules[key] = build_schedule(
                self.schedule_name, self.num_stages, num_microbatches, forward_only=forward_only
            )
        return self._schedules[key]

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
        """Run the user's ``step_name`` over micro-batches through the schedule; return what it returns on one device.

        Training runs the full schedule and returns the loss; evaluation runs the forward-only schedule (nothing kept
        for backward) and returns the step's outputs merged over micro-batches. Either way the last stage's results
        and ``self.log`` calls are sent to every stage, so every rank returns and logs the same values.
        """
        module = self.lightning_module
        stage_module = self._stage_module
        assert module is not None and stage_module is not None
        training = step_name == "training_step"
        user_step = getattr(module, step_name)
        batch, rest = args[0], args[1:]
        microbatches, sizes = split_batch(batch, self.microbatches)
        total = sum(sizes)
        accumulation = module.trainer.accumulate_grad_batches if training else 1
        weights = [size / total / accumulation for size in sizes]
        first, last = self.stage == 0, self.stage == self.num_stages - 1
        outputs: dict[int, Any] = {}  # the last stage's step outputs (training: loss values)
        extras: dict[int, dict[str, Any]] = {}  # training: the other entries of a dict training_step returned
        scaler = self._grad_scaler() if training else None

        def forward(mb: int, received: Tensor | None) -> Tensor:
            if not first and not last:
                return stage_module.run_layers(received)
            stage_module.calls = 0
            stage_module.received = received
            stage_module.in_user_step = True
            try:
                with self._log_recorder.recording(module, mb if last else None):
                    output = user_step(microbatches[mb], *rest, **kwargs)
            except _SequentialOutput as stop:
                return stop.output
            finally:
                stage_module.received = None
                stage_module.in_user_step = False
            if stage_module.calls == 0:
                raise PipelineConfigError(
                    f"{step_name} returned without calling `self.{stage_module.attribute}`. A pipelined step must "
                    f"call the partitioned sequential once (call it, do not iterate over its layers)."
                )
            if not training:
                outputs[mb] = output
                return _NOTHING
            loss = output.get("loss") if isinstance(output, Mapping) else output
            if not isinstance(loss, Tensor):
                raise PipelineConfigError(
                    f"training_step returned {type(output).__name__}; with PipelineParallelStrategy it must return "
                    f"the loss tensor or a dict with a 'loss' tensor (skipping a step by returning None is not "
                    f"supported)."
                )
            outputs[mb] = loss.detach()  # read once after the step: a read per micro-batch would stall a GPU
            if isinstance(output, Mapping) and len(output) > 1:
                extras[mb] = {k: v.detach() if isinstance(v, Tensor) else v for k, v in output.items() if k != "loss"}
            return scaler.scale(loss * weights[mb]) if scaler is not None else loss * weights[mb]

        schedule = self._schedule(len(microbatches), forward_only=not training)
        events: list[TimelineEvent] | None = [] if training and self.timing_sink is not None else None
        if training:
            # Lightning zeroes gradients between training_step and backward: keep this step's gradients aside and
            # hand them over in `backward`, leaving earlier (accumulated) gradients for Lightning to manage
            params = [p for p in module.parameters() if p.requires_grad]
            previous = [p.grad for p in params]
            for p in params:
                p.grad = None
            self.last_schedule = schedule
        self._steps_run += 1
        with _stage_rng(self.stage, self._steps_run):
            run_stage(
                schedule.actions[self.stage],
                forward,
                self._p2p if self.num_stages > 1 else None,
                is_last=last,
                training=training,
                events=events,
                clock=step_clock(self.root_device) if events is not None else None,
            )
        if training:
            self._sum_replicated_grads()
            self._pending_grads = [(p, p.grad) for p in params if p.grad is not None]
            for p, grad in zip(params, previous, strict=True):
                p.grad = grad

        result: Any = None
        extra: dict[str, Any] | None = None
        records: list[LogRecord] = []
        if last:
            records = self._log_recorder.combine(sizes)
            if training:
                order = sorted(outputs)
                losses = torch.stack([outputs[mb] for mb in order]).double().tolist()
                result = sum(loss * sizes[mb] for loss, mb in zip(losses, order, strict=True)) / total
                if extras:
                    extra = move_data_to_device(merge_microbatches([extras[mb] for mb in order], sizes),
                                                torch.device("cpu"))
            else:
                result = move_data_to_device(merge_microbatches([outputs[mb] for mb in sorted(outputs)], sizes),
                                             torch.device("cpu"))
        result, extra, records = self._from_last_stage((result, extra, records))
        replay(module, records, updated_here=last)
        if events is not None and self.timing_sink is not None:
            self.timing_sink(events, total)
        if not training:
            return move_data_to_device(result, self.root_device)
        loss = torch.tensor(result, dtype=torch.get_default_dtype(), device=self.root_device)
        # what training_step returned on one device: the loss, and any other entries merged over micro-batches
        return {"loss": loss, **move_data_to_device(extra, self.root_device)} if extra else loss

    def _from_last_stage(self, payload: Any) -> Any:
        if self.num_stages == 1:
            return payload
        box = [payload]
        dist.broadcast_object_list(box, src=self.num_stages - 1)
        return box[0]

    def _sum_replicated_grads(self) -> None:
        """Sum the gradients of parameters outside the sequential over all stages (one collective per dtype)."""
        if self.num_stages == 1 or not self._replicated:
            return
        has_grad = torch.tensor([p.grad is not None for p in self._replicated], dtype=torch.int32,
                                device=self.root_device)
        dist.all_reduce(has_grad)
        used = [p for p, n in zip(self._replicated, has_grad.tolist(), strict=True) if n > 0]
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in used:
            by_dtype.setdefault(p.dtype, []).append(p)
        for group in by_dtype.values():
            flat = torch.cat([
                (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in group
            ])
            dist.all_reduce(flat)
            offset = 0
            for p in group:
                p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
                offset += p.numel()

    def _grad_scaler(self) -> torch.amp.GradScaler | None:
        scaler = getattr(self.precision_plugin, "scaler", None)
        return scaler if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled() else None

    def _unscale_agreeing(self, scaler: torch.amp.GradScaler, unscale: Callable[[Optimizer], None],
                          optimizer: Optimizer) -> None:
        """Unscale, then make the inf/NaN verdict the same on every stage (the max over the pipeline)."""
        unscale(optimizer)
        found = _compat._found_inf_per_device(scaler, optimizer)
        verdict = torch.zeros((), dtype=torch.float32, device=self.root_device)
        for value in found.values():
            verdict = torch.maximum(verdict, value.to(self.root_device).reshape(()))
        if self.num_stages > 1:
            dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
        if not found:
            found[self.root_device] = verdict
        for value in found.values():
            value.copy_(verdict.to(value.device))

    def _clip_grad_by_global_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        """``clip_grad_norm_`` over the whole pipeline: squared norms summed over stages, each weight counted once."""
        replicated = {id(p) for p in self._replicated}
        grads = [(p, p.grad) for p in self.precision_plugin.main_params(optimizer) if p.grad is not None]
        squared = torch.zeros((), dtype=torch.float64, device=self.root_device)
        for p, grad in grads:
            if id(p) not in replicated or self.stage == 0:
                squared += torch.linalg.vector_norm(grad.detach(), dtype=torch.float64) ** 2
        if self.num_stages > 1:
            dist.all_reduce(squared)
        scale = torch.clamp(clip_val / (squared.sqrt() + 1e-6), max=1.0)
        for _, grad in grads:
            grad.mul_(scale.to(grad.dtype))

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Hand over the gradients the schedule computed; never back-propagate ``closure_loss`` again."""
        module = self.lightning_module
        assert module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        for p, grad in self._pending_grads:
            if p.grad is None:
                p.grad = grad
            else:
                p.grad.add_(grad)
        self._pending_grads = []
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    # ------------------------------------------------------------------------------------------------ checkpoints

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # load into the partitioned module and the stage's optimizers

    def _name_of(self) -> dict[int, str]:
        assert self.lightning_module is not None
        return {id(p): n for n, p in self.lightning_module.named_parameters()}

    def _gather_on_zero(self, obj: Any) -> list[Any]:
        if self.num_stages == 1:
            return [obj]
        gathered: list[Any] | None = [None] * self.num_stages if self.is_global_zero else None
        dist.gather_object(obj, gathered, dst=0)
        return gathered or []

    def _own_state(self) -> dict[str, Tensor]:
        """The state entries this stage holds alone (its layers), plus, on the last stage, everything replicated.

        Replicated parameters are equal on every stage, but buffers are not: modules after the sequential (a
        BatchNorm head, say) run only on the last stage, which also runs those before it, so its copies are current.
        """
        assert self.lightning_module is not None and self._stage_module is not None
        prefix = self._stage_module.attribute + "."
        last = self.stage == self.num_stages - 1
        return {k: v.detach().cpu() for k, v in self.lightning_module.state_dict().items()
                if k.startswith(prefix) or last}

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None and self._stage_module is not None
        if self.checkpoint_format == "sharded" or self.num_stages == 1:
            return self.lightning_module.state_dict()
        parts = self._gather_on_zero(self._own_state())
        if not self.is_global_zero:
            return {}
        merged: dict[str, Tensor] = {}
        for part in parts:
            merged.update(part)
        return {key: merged[key] for key in self._stage_module.full_state_keys}

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self._stage_module is not None
        named = named_state(getattr(optimizer, "_optimizer", optimizer), self._name_of())
        if self.checkpoint_format == "sharded":
            return named
        parts = self._gather_on_zero(named)
        return named_to_indexed(merge_named(parts, self._stage_module.full_param_order)) if parts else {}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if self.checkpoint_format == "full":
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        folder = str(filepath)
        os.makedirs(folder, exist_ok=True)
        shard = {"state_dict": self._own_state(), "optimizer_states": checkpoint.get("optimizer_states", [])}
        torch.save(shard, os.path.join(folder, f"stage{self.stage}.pt"))
        if self.is_global_zero:
            meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            meta["lightning_pp"] = {"format": "sharded", "num_stages": self.num_stages}
            torch.save(meta, os.path.join(folder, "checkpoint.pt"))

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path = str(checkpoint_path)
        if not os.path.isdir(path):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        assert self.lightning_module is not None and self._stage_module is not None
        only = bool(weights_only)
        checkpoint = torch.load(os.path.join(path, "checkpoint.pt"), map_location="cpu", weights_only=only)
        wanted = set(self.lightning_module.state_dict())
        state: dict[str, Tensor] = {}
        optimizer_parts: list[list[Any]] = []
        for stage in range(checkpoint["lightning_pp"]["num_stages"]):
            shard = torch.load(os.path.join(path, f"stage{stage}.pt"), map_location="cpu", weights_only=only)
            state.update({k: v for k, v in shard["state_dict"].items() if k in wanted})
            optimizer_parts.append(shard["optimizer_states"])
        checkpoint["state_dict"] = state
        order = self._stage_module.full_param_order
        checkpoint["optimizer_states"] = [
            merge_named(list(parts), order) for parts in zip(*optimizer_parts, strict=True)
        ]
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        module = self.lightning_module
        assert module is not None
        saved = checkpoint["state_dict"]
        local_keys = list(module.state_dict())
        missing = [k for k in local_keys if k not in saved]
        if missing and strict:
            raise PipelineConfigError(
                f"The checkpoint has no entries for {missing[:5]} (of {len(missing)} missing) of pipeline stage "
                f"{self.stage}: it was saved from a different model."
            )
        module.load_state_dict({k: saved[k] for k in local_keys if k in saved}, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        name_of = self._name_of()
        for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            inner = getattr(optimizer, "_optimizer", optimizer)
            if "names" in saved and "groups" in saved:
                named = saved
            else:
                names = saved.get(NAMES_KEY) or self._full_group_names(inner, name_of)
                named = indexed_to_named(saved, names)
            load_named(inner, named, name_of)
            _compat._optimizers_to_device([inner], self.root_device)

    def _full_group_names(self, optimizer: Optimizer, name_of: dict[int, str]) -> list[list[str]]:
        """Each param group's names as a single-device optimizer orders them: the module's parameter order.

        Needed for checkpoints written by plain Lightning, which number parameters without naming them.
        """
        assert self._stage_module is not None
        local = [[name_of[id(p)] for p in group["params"]] for group in optimizer.param_groups]
        parts: list[Any] = [local]
        if self.num_stages > 1:
            parts = [None] * self.num_stages
            dist.all_gather_object(parts, local)
        order = self._stage_module.full_param_order
        return [sorted({n for part in parts for n in part[g]}, key=lambda n: order[n]) for g in range(len(local))]

    def _new_group(self) -> Any:
        return dist.new_group(backend=self._process_group_backend, timeout=timedelta(seconds=self.timeout))

    @override
    def teardown(self) -> None:
        if self._p2p is not None and dist.is_initialized():
            for group in self._p2p.groups:
                dist.destroy_process_group(group)
        self._p2p = None
        self._log_recorder.detach()
        super().teardown()


StrategyRegistry.register(
    PipelineParallelStrategy.strategy_name,
    PipelineParallelStrategy,
    description="Pipeline parallelism over the LightningModule's nn.Sequential (lightning_pp)",
)
