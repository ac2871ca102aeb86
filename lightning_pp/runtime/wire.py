"""What crosses a stage boundary: a block's output (a tensor, or tuples / lists / dicts of tensors and plain values)
split into its tensors and a JSON description of the rest, so it travels without pickle and is rebuilt alike; and
tensors packed into one byte buffer, so several travel as one message."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_pp.errors import PipelineConfigError

__all__ = ["Layout", "Spec", "decode_spec", "encode_spec", "flatten", "has_nested", "map_tensors", "pack",
           "packed_size", "unflatten", "unpack"]

# {"T": i}: the i-th tensor; {"N": [i, j]}: a nested tensor, padded as the i-th tensor with its sizes as the j-th;
# {"V": x}: a plain value (None, bool, int, float, str); {"tuple"|"list": [...]}; {"dict": [[key, spec], ...]}
Spec = dict[str, Any]
_PLAIN = (type(None), bool, int, float, str)
# (dtype, shape) of each tensor in a packed buffer
Layout = list[tuple[torch.dtype, list[int]]]
_ALIGN = 16  # tensors start at multiples of this in a packed buffer, so each can be read in its own dtype


def flatten(obj: Any) -> tuple[list[torch.Tensor], Spec]:
    """The tensors of ``obj`` in a fixed order, and the spec that :func:`unflatten` rebuilds ``obj`` from."""
    tensors: list[torch.Tensor] = []

    def walk(value: Any) -> Spec:
        if isinstance(value, torch.Tensor) and value.is_nested:
            return walk_nested(value)
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return {"T": len(tensors) - 1}
        if isinstance(value, _PLAIN):
            return {"V": value}
        if type(value) in (tuple, list):
            return {type(value).__name__: [walk(v) for v in value]}
        if type(value) is dict and all(isinstance(k, (str, int)) for k in value):
            return {"dict": [[k, walk(v)] for k, v in value.items()]}
        raise PipelineConfigError(
            f"A block handed the next block a {type(value).__name__}, which cannot cross pipeline stages. What one "
            f"block returns must be a tensor, or tuples, lists and dicts (str or int keys) of tensors, None, numbers "
            f"and strings."
        )

    def walk_nested(value: torch.Tensor) -> Spec:
        # PyTorch's nn.TransformerEncoder runs its layers on a nested tensor in evaluation (its fast path): it travels
        # padded, with each sequence's size
        if value.requires_grad:
            raise PipelineConfigError(
                "A block handed the next block a nested tensor that requires gradients, which cannot cross pipeline "
                "stages. Nested tensors can cross only without gradients (in evaluation); in training, hand on a "
                "padded tensor and a mask."
            )
        sizes = torch.tensor([list(t.shape) for t in value.unbind()], dtype=torch.int64, device=value.device)
        tensors.extend([value.to_padded_tensor(0), sizes])
        return {"N": [len(tensors) - 2, len(tensors) - 1]}

    return tensors, walk(obj)


def unflatten(spec: Spec, tensors: list[torch.Tensor]) -> Any:
    """Rebuild what :func:`flatten` took apart, with ``tensors`` in place of the original ones."""
    if "T" in spec:
        return tensors[spec["T"]]
    if "N" in spec:
        padded, sizes = (tensors[i] for i in spec["N"])
        return torch.nested.nested_tensor([padded[b][tuple(slice(0, n) for n in size)]
                                           for b, size in enumerate(sizes.tolist())])
    if "V" in spec:
        return spec["V"]
    if "tuple" in spec:
        return tuple(unflatten(s, tensors) for s in spec["tuple"])
    if "list" in spec:
        return [unflatten(s, tensors) for s in spec["list"]]
    return {key: unflatten(s, tensors) for key, s in spec["dict"]}


def has_nested(spec: Spec) -> bool:
    """Whether ``spec`` holds a nested tensor, which :func:`unflatten` rebuilds by reading its tensors' values."""
    if "N" in spec:
        return True
    for kind in ("tuple", "list"):
        if kind in spec:
            return any(has_nested(s) for s in spec[kind])
    return "dict" in spec and any(has_nested(s) for _, s in spec["dict"])


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with ``fn`` applied to each of its tensors."""
    tensors, spec = flatten(obj)
    return unflatten(spec, [fn(t) for t in tensors])


def encode_spec(spec: Spec) -> bytes:
    return json.dumps(spec, separators=(",", ":")).encode()


def decode_spec(data: bytes) -> Spec:
    return json.loads(data.decode())  # type: ignore[no-any-return]


def _offsets(layout: Layout, start: int) -> tuple[list[int], int]:
    """Where each tensor of ``layout`` starts in a buffer whose tensors start at byte ``start``, and its size."""
    offsets: list[int] = []
    end = start
    for dtype, shape in layout:
        offsets.append(end)
        end += -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN
    return offsets, end


def packed_size(layout: Layout, start: int = 0) -> int:
    """The bytes :func:`pack` needs for tensors of ``layout`` placed from byte ``start``."""
    return _offsets(layout, start)[1]


def pack(tensors: list[torch.Tensor], device: torch.device, start: int = 0, size: int = 0) -> torch.Tensor:
    """A byte buffer on ``device`` (of at least ``size`` bytes) holding ``tensors`` from byte ``start`` on; the bytes
    before ``start`` are left for the caller."""
    for value in tensors:
        _refuse_dtensor(value)
    offsets, end = _offsets([(t.dtype, list(t.shape)) for t in tensors], start)
    buffer = torch.empty(max(end, size), dtype=torch.uint8, device=device)
    for tensor, offset in zip(tensors, offsets, strict=True):
        flat = tensor.reshape(-1).view(torch.uint8)
        buffer[offset:offset + flat.numel()].copy_(flat)
    return buffer


def _refuse_dtensor(value: torch.Tensor) -> None:
    if isinstance(value, DTensor):
        raise PipelineConfigError(
            f"A DTensor ({value.placements} on mesh {value.device_mesh.mesh_dim_names}) would cross stages outside "
            f"the pipelined micro-batches (an evaluation or generation pass through the blocks), where only plain "
            f"tensors can. Let the plan's last layer of each block return a plain tensor (use_local_output=True, the "
            f"default of ColwiseParallel, RowwiseParallel and SequenceParallel).")


def unpack(buffer: torch.Tensor, layout: Layout, start: int = 0) -> list[torch.Tensor]:
    """The tensors of ``layout`` that :func:`pack` placed in ``buffer`` (sharing its memory, but not views of it: each
    is a leaf of its own)."""
    offsets, _ = _offsets(layout, start)
    storage = buffer.untyped_storage()
    tensors = []
    for (dtype, shape), offset in zip(layout, offsets, strict=True):
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        tensors.append(torch.empty(0, dtype=dtype, device=buffer.device).set_(storage, offset // dtype.itemsize,
                                                                              shape, strides))
    return tensors
