"""Splitting a batch into micro-batches along dimension 0, like ``torch.tensor_split`` (sizes differ by at most one)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_pp.errors import PipelineConfigError

__all__ = ["batch_size", "merge_microbatches", "split_batch"]


def _batch_sizes(batch: Any) -> set[int]:
    if isinstance(batch, torch.Tensor):
        return {batch.shape[0]} if batch.dim() > 0 else set()
    if isinstance(batch, Mapping):
        return set().union(*(_batch_sizes(v) for v in batch.values())) if batch else set()
    if isinstance(batch, (list, tuple)):
        return set().union(*(_batch_sizes(v) for v in batch)) if batch else set()
    return set()


def _take(batch: Any, num_microbatches: int, index: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return torch.tensor_split(batch, num_microbatches)[index] if batch.dim() > 0 else batch
    if isinstance(batch, Mapping):
        return type(batch)({k: _take(v, num_microbatches, index) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_take(v, num_microbatches, index) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_take(v, num_microbatches, index) for v in batch)
    return batch  # non-tensor leaves (strings, numbers) are shared by every micro-batch


def batch_size(batch: Any) -> int:
    """The common size of dimension 0 of every tensor in ``batch``."""
    sizes = _batch_sizes(batch)
    if len(sizes) != 1:
        raise PipelineConfigError(
            f"Cannot split the batch into micro-batches: its tensors have first dimensions {sorted(sizes)} but need "
            f"one common batch dimension. Return tensors whose dimension 0 is the batch from your DataLoader."
        )
    return sizes.pop()


def split_batch(batch: Any, num_microbatches: int) -> tuple[list[Any], list[int]]:
    """Split every tensor of ``batch`` (nested in dicts, lists, tuples) into ``num_microbatches`` pieces.

    Returns the micro-batches and their sizes. When the batch size does not divide evenly, the first
    ``size % num_microbatches`` micro-batches get one extra sample; the strategy weights each micro-batch's loss by
    its share of the samples, so gradients still equal single-device ones for losses that average over the batch.
    """
    size = batch_size(batch)
    if size < num_microbatches:
        raise PipelineConfigError(
            f"A batch of {size} samples cannot be split into {num_microbatches} micro-batches. Use a batch size of "
            f"at least {num_microbatches} (ideally a multiple), or lower PipelineParallelStrategy(microbatches=...)."
        )
    base, extra = divmod(size, num_microbatches)
    micro_sizes = [base + (1 if i < extra else 0) for i in range(num_microbatches)]
    return [_take(batch, num_microbatches, i) for i in range(num_microbatches)], micro_sizes


def merge_microbatches(outputs: list[Any], sizes: list[int]) -> Any:
    """Combine per-micro-batch step outputs into what one step over the whole batch returns.

    Tensors whose first dimension is the micro-batch size are concatenated (nested tensors too); scalar tensors are
    averaged weighted by micro-batch size (a batch mean); dicts, lists and tuples are merged element-wise; anything else
    is taken from the first micro-batch.
    """
    first = outputs[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor) and first.is_nested:  # one nested tensor of every micro-batch's sequences
        return torch.nested.as_nested_tensor([t for o in outputs for t in o.unbind()])
    if isinstance(first, torch.Tensor):
        if first.dim() > 0 and all(o.shape[0] == n for o, n in zip(outputs, sizes, strict=True)):
            return torch.cat(outputs)
        if first.dim() == 0:
            weights = torch.tensor(sizes, dtype=torch.float64, device=first.device)
            stacked = torch.stack([o.double() for o in outputs])
            return ((stacked * weights).sum() / weights.sum()).to(first.dtype if first.is_floating_point()
                                                                  else torch.get_default_dtype())
        return first
    if isinstance(first, Mapping):
        return type(first)({k: merge_microbatches([o[k] for o in outputs], sizes) for k in first})  # type: ignore[call-arg]
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(merge_microbatches(list(items), sizes) for items in zip(*outputs, strict=True)))
    if isinstance(first, (list, tuple)):
        return type(first)(merge_microbatches(list(items), sizes) for items in zip(*outputs, strict=True))
    return first
