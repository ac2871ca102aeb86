"""Multi-process tier: data parallel x pipeline parallel equals Lightning's DDP with as many replicas (fp32, tight).

The reference is plain Lightning ``strategy="ddp"`` with one process per replica, not one device: Lightning's training
sampler (a ``DistributedSampler``, injected for DDP and for a pipeline with replicas alike) shuffles across replicas,
so DDP fixes which samples each replica sees and in which order. DDP run twice gives identical parameters (checked),
so one DDP run is the reference. Compared: the weights after training (SGD models, element-wise, the tolerances of
`support`), everything rank 0 logged, every rank's ``callback_metrics`` and batches (a pipeline rank against
the DDP rank of its replica), and the saved checkpoints.

The data: 32 samples in batches of 8, so each of 2 replicas runs 2 steps per epoch; 2 epochs are 4 optimizer steps.
The jobs are few and shared by the tests (module-scoped fixtures): process start-up dominates on a small machine.
The multi-process tests are in ``multi_process/test_data_parallel_multiprocess.py``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from lightning_pp import PipelineConfigError, PipelineLayout, PipelineParallelStrategy

EPOCHS = 2


def ddp(model: str, **kwargs: Any) -> dict[str, Any]:
    """The same run under Lightning's DDP, one replica per process."""
    return {"scenario": "train_ddp", "kwargs": {"model": model, "max_steps": -1, "max_epochs": EPOCHS,
                                                "trainer": {"record_batches": True}, **kwargs}}


# ----------------------------------------------------------------------------------------------------- shared jobs


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dp_checkpoints")


# ----------------------------------------------------------------------------------------------------- comparisons


# ----------------------------------------------------------------------------------------------------- tests


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


