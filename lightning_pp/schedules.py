"""Pipeline schedules as data: per-rank action lists, their generators, the communication lowering and the checker.

A schedule is the single source of truth for what every rank does in one optimizer step. The same action lists
(:mod:`lightning_pp.actions`) are validated here, simulated in :mod:`lightning_pp.simulate`, executed by the runtime and
drawn by the monitor. Schedules are exchanged with torch as CSV files (:meth:`Schedule.to_csv`, :func:`load_csv`).

What a runtime does with a rank's list, in order: ``F`` of stage ``s`` takes stage ``s - 1``'s output of the
micro-batch, from its ``RECV_F`` or, when stage ``s - 1`` lives on the same rank, straight from that stage's earlier
``F`` (no transfer is scheduled between stages of one rank; the runtime keeps the value, as torch's
``set_local_fwd_input`` does). ``B`` back-propagates the stage's output gradient (from ``RECV_B``, or left by stage
``s + 1``'s earlier ``B`` / ``I`` on the same rank) into its input and its weights. ``I`` computes only the gradient
with respect to the input, which ``SEND_B`` (or the same-rank hand-over) passes on, and keeps what the weight
gradient needs (torch's ``stage_backward_input`` keeps the gradients where the weight paths branch off); ``W`` later
computes and accumulates the weight gradients from them. A stage holds a micro-batch from its ``F`` until its ``B``,
or until its ``W`` (most of the activations can go after ``I``).
"""

from __future__ import annotations

import contextlib
import csv
import functools
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from lightning_pp.actions import Action, ActionType, Schedule, format_grid
from lightning_pp.errors import PipelineConfigError, PipelineScheduleError
from lightning_pp.simulate import execute

__all__ = [
    "GENERATORS",
    "SCHEDULES",
    "Action",
    "ActionType",
    "Schedule",
    "StepSchedules",
    "add_communication",
    "build_schedule",
    "format_grid",
    "forward_sweep",
    "infer_stage_to_rank",
    "load_csv",
    "validate_schedule",
]

_F, _B, _I, _W = ActionType.FORWARD, ActionType.BACKWARD, ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT
# the receive that matches each send
_MATCHING_RECV = {ActionType.SEND_F: ActionType.RECV_F, ActionType.SEND_B: ActionType.RECV_B}
_MATCHING_SEND = {recv: send for send, recv in _MATCHING_RECV.items()}


# ----------------------------------------------------------------------------------------------------------------------
# Generators: compute-only action lists, one per rank. The pictures below are unit-cost timelines (every compute action
# one tick) for 4 ranks x 8 micro-batches, as drawn by `simulate.format_timeline`; `tests/test_schedules.py` asserts
# them. With several stages per rank a cell is the whole action, stage included (`4F1`: stage 4 forwards micro-batch 1).
# ----------------------------------------------------------------------------------------------------------------------


class Generator(Protocol):
    """``(num_ranks, num_microbatches, stages_per_rank) -> one compute-only action list per rank``."""

    def __call__(self, num_ranks: int, num_microbatches: int, stages_per_rank: int = 1) -> list[list[Action]]: ...


def _one_stage_per_rank(name: str, stages_per_rank: int) -> None:
    if stages_per_rank != 1:
        raise PipelineConfigError(
            f"Schedule {name!r} runs one stage per rank, got stages_per_rank={stages_per_rank}. Use "
            f"stages_per_rank=1, or 'interleaved_1f1b' for several stages per rank."
        )


def _naive(num_ranks: int, num_microbatches: int, stages_per_rank: int = 1) -> list[list[Action]]:
    """One micro-batch at a time through every stage, forward then backward: no two stages ever work together.

    stage 0 |F0............B0F1............B1F2...
    stage 1 |..F0........B0....F1........B1....F2...
    stage 2 |....F0....B0........F1....B1........F2...
    stage 3 |......F0B0............F1B1............F2B2...
    """
    _one_stage_per_rank("naive", stages_per_rank)
    return [
        [Action(stage, kind, mb) for mb in range(num_microbatches) for kind in (_F, _B)]
        for stage in range(num_ranks)
    ]


def _gpipe(num_ranks: int, num_microbatches: int, stages_per_rank: int = 1) -> list[list[Action]]:
    """Fill-drain: all forwards, then all backwards; every micro-batch's activations live until its backward.

    stage 0 |F0F1F2F3F4F5F6F7............B0B1B2B3B4B5B6B7
    stage 1 |..F0F1F2F3F4F5F6F7........B0B1B2B3B4B5B6B7
    stage 2 |....F0F1F2F3F4F5F6F7....B0B1B2B3B4B5B6B7
    stage 3 |......F0F1F2F3F4F5F6F7B0B1B2B3B4B5B6B7
    """
    _one_stage_per_rank("gpipe", stages_per_rank)
    return [
        [Action(stage, _F, mb) for mb in range(num_microbatches)]
        + [Action(stage, _B, mb) for mb in range(num_microbatches)]
        for stage in range(num_ranks)
    ]


def _one_f_one_b(num_ranks: int, num_microbatches: int, stages_per_rank: int = 1) -> list[list[Action]]:
    """Warm-up forwards, then one forward one backward, then cool-down backwards (PipeDream-flush).

    Stage ``s`` runs ``num_stages - s - 1`` warm-up forwards, so at most ``num_stages - s`` micro-batches are in
    flight on it: activation memory is bounded by the number of stages instead of the number of micro-batches.

    stage 0 |F0F1F2F3......B0F4B1F5B2F6B3F7B4..B5..B6..B7
    stage 1 |..F0F1F2....B0F3B1F4B2F5B3F6B4F7B5..B6..B7
    stage 2 |....F0F1..B0F2B1F3B2F4B3F5B4F6B5F7B6..B7
    stage 3 |......F0B0F1B1F2B2F3B3F4B4F5B5F6B6F7B7
    """
    _one_stage_per_rank("1f1b", stages_per_rank)
    return [_warmup_alternate_cooldown(num_microbatches, min(num_ranks - stage - 1, num_microbatches),
                                       functools.partial(Action, stage))
            for stage in range(num_ranks)]


