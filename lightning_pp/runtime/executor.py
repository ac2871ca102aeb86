"""Executes one rank's action list for one step: compute, transfers, and (on request) a timed event per action."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from lightning_pp.errors import PipelineScheduleError
from lightning_pp.parallel.device import synchronize_stream
from lightning_pp.parallel.sharding import placed_like
from lightning_pp.runtime.backward import WeightGradients, backward_input, backward_weight
from lightning_pp.runtime.p2p import StageP2P
from lightning_pp.runtime.wire import flatten, map_tensors
from lightning_pp.schedule.actions import Action, ActionType, Schedule
from lightning_pp.schedule.timeline import CATEGORY_OF, COMM_TRANSFER, COMM_WAIT, TimelineEvent

__all__ = ["EventClock", "ForwardFn", "HostClock", "StageRun", "run_stage", "step_clock"]

# forward(stage, microbatch, what the previous stage sent or None on the first stage) -> what to send downstream (a
# tensor or a structure of them), or on the last stage the (already weighted) loss to back-propagate
ForwardFn = Callable[[int, int, Any], Any]


_COMPUTE = frozenset({ActionType.FORWARD, ActionType.BACKWARD, ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT})


def _needing_grad(obj: Any) -> list[torch.Tensor]:
    """The tensors of a sent or received structure that gradients flow through, in transfer order."""
    return [t for t in flatten(obj)[0] if t.requires_grad]


class HostClock:
    """Timestamps of a stage whose work runs on the host as it is issued (CPU): ``time.perf_counter``.

    ``synchronize`` is called where a device's clock waits for its stream (at construction and in :meth:`finish`):
    nothing on a plain CPU run; under NCCL's emulation it stands in for the device (see
    :mod:`lightning_pp.parallel.device`), so a timed step waits there for what a GPU's would."""

    def __init__(self, synchronize: Callable[[], None] | None = None) -> None:
        self._synchronize = synchronize
        if synchronize is not None:
            synchronize()

    def now(self) -> Any:
        return time.perf_counter()

    def seconds(self, stamp: Any) -> float:
        """A stamp from :meth:`now`, or a host ``perf_counter`` reading, as host seconds (call after the step)."""
        return float(stamp)

    def finish(self) -> None:
        """Called once after the step, before :meth:`seconds`."""
        if self._synchronize is not None:
            self._synchronize()


class EventClock(HostClock):
    """Timestamps of an asynchronous device (CUDA): events recorded on the current stream, read once per step.

    A host clock read would only time the launch of a kernel, and synchronising around every action would stop the
    host from queueing work ahead and so change what is measured. Two synchronisations of the current stream per
    timed step are needed instead (``synchronize``), never of the whole device: that would also wait for NCCL's
    streams, where a pipeline's last send of a step may wait for the peer's next step, which the peer starts only
    once this rank's host has handed it something (a deadlock). The first, at construction, empties the stream's queue
    so that a reference event runs when it is recorded: that ties device time to host time, and host-side stamps
    (when a header arrived) land on the same axis. The second, in :meth:`finish`, waits for every event recorded on
    the stream (all of them: the runtime records them outside any stream the user's code picks) so their times can be
    read.
    """

    def __init__(self, new_event: Callable[[], Any], synchronize: Callable[[], None]) -> None:
        self._new_event = new_event
        super().__init__(synchronize)
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


def step_clock(device: torch.device) -> HostClock:
    """The clock that times a step on ``device``; it waits for the current stream only (see :class:`EventClock`)."""
    if device.type == "cuda":
        return EventClock(lambda: torch.cuda.Event(enable_timing=True), lambda: synchronize_stream(device))
    return HostClock(lambda: synchronize_stream(device))


_Key = tuple[int, int]  # (stage, micro-batch)
# (action, category, start, header arrival or None, end) in clock stamps, turned into events after the step
_Stamp = tuple[Action, str, Any, Any, Any]


