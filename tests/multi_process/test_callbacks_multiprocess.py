"""Lightning's own callbacks under the pipeline: weight averaging's checkpoints equal one device's file entry by entry,
the callbacks that cannot give one device's result are refused at setup, norms with batch statistics are warned
about, ``ThroughputMonitor`` logs what one device logs (the outcome for every callback: docs/compatibility.md).
The single-process tests are in ``single_process/test_callbacks.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import callback_scenarios
import pytest
import torch
from _launch import launch
from support import ATOL, RTOL, prefixed

_CHECKPOINT_ENTRIES = ("state_dict", "current_model_state", "averaging_state", "global_step", "epoch")


def _assert_same_entries(got: Any, want: Any, label: str) -> None:
    """Equal structure; tensors within the tolerances, everything else equal."""
    if isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=prefixed(label))
    elif isinstance(want, dict):
        assert sorted(got) == sorted(want), (label, sorted(set(got) ^ set(want)))
        for key, value in want.items():
            _assert_same_entries(got[key], value, f"{label}.{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), label
        for index, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same_entries(g, w, f"{label}[{index}]")
    else:
        assert got == want, (label, got, want)


def _assert_same_file(got_path: Path, want_path: Path) -> None:
    got, want = torch.load(got_path, weights_only=True), torch.load(want_path, weights_only=True)
    for entry in _CHECKPOINT_ENTRIES:
        _assert_same_entries(got[entry], want[entry], f"{got_path.name}: {entry}")
    averaging = [k for k in want["callbacks"] if k.startswith("EMAWeightAveraging")]
    assert averaging and all(got["callbacks"][k] == want["callbacks"][k] for k in averaging), got["callbacks"]
    for index, (g, w) in enumerate(zip(got["optimizer_states"], want["optimizer_states"], strict=True)):
        _assert_same_entries(g["state"], w["state"], f"{got_path.name}: optimizer_states[{index}]")


@pytest.mark.timeout(400)
def test_weight_averaging_checkpoints_equal_one_devices_file(tmp_path: Path) -> None:
    """``EMAWeightAveraging``: every ``ModelCheckpoint`` file and the one saved by hand after fit hold the whole
    averaged model (``state_dict``), the live one (``current_model_state``) and the averaging state as one device's
    file does, entry by entry: every weight inside the blocks (the last stage's gathered from another rank), weights
    outside them kept where used (the averaged copy follows the stage's weights), Hugging Face GPT-2 (tied head), and
    a pipelined run resumed from a pipelined file; validation during fit (the averages swapped in) and ``validate``
    after it give one device's values."""
    models = ("blocks_only", "validated_mlp", "hf_gpt2")
    wants = [callback_scenarios.averaged(model, str(tmp_path / "one" / model)) for model in models]
    wants.append(callback_scenarios.averaged("validated_mlp", str(tmp_path / "one" / "resumed"),
                                             ckpt_path=str(tmp_path / "one" / "validated_mlp" / "step=2.ckpt")))
    runs = [{"model": model, "dirpath": str(tmp_path / "pipe" / model)} for model in models]
    runs.append({"model": "validated_mlp", "dirpath": str(tmp_path / "pipe" / "resumed"),
                 "ckpt_path": str(tmp_path / "pipe" / "validated_mlp" / "step=2.ckpt")})
    ranks = launch(2, [{"scenario": "callback_scenarios:pipelined_averaged",
                        "kwargs": {"runs": runs, "schedule": "1f1b", "microbatches": 2}}], timeout=300)
    assert not any(rank.errors for rank in ranks), [rank.errors for rank in ranks]
    for index, name in enumerate((*models, "resumed")):
        got, want = ranks[0].results[0][index], wants[index]
        assert [m for _, m in got["history"] if "val_loss" in m] == [m for _, m in want["history"] if "val_loss" in m]
        if "validate" in want:
            validations = 2 if name == "resumed" else 3  # at steps 2 (not when resumed there) and 4, and validate
            assert len([m for _, m in want["history"] if "val_loss" in m]) == validations, want["history"]
            for rank in ranks:
                (validated,) = rank.results[0][index]["validate"]
                assert validated == pytest.approx(want["validate"][0], abs=1e-6), name
        files = sorted(p.name for p in (tmp_path / "one" / name).iterdir())
        assert files == ["after_fit.ckpt", *(["step=2.ckpt"] if name != "resumed" else []), "step=4.ckpt"], files
        assert sorted(p.name for p in (tmp_path / "pipe" / name).iterdir()) == files, name
        for file in files:
            _assert_same_file(tmp_path / "pipe" / name / file, tmp_path / "one" / name / file)


@pytest.mark.timeout(400)
def test_weight_averaging_under_split_backward_schedules_equals_one_devices_file(tmp_path: Path) -> None:
    """The same files, entry by entry, under the schedules that split the backward: ZB-H1 (one stage per rank) and
    ZBV (two per rank, in a V: the last stage's blocks live on rank 0 beside the first's)."""
    models = ("blocks_only", "validated_mlp")
    wants = {model: callback_scenarios.averaged(model, str(tmp_path / "one" / model)) for model in models}
    jobs = [{"scenario": "callback_scenarios:pipelined_averaged",
             "kwargs": {"runs": [{"model": model, "dirpath": str(tmp_path / schedule / model)} for model in models],
                        "schedule": schedule, "microbatches": 4}} for schedule in ("zb_h1", "zbv")]
    ranks = launch(2, jobs, timeout=300)
    assert not any(rank.errors for rank in ranks), [rank.errors for rank in ranks]
    for job_index, schedule in enumerate(("zb_h1", "zbv")):
        for index, model in enumerate(models):
            got, want = ranks[0].results[job_index][index], wants[model]
            assert [m for _, m in got["history"] if "val_loss" in m] == [
                m for _, m in want["history"] if "val_loss" in m], (schedule, model)
            files = sorted(p.name for p in (tmp_path / "one" / model).iterdir())
            assert sorted(p.name for p in (tmp_path / schedule / model).iterdir()) == files, (schedule, model)
            for file in files:
                _assert_same_file(tmp_path / schedule / model / file, tmp_path / "one" / model / file)


@pytest.mark.timeout(300)
def test_norms_with_batch_statistics_warn_once_and_throughput_logs_what_one_device_logs() -> None:
    """A BatchNorm and an InstanceNorm with running statistics in the blocks: one warning on global rank 0 naming
    both, saying what the result equals and how to get one device's; none with one micro-batch. ``ThroughputMonitor``
    counts the pipeline as one device: the keys one device logs, and training as one device's."""
    want = callback_scenarios.throughput()
    ranks = launch(2, [{"scenario": "callback_scenarios:normed_warnings", "kwargs": {"microbatches": 2}},
                       {"scenario": "callback_scenarios:normed_warnings", "kwargs": {"microbatches": 1}},
                       {"scenario": "callback_scenarios:pipelined_throughput",
                        "kwargs": {"schedule": "1f1b", "microbatches": 2}}], timeout=200)
    assert not any(rank.errors for rank in ranks), [rank.errors for rank in ranks]
    (message,) = ranks[0].results[0]
    assert "layers.0.1 (BatchNorm1d), layers.2.2 (InstanceNorm1d) compute" in message, message
    assert "GroupNorm" not in message.split(" compute ")[0], message
    assert "accumulating gradients over 2 micro-batches" in message and "microbatches=1" in message, message
    assert ranks[1].results[0] == [] and ranks[0].results[1] == [] and ranks[1].results[1] == []
    got = ranks[0].results[2]
    assert got["keys"] == want["keys"], (got["keys"], want["keys"])
    state = {**ranks[1].results[2]["state"], **{k: v for k, v in got["state"].items() if k.startswith("layers.0")}}
    for name in ("layers.0.weight", "layers.6.weight", "head.weight"):
        torch.testing.assert_close(state[name], want["state"][name], rtol=RTOL, atol=ATOL, msg=prefixed(name))


@pytest.mark.timeout(400)
def test_tuner_lr_find_and_the_callbacks_that_need_nothing_equal_one_device() -> None:
    """``Tuner.lr_find`` (its learning rates, losses and suggestion, then the weights it restores), and a fit with
    ``GradientAccumulationScheduler``, ``SpikeDetection``, ``Timer``, ``LambdaCallback``, ``DeviceStatsMonitor``,
    ``RichProgressBar``, ``RichModelSummary``, ``EarlyStopping`` and ``LearningRateMonitor``: every logged key at every
    step, the logged values, what ``on_train_batch_end`` gets, the steps and the weights as on one device; then what a
    ``BasePredictionWriter`` is handed in ``predict``, on every rank."""
    want = callback_scenarios.sweep()
    ranks = launch(2, [{"scenario": "callback_scenarios:pipelined_sweep",
                        "kwargs": {"schedule": "1f1b", "microbatches": 2}}], timeout=300)
    assert not any(rank.errors for rank in ranks), [rank.errors for rank in ranks]
    got = ranks[0].results[0]
    assert got["lr_find"]["lr"] == want["lr_find"]["lr"] and len(want["lr_find"]["lr"]) == 16
    assert got["lr_find"]["loss"] == pytest.approx(want["lr_find"]["loss"], abs=1e-5)
    assert got["lr_find"]["suggested"] == want["lr_find"]["suggested"] != 0.01, (got["lr_find"], want["lr_find"])
    assert got["logged"] == want["logged"] and got["global_step"] == want["global_step"] == 8
    assert ranks[1].results[0]["losses"] == got["losses"]
    assert got["losses"] == pytest.approx(want["losses"], abs=1e-5) and len(want["losses"]) == 12
    for (step, values), (want_step, want_values) in zip(got["values"], want["values"], strict=True):
        assert step == want_step and values == pytest.approx(want_values, abs=1e-5), (step, values, want_values)
    state = {**ranks[1].results[0]["state"], **got["state"]}
    for name, value in want["state"].items():
        torch.testing.assert_close(state[name], value, rtol=RTOL, atol=ATOL, msg=prefixed(name))
    assert len(want["written"]) == 4
    for rank in ranks:
        torch.testing.assert_close(rank.results[0]["written"], want["written"], rtol=RTOL, atol=ATOL)


@pytest.mark.timeout(300)
def test_weight_averaging_with_replicas_equals_one_device(tmp_path: Path) -> None:
    """2 replicas x 2 stages, every replica loading every batch (no distributed sampler, so one device is the
    reference): each replica averages the same weights, and the files (replica 0's gathered) and validation equal one
    device's."""
    want = callback_scenarios.averaged("validated_mlp", str(tmp_path / "one"))
    ranks = launch(4, [{"scenario": "callback_scenarios:pipelined_averaged",
                        "kwargs": {"runs": [{"model": "validated_mlp", "dirpath": str(tmp_path / "pipe")}],
                                   "schedule": "1f1b", "microbatches": 2, "pipeline_parallel_size": 2}}], timeout=200)
    assert not any(rank.errors for rank in ranks), [rank.errors for rank in ranks]
    got = ranks[0].results[0][0]
    assert [m for _, m in got["history"] if "val_loss" in m] == [m for _, m in want["history"] if "val_loss" in m]
    for rank in ranks:
        assert rank.results[0][0]["validate"][0] == pytest.approx(want["validate"][0], abs=1e-6)
    for file in ("step=2.ckpt", "step=4.ckpt", "after_fit.ckpt"):
        _assert_same_file(tmp_path / "pipe" / file, tmp_path / "one" / file)


