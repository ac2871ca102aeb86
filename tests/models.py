"""The suite's models and the one run that trains them.

Every model a test trains is an entry of `MODELS` (a `Model`): how it is built, the data it is fed (a loader of
``loaders.py``, or none where the module brings its own loaders), how long it trains and what runs besides (a
checkpoint callback, its own callbacks, validate/test/predict after fit, a meta-device build). `fit` trains an entry the
same way for the single-device reference (``support.reference``) and for every rank of a multi-process job
(``scenarios.train`` and its DDP and ModelParallelStrategy siblings), with any strategy; its ``result`` is what the
comparisons of ``support.py`` compare, the same dictionary on both sides.

The modules here are written as a user would, with no pipeline in mind (small classifiers, tied weights, metrics,
failures on purpose, sleeping layers, tensor-parallel plans); those shaped like real models are in ``real_models.py``.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import real_models as real
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, ModelCheckpoint
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from loaders import features, random_tokens
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from torchmetrics import Metric


# --------------------------------------------------------------------------------------------------- what a run keeps
class RecordingLogger(Logger):
    """Keeps every `log_metrics` call in memory (Lightning calls it on global rank 0 only)."""

    def __init__(self) -> None:
        super().__init__()
        self.history: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.history.append((int(step or 0), {k: float(v) for k, v in metrics.items()}))


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor sharded over ranks (a DTensor: ``data_parallel_mode="fsdp"``, tensor parallelism) gathered whole (every
    rank holding a part calls it in the same order); any other tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local_numel(tensor: torch.Tensor) -> int:
    """The elements of ``tensor`` this rank holds (a DTensor's: its shard's)."""
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).numel()


class AppliedGradientRecorder(L.Callback):
    """Keeps, at every optimizer step, the gradients ``optimizer.step`` applied and the weights they were computed at.

    Lightning runs ``training_step`` and ``backward`` inside ``optimizer.step`` (its closure), so the weights are read
    by a step pre-hook (before the closure: the weights this step's gradients are computed at) and the gradients by a
    step post-hook (after the strategy summed the gradients of replicated weights, after clipping; the update leaves
    ``grad`` as it was). ``on_before_optimizer_step`` runs before clipping. Also the optimizers' classes (whether an
    adaptive one trained the weights).
    """

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []
        self.weights: list[dict[str, torch.Tensor]] = []
        self.optimizers: list[str] = []
        self._handles: list[Any] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.optimizers = [type(optimizer).__name__ for optimizer in trainer.optimizers]

        def record_weights(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            self.weights.append({n: whole(p).detach().clone() for n, p in pl_module.named_parameters()})

        def record_grads(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            self.grads.append({n: whole(p.grad).detach().clone() for n, p in pl_module.named_parameters()
                               if p.grad is not None})

        self._handles = [hook for optimizer in trainer.optimizers
                         for hook in (optimizer.register_step_pre_hook(record_weights),
                                      optimizer.register_step_post_hook(record_grads))]

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class LoadWeightsEachStep(L.Callback):
    """Sets the weights to ``weights[step]`` as each optimizer step starts, so that every step's gradients are
    computed at exactly those weights (whatever the optimizer did before): single-device gradients at the weights a
    pipelined run had, step by step."""

    def __init__(self, weights: list[dict[str, torch.Tensor]]) -> None:
        self.weights = weights

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        wanted = self.weights[trainer.global_step]  # the same for every batch an accumulated step sums
        with torch.no_grad():
            for name, parameter in pl_module.named_parameters():
                parameter.copy_(wanted[name])


class DelayedGradients(L.Callback):
    """PipeDream-2BW's update rule on one device, the reference of ``schedule="pipedream_2bw"``: each optimizer step
    applies the previous batch's gradient (the first step none), computed at the weights that batch's step started
    from: W_t = W_{t-1} - lr * grad f_{t-1}(W_{t-2})."""

    def __init__(self) -> None:
        self.previous: dict[int, torch.Tensor | None] = {}

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        for p in pl_module.parameters():
            p.grad, self.previous[id(p)] = self.previous.get(id(p)), p.grad


class BatchRecorder(L.Callback):
    """Keeps the first tensor of every training batch this rank loads: which samples each rank (replica) sees."""

    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.batches.append(batch[0].detach().cpu().clone())


class WeightDtypeRecorder(L.Callback):
    """The dtype each ``nn.Linear`` computes with: its weight's as its forward starts (FSDP2's mixed-precision policy
    gathers it in the low precision; under autocast alone it stays fp32)."""

    def __init__(self) -> None:
        self.dtypes: dict[str, str] = {}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for name, sub in pl_module.named_modules():
            if isinstance(sub, nn.Linear):
                sub.register_forward_pre_hook(self._record(name))

    def _record(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self.dtypes[name] = str(module.weight.dtype)

        return hook


# ------------------------------------------------------------------------------------ modules written as a user would
class MLPClassifier(L.LightningModule):
    """Input projection and head outside the sequential; hidden sizes change between layers (and stages)."""

    def __init__(self, in_features: int = 10, classes: int = 5) -> None:
        super().__init__()
        self.inp = nn.Linear(in_features, 16)
        self.layers = nn.Sequential(
            nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 12), nn.Tanh(),
            nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 16), nn.Tanh(),
        )  # fmt: skip
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(torch.relu(self.inp(x))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_correct", (logits.argmax(-1) == y).sum().float(), reduce_fx="sum")
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class ValidationLoss:
    """Mixed into a classifier: its validation step logs ``val_loss``, the cross entropy of ``self(x)``."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))  # type: ignore[attr-defined, operator]


class ValidatedMLP(ValidationLoss, MLPClassifier):
    """`MLPClassifier` with a validation step."""


class BlocksOnly(ValidatedMLP):
    """Every weight inside the blocks, all of one shape (nothing outside them to place): the last stage's blocks are
    the ones a checkpoint gathers from another rank, and an averaged copy of the whole module lines up with any
    stage's weights without an error."""

    def __init__(self) -> None:
        super().__init__()
        del self.inp, self.head
        self.layers = nn.Sequential(*(module for _ in range(4) for module in (nn.Linear(16, 16), nn.Tanh())))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(nn.functional.pad(x, (0, 16 - x.shape[1])))[:, :5]  # 10 features in, 5 classes out


