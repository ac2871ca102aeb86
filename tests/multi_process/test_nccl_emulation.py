"""NCCL's control flow on CPU (``LIGHTNING_PP_NCCL_EMULATION=1``, see :mod:`lightning_pp.parallel.nccl_emulation`):
headers on the host in gloo groups of their own, payloads posted in batches and polled for completion as NCCL's are,
object collectives on a gloo group. Each test here failed, stalled or read garbage before the fault it names was fixed.

The emulated tier is a subset of the multi-process tiers, on 2 ranks: equivalence (1F1B, GPipe with a micro-batch count
that does not divide the batch, interleaved (four transfer groups), ZB-H1 and ZBV, a weight shared by the first and
the last stage), the lifecycle (validation, test, predict, torchmetrics, step outputs), PyTorch's
``nn.TransformerEncoder`` (nested tensors crossing stages in evaluation), a full checkpoint gathered and resumed, the
monitor, and the failure tier (a user error on one stage, a dead peer).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _launch import launch
from models import step_outputs
from support import (
    assemble,
    assert_matches,
    assert_params_close,
    assert_runs_as_scheduled,
    assert_same_outputs,
    assert_trains_like,
    check_all,
    check_dead_peer_raises_timeout_on_the_other_rank,
    check_lifecycle,
    check_user_error_reaches_the_other_stage,
    delayed_reference,
    epochs_run,
    like,
    pipelined,
    reference,
    schedule_for,
    single_device_state,
)

from lightning_pp.parallel.nccl_emulation import ENV_VAR
from lightning_pp.schedule.simulate import COMM_WAIT, FORWARD


@pytest.fixture(autouse=True)
def _nccl_emulation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "1")  # the ranks inherit the environment


def test_transfers_end_their_step_without_stalling() -> None:
    """Finding 1: the headers' gloo sends were polled like NCCL's payloads, and a gloo send reports completion only
    once waited for, so every step's end stalled for ``timeout`` seconds and then failed."""
    steps = [[("float32", [4, 3]), ("int64", [3])], [("float32", [2, 5]), ("int64", [3])]]
    ranks = launch(2, [{"scenario": "p2p_exchange", "kwargs": {"steps": steps, "header_groups": True, "timeout": 5}}],
                   timeout=180)
    for rank in ranks:
        assert not rank.errors, rank.errors
        assert [[list(t.shape) for t in step] for step in rank.results[0]] == [[s for _, s in step] for step in steps]


def test_nested_tensors_arrive_intact_with_headers_on_the_host() -> None:
    """Finding 3: a nested tensor was rebuilt (its sizes read, its values copied) before its payloads were received:
    sizes (2, 3), (4, 3) arrived as (4, 3), (4, 3) of uninitialised memory."""
    sizes = [[2, 3], [4, 3], [1, 3]]
    ranks = launch(2, [{"scenario": "p2p_nested", "kwargs": {"sizes": sizes}}], timeout=180)
    assert not ranks[1].errors, ranks[1].errors
    assert ranks[1].results[0] == [[i + 7.0] * (rows * cols) for i, (rows, cols) in enumerate(sizes)]


def test_payload_wait_is_timed_as_communication_not_compute() -> None:
    """Finding 5: the compute's clock started before the payloads were posted and waited for, so forward and backward
    absorbed the wait for the peer's payload."""
    delay = 0.5
    ranks = launch(2, [{"scenario": "payload_wait_timing", "kwargs": {"delay": delay}}], timeout=180)
    assert not ranks[1].errors, ranks[1].errors
    events = ranks[1].results[0]
    forward = sum(seconds for action, category, seconds in events if category == FORWARD)
    waiting = sum(seconds for action, category, seconds in events if action == "1RECV_F0" and category == COMM_WAIT)
    assert forward < 0.5 * delay, events
    assert waiting > 0.8 * delay, events


def test_schedules_match_single_device() -> None:
    runs = [pipelined("mlp", schedule=s, microbatches=m)
            for s, m in [("1f1b", 4), ("gpipe", 3), ("interleaved_1f1b", 4), ("zb_h1", 4), ("zbv", 4),
                         ("dualpipev", 4)]]
    runs += [pipelined("tied_sgd", schedule="1f1b", microbatches=2)]
    ranks = launch(2, runs, timeout=300)
    for index, run in enumerate(runs):
        assert_trains_like(ranks, index, run, reference(run["kwargs"]["model"]), f"emulated NCCL {run['kwargs']}")


def test_pipedream_2bw_follows_its_rule() -> None:
    """The asynchronous stream under NCCL's control flow (headers on the host, payloads batched and polled), its
    sends left pending across a step's end: as one device applying the rule, a tied weight on the first and the last
    stage."""
    run = {"scenario": "train", "kwargs": {"model": "tied_sgd", "schedule": "pipedream_2bw", "microbatches": 4,
                                           "max_steps": 6}}
    full, history = assemble(launch(2, [run], timeout=120), 0)
    assert_matches(full, history, delayed_reference("tied_sgd", max_steps=6), "pipedream_2bw, emulated NCCL")


def test_validation_test_predict_and_metrics_match_single_device() -> None:
    check_lifecycle(2, [("1f1b", 2), ("interleaved_1f1b", 8)])


