"""Side outputs: what a model records from its blocks with forward hooks on them or on their submodules (Hugging
Face's router logits of a mixture of experts, its hidden states and attentions; a user's own hooks), carried from the
stage that ran the block to the stages after it, where that block is a stand-in, and handed there to the same hooks,
so the code after the blocks sees what one device sees. The values travel with the activation, so gradients flow back
to the stage that computed them.

The model's own code installs its hooks: on the real block and its submodules where a stage holds the block, on the
stand-in and its weightless copies of the submodules elsewhere (see :mod:`lightning_pp.model.stage`). On the stage
that runs a block, the output of the block and of each submodule that has hooks (not ours) is recorded, in call
order; the records travel on with the activation, through every later stage. When the model's loop calls the
stand-in of that block, the stand-in hands each submodule's record to the hooks of its copy of that submodule, in the
same order, and returns the block's own record, which its own hooks then see as they would the block's output. In
evaluation the last stage runs the step once on the whole batch: each record is joined over the micro-batches first
(its tensors' first dimension must follow the micro-batch's samples, as a router's per-token logits do).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_pp import _compat
from lightning_pp.errors import PipelineConfigError
from lightning_pp.runtime.microbatch import merge_microbatches
from lightning_pp.runtime.wire import flatten, unflatten

__all__ = ["SideOutputs", "Sides", "joined_sides", "not_ours", "ours", "split_sides", "with_sides"]

# one record: [block index, the submodule's path inside the block ("": the block), its output]
Sides = list[list[Any]]
_OUTPUT, _SIDES = "lightning_pp.output", "lightning_pp.sides"


def ours(hook: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``hook`` as lightning_pp's own: it is neither recorded for nor replayed on other stages."""
    hook.__dict__["lightning_pp"] = True
    return hook


def not_ours(hook: Any) -> bool:
    return not getattr(hook, "__dict__", {}).get("lightning_pp")


def _parallelism_hook(hook: Any) -> bool:
    """Whether ``hook`` is torch.distributed's own (a tensor-parallel plan's output layout, FSDP's): part of how the
    module computes on this stage, not a record of its output for code after the blocks."""
    return getattr(getattr(hook, "func", hook), "__module__", "").startswith("torch.distributed.")


def _foreign_hooks(module: nn.Module) -> list[tuple[Callable[..., Any], bool]]:
    """The module's forward hooks that are neither ours nor torch.distributed's, each with whether it takes the call's
    kwargs."""
    return [(hook, with_kwargs) for hook, with_kwargs in _compat.forward_hooks(module)
            if not_ours(hook) and not _parallelism_hook(hook)]


def with_sides(output: Any, sides: Sides) -> Any:
    """What a stage sends on: its last block's output, with the records when there are any. The records' tensors
    travel packed, one flat tensor per dtype (and whether it needs gradients), so that a deep model's records cross
    as a few tensors, not one per layer; packing and unpacking are differentiable."""
    if not sides:
        return output
    tensors, spec = flatten(sides)
    groups: dict[tuple[torch.dtype, bool], list[int]] = {}
    for k, tensor in enumerate(tensors):
        groups.setdefault((tensor.dtype, tensor.requires_grad), []).append(k)
    places: list[list[Any]] = [[] for _ in tensors]  # per tensor: [its pack, its offset there, its shape]
    packs = []
    for pack, members in enumerate(groups.values()):
        offset = 0
        for k in members:
            places[k] = [pack, offset, list(tensors[k].shape)]
            offset += tensors[k].numel()
        packs.append(torch.cat([tensors[k].reshape(-1) for k in members]))
    return {_OUTPUT: output, _SIDES: {"spec": spec, "places": places, "packs": packs}}


def split_sides(received: Any) -> tuple[Any, Sides]:
    """The inverse of :func:`with_sides`."""
    if not (isinstance(received, dict) and _SIDES in received):
        return received, []
    sides = received[_SIDES]
    packs = sides["packs"]
    tensors = [packs[pack][offset:offset + math.prod(shape)].view(shape) for pack, offset, shape in sides["places"]]
    return received[_OUTPUT], list(unflatten(sides["spec"], tensors))


def joined_sides(per_microbatch: list[Sides], sizes: list[int]) -> Sides:
    """The records of every micro-batch joined into those of the whole batch (evaluation on the last stage)."""
    first = per_microbatch[0]
    if any([r[:2] for r in sides] != [r[:2] for r in first] for sides in per_microbatch):
        raise PipelineConfigError(
            "The hooks inside the blocks recorded different modules for different micro-batches; their records cannot "
            "be joined into the whole batch's for evaluation. Record the same modules for every input.")
    return [[index, path, _joined([sides[k][2] for sides in per_microbatch], sizes, index, path)]
            for k, (index, path, _) in enumerate(first)]


