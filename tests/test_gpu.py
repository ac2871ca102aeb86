"""GPU tier (skipped without CUDA): event timing on one GPU; NCCL pipeline equivalence and benchmark on two."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _launch import launch
from support import SCHEDULE_NAMES, assemble, assert_matches, reference, run_compare

from lightning_pp.runtime.executor import run_stage, step_clock
from lightning_pp.schedule import build_schedule
from lightning_pp.schedule.simulate import FORWARD, TimelineEvent

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an NCCL pipeline needs two CUDA devices")


@needs_cuda
def test_cuda_events_time_kernels_not_launches() -> None:
    device = torch.device("cuda", 0)
    weight = torch.randn(2048, 2048, device=device, requires_grad=True)

    def forward(mb: int, received: torch.Tensor | None) -> torch.Tensor:
        x = weight
        for _ in range(20):
            x = torch.tanh(x @ weight)
        return x.sum()

    forward(0, None).backward()  # warm up first: cuBLAS start-up and lazy kernel loading take ~100 ms, once
    torch.cuda.synchronize(device)
    begin = time.perf_counter()
    forward(0, None).backward()
    torch.cuda.synchronize(device)
    one_forward_backward = time.perf_counter() - begin

    events: list[TimelineEvent] = []
    run_stage(build_schedule("gpipe", 1, 2), 0, lambda stage, mb, received: forward(mb, received), None,
              training=True, events=events, clock=step_clock(device))
    compute = sum(e.duration for e in events)
    assert [e.category for e in events][:2] == [FORWARD, FORWARD]
    # launches alone take a small fraction of the kernels' time; the events cover the kernels
    assert compute >= 0.5 * 2 * one_forward_backward, (compute, one_forward_backward)
    assert all(a.end <= b.start + 1e-4 for a, b in itertools.pairwise(events))


@needs_two_gpus
@pytest.mark.multiprocess
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
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_benchmark_runs_on_nccl_with_allocator_peaks(tmp_path: Path) -> None:
    report = run_compare(tmp_path, "--schedules", "1f1b", "--stages", "2", "--device", "cuda")
    assert report["meta"]["memory_column"] == "peak allocator memory"
    assert {row["runner"] for row in report["rows"]} == {"single process", "torch.distributed.pipelining",
                                                         "lightning_pp"}
    assert all(row["step_s"] is not None and None not in row["peak_saved_bytes"] for row in report["rows"])
