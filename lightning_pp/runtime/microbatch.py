"""Splitting a batch into micro-batches along its samples, like ``torch.tensor_split`` (sizes differ by at most one),
and joining what the micro-batches' steps return.

What is split (:func:`split_batch`), for any batch Lightning's DataLoader gives:

* The batch size is the common size of dimension 0 of the batch's tensors (0-dimensional ones aside); a batch with no
  such tensor takes it from its flat sequences (lists or tuples of plain values, such as a collated text field).
* A tensor is split along dimension 0; a 0-dimensional one goes whole to every micro-batch.
* A list or tuple that holds no tensor and has exactly as many items as the batch has samples holds one value per
  sample (a text field's strings, ids, per-sample dicts): each micro-batch gets its own samples' items, in a sequence
  of the same type.
* Dicts (any mapping), dataclasses, namedtuples, and lists or tuples holding tensors or of another length are
  containers: their values are split by these rules and the container is rebuilt (a dataclass with
  ``dataclasses.replace``). Anything else (numbers, strings, other objects) goes whole to every micro-batch.
* A list or tuple of values shared by the whole batch whose length equals the batch size by chance (four
  configuration values in a batch of four) would be split: mark it with :func:`whole`. The pipeline refuses a
  sequence whose length was the batch size in one batch and not in another (see
  :func:`lightning_pp.model.batches.BatchGuard`), and a sequence of sequences both as long as the batch (rows or
  columns?).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

import torch

from lightning_pp.errors import PipelineConfigError

__all__ = ["batch_size", "merge_microbatches", "per_sample", "split_batch", "whole"]

_T = TypeVar("_T", list[Any], tuple[Any, ...])
_PLAIN = (type(None), bool, int, float, complex, str, bytes)


class _Whole:
    """A list or tuple that every micro-batch gets whole (see :func:`whole`)."""

    __slots__ = ()


class _WholeList(_Whole, list):  # type: ignore[type-arg]
    __slots__ = ()


class _WholeTuple(_Whole, tuple):  # type: ignore[type-arg]
    __slots__ = ()


def whole(values: _T) -> _T:
    """``values`` (a list or tuple) marked as shared by the whole batch: every micro-batch gets all of it, though it
    has as many items as the batch has samples. It stays a list (or tuple) that your step reads as before.

    The rule it overrides: a list or tuple without tensors that has as many items as the batch has samples holds one
    item per sample and is split with the batch; any other is shared by every micro-batch.

    Example:
        ``return {"x": torch.stack(xs), "loss_weights": whole([1.0, 0.5, 0.5, 1.0])}`` in a collate function.
    """
    if isinstance(values, list):
        return _WholeList(values)  # type: ignore[return-value]
    if isinstance(values, tuple):
        return _WholeTuple(values)  # type: ignore[return-value]
    raise PipelineConfigError(f"whole() marks a list or tuple; got {type(values).__name__}. Other values than lists "
                              f"and tuples (numbers, strings, objects) already go whole to every micro-batch.")


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def _is_dataclass(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_has_tensor(v) for v in value.values())
    if _is_dataclass(value):
        return any(_has_tensor(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, (list, tuple)) and not isinstance(value, _Whole):
        return any(_has_tensor(v) for v in value)
    return False


def _children(value: Any) -> list[tuple[str, Any]]:
    """The values a container holds, each with how to name it in a message (``['text']``, ``.ids``, ``[0]``)."""
    if isinstance(value, Mapping):
        return [(f"[{k!r}]", v) for k, v in value.items()]
    if _is_dataclass(value):
        return [(f".{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value)]
    if _is_namedtuple(value):
        return [(f".{name}", v) for name, v in zip(value._fields, value, strict=True)]
    if isinstance(value, (list, tuple)) and not isinstance(value, _Whole):
        return [(f"[{i}]", v) for i, v in enumerate(value)]
    return []


def per_sample(value: Any, size: int) -> bool:
    """Whether ``value`` is a list or tuple of one value per sample of a batch of ``size``: no tensor in it, not a
    namedtuple, not marked :func:`whole`, and ``size`` items."""
    return (isinstance(value, (list, tuple)) and not isinstance(value, _Whole) and not _is_namedtuple(value)
            and len(value) == size and not _has_tensor(value))


def _tensor_sizes(batch: Any) -> set[int]:
    if isinstance(batch, torch.Tensor):
        return {batch.shape[0]} if batch.dim() > 0 else set()
    return set().union(*(_tensor_sizes(v) for _, v in _children(batch)))


def _flat_lengths(batch: Any) -> set[int]:
    """The lengths of the flat sequences (of plain values only) in ``batch``."""
    if isinstance(batch, (list, tuple)) and not isinstance(batch, _Whole) and not _is_namedtuple(batch) and batch \
            and all(isinstance(v, _PLAIN) for v in batch):
        return {len(batch)}
    return set().union(*(_flat_lengths(v) for _, v in _children(batch)))


def batch_size(batch: Any) -> int:
    """The number of samples of ``batch``: the common size of dimension 0 of its tensors (see the module's rules)."""
    sizes = _tensor_sizes(batch)
    if not sizes:
        sizes = _flat_lengths(batch)
        if len(sizes) > 1:
            raise PipelineConfigError(
                f"Cannot split the batch into micro-batches: it has no tensor, and its lists of values have lengths "
                f"{sorted(sizes)}, so its number of samples is unclear. Give every per-sample list one item per "
                f"sample, mark a list shared by the whole batch with lightning_pp.whole(...), or add a tensor whose "
                f"dimension 0 is the batch.")
    if not sizes:
        raise PipelineConfigError(
            f"Cannot split a {type(batch).__name__} batch into micro-batches: it holds no tensor with a batch "
            f"dimension and no list of values to tell its number of samples from. Return tensors whose dimension 0 is "
            f"the batch (or lists of per-sample values) from your DataLoader, in dicts, lists, tuples or dataclasses.")
    if len(sizes) != 1:
        raise PipelineConfigError(
            f"Cannot split the batch into micro-batches: its tensors have first dimensions {sorted(sizes)} but need "
            f"one common batch dimension. Return tensors whose dimension 0 is the batch from your DataLoader (a "
            f"batch Lightning accepts: tensors, lists or tuples of per-sample values, dicts, dataclasses)."
        )
    return sizes.pop()


def _refuse_ambiguous(value: Any, size: int, where: str) -> None:
    """A per-sample sequence whose items are sequences as long as the batch too: rows of samples, or columns?"""
    if size > 1 and all(isinstance(v, (list, tuple)) and not isinstance(v, _Whole) and len(v) == size
                        for v in value):
        raise PipelineConfigError(
            f"Cannot split batch{where}: it is a {type(value).__name__} of {size} sequences of {size} items each, in "
            f"a batch of {size} samples, so it could hold one sequence per sample (rows) or one value per sample in "
            f"each sequence (columns, as default_collate transposes). The rule: a list or tuple with as many items "
            f"as the batch has samples holds one item per sample. Mark the outer one with "
            f"lightning_pp.whole(...) to split each inner sequence instead, or collate to tensors.")


def _take(value: Any, bounds: tuple[int, int], size: int, where: str) -> Any:
    start, stop = bounds
    if isinstance(value, torch.Tensor):
        return value[start:stop] if value.dim() > 0 else value
    if per_sample(value, size):
        _refuse_ambiguous(value, size, where)
        part = value[start:stop]
        return part if type(value) in (list, tuple) else type(value)(part)
    if isinstance(value, Mapping):
        return type(value)({k: _take(v, bounds, size, f"{where}[{k!r}]")  # type: ignore[call-arg]
                            for k, v in value.items()})
    if _is_dataclass(value):
        fields = dataclasses.fields(value)
        taken = {f.name: _take(getattr(value, f.name), bounds, size, f"{where}.{f.name}") for f in fields}
        rebuilt = dataclasses.replace(value, **{f.name: taken[f.name] for f in fields if f.init})
        for f in fields:
            if not f.init:  # not a constructor argument: set as the original holds it (frozen ones too)
                object.__setattr__(rebuilt, f.name, taken[f.name])
        return rebuilt
    if _is_namedtuple(value):
        return type(value)(*(_take(v, bounds, size, f"{where}.{n}") for n, v in zip(value._fields, value, strict=True)))
    if isinstance(value, (list, tuple)) and not isinstance(value, _Whole):
        return type(value)(_take(v, bounds, size, f"{where}[{i}]") for i, v in enumerate(value))
    return value  # numbers, strings, objects, sequences marked whole(): shared by every micro-batch


def split_batch(batch: Any, num_microbatches: int) -> tuple[list[Any], list[int]]:
    """Split ``batch`` into ``num_microbatches`` micro-batches by the rules in the module's docstring.

    Returns the micro-batches and their sizes. When the batch size does not divide evenly, the first
    ``size % num_microbatches`` micro-batches get one extra sample; the strategy weights each micro-batch's loss by
    its share of the samples, so gradients still equal single-device ones for losses that average over the batch.

    Raises:
        PipelineConfigError: the batch has no common size, fewer samples than ``num_microbatches``, or a sequence
            that is ambiguous under the rules.
    """
    size = batch_size(batch)
    if size < num_microbatches:
        raise PipelineConfigError(
            f"A batch of {size} samples cannot be split into {num_microbatches} micro-batches. Use a batch size of "
            f"at least {num_microbatches} (ideally a multiple), or lower PipelineParallelStrategy(microbatches=...)."
        )
    base, extra = divmod(size, num_microbatches)
    micro_sizes = [base + (1 if i < extra else 0) for i in range(num_microbatches)]
    starts = [sum(micro_sizes[:i]) for i in range(num_microbatches)]
    return [_take(batch, (start, start + n), size, "") for start, n in zip(starts, micro_sizes, strict=True)], \
        micro_sizes


def merge_microbatches(outputs: list[Any], sizes: list[int]) -> Any:
    """Combine per-micro-batch step outputs into what one step over the whole batch returns.

    Tensors whose first dimension is the micro-batch size are concatenated (nested tensors too), and so are lists and
    tuples of per-sample values (no tensor in them, one item per sample); scalar tensors are averaged weighted by
    micro-batch size (a batch mean); dicts, dataclasses, lists and tuples are merged element-wise; anything else is
    taken from the first micro-batch.
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
    if len(sizes) > 1 and all(per_sample(o, n) for o, n in zip(outputs, sizes, strict=True)):
        joined = [item for o in outputs for item in o]
        return joined if type(first) is list else type(first)(joined)
    if isinstance(first, Mapping):
        return type(first)({k: merge_microbatches([o[k] for o in outputs], sizes) for k in first})  # type: ignore[call-arg]
    if _is_dataclass(first):
        fields = [f for f in dataclasses.fields(first) if f.init]
        return dataclasses.replace(first, **{f.name: merge_microbatches([getattr(o, f.name) for o in outputs], sizes)
                                             for f in fields})
    if _is_namedtuple(first):
        return type(first)(*(merge_microbatches(list(items), sizes) for items in zip(*outputs, strict=True)))
    if isinstance(first, (list, tuple)) and not isinstance(first, _Whole):
        return type(first)(merge_microbatches(list(items), sizes) for items in zip(*outputs, strict=True))
    return first
