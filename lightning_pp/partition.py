"""Partitioning: how many consecutive blocks of the container each stage owns (pure functions over numbers)."""

from __future__ import annotations

from collections.abc import Sequence

from lightning_pp.errors import PipelineConfigError

__all__ = ["stage_layer_ranges", "uniform_balance", "validate_balance"]


def uniform_balance(num_layers: int, num_stages: int) -> list[int]:
    """Split ``num_layers`` as evenly as possible; the first ``num_layers % num_stages`` stages get one more."""
    if num_layers < num_stages:
        raise PipelineConfigError(
            f"The block container has {num_layers} blocks but the pipeline has {num_stages} stages; every stage needs "
            f"at least one block. Use at most {num_layers} devices, or split the model into more blocks."
        )
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if stage < extra else 0) for stage in range(num_stages)]


def validate_balance(balance: Sequence[int], num_layers: int, num_stages: int) -> list[int]:
    """Check a user's ``balance`` (blocks per stage) against the container and the number of stages."""
    balance = list(balance)
    if len(balance) != num_stages:
        raise PipelineConfigError(
            f"balance={balance} has {len(balance)} entries but the pipeline has {num_stages} stages (one per "
            f"device). Give one block count per stage, or run with devices={len(balance)}."
        )
    if any(not isinstance(n, int) or n < 1 for n in balance):
        raise PipelineConfigError(
            f"balance={balance} has an entry below 1; every stage needs at least one block of the container."
        )
    if sum(balance) != num_layers:
        raise PipelineConfigError(
            f"balance={balance} sums to {sum(balance)} but the block container has {num_layers} blocks. "
            f"Make the counts add up to {num_layers}, e.g. balance={uniform_balance(num_layers, num_stages)}."
        )
    return balance


def stage_layer_ranges(balance: Sequence[int]) -> list[range]:
    """The block indices of each stage: ``[2, 3]`` gives ``[range(0, 2), range(2, 5)]``."""
    ranges, start = [], 0
    for count in balance:
        ranges.append(range(start, start + count))
        start += count
    return ranges
