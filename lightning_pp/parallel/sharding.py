"""Sharded weights: a stage's blocks sharded over its data-parallel replicas with torch's FSDP2
(``data_parallel_mode="fsdp"``), each block its own ``fully_shard`` unit on the replicas' mesh, and the FSDP2 units and
tensor-parallel plans a module applies itself in ``configure_model`` (checked by :func:`check_user_sharding`, units
adopted by :meth:`BlockSharding.adopt_units`). The schedule's backwards accumulate unsharded gradients without
communication, and :meth:`BlockSharding.reduce_grads` reduce-scatters them once per optimizer step, as
torch.distributed.pipelining does. Full checkpoints see whole tensors: :func:`full_tensors` gathers a sharded state,
:func:`shard_like` cuts a whole one to this rank's shard."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_pp import _compat
from lightning_pp.errors import PipelineConfigError

__all__ = ["BlockSharding", "check_user_sharding", "fsdp_units", "full_tensors", "is_sharded_module", "local",
           "placed_like", "shard_like", "sharded_over_replicas", "shared_block_weights"]


def sharded_over_replicas(tensor: Any) -> bool:
    """Whether ``tensor`` is sharded over the data-parallel replicas (by FSDP2; its mesh may also be
    tensor-parallel): its gradient is reduce-scattered, not all-reduced."""
    return isinstance(tensor, DTensor) and "data_parallel" in (tensor.device_mesh.mesh_dim_names or ())


def local(tensor: Tensor) -> Tensor:
    """This rank's part of ``tensor`` (a DTensor's local shard, a view: writing to it writes to the DTensor), or
    ``tensor`` itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def placed_like(grad: Tensor, tensor: Tensor) -> Tensor:
    """``grad`` laid out as ``tensor``: a DTensor's gradient may come out otherwise placed (partial sums), and what is
    sent back upstream must match what was sent down."""
    if isinstance(grad, DTensor) and isinstance(tensor, DTensor) and grad.placements != tensor.placements:
        return grad.redistribute(tensor.device_mesh, tensor.placements)
    return grad


def is_sharded_module(module: nn.Module | None) -> bool:
    return module is not None and any(isinstance(p, DTensor) for p in module.parameters())


