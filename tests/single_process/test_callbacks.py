"""Lightning's own callbacks under the pipeline: weight averaging's checkpoints equal one device's file entry by entry,
the callbacks that cannot give one device's result are refused at setup, norms with batch statistics are warned
about, ``ThroughputMonitor`` logs what one device logs (the outcome for every callback: docs/compatibility.md).
The multi-process tests are in ``multi_process/test_callbacks_multiprocess.py``."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import (
    BatchSizeFinder,
    EMAWeightAveraging,
    ModelPruning,
    StochasticWeightAveraging,
)
from models import BlocksOnly, make_data

from lightning_pp import PipelineParallelStrategy
from lightning_pp.errors import PipelineConfigError
from lightning_pp.model.callbacks import batch_statistics_modules, check_callbacks


@pytest.mark.parametrize("callback", [StochasticWeightAveraging(swa_lrs=0.1), ModelPruning("l1_unstructured"),
                                      BatchSizeFinder()],
                         ids=lambda c: type(c).__name__)
def test_callbacks_that_cannot_give_one_devices_result_are_refused(callback: L.Callback) -> None:
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=PipelineParallelStrategy(), callbacks=[callback],
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    options = trainer.strategy.options  # type: ignore[attr-defined]
    refused = f"^{type(callback).__name__} does not work with PipelineParallelStrategy: "
    with pytest.raises(PipelineConfigError, match=refused):
        check_callbacks(trainer, BlocksOnly(), options=options, microbatches=2)


@pytest.mark.parametrize("option", [{"state_dict_type": "sharded"}, {"data_parallel_mode": "fsdp"},
                                    {"schedule": "pipedream_2bw"}], ids=lambda o: next(iter(o)))
def test_weight_averaging_refuses_what_a_stages_averaged_model_does_not_cover(option: dict[str, Any]) -> None:
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=PipelineParallelStrategy(**option),
                        callbacks=[EMAWeightAveraging()], logger=False, enable_progress_bar=False)
    options = trainer.strategy.options  # type: ignore[attr-defined]
    with pytest.raises(PipelineConfigError, match=r"^EMAWeightAveraging with PipelineParallelStrategy\("):
        check_callbacks(trainer, BlocksOnly(), options=options, microbatches=2)


def test_batch_statistics_modules_are_the_norms_that_see_the_batch() -> None:
    module = torch.nn.Sequential(torch.nn.BatchNorm1d(4), torch.nn.SyncBatchNorm(4), torch.nn.LazyBatchNorm1d(),
                                 torch.nn.InstanceNorm1d(4), torch.nn.InstanceNorm2d(4, track_running_stats=True),
                                 torch.nn.GroupNorm(2, 4), torch.nn.LayerNorm(4))
    assert [name for name, _ in batch_statistics_modules(module)] == ["0", "1", "2", "4"]


def test_a_refused_callback_stops_fit_at_setup() -> None:
    """Through ``fit`` (one process, one stage): the strategy's setup refuses before anything trains."""
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=PipelineParallelStrategy(), max_steps=1, logger=False,
                        callbacks=[ModelPruning("l1_unstructured")], enable_progress_bar=False)
    module = BlocksOnly()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(PipelineConfigError, match=r"^ModelPruning does not work with PipelineParallelStrategy: "):
        trainer.fit(module, make_data("mlp"))
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
