"""Gradients across ranks: handed over from the schedule, the replicas' average, weights outside the blocks summed
over their holders (timed for the monitor on request), the global clipping norm and the fp16 inf/NaN verdict, which
replace Lightning's per-stage ones from setup to teardown (:meth:`PipelineGradients.install`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_pp import _compat
from lightning_pp.parallel.device import synchronize_stream
from lightning_pp.parallel.sharding import local, placed_like, sharded_over_replicas
from lightning_pp.parallel.topology import StageGroups

__all__ = ["PipelineGradients", "add_to_grads", "broadcast_tensors"]


def _coalesced(tensors: Iterable[Tensor]) -> dict[torch.dtype, list[Tensor]]:
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    return by_dtype


def _through_one_collective(tensors: list[Tensor], collective: Callable[[Tensor], object],
                            device: torch.device) -> list[Tensor]:
    """Run ``collective`` in place on one flat copy of ``tensors`` (one dtype); return its pieces, shaped like them."""
    flat = torch.cat([t.detach().reshape(-1).to(device) for t in tensors])
    collective(flat)
    pieces, offset = [], 0
    for t in tensors:
        pieces.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return pieces


def broadcast_tensors(tensors: Iterable[Tensor], src: int, group: Any, device: torch.device) -> None:
    """Give every rank of ``group`` rank ``src``'s values of ``tensors``, as DDP does at start: ranks seeded
    differently would otherwise each train their own copy. One broadcast per dtype."""
    with torch.no_grad():
        for same_dtype in _coalesced(local(t) for t in tensors if t.numel() > 0).values():
            values = _through_one_collective(same_dtype, lambda flat: dist.broadcast(flat, src=src, group=group),
                                             device)
            for t, value in zip(same_dtype, values, strict=True):
                t.copy_(value)


class PipelineGradients:
    """What the optimizer step needs beyond one rank.

    ``outside`` are the weights outside the blocks. Each is held by the pipeline positions in ``users[id(weight)]``
    (every position where absent: before :class:`~lightning_pp.model.placement.WeightPlacement` decides, or when all
    use it): its gradient is summed over those positions (a weight tied between the first and the last stage gets
    both parts) and averaged over the replicas, in ``sharing_groups[positions]`` (``shard_peers`` when every position
    holds it), by local shards under tensor parallelism. The stage's own parameters (its blocks) are averaged over the
    replicas holding the same shard, as DDP averages; weights sharded over the replicas (FSDP2) are reduce-scattered
    by their units instead. All in buckets of at most ``bucket_bytes``, each all-reduced while the next is packed.
    """

    def __init__(self, outside: list[nn.Parameter], groups: StageGroups, device: torch.device,
                 bucket_bytes: int = 25 * 2**20) -> None:
        self.outside = {id(p) for p in outside}
        self.groups = groups
        self.device = device
        self.bucket_bytes = bucket_bytes
        self.users: dict[int, frozenset[int]] = {}
        self.sharing_groups: dict[frozenset[int], Any] = {}  # those this rank belongs to
        self.sharing_sets: set[frozenset[int]] = set()  # every set with a group (created by every rank)
        self.lane_sharing_groups: dict[frozenset[int], Any] = {}  # the same along this rank's lane only
        self.lane_sharing_sets: set[frozenset[int]] = set()
        self.every_position = frozenset(range(groups.layout.num_stages))
        self.last_bytes = 0  # gradient bytes this rank all-reduced in the latest synchronize
        self._installed: list[Callable[[], None]] = []  # what puts back what install replaced

    def install(self, precision_plugin: Any, scaler: torch.amp.GradScaler | None) -> None:
        """Route Lightning's norm clipping through :meth:`clip_by_global_norm` (Lightning clips by the norm of this
        stage's gradients; the right norm spans every stage), its value clipping through :func:`clip_by_value` (torch's
        cannot mix sharded and whole gradients) and the fp16 scaler's unscale through
        :meth:`unscale_agreeing` (a stage that finds inf/NaN must make every stage skip the step and back off the
        scale alike), until :meth:`uninstall`."""
        self._installed.append(_replace(precision_plugin, "clip_grad_by_norm", lambda optimizer, clip_val: (
            self.clip_by_global_norm(precision_plugin.main_params(optimizer), clip_val))))
        self._installed.append(_replace(precision_plugin, "clip_grad_by_value", lambda optimizer, clip_val: (
            clip_by_value(precision_plugin.main_params(optimizer), clip_val))))
        if scaler is not None:
            local_unscale = scaler.unscale_
            self._installed.append(_replace(scaler, "unscale_", lambda optimizer: (
                self.unscale_agreeing(scaler, local_unscale, optimizer))))

    def uninstall(self) -> None:
        """Put back what :meth:`install` replaced."""
        while self._installed:
            self._installed.pop()()

    def positions_of(self, p: nn.Parameter) -> frozenset[int]:
        """The pipeline positions holding ``p``."""
        if id(p) not in self.outside:
            return frozenset({self.groups.stage})
        return self.users.get(id(p), self.every_position)

    def synchronize(self, params: Iterable[nn.Parameter], timed: bool = False) -> float:
        """Once per optimizer step, after the last backward: make every gradient the one the optimizer should apply.

        Which parameters take part is decided from ``grad`` every step (so weights frozen or unfrozen during
        training, as ``BackboneFinetuning`` does, are followed) and agreed on by every rank of the collective: a
        parameter whose gradient exists on one rank only gets zeros elsewhere. Every rank runs its collectives in
        one global order of the holding position sets, so no two ranks wait on each other in opposite orders.

        Returns the milliseconds it took when ``timed`` (the current stream's queue emptied before and after, so the
        clock reads the collectives alone: the stream waits for them), else 0. Not the whole device's: that would wait
        for NCCL's streams too, where ``pipedream_2bw``'s last send of the step waits for the peer's next step, which
        the peer may start only after these collectives, which wait for this rank.
        """
        if not timed:
            self._synchronize(params)
            return 0.0
        synchronize_stream(self.device)
        started = time.perf_counter()
        self._synchronize(params)
        synchronize_stream(self.device)
        return 1e3 * (time.perf_counter() - started)

    def _synchronize(self, params: Iterable[nn.Parameter]) -> None:
        layout = self.groups.layout
        replicas = layout.num_replicas
        self.last_bytes = 0
        if layout.world_size == 1:
            return
        by_positions: dict[frozenset[int], list[nn.Parameter]] = {}
        # outside the blocks, reduce-scattered over the replicas by FSDP2 units: summed along the lane by their holders
        sharded_outside: dict[frozenset[int], list[nn.Parameter]] = {}
        for p in params:
            if isinstance(p.grad, DTensor) and not sharded_over_replicas(p):
                # a replicated tensor-parallel weight (a sequence-parallel norm's) gets partial sums: summed here, over
                # its tensor-parallel ranks (a collective of theirs, in parameter order)
                p.grad = placed_like(p.grad, p)
            if sharded_over_replicas(p):
                if id(p) in self.outside and len(self.positions_of(p)) > 1:
                    sharded_outside.setdefault(self.positions_of(p), []).append(p)
                continue
            by_positions.setdefault(self.positions_of(p), []).append(p)
        for positions in sorted(sharded_outside, key=lambda s: (-len(s), sorted(s))):
            group = self.groups.pipeline if positions == self.every_position else self.lane_sharing_groups[positions]
            self._all_reduce(self._used(sharded_outside[positions], group), group, 1)
        for positions in sorted(by_positions, key=lambda s: (-len(s), sorted(s))):
            if len(positions) == 1:
                if replicas > 1:
                    group = self.groups.replicas
                    self._all_reduce(self._used(by_positions[positions], group), group, replicas)
                continue
            group = self.groups.shard_peers if positions == self.every_position else self.sharing_groups[positions]
            self._all_reduce(self._used(by_positions[positions], group), group, replicas)

    def _used(self, params: list[nn.Parameter], group: Any) -> list[nn.Parameter]:
        """The parameters with a gradient on at least one rank of ``group``."""
        has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=self.device)
        dist.all_reduce(has_grad, group=group)
        return [p for p, n in zip(params, has_grad.tolist(), strict=True) if n > 0]

    def _all_reduce(self, params: list[nn.Parameter], group: Any, replicas: int) -> None:
        """Sum ``params``' gradients over ``group``, each divided by ``replicas`` first (as DDP does); a tensor-parallel
        gradient by its local shard."""
        pending = []
        for bucket in self._buckets(params):
            grads = [local(p.grad) if p.grad is not None else torch.zeros_like(local(p)) for p in bucket]
            flat = torch.cat([g.detach().reshape(-1) for g in grads])
            if replicas > 1:
                flat.div_(replicas)
            self.last_bytes += flat.numel() * flat.element_size()
            pending.append((bucket, flat, dist.all_reduce(flat, group=group, async_op=True)))
        for bucket, flat, work in pending:
            work.wait()
            offset = 0
            for p in bucket:
                shard = local(p)
                value = flat[offset : offset + shard.numel()].view_as(shard).clone()
                p.grad = _like(p, value)
                offset += shard.numel()

    def _buckets(self, params: list[nn.Parameter]) -> Iterator[list[Tensor]]:
        for same_dtype in _coalesced(params).values():
            bucket: list[Tensor] = []
            size = 0
            for p in same_dtype:
                if bucket and size + local(p).numel() * p.element_size() > self.bucket_bytes:
                    yield bucket
                    bucket, size = [], 0
                bucket.append(p)
                size += local(p).numel() * p.element_size()
            if bucket:
                yield bucket

    def replace_weights(self, replacements: dict[int, nn.Parameter], users: dict[int, frozenset[int]]) -> None:
        """Follow weights outside the blocks replaced by new objects (``id`` of the old one -> the new one), held as
        ``users`` (the placement's, keyed by the new ones) says."""
        self.outside = {id(replacements[key]) if key in replacements else key for key in self.outside}
        self.users = users

    def clip_by_global_norm(self, params: Iterable[nn.Parameter], clip_val: float) -> None:
        """``clip_grad_norm_`` over the whole pipeline: squared norms summed over stages, each weight counted once (by
        the first position holding it; after :meth:`synchronize`, so its holders and replicas agree). A sharded
        gradient (FSDP2, tensor parallelism) counts by its shards, summed over its mesh, each shard once."""
        grads = [(p, p.grad) for p in params if p.grad is not None]
        squared = torch.zeros((), dtype=torch.float64, device=self.device)
        by_mesh: dict[Any, Tensor] = {}  # the squared norms of sharded gradients, per mesh, to be summed over it
        for p, grad in grads:
            if isinstance(grad, DTensor) and min(self.positions_of(p)) == self.groups.stage:
                copies = math.prod(grad.device_mesh.size(dim) for dim, placement in enumerate(grad.placements)
                                   if placement.is_replicate())
                share = torch.linalg.vector_norm(grad.to_local().detach(), dtype=torch.float64) ** 2 / copies
                mesh = grad.device_mesh
                by_mesh[mesh] = by_mesh.get(mesh, torch.zeros_like(squared)) + share
            elif not isinstance(grad, DTensor) and min(self.positions_of(p)) == self.groups.stage:
                squared += torch.linalg.vector_norm(grad.detach(), dtype=torch.float64) ** 2
        for mesh, share in sorted(by_mesh.items(), key=lambda item: item[0].mesh_dim_names or ()):
            for dim in range(mesh.ndim):  # summed over every dimension: over the whole mesh
                dist.all_reduce(share, group=mesh.get_group(dim))
            squared += share
        if self.groups.layout.num_stages > 1:  # the lanes hold the same norm: the norm of one pipeline
            dist.all_reduce(squared, group=self.groups.pipeline)
        scale = torch.clamp(clip_val / (squared.sqrt() + 1e-6), max=1.0)
        for _, grad in grads:
            local(grad).mul_(scale.to(grad.dtype))

    def unscale_agreeing(self, scaler: torch.amp.GradScaler, unscale: Callable[[Optimizer], None],
                         optimizer: Optimizer) -> None:
        """Unscale, then make the inf/NaN verdict the same on every rank (the max over the world). Sharded gradients
        (FSDP2, tensor parallelism) are unscaled by their local shards, after the whole ones: torch's unscale cannot
        take both in one call."""
        sharded = [p for group in optimizer.param_groups for p in group["params"] if isinstance(p.grad, DTensor)]
        grads = [p.grad for p in sharded]
        for p in sharded:
            p.grad = None
        try:
            unscale(optimizer)
        finally:
            for p, grad in zip(sharded, grads, strict=True):
                p.grad = grad
        if grads:
            _compat.unscale_local_grads(scaler, optimizer, [g.to_local() for g in grads], self.device)
        found = _compat._found_inf_per_device(scaler, optimizer)
        verdict = torch.zeros((), dtype=torch.float32, device=self.device)
        for value in found.values():
            verdict = torch.maximum(verdict, value.to(self.device).reshape(()))
        if self.groups.layout.world_size > 1:
            dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
        if not found:
            found[self.device] = verdict
        for value in found.values():
            value.copy_(verdict.to(value.device))


def _like(p: Tensor, value: Tensor) -> Tensor:
    """``value`` (this rank's part of ``p``'s gradient) as ``p``'s gradient: a DTensor laid out as ``p`` for a
    DTensor ``p``."""
    if not isinstance(p, DTensor):
        return value
    return DTensor.from_local(value, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)


def _replace(obj: Any, name: str, replacement: Callable[..., Any]) -> Callable[[], None]:
    """Set the attribute ``name`` of ``obj`` to ``replacement``; return what puts the previous one back (the class's
    method again, where the instance had none of its own)."""
    own = vars(obj)
    had, previous = name in own, own.get(name)
    setattr(obj, name, replacement)

    def restore() -> None:
        if had:
            setattr(obj, name, previous)
        else:
            delattr(obj, name)

    return restore


def enabled_scaler(precision_plugin: Any) -> torch.amp.GradScaler | None:
    """The precision plugin's gradient scaler when it scales (fp16), else None."""
    scaler = getattr(precision_plugin, "scaler", None)
    return scaler if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled() else None


def clip_by_value(params: Iterable[nn.Parameter], clip_val: float) -> None:
    """Clamp every gradient to ``[-clip_val, clip_val]`` (a sharded one by its local shard)."""
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clamp_(-clip_val, clip_val)


def add_to_grads(pending: Iterable[tuple[nn.Parameter, Tensor]]) -> None:
    """Hand the gradients a schedule computed to their parameters: the first becomes ``grad``, later ones add to it."""
    for p, grad in pending:
        if p.grad is None:
            p.grad = grad
        else:
            p.grad.add_(grad)
