"""Executes one rank's action list for one step: compute, transfers, and (on request) a timed event per action."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from lightning_pp._tree import flatten, map_tensors
from lightning_pp.actions import Action, ActionType, Schedule
from lightning_pp.backward import WeightGradients, backward_input, backward_weight
from lightning_pp.errors import PipelineScheduleError
from lightning_pp.p2p import StageP2P
from lightning_pp.timeline import CATEGORY_OF, COMM_TRANSFER, COMM_WAIT, TimelineEvent

__all__ = ["EventClock", "ForwardFn", "HostClock", "run_stage", "step_clock"]

# forward(stage, microbatch, what the previous stage sent or None on the first stage) -> what to send downstream (a
# tensor or a structure of them), or on the last stage the (already weighted) loss to back-propagate
ForwardFn = Callable[[int, int, Any], Any]


_COMPUTE = frozenset({ActionType.FORWARD, ActionType.BACKWARD, ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT})


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
    schedule: Schedule,
    rank: int,
    forward: ForwardFn,
    p2p: StageP2P | None,
    *,
    training: bool,
    params: Callable[[int], list[torch.nn.Parameter]] | None = None,
    events: list[TimelineEvent] | None = None,
    clock: HostClock | None = None,
) -> None:
    """Run ``rank``'s actions of ``schedule`` in order; with ``events`` (a list) and ``clock``, append one timed event
    per action. ``params(stage)`` lists the weights a split backward (I, then W) of ``stage`` accumulates into.

    State is kept per (stage, micro-batch), so a rank may hold several stages. Between two stages of one rank nothing
    travels: the later stage's forward takes the earlier one's output (detached, as if received), and its input
    gradient becomes the earlier stage's output gradient. Activations, received tensors and gradients are dropped as
    soon as the last action that needs them has run, so a rank holds only what its schedule keeps in flight.
    """
    actions = schedule.actions[rank]
    last_stage = schedule.num_stages - 1
    local = set(schedule.stages_of(rank))
    Key = tuple[int, int]
    inputs: dict[Key, Any] = {}  # received (or handed over) activations, kept for backward
    outputs: dict[Key, Any] = {}  # stage outputs (the weighted loss on the last stage)
    output_grads: dict[Key, list[torch.Tensor]] = {}  # gradients w.r.t. a stage's outputs
    input_grads: dict[Key, list[torch.Tensor]] = {}  # gradients w.r.t. a stage's inputs, to send upstream
    weight_work: dict[Key, WeightGradients] = {}  # what an I left for its W
    # (action, category, start, header arrival or None, end) in clock stamps, turned into events after the step
    stamps: list[tuple[Action, str, Any, Any, Any]] = []
    timer = clock if events is not None else None  # None: this step is not timed

    def gradients_of_output(stage: int, mb: int) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        output = outputs.pop((stage, mb))
        if stage == last_stage:
            return [output], None
        tensors = _needing_grad(output)
        grads = output_grads.pop((stage, mb))
        return tensors, grads if tensors else None

    def hand_upstream(stage: int, mb: int, grads: list[torch.Tensor]) -> None:
        if stage - 1 in local:
            output_grads[(stage - 1, mb)] = grads
        elif stage > 0:
            input_grads[(stage, mb)] = grads

    if p2p is not None:
        p2p.start_step(actions)
    for action in actions:
        stage, mb = action.stage, action.microbatch
        key = (stage, mb)
        kind = action.type
        if p2p is not None and kind in _COMPUTE and p2p.batched:
            # batched payloads (NCCL) are posted before what may use them, and the stream waits for them there: mostly
            # for the peer to compute them (its header left when its host queued the work), so timed as waiting for
            # the receive they belong to, before the compute's own start
            posted = timer.now() if timer is not None else None
            receive = p2p.flush()
            if timer is not None and receive is not None:
                stamps.append((receive, COMM_WAIT, posted, None, timer.now()))
        start = timer.now() if timer is not None else None
        header_arrived = None
        if kind is ActionType.FORWARD:
            if stage - 1 in local:  # the previous stage ran on this rank: hand its output over
                previous = outputs[(stage - 1, mb)] if training else outputs.pop((stage - 1, mb))
                inputs[key] = map_tensors(previous, lambda t: t.detach().requires_grad_(t.requires_grad))
            output = forward(stage, mb, inputs.get(key))
            if training or stage != last_stage:
                outputs[key] = output
            if not training:
                inputs.pop(key, None)
        elif kind is ActionType.BACKWARD:
            tensors, grads = gradients_of_output(stage, mb)
            if tensors:  # else: frozen layers fed by an input without gradient, nothing to do
                torch.autograd.backward(tensors, grads)
            if key in inputs:
                hand_upstream(stage, mb, [t.grad if t.grad is not None else torch.zeros_like(t)
                                          for t in _needing_grad(inputs.pop(key))])
        elif kind is ActionType.BACKWARD_INPUT:
            if params is None:
                raise PipelineScheduleError(f"Action {action} splits the backward: run_stage needs `params`.")
            tensors, grads = gradients_of_output(stage, mb)
            had_input = key in inputs
            received = _needing_grad(inputs.pop(key)) if had_input else []
            weights = [p for p in params(stage) if p.requires_grad]
            if tensors:
                dinputs, weight_work[key] = backward_input(tensors, grads, received, weights)
            else:  # frozen layers fed by an input without gradient, nothing to do
                dinputs, weight_work[key] = [torch.zeros_like(t) for t in received], WeightGradients(weights)
            if had_input:  # the previous stage waits for this (possibly empty) gradient, as after a B
                hand_upstream(stage, mb, dinputs)
        elif kind is ActionType.BACKWARD_WEIGHT:
            backward_weight(weight_work.pop(key))
        elif kind is ActionType.SEND_F:
            assert p2p is not None
            p2p.send(outputs[key] if training else outputs.pop(key), action)
        elif kind is ActionType.SEND_B:
            assert p2p is not None
            p2p.send(input_grads.pop(key), action)
        elif kind is ActionType.RECV_F:
            assert p2p is not None
            inputs[key], header_arrived = p2p.recv(action)
        elif kind is ActionType.RECV_B:
            assert p2p is not None
            output_grads[key], header_arrived = p2p.recv(action)
        else:
            raise PipelineScheduleError(f"The runtime cannot run action {action} ({kind.name}).")
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
                events.append(TimelineEvent(action.stage, action, COMM_WAIT, start_s, split, rank=rank))
                start_s = split
            events.append(TimelineEvent(action.stage, action, category, start_s, end_s, rank=rank))
