"""What a pipelined step's last stage hands the other stages: its outputs only where something reads them, as
tensors without pickle when their structure repeats.
The multi-process tests are in ``multi_process/test_results_multiprocess.py``."""

from __future__ import annotations

import lightning as L
import pytest
from lightning.pytorch.callbacks import BasePredictionWriter, Callback, ModelCheckpoint, TQDMProgressBar
from models import MLPClassifier

from lightning_pp import PipelineMonitor
from lightning_pp.model.results import outputs_read


class _Writer(BasePredictionWriter):
    def write_on_batch_end(self, *args: object) -> None:
        pass


class _ReadsOutputs(Callback):
    def on_validation_batch_end(self, *args: object) -> None:
        pass


class _CheckpointReadingOutputs(ModelCheckpoint):
    def on_train_batch_end(self, *args: object, **kwargs: object) -> None:
        pass


class _ModuleReadingOutputs(MLPClassifier):
    def on_test_batch_end(self, *args: object) -> None:
        pass


@pytest.mark.parametrize(
    ("callbacks", "module", "return_predictions", "read"),
    [
        ([TQDMProgressBar(), ModelCheckpoint(), PipelineMonitor()], MLPClassifier, False, {}),
        ([], MLPClassifier, True, {"predict_step"}),
        ([_Writer("batch")], MLPClassifier, False, {"predict_step"}),
        ([_Writer("epoch")], MLPClassifier, False, {"predict_step"}),
        ([_ReadsOutputs()], MLPClassifier, False, {"validation_step"}),
        ([_CheckpointReadingOutputs()], MLPClassifier, False, {"training_step"}),
        ([], _ModuleReadingOutputs, False, {"test_step"}),
    ],
)
def test_outputs_read_where_a_hook_takes_them(callbacks: list[Callback], module: type, return_predictions: bool,
                                               read: set[str]) -> None:
    """Lightning's progress bars, checkpointing and our monitor ignore the outputs; prediction writers, returned
    predictions and any other batch-end hook (also a subclass's override of an ignoring one) read them."""
    trainer = L.Trainer(accelerator="cpu", devices=1, callbacks=callbacks, logger=False)
    trainer.strategy.connect(module())
    trainer.predict_loop.return_predictions = return_predictions
    for step_name in ("training_step", "validation_step", "test_step", "predict_step"):
        assert outputs_read(trainer, step_name) == (step_name in read), step_name
