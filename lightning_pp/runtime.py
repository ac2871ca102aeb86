"""Executes one stage's action list for one step: compute, transfers, and (on request) a timed event per action."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from lightning_pp.p2p import StageP2P
from lightning_pp.schedules import Action, ActionType
from lightning_pp.simulate import BACKWARD, COMM_TRANSFER, COMM_WAIT, FORWARD, TimelineEvent

__all__ = ["ForwardFn", "run_stage"]

# forward(microbatch, received activation or None on the first stage) -> the activation to send downstream, or on the
# last stage the (already weighted) loss to back-propagate
ForwardFn = Callable[[int, "torch.Tensor | None"], torch.Tensor]


def run_stage(
    actions: Sequence[Action],
    forward: ForwardFn,
    p2p: StageP2P | None,
    *,
    is_last: bool,
    training: bool,
    events: list[TimelineEvent] | None = None,
    synchronize: Callable[[], None] | None = None,
) -> None:
    """Run ``actions`` in order; append one timed event per action to ``events`` when it is a list.

    Activations, received tensors and gradients are dropped as soon as the last action that needs them has run, so a
    stage holds only what its schedule keeps in flight. ``synchronize`` (for CUDA) is called before each clock read
    while timing, so that an event covers the kernels it launched rather than just their launch.
    """
    inputs: dict[int, torch.Tensor] = {}  # received activations, kept for backward
    outputs: dict[int, torch.Tensor] = {}  # stage outputs (the weighted loss on the last stage)
    output_grads: dict[int, torch.Tensor] = {}  # received gradients w.r.t. this stage's outputs
    input_grads: dict[int, torch.Tensor] = {}  # gradients w.r.t. this stage's inputs, to send upstream
    timed = events is not None

    def clock() -> float:
        if synchronize is not None:
            synchronize()
        return time.perf_counter()

    if p2p is not None:
        p2p.start_step(actions)
    for action in actions:
        mb = action.microbatch
        start = clock() if timed else 0.0
        header_arrived = 0.0
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
                torch.autograd.backward(output, output_grads.pop(mb))
            received = inputs.pop(mb, None)
            if received is not None:
                input_grads[mb] = received.grad if received.grad is not None else torch.zeros_like(received)
            del output, received
        elif kind is ActionType.SEND_F:
            assert p2p is not None
            p2p.send(outputs[mb] if training else outputs.pop(mb), action)
        elif kind is ActionType.SEND_B:
            assert p2p is not None
            p2p.send(input_grads.pop(mb), action)
        elif kind is ActionType.RECV_F:
            assert p2p is not None
            tensor, header_arrived = p2p.recv(action)
            if training and tensor.is_floating_point():
                tensor.requires_grad_()
            inputs[mb] = tensor
        else:  # RECV_B
            assert p2p is not None
            output_grads[mb], header_arrived = p2p.recv(action)
        if events is not None:
            end = clock()
            if kind is ActionType.FORWARD or kind is ActionType.BACKWARD:
                events.append(TimelineEvent(action.stage, action, FORWARD if kind is ActionType.FORWARD else BACKWARD,
                                            start, end))
            elif header_arrived:
                events.append(TimelineEvent(action.stage, action, COMM_WAIT, start, header_arrived))
                events.append(TimelineEvent(action.stage, action, COMM_TRANSFER, header_arrived, end))
            else:
                events.append(TimelineEvent(action.stage, action, COMM_TRANSFER, start, end))
    if p2p is not None:
        start = clock() if timed else 0.0
        p2p.wait_sends()
        if events is not None and actions:
            events.append(TimelineEvent(actions[-1].stage, actions[-1], COMM_WAIT, start, clock()))
