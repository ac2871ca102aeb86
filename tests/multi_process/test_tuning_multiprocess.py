"""Multi-process tier: ``schedule="auto"`` (:mod:`lightning_pp.tuning`) measured and applied on ranks.
The single-process tests are in ``single_process/test_tuning.py``."""

from __future__ import annotations

import pytest
from _launch import launch
from support import assemble, assert_params_close, assert_trains_like, pipelined, reference


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


