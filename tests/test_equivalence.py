"""Multi-process tier: pipelined training on gloo equals single-device Lightning training (fp32, tight tolerance).

What is compared, and why. At every optimizer step, the gradients handed to the optimizer (after clipping) against
those one device computes at the same weights on the same batch, each element within 1e-5 of its tensor's largest
magnitude; every logged value against a single-device run; and the weights after training, element-wise, for models
trained with SGD. Not the weights of models trained with Adam or AdamW, nor their gradients against a free-running
single-device run: Adam divides each gradient by its running magnitude, so the fp32 noise of a gradient that is
(nearly) zero, which differs with the summation order of micro-batches, becomes a full-size update of random sign. Two
single-device runs that merely sum in a different order drift apart there too, and so do the gradients computed at the
drifted weights. SGD moves each weight in proportion to its gradient, so its noise stays noise.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from _launch import launch
from models import AppliedGradientRecorder, LoadWeightsEachStep, fit

RTOL, ATOL = 1e-5, 5e-6  # fp32: micro-batch gradient sums differ from full-batch ones in the last bits
GRAD_RTOL = 1e-5  # of each gradient tensor's largest magnitude (see `assert_grads_match`)
LOSS_TOL = 1e-5
SCHEDULE_NAMES = ["naive", "gpipe", "1f1b"]
SGD_MODELS = ("mlp_sgd", "tied_sgd")  # weights compared element-wise after training


def prefixed(prefix: str) -> Callable[[str], str]:
    """An ``assert_close`` message that keeps torch's mismatch report and says which tensor it is."""
    return lambda message: f"{prefix}: {message}"


@cache
def reference(model: str, max_steps: int = 4, batch_size: int = 8, **trainer: Any) -> dict[str, Any]:
    """The single-device run; ``fit`` holds its arguments (see `single_device_grads_at`)."""
    recorder = AppliedGradientRecorder()
    module, logger = fit(model, max_steps=max_steps, batch_size=batch_size, callbacks=[recorder], **trainer)
    return {"state": {k: v.detach().clone() for k, v in module.state_dict().items()}, "history": logger.history,
            "steps": len(recorder.grads),
            "fit": {"model_name": model, "max_steps": max_steps, "batch_size": batch_size, **trainer}}


def single_device_grads_at(expected: dict[str, Any], weights: list[dict[str, torch.Tensor]]
                           ) -> list[dict[str, torch.Tensor]]:
    """The gradients the single-device run of ``expected`` hands its optimizer when every step starts from
    ``weights[step]`` (a pipelined run's): the same batch, clipping and accumulation, none of the drift."""
    recorder = AppliedGradientRecorder()
    fit(**expected["fit"], callbacks=[recorder, LoadWeightsEachStep(weights)])
    return recorder.grads


def pipelined(model: str, **kwargs: Any) -> dict[str, Any]:
    """A run that trains and records, at every optimizer step on every stage, the gradients and their weights."""
    return {"scenario": "train_recording_steps", "kwargs": {"model": model, **kwargs}}


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


def assemble_steps(ranks: list, index: int, key: str) -> list[dict[str, torch.Tensor]]:
    """Per optimizer step, every stage's recorded ``key`` ("grads" or "weights"); replicated weights' must agree
    across stages exactly."""
    per_rank = [rank.results[index][key] for rank in ranks]
    assert len({len(steps) for steps in per_rank}) == 1, f"optimizer steps per stage: {[len(s) for s in per_rank]}"
    merged: list[dict[str, torch.Tensor]] = []
    for per_stage in zip(*per_rank, strict=True):
        full: dict[str, torch.Tensor] = {}
        for tensors in per_stage:
            for name, tensor in tensors.items():
                if name in full:
                    assert torch.equal(full[name], tensor), f"replicated {name}: {key} differ between stages"
                full[name] = tensor
        merged.append(full)
    return merged


def assert_grads_match(got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]], label: str) -> None:
    """Every step's gradients, each element within ``GRAD_RTOL`` of its tensor's largest magnitude: a margin that
    summation order does not reach (measured: up to ~1e-6) and a pipelining mistake (a micro-batch missing or counted
    twice, a replicated weight's gradient not summed over stages, clipping by one stage's norm) exceeds many times."""
    assert len(got) == len(want), f"{label}: {len(got)} optimizer steps, single-device {len(want)}"
    worst = 0.0
    for step, (got_step, want_step) in enumerate(zip(got, want, strict=True)):
        assert sorted(got_step) == sorted(want_step), f"{label} step {step}: gradients of other parameters"
        for name, grad in want_step.items():
            scale = grad.abs().max().item()
            worst = max(worst, (got_step[name] - grad).abs().max().item() / (scale or 1.0))
            torch.testing.assert_close(got_step[name], grad, rtol=0, atol=GRAD_RTOL * scale + 1e-12,
                                       msg=prefixed(f"{label} step {step} {name}"))
    print(f"{label}: max |gradient difference| / scale {worst:.2e}")


