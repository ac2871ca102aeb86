"""The options of :class:`~lightning_pp.PipelineParallelStrategy`: one keyword-only dataclass, each field documented
and checked on construction (before any process starts), and the checks that need the world size
(:meth:`PipelineOptions.check_world`, run in the launching process and again on every rank before any collective)."""

from __future__ import annotations

import ast
import difflib
import inspect
import itertools
import os
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any, Literal, get_args

import torch
from torch.distributed.constants import default_pg_timeout

from lightning_pp.errors import PipelineConfigError
from lightning_pp.schedule import GENERATORS, load_csv
from lightning_pp.schedule.actions import Schedule

__all__ = ["BALANCE_MODES", "PipelineOptions", "ScheduleName", "check", "documented_arguments", "schedule_named"]

ScheduleName = Literal["naive", "gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev", "pipedream_2bw",
                       "auto", "GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"]
Balance = Literal["uniform", "params", "time"]
Backend = Literal["gloo", "nccl"]
StateDictType = Literal["full", "sharded"]
DataParallelMode = Literal["ddp", "fsdp"]
OutsideWeights = Literal["where_used", "everywhere"]

BACKENDS: tuple[str, ...] = get_args(Backend)
BALANCE_MODES: tuple[str, ...] = get_args(Balance)
# torch.distributed.pipelining's names (its get_schedule_class matches them case-insensitively) for ours
_TORCH_NAMES = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved1f1b": "interleaved_1f1b", "zbvzerobubble": "zbv",
                "dualpipev": "dualpipev"}
# (least and default, most) stages per rank; others 1
_STAGES_PER_RANK = {"interleaved_1f1b": (2, sys.maxsize), "zbv": (2, 2), "dualpipev": (2, 2)}