def _joined(values: list[Any], sizes: list[int], index: int, path: str) -> Any:
    first = values[0]
    if isinstance(first, torch.Tensor):
        counts = [v.shape[0] if v.dim() else 0 for v in values]
        per_sample = counts[0] // sizes[0] if counts[0] % sizes[0] == 0 else 0
        if per_sample and all(count == per_sample * size for count, size in zip(counts, sizes, strict=True)):
            return torch.cat(values)
        raise PipelineConfigError(
            f"A hook inside block {index} records the output of `{path}` (shape {list(first.shape)}), whose first "
            f"dimension does not follow the micro-batch's samples ({sizes}); its records cannot be joined into the "
            f"whole batch's for evaluation. Record a per-sample or per-token value.")
    if isinstance(first, (tuple, list)):
        return type(first)(_joined(list(items), sizes, index, path) for items in zip(*values, strict=True))
    return merge_microbatches(values, sizes)


class _Recorder:
    """Our forward hook on a hooked module of block ``index``: records its output while the block's stage runs (an
    object, not a closure, so that a module carrying it still pickles)."""

    def __init__(self, sides: SideOutputs, index: int, path: str) -> None:
        self.sides, self.index, self.path = sides, index, path
        ours(self)

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        sides = self.sides
        # the hooks may have gone since (a user's handle removed): then nothing is recorded
        if self.index in sides._recording and sides.records(module, self.path):
            sides.recorded.append([self.index, self.path, output])


class SideOutputs:
    """Records the outputs of hooked submodules of the blocks a stage runs, and replays records on stand-ins."""

    def __init__(self) -> None:
        self.recorded: Sides = []
        self.every_block = False  # record every block's output, hooked or not (``carry_block_outputs``)
        self._recording: set[int] = set()  # the blocks whose submodules' outputs are recorded now
        self._watched: dict[int, RemovableHandle] = {}  # by module id: our recording hooks

    def start(self, blocks: Iterable[tuple[int, nn.Module]]) -> None:
        """Record, from now on, the outputs of the hooked submodules of ``blocks`` (index, block)."""
        self.recorded = []
        self._recording = set()
        for index, block in blocks:
            self._recording.add(index)
            for path, module in block.named_modules():
                if self.records(module, path) and id(module) not in self._watched:
                    self._watched[id(module)] = module.register_forward_hook(_Recorder(self, index, path),
                                                                             prepend=True)

    def records_output(self, block: nn.Module) -> bool:
        """Whether the output of ``block`` (or its stand-in) is recorded where it runs."""
        return self.every_block or bool(_foreign_hooks(block))

    def records(self, module: nn.Module, path: str) -> bool:
        """Whether the output of ``module``, at ``path`` in its block ("": the block), is recorded: a submodule's
        while it has hooks, the block's also with ``every_block``."""
        return self.records_output(module) if not path else bool(_foreign_hooks(module))

    def stop(self) -> Sides:
        recorded, self.recorded, self._recording = self.recorded, [], set()
        return recorded

    def remove(self) -> None:
        """Remove our recording hooks (a later run adds those it needs)."""
        for handle in self._watched.values():
            handle.remove()
        self._watched.clear()

    @staticmethod
    def replay(stand_in: nn.Module, records: Sides) -> Any:
        """Hand each record of the block ``stand_in`` stands for to the hooks of its copy of the recorded submodule;
        return the block's own recorded output (None: not recorded)."""
        block_output = None
        for _, path, output in records:
            if not path:
                block_output = output
                continue
            try:
                module = stand_in.get_submodule(path)
            except AttributeError as error:
                raise PipelineConfigError(
                    f"A hook inside a block recorded the output of `{path}`, which the stand-in of that block on this "
                    f"stage does not have (the block could not be copied). Keep such hooks off the blocks' "
                    f"submodules.") from error
            for hook, with_kwargs in _foreign_hooks(module):
                try:
                    result = hook(module, (), {}, output) if with_kwargs else hook(module, (), output)
                except (IndexError, KeyError) as error:
                    raise PipelineConfigError(
                        f"A forward hook on `{path}` inside a block another pipeline stage holds failed when handed "
                        f"that module's recorded output ({type(error).__name__}: {error}). On a stage that does not "
                        f"hold the block, the hooks get the module's output only, not its inputs: record from the "
                        f"output.") from error
                output = output if result is None else result
        return block_output
