"""GPU tier (skipped without CUDA): event timing on one GPU; NCCL pipeline equivalence and benchmark on two.
The multi-process tests are in ``multi_process/test_gpu_multiprocess.py``."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from lightning_pp.runtime.executor import run_stage, step_clock
from lightning_pp.schedule import build_schedule
from lightning_pp.schedule.simulate import FORWARD, TimelineEvent

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


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


