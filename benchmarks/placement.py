"""Memory and gradient traffic of the weights outside the blocks: ``outside_weights="everywhere"`` against
``"where_used"`` (the default), on CPU with gloo.

Run ``python benchmarks/placement.py`` (``--models vgg11 gpt2``, ``--stages 2 4``, ``--steps 4``). For each model,
stage count and mode it trains the LightningModule with ``L.Trainer(devices=p, strategy=PipelineParallelStrategy(
schedule="1f1b", microbatches=4, outside_weights=...))`` in ``p`` processes (one CPU thread each) and prints, per stage:
the parameters it holds, the optimizer state it holds (AdamW), the gradient bytes it all-reduces per optimizer step,
and the median step time (the window from one ``on_train_batch_start`` to the next, the first step left out: it is
the observed step).

- ``vgg11``: VGG11 as torchvision builds it (8 convolutions in ``features``, the blocks; average pooling to 7 x 7; a
  classifier of 25088 x 4096, 4096 x 4096 and 4096 x 1000, 123.6M of its 132.9M weights, outside the blocks) on
  32 x 32 images, batch 8.
- ``gpt2``: Hugging Face ``GPT2LMHeadModel`` with GPT-2 small's configuration (12 layers of width 768, a vocabulary of
  50257 whose embedding is tied to the head; 124M weights), random init, sequences of 64 random tokens, batch 8.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import lightning as L
import torch
from _workers import answer_as_worker, run_workers  # beside this script
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pp import PipelineParallelStrategy

MIB = 2**20


class VGG11(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for width in (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"):
            if width == "M":
                layers[-1] = nn.Sequential(layers[-1], nn.MaxPool2d(2))  # each block: conv, ReLU (and pooling)
            else:
                layers.append(nn.Sequential(nn.Conv2d(channels, int(width), 3, padding=1), nn.ReLU()))
                channels = int(width)
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(nn.Linear(512 * 7 * 7, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                                        nn.Linear(4096, 1000))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        logits = self.classifier(torch.flatten(self.avgpool(self.features(images)), 1))
        loss = nn.functional.cross_entropy(logits, labels)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def data(self) -> TensorDataset:
        return TensorDataset(torch.randn(64, 3, 32, 32), torch.randint(1000, (64,)))


class GPT2(L.LightningModule):
    """Hugging Face GPT-2 (vocabulary 50257, head tied to the embedding), random init, AdamW."""

    def __init__(self, layers: int = 12, width: int = 768) -> None:  # GPT-2 small by default
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        self.model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=width, n_head=width // 64))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch[0], labels=batch[0]).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def data(self) -> TensorDataset:
        return TensorDataset(torch.randint(50257, (64, 64)))


MODELS: dict[str, tuple[type[VGG11] | type[GPT2], str]] = {"vgg11": (VGG11, "features"),
                                                            "gpt2": (GPT2, "model.transformer.h")}


class Meter(L.Callback):
    """Per rank: step windows, parameter and optimizer bytes held, gradient bytes all-reduced per step."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.sync_bytes: list[int] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        self.starts.append(time.perf_counter())

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.sync_bytes.append(trainer.strategy.telemetry.last_grad_sync_bytes)  # type: ignore[attr-defined]

    def summary(self, trainer: L.Trainer, module: L.LightningModule) -> dict[str, float]:
        params = {id(p): p for p in module.parameters()}.values()
        optimizer = trainer.optimizers[0]
        state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor) and t.dim() > 0)
        windows = [b - a for a, b in zip(self.starts[1:], self.starts[2:], strict=False)]
        return {"params_mib": sum(p.numel() * p.element_size() for p in params) / MIB, "optimizer_mib": state / MIB,
                "allreduce_mib": self.sync_bytes[-1] / MIB, "step_s": statistics.median(windows)}


def worker(spec: dict[str, Any]) -> list[Any]:
    """Train the spec's model with its ``outside_weights`` mode on this process's rank; every rank's figures (global
    rank 0's are reported)."""
    torch.set_num_threads(1)
    model_class, blocks = MODELS[spec["model"]]
    L.seed_everything(0, verbose=False)
    module: VGG11 | GPT2 = model_class()
    meter = Meter()
    trainer = L.Trainer(accelerator="cpu", devices=spec["stages"], max_steps=spec["steps"] + 2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[meter], strategy=PipelineParallelStrategy(
                            schedule="1f1b", microbatches=4, blocks=blocks, outside_weights=spec["mode"]))
    trainer.fit(module, DataLoader(module.data(), batch_size=8))
    gathered: list[Any] = [None] * spec["stages"]
    torch.distributed.all_gather_object(gathered, meter.summary(trainer, module))
    return gathered


def run(model: str, stages: int, mode: str, steps: int) -> list[dict[str, float]]:
    spec = {"model": model, "stages": stages, "mode": mode, "steps": steps}
    return run_workers(__file__, stages, spec, timeout=1800)  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--stages", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--steps", type=int, default=4, help="timed steps (after the observed one)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        answer_as_worker(args.worker, worker)
        return
    print("| model | stages | outside_weights | params MiB per stage | AdamW state MiB per stage "
          "| all-reduced MiB per step per stage | step s |")
    print("|---|---|---|---|---|---|---|")
    for model in args.models:
        for stages in args.stages:
            for mode in ("everywhere", "where_used"):
                rows = run(model, stages, mode, args.steps)

                def column(key: str, rows: list[dict[str, float]] = rows) -> str:
                    return " / ".join(f"{row[key]:.0f}" for row in rows)

                step = max(row["step_s"] for row in rows)
                print(f"| {model} | {stages} | {mode} | {column('params_mib')} | {column('optimizer_mib')} "
                      f"| {column('allreduce_mib')} | {step:.2f} |", flush=True)


if __name__ == "__main__":
    main()
