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
from models import RecordingLogger, ValidatedMLP, fit, make_data

# read at import: Lightning's environment deletes WORLD_SIZE at teardown (a launch's first run imports this module)
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))


def averaged(model: str, dirpath: str, strategy: Any = "auto", devices: int = 1, ckpt_path: str | None = None,
             max_steps: int = 4) -> dict[str, Any]:
    """`models.fit` of ``model`` with ``EMAWeightAveraging`` (decay 0.5: every step shows) and a ``ModelCheckpoint``
    every two steps into ``dirpath`` (``step=N.ckpt``), validating every two steps (the averaged weights swapped in)
    where the model validates, then ``after_fit.ckpt`` saved by hand and, where it validates, ``validate``; each
    replica loading every batch (no distributed sampler)."""
    validated = model != "hf_gpt2"
    checkpoint = ModelCheckpoint(dirpath=dirpath, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    return fit(model, strategy, devices, max_steps=max_steps, ckpt_path=ckpt_path,
               callbacks=[EMAWeightAveraging(decay=0.5), checkpoint], enable_checkpointing=True,
               save_to=str(Path(dirpath) / "after_fit.ckpt"), after_fit=("validate",) if validated else (),
               use_distributed_sampler=False, val_check_interval=2 if validated else None,
               limit_val_batches=None if validated else 0).result


def pipelined_averaged(runs: list[dict[str, Any]], **strategy: Any) -> list[dict[str, Any]]:
    """`averaged` on the pipeline, one run after another (a later run may resume from an earlier run's file)."""
    from lightning_pp import PipelineParallelStrategy

    return [averaged(**run, strategy=PipelineParallelStrategy(transfer_timeout=60, **strategy), devices=WORLD_SIZE)
            for run in runs]


def normed_warnings(microbatches: int) -> list[str]:
    """The warnings fitting `models.NormedBlocks` raises on this rank (one step)."""
    from lightning_pp import PipelineParallelStrategy

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit("normed_blocks", PipelineParallelStrategy(transfer_timeout=60, microbatches=microbatches),
            devices=WORLD_SIZE, max_steps=1)
    return [str(w.message) for w in caught if "batch statistics" in str(w.message)]


def throughput(strategy: Any = "auto", devices: int = 1) -> dict[str, Any]:
    """`models.MLPClassifier` for 4 steps with ``ThroughputMonitor``: the logged keys and the weights."""
    result = fit("mlp", strategy, devices, callbacks=[ThroughputMonitor(batch_size_fn=len, window_size=2)]).result
    return {"keys": sorted({k for _, metrics in result["history"] for k in metrics}), "state": result["state"]}


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