class StageRun:
    """One rank's state over one step: what each (stage, micro-batch) keeps between its actions, and the stamps."""

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        forward: ForwardFn,
        p2p: StageP2P | None,
        *,
        training: bool,
        params: Callable[[int], list[torch.nn.Parameter]] | None,
        timer: HostClock | None,
        around: Callable[[Action], AbstractContextManager[Any]] | None = None,
    ) -> None:
        self.forward = forward
        self.p2p = p2p
        self.training = training
        self.params = params
        self.timer = timer  # None: this step is not timed
        self.last_stage = schedule.num_stages - 1
        self.local = set(schedule.stages_of(rank))
        self.inputs: dict[_Key, Any] = {}  # received (or handed over) activations, kept for backward
        self.outputs: dict[_Key, Any] = {}  # stage outputs (the weighted loss on the last stage)
        self.output_grads: dict[_Key, list[torch.Tensor]] = {}  # gradients w.r.t. a stage's outputs
        self.input_grads: dict[_Key, list[torch.Tensor]] = {}  # gradients w.r.t. a stage's inputs, to send upstream
        self.weight_work: dict[_Key, WeightGradients] = {}  # what an I left for its W
        self.stamps: list[_Stamp] = []
        self.around = around  # wraps each compute action (a stream's steps: which weights and gradients it uses)

    def go_on(self, carried: StageRun) -> None:
        """Take over what ``carried`` (the previous step's run) left in flight: a schedule whose steps overlap
        (:mod:`lightning_pp.pipedream.stream`) backs up in this step micro-batches the previous step ran forward."""
        self.inputs, self.outputs = carried.inputs, carried.outputs
        self.output_grads, self.input_grads, self.weight_work = (carried.output_grads, carried.input_grads,
                                                                 carried.weight_work)

    @property
    def transfers(self) -> StageP2P:
        """The point-to-point link, which a schedule with transfers needs."""
        assert self.p2p is not None
        return self.p2p

    def now(self) -> Any:
        """A stamp of the step's clock, or None when the step is not timed."""
        return self.timer.now() if self.timer is not None else None

    def run(self, action: Action) -> None:
        """Run one action, stamping it when the step is timed."""
        kind = action.type
        p2p = self.p2p
        if p2p is not None and kind in _COMPUTE and p2p.batched:
            self.flush_batched(p2p)
        start = self.now()
        handler = _HANDLERS.get(kind)
        if handler is None:
            raise PipelineScheduleError(f"The runtime cannot run action {action} ({kind.name}).")
        if self.around is not None and kind in _COMPUTE:
            with self.around(action):
                header_arrived = handler(self, action)
        else:
            header_arrived = handler(self, action)
        if self.timer is not None:
            self.stamps.append((action, CATEGORY_OF.get(kind, COMM_TRANSFER), start, header_arrived, self.timer.now()))

    def flush_batched(self, p2p: StageP2P) -> None:
        """Post the batched transfers queued before a compute action and wait for them."""
        # batched payloads (NCCL) are posted before what may use them, and the stream waits for them there: mostly
        # for the peer to compute them (its header left when its host queued the work), so timed as waiting for
        # the receive they belong to, before the compute's own start
        posted = self.now()
        receive = p2p.flush()
        if self.timer is not None and receive is not None:
            self.stamps.append((receive, COMM_WAIT, posted, None, self.timer.now()))

    def gradients_of_output(self, key: _Key) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """The tensors to back-propagate from for ``key`` and their gradients (None: the loss, or nothing to do)."""
        output = self.outputs.pop(key)
        if key[0] == self.last_stage:
            return [output], None
        tensors = _needing_grad(output)
        grads = self.output_grads.pop(key)
        return tensors, grads if tensors else None

    def hand_upstream(self, key: _Key, grads: list[torch.Tensor]) -> None:
        """Give ``key``'s input gradients to the previous stage: on this rank directly, else through a SEND_B."""
        stage, mb = key
        if stage - 1 in self.local:
            self.output_grads[(stage - 1, mb)] = grads
        elif stage > 0:
            self.input_grads[key] = grads

    def run_forward(self, action: Action) -> None:
        stage, mb = action.stage, action.microbatch
        key = (stage, mb)
        if stage - 1 in self.local:  # the previous stage ran on this rank: hand its output over
            previous = self.outputs[(stage - 1, mb)] if self.training else self.outputs.pop((stage - 1, mb))
            self.inputs[key] = map_tensors(previous, lambda t: t.detach().requires_grad_(t.requires_grad))
        output = self.forward(stage, mb, self.inputs.get(key))
        if self.training or stage != self.last_stage:
            self.outputs[key] = output
        if not self.training:
            self.inputs.pop(key, None)

    def run_backward(self, action: Action) -> None:
        """The full backward: weight gradients accumulate, input gradients go upstream."""
        key = (action.stage, action.microbatch)
        tensors, grads = self.gradients_of_output(key)
        if tensors:  # else: frozen layers fed by an input without gradient, nothing to do
            torch.autograd.backward(tensors, grads)
        if key in self.inputs:
            self.hand_upstream(key, [placed_like(t.grad, t) if t.grad is not None else torch.zeros_like(t)
                                     for t in _needing_grad(self.inputs.pop(key))])

    def run_backward_input(self, action: Action) -> None:
        """Input gradients only (they go upstream); the weights' part is left for the W."""
        if self.params is None:
            raise PipelineScheduleError(f"Action {action} splits the backward: run_stage needs `params`.")
        key = (action.stage, action.microbatch)
        tensors, grads = self.gradients_of_output(key)
        had_input = key in self.inputs
        received = _needing_grad(self.inputs.pop(key)) if had_input else []
        weights = [p for p in self.params(action.stage) if p.requires_grad]
        if tensors:
            dinputs, self.weight_work[key] = backward_input(tensors, grads, received, weights)
        else:  # frozen layers fed by an input without gradient, nothing to do
            dinputs, self.weight_work[key] = [torch.zeros_like(t) for t in received], WeightGradients(weights)
        if had_input:  # the previous stage waits for this (possibly empty) gradient, as after a B
            self.hand_upstream(key, [placed_like(g, t) for g, t in zip(dinputs, received, strict=True)])

    def run_backward_weight(self, action: Action) -> None:
        backward_weight(self.weight_work.pop((action.stage, action.microbatch)))

    def send_forward(self, action: Action) -> None:
        key = (action.stage, action.microbatch)
        self.transfers.send(self.outputs[key] if self.training else self.outputs.pop(key), action)

    def send_backward(self, action: Action) -> None:
        self.transfers.send(self.input_grads.pop((action.stage, action.microbatch)), action)

    def recv_forward(self, action: Action) -> float:
        """Receive an activation; returns when its header arrived."""
        self.inputs[(action.stage, action.microbatch)], header_arrived = self.transfers.recv(action)
        return header_arrived

    def recv_backward(self, action: Action) -> float:
        """Receive an output gradient; returns when its header arrived."""
        self.output_grads[(action.stage, action.microbatch)], header_arrived = self.transfers.recv(action)
        return header_arrived

    def wait_sends(self, p2p: StageP2P, last: Action | None, this_step: bool = True) -> None:
        """Wait for the step's sends to complete (not ``this_step``: only those of earlier steps), timed as waiting
        after the ``last`` action."""
        start = self.now()
        p2p.wait_sends(this_step)
        if self.timer is not None and last is not None:
            self.stamps.append((last, COMM_WAIT, start, None, self.timer.now()))

    def record_events(self, timer: HostClock, events: list[TimelineEvent], rank: int) -> None:
        """Turn the stamps into timeline events, appended to ``events`` (after the step)."""
        timer.finish()
        for action, category, start, header_arrived, end in self.stamps:
            start_s = timer.seconds(start)
            end_s = max(start_s, timer.seconds(end))
            if header_arrived is not None:  # a receive: waiting for the peer, then moving the tensor
                # clamped: on a device, the host may see the header before the stream reaches the receive
                split = min(max(timer.seconds(header_arrived), start_s), end_s)
                events.append(TimelineEvent(action.stage, action, COMM_WAIT, start_s, split, rank=rank))
                start_s = split
            events.append(TimelineEvent(action.stage, action, category, start_s, end_s, rank=rank))


