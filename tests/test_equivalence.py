"""Multi-process tier: pipelined training on gloo equals single-device Lightning training (fp32, tight tolerance)."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import pytest
import torch
from _launch import launch
from models import fit

RTOL, ATOL = 1e-5, 5e-6  # fp32: micro-batch gradient sums differ from full-batch ones in the last bits
LOSS_TOL = 1e-5
SCHEDULE_NAMES = ["naive", "gpipe", "1f1b"]


def prefixed(prefix: str) -> Callable[[str], str]:
    """An ``assert_close`` message that keeps torch's mismatch report and says which tensor it is."""
    return lambda message: f"{prefix}: {message}"


@cache
def reference(model: str, max_steps: int = 4, batch_size: int = 8, **trainer: Any) -> dict[str, Any]:
    module, logger = fit(model, max_steps=max_steps, batch_size=batch_size, **trainer)
    return {"state": {k: v.detach().clone() for k, v in module.state_dict().items()}, "history": logger.history}


def assemble(ranks: list, index: int) -> tuple[dict[str, torch.Tensor], list]:
    """The full model from every stage's parameters; replicated ones must agree across stages exactly."""
    full: dict[str, torch.Tensor] = {}
    for rank in ranks:
        assert index not in rank.errors, rank.errors[index]["traceback"]
        for name, value in rank.results[index]["state"].items():
            if name in full:
                assert torch.equal(full[name], value), f"replicated {name} differs between stages"
            else:
                full[name] = value
    return full, ranks[0].results[index]["history"]


def assert_matches(full: dict[str, torch.Tensor], history: list, expected: dict[str, Any], label: str) -> None:
    assert sorted(full) == sorted(expected["state"]), label
    worst = max((full[n] - v).abs().max().item() for n, v in expected["state"].items())
    print(f"{label}: max |param difference| {worst:.2e}")
    for name, value in expected["state"].items():
        torch.testing.assert_close(full[name], value, rtol=RTOL, atol=ATOL, msg=prefixed(f"{label} {name}"))
    logged = [(step, m["train_loss"]) for step, m in history if "train_loss" in m]
    wanted = [(step, m["train_loss"]) for step, m in expected["history"] if "train_loss" in m]
    assert [s for s, _ in logged] == [s for s, _ in wanted], label
    for (_, got), (_, want) in zip(logged, wanted, strict=True):
        assert abs(got - want) <= LOSS_TOL, f"{label}: logged loss {got} vs single-device {want}"
    for key in {k for _, m in expected["history"] for k in m} - {"epoch"}:
        got_values = [m[key] for _, m in history if key in m]
        want_values = [m[key] for _, m in expected["history"] if key in m]
        assert got_values == pytest.approx(want_values, abs=LOSS_TOL), f"{label}: {key}"


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_schedule_matches_single_device(world_size: int) -> None:
    """naive, gpipe, 1f1b x micro-batch counts 1, p, 2p and one that does not divide the batch of 8."""
    microbatch_counts = [1, world_size, 2 * world_size, 3]
    runs: list[dict[str, Any]] = [{"scenario": "train", "kwargs": {"model": "mlp", "schedule": s, "microbatches": m}}
            for s in SCHEDULE_NAMES for m in microbatch_counts]
    runs += [{"scenario": "train", "kwargs": {"model": "tied", "schedule": s, "microbatches": world_size}}
             for s in SCHEDULE_NAMES]
    ranks = launch(world_size, runs, timeout=400)
    for index, run in enumerate(runs):
        full, history = assemble(ranks, index)
        label = f"{world_size} stages {run['kwargs']}"
        assert_matches(full, history, reference(run["kwargs"]["model"]), label)


def test_balance_accumulation_uneven_batches_and_frozen_layers() -> None:
    """A custom balance, accumulate_grad_batches=2, a batch of 7 split into 2 micro-batches of 4 and 3, and a first
    stage whose weights are all frozen."""
    runs = [
        {"scenario": "train", "kwargs": {"model": "mlp", "schedule": "1f1b", "microbatches": 2, "balance": [2, 6]}},
        {"scenario": "train", "kwargs": {"model": "mlp", "schedule": "gpipe", "microbatches": 2,
                                         "trainer": {"accumulate_grad_batches": 2}}},
        {"scenario": "train", "kwargs": {"model": "mlp", "schedule": "1f1b", "microbatches": 2, "batch_size": 7}},
        {"scenario": "train", "kwargs": {"model": "frozen_front", "schedule": "1f1b", "microbatches": 2}},
    ]
    ranks = launch(2, runs, timeout=300)
    expected = [reference("mlp"), reference("mlp", accumulate_grad_batches=2), reference("mlp", batch_size=7),
                reference("frozen_front")]
    for index, run in enumerate(runs):
        full, history = assemble(ranks, index)
        assert_matches(full, history, expected[index], str(run["kwargs"]))
    assert sorted(k for k in ranks[0].results[0]["state"] if k.startswith("layers.")) == [
        "layers.0.bias", "layers.0.weight"]


