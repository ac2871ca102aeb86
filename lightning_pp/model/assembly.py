"""Building this rank's stage from the user's module at setup: split the blocks, bring back what an earlier run placed
elsewhere, create the process groups, start every rank from the same weights; and, after the first observed training
step, keep each weight outside the blocks only where it is used."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_pp import _compat
from lightning_pp._logging import EVERY_RANK, get_logger
from lightning_pp.errors import PipelineConfigError
from lightning_pp.model.callbacks import check_callbacks
from lightning_pp.model.materialize import has_meta_tensors, left_uninitialized, materialize
from lightning_pp.model.placement import WeightPlacement
from lightning_pp.model.sides import not_ours
from lightning_pp.model.split import Partition, split_module
from lightning_pp.parallel.grads import PipelineGradients, broadcast_tensors
from lightning_pp.parallel.sharding import (
    BlockSharding,
    check_user_sharding,
    local,
    sharded_over_replicas,
    shared_block_weights,
)
from lightning_pp.parallel.topology import (
    PipelineLayout,
    StageGroups,
    create_groups,
    create_sharing_groups,
    gather_reports,
)
from lightning_pp.run import RunContext
from lightning_pp.schedule.actions import Schedule

__all__ = ["StageAssembly", "assemble_stage", "check_initialized", "is_assembled",
           "place_outside_weights", "placement_of", "refuse_manual_optimization", "refuse_unsupported",
           "set_aside_example_input", "setup_optimizers_everywhere", "shard_outside_weights"]

log = get_logger(__name__)


@dataclass
class _EarlierRun:
    """What a run in this process left on a module that a later run (another fit, validate, ...) carries on from."""

    partition: Partition  # its split, kept whatever balance a later run asks for
    placement: WeightPlacement | None = None  # where it left the weights outside the blocks (some ranks only)
    sharding: BlockSharding | None = None  # its blocks sharded over the replicas (data_parallel_mode="fsdp")


_EARLIER_RUNS: weakref.WeakKeyDictionary[nn.Module, _EarlierRun] = weakref.WeakKeyDictionary()


@dataclass
class StageAssembly:
    """What setup made of the module on this rank."""

    partition: Partition
    groups: StageGroups
    grads: PipelineGradients
    # where the weights outside the blocks are kept: this run's placement, or an earlier run's (None: on every rank)
    placement: WeightPlacement | None
    places: bool  # whether this run places the weights outside the blocks where they are used
    sharding: BlockSharding | None = None  # the blocks sharded over the stage's replicas (data_parallel_mode="fsdp")
    # the tensors a meta-device build made here, to be checked once a checkpoint had its chance to set them
    materialized: list[str] = field(default_factory=list)
    # the modules outside the blocks to shard over the replicas once the placing step's gradients are averaged
    to_shard: tuple[list[tuple[str, nn.Module]], list[nn.Parameter]] | None = None

    @property
    def placing(self) -> WeightPlacement | None:
        """This run's placement, observed on its first training step (None: this run places nothing)."""
        return self.placement if self.places else None


def is_assembled(module: nn.Module) -> bool:
    """Whether a run in this process assembled a stage of ``module`` (a later run keeps its split)."""
    return module in _EARLIER_RUNS


def placement_of(module: nn.Module) -> WeightPlacement | None:
    """The placement a run made of ``module``'s weights outside the blocks, if any."""
    earlier = _EARLIER_RUNS.get(module)
    return earlier.placement if earlier is not None else None


def refuse_unsupported(module: Any, fitting: bool, tensor_parallel_size: int) -> None:
    """Before any collective: sharding the module applied itself that the pipeline cannot run, or
    ``tensor_parallel_size`` without a plan (see :func:`~lightning_pp.parallel.sharding.check_user_sharding`; before our
    first run on it), (fit) manual optimization, and the callbacks a pipeline cannot run as one device would (see
    :func:`~lightning_pp.model.callbacks.check_callbacks`, which also warns about norms with batch statistics), are
    refused."""
    strategy = module.trainer.strategy
    warn_norms = fitting and strategy.num_stages > 1 and not is_assembled(module)  # (a split module: some are gone)
    check_callbacks(module.trainer, module, options=strategy.options, microbatches=strategy.microbatches if warn_norms
                    else 1)
    if not is_assembled(module):
        check_user_sharding(module, tensor_parallel_size)
    if fitting:
        refuse_manual_optimization(module)


