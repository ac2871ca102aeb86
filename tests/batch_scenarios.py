"""Batches as users load them (text fields, dataclasses) and loaders that give the stages different batches: the
modules, their data, and what a rank of the multi-process tests runs (``"batch_scenarios:<name>"``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

# read at import: Lightning's environment deletes WORLD_SIZE at teardown (a launch's first run imports this module)
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))


class TextDataset(Dataset):
    """Features, a class and a text whose length varies by sample (a collated text field is a list of strings)."""

    def __init__(self, n: int = 32, seed: int = 1234) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 10, generator=generator)
        self.y = torch.randint(0, 5, (n,), generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "y": self.y[i], "text": "word " * (1 + i % 5)}


class _MLP(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(10, 16)
        self.layers = nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 16), nn.Tanh())
        self.head = nn.Linear(16, 5)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(torch.relu(self.inp(x))))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class CountsTexts(_MLP):
    """Weights each sample by its text's length and divides by ``len(batch["text"])``: the batch size as its list of
    strings tells it."""

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        weights = torch.tensor([len(text.split()) for text in batch["text"]], dtype=torch.float32)
        losses = nn.functional.cross_entropy(self.logits(batch["x"]), batch["y"], reduction="none")
        loss = (losses * weights).sum() / len(batch["text"])
        self.log("train_loss", loss)
        return loss


@dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    names: list[str]


def collate_batch(samples: list[dict[str, Any]]) -> Batch:
    return Batch(torch.stack([s["x"] for s in samples]), torch.stack([s["y"] for s in samples]),
                 [s["text"] for s in samples])


class ReadsADataclass(_MLP):
    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        loss = nn.functional.cross_entropy(self.logits(batch.x), batch.y, reduction="sum") / len(batch.names)
        self.log("train_loss", loss)
        return loss


class Plain(_MLP):
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss = nn.functional.cross_entropy(self.logits(batch["x"]), batch["y"])
        self.log("train_loss", loss)
        return loss


def loader(kind: str, rank: int = 0, world: int = 1) -> DataLoader:
    """``text`` / ``dataclass``: the same batches everywhere; ``own_distributed_sampler``: a DistributedSampler over
    the whole world; ``shuffled_by_rank``: a shuffle seeded by the rank; ``fewer_on_rank_1``: 3 batches on rank 1, 4
    elsewhere."""
    dataset = TextDataset()
    if kind == "dataclass":
        return DataLoader(dataset, batch_size=8, collate_fn=collate_batch)
    if kind == "own_distributed_sampler":
        return DataLoader(dataset, batch_size=8, sampler=DistributedSampler(dataset, num_replicas=world, rank=rank))
    if kind == "shuffled_by_rank":
        return DataLoader(dataset, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(rank))
    if kind == "fewer_on_rank_1":
        return DataLoader(Subset(dataset, range(24 if rank == 1 else 32)), batch_size=8)
    return DataLoader(dataset, batch_size=8)


MODULES = {"text": CountsTexts, "dataclass": ReadsADataclass}


def fit(kind: str, strategy: Any = "auto", devices: int = 1, rank: int = 0, world: int = 1) -> dict[str, Any]:
    """Train 4 steps (one epoch) on ``loader(kind)``; this rank's weights and the losses logged."""
    L.seed_everything(7, verbose=False)
    module = MODULES.get(kind, Plain)()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader(kind, rank, world))
    return {"state": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "loss": float(trainer.callback_metrics.get("train_loss", float("nan")))}


def train(kind: str, catch: bool = False, **strategy: Any) -> dict[str, Any]:
    """One rank of a 2-stage pipeline (``launch``); with ``catch`` the error is returned rather than raised."""
    from lightning_pp import PipelineParallelStrategy

    rank = int(os.environ["LOCAL_RANK"])
    try:
        return fit(kind, PipelineParallelStrategy(**{"transfer_timeout": 30, **strategy}), devices=WORLD_SIZE,
                   rank=rank, world=WORLD_SIZE)
    except Exception as error:
        if not catch:
            raise
        return {"type": type(error).__name__, "message": str(error)}
