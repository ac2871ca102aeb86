"""Executes one stage's action list for one step: compute, transfers, and (on request) a timed event per action."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_pp._tree import flatten
from lightning_pp.p2p import StageP2P
from lightning_pp.schedules import Action, ActionType
from lightning_pp.simulate import CATEGORY_OF, COMM_TRANSFER, COMM_WAIT, TimelineEvent

__all__ = ["EventClock", "ForwardFn", "HostClock", "run_stage", "step_clock"]

# forward(microbatch, what the previous stage sent or None on the first stage) -> what to send downstream (a tensor or a
# structure of them), or on the last stage the (already weighted) loss to back-propagate
ForwardFn = Callable[[int, Any], Any]


def _needing_grad(obj: Any) -> list[torch.Tensor]:
    """The tensors of a sent or received structure that gradients flow through, in transfer order."""
    return [t for t in flatten(obj)[0] if t.requires_grad]


class HostClock:
    """Timestamps of a stage whose work runs on the host as it is issued (CPU): ``time.perf_counter``."""

    def now(self) -> Any:
        return time.perf_counter()

    def seconds(self, stamp: Any) -> float:
        """A stamp from :meth:`now`, or a host ``perf_counter`` reading, as host seconds (call after the step)."""
        return float(stamp)

    def finish(self) -> None:
        """Called once after the step, before :meth:`seconds`."""


class EventClock(HostClock):
    """Timestamps of an asynchronous device (CUDA): events recorded on the current stream, read once per step.

    A host clock read would only time the launch of a kernel, and synchronising around every action would stop the
    host from queueing work ahead and so change what is measured. Two synchronisations per timed step are needed
    instead. The first, at construction, empties the device queue so that a reference event runs when it is recorded:
    that ties device time to host time, and host-side stamps (when a header arrived) land on the same axis. The second,
    in :meth:`finish`, waits for every recorded event so their times can be read.
    """

    def __init__(self, new_event: Callable[[], Any], synchronize: Callable[[], None]) -> None:
        self._new_event = new_event
        self._synchronize = synchronize
        synchronize()
        self._reference = self.now()
        self._reference_host = time.perf_counter()

    def now(self) -> Any:
        event = self._new_event()
        event.record()
        return event

    def seconds(self, stamp: Any) -> float:
        if isinstance(stamp, float):  # a host reading
            return stamp
        return self._reference_host + self._reference.elapsed_time(stamp) / 1e3

    def finish(self) -> None:
        self._synchronize()


def step_clock(device: torch.device) -> HostClock:
    """The clock that times a step on ``device``."""
    if device.type == "cuda":
        return EventClock(lambda: torch.cuda.Event(enable_timing=True), lambda: torch.cuda.synchronize(device))
    return HostClock()


def run_stage(
    actions: Sequence[Action],
    forward: ForwardFn,
    p2p: StageP2P | None,
    *,
    is_last: bool,
    training: bool,
    events: list[TimelineEvent] | None = None,
    clock: HostClock | None = None,
) -> None:
    """Run ``actions`` in order; with ``events`` (a list) and ``clock``, append one timed event per action.

    Activations, received tensors and gradients are dropped as soon as the last action that needs them has run, so a
    stage holds only what its schedule keeps in flight.
    """
    inputs: dict[int, Any] = {}  # received activations, kept for backward
    outputs: dict[int, Any] = {}  # stage outputs (the weighted loss on the last stage)
    output_grads: dict[int, list[torch.Tensor]] = {}  # received gradients w.r.t. this stage's outputs
    input_grads: dict[int, list[torch.Tensor]] = {}  # gradients w.r.t. this stage's inputs, to send upstream
    # (action, category, start, header arrival or None, end) in clock stamps, turned into events after the step
    stamps: list[tuple[Action, str, Any, Any, Any]] = []
    timer = clock if events is not None else None  # None: this step is not timed

    if p2p is not None:
        p2p.start_step(actions)
    for action in actions:
        mb = action.microbatch
        start = timer.now() if timer is not None else None
        header_arrived = None
        kind = action.type
        if kind is ActionType.FORWARD:
            output = forward(mb, inputs.get(mb))
            if training or not is_last:
                outputs[mb] = output
            if not training:
                inputs.pop(mb, None)
        elif kind is ActionType.BACKWARD:
            output = outputs.pop(mb)
            if is_last:
                torch.autograd.backward(output)
            else:
                grads = output_grads.pop(mb)
                tensors = _needing_grad(output)
                if tensors:  # else: frozen layers fed by an input without gradient, nothing to do
                    torch.autograd.backward(tensors, grads)
            if mb in inputs:
                input_grads[mb] = [t.grad if t.grad is not None else torch.zeros_like(t)
                                   for t in _needing_grad(inputs.pop(mb))]
            del output
        elif kind is ActionType.SEND_F:
            assert p2p is not None
            p2p.send(outputs[mb] if training else outputs.pop(mb), action)
        elif kind is ActionType.SEND_B:
            assert p2p is not None
            p2p.send(input_grads.pop(mb), action)
        elif kind is ActionType.RECV_F:
            assert p2p is not None
            inputs[mb], header_arrived = p2p.recv(action)
        else:  # RECV_B
            assert p2p is not None
            output_grads[mb], header_arrived = p2p.recv(action)
        if timer is not None:
            stamps.append((action, CATEGORY_OF.get(kind, COMM_TRANSFER), start, header_arrived, timer.now()))
    if p2p is not None:
        start = timer.now() if timer is not None else None
        p2p.wait_sends()
        if timer is not None and actions:
            stamps.append((actions[-1], COMM_WAIT, start, None, timer.now()))
    if timer is not None and events is not None:
        timer.finish()
        for action, category, start, header_arrived, end in stamps:
            start_s = timer.seconds(start)
            end_s = max(start_s, timer.seconds(end))
            if header_arrived is not None:  # a receive: waiting for the peer, then moving the tensor
                # clamped: on a device, the host may see the header before the stream reaches the receive
                split = min(max(timer.seconds(header_arrived), start_s), end_s)
                events.append(TimelineEvent(action.stage, action, COMM_WAIT, start_s, split, rank=action.stage))
                start_s = split
            events.append(TimelineEvent(action.stage, action, category, start_s, end_s, rank=action.stage))
