"""``schedule="auto"``'s closed loop (:mod:`lightning_pp.tuning.closed_loop`): the decision on measurements given by
hand (single process), and every rank switching at the same step while training stays exact (2 ranks).
The single-process tests are in ``single_process/test_closed_loop.py``."""

from __future__ import annotations

import re

import pytest
from _launch import launch
from support import assert_trains_like, reference

from lightning_pp.tuning.search import Candidate, MeasuredCosts, search

BLOCKS, BATCH = 8, 32


def configuration(measured: MeasuredCosts, schedule: str, microbatches: int, balance: tuple[int, ...]) -> Candidate:
    return next(c for c in search(measured, 2, BATCH, microbatches=microbatches, stages_per_rank=1, balance=balance,
                                  recompute=False) if c.schedule == schedule)


@pytest.mark.timeout(400)
def test_the_closed_loop_switches_every_rank_at_the_same_step_and_trains_as_one_device() -> None:
    """2 ranks, 8 steps: (a) a switch decided on rank 0 (forced: 1F1B and GPipe trade places, another micro-batch
    count) runs on both ranks from step 5 on, and training equals one device's, for our MLP and for Hugging Face's
    GPT-2 (Adam: the gradients handed to the optimizer at every step); (b) a loop that sleeps 0.3 s per step outside
    the schedule is reported as such, not as a miss of the schedule's prediction (that time is the same for every
    configuration), and the choice stays."""
    runs = [{"scenario": "tuning_scenarios:auto_recording_schedules",
             "kwargs": {"model": "mlp", "max_steps": 8, "stages_per_rank": 1, "force_switch": True}},
            {"scenario": "tuning_scenarios:auto_recording_schedules",
             "kwargs": {"model": "mlp", "max_steps": 8, "stages_per_rank": 1, "slow_loop_s": 0.3}},
            {"scenario": "tuning_scenarios:auto_recording_schedules",
             "kwargs": {"model": "hf_gpt2", "max_steps": 8, "stages_per_rank": 1, "force_switch": True}}]
    ranks = launch(2, runs, timeout=300)
    for index, run in enumerate(runs):
        model = run["kwargs"]["model"]
        assert_trains_like(ranks, index, run, reference(model, max_steps=8), f"auto {run['kwargs']}")
    for index in (0, 2):
        switched = [rank.results[index]["schedules"] for rank in ranks]
        assert switched[0] == switched[1] and len(switched[0]) == 8, switched
        assert len(set(switched[0][:5])) == 1 and len(set(switched[0][5:])) == 1, switched
        assert switched[0][4] != switched[0][5] and switched[0][5][0] in ("1f1b", "gpipe"), switched
    assert ranks[0].output.count("forced: switching to") == 2, ranks[0].output[-3000:]
    kept = [rank.results[1]["schedules"] for rank in ranks]
    assert kept[0] == kept[1] and len(set(kept[0])) == 1, kept
    said = [line for line in ranks[0].output.splitlines() if "schedule='auto' predicted" in line]
    assert len(said) == 3, ranks[0].output[-3000:]
    outside = re.search(r"the whole step took [\d.]+ ms, ([\d.]+) ms of it outside the schedule", said[1])
    assert outside is not None and float(outside.group(1)) >= 250, said[1]
