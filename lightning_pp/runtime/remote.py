"""Marking, on a stage, what stands in for the output of a block another stage holds, so that a result computed from
it (a skip connection across stages, every block's output kept in a list) is refused with our error instead of being
trained silently wrong."""

from __future__ import annotations

from typing import Any

import torch

from lightning_pp.errors import PipelineConfigError
from lightning_pp.runtime.wire import flatten

__all__ = ["RemoteBlockOutput", "marked_remote", "refuse_reached", "refuse_remote", "remote_placeholder"]

_ONLY_THE_LAST = (
    "A stage receives only the output of the block just before its own blocks: the outputs of earlier blocks are not "
    "there (a skip connection across stages, a list of every block's output, a loss over all hidden states). Pass "
    "PipelineParallelStrategy(carry_block_outputs=True) to send every block's output on to every later stage, or "
    "split a container whose blocks hand on everything the code after them reads (name it with "
    "PipelineParallelStrategy(blocks=...))."
)


class RemoteBlockOutput(torch.Tensor):
    """What a stand-in returns in place of the output of a block held by another stage, other than the block just
    before this stage's own: the received activation, marked, because that block's own output is not on this stage.

    Computing with it goes on (the result is marked too: a loop's work between blocks reaches the next stand-in, which
    ignores it), a computation that fails on it becomes our error, and a step whose loss, logged values or outputs
    depend on one is refused (:func:`refuse_remote`): never trained silently wrong.
    """

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        try:
            return super().__torch_function__(func, types, args, kwargs or {})
        except RuntimeError as error:  # torch's own errors: a shape that is not that block's, say
            raise PipelineConfigError(
                f"{getattr(func, '__name__', func)} failed on the output of a block held by another pipeline stage "
                f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}). {_ONLY_THE_LAST}"
            ) from error


def marked_remote(t: torch.Tensor) -> torch.Tensor:
    """``t`` standing in for the output of a block another stage holds (nested tensors and DTensors, which cannot be
    made a subclass of another tensor type, stay as they are: unmarked)."""
    from torch.distributed.tensor import DTensor

    return t if t.is_nested or isinstance(t, DTensor) else t.as_subclass(RemoteBlockOutput)


def remote_placeholder(t: torch.Tensor) -> torch.Tensor:
    """What stands in for the output of a block another stage holds where ``t`` (the received activation, a
    DTensor) cannot be marked: a new leaf of NaN (integers: zeros) laid out as ``t``, which :func:`refuse_reached`
    finds in what a step computed from it, and whose values poison any result computed from it where there is no
    graph to search (evaluation)."""
    fill = float("nan") if t.is_floating_point() else 0
    return torch.full_like(t.detach(), fill).requires_grad_(t.requires_grad)


def refuse_reached(value: Any, placeholders: list[torch.Tensor], what: str) -> None:
    """Raise our error if the autograd graph of ``value`` (the tensors in it) reaches one of ``placeholders``
    (:func:`remote_placeholder`): it was computed from the output of a block another stage holds."""
    wanted = {id(p) for p in placeholders}
    try:
        tensors = flatten(value)[0]
    except PipelineConfigError:
        tensors = [value] if isinstance(value, torch.Tensor) else []
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    seen: set[Any] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if id(getattr(node, "variable", None)) in wanted:
            raise PipelineConfigError(
                f"{what} is computed from the output of a block held by another pipeline stage. {_ONLY_THE_LAST}")
        stack.extend(next_node for next_node, _ in node.next_functions if next_node is not None)


def refuse_remote(value: Any, what: str) -> None:
    """Raise our error if ``value`` (the step's loss, a logged value, its outputs) holds a value computed from the
    output of a block another stage holds."""
    try:
        tensors = flatten(value)[0]
    except PipelineConfigError:  # a structure that cannot cross stages: look at its top level only
        tensors = [value] if isinstance(value, torch.Tensor) else []
    if any(isinstance(t, RemoteBlockOutput) for t in tensors):
        raise PipelineConfigError(
            f"{what} is computed from the output of a block held by another pipeline stage. {_ONLY_THE_LAST}"
        )
