"""Single-process tier of data parallel x pipeline parallel: `PipelineLayout` (which rank holds which stage of which
replica) and the refused sizes. The multi-process tests (the comparisons with Lightning's DDP) are in
``multi_process/test_data_parallel_multiprocess.py``.
"""

from __future__ import annotations

import re

import pytest

from lightning_pp import PipelineConfigError, PipelineLayout, PipelineParallelStrategy


def test_layout_places_replicas_of_a_stage_on_neighbouring_ranks() -> None:
    layout = PipelineLayout(num_stages=3, num_replicas=2)
    assert layout.world_size == 6
    assert [layout.rank(s, r) for s in range(3) for r in range(2)] == list(range(6))
    assert [(layout.stage_of(g), layout.replica_of(g)) for g in range(6)] == [
        (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert [layout.replica_ranks(2 * s) for s in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert [layout.pipeline_ranks(r) for r in range(2)] == [[0, 2, 4], [1, 3, 5]]
    for bad in (0, -1, 2.0, "2", True):
        with pytest.raises(PipelineConfigError, match=re.escape(f"pipeline_parallel_size={bad!r}")):
            PipelineParallelStrategy(pipeline_parallel_size=bad)  # type: ignore[arg-type]


