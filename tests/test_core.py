"""Single-process tier: partitioning, micro-batch splitting, log combination and configuration errors."""

from __future__ import annotations

import pytest
import torch

from lightning_pp import PipelineConfigError, PipelineParallelStrategy
from lightning_pp.microbatch import split_batch
from lightning_pp.partition import stage_layer_ranges, uniform_balance, validate_balance


def test_uniform_balance_and_ranges() -> None:
    assert uniform_balance(8, 2) == [4, 4]
    assert uniform_balance(10, 4) == [3, 3, 2, 2]
    assert stage_layer_ranges([3, 3, 2, 2]) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]


def test_balance_errors_name_values_and_fix() -> None:
    with pytest.raises(PipelineConfigError, match=r"3 layers but the pipeline has 4 stages"):
        uniform_balance(3, 4)
    with pytest.raises(PipelineConfigError, match=r"sums to 7 but the sequential has 8 layers.*balance=\[4, 4\]"):
        validate_balance([3, 4], 8, 2)
    with pytest.raises(PipelineConfigError, match="has 3 entries but the pipeline has 2 stages"):
        validate_balance([3, 3, 2], 8, 2)
    with pytest.raises(PipelineConfigError, match="below 1"):
        validate_balance([8, 0], 8, 2)


def test_split_batch_nested_and_uneven() -> None:
    batch = {"x": torch.arange(10).reshape(5, 2), "pair": (torch.arange(5), "tag")}
    micro, sizes = split_batch(batch, 3)
    assert sizes == [2, 2, 1]
    assert torch.equal(micro[2]["x"], torch.tensor([[8, 9]]))
    assert micro[1]["pair"][1] == "tag"
    assert torch.equal(torch.cat([m["pair"][0] for m in micro]), torch.arange(5))


def test_split_batch_errors() -> None:
    with pytest.raises(PipelineConfigError, match="batch of 2 samples cannot be split into 4"):
        split_batch(torch.zeros(2, 3), 4)
    with pytest.raises(PipelineConfigError, match=r"first dimensions \[3, 4\]"):
        split_batch((torch.zeros(3), torch.zeros(4)), 2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"schedule": "interleaved"}, r"Unknown schedule 'interleaved'. Valid schedules: 1f1b, gpipe, naive"),
        ({"microbatches": 0}, r"microbatches=0, but at least 1"),
        ({"balance": [2, 0]}, r"balance=\[2, 0\] must list at least one layer"),
        ({"timeout": 0}, r"timeout=0 must be a positive number of seconds"),
    ],
)
def test_strategy_rejects_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(PipelineConfigError, match=message):
        PipelineParallelStrategy(**kwargs)


def test_registry_alias() -> None:
    import lightning as L

    trainer = L.Trainer(strategy="pipeline", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, PipelineParallelStrategy)