def refuse_manual_optimization(module: Any) -> None:
    """A fit's module must use automatic optimization: the schedule runs forward and backward itself."""
    if not module.automatic_optimization:
        raise PipelineConfigError(
            f"{type(module).__name__} uses manual optimization (automatic_optimization=False), which "
            f"PipelineParallelStrategy does not support: the schedule runs forward and backward itself. Use "
            f"automatic optimization, where Lightning calls the optimizers after the pipelined step.")


def set_aside_example_input(module: Any, rank: int) -> Any:
    """Take ``example_input_array`` off the module while fit starts and return it (None: there is none). Lightning's
    model summary (and a logger's graph) run the module on it outside the pipelined step, where other stages' blocks
    cannot run; the strategy puts it back once training starts."""
    example = module.example_input_array
    if example is not None:
        module.example_input_array = None
        if rank == 0:
            log.info("example_input_array is set aside until training starts: the model summary is shown without "
                     "input and output sizes (a pipeline cannot run the whole model outside its steps).")
    return example


def assemble_stage(run: RunContext, module: nn.Module, schedule: Schedule, *, balance: Sequence[int] | None,
                   to_device: Callable[[], None], sharding: BlockSharding | None = None) -> StageAssembly:
    """Split ``module`` into this rank's stages of ``schedule`` (a later run on the same module keeps what the earlier
    one trained; ``balance``: blocks per stage, None for an even split), create the groups, give what this rank holds
    of a meta-device build its storage, move it with ``to_device``, and start every rank from the same weights, as DDP
    starts: outside the blocks, those of the rank holding the same tensor-parallel shard on the first stage (global
    rank 0 without tensor parallelism); the blocks, replica 0's. (Tensor-parallel ranks start alike by building alike:
    seed every rank alike, as for Lightning's ``ModelParallelStrategy``.) A training run places the weights outside
    the blocks where they are used (``outside_weights="where_used"``); ``sharding``: shard this rank's blocks over the
    stage's replicas (block by block, so that no rank holds its stage whole at setup) and run the FSDP2 units the
    module applied itself."""
    layout, rank, device, new_group, options = run.layout, run.rank, run.device, run.new_group, run.options
    stage = layout.stage_of(rank)
    earlier = _EARLIER_RUNS.get(module)
    fresh = earlier is None
    partition = split_module(module, options.blocks, balance, schedule.stages_of(stage), schedule.num_stages,
                             earlier.partition if earlier is not None else None, schedule.stages_per_rank)
    if earlier is None:
        earlier = _EARLIER_RUNS[module] = _EarlierRun(partition)
        if rank == 0:  # which container was found (or named), and how it was split
            _log_split(partition)
    if options.recompute_every:
        partition.view.checkpoint_blocks(options.recompute_every)
    sharding = sharding if earlier.sharding is None else None  # a later run keeps the earlier run's shards
    if sharding is not None:  # before any collective: a stage that cannot be sharded fails every rank
        _refuse_unshardable(module, partition, layout, rank, run.object_group())
    groups = create_groups(layout, rank, new_group, p2p_groups=2 if schedule.stages_per_rank == 1 else 4,
                           last_position=schedule.stage_to_rank[-1])
    if rank == 0 and layout.lanes > 1:
        log.info(str(layout))
    made: list[str] = []
    if sharding is not None:
        made += _shard(module, partition, sharding, groups, device)
        earlier.sharding = sharding
    if has_meta_tensors(module):  # alike on every rank: the module was built alike
        for name, _ in partition.view.named_local_blocks():  # block by block: a tensor-parallel one is made whole
            made += materialize(module, device, part=name)
        made += materialize(module, device)
    # each tensor-parallel shard's values come from the rank holding the same shard: `shard_peers`, `replica_root`
    tp = layout.tensor_parallel_rank_of(rank)
    placement = earlier.placement
    if placement is not None:  # an earlier run may have left some weights on some ranks only
        placement.restore(lambda tensors, position: broadcast_tensors(tensors, layout.rank(position, tp),
                                                                      groups.shard_peers, device))
    to_device()
    if sharding is not None and fresh:  # on the device: adopting a unit initializes it
        sharding.adopt_units(module, _pipeline_hooks_last, outside=partition.view.container_name)
    shared, shared_buffers = partition.shared_tensors(module)
    _start_alike(module, [*shared, *shared_buffers], groups, device, outside_too=fresh)
    # weights outside the blocks the module sharded over the replicas itself stay on every stage: its units hold them
    place_where_used = (run.fitting and layout.num_stages > 1 and options.outside_weights == "where_used"
                        and not (earlier.sharding is not None and earlier.sharding.adopted_outside))
    if place_where_used and placement is None:
        placement = earlier.placement = WeightPlacement(module, shared, stage, layout.num_stages,
                                                        partition.view.container)
    partition.view.pass_context = placement.reads if placement is not None else contextlib.nullcontext
    return StageAssembly(partition, groups, _gradients(shared, placement, groups, device, new_group), placement,
                         place_where_used, earlier.sharding, made)