def check(ok: bool, message: str) -> None:
    """Raise :class:`PipelineConfigError` with ``message`` unless ``ok``."""
    if not ok:
        raise PipelineConfigError(message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _key(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "")


def schedule_named(name: str) -> str | None:
    """Our name for the schedule ``name``: ours or torch.distributed.pipelining's, in any case, with or without
    underscores (``"Interleaved1F1B"``, ``"interleaved_1f1b"`` and ``"INTERLEAVED_1F1B"`` are one); None if none."""
    ours = {_key(known): known for known in (*GENERATORS, "auto")}
    return ours.get(_key(name)) or _TORCH_NAMES.get(_key(name))


def _closest(name: str) -> str:
    names = [*GENERATORS, "auto", *get_args(ScheduleName)]
    matches = dict.fromkeys(schedule_named(m) or m for m in difflib.get_close_matches(name, names, n=3, cutoff=0.5))
    return f" Did you mean {' or '.join(repr(m) for m in matches)}?" if matches else ""


@dataclass(kw_only=True)
class PipelineOptions:
    """How to pipeline: every argument of :class:`~lightning_pp.PipelineParallelStrategy` but Lightning's own.

    Raises:
        PipelineConfigError: on construction, for an argument of the wrong type or value (the message names the
            argument, the value and the fix).
    """

    schedule: ScheduleName | os.PathLike[str] = "1f1b"
    """``"naive"`` (one micro-batch at a time), ``"gpipe"`` (all forwards, then all backwards), ``"1f1b"`` (one forward
    one backward; activation memory bounded by the number of stages), ``"interleaved_1f1b"`` (``stages_per_rank``
    stages per rank, round-robin: a bubble ``stages_per_rank`` times smaller), ``"zb_h1"`` (backward split into input
    and weight gradients, the weight part deferred into the bubble), ``"zbv"`` (zero bubble with 2 stages per rank in a
    V), ``"dualpipev"`` (DeepSeek's DualPipe in its V form: the V of ``"zbv"``, a forward of one stage paired with a
    backward of the other; at least 2 micro-batches per rank), ``"pipedream_2bw"`` (asynchronous, opt-in:
    PipeDream-2BW's 1F1B that never drains between batches, each optimizer step applying the previous batch's
    gradient, so training is not one device's; the semantics in :mod:`lightning_pp.pipedream.stream`), the path of a
    ``.csv`` file with one row of compute actions per rank in torch.distributed.pipelining's format (it fixes the
    micro-batch count), or ``"auto"``: at the start of ``fit``, global rank 0 times the blocks on the first batch and
    the simulator picks the schedule, ``microbatches``, ``stages_per_rank``, ``balance`` and activation checkpointing
    it predicts fastest within ``max_memory`` (what the user passes of those is kept;
    :mod:`lightning_pp.tuning.search`). Names match in any case, with or without underscores, and
    torch.distributed.pipelining's names are accepted too: ``"GPipe"``, ``"1F1B"``, ``"Interleaved1F1B"``,
    ``"ZBVZeroBubble"`` and ``"DualPipeV"``."""
    pipeline_parallel_size: int | None = None
    """Ranks per pipeline; the world size must be a multiple of it. ``None``: the world size (one pipeline, no data
    parallelism)."""
    stages_per_rank: int | None = None
    """Stages each rank holds: 2 or more for ``"interleaved_1f1b"`` (default 2), 2 for ``"zbv"`` and ``"dualpipev"``,
    1 otherwise; the blocks are split into ``stages_per_rank x pipeline_parallel_size`` stages."""
    microbatches: int | None = None
    """Micro-batches per batch; ``None`` means twice the number of ranks per pipeline. A batch with fewer samples is
    split into one micro-batch per sample (or fewer, where the schedule's rule asks)."""
    blocks: str | None = None
    """Dotted path of the block container to split (``"model.transformer.h"``); by default the container of repeated
    blocks holding the most parameters."""
    balance: Sequence[int] | Balance | None = None
    """How the blocks are split into stages (``stages_per_rank x pipeline_parallel_size`` of them), each a contiguous
    run of at least one block: ``"uniform"`` (or ``None``, the default) an even split of the block count; ``"params"``
    even parameter counts (the blocks' own); ``"time"`` the split whose slowest stage is fastest, by each block's
    forward and backward time measured on global rank 0 on micro-batch 0 of the first training batch (the first stage
    also pays the step's work before the blocks, the last the head and loss), broadcast to every rank (outside ``fit``
    it falls back to ``"params"``); or a list of blocks per stage summing to the container's length. The split is made
    in the first run on a module; later runs on it keep it."""
    timeout: timedelta = default_pg_timeout
    """The process group's timeout (its collectives and start-up), as in Lightning's ``DDPStrategy``: by default
    Lightning's 30 minutes, so slow imports or a large checkpoint write on one rank do not fail the job."""
    transfer_timeout: float = 300.0
    """Seconds a stage waits for a peer's transfer before raising :class:`~lightning_pp.PipelineTimeoutError` naming
    the stage, the action and the peer; a rank still alive this long (plus 5 s) after another rank of the job failed
    ends itself."""
    state_dict_type: StateDictType = "full"
    """How checkpoints are saved, with ``FSDPStrategy``'s name and values. ``"full"`` gathers the whole model and
    optimizer on global rank 0 into one file that plain single-device Lightning loads; ``"sharded"`` writes torch's
    distributed checkpoint, a folder where every rank writes the shards it holds, keyed by parameter name (nothing is
    gathered). Both resume on any number of stages, replicas and tensor-parallel ranks, as do single-device
    checkpoints."""
    process_group_backend: Backend | None = None
    """``"gloo"`` or ``"nccl"``; by default chosen from the device (gloo cannot carry transfers between GPUs)."""
    reuse_cpu_memory: bool = True
    """On CPU (Linux, glibc), keep freed memory in each stage's process instead of returning it to the operating
    system, so the buffers of every micro-batch reuse pages rather than page-faulting fresh ones in (15-30 % of the
    compute time of a 1024-wide MLP stage). The process keeps its peak memory."""
    microbatch_weight: Callable[[Any], Any] | None = None
    """What a micro-batch's training loss averages over, as a function of the micro-batch; by default its number of
    samples. Losses and logged means of the micro-batches are combined with these weights, so for a loss that averages
    over tokens with padding ignored (Hugging Face causal LMs with ``-100`` labels) pass
    ``lambda batch: (batch["labels"][:, 1:] != -100).sum()`` to get one device's gradients."""
    activation_checkpointing: bool | int = False
    """Recompute the blocks' activations in backward instead of keeping them (``True``: every block; an int ``n``:
    every ``n``-th block of the container), with ``torch.utils.checkpoint`` (non-reentrant, the random state restored,
    so dropout masks are the same in the recompute): activation memory for compute."""
    outside_weights: OutsideWeights = "where_used"
    """Where the weights outside the blocks live. ``"where_used"``: observed on the first training step, each is kept,
    with its gradient and optimizer state, only on the ranks whose work uses it (an embedding on the first stage, a
    head on the last, a tied embedding/head on both), and its gradient is summed among those; elsewhere its module
    becomes a weightless stand-in. Frozen weights are placed once they become trainable. The rule, and what stays
    everywhere: :mod:`lightning_pp.model.placement`. ``"everywhere"``: every rank holds all of them."""
    carry_block_outputs: bool = False
    """Send every block's output on to every later stage, not only the last block's, so that code reading earlier
    blocks' outputs after or between the blocks (a U-Net's skip connections across stages, a loss over a list of every
    block's output) sees one device's values, with gradients back to the stage that computed them. Each stage then
    sends the outputs of all blocks up to its own last one. Without it such a step is refused with our error. (Values
    the model records with forward hooks, as Hugging Face's ``output_hidden_states`` and router logits, always
    travel.)"""

    data_parallel_mode: DataParallelMode = "ddp"
    """How the data-parallel replicas of a stage (``pipeline_parallel_size`` smaller than the world) hold its blocks.
    ``"ddp"``: each replica holds them whole and their gradients are averaged once per optimizer step, as DDP does.
    ``"fsdp"``: each block is sharded over the replicas with torch's FSDP2 (``fully_shard``): a replica keeps 1/D of
    the blocks' weights, gradients and optimizer state, gathers a block's weights for its passes, and the gradients are
    reduce-scattered once per optimizer step (after the last micro-batch, honouring ``accumulate_grad_batches``). Once
    the first training step placed the weights outside the blocks (``outside_weights="where_used"``), those each rank
    holding them reads only inside their module's forward are sharded the same way on the ranks that use them (see
    :meth:`~lightning_pp.model.placement.WeightPlacement.shardable`); the others stay whole. FSDP2 units the module
    applies itself in ``configure_model`` (``fully_shard(..., mesh=self.device_mesh["data_parallel"])``) are run the
    same way whichever is chosen."""
    tensor_parallel_size: int = 1
    """Ranks each stage is split over by tensor parallelism (the world is pipeline x data-parallel x tensor-parallel;
    tensor-parallel ranks are neighbours). The module applies its own plan in ``configure_model``, as for Lightning's
    ``ModelParallelStrategy``: ``parallelize_module(block, self.device_mesh["tensor_parallel"], plan)`` for each
    block; activations travel between the matching tensor-parallel ranks of neighbouring stages."""

    max_memory: float | None = None
    """With ``schedule="auto"``: the activation memory a rank may hold at once, in bytes, or as a fraction (at most 1)
    of the GPU's memory; configurations predicted to need more are not chosen (activation checkpointing is how most
    fit). ``None``: no limit."""

    schedule_file: Schedule | None = field(init=False, default=None)
    """The schedule read from ``schedule`` when it names a ``.csv`` file (read on construction: a missing or broken
    file fails here)."""

    def __post_init__(self) -> None:
        self._check_schedule()
        check(self.pipeline_parallel_size is None or (_is_int(self.pipeline_parallel_size)
                                                       and self.pipeline_parallel_size >= 1),
               f"pipeline_parallel_size={self.pipeline_parallel_size!r} "
               f"({type(self.pipeline_parallel_size).__name__}): pass the number of stages per pipeline as a positive "
               f"integer (the world size must be a multiple of it), or None for one pipeline over the whole world.")
        check(self.microbatches is None or (_is_int(self.microbatches) and self.microbatches >= 1),
               f"microbatches={self.microbatches!r} ({type(self.microbatches).__name__}): pass a positive integer (at "
               f"least 1 micro-batch per batch), or None for twice the number of ranks per pipeline.")
        self._check_blocks_and_balance()
        self._check_the_rest()

    def _check_schedule(self) -> None:
        schedule = os.fspath(self.schedule) if isinstance(self.schedule, os.PathLike) else self.schedule
        is_file = isinstance(schedule, str) and schedule.lower().endswith(".csv")
        named = schedule_named(schedule) if isinstance(schedule, str) and not is_file else None
        check(named is not None or is_file,
               f"Unknown schedule {schedule!r}.{_closest(schedule) if isinstance(schedule, str) else ''} Valid "
               f"schedules: {', '.join(sorted(GENERATORS))}, 'auto' (chosen from measured costs), torch's names "
               f"({', '.join(n for n in get_args(ScheduleName) if n not in GENERATORS and n != 'auto')}), or the "
               f"path of a .csv file with one row of actions per rank (torch.distributed.pipelining's format).")
        self.schedule = schedule = named or schedule
        stages_per_rank = self.stages_per_rank
        check(stages_per_rank is None or (_is_int(stages_per_rank) and stages_per_rank >= 1),
               f"stages_per_rank={stages_per_rank!r} ({type(stages_per_rank).__name__}): pass a positive integer "
               f"(2 or more for schedule='interleaved_1f1b'), or None for the schedule's default.")
        from_file = self.schedule_file = load_csv(schedule) if is_file else None
        if from_file is not None:
            check(self.microbatches in (None, from_file.num_microbatches),
                   f"microbatches={self.microbatches} but the schedule file {schedule!r} runs "
                   f"{from_file.num_microbatches} micro-batches: leave microbatches out, or write the file for "
                   f"{self.microbatches}.")
            check(stages_per_rank in (None, from_file.stages_per_rank),
                   f"stages_per_rank={stages_per_rank} but the schedule file {schedule!r} places "
                   f"{from_file.stages_per_rank} stage(s) on each rank: leave stages_per_rank out.")
            self.microbatches, stages_per_rank = from_file.num_microbatches, from_file.stages_per_rank
        if schedule == "auto":  # chosen at fit's start, unless given
            return
        low, high = _STAGES_PER_RANK.get(str(schedule), (1, 1))
        self.stages_per_rank = stages_per_rank = stages_per_rank or low
        check(from_file is not None or low <= stages_per_rank <= high,
               f"schedule={schedule!r} runs {low if low == high else f'at least {low}'} stage(s) per rank, got "
               f"stages_per_rank={stages_per_rank}. Several stages per rank need schedule='interleaved_1f1b' (any "
               f"number from 2), 'zbv' or 'dualpipev' (2).")

    def _check_blocks_and_balance(self) -> None:
        blocks, balance = self.blocks, self.balance
        check(blocks is None or (isinstance(blocks, str) and blocks != ""),
               f"blocks={blocks!r} ({type(blocks).__name__}): pass the dotted path of the block container as a "
               f"string, e.g. blocks='model.transformer.h', or None to find it automatically.")
        check(balance in BALANCE_MODES if isinstance(balance, str) else
               balance is None or (isinstance(balance, Sequence) and len(balance) > 0
                                   and all(_is_int(n) and int(n) >= 1 for n in balance)),
               f"balance={balance!r} must be 'uniform' (an even split), 'params' (even parameter counts), 'time' "
               f"(measured forward and backward time) or a list of at least one block for every stage (positive "
               f"integers, e.g. balance=[3, 5]).")

    def _check_the_rest(self) -> None:
        timeout, transfer = self.timeout, self.transfer_timeout
        check(isinstance(timeout, timedelta) and timeout.total_seconds() > 0,
               f"timeout={timeout!r} ({type(timeout).__name__}) is the process group's timeout, as in Lightning's "
               f"DDPStrategy: pass a positive datetime.timedelta, e.g. timeout=timedelta(hours=1). The seconds a stage "
               f"waits for a peer's transfer are transfer_timeout (e.g. transfer_timeout=300).")
        check(isinstance(transfer, int | float) and not isinstance(transfer, bool) and transfer > 0,
               f"transfer_timeout={transfer!r} ({type(transfer).__name__}) must be a positive number of seconds, e.g. "
               f"transfer_timeout=300.")
        check(self.state_dict_type in get_args(StateDictType),
               f"state_dict_type={self.state_dict_type!r}; use 'full' (one file plain Lightning loads) or "
               f"'sharded' (torch's distributed checkpoint: each rank writes its shards, nothing gathered).")
        check(self.process_group_backend is None or self.process_group_backend in BACKENDS,
               f"process_group_backend={self.process_group_backend!r}; use 'gloo' (CPU) or 'nccl' (CUDA GPUs), or "
               f"None to choose from the device.")
        check(self.microbatch_weight is None or callable(self.microbatch_weight),
               f"microbatch_weight={self.microbatch_weight!r} must be a function of a micro-batch returning its "
               f"weight, e.g. microbatch_weight=lambda batch: (batch['labels'][:, 1:] != -100).sum(), or None.")
        checkpointing = self.activation_checkpointing
        check(isinstance(checkpointing, bool) or (_is_int(checkpointing) and checkpointing >= 1),
               f"activation_checkpointing={checkpointing!r} ({type(checkpointing).__name__}) must be True (recompute "
               f"every block in backward), False, or a positive int n (every n-th block).")
        check(self.outside_weights in get_args(OutsideWeights),
               f"outside_weights={self.outside_weights!r}; use 'where_used' (each weight outside the blocks only on "
               f"the ranks that use it) or 'everywhere' (on every rank).")
        check(isinstance(self.carry_block_outputs, bool),
               f"carry_block_outputs={self.carry_block_outputs!r} ({type(self.carry_block_outputs).__name__}) must "
               f"be True or False.")
        check(self.data_parallel_mode in get_args(DataParallelMode),
               f"data_parallel_mode={self.data_parallel_mode!r}; use 'ddp' (each replica holds its stage's blocks "
               f"whole) or 'fsdp' (the blocks sharded over the replicas with FSDP2).")
        check(_is_int(self.tensor_parallel_size) and self.tensor_parallel_size >= 1,
               f"tensor_parallel_size={self.tensor_parallel_size!r} ({type(self.tensor_parallel_size).__name__}): "
               f"pass the number of ranks each stage is split over as a positive integer (1: no tensor parallelism).")
        check(self.tensor_parallel_size == 1 or self.balance_by != "time",
               f"balance='time' measures the blocks on global rank 0 alone, but with tensor_parallel_size="
               f"{self.tensor_parallel_size} a block's passes need every tensor-parallel rank. Use balance='params' or "
               f"a list of blocks per stage.")
        check(isinstance(self.reuse_cpu_memory, bool),
               f"reuse_cpu_memory={self.reuse_cpu_memory!r} ({type(self.reuse_cpu_memory).__name__}) must be True "
               f"or False.")
        auto = self.schedule == "auto"
        check(not auto or self.balance_by in (None, "time"),
               f"balance={self.balance!r} with schedule='auto', which splits the blocks by their measured time (as "
               f"balance='time'): leave balance out, or pass a list of blocks per stage to fix the split.")
        check(not auto or self.tensor_parallel_size == 1,
               f"schedule='auto' measures the blocks on global rank 0 alone, but with tensor_parallel_size="
               f"{self.tensor_parallel_size} a block's passes need every tensor-parallel rank. Name a schedule.")
        memory = self.max_memory
        check(memory is None or (isinstance(memory, int | float) and not isinstance(memory, bool) and memory > 0),
               f"max_memory={memory!r} ({type(memory).__name__}): pass bytes (max_memory=8 * 2**30), a fraction of "
               f"the GPU's memory (max_memory=0.8), or None for no limit.")
        check(memory is None or auto,
               f"max_memory={memory} only bounds what schedule='auto' chooses, but schedule={self.schedule!r}: pass "
               f"schedule='auto', or leave max_memory out.")
        self._check_pipedream()

    def _check_pipedream(self) -> None:
        """``pipedream_2bw`` keeps a second version of a stage's own, whole weights."""
        if self.schedule != "pipedream_2bw":
            return
        for what, bad in (("tensor_parallel_size > 1", self.tensor_parallel_size > 1),
                          ("data_parallel_mode='fsdp'", self.data_parallel_mode == "fsdp"),
                          ("activation_checkpointing", bool(self.activation_checkpointing))):
            check(not bad,
                   f"schedule='pipedream_2bw' with {what}: its backwards may run after an optimizer step, on a kept "
                   f"copy of a stage's whole, local weights, which sharded weights do not have (and the strategy's "
                   f"recomputation is not supported with it). Leave {what.split(' ')[0].split('=')[0]} out, or use "
                   f"a synchronous schedule (schedule='1f1b').")

    @property
    def balance_list(self) -> list[int] | None:
        """Blocks per stage as given, or None when ``balance`` names a mode."""
        return list(self.balance) if self.balance is not None and not isinstance(self.balance, str) else None

    @property
    def balance_by(self) -> str | None:
        """``"uniform"``, ``"params"`` or ``"time"`` when ``balance`` names a mode."""
        return self.balance if isinstance(self.balance, str) else None

    @property
    def recompute_every(self) -> int:
        """Recompute every this many blocks in backward; 0: keep every activation."""
        return int(self.activation_checkpointing) if self.activation_checkpointing is not False else 0

    def check_backend(self, backend: str, device: torch.device) -> None:
        """The process group's backend can carry transfers between ``device``s (before any collective)."""
        check(not (backend == "gloo" and device.type == "cuda"),
              f"process_group_backend='gloo' cannot carry the pipeline's transfers between CUDA devices ({device}): "
              f"gloo does not move GPU memory between processes. Use process_group_backend='nccl' (or leave it None, "
              f"which chooses NCCL for CUDA devices).")

    def check_world(self, num_stages: int, num_processes: int, num_nodes: int) -> None:
        """What every rank checks alike before any collective, once the world size is known: ``num_stages`` ranks per
        pipeline times ``tensor_parallel_size`` must divide the world, and a schedule file and a balance list must fit
        the pipeline."""
        world = num_processes * num_nodes
        tp = self.tensor_parallel_size
        if tp == 1:
            divisor = max(d for d in range(1, num_stages + 1) if world % d == 0)
            check(world % num_stages == 0,
                   f"pipeline_parallel_size={num_stages} does not divide the world of {world} processes (devices x "
                   f"num_nodes = {num_processes} x {num_nodes}): each data-parallel replica needs a whole pipeline. "
                   f"Use a divisor of {world}, e.g. pipeline_parallel_size={divisor}, or change devices/num_nodes.")
        else:
            check(world % (num_stages * tp) == 0,
                   f"pipeline_parallel_size x tensor_parallel_size = {num_stages} x {tp} = {num_stages * tp} does not "
                   f"divide the world of {world} processes (devices x num_nodes = {num_processes} x {num_nodes}): the "
                   f"world is pipeline x data-parallel x tensor-parallel ranks. Choose sizes whose product divides "
                   f"{world} (set pipeline_parallel_size when tensor_parallel_size > 1), or change devices/num_nodes.")
        where = ("pipeline_parallel_size" if self.pipeline_parallel_size is not None
                 else "one per process: Trainer(devices=..., num_nodes=...)")
        if self.schedule_file is not None:
            check(self.schedule_file.num_ranks == num_stages,
                   f"The schedule file {self.schedule!r} has {self.schedule_file.num_ranks} rows (ranks) but each "
                   f"pipeline has {num_stages} ({where}): run it on {self.schedule_file.num_ranks} ranks per "
                   f"pipeline.")
        microbatches = self.microbatches if self.microbatches is not None else 2 * num_stages
        check(self.schedule != "pipedream_2bw" or num_stages > 1,
               f"schedule='pipedream_2bw' on a pipeline of one rank ({where}): with nothing to overlap, its delayed "
               f"update would only change training. Run it on 2 or more ranks per pipeline, or use schedule='1f1b'.")
        check(self.schedule != "pipedream_2bw" or microbatches >= num_stages,
               f"schedule='pipedream_2bw' needs at least as many micro-batches as ranks in a pipeline "
               f"(microbatches={microbatches}, {num_stages} ranks): with fewer, more than one earlier batch would "
               f"still be in flight when a batch starts, needing more than two weight versions. Pass "
               f"microbatches={num_stages} or more.")
        stages_per_rank = self.stages_per_rank
        if stages_per_rank is None:  # schedule="auto" chooses it (and fits it to a balance list)
            return
        total = num_stages * stages_per_rank
        per_rank = f" ({stages_per_rank} per rank)" if stages_per_rank > 1 else ""
        balance = self.balance_list
        check(balance is None or len(balance) == total,
               f"balance={balance} describes {len(balance or [])} stages but each pipeline has {total}{per_rank} "
               f"({where}). Give {total} block counts, or make the pipeline {len(balance or [])} stages long.")


def documented_arguments() -> str:
    """The arguments of :class:`PipelineOptions` with their field docstrings, as a Google-style ``Args:`` section: the
    strategy's docstring ends with it, so that its reader and LightningCLI's ``--help`` see every argument described
    (one text, written once, beside its field). Empty where the source cannot be read."""
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(PipelineOptions))).body[0].body  # type: ignore[attr-defined]
    except (OSError, TypeError):
        return ""
    arguments = {f.name for f in fields(PipelineOptions) if f.init}
    lines = ["Args:"]
    for node, following in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in arguments
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)):
            text = " ".join(str(following.value.value).split())
            lines.append(textwrap.fill(f"{node.target.id}: {text}", width=116, initial_indent="    ",
                                       subsequent_indent="        "))
    return "\n".join(lines)