def test_gradient_clipping_by_global_norm_and_value() -> None:
    cases = [{"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"},
             {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}]
    runs: list[dict[str, Any]] = [
        {"scenario": "train", "kwargs": {"model": model, "schedule": "1f1b", "microbatches": 2, "trainer": case}}
            for case in cases for model in ("mlp", "tied")]
    ranks = launch(2, runs, timeout=300)
    for index, run in enumerate(runs):
        full, history = assemble(ranks, index)
        expected = reference(run["kwargs"]["model"], **run["kwargs"]["trainer"])
        assert_matches(full, history, expected, str(run["kwargs"]))


def test_mixed_precision() -> None:
    """bf16-mixed, and fp16 with a gradient scaler where one stage sees inf: all stages skip and back off."""
    from models import fp16_with_scaler

    runs = [{"scenario": "train", "kwargs": {"model": "mlp", "schedule": "1f1b", "microbatches": 2,
                                             "trainer": {"precision": "bf16-mixed"}}},
            {"scenario": "train", "kwargs": {"model": "inf_on_one_stage", "schedule": "gpipe", "microbatches": 2,
                                             "fp16_scaler": True}}]
    ranks = launch(2, runs, timeout=300)
    bf16 = reference("mlp", precision="bf16-mixed")
    full, history = assemble(ranks, 0)
    # bf16 keeps ~3 significant digits: summing micro-batch gradients rounds differently from one batch, and
    # AdamW (lr 0.01) turns a flipped sign of a tiny gradient into a full step, so parameters agree to ~1 step
    for name, value in bf16["state"].items():
        torch.testing.assert_close(full[name], value, rtol=0, atol=2e-2)
    for (_, got), (_, want) in zip(history, bf16["history"], strict=True):
        assert abs(got["train_loss"] - want["train_loss"]) < 2e-3

    module, logger = fit("inf_on_one_stage", plugins=[fp16_with_scaler()])
    expected_scale = module.trainer.precision_plugin.scaler.get_scale()  # type: ignore[attr-defined]
    assert expected_scale == 2.0**9  # the single-device run skipped step 1 and halved the scale
    assert [rank.results[1]["scale"] for rank in ranks] == [expected_scale, expected_scale]
    full, history = assemble(ranks, 1)
    for name, value in module.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=0, atol=2e-3)
    for (_, got), (_, want) in zip(history, logger.history, strict=True):
        assert abs(got["train_loss"] - want["train_loss"]) < 2e-3


def test_example_transformer_gradients_and_losses_match_single_device() -> None:
    """The example's GPT (attention, position embedding, tied head, AdamW + cosine LambdaLR) on 2 and 4 stages.

    Compared: every gradient handed to the optimizer at every step (each element within 1e-5 of the tensor's scale)
    and the logged loss of every step. Parameters are not compared element-wise here: in attention some gradients
    are analytically zero (the key bias: softmax ignores a constant added to a row of scores) or nearly so, and AdamW
    normalises their fp32 noise into full-size random-sign updates, so two single-device runs that merely sum in a
    different order drift apart there too.
    """
    from models import GradientRecorder

    recorder = GradientRecorder()
    _, logger = fit("gpt", max_steps=5, callbacks=[recorder])
    for world_size in (2, 4):
        ranks = launch(world_size, [{"scenario": "train", "kwargs": {
            "model": "gpt", "schedule": "1f1b", "microbatches": 4, "max_steps": 5,
            "trainer": {"record_grads": True}}}], timeout=300)
        for step, want in enumerate(recorder.grads):
            got: dict[str, torch.Tensor] = {}
            for rank in ranks:
                for name, grad in rank.results[0]["grads"][step].items():
                    if name in got:
                        assert torch.equal(got[name], grad), f"replicated {name} differs between stages"
                    got[name] = grad
            assert sorted(got) == sorted(want)
            for name, grad in want.items():
                scale = grad.abs().max().item()
                torch.testing.assert_close(got[name], grad, rtol=0, atol=1e-5 * scale + 1e-12,
                                           msg=prefixed(f"{world_size} stages step {step} {name}"))
        logged = [m["train_loss"] for _, m in ranks[0].results[0]["history"] if "train_loss" in m]
        wanted = [m["train_loss"] for _, m in logger.history if "train_loss" in m]
        assert logged == pytest.approx(wanted, abs=LOSS_TOL)