def _gradients(shared: list[nn.Parameter], placement: WeightPlacement | None, groups: StageGroups,
               device: torch.device, new_group: Callable[[list[int]], Any]) -> PipelineGradients:
    grads = PipelineGradients(shared, groups, device)
    if placement is not None and placement.users:  # an earlier run's sharded weights stay placed
        _sum_shared_weights(placement, grads, groups, new_group)
    return grads


def _log_split(partition: Partition) -> None:
    view = partition.view
    log.info(f"`{view.container_name}` ({view.ranges[-1].stop} blocks) split into {view.num_stages} stages "
             f"of {[len(r) for r in view.ranges]} blocks")


def _refuse_unshardable(module: nn.Module, partition: Partition, layout: PipelineLayout, rank: int,
                        object_group: Any) -> None:
    """Blocks of any stage that cannot each be their own FSDP2 unit (a shared weight) fail every rank."""
    report = shared_block_weights(partition.view.named_local_blocks(), partition.shared_tensors(module)[0])
    where = f"stage {layout.stage_of(rank)} (rank {rank})"
    failed = gather_reports(f"{where}: {report}" if report else None, layout.world_size, object_group)
    if failed:
        raise PipelineConfigError("; ".join(failed))


def _start_alike(module: nn.Module, outside: list[Tensor], groups: StageGroups, device: torch.device,
                 *, outside_too: bool) -> None:
    """Broadcast what every rank must start from alike, as DDP starts: (``outside_too``: a first run) the tensors
    ``outside`` the blocks from the first stage's rank holding the same tensor-parallel shard, those sharded over the
    replicas (by the module's own FSDP2 units) along each lane; this rank's other tensors (its blocks) from replica 0.
    (A later run's placement brought each outside weight back from a rank that held it; a head's buffers stay current
    where it ran.)"""
    layout, rank = groups.layout, groups.rank
    if outside_too and layout.world_size > layout.tensor_parallel:
        whole = [t for t in outside if not sharded_over_replicas(t)]
        broadcast_tensors(whole, layout.tensor_parallel_rank_of(rank), groups.shard_peers, device)
        if layout.num_stages > 1:
            sharded = [t for t in outside if sharded_over_replicas(t)]
            broadcast_tensors(sharded, layout.rank(0, layout.lane_of(rank)), groups.pipeline, device)
    if layout.num_replicas > 1:
        everywhere = {id(t) for t in outside}
        own = [t for t in (*module.parameters(), *module.buffers())  # sharded ones started alike (_shard)
               if id(t) not in everywhere and not sharded_over_replicas(t)]
        broadcast_tensors(own, groups.replica_root, groups.replicas, device)


