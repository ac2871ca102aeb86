"""Backward in two halves, for zero-bubble schedules: the input gradient now (I), the weight gradients later (W)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pp import _compat

__all__ = ["WeightGradients", "backward_input", "backward_weight"]


@dataclass
class WeightGradients:
    """What an input-gradient pass leaves for the weight-gradient pass of the same stage and micro-batch."""

    params: list[nn.Parameter]
    kept: Any = None  # torch's parameter groups with the gradients captured where the weight paths branch off
    deferred: tuple[list[Tensor], list[Tensor] | None] | None = None  # a whole backward left to W
    extra: list[tuple[nn.Parameter, Tensor]] = field(default_factory=list)


def backward_input(outputs: list[Tensor], output_grads: list[Tensor] | None, inputs: list[Tensor],
                   params: list[nn.Parameter]) -> tuple[list[Tensor], WeightGradients]:
    """Gradients of ``inputs`` (zeros where unused), and what :func:`backward_weight` needs.

    Without inputs that need a gradient (the first stage) there is nothing to hand upstream: the whole backward is
    left to W. Weights whose gradient path never meets the inputs' (a structure's part computed from weights alone)
    get their gradients here, where the graph from the outputs is still whole; all others wait for W.
    """
    if not inputs:
        return [], WeightGradients(params, deferred=(outputs, output_grads))
    work = WeightGradients(params)
    aside = _compat.weights_off_the_input_path(outputs, inputs, params)
    if aside:
        grads = torch.autograd.grad(outputs, aside, output_grads, retain_graph=True, allow_unused=True)
        work.extra = [(p, g) for p, g in zip(aside, grads, strict=True) if g is not None]
    dinputs, work.kept = _compat.backward_input(outputs, output_grads, inputs, params)
    return [d if d is not None else torch.zeros_like(t) for t, d in zip(inputs, dinputs, strict=True)], work


def backward_weight(work: WeightGradients) -> None:
    """Accumulate the weight gradients an input-gradient pass left, into ``grad``."""
    if work.deferred is not None:
        torch.autograd.backward(work.deferred[0], work.deferred[1])
        return
    for p, grad in work.extra:
        p.grad = grad if p.grad is None else p.grad + grad
    _compat.backward_weight(work.params, work.kept)