def _warmup_alternate_cooldown(total: int, warmup: int, action: Callable[[ActionType, int], Action]) -> list[Action]:
    """``warmup`` forwards, then one forward one backward until the forwards are done, then the other backwards:
    the order of 1F1B and of interleaved 1F1B (``action(kind, k)`` is the ``k``-th forward or backward)."""
    actions = [action(_F, k) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [action(_F, warmup + k), action(_B, k)]
    return actions + [action(_B, k) for k in range(total - warmup, total)]


def _interleaved_counts(num_ranks: int, num_microbatches: int) -> list[int]:
    """The micro-batch counts 'interleaved_1f1b' runs nearest to ``num_microbatches`` (below and above)."""
    fits = [m for m in range(num_ranks, 2 * num_microbatches + 2 * num_ranks) if m % (m // num_ranks) == 0]
    below = [m for m in fits if m < num_microbatches]
    above = [m for m in fits if m > num_microbatches]
    return ([below[-1]] if below else []) + above[:1]


def _interleaved_1f1b(num_ranks: int, num_microbatches: int, stages_per_rank: int = 2) -> list[list[Action]]:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron's virtual pipeline): each rank holds ``v`` stages.

    Rank ``r`` holds stages ``r, r + p, ..., r + (v - 1) p`` (round-robin), so a micro-batch visits every rank ``v``
    times and the pipeline fills and drains in ``v`` times shorter steps: with unit costs per stage, the bubble is
    (p - 1) / (v m + p - 1) of the step instead of 1F1B's (p - 1) / (m + p - 1). Micro-batches go through a rank's
    stages in rounds (depth first: a round's forwards on the rank's first stage, then on its second, ...); rank ``r``
    runs ``(v - 1) g + 2 (p - 1 - r)`` warm-up forwards (``g`` micro-batches per round), then alternates one forward
    and one backward, then drains the backwards. Each stage forwards and backwards in micro-batch order, which keeps
    every rank-to-rank channel's receives in the order of its sends.

    Micro-batch rule, torch's (``ScheduleInterleaved1F1B``): ``rounds = m // p`` rounds of ``g = m / rounds``
    micro-batches, so ``m`` must be a multiple of ``m // p`` (p = 4: m = 4, 5, 6, 7, 8, 10, 12, 15, 16, ...); and,
    unlike torch, at least ``p``: with fewer, a rank's next stage waits for the round to come around and the bubble
    exceeds the formula. For these counts the lists are the same as torch's (Megatron's rule, m a multiple of p, is
    the special case g = p).

    2 ranks x 4 micro-batches, v = 2 (stage 2 is rank 0's second stage; bubble 1/9):

    rank 0 |0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 ... 2B2 ... 2B3 0B2 0B3
    rank 1 |... 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3

    4 ranks x 4 micro-batches, v = 2 (bubble 3/11):

    rank 0 |0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 ... ... ... 4B0 ... 4B1 ... 4B2 ... 4B3 0B0 0B1 0B2 0B3
    rank 1 |... 1F0 1F1 1F2 1F3 5F0 5F1 5F2 5F3 ... 5B0 ... 5B1 ... 5B2 ... 5B3 1B0 1B1 1B2 1B3
    rank 2 |... ... 2F0 2F1 2F2 2F3 6F0 6F1 6F2 6B0 6F3 6B1 ... 6B2 ... 6B3 2B0 2B1 2B2 2B3
    rank 3 |... ... ... 3F0 3F1 3F2 3F3 7F0 7B0 7F1 7B1 7F2 7B2 7F3 7B3 3B0 3B1 3B2 3B3
    """
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    if v < 2:
        raise PipelineConfigError(
            f"Schedule 'interleaved_1f1b' needs at least 2 stages per rank, got stages_per_rank={v}. Pass "
            f"stages_per_rank=2 (or more), or use '1f1b' for one stage per rank."
        )
    if m < p or m % (m // p):
        raise PipelineConfigError(
            f"Schedule 'interleaved_1f1b' sends micro-batches through a rank's stages in rounds of equal size, "
            f"rounds = num_microbatches // num_ranks, so num_microbatches must be at least num_ranks and a multiple "
            f"of its number of rounds: got num_microbatches={m}, num_ranks={p}"
            + (f" (rounds = {m // p}, {m} % {m // p} = {m % (m // p)})" if m >= p else "")
            + f". Use {' or '.join(map(str, _interleaved_counts(p, m)))} micro-batches."
        )
    group = m // (m // p)  # micro-batches per round, at least p
    total = v * m  # forwards (and backwards) per rank

    def local_action(rank: int, kind: ActionType, k: int) -> Action:
        """The ``k``-th forward (or backward) of ``rank``: groups of micro-batches, stage by stage."""
        chunk = (k // group) % v
        if kind is not _F:
            chunk = v - 1 - chunk  # backwards visit the rank's stages last to first
        return Action(chunk * p + rank, kind, (k // (group * v)) * group + k % group)

    return [_warmup_alternate_cooldown(total, min(total, (v - 1) * group + 2 * (p - 1 - rank)),
                                       functools.partial(local_action, rank))
            for rank in range(p)]


def _zb_h1(num_ranks: int, num_microbatches: int, stages_per_rank: int = 1) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with B split into I and W, W deferred.

    Only I (the input gradient) is on the critical path back to the first stage; each stage's W (the weight gradient)
    waits and fills what would be the cool-down bubble. Stage ``s`` runs 1F1B's ``p - 1 - s`` warm-up forwards, then
    one F and one I per step, adding the W of the micro-batch ``s`` steps back from step ``s`` on, and ends with the
    remaining W's: the lists of torch's ``ScheduleInterleavedZeroBubble`` with one stage per rank. With F = I = W and
    at least as many micro-batches as stages, the bubble is (p - 1) / (3 m + p - 1) of the step: (p - 1) ticks, a
    third of 1F1B's (p - 1)(F + B) with B = I + W. With fewer micro-batches the W's cannot hide the backward chain and
    the bubble is larger (still smaller than 1F1B's).

    Memory: as in 1F1B, at most ``p - s`` micro-batches are between their F and their I on stage ``s``, and those
    hold the full activations; counting a micro-batch until its W (which keeps the inputs of the weight
    multiplications and the output gradients), every stage holds at most ``p``, 1F1B's peak (stage 0's). Holding
    only ``p - s`` until the W cannot reach this bubble: the last stage would have to run F, I, W of each micro-batch
    back to back, so stage 0's last I could not start before ``2p + 3m - 4`` and its step would end at ``2p + 3m - 2``
    or later, past the ``3m + p - 1`` ticks of a ZB-H1 step.

    stage 0 |F0F1F2F3......I0W0F4I1W1F5I2W2F6I3W3F7I4W4I5W5I6W6I7W7
    stage 1 |..F0F1F2....I0F3I1W0F4I2W1F5I3W2F6I4W3F7I5W4I6W5I7W6W7
    stage 2 |....F0F1..I0F2I1F3I2W0F4I3W1F5I4W2F6I5W3F7I6W4I7W5W6W7
    stage 3 |......F0I0F1I1F2I2F3I3W0F4I4W1F5I5W2F6I6W3F7I7W4W5W6W7
    """
    _one_stage_per_rank("zb_h1", stages_per_rank)
    p, m = num_ranks, num_microbatches
    lists = []
    for stage in range(p):
        warmup = min(p - 1 - stage, m)
        actions = [Action(stage, _F, mb) for mb in range(warmup)]
        weights = 0  # W's issued so far, in micro-batch order
        for step in range(m):
            if warmup + step < m:
                actions.append(Action(stage, _F, warmup + step))
            actions.append(Action(stage, _I, step))
            if step >= stage:
                actions.append(Action(stage, _W, weights))
                weights += 1
        actions += [Action(stage, _W, mb) for mb in range(weights, m)]
        lists.append(actions)
    return lists


def _zbv(num_ranks: int, num_microbatches: int, stages_per_rank: int = 2) -> list[list[Action]]:
    """ZB-V (Qi et al. 2023, section 6): two stages per rank in a V, B split into I and W, W filling the bubbles.

    Rank ``r`` holds stages ``r`` and ``2p - 1 - r``: a micro-batch goes down the ranks on the first stages and back
    up on the second, so rank ``p - 1`` holds the two middle stages and the last stage sits on rank 0, next to the
    first (its loss is computed where the input came in). Stages ``p - 1`` and ``p`` hand their values over in memory.
    The lists are those of torch's ``ScheduleZBVZeroBubble``. With F = I = W per stage and at least ``2p - 1``
    micro-batches the bubble is (p - 1) / (6 m + p - 1) of the step: (p - 1) ticks of stages half as long as ZB-H1's
    for the same model, so half its bubble; with fewer micro-batches the warm-up cannot be filled and it is larger.
    Memory: counting a micro-batch until its W, a rank holds at most ``2p`` micro-batches of its half-size stages,
    the activations of ``p`` full ones: 1F1B's peak (stage 0's).

    2 ranks x 4 micro-batches (rank 0 holds stages 0 and 3, rank 1 stages 1 and 2; bubble 1/25):

    rank 0 |0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3
    rank 1 |... 1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3
    """
    if stages_per_rank != 2:
        raise PipelineConfigError(
            f"Schedule 'zbv' runs exactly 2 stages per rank (a V: stages r and 2p - 1 - r on rank r), got "
            f"stages_per_rank={stages_per_rank}. Pass stages_per_rank=2, or use 'zb_h1' for one stage per rank."
        )
    p, m = num_ranks, num_microbatches
    padded = max(2 * p - 1, m)  # built for enough micro-batches to fill the V, the extra ones dropped at the end
    lists = []
    for rank in range(p):
        down, up = rank, 2 * p - 1 - rank  # the rank's stage on the way down and on the way back up
        done = {(stage, kind): 0 for stage in (down, up) for kind in (_F, _I, _W)}
        actions: list[Action] = []

        def run(stage: int, *kinds: ActionType, actions: list[Action] = actions,
                done: dict[tuple[int, ActionType], int] = done) -> None:
            for kind in kinds:
                actions.append(Action(stage, kind, done[stage, kind]))
                done[stage, kind] += 1

        for _ in range(2 * (p - rank) - 1):  # warm-up: fill the way down
            run(down, _F)
        for _ in range(rank):
            run(up, _F)
            run(down, _F)
        for _ in range(p - rank):  # the way back up starts
            run(up, _F, _I, _W)
        while done[up, _F] < done[down, _F] or done[down, _F] < padded:  # steady: both stages F, I, W in turn
            if done[down, _F] < padded:
                run(down, _F)
            run(down, _I, _W)
            run(up, _F, _I, _W)
        for _ in range(rank):  # cool-down: I's first, the W's fill behind them
            run(down, _I)
            run(up, _I)
        for _ in range(p - rank):
            run(down, _I)
            run(down, _W)
        while done[up, _W] < done[up, _I]:
            run(up, _W)
        while done[down, _W] < done[down, _I]:
            run(down, _W)
        lists.append([action for action in actions if action.microbatch < m])
    return lists


def _dualpipev(num_ranks: int, num_microbatches: int, stages_per_rank: int = 2) -> list[list[Action]]:
    """DualPipeV (DeepSeek-V3's DualPipe, "cut in half" into a V; the lists of torch's ``ScheduleDualPipeV``).

    The stages sit as in ``zbv`` (rank ``r`` holds stages ``r`` and ``2p - 1 - r``). After a warm-up that fills the
    way down, each rank's steady state pairs a forward of one of its stages with a full backward (B) of the other:
    DualPipe overlaps the pair's computation with the other's communication (an MoE's all-to-all), which a runtime
    running one action at a time turns into back-to-back actions. The first half of the cool-down runs full
    backwards, the second half splits them into I and W, the deferred W's filling the drain. Needs ``m >= 2p``
    micro-batches. With F = I = W (B = I + W) the bubble is ZB-V's, (p - 1) / (6 m + p - 1); what DualPipe adds over
    ZB-V is the overlap, which pays where transfers are long (expert parallelism), not in the compute bubble. Memory:
    at most ``2p + 1`` micro-batches of a rank's half-size stages (counting each until its B or W), one more than
    ZB-V's and 1F1B's peak.

    2 ranks x 4 micro-batches (rank 0 holds stages 0 and 3, rank 1 stages 1 and 2; drawn with B one tick):

    rank 0 |0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3
    rank 1 |... 1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3
    """
    if stages_per_rank != 2:
        raise PipelineConfigError(
            f"Schedule 'dualpipev' runs exactly 2 stages per rank (a V: stages r and 2p - 1 - r on rank r), got "
            f"stages_per_rank={stages_per_rank}. Pass stages_per_rank=2."
        )
    p, m = num_ranks, num_microbatches
    if m < 2 * p:
        raise PipelineConfigError(
            f"Schedule 'dualpipev' needs at least as many micro-batches as stages (2 x {p} ranks = {2 * p}), got "
            f"{m}. Pass microbatches >= {2 * p}, or use 'zbv' (any count)."
        )
    return [_dualpipev_rank(rank, p, m) for rank in range(p)]


def _dualpipev_rank(rank: int, p: int, m: int) -> list[Action]:
    """Rank ``rank``'s list of :func:`_dualpipev`."""
    down, up = rank, 2 * p - 1 - rank
    forwards, backwards = {down: 0, up: 0}, {down: 0, up: 0}  # the next micro-batch of each stage's F, B or I
    pending: list[Action] = []  # the W's owed by I's, run first-in first-out where the list leaves room
    actions: list[Action] = []

    def forward(stage: int) -> None:
        actions.append(Action(stage, _F, forwards[stage]))
        forwards[stage] += 1

    def backward(stage: int, split: bool = False) -> None:
        actions.append(Action(stage, _I if split else _B, backwards[stage]))
        if split:
            pending.append(Action(stage, _W, backwards[stage]))
        backwards[stage] += 1

    def deferred_weight() -> None:
        if pending:
            actions.append(pending.pop(0))

    for _ in range(2 * (p - rank - 1)):  # warm-up: fill the way down
        forward(down)
    for _ in range(rank + 1):
        forward(down)
        forward(up)
    for _ in range(p - rank - 1):  # the way back up starts, zero-bubble style
        backward(up, split=True)
        deferred_weight()
        forward(up)
    for _ in range(m - 2 * p + rank + 1):  # steady state: forward of one stage with the backward of the other
        forward(down)
        backward(up)
        forward(up)
        backward(down)
    for _ in range(p - rank - 1):
        backward(up)
        forward(up)
        backward(down)
    split = False  # the cool-down's second half splits its backwards, so that W's fill the drain
    for i in range(rank + 1):
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        backward(up, split)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        backward(down, split)
    for _ in range(p - rank - 1):
        deferred_weight()
        backward(down, split)
    while pending:
        deferred_weight()
    return actions


# the schedules of one stage per rank with a full backward (B)
SCHEDULES: dict[str, Generator] = {
    "naive": _naive,
    "gpipe": _gpipe,
    "1f1b": _one_f_one_b,
}
# every generator build_schedule knows (PipelineParallelStrategy accepts each): also several stages per rank, I / W
GENERATORS: dict[str, Generator] = {
    **SCHEDULES,
    "interleaved_1f1b": _interleaved_1f1b,
    "zb_h1": _zb_h1,
    "zbv": _zbv,
    "dualpipev": _dualpipev,
    # one batch's lists (evaluation, the micro-batch count); training runs 1F1B over every batch's micro-batches as one
    # stream, cut into steps (lightning_pp.cross_batch)
    "pipedream_2bw": _one_f_one_b,
}


# ----------------------------------------------------------------------------------------------------------------------
# Placement, lowering, building, CSV
# ----------------------------------------------------------------------------------------------------------------------


def infer_stage_to_rank(actions: Sequence[Sequence[Action]]) -> tuple[int, ...]:
    """Which rank holds each stage, read off per-rank action lists; every rank must hold as many stages as the others.

    Raises:
        PipelineScheduleError: A stage appears on two ranks, a stage number is missing, or the ranks hold different
            numbers of stages (with the grid, the offending cell marked).
    """
    owner: dict[int, int] = {}
    for rank, rank_actions in enumerate(actions):
        for index, action in enumerate(rank_actions):
            held = owner.setdefault(action.stage, rank)
            if held != rank:
                raise PipelineScheduleError(
                    f"Stage {action.stage} has actions on rank {held} and on rank {rank} ({action}); a stage lives on "
                    f"one rank. Move every action of stage {action.stage} to one rank's list.\n"
                    f"{format_grid(actions, mark=(rank, index))}"
                )
    num_stages = max(owner, default=-1) + 1
    missing = [stage for stage in range(num_stages) if stage not in owner]
    if missing:
        raise PipelineScheduleError(
            f"Stages {missing} have no actions, but stage {num_stages - 1} does: stages are numbered 0..S-1 without "
            f"gaps.\n{format_grid(actions)}"
        )
    held_by = [[stage for stage in range(num_stages) if owner[stage] == rank] for rank in range(len(actions))]
    if len({len(stages) for stages in held_by}) > 1:
        listing = ", ".join(f"rank {rank}: {stages}" for rank, stages in enumerate(held_by))
        raise PipelineScheduleError(
            f"The ranks hold different numbers of stages ({listing}); every rank must hold the same number "
            f"(stages_per_rank).\n{format_grid(actions)}"
        )
    return tuple(owner[stage] for stage in range(num_stages))


def add_communication(
    compute: Sequence[Sequence[Action]], stage_to_rank: Sequence[int] | None = None
) -> list[list[Action]]:
    """Lower compute-only per-rank lists: a receive right before the compute that needs it, a send right after the
    producer.

    F needs ``RECV_F`` (unless first stage) and is followed by ``SEND_F`` (unless last stage); B and I need ``RECV_B``
    (unless last stage) and are followed by ``SEND_B`` (unless first stage); W has no transfer. A transfer between two
    stages on the same rank (``stage_to_rank``, inferred from the lists when left out) is left out: the runtime hands
    the value over in memory, the consumer finding it where the producer, earlier in the same list, left it (the
    output of stage ``s``'s F is the input of stage ``s + 1``'s F of the same micro-batch, the input gradient from
    stage ``s + 1``'s B or I the output gradient of stage ``s``'s B or I).
    """
    placement = tuple(stage_to_rank) if stage_to_rank is not None else infer_stage_to_rank(compute)
    last = len(placement) - 1

    def remote(stage: int, peer: int) -> bool:
        return 0 <= peer <= last and placement[peer] != placement[stage]

    lowered: list[list[Action]] = []
    for actions in compute:
        out: list[Action] = []
        for action in actions:
            stage, mb = action.stage, action.microbatch
            if action.type is _F:
                if remote(stage, stage - 1):
                    out.append(Action(stage, ActionType.RECV_F, mb))
                out.append(action)
                if remote(stage, stage + 1):
                    out.append(Action(stage, ActionType.SEND_F, mb))
            elif action.type in (_B, _I):
                if remote(stage, stage + 1):
                    out.append(Action(stage, ActionType.RECV_B, mb))
                out.append(action)
                if remote(stage, stage - 1):
                    out.append(Action(stage, ActionType.SEND_B, mb))
            elif action.type is _W:
                out.append(action)
            else:
                raise PipelineScheduleError(f"add_communication expects compute-only lists, got {action}.")
        lowered.append(out)
    return lowered


def _counts(num_ranks: int, num_microbatches: int, stages_per_rank: int) -> None:
    for label, value in (("num_ranks", num_ranks), ("num_microbatches", num_microbatches),
                         ("stages_per_rank", stages_per_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PipelineConfigError(
                f"A schedule needs at least one rank, one micro-batch and one stage per rank, got {label}={value!r}; "
                f"pass a positive int."
            )


def build_schedule(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    forward_only: bool = False,
    stages_per_rank: int | None = None,
) -> Schedule:
    """Generate (or load), lower and validate the schedule ``name`` for ``num_ranks`` ranks.

    Args:
        name: A generator of :data:`GENERATORS` (``"naive"``, ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``,
            ``"zb_h1"``), or the path of a ``.csv`` file in torch.distributed.pipelining's format (see
            :func:`load_csv`).
        num_ranks: Ranks in the pipeline (for one stage per rank, the number of stages).
        num_microbatches: Micro-batches per step.
        forward_only: Keep only the forwards (evaluation).
        stages_per_rank: Stages each rank holds (default 1; for a CSV file, read off the file when left out, checked
            when given).

    Raises:
        PipelineConfigError: An unknown name, counts below one, or counts the generator cannot run (the error names
            the rule and a fix).
        PipelineScheduleError: A CSV file whose schedule is inconsistent (with the grid, the broken cell marked).
    """
    if name.lower().endswith(".csv"):
        return load_csv(name, num_ranks, num_microbatches, forward_only=forward_only, stages_per_rank=stages_per_rank)
    if name not in GENERATORS:
        raise PipelineConfigError(
            f"Unknown schedule {name!r}. Valid schedules: {', '.join(sorted(GENERATORS))}, or the path of a .csv "
            f"file (one row of actions per rank, as torch.distributed.pipelining writes them)."
        )
    stages_per_rank = 1 if stages_per_rank is None else stages_per_rank
    _counts(num_ranks, num_microbatches, stages_per_rank)
    compute = GENERATORS[name](num_ranks, num_microbatches, stages_per_rank)
    return _finish(name, compute, num_microbatches, forward_only)


def _finish(name: str, compute: Sequence[Sequence[Action]], num_microbatches: int, forward_only: bool) -> Schedule:
    """Keep the forwards (``forward_only``), lower, validate, wrap."""
    if forward_only:
        compute = [[a for a in actions if a.type is _F] for actions in compute]
    placement = infer_stage_to_rank(compute)
    lowered = add_communication(compute, placement)
    validate_schedule(lowered, num_microbatches, forward_only=forward_only, stage_to_rank=placement)
    return Schedule(name, len(placement), num_microbatches, tuple(tuple(actions) for actions in lowered), placement)


def forward_sweep(stage_to_rank: Sequence[int], num_microbatches: int) -> Schedule:
    """Forward only, for any micro-batch count: each rank runs its stages in order, every micro-batch through one
    before the next. For evaluation batches a schedule's own rule cannot split (interleaved 1F1B with fewer
    micro-batches than ranks, a CSV file's fixed count)."""
    compute = [[Action(stage, _F, mb) for stage, holder in enumerate(stage_to_rank) if holder == rank
                for mb in range(num_microbatches)] for rank in range(max(stage_to_rank) + 1)]
    return _finish("forward_sweep", compute, num_microbatches, forward_only=True)


_TORCH_BOOKKEEPING = ("UNSHARD", "RESHARD", "REDUCE_GRAD")  # torch's actions without micro-batch, not ours


def load_csv(
    path: str | os.PathLike[str],
    num_ranks: int | None = None,
    num_microbatches: int | None = None,
    *,
    forward_only: bool = False,
    stages_per_rank: int | None = None,
) -> Schedule:
    """Read a schedule in torch.distributed.pipelining's CSV format, lower it (add the transfers) and validate it.

    One row per rank of comma-separated actions (``0F0,0F1,2F0,...,0I0,0W0``), as :meth:`Schedule.to_csv` and torch's
    ``_dump_csv`` write them; empty cells (torch's idle slots) are skipped. Which rank holds which stage is read off
    the rows. Only the compute actions are kept: the transfers are added by :func:`add_communication`. So a file in
    torch's ``compute_comms`` format (the default of ``_PipelineScheduleRuntime._dump_csv``) loads too, its
    ``SEND``/``RECV`` placed anew: torch posts a receive early and waits for it at the compute, while here a receive
    blocks where it stands, right before its compute. Its ``UNSHARD``, ``RESHARD`` and ``REDUCE_GRAD`` actions (FSDP
    and data-parallel bookkeeping, done outside the schedule here) are dropped as well.

    Args:
        path: The CSV file.
        num_ranks: Expected number of rows (ranks); left out, the file's.
        num_microbatches: Expected micro-batches; left out, one more than the largest micro-batch in the file.
        forward_only: Keep only the forwards (evaluation).
        stages_per_rank: Expected stages per rank; left out, the file's.

    Raises:
        PipelineConfigError: The file does not exist, holds no actions or does not have the expected counts.
        PipelineScheduleError: An action cannot be parsed or the schedule is inconsistent (with the grid).
    """
    file = Path(path)
    if not file.is_file():
        raise PipelineConfigError(
            f"Schedule file {str(file)!r} does not exist. Pass the path of a CSV file with one row of actions per "
            f"rank (e.g. written by Schedule.to_csv), or the name of a generator: {', '.join(sorted(GENERATORS))}."
        )
    rows: list[list[Action]] = []
    with open(file, newline="") as handle:
        for row in csv.reader(handle):
            cells = [cell.strip() for cell in row]
            actions = [Action.parse(cell) for cell in cells if cell and not cell.endswith(_TORCH_BOOKKEEPING)]
            rows.append([action for action in actions if action.is_compute])
    while rows and not rows[-1]:  # trailing empty lines
        rows.pop()
    if not rows:
        raise PipelineConfigError(
            f"Schedule file {str(file)!r} holds no compute actions; write one row of actions per rank."
        )
    if num_ranks is not None and len(rows) != num_ranks:
        raise PipelineConfigError(
            f"Schedule file {str(file)!r} has {len(rows)} rows (ranks) but num_ranks={num_ranks}: write one row per "
            f"rank, or run it on {len(rows)} ranks."
        )
    largest = max(a.microbatch for row in rows for a in row) + 1
    if num_microbatches is None:
        num_microbatches = largest
    elif largest != num_microbatches:
        raise PipelineConfigError(
            f"Schedule file {str(file)!r} schedules micro-batches 0..{largest - 1} but num_microbatches="
            f"{num_microbatches}: a file fixes the micro-batch count; use num_microbatches={largest} or write the "
            f"file for {num_microbatches}."
        )
    placement = infer_stage_to_rank(rows)
    found = len(placement) // len(rows)
    if stages_per_rank is not None and found != stages_per_rank:
        raise PipelineConfigError(
            f"Schedule file {str(file)!r} places {found} stage(s) on each rank but stages_per_rank={stages_per_rank}; "
            f"pass stages_per_rank={found} (or leave it out)."
        )
    return _finish(str(file), rows, num_microbatches, forward_only)


# ----------------------------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------------------------

_CHANNEL_NAME = {ActionType.SEND_F: "activations", ActionType.SEND_B: "gradients"}


def validate_schedule(
    actions: Sequence[Sequence[Action]],
    num_microbatches: int,
    forward_only: bool = False,
    stage_to_rank: Sequence[int] | None = None,
) -> None:
    """Check a lowered schedule (one list per rank); raise :class:`PipelineScheduleError` with the rank x step grid
    and the broken cell marked.

    Rules:

    - Placement: every stage lives on one rank (``stage_to_rank``, read off the lists when left out), every rank holds
      as many stages as the others.
    - Compute: each stage forwards every micro-batch once and (unless ``forward_only``) backwards it once, either with
      one B or with one I and, later, one W; B and I come after the stage's F.
    - Data: a compute that needs another stage's output finds it first: on another rank, its receive comes earlier in
      the list; on the same rank, the producing compute does (no transfer between stages of one rank). A send comes
      after the compute that produces it.
    - Transfers: every send has exactly one matching receive on the peer's rank, and vice versa; and on each channel
      (source rank, destination rank, activations or gradients) the receives are posted in the order of the sends:
      gloo matches messages per peer and tag in posting order, and the transfers reuse the same tags for every
      micro-batch, so a swapped pair would silently deliver the wrong tensors.
    - Progress: executing the lists with the simulator's loop (sends never block, a receive waits for its send)
      finishes, i.e. there is no deadlock.
    """
    def fail(message: str, cell: tuple[int, int] | None) -> None:
        raise PipelineScheduleError(f"{message}\n{format_grid(actions, mark=cell)}")

    placement = infer_stage_to_rank(actions)
    if stage_to_rank is not None:
        given = tuple(stage_to_rank)
        for rank, rank_actions in enumerate(actions):
            for index, action in enumerate(rank_actions):
                if not 0 <= action.stage < len(given) or given[action.stage] != rank:
                    fail(f"Action {action} is in the list of rank {rank}, but stage {action.stage} lives on rank "
                         f"{given[action.stage] if 0 <= action.stage < len(given) else None} (stage_to_rank={given}).",
                         (rank, index))
        placement = given
    last = len(placement) - 1

    def local(stage: int, peer: int) -> bool:
        return placement[peer] == placement[stage]

    for rank, rank_actions in enumerate(actions):
        seen: set[tuple[int, ActionType, int]] = set()

        def done(stage: int, kinds: tuple[ActionType, ...], mb: int, seen: set[tuple[int, ActionType, int]] = seen
                 ) -> bool:
            return any((stage, kind, mb) in seen for kind in kinds)

        for index, action in enumerate(rank_actions):
            stage, kind, mb = action.stage, action.type, action.microbatch
            cell = (rank, index)
            if not 0 <= mb < num_microbatches:
                fail(f"Action {action} names micro-batch {mb}; valid: 0..{num_microbatches - 1}.", cell)
            if not action.is_compute:
                if not 0 <= action.peer <= last:
                    fail(f"Action {action} talks to stage {action.peer}, which does not exist.", cell)
                if local(stage, action.peer):
                    fail(f"Action {action} transfers between stages {stage} and {action.peer}, which both live on "
                         f"rank {rank}: the runtime hands the value over in memory. Drop the transfer (or let "
                         f"add_communication lower the compute-only lists).", cell)
            if (stage, kind, mb) in seen:
                fail(f"Action {action} appears twice on rank {rank}.", cell)
            if kind in (_B, _I) and done(stage, (_B, _I), mb):
                fail(f"Action {action}: stage {stage} already backwarded micro-batch {mb} (one B, or one I and one W).",
                     cell)
            if kind is _F and stage > 0:
                if local(stage, stage - 1) and not done(stage - 1, (_F,), mb):
                    fail(f"Action {action} runs before {stage - 1}F{mb}, whose output it takes (both on rank {rank}).",
                         cell)
                if not local(stage, stage - 1) and not done(stage, (ActionType.RECV_F,), mb):
                    fail(f"Action {action} runs before its RECV_F on rank {rank}.", cell)
            if kind in (_B, _I):
                if not done(stage, (_F,), mb):
                    fail(f"Action {action} runs before the forward of micro-batch {mb} ({stage}F{mb}).", cell)
                if stage < last and local(stage, stage + 1) and not done(stage + 1, (_B, _I), mb):
                    fail(f"Action {action} runs before {stage + 1}B{mb} or {stage + 1}I{mb}, whose input gradient it "
                         f"takes (both on rank {rank}).", cell)
                if stage < last and not local(stage, stage + 1) and not done(stage, (ActionType.RECV_B,), mb):
                    fail(f"Action {action} runs before its RECV_B on rank {rank}.", cell)
            if kind is _W and not done(stage, (_I,), mb):
                fail(f"Action {action} runs before {stage}I{mb}: the weight gradient needs the input gradient's "
                     f"pass first (B does both at once).", cell)
            if kind is ActionType.SEND_F and not done(stage, (_F,), mb):
                fail(f"Send {action} comes before {stage}F{mb}, which produces what it sends.", cell)
            if kind is ActionType.SEND_B and not done(stage, (_B, _I), mb):
                fail(f"Send {action} comes before {stage}B{mb} or {stage}I{mb}, which produces what it sends.", cell)
            seen.add((stage, kind, mb))
        for stage in (s for s, owner in enumerate(placement) if owner == rank):
            for mb in range(num_microbatches):
                if not done(stage, (_F,), mb):
                    fail(f"Stage {stage} never runs {stage}F{mb}.", None)
                if forward_only:
                    continue
                if not done(stage, (_B, _I), mb):
                    fail(f"Stage {stage} never runs {stage}B{mb} (or {stage}I{mb} and {stage}W{mb}).", None)
                if done(stage, (_I,), mb) != done(stage, (_W,), mb):
                    have, lacks = ("I", "W") if done(stage, (_I,), mb) else ("W", "I")
                    fail(f"Stage {stage} runs {stage}{have}{mb} but never {stage}{lacks}{mb}: a backward is one B, or "
                         f"one I and one W.", None)
        if forward_only:
            extra = next((i for i, a in enumerate(rank_actions) if a.type in (_B, _I, _W, ActionType.SEND_B,
                                                                               ActionType.RECV_B)), None)
            if extra is not None:
                fail(f"Rank {rank} has a backward in a forward-only schedule.", (rank, extra))

    # every send has exactly one matching receive on the peer, and vice versa
    posted = {(a.stage, a.type, a.microbatch) for rank_actions in actions for a in rank_actions if not a.is_compute}
    for rank, rank_actions in enumerate(actions):
        for index, action in enumerate(rank_actions):
            if action.is_send and (action.peer, _MATCHING_RECV[action.type], action.microbatch) not in posted:
                fail(f"Send {action} has no matching receive on stage {action.peer} (rank {placement[action.peer]}).",
                     (rank, index))
            if action.is_recv and (action.peer, _MATCHING_SEND[action.type], action.microbatch) not in posted:
                fail(f"Receive {action} has no matching send on stage {action.peer} (rank {placement[action.peer]}).",
                     (rank, index))

    # per channel, receives in the order of the sends: (src rank, dst rank, send kind) -> [(sending stage, mb), ...]
    sends: dict[tuple[int, int, ActionType], list[tuple[int, int]]] = {}
    receives: dict[tuple[int, int, ActionType], list[tuple[int, int, int]]] = {}  # ... -> (sending stage, mb, index)
    for rank, rank_actions in enumerate(actions):
        for index, action in enumerate(rank_actions):
            if action.is_send:
                sends.setdefault((rank, placement[action.peer], action.type), []).append(
                    (action.stage, action.microbatch))
            elif action.is_recv:
                receives.setdefault((placement[action.peer], rank, _MATCHING_SEND[action.type]), []).append(
                    (action.peer, action.microbatch, index))
    for (source, destination, kind), posted_receives in sorted(receives.items()):
        sent = sends.get((source, destination, kind), [])
        for order, (peer, mb, index) in enumerate(posted_receives):
            if order < len(sent) and sent[order] != (peer, mb):
                sent_stage, sent_mb = sent[order]
                wanted = next(i for i, s in enumerate(sent) if s == (peer, mb))
                fail(
                    f"Receive {actions[destination][index]} is the receive number {order} on the {_CHANNEL_NAME[kind]} "
                    f"channel from rank {source} to rank {destination}, but rank {source} sends "
                    f"{sent_stage}{kind.value}{sent_mb} as message number {order} there and "
                    f"{peer}{kind.value}{mb} as number {wanted}. gloo matches the messages of one channel in posting "
                    f"order, so this receive would get the tensors of micro-batch {sent_mb} (stage {sent_stage}). "
                    f"Post rank {destination}'s receives from rank {source} in the order rank {source} sends.",
                    (destination, index),
                )

    # execute with the simulator's loop: sends complete when posted, a receive waits for its send
    run = execute(actions)
    if not run.finished:
        waiting = ", ".join(f"rank {r} at {actions[r][run.position[r]]}" for r in run.unfinished)
        stuck = run.unfinished[0]
        fail(f"Deadlock: every unfinished rank waits on a receive ({waiting}).", (stuck, run.position[stuck]))


class StepSchedules:
    """The schedules of one pipeline (``name`` on ``num_ranks`` ranks, ``stages_per_rank`` stages each), by micro-batch
    count and direction, each built once. ``microbatches`` is the count of a full batch.

    A last, short batch that the schedule cannot split into its count (interleaved 1F1B's rule, a file's fixed count)
    is evaluated with a forward sweep over the same stages and trained with the largest count the schedule runs below
    it (DualPipeV, which needs 2p micro-batches, with ZB-V's lists: the same V); none is an error naming the batch.
    """

    def __init__(self, name: str, num_ranks: int, microbatches: int, stages_per_rank: int, fixed_count: bool) -> None:
        self.name, self.num_ranks, self.microbatches = name, num_ranks, microbatches
        self.stages_per_rank, self.fixed_count = stages_per_rank, fixed_count
        self._built: dict[tuple[int, bool], Schedule] = {}

    def __call__(self, count: int, forward_only: bool) -> Schedule:
        key = (count, forward_only)
        if key not in self._built:
            self._built[key] = self._build(count, forward_only)
        return self._built[key]

    def _build(self, count: int, forward_only: bool) -> Schedule:
        try:
            return build_schedule(self.name, self.num_ranks, count, forward_only=forward_only,
                                  stages_per_rank=self.stages_per_rank)
        except PipelineConfigError as error:
            if count >= self.microbatches:
                raise
            why = str(error)
        if forward_only:
            return forward_sweep(self(self.microbatches, False).stage_to_rank, count)
        if self.name == "dualpipev":
            return build_schedule("zbv", self.num_ranks, count, stages_per_rank=self.stages_per_rank)
        for fewer in range(count - 1, 0, -1) if not self.fixed_count else []:
            with contextlib.suppress(PipelineConfigError):
                return build_schedule(self.name, self.num_ranks, fewer, stages_per_rank=self.stages_per_rank)
        raise PipelineConfigError(
            f"A training batch of {count} samples cannot be split into micro-batches that schedule={self.name!r} runs "
            f"on {self.num_ranks} ranks ({why}). Use batches of at least {self.microbatches} samples "
            f"(DataLoader(drop_last=True) for a short last batch)."
        )
