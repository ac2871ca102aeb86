"""PipelineParallelStrategy: Lightning's hooks translated into calls of the schedule, runtime and P2P core."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import time
import weakref
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from contextlib import contextmanager
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
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer
from typing_extensions import override

from lightning_pp import _compat
from lightning_pp._allocator import keep_freed_cpu_memory
from lightning_pp._failures import FailureSignal
from lightning_pp._logs import LogRecorder
from lightning_pp._nccl_emulation import ENV_VAR, emulating_nccl
from lightning_pp.actions import Schedule
from lightning_pp.checkpoint import NAMES_KEY, indexed_to_named, load_named, merge_named, named_state, named_to_indexed
from lightning_pp.errors import PipelineCommError, PipelineConfigError
from lightning_pp.grads import PipelineGradients, broadcast_tensors
from lightning_pp.model.balance import BALANCE_MODES, resolve_balance
from lightning_pp.model.placement import WeightPlacement
from lightning_pp.model.results import outputs_read
from lightning_pp.model.split import Partition, is_split, split_module
from lightning_pp.model.step import StepDriver
from lightning_pp.p2p import StageP2P
from lightning_pp.schedules import GENERATORS, build_schedule, forward_sweep, load_csv
from lightning_pp.telemetry import PipelineTelemetry
from lightning_pp.topology import PipelineLayout, StageGroups, create_groups, create_sharing_groups

__all__ = ["PipelineParallelStrategy"]


_AGREEING_SCALERS: weakref.WeakSet[torch.amp.GradScaler] = weakref.WeakSet()  # scalers already patched
_BACKENDS = ("gloo", "nccl")
_STAGES_PER_RANK = {"interleaved_1f1b": (2, sys.maxsize), "zbv": (2, 2)}  # (least and default, most); others 1
_PLACEMENTS: weakref.WeakKeyDictionary[torch.nn.Module, WeightPlacement] = weakref.WeakKeyDictionary()
log = logging.getLogger(__name__)
_fits_started = 0  # fits this process has run: names each fit's failure flag alike on every rank


def _destroy_gloo_process_group() -> None:
    """Registered with ``atexit`` on gloo: shut the process group down while the interpreter is still whole.

    Left to the interpreter's finalisation, gloo's worker threads can release tensors (and so take the GIL) after
    Python is gone, which now and then aborts the process ("terminate called without an active exception").
    """
    if dist.is_initialized() and dist.get_backend() == "gloo":
        dist.destroy_process_group()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise PipelineConfigError(message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _seconds(value: Any) -> float | None:
    if isinstance(value, timedelta):
        return value.total_seconds()
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


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

    Args:
        schedule: ``"naive"`` (one micro-batch at a time), ``"gpipe"`` (all forwards, then all backwards),
            ``"1f1b"`` (one forward one backward; activation memory bounded by the number of stages),
            ``"interleaved_1f1b"`` (``stages_per_rank`` stages per rank, round-robin: a bubble ``stages_per_rank``
            times smaller), ``"zb_h1"`` (backward split into input and weight gradients, the weight part deferred
            into the bubble), ``"zbv"`` (zero bubble with 2 stages per rank in a V), or the path of a ``.csv`` file
            with one row of compute actions per rank in torch.distributed.pipelining's format (it fixes the
            micro-batch count).
        pipeline_parallel_size: Ranks per pipeline; the world size must be a multiple of it. ``None``: the world
            size (one pipeline, no data parallelism).
        stages_per_rank: Stages each rank holds: 2 or more for ``"interleaved_1f1b"`` (default 2), 2 for
            ``"zbv"``, 1 otherwise; the blocks are split into ``stages_per_rank x pipeline_parallel_size`` stages.
        microbatches: Micro-batches per batch; ``None`` means twice the number of ranks per pipeline. A batch with
            fewer samples is split into one micro-batch per sample (or fewer, where the schedule's rule asks).
        blocks: Dotted path of the block container to split (``"model.transformer.h"``); by default the container of
            repeated blocks holding the most parameters. ``sequential`` is the same argument under its former name.
        balance: How the blocks are split into stages (``stages_per_rank x pipeline_parallel_size`` of them), each a
            contiguous run of at least one block: ``"uniform"`` (or ``None``, the default) an even split of the block
            count; ``"params"`` even parameter counts (the blocks' own); ``"time"`` the split whose slowest stage is
            fastest, by each block's forward and backward time measured on global rank 0 on micro-batch 0 of the
            first training batch (the first stage also pays the step's work before the blocks, the last the head and
            loss), broadcast to every rank (outside ``fit`` it falls back to ``"params"``); or a list of blocks per
            stage summing to the container's length. The split is made in the first run on a module; later runs on
            it keep it.
        timeout: Seconds a stage waits for a peer's transfer before raising
            :class:`~lightning_pp.PipelineTimeoutError` naming the stage, the action and the peer; a rank still alive
            this long (plus 5 s) after another rank of the job failed ends itself.
        process_group_timeout: Timeout of the process group's collectives and of start-up (seconds or a
            ``timedelta``); by default Lightning's (30 minutes), so slow imports or a large checkpoint write on one
            rank do not fail the job.
        checkpoint_format: ``"full"`` gathers the whole model and optimizer on global rank 0 into one file that
            plain single-device Lightning loads; ``"sharded"`` writes a folder with one file per stage (nothing is
            gathered). Both resume on any number of stages, as do single-device checkpoints.
        process_group_backend: ``"gloo"`` or ``"nccl"``; by default chosen from the device.
        reuse_cpu_memory: On CPU (Linux, glibc), keep freed memory in each stage's process instead of returning it to
            the operating system, so the buffers of every micro-batch reuse pages rather than page-faulting fresh ones
            in (15-30 % of the compute time of a 1024-wide MLP stage). The process keeps its peak memory.
        activation_checkpointing: Recompute the blocks' activations in backward instead of keeping them (``True``:
            every block; an int ``n``: every ``n``-th block of the container), with ``torch.utils.checkpoint``
            (non-reentrant, the random state restored, so dropout masks are the same in the recompute): activation
            memory for compute.
        outside_weights: Where the weights outside the blocks live. ``"where_used"``: observed on the first
            training step, each is kept, with its gradient and optimizer state, only on the ranks whose work uses it
            (an embedding on the first stage, a head on the last, a tied embedding/head on both), and its gradient is
            summed among those; elsewhere its module becomes a weightless stand-in. Frozen weights are placed once
            they become trainable. The rule, and what stays everywhere: :mod:`lightning_pp.model.placement`.
            ``"everywhere"``: every rank holds all of them.
        microbatch_weight: What a micro-batch's training loss averages over, as a function of the micro-batch; by
            default its number of samples. Losses and logged means of the micro-batches are combined with these
            weights, so for a loss that averages over tokens with padding ignored (Hugging Face causal LMs with
            ``-100`` labels) pass ``lambda batch: (batch["labels"][:, 1:] != -100).sum()`` to get one device's
            gradients.

    Raises:
        PipelineConfigError: for an argument of the wrong type or value, a world size that is not a multiple of
            ``pipeline_parallel_size``, a ``balance`` that does not fit the container or the number of stages, a
            module without a block container, or manual optimization.

    Example::

        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=PipelineParallelStrategy(schedule="1f1b"))
        trainer.fit(model, train_dataloader)
    """

    strategy_name = "pipeline"

    def __init__(
        self,
        *,
        schedule: str | os.PathLike[str] = "1f1b",
        pipeline_parallel_size: int | None = None,
        stages_per_rank: int | None = None,
        microbatches: int | None = None,
        blocks: str | None = None,
        sequential: str | None = None,
        balance: Sequence[int] | str | None = None,
        timeout: float = 300.0,
        process_group_timeout: float | timedelta | None = None,
        checkpoint_format: str = "full",
        process_group_backend: str | None = None,
        reuse_cpu_memory: bool = True,
        microbatch_weight: Callable[[Any], Any] | None = None,
        activation_checkpointing: bool | int = False,
        outside_weights: str = "where_used",
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
        schedule = os.fspath(schedule) if isinstance(schedule, os.PathLike) else schedule
        is_file = isinstance(schedule, str) and schedule.lower().endswith(".csv")
        _check(isinstance(schedule, str) and (schedule in GENERATORS or is_file),
               f"Unknown schedule {schedule!r}. Valid schedules: {', '.join(sorted(GENERATORS))}, or the path of a "
               f".csv file with one row of actions per rank (torch.distributed.pipelining's format).")
        _check(stages_per_rank is None or (_is_int(stages_per_rank) and stages_per_rank >= 1),
               f"stages_per_rank={stages_per_rank!r} ({type(stages_per_rank).__name__}): pass a positive integer "
               f"(2 or more for schedule='interleaved_1f1b'), or None for the schedule's default.")
        from_file = load_csv(schedule) if is_file else None  # read now: a missing or broken file fails here
        if from_file is not None:
            _check(microbatches in (None, from_file.num_microbatches),
                   f"microbatches={microbatches} but the schedule file {schedule!r} runs "
                   f"{from_file.num_microbatches} micro-batches: leave microbatches out, or write the file for "
                   f"{microbatches}.")
            _check(stages_per_rank in (None, from_file.stages_per_rank),
                   f"stages_per_rank={stages_per_rank} but the schedule file {schedule!r} places "
                   f"{from_file.stages_per_rank} stage(s) on each rank: leave stages_per_rank out.")
            microbatches, stages_per_rank = from_file.num_microbatches, from_file.stages_per_rank
        stages_per_rank = stages_per_rank or _STAGES_PER_RANK.get(str(schedule), (1, 1))[0]
        low, high = _STAGES_PER_RANK.get(str(schedule), (1, 1))
        _check(from_file is not None or low <= stages_per_rank <= high,
               f"schedule={schedule!r} runs {low if low == high else f'at least {low}'} stage(s) per rank, got "
               f"stages_per_rank={stages_per_rank}. Several stages per rank need schedule='interleaved_1f1b' (any "
               f"number from 2) or 'zbv' (2).")
        self._schedule_file = from_file
        _check(pipeline_parallel_size is None or (_is_int(pipeline_parallel_size) and pipeline_parallel_size >= 1),
               f"pipeline_parallel_size={pipeline_parallel_size!r} ({type(pipeline_parallel_size).__name__}): pass "
               f"the number of stages per pipeline as a positive integer (the world size must be a multiple of it), "
               f"or None for one pipeline over the whole world.")
        _check(microbatches is None or (_is_int(microbatches) and microbatches >= 1),
               f"microbatches={microbatches!r} ({type(microbatches).__name__}): pass a positive integer (at least 1 "
               f"micro-batch per batch), or None for twice the number of ranks per pipeline.")
        for name, value in (("blocks", blocks), ("sequential", sequential)):
            _check(value is None or (isinstance(value, str) and value != ""),
                   f"{name}={value!r} ({type(value).__name__}): pass the dotted path of the block container as a "
                   f"string, e.g. {name}='model.transformer.h', or None to find it automatically.")
        _check(blocks is None or sequential is None or blocks == sequential,
               f"blocks={blocks!r} and sequential={sequential!r} name different containers; `sequential` is the "
               f"former name of `blocks`: pass only blocks=...")
        _check(balance in BALANCE_MODES if isinstance(balance, str) else
               balance is None or (isinstance(balance, Sequence) and not isinstance(balance, str) and len(balance) > 0
                                   and all(_is_int(n) and n >= 1 for n in balance)),
               f"balance={balance!r} must be 'uniform' (an even split), 'params' (even parameter counts), 'time' "
               f"(measured forward and backward time) or a list of at least one block for every stage (positive "
               f"integers, e.g. balance=[3, 5]).")
        transfer_seconds = _seconds(timeout)
        _check(transfer_seconds is not None and transfer_seconds > 0,
               f"timeout={timeout!r} ({type(timeout).__name__}) must be a positive number of seconds, e.g. "
               f"timeout=300.")
        group_seconds = _seconds(process_group_timeout) if process_group_timeout is not None else None
        _check(process_group_timeout is None or (group_seconds is not None and group_seconds > 0),
               f"process_group_timeout={process_group_timeout!r} ({type(process_group_timeout).__name__}) must be a "
               f"positive number of seconds or a datetime.timedelta, or None for Lightning's default (30 minutes).")
        _check(checkpoint_format in ("full", "sharded"),
               f"checkpoint_format={checkpoint_format!r}; use 'full' (one file plain Lightning loads) or 'sharded' "
               f"(a folder with one file per stage, nothing gathered on one rank).")
        _check(process_group_backend is None or process_group_backend in _BACKENDS,
               f"process_group_backend={process_group_backend!r}; use 'gloo' (CPU) or 'nccl' (CUDA GPUs), or None to "
               f"choose from the device.")
        _check(microbatch_weight is None or callable(microbatch_weight),
               f"microbatch_weight={microbatch_weight!r} must be a function of a micro-batch returning its weight, "
               f"e.g. microbatch_weight=lambda batch: (batch['labels'][:, 1:] != -100).sum(), or None.")
        _check(isinstance(activation_checkpointing, bool) or (_is_int(activation_checkpointing)
                                                              and activation_checkpointing >= 1),
               f"activation_checkpointing={activation_checkpointing!r} ({type(activation_checkpointing).__name__}) "
               f"must be True (recompute every block in backward), False, or a positive int n (every n-th block).")
        _check(outside_weights in ("where_used", "everywhere"),
               f"outside_weights={outside_weights!r}; use 'where_used' (each weight outside the blocks only on the "
               f"ranks that use it) or 'everywhere' (on every rank).")
        _check(isinstance(reuse_cpu_memory, bool),
               f"reuse_cpu_memory={reuse_cpu_memory!r} ({type(reuse_cpu_memory).__name__}) must be True or False.")
        self.checkpoint_format = checkpoint_format
        self.schedule_name = schedule
        self.stages_per_rank = stages_per_rank
        self._pipeline_parallel_size = pipeline_parallel_size
        self._microbatches = microbatches
        self._blocks_name = blocks if blocks is not None else sequential
        self._balance = list(balance) if balance is not None and not isinstance(balance, str) else None
        self._balance_by = balance if isinstance(balance, str) else None  # "uniform", "params", "time"
        self.timeout = float(transfer_seconds or 0)
        self.process_group_timeout = (timedelta(seconds=group_seconds) if group_seconds is not None
                                      else default_pg_timeout)
        self._process_group_backend = process_group_backend
        self._reuse_cpu_memory = reuse_cpu_memory
        self._microbatch_weight = microbatch_weight
        # recompute every n-th block in backward; 0: keep every activation
        self._checkpoint_every = int(activation_checkpointing) if activation_checkpointing is not False else 0
        self._outside_weights = outside_weights
        self._placement: WeightPlacement | None = None
        self._num_nodes = 1
        self._partition: Partition | None = None
        self._driver: StepDriver | None = None
        self._hidden_example_input: Any = None  # the module's example_input_array while fit starts (see setup)
        self._grads: PipelineGradients | None = None
        self._p2p: StageP2P | None = None
        self._groups: StageGroups | None = None
        # a gloo group over the world for object collectives where the default group is not gloo (None: the default)
        self.object_group: Any = None
        self._accumulating = False  # inside Lightning's block_backward_sync: gradients not synchronized yet
        self._failures: FailureSignal | None = None
        self._schedules: dict[tuple[int, bool], Schedule] = {}
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
        return self._pipeline_parallel_size or max(1, self._world)

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
    def microbatches(self) -> int:
        return self._microbatches if self._microbatches is not None else 2 * self.num_stages

    @property
    def last_grad_sync_bytes(self) -> int:
        """Gradient bytes this rank all-reduced at the latest optimizer step (replicas' average, shared weights)."""
        return self._grads.last_bytes if self._grads is not None else 0

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
        world, stages = self._world, self.num_stages
        divisor = max(d for d in range(1, stages + 1) if world % d == 0)
        _check(world % stages == 0,
               f"pipeline_parallel_size={stages} does not divide the world of {world} processes (devices x num_nodes "
               f"= {self.num_processes} x {self.num_nodes}): each data-parallel replica needs a whole pipeline. Use "
               f"a divisor of {world}, e.g. pipeline_parallel_size={divisor}, or change devices/num_nodes.")
        where = ("pipeline_parallel_size" if self._pipeline_parallel_size is not None
                 else "one per process: Trainer(devices=..., num_nodes=...)")
        if self._schedule_file is not None:
            _check(self._schedule_file.num_ranks == stages,
                   f"The schedule file {self.schedule_name!r} has {self._schedule_file.num_ranks} rows (ranks) but "
                   f"each pipeline has {stages} ({where}): run it on {self._schedule_file.num_ranks} ranks per "
                   f"pipeline.")
        total = stages * self.stages_per_rank
        per_rank = f" ({self.stages_per_rank} per rank)" if self.stages_per_rank > 1 else ""
        _check(self._balance is None or len(self._balance) == total,
               f"balance={self._balance} describes {len(self._balance or [])} stages but each pipeline has {total}"
               f"{per_rank} ({where}). Give {total} block counts, or make the pipeline {len(self._balance or [])} "
               f"stages long.")

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
        _check(not (backend == "gloo" and self.root_device.type == "cuda"),
               f"process_group_backend='gloo' cannot carry the pipeline's transfers between CUDA devices "
               f"({self.root_device}): gloo does not move GPU memory between processes. Use "
               f"process_group_backend='nccl' (or leave it None, which chooses NCCL for CUDA devices).")
        super().setup_environment()
        if self._reuse_cpu_memory and self.root_device.type == "cpu":
            keep_freed_cpu_memory()
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self._world)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        _compat._init_dist_connection(self.cluster_environment, backend, timeout=self.process_group_timeout)
        # object collectives (checkpoint gathering, reports, the monitor's timelines) pickle into tensors: on NCCL those
        # would be GPU buffers of the largest object times the world on the receiving rank, so they use gloo
        self.object_group = (dist.new_group(backend="gloo", timeout=self.process_group_timeout)
                             if backend != "gloo" or emulating_nccl() else None)
        if emulating_nccl() and self.global_rank == 0:
            log.warning(f"lightning_pp: {ENV_VAR} is set: the transfers follow NCCL's protocol on {backend}.")
        if backend == "gloo":
            atexit.unregister(_destroy_gloo_process_group)  # once, however many fits this process runs
            atexit.register(_destroy_gloo_process_group)
        global _fits_started
        _fits_started += 1
        if self._world > 1:
            self._failures = FailureSignal(_compat._default_store(), _fits_started, self.global_rank,
                                           grace=self.timeout + 5)

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
        if trainer.state.fn == TrainerFn.FITTING and self.num_stages > 1 and module.example_input_array is not None:
            # Lightning's model summary (and a logger's graph) run the module on it when fit starts, outside the
            # pipelined step, where the other stages' blocks cannot run: hidden until training starts
            self._hidden_example_input = module.example_input_array
            module.example_input_array = None
            if self.global_rank == 0:
                log.info("example_input_array is set aside until training starts: the model summary is shown without "
                         "input and output sizes (a pipeline cannot run the whole model outside its steps).")
        schedule = self._schedule(self.microbatches, forward_only=False)  # raises for a count it cannot run
        fresh = not is_split(module)  # a later run on the same module keeps what the earlier one trained
        partition = self._partition = split_module(module, self._blocks_name, self._balance_for(trainer, module),
                                                   schedule.stages_of(self.stage), schedule.num_stages)
        if self._checkpoint_every:
            partition.view.checkpoint_blocks(self._checkpoint_every)
        placement = _PLACEMENTS.get(module)
        if placement is not None:  # an earlier run may have left some weights on some ranks only
            placement.restore(lambda tensors, position: broadcast_tensors(
                tensors, self.layout.rank(position, 0), None, self.root_device))
        assert self.model is not None
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        groups = self._groups = create_groups(self.layout, self.global_rank, self._new_group,
                                              p2p_groups=2 if schedule.stages_per_rank == 1 else 4,
                                              last_position=schedule.stage_to_rank[-1])
        if self.is_global_zero and self.num_replicas > 1:
            print(f"lightning_pp: {self.layout}")
        shared, shared_buffers = partition.shared_tensors(module)
        if self._world > 1 and fresh:
            # as DDP starts: rank 0's weights outside the blocks everywhere (later runs: the placement's restore above
            # brought each back from a rank that held it; a head's buffers stay current where it ran)
            broadcast_tensors([*shared, *shared_buffers], 0, None, self.root_device)
        if self.num_replicas > 1:  # and replica 0's blocks in every replica
            everywhere = {id(t) for t in (*shared, *shared_buffers)}
            own = [t for t in (*module.parameters(), *module.buffers()) if id(t) not in everywhere]
            broadcast_tensors(own, self.layout.rank(self.stage, 0), groups.replicas, self.root_device)
        self._grads = PipelineGradients(shared, groups, self.root_device)
        self._placement = None
        if trainer.state.fn == TrainerFn.FITTING and self.num_stages > 1 and self._outside_weights == "where_used":
            if placement is None:
                placement = _PLACEMENTS[module] = WeightPlacement(module, shared, self.stage, self.num_stages)
            self._placement = placement
        partition.view.pass_context = placement.reads if placement is not None else contextlib.nullcontext
        if trainer.state.fn == TrainerFn.FITTING:
            self._setup_optimizers_on_every_stage(trainer)
        self.setup_precision_plugin()
        # Lightning clips by the norm of this stage's gradients; the right norm spans every stage
        grads = self._grads
        self.precision_plugin.clip_grad_by_norm = (  # type: ignore[method-assign]
            lambda optimizer, clip_val: grads.clip_by_global_norm(self.precision_plugin.main_params(optimizer),
                                                                   clip_val))
        scaler = self._grad_scaler()
        if scaler is not None and scaler not in _AGREEING_SCALERS:
            # a stage that finds inf/NaN must make every stage skip the step and back off the scale alike
            local_unscale = scaler.unscale_
            scaler.unscale_ = lambda optimizer: grads.unscale_agreeing(scaler, local_unscale, optimizer)  # type: ignore[method-assign]
            _AGREEING_SCALERS.add(scaler)
        if trainer.state.fn == TrainerFn.FITTING:
            _compat._optimizers_to_device(self.optimizers, self.root_device)
        pipeline_groups = groups if self.num_stages > 1 else None
        self._log_recorder.attach(module, pipeline_groups)
        if self.num_stages > 1:
            stage_ranks = [groups.pipeline_ranks[rank] for rank in schedule.stage_to_rank]
            header_groups = None
            if self._process_group_backend == "nccl" or emulating_nccl():  # headers travel on the host (StageP2P)
                for group in groups.p2p:  # batch_isend_irecv needs a group's first call to involve all its ranks
                    dist.all_reduce(torch.zeros(1, device=self.root_device), group=group)
                on_host = create_groups(self.layout, self.global_rank, lambda ranks: dist.new_group(
                    ranks, backend="gloo", timeout=self.process_group_timeout), p2p_groups=len(groups.p2p))
                groups.created.extend(on_host.created)
                header_groups = on_host.p2p
            self._p2p = StageP2P(stage_ranks, self.root_device, self.timeout, groups.p2p, header_groups=header_groups)
        self._driver = StepDriver(module, partition.view, self._p2p, self._log_recorder, self.root_device,
                                  self._schedule, self.microbatches, self._microbatch_weight, pipeline_groups,
                                  position=self.stage, shared=shared)
        self.telemetry = PipelineTelemetry(device=self.root_device, stage=self.stage, replica=self.replica,
                                           object_group=self.object_group, view=partition.view)

    def _setup_optimizers_on_every_stage(self, trainer: pl.Trainer) -> None:
        """``configure_optimizers`` sees only this stage's parameters, so it may fail on some stages alone (an empty
        parameter list): make any stage's failure an error on every stage, so that no rank is left waiting."""
        error: Exception | None = None
        try:
            self.setup_optimizers(trainer)
        except Exception as caught:
            if self._world == 1:
                raise
            error = caught
        if self._world == 1:
            return
        assert self._partition is not None and self.lightning_module is not None
        view = self._partition.view
        report = None
        if error is not None:
            params = list(self.lightning_module.parameters())
            total, trainable = sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
            report = (f"stage {self.stage} ({type(error).__name__}: {error}; it holds blocks "
                      f"{view.local.start}-{view.local.stop - 1} of `{view.container_name}` and {total} parameters, "
                      f"{trainable} trainable, counting those outside the blocks)")
        reports: list[str | None] = [None] * self._world
        dist.all_gather_object(reports, report, group=self.object_group)
        failed = list(dict.fromkeys(r for r in reports if r is not None))  # replicas of a stage fail alike
        if failed:
            raise PipelineConfigError(
                f"configure_optimizers failed on {len(failed)} pipeline stage(s): {'; '.join(failed)}. Each stage's "
                f"optimizer gets only that stage's parameters; a stage without any (or, when configure_optimizers "
                f"keeps only parameters with requires_grad, without trainable ones) gets an empty list. Pass "
                f"PipelineParallelStrategy(balance=[...]) so that every stage holds blocks with trainable weights."
            ) from error

    def _balance_for(self, trainer: pl.Trainer, module: pl.LightningModule) -> list[int] | None:
        """Blocks per stage for the split: the user's list, ``None`` for an even split, or what ``balance="params"`` /
        ``"time"`` give (the same on every rank: ``"time"`` measures on global rank 0 and broadcasts). Nothing is
        measured for a module an earlier run split (that split is kept) or for a single stage."""
        num_stages = self.num_stages * self.stages_per_rank
        if self._balance_by not in ("params", "time") or num_stages == 1 or is_split(module):
            return self._balance
        return resolve_balance(self._balance_by, module, self._blocks_name, num_stages, trainer,
                               device=self.root_device, microbatches=self.microbatches,
                               precision=self.precision_plugin, recompute_every=self._checkpoint_every,
                               global_rank=self.global_rank, world_size=self._world, collective=self._collective,
                               object_group=self.object_group)

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
            assert self._groups is not None
            group = self._groups.replicas
        return _compat._sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Gather over the data-parallel replicas (``group`` None): one entry per replica, as DDP gives one per rank;
        with one replica the tensor itself, as on one device."""
        if group is None:
            if self.num_replicas == 1:
                return tensor
            assert self._groups is not None
            group = self._groups.replicas
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

    @contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        """Turn a collective's failure (gloo and NCCL name only a socket) into an error naming this rank, the
        collective and, when one has reported, the rank that failed first."""
        try:
            yield
        except PipelineCommError:
            raise
        except RuntimeError as error:
            reported = self._failures.reported() if self._failures is not None else None
            cause = (f"it follows another rank's failure: {reported}" if reported else
                     "a peer has probably crashed: look at the other ranks' output for the first error")
            raise PipelineCommError(f"Pipeline {self._where()} failed in {what}: {error}; {cause}.") from error

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
            assert self._groups is not None
            log.info(f"The predictions stay on the pipeline's last stage (rank {self._groups.last_stage_rank}): "
                     f"nothing on the other stages reads them (return_predictions=False, no prediction writer, no "
                     f"on_predict_batch_end hook), so predict_step returns None there.")

    def _schedule(self, num_microbatches: int, forward_only: bool) -> Schedule:
        key = (num_microbatches, forward_only)
        if key not in self._schedules:
            self._schedules[key] = self._build_schedule(num_microbatches, forward_only)
        return self._schedules[key]

    def _build_schedule(self, count: int, forward_only: bool) -> Schedule:
        """The schedule for ``count`` micro-batches. A last, short batch that the schedule cannot split into ``count``
        (interleaved 1F1B's rule, a file's fixed count) is evaluated with a forward sweep and trained with the largest
        count the schedule runs below ``count``; none is an error naming the batch."""
        try:
            return build_schedule(self.schedule_name, self.num_stages, count, forward_only=forward_only,
                                  stages_per_rank=self.stages_per_rank)
        except PipelineConfigError as error:
            if count >= self.microbatches:
                raise
            why = str(error)
        if forward_only:
            return forward_sweep(self._schedule(self.microbatches, False).stage_to_rank, count)
        for fewer in range(count - 1, 0, -1) if self._schedule_file is None else []:
            with contextlib.suppress(PipelineConfigError):
                return build_schedule(self.schedule_name, self.num_stages, fewer, stages_per_rank=self.stages_per_rank)
        raise PipelineConfigError(
            f"A training batch of {count} samples cannot be split into micro-batches that schedule="
            f"{self.schedule_name!r} runs on {self.num_stages} ranks ({why}). Use batches of at least "
            f"{self.microbatches} samples (DataLoader(drop_last=True) for a short last batch)."
        )

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
        assert self._driver is not None and self._grads is not None and self.lightning_module is not None
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
        for p, grad in self._driver.pending_grads:
            if p.grad is None:
                p.grad = grad
            else:
                p.grad.add_(grad)
        self._driver.pending_grads = []
        if not self._accumulating:  # the optimizer step's backward, as DDP's
            assert self._grads is not None
            if self._placement is not None and self._placement.observation is not None:
                with self._collective("agreeing on which ranks use the weights outside the blocks"):
                    self._place_outside_weights(self._placement, self._grads)
            timed = self.telemetry.timing_sink is not None and self._world > 1
            if timed:  # for PipelineMonitor: wait for the queued work first, so the clock reads the collectives alone
                _synchronize(self.root_device)
                started = time.perf_counter()
            with self._collective("the gradient all-reduce (replicas' average, weights several stages hold)"):
                self._grads.synchronize([p for p in module.parameters() if p.requires_grad])
            if timed:
                _synchronize(self.root_device)
                self.telemetry.last_grad_sync_ms = 1e3 * (time.perf_counter() - started)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _place_outside_weights(self, placement: WeightPlacement, grads: PipelineGradients) -> None:
        """After an observed step: keep each weight outside the blocks only where it is used, and give the weights
        shared by some stages (a tied embedding and head) a group to sum their gradients in."""
        assert self._groups is not None and self._driver is not None
        device = self.root_device

        def any_rank(flags: Tensor) -> Tensor:
            flags = flags.to(device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            return flags.cpu()

        def every_rank(flags: Tensor) -> Tensor:
            gathered = [torch.zeros_like(flags, device=device) for _ in range(self._world)]
            dist.all_gather(gathered, flags.to(device))
            return torch.stack(gathered).cpu()

        lines = placement.decide(any_rank, every_rank, self.layout.stage_of,
                                 [getattr(o, "_optimizer", o) for o in self.optimizers])
        log.info(lines[0])
        for line in lines[1:]:  # weights kept on a rank that does not use them: worth a user's look
            log.warning(line)
        shared_by = {s for s in placement.users.values() if len(s) > 1} - grads.sharing_sets
        if shared_by:  # the same sets on every rank: `users` came from every rank's flags
            groups = create_sharing_groups(self.layout, shared_by, self.global_rank, self._new_group)
            grads.sharing_sets |= shared_by
            grads.sharing_groups.update(groups)
            self._groups.created.extend(groups.values())
        grads.users = placement.users
        self._driver.shared = placement.held()

    # ------------------------------------------------------------------------------------------------ checkpoints

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # load into the partitioned module and the stage's optimizers

    def _name_of(self) -> dict[int, str]:
        assert self.lightning_module is not None
        return {id(p): n for n, p in self.lightning_module.named_parameters()}

    def _gather_on_zero(self, obj: Any) -> list[Any]:
        """Every stage's ``obj`` of replica 0, in stage order, on global rank 0 (replicas hold the same state)."""
        if self._world == 1:
            return [obj]
        gathered: list[Any] | None = [None] * self._world if self.is_global_zero else None
        dist.gather_object(obj if self.replica == 0 else None, gathered, dst=0, group=self.object_group)
        return [gathered[self.layout.rank(stage, 0)] for stage in range(self.num_stages)] if gathered else []

    def _own_state(self) -> dict[str, Tensor]:
        """The state entries this stage holds alone (its blocks), plus, on the last stage, everything else it holds,
        and elsewhere what the last stage does not hold (weights used before the blocks only, see ``outside_weights``).

        Replicated parameters are equal on every stage, but buffers are not: modules after the blocks (a BatchNorm
        head, say) run only on the last stage, which also runs those before it, so its copies are current.
        """
        assert self.lightning_module is not None and self._partition is not None
        prefix = self._partition.view.container_name + "."
        view = self._partition.view
        last = view.num_stages - 1 in view.stages
        placement = _PLACEMENTS.get(self.lightning_module)
        not_on_last = (placement.missing_keys(self._schedule(self.microbatches, False).stage_to_rank[-1])
                       if placement is not None and not last else set())
        return {k: v.detach().cpu() for k, v in self.lightning_module.state_dict().items()
                if k.startswith(prefix) or last or k in not_on_last}

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None and self._partition is not None
        if self.checkpoint_format == "sharded" or self.num_stages == 1:
            return self.lightning_module.state_dict()
        parts = self._gather_on_zero(self._own_state())
        if not self.is_global_zero:
            return {}
        merged: dict[str, Tensor] = {}
        for part in parts:
            merged.update(part)
        return {key: merged[key] for key in self._partition.full_state_keys}

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self._partition is not None
        named = named_state(getattr(optimizer, "_optimizer", optimizer), self._name_of())
        if self.checkpoint_format == "sharded":
            return named
        parts = self._gather_on_zero(named)
        return named_to_indexed(merge_named(parts, self._partition.full_param_order)) if parts else {}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if self.checkpoint_format == "full":
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        folder = str(filepath)
        os.makedirs(folder, exist_ok=True)
        if self.replica == 0:  # one copy per stage
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
        assert self.lightning_module is not None and self._partition is not None
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
        order = self._partition.full_param_order
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
        assert self._partition is not None
        local = [[name_of[id(p)] for p in group["params"]] for group in optimizer.param_groups]
        parts: list[Any] = [local]
        if self._world > 1:
            parts = [None] * self._world
            dist.all_gather_object(parts, local, group=self.object_group)
        order = self._partition.full_param_order
        return [sorted({n for part in parts for n in part[g]}, key=lambda n: order[n]) for g in range(len(local))]

    def _new_group(self, ranks: list[int]) -> Any:
        return dist.new_group(ranks, backend=self._process_group_backend, timeout=self.process_group_timeout)

    @override
    def teardown(self) -> None:
        if self._groups is not None and dist.is_initialized():  # the default group is Lightning's to destroy
            for group in self._groups.created:
                dist.destroy_process_group(group)
        if self.object_group is not None and dist.is_initialized():
            dist.destroy_process_group(self.object_group)
        self.object_group = None
        if self._placement is not None:
            self._placement.cancel()
        self._groups = None
        self._p2p = None
        if self._failures is not None:
            self._failures.stop()
            self._failures = None
        self._log_recorder.detach()
        self._restore_example_input()
        super().teardown()


StrategyRegistry.register(
    PipelineParallelStrategy.strategy_name,
    PipelineParallelStrategy,
    description="Pipeline parallelism over the LightningModule's block container (lightning_pp)",
)