def _shard(module: nn.Module, partition: Partition, sharding: BlockSharding, groups: StageGroups,
           device: torch.device) -> list[str]:
    """This rank's blocks, one at a time: materialize it (a meta build); run the FSDP2 units the module applied in it
    itself, or (``sharding.shard_blocks``) give it replica 0's values (as DDP starts) and shard it. Returns the names
    of the tensors materialized."""
    made: list[str] = []
    for name, block in partition.view.named_local_blocks():
        if has_meta_tensors(block):
            made += materialize(module, device, part=name)
        block.to(device)
        if sharding.adopt_units(module, _pipeline_hooks_last, within=name):
            continue
        if sharding.shard_blocks:
            with torch.no_grad():  # in place, tensor by tensor: no flat copy of the block beside it
                for tensor in (*block.parameters(), *block.buffers()):
                    dist.broadcast(local(tensor), groups.replica_root, group=groups.replicas)
            sharding.shard(block, last=_pipeline_hooks_last)
    return made


def _pipeline_hooks_last(hook: Any) -> bool:
    return not not_ours(hook)  # the pipeline's hooks (the end of a stage stops the step) run after FSDP's


def check_initialized(assembly: StageAssembly, module: nn.Module, layout: PipelineLayout, rank: int,
                      object_group: Any) -> None:
    """Once a checkpoint had its chance to set them: what a meta-device build left uninitialized on any rank is an
    error on every rank (see :mod:`lightning_pp.model.materialize`)."""
    made, assembly.materialized = assembly.materialized, []
    report = left_uninitialized(module, made) if made else None
    where = f"stage {layout.stage_of(rank)} (rank {rank})"
    failed = gather_reports(f"{where}: {report}" if report is not None else None, layout.world_size, object_group)
    if failed:
        raise PipelineConfigError("The module was built on the meta device, and " + "; ".join(failed))


