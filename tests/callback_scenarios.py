"""Lightning's own callbacks on one device and on a pipeline: the modules, the runs both sides make, and what a rank
of the multi-process tests runs (``"callback_scenarios:<name>"``)."""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter, EMAWeightAveraging, ModelCheckpoint, ThroughputMonitor
from models import MLPClassifier, RecordingLogger, make_data
from torch import nn

# read at import: Lightning's environment deletes WORLD_SIZE at teardown (a launch's first run imports this module)
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))


class ValidatedMLP(MLPClassifier):
    """`MLPClassifier` with a validation step."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))


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


def _module(name: str) -> L.LightningModule:
    if name == "hf_gpt2":
        from real_models import HFGPT2

        return HFGPT2()
    return {"blocks_only": BlocksOnly, "mlp": ValidatedMLP, "normed": NormedBlocks}[name]()


def averaged(model: str, dirpath: str, strategy: Any = "auto", devices: int = 1, ckpt_path: str | None = None,
             max_steps: int = 4) -> dict[str, Any]:
    """Fit ``model`` with ``EMAWeightAveraging`` (decay 0.5: every step shows) and a ``ModelCheckpoint`` every two
    steps into ``dirpath`` (``step=N.ckpt``), validating every two steps (the averaged weights swapped in), then save
    ``after_fit.ckpt`` by hand and validate again; return the live weights, the logged values and the validation."""
    L.seed_everything(7, verbose=False)
    module = _module(model)
    checkpoint = ModelCheckpoint(dirpath=dirpath, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    logger = RecordingLogger()
    validated = model != "hf_gpt2"
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps, logger=logger,
                        callbacks=[EMAWeightAveraging(decay=0.5), checkpoint], enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
                        log_every_n_steps=1, val_check_interval=2 if validated else None,
                        limit_val_batches=None if validated else 0)
    data, val = (make_data("mlp"), make_data("mlp", seed=99)) if validated else (None, None)
    trainer.fit(module, data, val, ckpt_path=ckpt_path)
    trainer.save_checkpoint(str(Path(dirpath) / "after_fit.ckpt"))
    return {"state": {k: v.detach().clone() for k, v in module.state_dict().items()}, "history": logger.history,
            "validate": trainer.validate(module, val, verbose=False) if validated else None}


def pipelined_averaged(runs: list[dict[str, Any]], **strategy: Any) -> list[dict[str, Any]]:
    """`averaged` on the pipeline, one run after another (a later run may resume from an earlier run's file)."""
    from lightning_pp import PipelineParallelStrategy

    return [averaged(**run, strategy=PipelineParallelStrategy(transfer_timeout=60, **strategy), devices=WORLD_SIZE)
            for run in runs]


def normed_warnings(microbatches: int) -> list[str]:
    """The warnings fitting `NormedBlocks` raises on this rank (one step)."""
    from lightning_pp import PipelineParallelStrategy

    L.seed_everything(7, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=WORLD_SIZE, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False,
                        strategy=PipelineParallelStrategy(transfer_timeout=60, microbatches=microbatches))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(NormedBlocks(), make_data("mlp"))
    return [str(w.message) for w in caught if "batch statistics" in str(w.message)]


def throughput(strategy: Any = "auto", devices: int = 1) -> dict[str, Any]:
    """`MLPClassifier` for 4 steps with ``ThroughputMonitor``: the logged keys and the weights."""
    L.seed_everything(7, verbose=False)
    logger = RecordingLogger()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=4, logger=logger,
                        log_every_n_steps=1, callbacks=[ThroughputMonitor(batch_size_fn=len, window_size=2)],
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    module = MLPClassifier()
    trainer.fit(module, make_data("mlp"))
    return {"keys": sorted({k for _, metrics in logger.history for k in metrics}),
            "state": {k: v.detach().clone() for k, v in module.state_dict().items()}}


def pipelined_throughput(**strategy: Any) -> dict[str, Any]:
    from lightning_pp import PipelineParallelStrategy

    return throughput(PipelineParallelStrategy(transfer_timeout=60, **strategy), WORLD_SIZE)


class TunedMLP(ValidatedMLP):
    """`MLPClassifier` with SGD at the learning rate in ``self.lr`` (what the learning-rate finder sets) and a
    validation step."""

    def __init__(self) -> None:
        super().__init__()
        self.lr = 0.01

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)  # (weights compared element-wise)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).softmax(-1)


