"""Multi-process tier: how a job ends. A failure with a callback that saves on exception ends every rank as fast as a
plain failure; SIGTERM to every rank stops a synchronous schedule at a step's end, with a checkpoint equal to one
device's at that step; many fits in one process leave no thread, descriptor or socket behind (issue 39, findings 5-8).
Scenarios in tests/teardown_scenarios.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from _launch import launch

pytestmark = pytest.mark.multiprocess


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
