"""Backward in two halves, for zero-bubble schedules: the input gradient now (I), the weight gradients later (W)."""

from __future__ import annotations

from dataclasses import dataclass
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


def backward_input(outputs: list[Tensor], output_grads: list[Tensor] | None, inputs: list[Tensor],
                   params: list[nn.Parameter]) -> tuple[list[Tensor], WeightGradients]:
    """Gradients of ``inputs`` (zeros where unused), and what :func:`backward_weight` needs.

    Without inputs that need a gradient (the first stage) there is nothing to hand upstream: the whole backward is
    left to W. Where the split would miss a gradient (an output that does not depend on the inputs, a weight whose
    path never meets theirs) the whole backward runs here and W has nothing left to do.
    """
    if not inputs:
        return [], WeightGradients(params, deferred=(outputs, output_grads))
    if not _compat.split_backward_applies(outputs, inputs, params):
        torch.autograd.backward(outputs, output_grads, inputs=[*inputs, *(p for p in params if p.requires_grad)])
        return [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs], WeightGradients(params)
    work = WeightGradients(params)
    dinputs, work.kept = _compat.backward_input(outputs, output_grads, inputs, params)
    return [d if d is not None else torch.zeros_like(t) for t, d in zip(inputs, dinputs, strict=True)], work


def backward_weight(work: WeightGradients) -> None:
    """Accumulate the weight gradients an input-gradient pass left, into ``grad``."""
    if work.deferred is not None:
        torch.autograd.backward(work.deferred[0], work.deferred[1])
    elif work.kept is not None:
        _compat.backward_weight(work.params, work.kept)
