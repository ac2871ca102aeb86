"""The strategy's collectives as Lightning calls them (``sync_dist``, torchmetrics, callbacks): over the data-parallel
replicas of a stage, as DDP over its ranks, or over every rank of the job where all must agree."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import ReduceOp
from lightning.pytorch.strategies import ParallelStrategy
from torch import Tensor
from typing_extensions import override

from lightning_pp import _compat
from lightning_pp.parallel.topology import broadcast_object

__all__ = ["ReplicaCollectives"]


class ReplicaCollectives(ParallelStrategy):
    """What :class:`~lightning_pp.strategy.PipelineParallelStrategy` reduces, gathers and agrees on, and where."""

    object_group: Any  # a gloo group over the world for object collectives (None: the default group)
    _session: Any  # this rank's StageSession during a run

    @property
    @abstractmethod
    def num_replicas(self) -> int: ...

    @property
    @abstractmethod
    def _world(self) -> int: ...

    @override
    def barrier(self, name: str | None = None) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return broadcast_object(obj, src, self.object_group)

    def _replicas_group(self) -> Any:
        assert self._session is not None
        return self._session.assembly.groups.replicas

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None,
               reduce_op: ReduceOp | str | None = "mean") -> Tensor | Any:
        """Reduce over the data-parallel replicas (``group`` None), as DDP over its ranks: every stage holds its
        replica's value (the last stage's, replayed), so ``sync_dist=True`` and torchmetrics see one per replica."""
        if not isinstance(tensor, Tensor) or (group is None and self.num_replicas == 1):
            return tensor
        return _compat._sync_ddp_if_available(tensor, group or self._replicas_group(), reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Gather over the data-parallel replicas (``group`` None): one entry per replica, as DDP gives one per rank;
        with one replica the tensor itself, as on one device."""
        if group is None and self.num_replicas == 1:
            return tensor
        return super().all_gather(tensor, group=group or self._replicas_group(), sync_grads=sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Agree over every rank of the job (every stage of every replica), e.g. on stopping early."""
        votes = torch.tensor(int(decision), device=self.root_device)
        if self._world > 1:
            votes = _compat._sync_ddp_if_available(votes, None, reduce_op="sum")
        return bool(votes == self._world) if all else bool(votes)
