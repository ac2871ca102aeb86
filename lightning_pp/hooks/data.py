"""The strategy's part in loading data: which samples each rank loads (every stage of a pipeline the same batch, the
replicas their own shards), checked where Lightning hands over the DataLoaders and the batches (see
:mod:`lightning_pp.model.batches`)."""

from __future__ import annotations

import os
from abc import abstractmethod
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ParallelStrategy
from typing_extensions import override

from lightning_pp.model.batches import refuse_wrong_sampler

__all__ = ["PipelineDataHooks"]


class PipelineDataHooks(ParallelStrategy):
    """The DataLoader and batch hooks of :class:`~lightning_pp.strategy.PipelineParallelStrategy`."""

    _session: Any  # this rank's StageSession during a run
    _sampler_seed: int | None = None  # global rank 0's seed, for Lightning's DistributedSampler on every rank

    @property
    @abstractmethod
    def num_replicas(self) -> int: ...

    @property
    @abstractmethod
    def replica(self) -> int: ...

    @property
    def is_distributed(self) -> bool:
        # one replica: the user's DataLoader stays as it is (no always-shuffling DistributedSampler; every step leaves
        # the CPU generator as it found it, so stages shuffle alike) and `sync_dist` is a no-op, as on one device
        return self.num_replicas > 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every stage of a pipeline loads the same samples: shard over the replicas only, shuffled with one seed
        kwargs: dict[str, Any] = {"num_replicas": self.num_replicas, "rank": self.replica}
        if self._sampler_seed is not None:
            kwargs["seed"] = self._sampler_seed
        return kwargs

    def agree_sampler_seed(self, group: Any) -> None:
        """Take global rank 0's seed for Lightning's DistributedSampler (by default each rank's ``PL_GLOBAL_SEED``,
        which code seeding every rank differently, ``seed_everything(seed + rank)``, makes differ: the stages of a
        pipeline would shuffle apart). ``group``: a gloo group of every rank (None: the default group)."""
        seed = [int(os.environ.get("PL_GLOBAL_SEED", 0))]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(seed, src=0, group=group)
        self._sampler_seed = seed[0]

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Refuse a DistributedSampler of the user's that does not shard over the replicas (before any step)."""
        stage = self.lightning_module.trainer.state.stage if self.lightning_module is not None else None
        refuse_wrong_sampler(dataloader, self.num_replicas, self.replica, getattr(stage, "dataloader_prefix", None)
                             or "a", self.global_rank)
        return dataloader

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        if self._session is not None:  # fingerprinted on the host, before it moves (see lightning_pp.model.batches)
            self._session.batches.note(batch)
        return super().batch_to_device(batch, device, dataloader_idx)
