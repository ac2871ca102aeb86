"""Single-process tier: the runtime times every action with the clock of its device."""

from __future__ import annotations

import itertools
import subprocess
import sys
import time

import pytest
import torch

from lightning_pp.runtime.executor import EventClock, HostClock, run_stage
from lightning_pp.schedule import build_schedule
from lightning_pp.schedule.simulate import BACKWARD, FORWARD, TimelineEvent

DEVICE_LAG = 0.5  # seconds the fake device runs behind the host


class FakeDeviceEvent:
    """A device event whose work runs DEVICE_LAG after the host queued it, like a CUDA stream with a backlog."""

    def record(self) -> None:
        self.time = time.perf_counter() + DEVICE_LAG

    def elapsed_time(self, end: FakeDeviceEvent) -> float:
        return (end.time - self.time) * 1e3


def one_stage_step(clock: HostClock, sleep_s: float) -> list[TimelineEvent]:
    weight = torch.ones(3, requires_grad=True)

    def forward(mb: int, received: torch.Tensor | None) -> torch.Tensor:
        time.sleep(sleep_s)
        return (weight * (mb + 1)).sum()

    events: list[TimelineEvent] = []
    run_stage(build_schedule("gpipe", 1, 2), 0, lambda stage, mb, received: forward(mb, received), None,
              training=True, events=events, clock=clock)
    assert weight.grad is not None
    assert torch.equal(weight.grad, torch.full((3,), 3.0))  # both micro-batches back-propagated
    return events


def test_host_clock_times_each_action() -> None:
    events = one_stage_step(HostClock(), sleep_s=0.02)
    assert [(str(e.action), e.category) for e in events] == [
        ("0F0", FORWARD), ("0F1", FORWARD), ("0B0", BACKWARD), ("0B1", BACKWARD)]
    assert all(e.duration >= 0.02 for e in events if e.category == FORWARD)
    assert all(a.end <= b.start for a, b in itertools.pairwise(events))


def test_event_clock_synchronises_twice_and_maps_device_time_to_host_time() -> None:
    synchronisations: list[float] = []
    before = time.perf_counter()
    clock = EventClock(FakeDeviceEvent, lambda: synchronisations.append(time.perf_counter()))
    events = one_stage_step(clock, sleep_s=0.02)
    assert len(synchronisations) == 2  # one to anchor the clocks, one to read the events: none per action
    # the reference event's lag cancels: times land on the host axis, inside the step, and keep device durations
    assert before <= events[0].start and events[-1].end <= synchronisations[-1]
    assert all(e.duration >= 0.02 for e in events if e.category == FORWARD)


FAULTS_PER_REALLOCATION = """
import resource, sys, torch
from lightning_pp.runtime.allocator import keep_freed_cpu_memory
if sys.argv[1] == "keep":
    assert keep_freed_cpu_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):  # what a micro-batch does: allocate weight-gradient-sized buffers, then free them
    [torch.ones(1024, 1024) for _ in range(4)]
before = faults()
for _ in range(20):
    [torch.ones(1024, 1024) for _ in range(4)]
print((faults() - before) / 20)
"""


@pytest.mark.multiprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_kept_cpu_memory_is_reused_without_page_faults() -> None:
    def faults(mode: str) -> float:
        run = subprocess.run([sys.executable, "-c", FAULTS_PER_REALLOCATION, mode], capture_output=True, text=True,
                             check=True, timeout=60)
        return float(run.stdout.split()[-1])

    # by default glibc returns the 16 MiB to the kernel when no small allocation sits above it in the heap (usually:
    # ~4,000 faults per round), which makes the default count vary from run to run; kept memory never faults back in
    assert faults("keep") < 50