class NormedBlocks(MLPClassifier):
    """A BatchNorm and an InstanceNorm keeping running statistics inside the blocks, a GroupNorm beside them."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Tanh()),
            nn.Sequential(nn.Linear(16, 16), nn.GroupNorm(4, 16), nn.Tanh()),
            nn.Sequential(nn.Linear(16, 16), nn.Unflatten(1, (4, 4)), nn.InstanceNorm1d(4, track_running_stats=True),
                          nn.Flatten()),
            nn.Sequential(nn.Linear(16, 16), nn.Tanh()))


class MLPClassifierSGD(MLPClassifier):
    """The MLP with SGD (momentum, weight decay, StepLR): updates proportional to gradients, so fp32 summation-order
    noise stays at noise level in the parameters and they can be compared element-wise after training."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class FreezingMLPSGD(ValidationLoss, MLPClassifierSGD):
    """`MLPClassifierSGD` that freezes its first layer and its head once step 3 has run, before its batch-end hooks
    and checkpoints (``BackboneFinetuning``'s pattern, reversed; also when a run resumes after step 3): under
    ``pipedream_2bw`` the next step still applies batch 3's gradient to them."""

    def _freeze_after_step_3(self) -> None:
        if self.global_step >= 4:
            for module in (self.layers[0], self.head):
                module.requires_grad_(False)

    def on_train_start(self) -> None:
        self._freeze_after_step_3()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._freeze_after_step_3()


class TiedLM(L.LightningModule):
    """A tiny language model whose head reuses the token embedding (stage 0 and the last stage share a weight)."""

    def __init__(self, vocab: int = 13, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(4)])
        self.norm = nn.LayerNorm(dim)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> dict[str, torch.Tensor]:
        tokens = batch[0]
        hidden = self.norm(self.blocks(self.embed(tokens[:, :-1])))
        logits = hidden @ self.embed.weight.T
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        self.log("train_loss", loss)
        return {"loss": loss}

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.02)


class TiedClassifierSGD(L.LightningModule):
    """The SGD counterpart of `TiedLM` (on the MLP's data): the head reuses the input projection's weight, so stage 0
    and the last stage share a weight; SGD keeps the parameters comparable element-wise (see `MLPClassifierSGD`)."""

    def __init__(self, in_features: int = 10, dim: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(in_features, dim)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(4)])
        self.norm = nn.LayerNorm(dim)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.norm(self.blocks(self.inp(x))) @ self.inp.weight  # one logit per input feature, 5 used
        loss = nn.functional.cross_entropy(logits, y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)


class _TransposedHead(nn.Module):
    """A head computing with another module's weight (as Hugging Face ties ``lm_head.weight`` to the embedding's)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class TiedModulesSGD(TiedClassifierSGD):
    """`TiedClassifierSGD` (the same weights, the same computation) with its tied weight registered in two modules,
    each reading it in its own forward: the input projection, and a head module."""

    def __init__(self) -> None:
        super().__init__()
        self.head = _TransposedHead(self.inp.weight)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.head(self.norm(self.blocks(self.inp(x)))), y)
        self.log("train_loss", loss)
        return loss


class Lifecycle(MLPClassifier):
    """Validation, test and predict steps, torchmetrics objects, epoch-level and max-reduced logging."""

    def __init__(self) -> None:
        super().__init__()
        from torchmetrics.classification import MulticlassAccuracy

        self.train_acc = MulticlassAccuracy(num_classes=5, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=5, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=5, average="micro")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.val_acc.update(logits, y)
        self.log_dict({"val_loss": loss, "val_loss_copy": loss.clone()}, prog_bar=True)
        self.log("val_acc", self.val_acc)
        self.log("val_top", logits.max(), reduce_fx="max")
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.test_acc.update(logits, y)
        self.log("test_loss", nn.functional.cross_entropy(logits, y))
        self.log("test_acc", self.test_acc)

    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        return {"probs": self(batch[0]).softmax(-1), "label": batch[1]}

    def val_dataloader(self) -> DataLoader:
        return features(batches=3, seed=99)

    def test_dataloader(self) -> DataLoader:
        return features(batch_size=6, batches=3, seed=98)

    def predict_dataloader(self) -> DataLoader:
        return features(batch_size=5, batches=2, seed=97)


class SamplesSeen(Metric):
    """A custom metric with a list state that torchmetrics does not concatenate (``dist_reduce_fx=None``)."""

    counts: list[torch.Tensor]

    def __init__(self) -> None:
        super().__init__()
        self.add_state("counts", default=[], dist_reduce_fx=None)

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.counts.append(torch.tensor(float(target.numel())))

    def compute(self) -> torch.Tensor:
        return torch.stack(self.counts).sum()


class Everyday(L.LightningModule):
    """What a user writes without pipelines in mind: shuffled data; macro-averaged accuracy and a sum of two metrics
    logged per step and per epoch; AUROC and a custom metric (list states) in validation; extra entries in
    training_step's dict read by a hook."""

    def __init__(self) -> None:
        super().__init__()
        from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC

        self.inp = nn.Linear(10, 16)
        self.layers = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 5)
        self.train_acc = MulticlassAccuracy(num_classes=5)  # average="macro", the default
        self.train_mixed = MulticlassAccuracy(num_classes=5, average="micro") + MulticlassAccuracy(num_classes=5)
        self.val_auroc = MulticlassAUROC(num_classes=5)
        self.val_seen = SamplesSeen()
        self.batch_end_outputs: list[tuple[int, list[str], torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(torch.relu(self.inp(x))))

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True, prog_bar=True)
        self.train_mixed(logits, y)
        self.log("train_mixed", self.train_mixed, on_step=True, on_epoch=True)
        return {"loss": loss, "preds": logits.argmax(-1)}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.batch_end_outputs.append((batch_idx, sorted(outputs), outputs["preds"].cpu()))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_auroc.update(logits, y)
        self.val_seen.update(logits, y)
        self.log("val_auroc", self.val_auroc)
        self.log("val_seen", self.val_seen)
        self.log("val_loss", nn.functional.cross_entropy(logits, y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.2)

    def train_dataloader(self) -> DataLoader:
        # the sampler draws from the global generator
        return DataLoader(features(seed=5).dataset, batch_size=8, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return features(batches=2, seed=99)


class SyncedMetrics(Everyday):
    """`Everyday` plus values logged with ``sync_dist=True``: a mean and a sum (per step and per epoch) and, in
    validation, a mean and a max, which DDP all-reduces over its ranks; a data-parallel pipeline must reduce them over
    its replicas only (the stages of one replica hold one value between them)."""

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        out = super().training_step(batch, batch_idx)
        correct = (out["preds"] == batch[1]).sum().float()
        self.log("loss_synced", out["loss"], sync_dist=True, on_step=True, on_epoch=True)
        self.log("correct_synced", correct, sync_dist=True, reduce_fx="sum", on_step=True, on_epoch=True)
        return out

    def validation_step(self, batch: Any, batch_idx: int) -> None:  # Everyday's, plus two synced values
        x, y = batch
        logits = self(x)  # once: a step may not run the blocks twice
        loss = nn.functional.cross_entropy(logits, y)
        self.val_auroc.update(logits, y)
        self.val_seen.update(logits, y)
        self.log("val_auroc", self.val_auroc)
        self.log("val_seen", self.val_seen)
        self.log("val_loss", loss)
        self.log("val_loss_synced", loss, sync_dist=True)
        self.log("val_top_synced", logits.max(), sync_dist=True, reduce_fx="max")


class BatchNormHead(MLPClassifier):
    """A BatchNorm after the sequential: its running statistics change only where it runs (the last stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.layers(torch.relu(self.inp(x)))))


class BatchNormHeadValidated(ValidationLoss, BatchNormHead):
    """`BatchNormHead` with a validation step: evaluation after fit must use the running statistics the last stage
    kept current (validate's set-up must not replace them with another stage's)."""


class FrozenFront(MLPClassifier):
    """Fine-tuning: the input projection and the first half of the sequential are frozen, so with 2 stages the first
    stage has nothing to back-propagate."""

    def __init__(self) -> None:
        super().__init__()
        for module in (self.inp, *list(self.layers)[:4]):
            module.requires_grad_(False)


class UnfreezesFront(FrozenFront):
    """``BackboneFinetuning``'s pattern by hand: the input projection (outside the blocks) is frozen for the first two
    optimizer steps, then trained (its optimizer held it all along)."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.global_step == 2:
            self.inp.requires_grad_(True)


class WithExampleInput(MLPClassifier):
    """Lightning tutorials' habit: ``example_input_array`` set, which the model summary runs the module on."""

    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = torch.zeros(2, 10)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        assert self.example_input_array is not None, "example_input_array was not given back when training started"


class AllHiddenStates(MLPClassifier):
    """The loss reads every block's output, kept in a list by the loop (as Hugging Face's ``output_hidden_states``):
    all the same shape, so a stage holding copies of the received activation in their place would train silently
    wrong."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = [torch.relu(self.inp(x))]
        for layer in self.layers:
            hidden.append(layer(hidden[-1]))
        return self.head(torch.stack(hidden).mean(0))


class SkipsAcrossStages(MLPClassifier):
    """A U-Net's shape: each down block's output is kept and added back after the blocks (sizes 16 -> 12 -> 8 -> 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 12), nn.Linear(12, 8), nn.Linear(8, 6), nn.Linear(6, 4))
        self.up = nn.ModuleList([nn.Linear(4, 6), nn.Linear(6, 8), nn.Linear(8, 12), nn.Linear(12, 16)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.inp(x))
        skips = []
        for layer in self.layers:
            skips.append(x)
            x = torch.tanh(layer(x))
        for up in self.up:
            x = torch.tanh(up(x)) + skips.pop()
        return self.head(x)


class _SeenWeights(torch.autograd.Function):
    """A linear layer that records the weights its forward used and those its backward reads back (through autograd's
    saved tensors, as every layer's backward does), numbering each pass."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, layer: Any) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.layer, ctx.number = layer, len(layer.log)
        layer.log.append((layer.index, "F", ctx.number, float(weight.double().sum()), None))
        return x @ weight.t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight = ctx.saved_tensors
        live = float(ctx.layer.weight.detach().double().sum())  # the layer's weights now
        ctx.layer.log.append((ctx.layer.index, "B", ctx.number, float(weight.double().sum()), live))
        return grad @ weight, grad.flatten(0, -2).t() @ x.flatten(0, -2), None


class _RecordingLinear(nn.Module):
    def __init__(self, index: int, width: int, log: list[Any]) -> None:
        super().__init__()
        self.index, self.log = index, log
        self.weight = nn.Parameter(torch.randn(width, width) / width**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(_SeenWeights.apply(x, self.weight, self))


class WeightVersions(L.LightningModule):
    """Blocks that record, per pass, the weights their forward used and their backward read back, and at each step's
    start the weights they hold (in ``samples``): which version each pass of ``pipedream_2bw`` used."""

    def __init__(self) -> None:
        super().__init__()
        self.samples: list[Any] = []
        self.inp = nn.Linear(10, 8)
        self.layers = nn.Sequential(*[_RecordingLinear(i, 8, self.samples) for i in range(4)])
        self.head = nn.Linear(8, 5)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        for layer in self.layers:
            if isinstance(layer, _RecordingLinear) and not layer.weight.is_meta:  # held here, not another stage's
                self.samples.append((layer.index, "S", self.trainer.global_step, float(layer.weight.double().sum()),
                                     None))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.layers(self.inp(x))), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class BlocksMLP(MLPClassifier):
    """The MLP with ``blocks`` alike 16-wide linear blocks: checkpoints of another depth match it in every shape and
    differ in their blocks' count only."""

    def __init__(self, blocks: int, strict_loading: bool = True) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(16, 16) for _ in range(blocks)))
        self.strict_loading = strict_loading