def fsdp_units(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The FSDP2 units in ``module`` (``fully_shard`` applied), outermost first."""
    from torch.distributed.fsdp import FSDPModule

    def is_unit(sub: nn.Module) -> bool:
        return issubclass(type(sub), FSDPModule)  # the type: a stand-in shows its block's class to isinstance

    return [(name, sub) for name, sub in module.named_modules() if is_unit(sub)]


def mixed_precision_policy(precision: str) -> Any:
    """FSDP2's mixed-precision policy for Lightning's ``precision``: with ``"bf16-mixed"`` / ``"16-mixed"`` a unit
    gathers its weights in that dtype for the passes (half the bytes of fp32) and reduce-scatters gradients in fp32,
    as autocast computes from fp32 weights; for the other precisions (fp32, or a module converted whole) no casts."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype is not None else None)


class BlockSharding:
    """FSDP2 over ``mesh`` (the stage's replicas, a 1-D DeviceMesh): the blocks passed to :meth:`shard`, and the units
    the module applied itself in ``configure_model`` (:meth:`adopt`)."""

    def __init__(self, mesh: Any, shard_blocks: bool = True, precision: str = "32-true") -> None:
        self.mesh = mesh
        self.shard_blocks = shard_blocks  # whether blocks the module did not shard itself are sharded
        self.blocks: list[nn.Module] = []  # the units reduced at the optimizer step: none inside another
        self.mp_policy = mixed_precision_policy(precision)
        self.adopted_outside = False  # whether the module sharded weights outside the blocks itself

    @classmethod
    def over(cls, job_mesh: Any, shard_blocks: bool, module: nn.Module, precision: str) -> BlockSharding | None:
        """Sharding over the ``"data_parallel"`` dimension of the job's mesh: of the blocks (``shard_blocks``, with
        more than one replica; Lightning's ``precision`` as FSDP2's mixed-precision policy) and of the units
        ``module`` applied itself; None where there is neither (or no mesh)."""
        if job_mesh is None:
            return None
        shard_blocks = shard_blocks and job_mesh["data_parallel"].size() > 1
        if not shard_blocks and not fsdp_units(module):
            return None
        return cls(job_mesh["data_parallel"], shard_blocks, precision)

    def shard(self, block: nn.Module, last: Callable[[Any], bool]) -> None:
        """Make ``block`` an FSDP2 unit whose backwards only accumulate (see :meth:`reduce_grads`). Its forward hooks
        for which ``last(hook)`` holds (the pipeline's: the end of a stage stops the step) run after FSDP's."""
        from torch.distributed.fsdp import fully_shard

        fully_shard(block, mesh=self.mesh, mp_policy=self.mp_policy)
        self.adopt(block, last, initialize=False)  # every replica runs it each step: its first forward initializes it

    def adopt_units(self, module: nn.Module, last: Callable[[Any], bool], within: str | None = None,
                    outside: str | None = None) -> bool:
        """:meth:`adopt` the FSDP2 units ``module`` applied itself in its submodule ``within``, or outside its
        submodule ``outside``; whether there were any."""
        units = fsdp_units(module)

        def inside(name: str, part: str) -> bool:
            return part == "" or name == part or name.startswith(part + ".")

        chosen = [(name, unit) for name, unit in units
                  if (within is None or inside(name, within)) and (outside is None or not inside(name, outside))]
        for name, unit in chosen:
            self.adopt(unit, last, outermost=not any(inside(name, other) for other, _ in units if other != name))
        if outside is not None:
            self.adopted_outside = bool(chosen)
        return bool(chosen)

    def adopt(self, unit: nn.Module, last: Callable[[Any], bool], outermost: bool = True,
              initialize: bool = True) -> None:
        """Run the FSDP2 unit ``unit`` as :meth:`shard` runs its own (``outermost``: not inside another unit, so that
        :meth:`reduce_grads` reduces it; ``initialize``: now, as a root, since it may not run on every replica)."""
        _compat.move_forward_hooks_last(unit, last)
        # a weight unused on one replica (data-dependent routing) still takes part in the reduce-scatter, with zeros
        unit.set_reduce_scatter_unused_params(True)  # type: ignore[operator]
        self._accumulate_only(unit)
        if outermost:
            if initialize:
                _compat.init_fsdp_root(unit)
            self.blocks.append(unit)

    def shard_outside(self, modules: list[tuple[str, nn.Module]], bare: list[nn.Parameter],
                      optimizers: list[torch.optim.Optimizer], last: Callable[[Any], bool]) -> dict[int, nn.Parameter]:
        """Make ``modules`` (weights outside the blocks, innermost first; see
        :meth:`~lightning_pp.model.placement.WeightPlacement.shardable`) FSDP2 units run as the blocks' are, and the
        weights ``bare`` (held, not used) shards laid out as theirs, after a step's gradients were averaged whole: each
        gradient, and each optimizer's state and parameter lists, become this rank's shards. Returns the new parameters
        by ``id`` of those they replace (registering them in place of a bare weight is the caller's)."""
        from torch.distributed.fsdp import fully_shard

        replaced: dict[int, nn.Parameter] = {}
        grads: list[tuple[nn.Parameter, Tensor | None]] = []
        for p in bare:
            shard = distribute_tensor(p.detach(), self.mesh, [Shard(0)], src_data_rank=None)
            replaced[id(p)] = nn.Parameter(shard, requires_grad=p.requires_grad)
            grads.append((replaced[id(p)], p.grad))
        for path, module in modules:
            before = {name: p for name, p in module.named_parameters() if not isinstance(p, DTensor)}
            fully_shard(module, mesh=self.mesh, mp_policy=self.mp_policy)
            after = dict(module.named_parameters())
            for name, old in before.items():
                replaced[id(old)] = after[name]
                grads.append((after[name], old.grad))
            inner = any(path.startswith(other + ".") for other, _ in modules if other)
            self.adopt(module, last, outermost=not inner)
        with torch.no_grad():
            for new, grad in grads:
                new.grad = shard_like(grad, new) if grad is not None else None
        for optimizer in optimizers:
            olds = {id(p): p for group in optimizer.param_groups for p in group["params"] if id(p) in replaced}
            for group in optimizer.param_groups:
                group["params"] = [replaced.get(id(p), p) for p in group["params"]]
            for key, old in olds.items():
                new, state = replaced[key], optimizer.state.pop(old, None)
                if state is not None:  # a checkpoint's, restored before the first step
                    optimizer.state[new] = {k: shard_like(v, new) if isinstance(v, Tensor) and v.shape == old.shape
                                            else v for k, v in state.items()}
        return replaced

    @staticmethod
    def _accumulate_only(block: Any) -> None:
        # unsharded weights stay gathered between the step's backwards, as torch.distributed.pipelining keeps them
        block.set_is_last_backward(False)
        block.set_reshard_after_backward(False)
        block.set_requires_gradient_sync(False)

    def reshard(self) -> None:
        """Free the gathered weights (no communication), so that between steps a replica holds its shards only: after
        an evaluation loop, whose passes leave them gathered (each block is its own FSDP root)."""
        for block in self.blocks:
            block.reshard()  # type: ignore[operator]

    def reduce_grads(self) -> None:
        """Reduce-scatter what the step's backwards accumulated (each replica's shard gets the replicas' mean, as DDP
        averages) and reshard the weights; then back to accumulating."""
        for block in self.blocks:
            _compat.reduce_fsdp_grads(block)
            self._accumulate_only(block)


def full_tensors(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with every sharded tensor gathered whole, on the CPU (a collective over its mesh: every replica of the
    stage calls it, in the same order); nested dicts (an optimizer's per-parameter state) too."""
    def whole(value: Any) -> Any:
        if isinstance(value, DTensor):
            return value.full_tensor().cpu()  # one whole tensor on the device at a time
        if isinstance(value, Mapping):
            return {k: whole(v) for k, v in value.items()}
        return value

    return {k: whole(v) for k, v in state.items()}


def shard_like(value: Tensor, like: Any) -> Tensor:
    """``value`` (whole, the same on every replica) as this rank's shard of ``like``'s layout; other values as they
    are. No communication: each rank cuts its own shard."""
    if not isinstance(like, DTensor) or isinstance(value, DTensor):
        return value
    return distribute_tensor(value.to(like.device, like.dtype), like.device_mesh, like.placements, src_data_rank=None)


def check_user_sharding(module: nn.Module, tensor_parallel_size: int) -> None:
    """Before any collective (every rank ran the same ``configure_model``): sharding the pipeline cannot run is our
    error. FSDP2 units and DTensor parameters must be on the job's mesh (``"data_parallel"``,
    ``"tensor_parallel"``, or both); FSDP1 is refused; ``tensor_parallel_size > 1`` needs a tensor-parallel plan."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    for name, sub in module.named_modules():
        if isinstance(sub, FullyShardedDataParallel):
            raise PipelineConfigError(
                f"`{name or type(module).__name__}` is wrapped in FSDP1 (FullyShardedDataParallel). Shard with FSDP2 "
                f"(fully_shard(..., mesh=self.device_mesh['data_parallel'])) in configure_model, or pass "
                f"PipelineParallelStrategy(data_parallel_mode='fsdp'), which shards each stage's blocks itself.")
    meshes = {name: p.device_mesh.mesh_dim_names for name, p in module.named_parameters() if isinstance(p, DTensor)}
    other = [f"{name} (mesh {dims})" for name, dims in meshes.items()
             if dims not in (("data_parallel",), ("tensor_parallel",), ("data_parallel", "tensor_parallel"))]
    if other:
        raise PipelineConfigError(
            f"Parameters {other[:3]} are DTensors on a mesh other than the strategy's. In configure_model, apply "
            f"tensor parallelism with parallelize_module(block, self.device_mesh['tensor_parallel'], plan) and FSDP2 "
            f"with fully_shard(module, mesh=self.device_mesh['data_parallel']) (or let "
            f"PipelineParallelStrategy(data_parallel_mode='fsdp') shard the blocks).")
    if tensor_parallel_size > 1 and not any("tensor_parallel" in (dims or ()) for dims in meshes.values()):
        raise PipelineConfigError(
            f"tensor_parallel_size={tensor_parallel_size}, but the module applies no tensor-parallel plan: no "
            f"parameter is split over the tensor-parallel ranks, so each of the {tensor_parallel_size} would compute "
            f"its stage whole. In configure_model, call parallelize_module(block, self.device_mesh['tensor_parallel'], "
            f"plan) for each block (as for Lightning's ModelParallelStrategy), or use tensor_parallel_size=1.")


def shared_block_weights(blocks: list[tuple[str, nn.Module]], outside: list[nn.Parameter]) -> str | None:
    """Each block is its own FSDP2 unit, so a weight two of a stage's blocks share (or a block listed twice) would be
    sharded twice and trained as two weights: what says so (None: no such weight). The split already refuses sharing
    across stages and with the weights outside the blocks."""
    owner: dict[int, str] = {}
    outside_ids = {id(p) for p in outside}
    for name, block in blocks:
        for p in block.parameters():
            first = owner.setdefault(id(p), name)
            if first != name or id(p) in outside_ids:
                return (f"`{name}` shares a weight with `{first}`; with data_parallel_mode='fsdp' each block is "
                        f"sharded on its own, so blocks cannot share weights. Use data_parallel_mode='ddp', or tie the "
                        f"weight outside "
                        f"the blocks.")
    return None
