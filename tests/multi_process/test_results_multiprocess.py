"""What a pipelined step's last stage hands the other stages: its outputs only where something reads them, as
tensors without pickle when their structure repeats.
The single-process tests are in ``single_process/test_results.py``."""

from __future__ import annotations

from _launch import launch
from models import step_outputs
from support import assert_same_outputs

STEPS = 9


def test_outputs_travel_intact_and_without_pickle_when_their_structure_repeats() -> None:
    ranks = launch(2, [{"scenario": "result_exchange", "kwargs": {"steps": STEPS}}], timeout=120)
    for rank_index, rank in enumerate(ranks):
        assert not rank.errors, rank.errors
        arrived = rank.results[0]
        assert len(arrived) == 2 * STEPS
        for index, got in enumerate(arrived):
            step, sent = index // 2, index % 2 == 0
            label = f"rank {rank_index}, step {step}, outputs sent: {sent}"
            assert got["loss"] == 0.5 + step, label
            assert [(name, value) for name, value, _ in got["logged"]] == [
                (f"m{i}", float(step + i)) for i in range(20)], label
            if sent or rank_index == 1:  # the source (rank 1) keeps its own outputs
                assert_same_outputs(got["outputs"], step_outputs(step))
            else:
                assert got["outputs"] is None, label
        # pickled: the log records' names at first, a structure when it is new or holds what cannot be packed
        pickled = [got["pickled"] for got in arrived[::2]]
        assert pickled == [1, 0, 1, 1, 0, 1, 1, 1, 0], pickled
        assert all(got["pickled"] == 0 for got in arrived[1::2])