def place_outside_weights(assembly: StageAssembly, optimizers: Sequence[Any], device: torch.device,
                          new_group: Callable[[list[int]], Any]) -> None:
    """After an observed step: keep each weight outside the blocks only where it is used, give the weights shared by
    some stages (a tied embedding and head) a group to sum their gradients in, and (``data_parallel_mode="fsdp"``)
    choose those to shard over the replicas (:func:`shard_outside_weights`)."""
    placement, grads, groups = assembly.placement, assembly.grads, assembly.groups
    assert placement is not None
    layout = groups.layout

    def any_rank(flags: Tensor) -> Tensor:
        flags = flags.to(device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return flags.cpu()

    def every_rank(flags: Tensor) -> Tensor:
        gathered = [torch.zeros_like(flags, device=device) for _ in range(layout.world_size)]
        dist.all_gather(gathered, flags.to(device))
        return torch.stack(gathered).cpu()

    def every_rank_agrees(flags: Tensor) -> Tensor:
        flags = flags.to(device)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        return flags.cpu()

    unwrapped = [_compat.unwrapped_optimizer(o) for o in optimizers]
    lines = placement.decide(any_rank, every_rank, layout.stage_of, unwrapped)
    sharding = assembly.sharding
    if sharding is not None and sharding.shard_blocks:  # data_parallel_mode="fsdp": what can be, sharded like blocks
        assembly.to_shard = units, bare = placement.shardable(every_rank_agrees)
        lines[0] += f"; {len(units)} module(s) and {len(bare)} unused weight(s) here sharded over the replicas (FSDP2)"
    log.info(lines[0], extra=EVERY_RANK)  # each rank's own report
    for line in lines[1:]:  # weights kept on a rank that does not use them: worth a user's look
        log.warning(line, extra=EVERY_RANK)
    _sum_shared_weights(placement, grads, groups, new_group)


def _sum_shared_weights(placement: WeightPlacement, grads: PipelineGradients, groups: StageGroups,
                        new_group: Callable[[list[int]], Any]) -> None:
    """Give ``grads`` the placement's holders and a group for each set of positions sharing a weight (a tied
    embedding and head): over their replicas for whole weights, along each lane for sharded ones. The same sets on
    every rank (``users`` came from every rank's flags, the sharded weights from agreed ones), created in one order."""
    sharded = {id(p) for p in placement.sharded_weights()}
    tied = [(users, id(p) in sharded) for p in placement.weights
            if len(users := placement.users.get(id(p), frozenset())) > 1]
    for lane_only, known, made in ((False, grads.sharing_sets, grads.sharing_groups),
                                   (True, grads.lane_sharing_sets, grads.lane_sharing_groups)):
        new_sets = {users for users, is_sharded in tied if is_sharded or not lane_only} - known
        if new_sets:  # a weight sharded now is summed whole at this step, by its shards from the next
            created = create_sharing_groups(groups.layout, new_sets, groups.rank, new_group,
                                            across_replicas=not lane_only)
            known |= new_sets
            made.update(created)
            groups.created.extend(created.values())
    grads.users = placement.users


def shard_outside_weights(assembly: StageAssembly, optimizers: Sequence[Any]) -> None:
    """After the placing step's gradients were averaged whole: make the modules :func:`place_outside_weights` chose
    FSDP2 units over the replicas (their gradients and optimizer state become this rank's shards)."""
    placement, sharding, to_shard = assembly.placement, assembly.sharding, assembly.to_shard
    assert placement is not None and sharding is not None and to_shard is not None
    replacements = sharding.shard_outside(*to_shard, [_compat.unwrapped_optimizer(o) for o in optimizers],
                                          _pipeline_hooks_last)
    assembly.to_shard = None
    placement.replace_weights(replacements)
    assembly.grads.replace_weights(replacements, placement.users)


def _refuse_meta_parameters(module: Any) -> None:
    """An optimizer given parameters still on the meta device (a list kept aside in ``__init__`` of a module built
    under ``init_module(empty_init=True)``; setup materialized new ones) would silently update nothing."""
    stale = [p for optimizer in module.trainer.optimizers for group in optimizer.param_groups for p in group["params"]
             if p.is_meta]
    if stale:
        raise PipelineConfigError(
            f"configure_optimizers gave the optimizer {len(stale)} parameter(s) still on the meta device: the module "
            f"was built under trainer.init_module(empty_init=True) and setup replaced its parameters with materialized "
            f"ones. Build the optimizer from self.parameters() (or self.named_parameters()) in configure_optimizers, "
            f"not from a list kept in __init__.")


def setup_optimizers_everywhere(setup: Callable[[], None], module: nn.Module, partition: Partition, stage: int,
                                world_size: int, object_group: Any) -> None:
    """Run ``setup`` (Lightning's ``configure_optimizers`` on this stage's parameters) on every rank. It may fail on
    some stages alone (an empty parameter list): any stage's failure becomes an error on every stage, so that no rank
    is left waiting."""
    error: Exception | None = None
    try:
        setup()
        _refuse_meta_parameters(module)
    except Exception as caught:
        if world_size == 1:
            raise
        error = caught
    if world_size == 1:
        return
    view, report = partition.view, None
    if error is not None:
        params = list(module.parameters())
        total, trainable = sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
        report = (f"stage {stage} ({type(error).__name__}: {error}; it holds blocks "
                  f"{view.local.start}-{view.local.stop - 1} of `{view.container_name}` and {total} parameters, "
                  f"{trainable} trainable, counting those outside the blocks)")
    failed = gather_reports(report, world_size, object_group)  # replicas of a stage fail alike
    if failed:
        raise PipelineConfigError(
            f"configure_optimizers failed on {len(failed)} pipeline stage(s): {'; '.join(failed)}. Each stage's "
            f"optimizer gets only that stage's parameters; a stage without any (or, when configure_optimizers "
            f"keeps only parameters with requires_grad, without trainable ones) gets an empty list. Pass "
            f"PipelineParallelStrategy(balance=[...]) so that every stage holds blocks with trainable weights."
        ) from error
