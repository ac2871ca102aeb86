"""Balancing the stages: the exact min-max split against brute force, parameter counts, and balance="time" measured
in one process (2 or 3 stages on one rank, interleaved 1F1B) and on 2 ranks. No timing is asserted: the models that
must be split by time sleep in their blocks, so the split they get does not depend on the machine's load.
The single-process tests are in ``single_process/test_balance.py``."""

from __future__ import annotations

from _launch import launch
from support import assert_trains_like, pipelined, reference

# ------------------------------------------------------------------------------------------------ the exact split


# ------------------------------------------------------------------------------------------------ arguments


# ------------------------------------------------------------------------------------------------ in one process


# ------------------------------------------------------------------------------------------------ on two ranks


def test_time_balance_on_two_ranks() -> None:
    """Rank 0 measures and broadcasts: both ranks split alike ([1, 7]: rank 0 holds the slow block alone), training
    equals one device's (the probe left the shuffling loader's generator alone), and a probe that fails on rank 0
    is a PipelineConfigError on both ranks."""
    run = pipelined("slow_first8", schedule="1f1b", microbatches=2, balance="time")
    failing = {"scenario": "expect_error", "kwargs": {"model": "uncopyable", "balance": "time"}}
    ranks = launch(2, [run, failing], timeout=200)
    blocks = [sorted(k for k in rank.results[0]["state"] if k.startswith("layers.")) for rank in ranks]
    assert blocks == [["layers.0.scale"], [f"layers.{i}.scale" for i in range(1, 8)]]
    assert "balance='time' split [1, 7]" in ranks[0].output
    assert_trains_like(ranks, 0, run, reference("slow_first8"), "balance='time' on 2 ranks")
    for rank in ranks:
        error = rank.results[1]
        assert error["type"] == "PipelineConfigError", error
        assert "measuring the blocks of `layers` on global rank 0 failed (TypeError: cannot pickle" in error["message"]

