"""Partitioning: how many consecutive blocks of the container each stage owns (pure functions over numbers)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_pp.errors import PipelineConfigError

__all__ = ["min_max_partition", "stage_costs", "stage_layer_ranges", "uniform_balance", "validate_balance"]


def uniform_balance(num_layers: int, num_stages: int, stages_per_rank: int = 1) -> list[int]:
    """Split ``num_layers`` as evenly as possible; the first ``num_layers % num_stages`` stages get one more.
    ``stages_per_rank``: how many of the ``num_stages`` each rank holds (only the error's advice depends on it)."""
    if num_layers < num_stages and stages_per_rank > 1:
        ranks = num_stages // stages_per_rank
        fewer = f"stages_per_rank={num_layers // ranks} or fewer, or " if num_layers // ranks >= 2 else ""
        raise PipelineConfigError(
            f"The block container has {num_layers} blocks but stages_per_rank={stages_per_rank} on {ranks} ranks makes "
            f"{num_stages} stages ({stages_per_rank} x {ranks}); every stage needs at least one block. Use "
            f"{fewer}schedule='1f1b' (one stage per rank), or split the model into more blocks."
        )
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


def min_max_partition(costs: Sequence[float], num_stages: int, first_extra: float = 0.0,
                      last_extra: float = 0.0) -> list[int]:
    """Blocks per stage for the contiguous split of ``costs`` into ``num_stages`` non-empty runs whose largest stage
    cost is smallest; the first stage also pays ``first_extra`` (the work before the blocks), the last
    ``last_extra`` (the work after them).

    This is the *linear partition problem* (Skiena, The Algorithm Design Manual, 2nd ed., §8.5; torchgpipe's
    balancing cites the same block partitions of Bárány and Grinberg), solved exactly by dynamic programming over
    prefix sums in O(n² k) for n blocks and k stages: ``best[j][a]``, the least possible slowest stage when stages
    ``j..k-1`` hold blocks ``a..n-1``, is the minimum over the end ``b`` of stage ``j`` of
    ``max(cost of stage j = blocks a..b-1, best[j+1][b])``. Ties are broken alike everywhere: among the optimal
    splits, earlier stages take as many blocks as they can (the lexicographically largest counts), which for equal
    costs is :func:`uniform_balance`'s split.

    Raises:
        PipelineConfigError: fewer blocks than stages, or a cost that is negative or not finite.
    """
    n, k = len(costs), num_stages
    if k < 1:
        raise PipelineConfigError(f"num_stages={k}: a pipeline has at least one stage.")
    uniform_balance(n, k)  # raises when some stage would get no block
    values = [float(c) for c in (*costs, first_extra, last_extra)]
    if not all(math.isfinite(c) and c >= 0 for c in values):
        raise PipelineConfigError(
            f"Block costs must be finite and non-negative to balance stages; got costs={list(costs)}, "
            f"first_extra={first_extra}, last_extra={last_extra}."
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))

    def stage_cost(j: int, a: int, b: int) -> float:  # stage j holding blocks a..b-1
        return (prefix[b] - prefix[a]) + (first_extra if j == 0 else 0.0) + (last_extra if j == k - 1 else 0.0)

    # best[j][a] for a in the blocks stage j can start at: j..n-(k-j)
    best = [[math.inf] * (n + 1) for _ in range(k)]
    for a in range(k - 1, n):
        best[k - 1][a] = stage_cost(k - 1, a, n)
    for j in range(k - 2, -1, -1):
        for a in range(j, n - (k - j) + 1):
            best[j][a] = min(max(stage_cost(j, a, b), best[j + 1][b]) for b in range(a + 1, n - (k - j - 1) + 1))
    optimum = best[0][0]
    counts, a = [], 0
    for j in range(k - 1):
        # the largest end that keeps this stage and the best split of the rest within the optimum (the same float
        # expressions as above, so the optimum itself compares equal): the tie-breaking rule
        b = max(b for b in range(a + 1, n - (k - j - 1) + 1)
                if stage_cost(j, a, b) <= optimum and best[j + 1][b] <= optimum)
        counts.append(b - a)
        a = b
    counts.append(n - a)
    return counts


def stage_costs(costs: Sequence[float], balance: Sequence[int], first_extra: float = 0.0,
                last_extra: float = 0.0) -> list[float]:
    """Each stage's cost under ``balance``: its blocks' costs, plus ``first_extra`` on the first stage and
    ``last_extra`` on the last (what :func:`min_max_partition` minimises the largest of)."""
    totals = [float(sum(costs[r.start:r.stop])) for r in stage_layer_ranges(balance)]
    totals[0] += first_extra
    totals[-1] += last_extra
    return totals