def _example_gpt() -> Any:
    """The GPT-style module of examples/train_gpt.py (attention, position embedding, head tied to the embedding)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
    import train_gpt

    return train_gpt


# -------------------------------------------------------------------------------- what a pipeline refuses or fails on
class TwoSequentials(MLPClassifier):
    """Two block containers of similar size (an encoder-decoder's shape): which to split is ambiguous."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = self.layers
        self.decoder = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)])
        del self.layers


class TooFewLayers(MLPClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 16))


class ManualOptimization(MLPClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class NoSequentialCall(MLPClassifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        hidden = torch.relu(self.inp(x))
        for layer in self.layers:  # iterates instead of calling the sequential
            hidden = layer(hidden)
        return nn.functional.cross_entropy(self.head(hidden), y)


class FailsOnRankZero(MLPClassifier):
    """A bug in the user's step that only shows on global rank 0, at step 1."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == 0 and self.trainer.global_step == 1:
            raise RuntimeError("a bug in the user's training_step")
        return super().training_step(batch, batch_idx)


class InfOnOneStage(MLPClassifier):
    """At step 1 a gradient of layer 6 (on the last stage when pipelined) becomes inf: every stage must skip."""

    def on_after_backward(self) -> None:
        layer = self.layers[6]  # on a stage that does not hold it, a weightless stand-in
        if self.trainer.global_step == 1 and next(layer.parameters(), None) is not None:
            assert layer.weight.grad is not None
            layer.weight.grad[0, 0] = float("inf")


class SequentialInHook(MLPClassifier):
    """Runs the blocks in a hook on global rank 0 only (as code printing a sample under ``if self.global_rank == 0``
    would)."""

    def on_train_epoch_end(self) -> None:
        if self.global_rank == 0:
            self.layers(torch.zeros(1, 16))


class ParameterlessStage(L.LightningModule):
    """Everything in the sequential; with 2 stages its second half has no weights to optimize."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(10, 5), nn.Tanh(), nn.Identity(), nn.Flatten())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.layers(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Uncopyable(MLPClassifier):
    """Holds a lock, so the module cannot be deep-copied (as with an open file or a thread handle): balance='time'
    cannot probe a copy of it."""

    def __init__(self) -> None:
        super().__init__()
        import threading

        self.lock = threading.Lock()


# --------------------------------------------------------------------------------- large, or built on the meta device
class Wide(MLPClassifier):
    """16 blocks of 2048 x 2048 (256 MiB of fp32 weights) between small layers: what a stage holds shows in the
    process's memory well above the 20-30 MiB that imports and the allocator's arenas add during a fit."""

    def __init__(self, width: int = 2048, blocks: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(10, width)
        self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(blocks)])
        self.head = nn.Linear(width, 5)


class Gain(nn.Module):
    """A learned per-feature gain with no ``reset_parameters``: built on the meta device, nothing can initialize it."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class GainOnLastStage(MLPClassifier):
    """MLPClassifier with a `Gain` in the blocks of the second of two stages."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), Gain(16))


class KeepsItsParameterList(MLPClassifier):
    """Builds its optimizer from a parameter list made in ``__init__``: with a meta build, the meta tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.trainable = [p for p in self.parameters() if p.requires_grad]

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.trainable, lr=0.1)


class BlocksShareAWeight(MLPClassifier):
    """Two blocks of the container use one weight (``layers.2`` reuses ``layers.0``'s)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.layers[2].weight = self.layers[0].weight


class ShardsOverItsOwnMesh(MLPClassifier):
    """Applies FSDP2 to its blocks in ``configure_model`` over a mesh of its own, not the strategy's."""

    def configure_model(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (self.trainer.world_size,), mesh_dim_names=("replicas",))
        for layer in self.layers:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)


# ------------------------------------------------------------------------ batches as users load them, and misload them
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


class TextClassifier(L.LightningModule):
    """Classifies `TextDataset`'s features (a dict batch), one epoch of its own loader (4 batches of 8, in order)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(10, 16)
        self.layers = nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 16), nn.Tanh())
        self.head = nn.Linear(16, 5)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(torch.relu(self.inp(x))))

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss = nn.functional.cross_entropy(self.logits(batch["x"]), batch["y"])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TextDataset(), batch_size=8)


class CountsTexts(TextClassifier):
    """Weights each sample by its text's length and divides by ``len(batch["text"])``: the batch size as its list of
    strings tells it."""

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        weights = torch.tensor([len(text.split()) for text in batch["text"]], dtype=torch.float32)
        losses = nn.functional.cross_entropy(self.logits(batch["x"]), batch["y"], reduction="none")
        loss = (losses * weights).sum() / len(batch["text"])
        self.log("train_loss", loss)
        return loss


@dataclass
class TextBatch:
    x: torch.Tensor
    y: torch.Tensor
    names: list[str]


def collate_text_batch(samples: list[dict[str, Any]]) -> TextBatch:
    return TextBatch(torch.stack([s["x"] for s in samples]), torch.stack([s["y"] for s in samples]),
                     [s["text"] for s in samples])


class ReadsADataclass(TextClassifier):
    """Its loader collates each batch into a dataclass (`TextBatch`)."""

    def training_step(self, batch: TextBatch, batch_idx: int) -> torch.Tensor:
        loss = nn.functional.cross_entropy(self.logits(batch.x), batch.y, reduction="sum") / len(batch.names)
        self.log("train_loss", loss)
        return loss

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TextDataset(), batch_size=8, collate_fn=collate_text_batch)


class SamplesTheWholeWorld(TextClassifier):
    """A DistributedSampler of its own over every process of the job: each stage of a pipeline gets other samples."""

    def train_dataloader(self) -> DataLoader:
        dataset = TextDataset()
        return DataLoader(dataset, batch_size=8, sampler=DistributedSampler(
            dataset, num_replicas=self.trainer.world_size, rank=self.global_rank))


class ShufflesByRank(TextClassifier):
    """A shuffle seeded by the process's rank: each stage of a pipeline gets other batches."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TextDataset(), batch_size=8, shuffle=True,
                          generator=torch.Generator().manual_seed(self.global_rank))