def test_pytorch_transformer_encoder_evaluates_on_nested_tensors(tmp_path: Path) -> None:
    run = pipelined("torch_encoder", schedule="1f1b", microbatches=2, dirpath=str(tmp_path / "encoder"))
    check_all(2, [run], [like("torch_encoder")], timeout=180)


def test_full_checkpoint_gathers_on_the_object_group(tmp_path: Path) -> None:
    """Finding 7: the full checkpoint is gathered through a gloo group of its own (on NCCL the default group's
    ``gather_object`` would allocate the largest object times the world on rank 0's GPU)."""
    uninterrupted = single_device_state(max_epochs=2)
    saved = str(tmp_path / "two.ckpt")
    ranks = launch(2, [epochs_run(schedule="1f1b", microbatches=2, max_epochs=1, save_to=saved, trainer={}),
                       epochs_run(schedule="1f1b", microbatches=2, max_epochs=2, ckpt_path=saved, trainer={})],
                   timeout=200)
    assert_params_close(assemble(ranks, 1)[0], uninterrupted,
                        "emulated NCCL: saved after one epoch, resumed for the second")


def test_monitor_gathers_a_timeline_of_1f1b(tmp_path: Path) -> None:
    """Stage clocks, the timed step and the timelines gathered on the object group: the trace follows the schedule
    (no timing is asserted: benchmarks/bubbles.py measures the bubble)."""
    ranks = launch(2, [{"scenario": "monitored", "kwargs": {"model": "sleepy2", "schedule": "1f1b", "microbatches": 4,
                                                             "log_dir": str(tmp_path), "max_steps": 1,
                                                             "timeline_every_n_steps": 1}}], timeout=200)
    assert not ranks[0].errors, ranks[0].errors
    (step,) = ranks[0].results[0]["history"]
    assert 0 < step["pipeline/bubble_fraction"] < 1, step
    trace = json.loads((tmp_path / "traces" / "pipeline_step0.json").read_text())
    assert_runs_as_scheduled(trace, schedule_for("1f1b", 2, 4))


@pytest.mark.timeout(200)
def test_pipedream_2bw_with_the_monitor_ends_its_timed_steps() -> None:
    """Issue 37, finding 1: with PipelineMonitor attached pipedream_2bw deadlocked on NCCL. The step's results were
    broadcast at its end, after the timed step's synchronize, which waits for the last stage's final send; stage 0
    posts that send's receive only in its next step, which it starts after the broadcast. Here the synchronize waits
    for the emulated operations in flight (see lightning_pp.parallel.nccl_emulation): before the fix the last stage
    failed after the transfers' timeout (5 s) with a PipelineTimeoutError naming that send. The tied embedding/head adds
    collectives at every step's end (its gradient summed over the two stages; the placement of the weights outside
    the blocks after step 0), which met the last stage's timed synchronize the same way until NCCL's cuts of the
    stream left no send in flight across a step's end; there every step is timed, the last one too."""
    runs = [{"scenario": "monitored", "kwargs": {"model": model, "schedule": "pipedream_2bw", "microbatches": 4,
                                                 "log_dir": None, "max_steps": 4, "logging_interval": interval,
                                                 "timeline_every_n_steps": 0, "timeout": 5}}
            for model, interval in (("sleepy2", 2), ("tied", 1))]
    ranks = launch(2, runs, timeout=150)
    for rank in ranks:
        assert not rank.errors, rank.errors
    for index, steps in enumerate(([0.0, 2.0], [0.0, 1.0, 2.0, 3.0])):
        history = ranks[0].results[index]["history"]
        assert [h["step"] for h in history] == steps, history
        assert all(0.0 <= h["pipeline/bubble_fraction"] <= 1.0 for h in history), history  # (no timing asserted)


@pytest.mark.timeout(150)
def test_results_travel_point_to_point_on_a_gloo_group_of_their_own() -> None:
    """Issue 37, finding 2: on NCCL the step's results were broadcast on the lane's NCCL group at the step's end, so
    every stage's host waited there for the last stage (pipedream_2bw lost its overlap between batches), and ranks
    entered two communicators in different orders. They take the path NCCL takes under the emulation: point to point
    in the results' own gloo group, without a single collective (one would raise here), loss, 20 logged numbers and
    outputs intact."""
    steps = 3
    ranks = launch(2, [{"scenario": "result_exchange", "kwargs": {"steps": steps, "host_group": True}}], timeout=120)
    for rank_index, rank in enumerate(ranks):
        assert not rank.errors, rank.errors
        arrived = rank.results[0]
        assert [got["collectives"] for got in arrived] == [0] * 2 * steps
        for index, got in enumerate(arrived):
            step = index // 2
            assert got["loss"] == 0.5 + step and len(got["logged"]) == 20, (rank_index, index)
            if index % 2 == 0:
                assert_same_outputs(got["outputs"], step_outputs(step))


def test_user_error_on_one_stage_reaches_the_other() -> None:
    check_user_error_reaches_the_other_stage()


def test_dead_peer_raises_timeout_on_the_other_rank() -> None:
    check_dead_peer_raises_timeout_on_the_other_rank()
