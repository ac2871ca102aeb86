"""Multi-process tier: how a job ends. A failure with a callback that saves on exception ends every rank as fast as a
plain failure; SIGTERM to every rank stops a synchronous schedule at a step's end, with a checkpoint equal to one
device's at that step; many fits in one process leave no thread, descriptor or socket behind (issue 39, findings 5-8).
Scenarios in tests/teardown_scenarios.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _launch import launch


@pytest.mark.timeout(400)
def test_twenty_fits_keep_threads_and_descriptors_flat() -> None:
    """Each fit left its process groups alive (held by the closed run's session through a bound method the
    checkpoints kept): 9 threads and 15 descriptors (6 sockets) more per fit. Counted after fit 2 and fit 20."""
    ranks = launch(2, [{"scenario": "teardown_scenarios:resources_over_fits", "kwargs": {"fits": 20}}], timeout=360)
    for rank in ranks:
        assert rank.returncode == 0 and not rank.errors, rank.output[-3000:]
        counts = rank.results[0]
        second, last = counts[1], counts[-1]
        assert last["os_threads"] <= second["os_threads"] + 2, [c["os_threads"] for c in counts]
        assert last["fds"] <= second["fds"] + 4, [c["fds"] for c in counts]
        assert last["sockets"] <= second["sockets"] + 1, [c["sockets"] for c in counts]
        assert not [name for name in last["threads"] if name.startswith("lightning_pp")], last["threads"]


def _stuck_rank(dirpath: str | None) -> list:
    """Stage 1 stuck for good at step 1 (SIGTERM ignored), with ``OnExceptionCheckpoint(dirpath)`` (None: without):
    the ranks. Before the fix the job was killed at the launch's timeout (a LaunchTimeoutError)."""
    return launch(2, [{"scenario": "teardown_scenarios:fail_with_on_exception_checkpoint",
                       "kwargs": {"dirpath": dirpath, "how": "stuck", "rank": 1, "step": 1, "timeout": 5}}],
                  timeout=150)


def test_a_failure_with_on_exception_checkpoint_ends_as_fast_as_without_it(tmp_path: Path) -> None:
    """Stage 1 gets stuck for good at step 1, with Lightning's OnExceptionCheckpoint: stage 0 times out naming the
    action and the peer; before, its on_exception save waited in a gather stage 1 never joins (the process group's 30
    minutes: the job was killed at 150 s), since the failure word was set only after the callbacks. Now the failure is
    told to every rank before any callback runs, the save is skipped (a warning says why) and no file is written; each
    rank ends when it does without the callback (stage 1 by its watcher, ``timeout + 5`` s after the failure)."""
    plain = _stuck_rank(None)
    ranks = _stuck_rank(str(tmp_path))
    ended, without = ranks[0].results[0], plain[0].results[0]
    assert ended is not None, ranks[0].output[-3000:]
    assert ended["type"] == without["type"] == "PipelineTimeoutError", (ended, without)
    assert "Pipeline stage 0 (rank 0) failed in action" in ended["message"] and "rank 1" in ended["message"], ended
    assert ended["seconds"] < without["seconds"] + 3, (ended, without)
    assert "skipped: the job failed (stage 0 (rank 0) failed: PipelineTimeoutError" in ranks[0].output
    assert ranks[1].returncode == plain[1].returncode == 1, ranks[1].output[-2000:]
    assert "lightning_pp: rank 1 ends: stage 0 (rank 0) failed: PipelineTimeoutError" in ranks[1].output
    assert not list(tmp_path.iterdir()), list(tmp_path.iterdir())

    # a user's error on stage 1 (not in a transfer): it ends at once, stage 0 with our error naming itself and the peer
    ranks = launch(2, [{"scenario": "teardown_scenarios:fail_with_on_exception_checkpoint",
                        "kwargs": {"dirpath": str(tmp_path), "how": "raise", "rank": 1, "step": 1, "timeout": 5}}],
                   timeout=120)
    first, second = (rank.results[0] for rank in ranks)
    assert second["type"] == "RuntimeError" and second["seconds"] < 5, second
    assert first["type"] in ("PipelineTimeoutError", "PipelineCommError"), first
    assert "Pipeline stage 0 (rank 0) failed in action" in first["message"] and "rank 1" in first["message"], first
    assert first["seconds"] < 5 + 5, first
    assert not list(tmp_path.iterdir()), list(tmp_path.iterdir())


def test_sigterm_to_every_rank_stops_a_synchronous_schedule_at_a_steps_end(tmp_path: Path) -> None:
    """Every rank receives SIGTERM mid-backward in step 1 (1F1B, 2 stages): before, Lightning's handler broadcast
    inside the signal handler and the job ended by the transfer timeout (34 s with timeout=30). Now every rank stops
    at step 1's end within a few seconds, and OnExceptionCheckpoint's file holds one device's state at that step, which
    a resumed run (pipelined or on one device) goes on from alike."""
    from models import fit
    from support import assemble, assert_params_close

    ranks = launch(2, [{"scenario": "teardown_scenarios:sigterm_every_rank",
                        "kwargs": {"dirpath": str(tmp_path), "step": 1, "timeout": 30}}], timeout=120)
    for rank in ranks:
        ended = rank.results[0]
        assert ended is not None, rank.output[-3000:]
        assert ended["type"] == "AgreedSigterm", ended
        assert ended["global_step"] == 2 and ended["seconds"] < 10, ended
    saved = tmp_path / "on_exception.ckpt"
    checkpoint = torch.load(saved, weights_only=False)
    assert checkpoint["global_step"] == 2, checkpoint["global_step"]
    one_device = fit("mlp", max_steps=2).module
    optimizer = one_device.trainer.optimizers[0].state_dict()
    assert_params_close(checkpoint["state_dict"], one_device.state_dict(), "OnExceptionCheckpoint at step 2")
    for index, state in optimizer["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(checkpoint["optimizer_states"][0]["state"][index][key], value, rtol=0,
                                       atol=1e-6, msg=f"optimizer state {index} {key}")

    ranks = launch(2, [{"scenario": "train", "kwargs": {"model": "mlp", "max_steps": 6, "ckpt_path": str(saved)}}],
                   timeout=120)
    resumed, _ = assemble(ranks, 0)
    single = fit("mlp", max_steps=6, ckpt_path=str(saved)).result["state"]
    assert_params_close(resumed, single, "resumed from OnExceptionCheckpoint")
