"""GPU tier (skipped without CUDA): event timing on one GPU; NCCL pipeline equivalence and benchmark on two.
The single-process tests are in ``single_process/test_gpu.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _launch import launch
from support import SCHEDULE_NAMES, assemble, assert_matches, reference, run_compare

needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an NCCL pipeline needs two CUDA devices")


@needs_two_gpus
@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_nccl_pipeline_matches_single_gpu(schedule: str) -> None:
    runs: list[dict[str, Any]] = [
        {"scenario": "train", "kwargs": {"model": model, "schedule": schedule, "microbatches": 4,
                                         "trainer": {"accelerator": "gpu"}}} for model in ("mlp", "tied")]
    ranks = launch(2, runs, timeout=300)
    for index, run in enumerate(runs):
        full, history = assemble(ranks, index)
        expected = reference(run["kwargs"]["model"], accelerator="gpu")
        cpu = {k: v.cpu() for k, v in full.items()}
        assert_matches(cpu, history, {**expected, "state": {k: v.cpu() for k, v in expected["state"].items()}},
                       f"nccl {run['kwargs']}")


@needs_two_gpus
@pytest.mark.timeout(300)
def test_benchmark_runs_on_nccl_with_allocator_peaks(tmp_path: Path) -> None:
    report = run_compare(tmp_path, "--schedules", "1f1b", "--stages", "2", "--device", "cuda")
    assert report["meta"]["memory_column"] == "peak allocator memory"
    assert {row["runner"] for row in report["rows"]} == {"single process", "torch.distributed.pipelining",
                                                         "lightning_pp"}
    assert all(row["step_s"] is not None and None not in row["peak_saved_bytes"] for row in report["rows"])
