"""What a pipelined step's last stage hands the other stages: its outputs only where something reads them, as
tensors without pickle when their structure repeats."""

from __future__ import annotations

import lightning as L
import pytest
from _launch import launch
from lightning.pytorch.callbacks import BasePredictionWriter, Callback, ModelCheckpoint, TQDMProgressBar
from models import MLPClassifier, step_outputs
from support import assert_same_outputs

from lightning_pp import PipelineMonitor
from lightning_pp.model.results import outputs_read

STEPS = 9


@pytest.mark.multiprocess
def test_outputs_travel_intact_and_without_pickle_when_their_structure_repeats() -> None:
    ranks = launch(2, [{"scenario": "result_exchange", "kwargs": {"steps": STEPS}}], timeout=120)
    for rank_index, rank in enumerate(ranks):
        assert not rank.errors, rank.errors
        arrived = rank.results[0]
        assert len(arrived) == 2 * STEPS
        for index, got in enumerate(arrived):
            step, sent = index // 2, index % 2 == 0
            label = f"rank {rank_index}, step {step}, outputs sent: {sent}"
            assert got["loss"] == 0.5 + step, label
            assert [(name, value) for name, value, _ in got["logged"]] == [
                (f"m{i}", float(step + i)) for i in range(20)], label
            if sent or rank_index == 1:  # the source (rank 1) keeps its own outputs
                assert_same_outputs(got["outputs"], step_outputs(step))
            else:
                assert got["outputs"] is None, label
        # pickled: the log records' names at first, a structure when it is new or holds what cannot be packed
        pickled = [got["pickled"] for got in arrived[::2]]
        assert pickled == [1, 0, 1, 1, 0, 1, 1, 1, 0], pickled
        assert all(got["pickled"] == 0 for got in arrived[1::2])


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
