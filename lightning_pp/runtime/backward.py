"""Backward in two halves, for zero-bubble schedules: the input gradient now (I), the weight gradients later (W).

The split is torch.distributed.pipelining's (``stage_backward_input`` / ``stage_backward_weight``): I runs autograd
from the stage's outputs to its inputs and keeps the gradient that reached each node of the inputs' paths where a
weight's path joins them (an "intermediate"); W runs autograd from those nodes to the weights. It is written here,
on public autograd APIs, because torch's weight pass fails where something computed from weights reaches several
blocks (DeBERTa's relative position embeddings ``norm(table)``, passed to every block):

- torch groups the weights by the intermediates they reach but merges two groups only through the intermediate at
  hand, not transitively; such a tensor's weights end in several overlapping groups, and W runs their graph twice
  (``Trying to backward through the graph a second time``, or gradients counted twice). Here a group is a connected
  part of the weights' graph (a union-find over the intermediates).
- the intermediates of such a group lie at several depths of the inputs' paths, and W's autograd runs the inputs'
  nodes between them again (their gradient at a deeper intermediate is replaced by the one I kept, which torch did
  from 2.13 on, pytorch#180952); with ``retain_graph=False`` that frees nodes another group's W still needs. W retains
  the graph, which is freed once the kept intermediates are dropped.
- each output of an operation is its own edge (torch before 2.12 summed them into the first, pytorch#170277).

Where the split cannot give every gradient (an output that does not depend on the stage's inputs: weights alone
lead to it), the whole backward runs in I and W has nothing left to do; that is logged once per reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, Node

from lightning_pp._logging import EVERY_RANK, get_logger

__all__ = ["WeightGradients", "backward_input", "backward_weight", "split_declined"]

log = get_logger(__name__)
_logged: set[str] = set()


@dataclass
class _WeightGroup:
    """Weights whose paths to the stage's inputs' paths share nodes, and the intermediates where those paths join."""

    weights: list[nn.Parameter]
    intermediates: list[Node]


@dataclass
class WeightGradients:
    """What an input-gradient pass leaves for the weight-gradient pass of the same stage and micro-batch."""

    params: list[nn.Parameter]
    groups: list[_WeightGroup] = field(default_factory=list)
    kept: dict[Node, tuple[Tensor | None, ...]] = field(default_factory=dict)  # the gradients I saw at intermediates
    deferred: tuple[list[Tensor], list[Tensor] | None] | None = None  # a whole backward left to W


def _node(tensor: Tensor) -> Node | None:
    """The node a tensor's gradient enters: its ``grad_fn``, or a leaf's gradient accumulator."""
    if tensor.grad_fn is not None or not tensor.requires_grad:
        return tensor.grad_fn
    return tensor.view_as(tensor).grad_fn.next_functions[0][0]  # type: ignore[union-attr]


def _consumers(roots: list[Node]) -> dict[Node, list[Node]]:
    """Every node of the graph below ``roots``, with the nodes that take its output (the forward direction)."""
    consumers: dict[Node, list[Node]] = {root: [] for root in roots}
    queue = list(roots)
    while queue:
        node = queue.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in consumers:
                consumers[child] = []
                queue.append(child)
            consumers[child].append(node)
    return consumers


def _downstream(starts: list[Node], consumers: dict[Node, list[Node]],
                stop: dict[Node, None] | None = None) -> tuple[dict[Node, None], dict[Node, None]]:
    """The nodes that use ``starts``' outputs, directly or not, without going through ``stop``; and the nodes of
    ``stop`` met on the way (ordered sets, so a run is repeatable)."""
    stop = stop or {}
    seen, met = dict.fromkeys(starts), dict[Node, None]()
    queue = list(starts)
    while queue:
        for node in consumers[queue.pop()]:
            if node in stop:
                met[node] = None
            elif node not in seen:
                seen[node] = None
                queue.append(node)
    return seen, met


def _plan(outputs: list[Tensor], inputs: list[Tensor],
          params: list[nn.Parameter]) -> tuple[list[_WeightGroup], str | None]:
    """The weight groups of the split, or why it does not apply."""
    roots = list(dict.fromkeys(n for n in map(_node, outputs) if n is not None))
    consumers = _consumers(roots)
    along, _ = _downstream([n for n in map(_node, inputs) if n is not None and n in consumers], consumers)
    if not all(root in along for root in roots):
        return [], "an output of the stage does not depend on its inputs"
    # every node leads to a root, and the roots are on the inputs' paths: each weight in the graph meets them
    weights: dict[Node, nn.Parameter] = {}
    for param in params:
        node = _node(param)
        if node is not None and node in consumers:
            weights.setdefault(node, param)
    groups: list[tuple[list[nn.Parameter], dict[Node, None]] | None] = []
    owner: dict[Node, int] = {}  # intermediate -> index of its group in `groups`
    for node, param in weights.items():
        members, joined = [param], _downstream([node], consumers, along)[1]
        for index in dict.fromkeys(owner[n] for n in joined if n in owner):  # merge every group it shares one with
            other = groups[index]
            assert other is not None
            members, joined = other[0] + members, {**other[1], **joined}
            groups[index] = None
        groups.append((members, joined))
        owner.update(dict.fromkeys(joined, len(groups) - 1))
    return [_WeightGroup(members, list(joined)) for members, joined in filter(None, groups)], None


def split_declined(outputs: list[Tensor], inputs: list[Tensor], params: list[nn.Parameter]) -> str | None:
    """Why the input/weight split of this backward would not give every gradient, or None where it does."""
    return _plan(outputs, inputs, params)[1]


def backward_input(outputs: list[Tensor], output_grads: list[Tensor] | None, inputs: list[Tensor],
                   params: list[nn.Parameter]) -> tuple[list[Tensor], WeightGradients]:
    """Gradients of ``inputs`` (zeros where unused), and what :func:`backward_weight` needs.

    Without inputs that need a gradient (the first stage) there is nothing to hand upstream: the whole backward is
    left to W. Where the split would miss a gradient the whole backward runs here and W has nothing left to do.
    """
    if not any(t.requires_grad for t in inputs):
        return [torch.zeros_like(t) for t in inputs], WeightGradients(params, deferred=(outputs, output_grads))
    pairs = [(t, None if output_grads is None else g)
             for t, g in zip(outputs, output_grads or outputs, strict=True) if t.requires_grad]
    outputs, grads = [t for t, _ in pairs], [g for _, g in pairs]
    wanted = [t for t in inputs if t.requires_grad]
    groups, declined = _plan(outputs, wanted, params)
    work = WeightGradients(params, groups)
    if not outputs:
        dinputs: tuple[Tensor | None, ...] = tuple(None for _ in wanted)
    elif declined is not None:
        if declined not in _logged:
            _logged.add(declined)
            log.info(f"a stage's backward is not split into input and weight gradients ({declined}): "
                     f"it runs whole where the schedule has the input gradient's action", extra=EVERY_RANK)
        torch.autograd.backward(outputs, None if output_grads is None else grads,
                                inputs=[*wanted, *(p for p in params if p.requires_grad)])
        dinputs = tuple(t.grad for t in wanted)
    else:
        handles = [node.register_prehook(_keeper(work.kept, node)) for group in groups for node in group.intermediates]
        try:
            dinputs = torch.autograd.grad(outputs, wanted, None if output_grads is None else grads,
                                          retain_graph=True, allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
    by_input = dict(zip(map(id, wanted), dinputs, strict=True))
    return [_or_zeros(by_input.get(id(t)), t) for t in inputs], work


def _keeper(kept: dict[Node, tuple[Tensor | None, ...]], node: Node) -> Any:
    def keep(grads: tuple[Tensor | None, ...]) -> None:
        kept[node] = grads
    return keep


def _or_zeros(grad: Tensor | None, like: Tensor) -> Tensor:
    return grad if grad is not None else torch.zeros_like(like)


def backward_weight(work: WeightGradients) -> None:
    """Accumulate the weight gradients an input-gradient pass left, into ``grad`` (as a whole backward would)."""
    if work.deferred is not None:
        torch.autograd.backward(work.deferred[0], work.deferred[1])
        return
    for group in work.groups:
        edges = [GradientEdge(node, nr) for node in group.intermediates
                 for nr, grad in enumerate(work.kept.get(node, ())) if grad is not None]
        if not edges:
            continue
        grads = [work.kept[edge.node][edge.output_nr] for edge in edges]
        # autograd runs the inputs' nodes between a group's intermediates again: what reaches a deeper intermediate
        # from them is replaced by the gradient I kept there (else counted twice)
        handles = [node.register_prehook(_clamp(work.kept.get(node))) for node in group.intermediates]
        try:
            torch.autograd.backward(edges, grads, retain_graph=True, inputs=group.weights)  # type: ignore[arg-type]
        finally:
            for handle in handles:
                handle.remove()
    work.groups, work.kept = [], {}


def _clamp(kept: tuple[Tensor | None, ...] | None) -> Any:
    def clamp(grads: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
        return kept if kept is not None else tuple(None for _ in grads)
    return clamp
