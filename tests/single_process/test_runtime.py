"""Single-process tier: the runtime times every action with the clock of its device.
The multi-process tests are in ``multi_process/test_runtime_multiprocess.py``."""

from __future__ import annotations

import itertools
import time

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