class FewerOnRank1(TextClassifier):
    """3 batches on global rank 1, 4 elsewhere."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Subset(TextDataset(), range(24 if self.global_rank == 1 else 32)), batch_size=8)


# ---------------------------------------------------------------------------------------------------- sleeping layers
class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward each sleep a fixed time: timings independent of the machine's load."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        import time

        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        import time

        time.sleep(ctx.backward_s)
        return grad, None, None


class SleepLayer(nn.Module):
    def __init__(self, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x * self.scale, self.forward_s, self.backward_s)


class SplitSleepLayer(nn.Module):
    """Forward, input gradient and weight gradient each sleep ``seconds`` (F = I = W; ``per_row``: that much per row
    of the input, as a GPU's time grows with the micro-batch): the weight's path joins the input's at the sum, so a
    zero-bubble schedule's W computes it apart from I."""

    def __init__(self, seconds: float, per_row: bool = False) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(()))  # so the input path needs a gradient on the first stage too
        self.scale = nn.Parameter(torch.zeros(()))
        self.seconds, self.per_row = seconds, per_row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.seconds * (x.shape[0] if self.per_row else 1)
        return _Sleep.apply(x * self.gain, s, s) + _Sleep.apply(self.scale, 0.0, s)


class Sleepy(L.LightningModule):
    """One sleeping layer per stage (30 ms forward and backward per micro-batch), nothing else of note."""

    def __init__(self, layers: int = 4, forward_s: float = 0.03, backward_s: float = 0.03) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[SleepLayer(forward_s, backward_s) for _ in range(layers)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.layers(x[:, :1]).squeeze(1), y.float())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _split_sleepy(layers: int, seconds: float) -> Sleepy:
    model = Sleepy(layers=1)
    model.layers = nn.Sequential(*[SplitSleepLayer(seconds) for _ in range(layers)])
    return model


class SlowFirst(Sleepy):
    """8 sleeping blocks, the first 100x slower than the others (forward and backward: 100 ms against 1 ms), reading a
    shuffling loader of its own: the global random generator decides the batches, so a balance probe that drew from
    it would show. The time split is [1, 7] however busy the machine: the other 7 blocks' 14 ms would need more than
    30 ms of delay each (forward and backward) to outweigh the first's 200 ms, where a busy machine adds a few (8x
    slower once came out [2, 6] under load)."""

    def __init__(self, base_s: float = 0.001, slow_s: float = 0.1) -> None:
        super().__init__(layers=8, forward_s=base_s, backward_s=base_s)
        self.layers[0] = SleepLayer(slow_s, slow_s)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(features().dataset, batch_size=8, shuffle=True)


# ---------------------------------------------------------------------- written for Lightning's ModelParallelStrategy
class FeedForward(nn.Module):
    """A transformer's MLP block with its residual: the shape a tensor-parallel plan splits (column, then row)."""

    def __init__(self, dim: int, hidden: int, residual: bool = True) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.residual = residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down(torch.tanh(self.up(x)))
        return x + out if self.residual else out


