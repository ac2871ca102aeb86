"""Multi-process tier: bad configurations fail on every rank with our error; a dead peer is an error, not a hang."""

from __future__ import annotations

import time

from _launch import launch
from support import check_dead_peer_raises_timeout_on_the_other_rank, check_user_error_reaches_the_other_stage


def test_configuration_errors_on_every_rank() -> None:
    runs = [
        {"scenario": "expect_error", "kwargs": {"model": "mlp", "balance": [3, 3]}},
        {"scenario": "expect_error", "kwargs": {"model": "mlp", "blocks": "head"}},
        {"scenario": "expect_error", "kwargs": {"model": "two_sequentials"}},
        {"scenario": "expect_error", "kwargs": {"model": "too_few_layers", "blocks": "layers"}},
        {"scenario": "expect_error", "kwargs": {"model": "manual"}},
        {"scenario": "expect_error", "kwargs": {"model": "parameterless_stage", "blocks": "layers"}},
    ]
    expected = [
        r"balance=[3, 3] sums to 6 but the block container has 8 blocks",
        r"has Linear at 'head', not an nn.Sequential, nn.ModuleList or nn.ModuleDict of blocks. Containers of "
        r"repeated blocks found: 'layers' (8 blocks, ",
        r"several containers of repeated blocks of similar size: 'encoder' (8 blocks, 1,304 parameters), 'decoder' "
        r"(3 blocks, 816 parameters)",
        r"The block container has 1 blocks but the pipeline has 2 stages",
        r"uses manual optimization",
        r"configure_optimizers failed on 1 pipeline stage(s): stage 1 (ValueError: optimizer got an empty parameter "
        r"list; it holds blocks 2-3 of `layers` and 0 parameters, 0 trainable, counting those outside the "
        r"blocks). Each stage's optimizer gets only that stage's parameters",
    ]
    ranks = launch(2, runs, timeout=200)
    for rank in ranks:
        assert rank.returncode == 0, rank.output[-3000:]
        for index, message in enumerate(expected):
            error = rank.results[index]
            assert error["type"] == "PipelineConfigError", (message, error)
            assert message in error["message"], (message, error["message"])


def test_user_error_on_one_stage_reaches_the_other() -> None:
    """The first stage's step fails; the last stage, waiting for its activation, fails naming the action and peer."""
    check_user_error_reaches_the_other_stage()


def test_stuck_rank_ends_when_its_peer_fails() -> None:
    """Stage 1 gets stuck for good (SIGTERM ignored); stage 0 times out, and its failure ends stage 1 too."""
    start = time.monotonic()
    ranks = launch(2, [{"scenario": "stuck_at_step", "kwargs": {"model": "mlp", "rank_to_hang": 1, "step": 1,
                                                                 "timeout": 5}}], timeout=100)
    assert time.monotonic() - start < 90
    error = ranks[0].errors[0]
    assert error["type"] == "PipelineTimeoutError", error
    assert ranks[1].returncode == 1, ranks[1].output[-2000:]
    said = "lightning_pp: rank 1 ends: stage 0 (rank 0) failed: PipelineTimeoutError: Pipeline stage 0"
    assert said in ranks[1].output


def test_dead_peer_raises_timeout_on_the_other_rank() -> None:
    check_dead_peer_raises_timeout_on_the_other_rank()


def test_hung_middle_stage_fails_every_other_stage() -> None:
    """Stage 1 of 4 stops responding: its neighbours time out naming it; the far stage times out too."""
    ranks = launch(4, [{"scenario": "hang_at_step", "kwargs": {"model": "mlp", "rank_to_hang": 1, "step": 1,
                                                                "timeout": 5}}], timeout=150)
    for rank in (0, 2, 3):
        error = ranks[rank].errors.get(0)
        assert error is not None, ranks[rank].output[-2000:]
        assert error["type"] in ("PipelineTimeoutError", "PipelineCommError"), error
        assert f"Pipeline stage {rank} (rank {rank}) failed in action {rank}" in error["message"], error["message"]


def test_outputs_of_other_stages_blocks_are_refused_not_trained_wrong() -> None:
    """A loss over every block's output (same shapes: silently wrong before) and skip connections across stages
    (a raw shape error before): our error on the stage that reads them, naming the pattern and the way out."""
    runs = [{"scenario": "expect_error", "kwargs": {"model": model, "blocks": "layers", "schedule": "1f1b",
                                                    "microbatches": 2, "timeout": 10}}
            for model in ("all_hidden_states", "skips_across_stages")]
    ranks = launch(2, runs, timeout=200)
    expected = ["is computed from the output of a block held by another pipeline stage",  # the logged loss, first
                "failed on the output of a block held by another pipeline stage"]
    for index, message in enumerate(expected):
        error = ranks[1].results[index]
        assert error["type"] == "PipelineConfigError" and message in error["message"], error
        assert "A stage receives only the output of the block just before its own blocks" in error["message"]
        assert ranks[0].results[index]["type"] != "none", ranks[0].results[index]  # the other stage fails too


def test_blocks_run_on_one_rank_only_in_a_hook_fail_naming_the_hook() -> None:
    """A hook running the blocks under ``if self.global_rank == 0``: rank 0 waits for the other stage's output in
    vain, and raises our error naming the hook and the fix within the transfer timeout, instead of hanging."""
    start = time.monotonic()
    ranks = launch(2, [{"scenario": "expect_error", "kwargs": {"model": "sequential_in_hook", "timeout": 5}}],
                   timeout=100)
    assert time.monotonic() - start < 90
    error = ranks[0].results[0]
    assert error["type"] == "PipelineCommError", error
    assert "in `on_train_epoch_end`" in error["message"] and "if self.global_rank == 0" in error["message"], error


def test_too_few_blocks_errors_say_what_is_wrong_on_every_rank() -> None:
    """Issue 39, finding 8: a container of 1 block found automatically was reported as no container; interleaved
    with too few blocks advised fewer devices."""
    runs = [{"scenario": "expect_error", "kwargs": {"model": "too_few_layers"}},
            {"scenario": "expect_error", "kwargs": {"model": "mlp", "schedule": "interleaved_1f1b",
                                                    "stages_per_rank": 5, "microbatches": 4, "timeout": 10}}]
    expected = ["TooFewLayers's block container 'layers' (Sequential, 272 parameters) has 1 block",
                "8 blocks but stages_per_rank=5 on 2 ranks makes 10 stages (5 x 2); every stage needs at least one "
                "block. Use stages_per_rank=4 or fewer, or schedule='1f1b'"]
    ranks = launch(2, runs, timeout=200)
    for rank in ranks:
        for index, message in enumerate(expected):
            error = rank.results[index]
            assert error["type"] == "PipelineConfigError" and message in error["message"], (message, error)