def assert_logged_match(history: list, expected_history: list, label: str, keys: tuple[str, ...] | None = None) -> None:
    """The same steps logged, with the same loss and every other logged value (or those of ``keys``)."""
    logged = [(step, m["train_loss"]) for step, m in history if "train_loss" in m]
    wanted = [(step, m["train_loss"]) for step, m in expected_history if "train_loss" in m]
    assert [s for s, _ in logged] == [s for s, _ in wanted], label
    for (_, got), (_, want) in zip(logged, wanted, strict=True):
        assert abs(got - want) <= LOSS_TOL, f"{label}: logged loss {got} vs single-device {want}"
    compared = keys if keys is not None else {k for _, m in expected_history for k in m} - {"epoch"}
    for key in compared:
        got_values = [m[key] for _, m in history if key in m]
        want_values = [m[key] for _, m in expected_history if key in m]
        assert got_values == pytest.approx(want_values, abs=LOSS_TOL), f"{label}: {key}"


def assert_matches(full: dict[str, torch.Tensor], history: list, expected: dict[str, Any], label: str) -> None:
    """Weights element-wise (trained with SGD or alike: see the module docstring) and everything logged."""
    assert sorted(full) == sorted(expected["state"]), label
    worst = max((full[n] - v).abs().max().item() for n, v in expected["state"].items())
    print(f"{label}: max |param difference| {worst:.2e}")
    for name, value in expected["state"].items():
        torch.testing.assert_close(full[name], value, rtol=RTOL, atol=ATOL, msg=prefixed(f"{label} {name}"))
    assert_logged_match(history, expected["history"], label)


def assert_trains_like(ranks: list, index: int, run: dict[str, Any], expected: dict[str, Any], label: str,
                       logged: tuple[str, ...] | None = None) -> None:
    """A `pipelined` run against single-device training: every step's gradients at the run's own weights, everything
    logged (or the keys in ``logged``), and the weights after training where SGD trained."""
    full, history = assemble(ranks, index)
    assert sorted(full) == sorted(expected["state"]), label
    grads, weights = assemble_steps(ranks, index, "grads"), assemble_steps(ranks, index, "weights")
    assert len(grads) == expected["steps"], f"{label}: {len(grads)} optimizer steps, single-device {expected['steps']}"
    assert_grads_match(grads, single_device_grads_at(expected, weights), label)
    if run["kwargs"]["model"] in SGD_MODELS:
        assert_matches(full, history, expected, label)
    else:
        assert_logged_match(history, expected["history"], label, logged)


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_schedule_matches_single_device(world_size: int) -> None:
    """naive, gpipe, 1f1b x micro-batch counts 1, p, 2p and one that does not divide the batch of 8; the tied models
    (a weight on the first and the last stage) with p micro-batches."""
    microbatch_counts = [1, world_size, 2 * world_size, 3]
    models = [("mlp", m) for m in microbatch_counts] + [("mlp_sgd", world_size), ("tied", world_size),
                                                        ("tied_sgd", world_size)]
    runs = [pipelined(model, schedule=s, microbatches=m) for s in SCHEDULE_NAMES for model, m in models]
    ranks = launch(world_size, runs, timeout=300)
    for index, run in enumerate(runs):
        label = f"{world_size} stages {run['kwargs']}"
        assert_trains_like(ranks, index, run, reference(run["kwargs"]["model"]), label)


def test_balance_accumulation_uneven_batches_and_frozen_layers() -> None:
    """A custom balance, accumulate_grad_batches=2, a batch of 7 split into 2 micro-batches of 4 and 3, a first
    stage whose weights are all frozen, an input projection unfrozen after two steps (placed then: it leaves the
    last stage, which computed it only to have it replaced by the received activation), and a module with an
    ``example_input_array`` under Lightning's model summary (which would run the whole module outside the step)."""
    runs = [
        pipelined("mlp", schedule="1f1b", microbatches=2, balance=[2, 6]),
        pipelined("mlp", schedule="gpipe", microbatches=2, trainer={"accumulate_grad_batches": 2}),
        pipelined("mlp", schedule="1f1b", microbatches=2, batch_size=7),
        pipelined("frozen_front", schedule="1f1b", microbatches=2),
        pipelined("unfreezes_front", schedule="1f1b", microbatches=2),
        pipelined("example_input", schedule="1f1b", microbatches=2, trainer={"enable_model_summary": True}),
    ]
    ranks = launch(2, runs, timeout=300)
    expected = [reference("mlp"), reference("mlp", accumulate_grad_batches=2), reference("mlp", batch_size=7),
                reference("frozen_front"), reference("unfreezes_front"), reference("mlp")]
    for index, run in enumerate(runs):
        assert_trains_like(ranks, index, run, expected[index], str(run["kwargs"]))
    assert sorted(k for k in ranks[0].results[0]["state"] if k.startswith("layers.")) == [
        "layers.0.bias", "layers.0.weight"]
    assert "inp.weight" in ranks[0].results[4]["state"] and "inp.weight" not in ranks[1].results[4]["state"]
    assert "inp.weight" in ranks[1].results[3]["state"]  # frozen throughout: never placed, held by both stages


