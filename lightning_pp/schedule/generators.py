"""Schedule generators: compute-only action lists, one per rank. The pictures below are unit-cost timelines (every
compute action one tick) for 4 ranks x 8 micro-batches, as drawn by `simulate.format_timeline`;
`tests/single_process/test_schedules.py` asserts them. With several stages per rank a cell is the whole action, stage
included (`4F1`: stage 4 forwards micro-batch 1)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

from lightning_pp.errors import PipelineConfigError
from lightning_pp.schedule.actions import Action, ActionType

__all__ = ["GENERATORS", "SCHEDULES", "Generator"]

_F, _B, _I, _W = ActionType.FORWARD, ActionType.BACKWARD, ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT


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
    # stream, cut into steps (lightning_pp.pipedream.stream)
    "pipedream_2bw": _one_f_one_b,
}