# what runs each kind of action; a handler returns when a received header arrived (None for other actions)
_HANDLERS: dict[ActionType, Callable[[StageRun, Action], float | None]] = {
    ActionType.FORWARD: StageRun.run_forward,
    ActionType.BACKWARD: StageRun.run_backward,
    ActionType.BACKWARD_INPUT: StageRun.run_backward_input,
    ActionType.BACKWARD_WEIGHT: StageRun.run_backward_weight,
    ActionType.SEND_F: StageRun.send_forward,
    ActionType.SEND_B: StageRun.send_backward,
    ActionType.RECV_F: StageRun.recv_forward,
    ActionType.RECV_B: StageRun.recv_backward,
}


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
    stream: bool = False,
    carried: StageRun | None = None,
    around: Callable[[Action], AbstractContextManager[Any]] | None = None,
) -> StageRun:
    """Run ``rank``'s actions of ``schedule`` in order; with ``events`` (a list) and ``clock``, append one timed event
    per action. ``params(stage)`` lists the weights a split backward (I, then W) of ``stage`` accumulates into.

    A step cut out of a longer ``stream`` (:mod:`lightning_pp.pipedream.stream`) passes the previous step's returned run
    as ``carried``, and ``around(action)`` wraps each compute action (to pick the weights and gradients it uses). Its
    sends are waited for only at the end of the next step: the peer may receive them in its next step.

    State is kept per (stage, micro-batch), so a rank may hold several stages. Between two stages of one rank nothing
    travels: the later stage's forward takes the earlier one's output (detached, as if received), and its input
    gradient becomes the earlier stage's output gradient. Activations, received tensors and gradients are dropped as
    soon as the last action that needs them has run, so a rank holds only what its schedule keeps in flight.
    """
    actions = schedule.actions[rank]
    timer = clock if events is not None else None
    run = StageRun(schedule, rank, forward, p2p, training=training, params=params, timer=timer, around=around)
    if carried is not None:
        run.go_on(carried)
    if p2p is not None:
        p2p.start_step(actions)
    for action in actions:
        run.run(action)
    if p2p is not None:
        run.wait_sends(p2p, actions[-1] if actions else None, this_step=not stream)
    if timer is not None and events is not None:
        run.record_events(timer, events, rank)
    run.around = None  # what it holds (the step, a version of the weights) is not the next step's
    return run