class TensorParallelMLP(L.LightningModule):
    """A module written for Lightning's ``ModelParallelStrategy``: ``configure_model`` parallelizes each block (``up``
    column-wise, ``down`` row-wise over ``device_mesh["tensor_parallel"]``) and, with data-parallel ranks, applies
    FSDP2 over ``"data_parallel"`` to each module its step calls. SGD, so parameters compare element-wise."""

    applies_fsdp = True

    def __init__(self, in_features: int = 10, dim: int = 16, classes: int = 5) -> None:
        super().__init__()
        self.inp = nn.Linear(in_features, dim)
        self.blocks = nn.ModuleList(FeedForward(dim, 2 * dim) for _ in range(4))
        self.head = nn.Linear(dim, classes)
        self.plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}

    def configure_model(self) -> None:
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = self.device_mesh
        if mesh is None:  # one device
            return
        for block in self.blocks:
            parallelize_module(block, mesh["tensor_parallel"], self.plan)
        if self.applies_fsdp and mesh["data_parallel"].size() > 1:
            from torch.distributed.fsdp import fully_shard

            for module in (self.inp, *self.blocks, self.head):  # each is called by the step itself
                fully_shard(module, mesh=mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        hidden = self.inp(x)
        for block in self.blocks:
            hidden = block(hidden)
        loss = nn.functional.cross_entropy(self.head(hidden), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)


class TensorParallelPlanOnly(TensorParallelMLP):
    """Applies its tensor-parallel plan and no FSDP: sharding over the replicas is the strategy's."""

    applies_fsdp = False


class _Net(nn.Module):
    def __init__(self, in_features: int = 10, dim: int = 16, classes: int = 5) -> None:
        super().__init__()
        self.inp = nn.Linear(in_features, dim)
        self.blocks = nn.ModuleList(FeedForward(dim, 2 * dim) for _ in range(4))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.inp(x)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


class FullyShardsItsModel(TensorParallelMLP):
    """Lightning's documented pattern: FSDP2 on each block, then on the whole network (the root unit holds what is
    outside the blocks); the step calls the network."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.model = _Net()
        self.plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = self.device_mesh
        if mesh is None:
            return
        for block in self.model.blocks:
            parallelize_module(block, mesh["tensor_parallel"], self.plan)
            fully_shard(block, mesh=mesh["data_parallel"])
        fully_shard(self.model, mesh=mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.log("train_loss", loss)
        return loss


class HandsOnDTensors(TensorParallelPlanOnly):
    """Its blocks hand each other DTensors (no residual; ``down``'s output kept distributed, replicated), which the
    next block's plan takes as they are; the step gathers the last one before the head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(FeedForward(16, 32, residual=False) for _ in range(4))
        self.plan = {"up": ColwiseParallel(), "down": RowwiseParallel(use_local_output=False)}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        x, y = batch
        hidden = self.inp(x)
        for block in self.blocks:
            hidden = block(hidden)
        if isinstance(hidden, DTensor):
            hidden = hidden.full_tensor()
        loss = nn.functional.cross_entropy(self.head(hidden), y)
        self.log("train_loss", loss)
        return loss


class SamplesDTensors(HandsOnDTensors):
    """`HandsOnDTensors` that also passes a fixed input through the blocks at the end of every training epoch (an
    eager pass: the DTensors between the blocks cross stages there too), keeping what the head gives."""

    def __init__(self) -> None:
        super().__init__()
        self.samples: list[torch.Tensor] = []

    def on_train_epoch_end(self) -> None:
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            hidden = self.inp(torch.linspace(-1, 1, 20, device=self.device).reshape(2, 10))
            for block in self.blocks:
                hidden = block(hidden)
            if isinstance(hidden, DTensor):
                hidden = hidden.full_tensor()
            self.samples.append(self.head(hidden).cpu())


class SkipsOverDTensors(HandsOnDTensors):
    """`HandsOnDTensors` adding the first block's output to the last one's (a skip connection across stages, over
    DTensors): refused with our error, since a DTensor cannot be marked as another stage's output."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        x, y = batch
        hidden = first = self.blocks[0](self.inp(x))
        for block in self.blocks[1:]:
            hidden = block(hidden)
        hidden = hidden + first
        if isinstance(hidden, DTensor):
            hidden = hidden.full_tensor()
        return nn.functional.cross_entropy(self.head(hidden), y)


class WideTensorParallel(TensorParallelPlanOnly):
    """1 GiB of fp32 weights: 32 residual blocks of two 2048 x 2048 layers, each split column- then row-wise (large
    enough that the memory a rank holds shows well above the 60-90 MiB its process groups and allocator take)."""

    def __init__(self, width: int = 2048, blocks: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(10, width)
        self.blocks = nn.ModuleList(FeedForward(width, width) for _ in range(blocks))
        self.head = nn.Linear(width, 5)


class NormedFeedForward(FeedForward):
    """A pre-norm MLP block: ``x + down(tanh(up(norm(x))))``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__(dim, hidden)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class SequenceParallelMLP(TensorParallelPlanOnly):
    """Sequence parallelism as Megatron and torchtitan use it: between blocks each tensor-parallel rank holds its part
    of the sequence; a block's norm runs on that part (its replicated weight gets partial-sum gradients), ``up``
    gathers the sequence, ``down`` reduce-scatters it. The step cuts the sequence before the blocks and gathers it
    after them; on one device it runs unsplit."""

    def __init__(self, in_features: int = 5, dim: int = 16, classes: int = 5) -> None:
        super().__init__()
        self.inp = nn.Linear(in_features, dim)
        self.blocks = nn.ModuleList(NormedFeedForward(dim, 2 * dim) for _ in range(4))
        self.head = nn.Linear(dim, classes)
        self.plan = {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
                     "down": RowwiseParallel(output_layouts=Shard(1))}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        x, y = batch
        hidden = self.inp(x.view(x.shape[0], 2, 5))  # a sequence of 2 positions per sample
        mesh = self.device_mesh["tensor_parallel"] if self.device_mesh is not None else None
        if mesh is not None:  # this rank's part of the sequence (its gradient gathered back in backward)
            hidden = DTensor.from_local(hidden, mesh, [Replicate()]).redistribute(mesh, [Shard(1)]).to_local()
        for block in self.blocks:
            hidden = block(hidden)
        if mesh is not None:
            hidden = DTensor.from_local(hidden, mesh, [Shard(1)]).full_tensor()
        loss = nn.functional.cross_entropy(self.head(hidden.mean(dim=1)), y)
        self.log("train_loss", loss)
        return loss


class LlamaTensorParallel(L.LightningModule):
    """Hugging Face ``LlamaForCausalLM`` from a small config (grouped-query attention, rotary embeddings computed
    before the layers), unmodified, with the usual Megatron plan applied to each layer in ``configure_model``; on one
    device it runs unsplit. SGD, so parameters compare element-wise."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.model = LlamaForCausalLM(LlamaConfig(
            vocab_size=13, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=False))

    def configure_model(self) -> None:
        from torch.distributed.tensor.parallel import parallelize_module

        if self.device_mesh is None:
            return
        plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel()}
        for layer in self.model.model.layers:
            parallelize_module(layer, self.device_mesh["tensor_parallel"], plan)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch[0], labels=batch[0]).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


def _materialized(build: Callable[[], L.LightningModule]) -> L.LightningModule:
    """``build()`` on the meta device, materialized on the CPU as a pipeline stage materializes a meta build (the
    same values: the reference for meta builds under other strategies)."""
    from lightning_pp.model.materialize import materialize

    with torch.device("meta"):
        module = build()
    materialize(module, torch.device("cpu"))
    return module


# ------------------------------------------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class Model:
    """An entry of `MODELS`: how `fit` builds, feeds and trains a model, the same on one device and on every rank."""

    build: Callable[[], L.LightningModule]
    # the training loader `fit` hands the module (called with batch_size, batches and seed: see `make_data`); None: the
    # module's own loaders
    data: Callable[..., DataLoader] | None = features
    val_data: Callable[..., DataLoader] | None = None  # the validation loader `fit` hands it (None: the module's own)
    max_steps: int = 4
    max_epochs: int | None = None
    monitor: str | None = None  # validated every epoch; a ModelCheckpoint keeps the best two by this value (min)
    callbacks: Callable[[], list[L.Callback]] = list  # the model's own callbacks, made anew for every run
    after_fit: tuple[str, ...] = ()  # of "validate", "test", "predict": run after fit, each one's results kept
    meta: bool = False  # built on the meta device (see `fit`)


def own(build: Callable[[], L.LightningModule], **how: Any) -> Model:
    """An entry whose module brings its own data loaders."""
    return Model(build, data=None, **how)


def _gpt() -> L.LightningModule:
    example = _example_gpt()
    return example.GPT(vocab_size=len(set(example.make_corpus(4000))))


def _gpt_data(**_: Any) -> DataLoader:
    """The example's characters, 16 windows of 32 per batch (whatever batch size is asked)."""
    example = _example_gpt()
    return DataLoader(example.CharDataset(example.make_corpus(4000), 32), batch_size=16, shuffle=False)


def _other_features(batch_size: int = 8, **_: Any) -> DataLoader:
    """`features` of another seed (99): a classifier's validation data."""
    return features(batch_size=batch_size, seed=99)


def _backbone_finetuning() -> list[L.Callback]:
    return [BackboneFinetuning(unfreeze_backbone_at_epoch=1, verbose=False)]


# the modules of real_models.py, each with its own loaders: what their tests compare, and how long they train
REAL_MODELS: dict[str, Model] = {
    "hf_gpt2": own(real.HFGPT2),
    "hf_gpt2_dropout": own(lambda: real.HFGPT2(dropout=True), max_steps=12, max_epochs=3),
    "hf_gpt2_padded": own(real.PaddedHFGPT2),
    "nanogpt": own(real.NanoGPT),
    "hf_gpt2_sgd": own(lambda: real.with_sgd(real.HFGPT2)),
    "hf_gpt2_meta": own(lambda: real.with_sgd(real.HFGPT2), meta=True),
    "nanogpt_meta": own(lambda: real.with_sgd(real.NanoGPT), meta=True),
    "tuple_carry": own(real.TupleCarry),
    "tuple_output": own(real.TupleOutput),
    "dict_state": own(real.DictState),
    "denoiser_identity": own(lambda: real.Denoiser(identity=True, signal=0.0)),
    "denoiser": own(real.Denoiser),
    "val_ppl": own(real.PerplexityLM, max_steps=-1, max_epochs=3, monitor="val_ppl"),
    "finetune": own(real.FinetuneLM, max_steps=-1, max_epochs=3, callbacks=_backbone_finetuning),
    "sliced": own(real.SlicedDecoder),
    "inplace": own(real.InplaceFeatures),
    "torch_encoder": own(real.TorchEncoderClassifier, max_steps=-1, max_epochs=3, monitor="val_ppl",
                         after_fit=("predict",)),
    "torch_causal": own(lambda: real.TorchEncoderClassifier(causal=True), max_steps=-1, max_epochs=3,
                        monitor="val_ppl"),
    "hf_vit": own(real.HFViT),
    "alternating": own(real.AlternatingLM),
    "compiled": own(real.CompiledNanoGPT),
    "hf_gpt2_hidden_states": own(real.HiddenStatesGPT2),
    "hf_gpt2_grad_norm": own(real.GradNormGPT2),
    "nanogpt_generate": own(real.GeneratingNanoGPT, max_steps=-1, max_epochs=2, monitor="val_ppl",
                            after_fit=("predict",)),
    "hf_gpt2_generate": own(real.GeneratingGPT2, max_steps=-1, max_epochs=2, monitor="val_ppl",
                            after_fit=("predict",)),
    "hf_gpt2_generate_no_cache": own(lambda: real.GeneratingGPT2(use_cache=False), max_steps=-1, max_epochs=2,
                                     monitor="val_ppl", after_fit=("predict",)),
    "nanogpt_sampled": own(real.SampledNanoGPT, max_steps=-1, max_epochs=2, monitor="val_ppl", after_fit=("predict",)),
    **{f"{family}_generate_{cache}{'_sampled' if sample else ''}": own(
        lambda family=family, cache=cache, sample=sample: real.GeneratingCausalLM(family, cache, sample), max_steps=2,
        after_fit=("predict",))
       for family in ("gpt2", "llama", "mamba") for cache in ("dynamic", "none", "unknown")
       for sample in (False, True)},
    "hooked_aux_loss": own(real.HookedAuxLoss),
    "nanogpt_grad_norm": own(real.GradNormNanoGPT),
    "unet": own(real.UNetAutoencoder, max_steps=-1, max_epochs=2, monitor="val_loss"),
    "hf_mixtral": own(real.HFMixtral, max_steps=-1, max_epochs=2, monitor="val_ppl"),
    "hf_mixtral_quarters": own(lambda: real.HFMixtral(chunks=4), max_steps=-1, max_epochs=2, monitor="val_ppl"),
    "relative_positions": own(real.RelativePositionLM),
    "hf_deberta": own(real.HFDeberta),
}

MODELS: dict[str, Model] = {
    # written as a user would, fed `features` unless said
    "mlp": Model(MLPClassifier),
    "mlp_sgd": Model(MLPClassifierSGD),
    "freezing_mlp_sgd": Model(FreezingMLPSGD),
    "tied": Model(TiedLM, random_tokens),
    "tied_sgd": Model(TiedClassifierSGD),
    "tied_modules_sgd": Model(TiedModulesSGD),
    "lifecycle": Model(Lifecycle, max_steps=-1, max_epochs=2, after_fit=("validate", "test", "predict")),
    "everyday": own(Everyday),
    "synced_metrics": own(SyncedMetrics),
    "bn_head": Model(BatchNormHead),
    "bn_head_validated": Model(BatchNormHeadValidated),
    "frozen_front": Model(FrozenFront),
    "unfreezes_front": Model(UnfreezesFront),
    "example_input": Model(WithExampleInput),
    "all_hidden_states": Model(AllHiddenStates),
    "skips_across_stages": Model(SkipsAcrossStages),
    "weight_versions": Model(WeightVersions),
    "gpt": Model(_gpt, _gpt_data),
    "validated_mlp": Model(ValidatedMLP, val_data=_other_features),
    "blocks_only": Model(BlocksOnly, val_data=_other_features),
    "normed_blocks": Model(NormedBlocks),
    "mlp_blocks4": Model(lambda: BlocksMLP(4)),
    "mlp_blocks6": Model(lambda: BlocksMLP(6)),
    "mlp_blocks4_lenient": Model(lambda: BlocksMLP(4, strict_loading=False)),
    # what a pipeline refuses or fails on
    "two_sequentials": Model(TwoSequentials),
    "too_few_layers": Model(TooFewLayers),
    "manual": Model(ManualOptimization),
    "no_sequential_call": Model(NoSequentialCall),
    "sequential_in_hook": Model(SequentialInHook),
    "fails_on_rank_zero": Model(FailsOnRankZero),
    "inf_on_one_stage": Model(InfOnOneStage),
    "parameterless_stage": Model(ParameterlessStage),
    "uncopyable": Model(Uncopyable),
    # built on the meta device by their tests: large, or what a meta build gets wrong
    "wide": Model(Wide),
    "gain_on_last_stage": Model(GainOnLastStage),
    "shards_over_its_own_mesh": Model(ShardsOverItsOwnMesh),
    "keeps_its_parameter_list": Model(KeepsItsParameterList),
    "blocks_share_a_weight": Model(BlocksShareAWeight),
    # batches as users load them (a text field, a dataclass), and loaders giving a pipeline's stages other batches
    "counts_texts": own(CountsTexts, max_steps=-1, max_epochs=1),
    "reads_a_dataclass": own(ReadsADataclass, max_steps=-1, max_epochs=1),
    "samples_the_whole_world": own(SamplesTheWholeWorld, max_steps=-1, max_epochs=1),
    "shuffles_by_rank": own(ShufflesByRank, max_steps=-1, max_epochs=1),
    "fewer_on_rank_1": own(FewerOnRank1, max_steps=-1, max_epochs=1),
    # sleeping layers: timings independent of the machine's load
    "sleepy2": Model(lambda: Sleepy(layers=2, forward_s=0.06, backward_s=0.06)),
    # 4 processes share 2 cores: longer sleeps keep the (real, ~1 ms) transfer cost small next to compute
    "sleepy4": Model(lambda: Sleepy(layers=4, forward_s=0.12, backward_s=0.12)),
    # 8 layers: one per stage for 4 ranks x 2 stages (interleaved), two per stage for 4 ranks otherwise
    "split_sleepy8": Model(lambda: _split_sleepy(8, 0.05)),
    "slow_first8": own(SlowFirst),
    # written for Lightning's ModelParallelStrategy (tensor parallelism in configure_model)
    "tp_mlp": Model(TensorParallelMLP),
    "tp_mlp_plan_only": Model(TensorParallelPlanOnly),
    "tp_fully_shards_its_model": Model(FullyShardsItsModel),
    "tp_mlp_materialized": Model(lambda: _materialized(TensorParallelMLP)),
    "hands_on_dtensors": Model(HandsOnDTensors),
    "samples_dtensors": Model(SamplesDTensors),
    "skips_over_dtensors": Model(SkipsOverDTensors),
    "wide_tp": Model(WideTensorParallel),
    "sp_mlp": Model(SequenceParallelMLP),
    "llama_tp": Model(LlamaTensorParallel, random_tokens),
    **REAL_MODELS,
}


def make_data(model: str, batch_size: int = 8, batches: int = 4, seed: int = 1234) -> DataLoader:
    """The training loader `MODELS` names for ``model`` (``seed``: another draw of the same kind, as a test's
    validation data)."""
    data = MODELS[model].data
    assert data is not None, f"{model} brings its own loaders"
    return data(batch_size=batch_size, batches=batches, seed=seed)


# ------------------------------------------------------------------------------------------------------------ the run
@dataclass
class Fitted:
    """A finished `fit`: the trained module (for a test that looks further) and what the tests compare."""

    module: L.LightningModule
    result: dict[str, Any] = field(repr=False)


def fit(model: str, strategy: Any = "auto", devices: int = 1, *, max_steps: int | None = None,
        max_epochs: int | None = None, batch_size: int = 8, seed: int = 7, meta: bool | None = None,
        callbacks: Sequence[L.Callback] = (), record_steps: bool = False, record_batches: bool = False,
        record_weight_dtypes: bool = False, replay: Sequence[torch.Tensor] | None = None, dirpath: str | None = None,
        checkpoint_every_epoch: str | None = None, fp16_scaler: bool = False, ckpt_path: str | None = None,
        save_to: str | None = None, validate_before_saving: bool = False, after_fit: Sequence[str] | None = None,
        accelerator: str = "cpu", **trainer_kwargs: Any) -> Fitted:
    """Seed, build and train ``model`` as its `MODELS` entry says (``max_steps``, ``max_epochs``, ``meta`` and
    ``after_fit`` override the entry's), with ``strategy`` on ``devices``: the same call for the single-device
    reference and for every rank of a job. ``trainer_kwargs`` go to the Trainer (quiet, every step logged, no
    checkpointing and no sanity check unless they say).

    A ``meta`` build is built as a user builds a model too large for a device, under ``trainer.init_module(
    empty_init=True)``; on one device, on the meta device and materialized as a pipeline stage materializes its part
    (the same values). Recorded besides what every result holds: with ``record_steps`` what every optimizer step
    applied (`AppliedGradientRecorder`), with ``record_batches`` every batch loaded, with ``record_weight_dtypes`` the
    dtype each linear layer computed with. ``replay``: noise for a `real_models.Denoiser` to use instead of drawing
    its own. ``dirpath``: where the entry's ModelCheckpoint writes (a temporary folder otherwise: rank 0's alone, so
    give one to compare files across ranks); ``checkpoint_every_epoch``: a folder where a ModelCheckpoint keeps one
    file per epoch. ``fp16_scaler``: 16-bit mixed precision with a gradient scaler. ``ckpt_path``: resume from it;
    ``save_to``: ``trainer.save_checkpoint`` after fit (after a validate run on the training data with
    ``validate_before_saving``)."""
    entry = MODELS[model]
    L.seed_everything(seed, verbose=False)
    meta = entry.meta if meta is None else meta
    module = None if meta else entry.build()
    logger = RecordingLogger()
    steps, batches, dtypes = (AppliedGradientRecorder() if record_steps else None,
                              BatchRecorder() if record_batches else None,
                              WeightDtypeRecorder() if record_weight_dtypes else None)
    every = [*entry.callbacks(), *callbacks, *(c for c in (steps, batches, dtypes) if c is not None)]
    if fp16_scaler:
        trainer_kwargs["plugins"] = [*trainer_kwargs.get("plugins", []), fp16_with_scaler()]
    with tempfile.TemporaryDirectory() as scratch:
        checkpointing = entry.monitor is not None or checkpoint_every_epoch is not None
        if entry.monitor is not None:
            every.append(ModelCheckpoint(dirpath=dirpath or scratch, monitor=entry.monitor, mode="min", save_top_k=2))
        if checkpoint_every_epoch is not None:  # at every epoch's end, each kept (epoch=E-step=S.ckpt)
            every.append(ModelCheckpoint(dirpath=checkpoint_every_epoch, save_top_k=-1, every_n_epochs=1,
                                         save_on_train_epoch_end=True))
        trainer = L.Trainer(
            accelerator=accelerator, devices=devices, strategy=strategy,
            max_steps=entry.max_steps if max_steps is None else max_steps,
            max_epochs=entry.max_epochs if max_epochs is None else max_epochs, logger=logger, callbacks=every,
            **{"log_every_n_steps": 1, "enable_checkpointing": checkpointing, "enable_progress_bar": False,
               "enable_model_summary": False, "num_sanity_val_steps": 0, **trainer_kwargs},
        )  # fmt: skip
        if module is None:
            module = _built_on_meta(entry, trainer)
        if replay is not None:
            assert isinstance(module, real.Denoiser), model
            module.replay = list(replay)
        data = entry.data(batch_size=batch_size) if entry.data is not None else None
        val = entry.val_data(batch_size=batch_size) if entry.val_data is not None else None
        trainer.fit(module, data, val, ckpt_path=ckpt_path)
        result: dict[str, Any] = {
            "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},  # before any later loop
            **_decisions(trainer),
        }
        if validate_before_saving:
            trainer.validate(module, data, verbose=False)
        if save_to is not None:
            trainer.save_checkpoint(save_to)
        for loop in entry.after_fit if after_fit is None else after_fit:
            if loop == "predict":
                result[loop] = trainer.predict(module)
            else:
                result[loop] = getattr(trainer, loop)(module, val if loop == "validate" else None, verbose=False)
    used = trainer.strategy
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    result.update({
        "model": model,
        "world_size": trainer.world_size,
        "state": {k: whole(v).detach().clone() for k, v in module.state_dict().items()},
        "local_numel": {name: local_numel(p) for name, p in module.named_parameters()},
        "history": logger.history,
        "epochs": trainer.current_epoch,
        "scale": scaler.get_scale() if scaler is not None else None,
        "samples": list(getattr(module, "samples", [])),
        "drawn": list(getattr(module, "drawn", [])),
        "batch_end_outputs": getattr(module, "batch_end_outputs", None),
        "graphs": compiled_graphs(),
        "batches": batches.batches if batches is not None else None,
        "weight_dtypes": dtypes.dtypes if dtypes is not None else None,
        "global_rank": trainer.global_rank,
        "environment": type(getattr(used, "cluster_environment", None)).__name__,
        # the data-parallel layout as the strategy states it (None where it has no such attribute)
        "layout": {name: getattr(used, name, None) for name in ("stage", "replica", "num_stages", "num_replicas")},
    })
    if steps is not None:
        result.update(grads=steps.grads, weights=steps.weights, optimizers=steps.optimizers)
    return Fitted(module, result)


def _built_on_meta(entry: Model, trainer: L.Trainer) -> L.LightningModule:
    from lightning_pp import PipelineParallelStrategy
    from lightning_pp.model.materialize import left_uninitialized, materialize

    if isinstance(trainer.strategy, SingleDeviceStrategy):
        with torch.device("meta"):
            module = entry.build()
        assert left_uninitialized(module, materialize(module, torch.device("cpu"))) is None
        return module
    with trainer.init_module(empty_init=True):
        module = entry.build()
    if isinstance(trainer.strategy, PipelineParallelStrategy):
        assert next(module.parameters()).is_meta
    return module


def _decisions(trainer: L.Trainer) -> dict[str, Any]:
    """What the run's ModelCheckpoint (one monitoring a value) and EarlyStopping decided: the value monitored, the best
    score and file, the best k, the files in its folder, the epoch training stopped at."""
    decided: dict[str, Any] = {}
    checkpoint = trainer.checkpoint_callback
    if isinstance(checkpoint, ModelCheckpoint) and checkpoint.monitor is not None:
        assert checkpoint.best_model_score is not None and checkpoint.dirpath is not None
        decided.update(monitor=checkpoint.monitor, best_score=float(checkpoint.best_model_score),
                       best_path=Path(checkpoint.best_model_path).name,
                       top_k=sorted((Path(p).name, float(s)) for p, s in checkpoint.best_k_models.items()),
                       files=sorted(p.name for p in Path(checkpoint.dirpath).iterdir()))
    if trainer.early_stopping_callback is not None:
        decided["stopped_epoch"] = trainer.early_stopping_callback.stopped_epoch
    return decided


def compiled_graphs() -> int:
    """The graphs dynamo has compiled in this process (none where nothing imported it)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def with_callbacks(dirpath: str, strategy: Any = "auto", devices: int = 1) -> dict[str, Any]:
    """`Lifecycle` for up to 8 epochs with ModelCheckpoint on val_loss (the best two and the last), EarlyStopping and
    LearningRateMonitor: their decisions are in the result."""
    from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor

    callbacks = [ModelCheckpoint(dirpath=dirpath, monitor="val_loss", save_top_k=2, save_last=True),
                 EarlyStopping(monitor="val_loss", patience=1, min_delta=0.002), LearningRateMonitor("step")]
    return fit("lifecycle", strategy, devices, max_steps=-1, max_epochs=8, after_fit=(), enable_checkpointing=True,
               callbacks=callbacks).result


def fp16_with_scaler() -> Any:
    """16-bit mixed precision with a gradient scaler, on CPU (Lightning's '16-mixed' means bf16 there)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))


# -------------------------------------------------------------------------------------- the result exchange's outputs
def step_outputs(step: int) -> Any:
    """What the last stage's step ``step`` of ``scenarios.result_exchange`` returns: structures whose tensors change
    every step, and whose shapes, dtypes, containers and plain values change at some steps only."""
    from transformers.modeling_outputs import SequenceClassifierOutput

    base = torch.arange(12, dtype=torch.float32).reshape(3, 4) + step
    if step in (0, 1):  # the same structure twice: the second time it travels without pickle
        return {"probs": base, "ids": base.long(), "mask": base > 5, "name": "a", "n": 3, "none": None}
    if step == 2:  # a shape changes
        return {"probs": base[:2], "ids": base.long(), "mask": base > 5, "name": "a", "n": 3, "none": None}
    if step in (3, 4):  # Hugging Face's output class, a half-precision scalar and a non-contiguous view
        return SequenceClassifierOutput(logits=base.t(), loss=base.sum().half())
    if step == 5:  # a plain value changes, inside a list and a tuple
        return [(base.double(), 1.5), "b"]
    if step == 6:
        return [(base.double(), 2.5), "b"]
    if step == 7:  # what cannot be packed: a sparse tensor, an array
        import numpy as np

        return {"sparse": base.to_sparse(), "array": np.arange(3) + step}
    return None  # step 8: nothing