def test_gradient_clipping_by_global_norm_and_value() -> None:
    """Clipped gradients are what the optimizer gets (compared as it gets them); SGD shows their effect on weights."""
    cases = [{"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"},
             {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}]
    runs = [pipelined(model, schedule="1f1b", microbatches=2, trainer=case)
            for case in cases for model in ("mlp", "tied", "mlp_sgd", "tied_sgd")]
    ranks = launch(2, runs, timeout=300)
    for index, run in enumerate(runs):
        expected = reference(run["kwargs"]["model"], **run["kwargs"]["trainer"])
        assert_trains_like(ranks, index, run, expected, str(run["kwargs"]))


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

    Compared: every gradient handed to the optimizer at every step (against one device's at the same weights) and
    the logged loss of every step. Not the weights (AdamW, see the module docstring): in attention some gradients are
    analytically zero (the key bias: softmax ignores a constant added to a row of scores) or nearly so.
    """
    expected = reference("gpt", max_steps=5)
    for world_size in (2, 4):
        run = pipelined("gpt", schedule="1f1b", microbatches=4, max_steps=5)
        ranks = launch(world_size, [run], timeout=200)
        # its perplexity, exp(loss), is logged with reduce_fx="mean": the mean over micro-batches of exp(micro-batch
        # loss), not exp(batch loss) (README, Limits), so only the loss is compared
        assert_trains_like(ranks, 0, run, expected, f"gpt on {world_size} stages", logged=("train_loss",))


def torch_interleaved_csv(path: Path, ranks: int, stages_per_rank: int, microbatches: int) -> str:
    """The CSV torch.distributed.pipelining writes for its own ScheduleInterleaved1F1B (built without a process group:
    its constructor reads only these attributes of its stages)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    stages = [SimpleNamespace(submod=torch.nn.Identity(), num_stages=ranks * stages_per_rank, group_size=ranks,
                              group_rank=0, stage_index=k * ranks) for k in range(stages_per_rank)]
    ScheduleInterleaved1F1B(stages, microbatches)._dump_csv(str(path), format="compute_comms")  # type: ignore[arg-type]
    return str(path)


@pytest.mark.parametrize("world_size", [2, 4])
def test_schedules_beyond_1f1b_match_single_device(world_size: int, tmp_path: Path) -> None:
    """interleaved_1f1b (2 stages per rank), zb_h1 (backward split into input and weight gradients) and zbv (both), at
    several micro-batch counts, and a schedule torch wrote as CSV; the tied models where they have enough blocks, and
    frozen first layers."""
    p = world_size
    runs = [pipelined("mlp", schedule=s, microbatches=m)
            for s, counts in (("interleaved_1f1b", [p, 2 * p]), ("zb_h1", [p, 2 * p, 3]), ("zbv", [p, 2 * p]))
            for m in counts]
    runs += [pipelined("tied_sgd", schedule="zb_h1", microbatches=p), pipelined("tied", schedule="zb_h1",
                                                                               microbatches=2 * p)]
    # frozen first layers: a stage's input without gradient still hands an (empty) gradient upstream
    runs += [pipelined("frozen_front", schedule=s, microbatches=2 * p) for s in ("zb_h1", "zbv")]
    if world_size == 2:  # 4 blocks: 2 stages per rank only fit on 2 ranks
        runs += [pipelined("tied_sgd", schedule="interleaved_1f1b", microbatches=p),
                 pipelined("tied_sgd", schedule="zbv", microbatches=2 * p)]
    runs.append(pipelined("mlp", schedule=torch_interleaved_csv(tmp_path / "torch.csv", p, 2, 2 * p)))
    ranks = launch(world_size, runs, timeout=380)
    for index, run in enumerate(runs):
        label = f"{world_size} ranks {run['kwargs']}"
        assert_trains_like(ranks, index, run, reference(run["kwargs"]["model"]), label)


def test_activation_checkpointing_matches_single_device_on_every_schedule() -> None:
    """Blocks recomputed in backward (every block, or every second one) give one device's gradients on every
    schedule, split backwards included."""
    schedules = ["naive", "gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv"]
    runs = [pipelined("mlp", schedule=s, microbatches=4, activation_checkpointing=True) for s in schedules]
    runs += [pipelined("tied_sgd", schedule=s, microbatches=4, activation_checkpointing=2) for s in ("1f1b", "zb_h1")]
    ranks = launch(2, runs, timeout=300)
    for index, run in enumerate(runs):
        assert_trains_like(ranks, index, run, reference(run["kwargs"]["model"]), str(run["kwargs"]))
