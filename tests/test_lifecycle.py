"""Multi-process tier: validation, test, predict, logging and torchmetrics equal single-device Lightning."""

from __future__ import annotations

from functools import cache
from typing import Any

import models
import pytest
import torch
from _launch import launch
from test_equivalence import ATOL, RTOL, assemble


@cache
def reference() -> dict[str, Any]:
    return models.lifecycle(num_sanity_val_steps=2)


def assert_same_metrics(got: dict[str, float], want: dict[str, float], label: str) -> None:
    assert sorted(got) == sorted(want), label
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=1e-5), f"{label}: {key} {got[key]} vs {value}"


@pytest.mark.parametrize("world_size", [2, 4])
def test_validation_test_predict_and_metrics_match_single_device(world_size: int) -> None:
    runs = [{"scenario": "lifecycle", "kwargs": {"schedule": s, "microbatches": m}}
            for s, m in [("1f1b", world_size), ("gpipe", 3)]]
    ranks = launch(world_size, runs, timeout=400)
    expected = reference()
    for index, run in enumerate(runs):
        label = f"{world_size} stages {run['kwargs']}"
        full, history = assemble(ranks, index)
        for name, value in expected["state"].items():
            torch.testing.assert_close(full[name], value, rtol=RTOL, atol=ATOL)
        assert [step for step, _ in history] == [step for step, _ in expected["history"]], label
        for (_, got), (_, want) in zip(history, expected["history"], strict=True):
            assert_same_metrics(got, want, label)
        for rank in ranks:  # every rank sees the same metrics, predictions and results
            result = rank.results[index]
            assert_same_metrics(result["callback_metrics"], expected["callback_metrics"], label)
            for got, want in zip(result["validate"] + result["test"], expected["validate"] + expected["test"],
                                 strict=True):
                assert_same_metrics(got, want, label)
            assert len(result["predict"]) == len(expected["predict"])
            for got, want in zip(result["predict"], expected["predict"], strict=True):
                torch.testing.assert_close(got["probs"], want["probs"], rtol=RTOL, atol=ATOL)
                assert torch.equal(got["label"], want["label"])
