"""The strategy's part in loading data: which samples each rank loads (every stage of a pipeline the same batch, the
replicas their own shards), checked where Lightning hands over the DataLoaders and the batches (see
:mod:`lightning_pp.model.batches`)."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch
from lightning.pytorch.strategies import ParallelStrategy
from typing_extensions import override

from lightning_pp.model.batches import refuse_wrong_sampler

__all__ = ["PipelineDataHooks"]


class PipelineDataHooks(ParallelStrategy):
    """The DataLoader and batch hooks of :class:`~lightning_pp.strategy.PipelineParallelStrategy`."""

    _session: Any  # this rank's StageSession during a run

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
        # every stage of a pipeline loads the same samples: shard over the replicas only
        return {"num_replicas": self.num_replicas, "rank": self.replica}

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
