"""Multi-process tier: ``schedule="auto"`` (:mod:`lightning_pp.tuning`) measured and applied on ranks.
The single-process tests are in ``single_process/test_tuning.py``."""

from __future__ import annotations

import pytest
from _launch import launch
from support import assemble, assert_params_close, assert_trains_like, pipelined, reference

from lightning_pp.tuning.search import MeasuredCosts

BLOCKS = 8


def costs(per_row: float = 1e-4, slow_first: float = 8.0, saved_per_row: float = 1e6, latency: float = 0.0,
          framework: float = 0.0) -> MeasuredCosts:
    """F = I = W = ``per_row`` seconds per row for each block (the first ``slow_first`` times as long), measured at
    micro-batches of 2 and 16 rows; ``saved_per_row`` bytes kept for backward per block and row."""
    def per_block(rows: int, value: float) -> list[float]:
        return [value * rows * (slow_first if block == 0 else 1) for block in range(BLOCKS)]

    def both(value: float) -> tuple[list[float], list[float]]:
        return per_block(2, value), per_block(16, value)

    return MeasuredCosts(sizes=(2.0, 16.0), forward=both(per_row), input_backward=both(per_row),
                         weight_backward=both(per_row), saved_bytes=both(saved_per_row),
                         output_bytes=both(saved_per_row / 8), before=((0.0, 0.0), (0.0, 0.0)),
                         after=((0.0, 0.0), (0.0, 0.0)), outside_saved_bytes=((0.0, 0.0), (0.0, 0.0)),
                         latency_s=latency, seconds_per_byte=0.0,
                         framework_s=framework)


@pytest.mark.timeout(300)
def test_auto_chosen_configurations_train_as_one_device() -> None:
    """``schedule="auto"`` on 2 ranks: rank 0 measures and prints its choice, every rank runs it, and training equals
    one device's (the probe leaves the module, its random state and the data order as they were); with the micro-batch
    count fixed by the user, the choice keeps it; with a memory budget too; a module built on the meta device runs
    the default configuration."""
    runs = [pipelined("mlp", schedule="auto"), pipelined("tied_sgd", schedule="auto", microbatches=4),
            pipelined("mlp_sgd", schedule="auto", max_memory=2**30)]
    # built on the meta device (each rank materializes its stage only, so no rank can time every block): the default
    # configuration, trained as 1F1B on the same build
    meta = [pipelined("mlp_sgd", schedule="auto", trainer={"meta": True}),
            pipelined("mlp_sgd", schedule="1f1b", microbatches=2, trainer={"meta": True})]
    ranks = launch(2, runs + meta, timeout=240)
    for index, run in enumerate(runs):
        assert_trains_like(ranks, index, run, reference(run["kwargs"]["model"]), f"auto {run['kwargs']}")
    assert_params_close(assemble(ranks, len(runs))[0], assemble(ranks, len(runs) + 1)[0], "auto on a meta build")
    chosen = [line for line in ranks[0].output.splitlines() if "schedule='auto' chose" in line]
    assert len(chosen) == 3, ranks[0].output[-3000:]
    assert "schedule='auto' runs the default configuration (1f1b)" in ranks[0].output, ranks[0].output[-3000:]
    assert " m=4 " in chosen[1], chosen
    assert not any("schedule='auto' chose" in line for line in ranks[1].output.splitlines())


