"""What crosses a stage boundary: a block's output (a tensor, or tuples / lists / dicts of tensors and plain values)
split into its tensors and a JSON description of the rest, so it travels without pickle and is rebuilt alike."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from lightning_pp.errors import PipelineConfigError

__all__ = ["Spec", "decode_spec", "encode_spec", "flatten", "map_tensors", "unflatten"]

# {"T": i}: the i-th tensor; {"V": x}: a plain value (None, bool, int, float, str); {"tuple"|"list": [...]};
# {"dict": [[key, spec], ...]}
Spec = dict[str, Any]
_PLAIN = (type(None), bool, int, float, str)


def flatten(obj: Any) -> tuple[list[torch.Tensor], Spec]:
    """The tensors of ``obj`` in a fixed order, and the spec that :func:`unflatten` rebuilds ``obj`` from."""
    tensors: list[torch.Tensor] = []

    def walk(value: Any) -> Spec:
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

    return tensors, walk(obj)


def unflatten(spec: Spec, tensors: list[torch.Tensor]) -> Any:
    """Rebuild what :func:`flatten` took apart, with ``tensors`` in place of the original ones."""
    if "T" in spec:
        return tensors[spec["T"]]
    if "V" in spec:
        return spec["V"]
    if "tuple" in spec:
        return tuple(unflatten(s, tensors) for s in spec["tuple"])
    if "list" in spec:
        return [unflatten(s, tensors) for s in spec["list"]]
    return {key: unflatten(s, tensors) for key, s in spec["dict"]}


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with ``fn`` applied to each of its tensors."""
    tensors, spec = flatten(obj)
    return unflatten(spec, [fn(t) for t in tensors])


def encode_spec(spec: Spec) -> bytes:
    return json.dumps(spec, separators=(",", ":")).encode()


def decode_spec(data: bytes) -> Spec:
    return json.loads(data.decode())  # type: ignore[no-any-return]
