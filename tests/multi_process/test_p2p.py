"""Transfers whose shape or dtype change between steps, on the same channel, arrive intact in both directions."""

from __future__ import annotations

import pytest
import torch
from _launch import launch

STEPS = [
    [("float32", [4, 3]), ("float32", [2, 5, 2]), ("int64", [3])],  # nothing expected yet
    [("float32", [4, 3]), ("float32", [2, 5, 2]), ("int64", [3])],  # steady state: payloads posted ahead
    [("int32", [4, 3]), ("float32", [1, 5, 2]), ("int64", [3])],  # same bytes, other dtype; smaller shape
    [("float64", []), ("bool", [0, 7]), ("bfloat16", [2, 2, 1, 1, 1, 1, 1, 2])],  # scalar, empty, 8 dimensions
    [("float64", []), ("bool", [0, 7]), ("bfloat16", [2, 2, 1, 1, 1, 1, 1, 2])],
]


@pytest.mark.parametrize(("prefetch", "header_groups"), [(0, False), (2, False), (2, True)])
def test_changing_shapes_and_dtypes_arrive_intact(prefetch: int, header_groups: bool) -> None:
    """Packets with the expected layout, resized tensors after a changed header; and (``header_groups``) NCCL's
    protocol: headers on the host in groups of their own, payloads posted in batches."""
    ranks = launch(2, [{"scenario": "p2p_exchange",
                        "kwargs": {"steps": STEPS, "prefetch": prefetch, "header_groups": header_groups}}],
                   timeout=120)
    for rank in ranks:
        assert not rank.errors, rank.errors
        for step, (tensors, arrived) in enumerate(zip(STEPS, rank.results[0], strict=True)):
            assert len(arrived) == len(tensors)
            for (dtype, shape), tensor in zip(tensors, arrived, strict=True):
                expected = torch.arange(torch.Size(shape).numel()).reshape(shape).to(getattr(torch, dtype)) + step
                assert tensor.dtype == expected.dtype and torch.equal(tensor, expected), (step, dtype, shape)
