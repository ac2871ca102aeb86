"""Multi-process tier: full and sharded checkpoints, plain-Lightning loading, resuming across stage counts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _launch import launch
from models import MLPClassifier
from support import assemble, assert_params_close, epochs_run, single_device_state

from lightning_pp._nccl_emulation import ENV_VAR

pytestmark = pytest.mark.multiprocess


def test_full_checkpoint_loads_in_plain_lightning_and_resumes_everywhere(tmp_path: Path) -> None:
    uninterrupted = single_device_state(max_epochs=2)
    single_ckpt = str(tmp_path / "single.ckpt")
    single_device_state(max_epochs=1, save_to=single_ckpt)
    two_stage_ckpt = str(tmp_path / "two.ckpt")

    ranks = launch(2, [epochs_run(schedule="1f1b", microbatches=2, max_epochs=1, save_to=two_stage_ckpt,
                                  trainer={}),
                       epochs_run(schedule="gpipe", microbatches=2, max_epochs=2, ckpt_path=single_ckpt,
                                  trainer={})],
                   timeout=200)
    pipelined_epoch1, _ = assemble(ranks, 0)
    assert_params_close(assemble(ranks, 1)[0], uninterrupted, "single-device checkpoint resumed on 2 stages")

    # the pipelined checkpoint is a plain Lightning checkpoint: weights_only load, one device
    checkpoint = torch.load(two_stage_ckpt, weights_only=True)
    assert sorted(checkpoint["state_dict"]) == sorted(pipelined_epoch1)
    loaded = MLPClassifier.load_from_checkpoint(two_stage_ckpt, weights_only=True)
    assert_params_close(loaded.state_dict(), pipelined_epoch1, "load_from_checkpoint")
    resumed_single = single_device_state(max_epochs=2, ckpt_path=two_stage_ckpt)
    assert_params_close(resumed_single, uninterrupted, "2-stage checkpoint resumed on one device")

    ranks = launch(4, [epochs_run(schedule="1f1b", microbatches=4, max_epochs=2, ckpt_path=two_stage_ckpt,
                                  trainer={}),
                       epochs_run(schedule="dualpipev", microbatches=8, max_epochs=2, ckpt_path=two_stage_ckpt,
                                  trainer={}),
                       epochs_run(schedule="auto", max_epochs=2, ckpt_path=two_stage_ckpt, trainer={})],
                   timeout=200)
    assert_params_close(assemble(ranks, 0)[0], uninterrupted, "2-stage checkpoint resumed on 4 stages")
    assert_params_close(assemble(ranks, 1)[0], uninterrupted, "2-stage checkpoint resumed on DualPipeV's 8 stages")
    assert_params_close(assemble(ranks, 2)[0], uninterrupted, "2-stage checkpoint resumed as schedule='auto' chose")


def test_sharded_checkpoint_resumes_on_other_stage_counts(tmp_path: Path) -> None:
    uninterrupted = single_device_state(max_epochs=2)
    four = str(tmp_path / "four_stages.ckpt")
    ranks = launch(4, [epochs_run(schedule="gpipe", microbatches=4, max_epochs=1, save_to=four,
                                  checkpoint_format="sharded", trainer={})], timeout=200)
    # torch's distributed checkpoint: one file per rank (each stage writes its blocks), and the rest of the checkpoint
    assert sorted(p.name for p in Path(four).iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "checkpoint.pt"]
    ranks = launch(2, [epochs_run(schedule="1f1b", microbatches=2, max_epochs=2, ckpt_path=four,
                                  checkpoint_format="sharded", trainer={}),
                       epochs_run(schedule="dualpipev", microbatches=4, max_epochs=2, ckpt_path=four,
                                  checkpoint_format="sharded", trainer={})], timeout=200)
    assert_params_close(assemble(ranks, 0)[0], uninterrupted, "4-stage sharded checkpoint resumed on 2 stages")
    assert_params_close(assemble(ranks, 1)[0], uninterrupted, "4-stage sharded checkpoint resumed on DualPipeV's V")


def test_model_checkpoint_early_stopping_and_lr_monitor_decide_as_single_device(tmp_path: Path) -> None:
    import models

    expected = models.with_callbacks(str(tmp_path / "single"))
    assert expected["stopped_epoch"] > 0, "EarlyStopping should trigger in this configuration"
    ranks = launch(2, [{"scenario": "with_callbacks", "kwargs": {"dirpath": str(tmp_path / "pipe"),
                                                                  "schedule": "1f1b", "microbatches": 2}}],
                   timeout=300)
    for rank in ranks:
        assert not rank.errors, rank.errors
        got = rank.results[0]
        assert got["best_path"] == expected["best_path"]
        assert got["stopped_epoch"] == expected["stopped_epoch"] and got["epochs"] == expected["epochs"]
        assert [name for name, _ in got["top_k"]] == [name for name, _ in expected["top_k"]]
        assert abs(got["best_score"] - expected["best_score"]) < 1e-5
        assert got["files"] == expected["files"]
    assert ranks[0].results[0]["lr"] == expected["lr"]
    best = torch.load(tmp_path / "pipe" / expected["best_path"], weights_only=True)
    want = torch.load(tmp_path / "single" / expected["best_path"], weights_only=True)
    for name, value in want["state_dict"].items():
        torch.testing.assert_close(best["state_dict"][name], value, rtol=1e-5, atol=5e-6)


def test_a_checkpoint_saved_by_hand_after_fit_gathers_on_a_gloo_group_of_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under NCCL's emulation (object collectives on a gloo group of their own, as on NCCL), ``save_checkpoint``
    after ``fit`` (whose teardown destroyed that group) still gathers, and writes sharded checkpoints, over a gloo
    group and never over the default group: on a GPU that would be NCCL, with every stage's pickled state in global
    rank 0's GPU memory. The saved state is the trained one."""
    monkeypatch.setenv(ENV_VAR, "1")  # the ranks inherit the environment
    full, sharded = str(tmp_path / "full.ckpt"), str(tmp_path / "sharded")
    ranks = launch(2, [{"scenario": "save_by_hand_after_fit",
                        "kwargs": {"save_to": path, "schedule": "1f1b", "microbatches": 2, "checkpoint_format": form}}
                       for path, form in ((full, "full"), (sharded, "sharded"))], timeout=200)
    for rank in ranks:
        assert not rank.errors, rank.errors
        for run in rank.results:
            assert run["used"], "the checkpoint gathered nothing: the test no longer sees its collectives"
            assert all(group == "own" and backend == "gloo" for _, group, backend in run["used"]), run["used"]
    trained, _ = assemble(ranks, 0)
    assert_params_close(torch.load(full, weights_only=True)["state_dict"], trained, "full checkpoint saved after fit")
    assert (Path(sharded) / ".metadata").exists() and (Path(sharded) / "checkpoint.pt").exists()