class Written(BasePredictionWriter):
    """Keeps what it is handed to write, batch by batch."""

    def __init__(self) -> None:
        super().__init__("batch")
        self.written: list[torch.Tensor] = []

    def write_on_batch_end(self, trainer: Any, pl_module: Any, prediction: Any, *args: Any) -> None:
        self.written.append(prediction.detach().clone())


def sweep(strategy: Any = "auto", devices: int = 1) -> dict[str, Any]:  # strategy: or a function making one
    """The callbacks and tuner that need nothing of the pipeline, in two runs of `TunedMLP`: ``Tuner.lr_find`` (16
    steps), then a fit of 3 epochs with ``GradientAccumulationScheduler`` (2 batches per step from epoch 1),
    ``SpikeDetection``, ``Timer``, ``LambdaCallback`` (recording what ``on_train_batch_end`` gets),
    ``DeviceStatsMonitor`` (with fixed stats: this CPU environment has no psutil), ``RichProgressBar``,
    ``RichModelSummary``, ``EarlyStopping`` and ``LearningRateMonitor``; then ``predict`` with a
    ``BasePredictionWriter``. Returns what one device's run is compared with."""
    from lightning.pytorch.accelerators import CPUAccelerator
    from lightning.pytorch.callbacks import (
        DeviceStatsMonitor,
        EarlyStopping,
        GradientAccumulationScheduler,
        LambdaCallback,
        LearningRateMonitor,
        RichModelSummary,
        RichProgressBar,
        SpikeDetection,
        Timer,
    )
    from lightning.pytorch.tuner import Tuner

    CPUAccelerator.get_device_stats = lambda self, device: {"fixed": 1.0}  # type: ignore[method-assign]

    def trainer(**kwargs: Any) -> L.Trainer:
        return L.Trainer(accelerator="cpu", devices=devices, strategy=strategy() if callable(strategy) else strategy,
                         log_every_n_steps=1,
                         enable_checkpointing=False, num_sanity_val_steps=0, **kwargs)

    L.seed_everything(7, verbose=False)
    module = TunedMLP()
    finder = Tuner(trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)).lr_find(
        module, train_dataloaders=make_data("mlp", batches=16), num_training=16, min_lr=1e-3, max_lr=1.0)
    assert finder is not None
    seen: list[float] = []
    logger = RecordingLogger()
    with tempfile.TemporaryDirectory() as scratch:  # where SpikeDetection would list the batches to skip
        callbacks = [GradientAccumulationScheduler({1: 2}), SpikeDetection(exclude_batches_path=scratch, rtol=100.0),
                     Timer(),
                     LambdaCallback(on_train_batch_end=lambda t, m, outputs, *_: seen.append(float(outputs["loss"]))),
                     DeviceStatsMonitor(cpu_stats=True), RichProgressBar(), RichModelSummary(),
                     EarlyStopping("val_loss", patience=5), LearningRateMonitor(), Written()]
        fit = trainer(logger=logger, max_epochs=3, callbacks=callbacks)
        fit.fit(module, make_data("mlp"), make_data("mlp", seed=99))
        fit.predict(module, make_data("mlp", seed=5), return_predictions=False)
    return {"lr_find": {"lr": finder.results["lr"], "loss": finder.results["loss"], "suggested": module.lr},
            "losses": seen, "logged": [(step, sorted(metrics)) for step, metrics in logger.history],
            "values": [(step, {k: v for k, v in m.items() if k in ("train_loss", "val_loss", "lr-SGD")})
                       for step, m in logger.history],
            "global_step": fit.global_step, "written": callbacks[-1].written,  # type: ignore[attr-defined]
            "state": {k: v.detach().clone() for k, v in module.state_dict().items()}}


def pipelined_sweep(**strategy: Any) -> dict[str, Any]:
    from lightning_pp import PipelineParallelStrategy

    return sweep(lambda: PipelineParallelStrategy(transfer_timeout=60, **strategy), WORLD_SIZE)  # one per Trainer
