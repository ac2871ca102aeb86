"""``schedule="auto"``: the configuration the simulator predicts fastest from measured costs.

What is measured (:class:`MeasuredCosts`, on one device, at two micro-batch sizes): each block's forward (F), input
gradient (I) and weight gradient (W), the bytes its forward saves for backward and the bytes of its output, the step's
work before the first block and after the last, a point-to-point message's latency and seconds per byte, and a fixed
framework time per action. A cost at another micro-batch size is read off the line through the two measurements (a
block's fixed per-call cost and its per-sample cost), so every micro-batch count the batch allows can be predicted.

What is searched (:func:`search`): every schedule the runtime runs (``gpipe``, ``1f1b``, ``interleaved_1f1b`` with 2
to 4 stages per rank, ``zb_h1``, ``zbv``, ``dualpipev``), every micro-batch count from the pipeline's length to the
batch size (at most :data:`MAX_MICROBATCHES`), the split that balances each candidate's stages
(:func:`~lightning_pp.schedule.partition.min_max_partition` on F + I + W at its micro-batch size), and activation
checkpointing of every block, under a memory budget on the activations a rank holds at once. Each candidate's schedule
is the same data the runtime executes, timed by the one executor (:func:`~lightning_pp.schedule.simulate.simulate`): an
action costs its measured time at its micro-batch's size (a batch that does not divide evenly gives the first
micro-batches a sample more, as the runtime does) plus the framework time; a send costs the message's latency plus
its bytes. The split balances the mean micro-batch. The fastest prediction wins; ties go to the simpler configuration
(fewer micro-batches, one stage per rank). Recomputation is chosen only where no configuration without it fits the
budget."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from lightning_pp.errors import PipelineConfigError
from lightning_pp.schedule import build_schedule
from lightning_pp.schedule.actions import Action, ActionType, Schedule
from lightning_pp.schedule.partition import min_max_partition, stage_layer_ranges
from lightning_pp.schedule.simulate import simulate

__all__ = ["MAX_MICROBATCHES", "Candidate", "MeasuredCosts", "StageCosts", "candidate_schedule", "search",
           "stage_costs"]

MAX_MICROBATCHES = 32  # beyond this, per-action costs dominate on any device we know
# (schedule, stages per rank) pairs searched, in the order ties are broken (simpler first)
_SCHEDULES = (("1f1b", 1), ("gpipe", 1), ("zb_h1", 1), ("interleaved_1f1b", 2), ("zbv", 2), ("dualpipev", 2),
              ("interleaved_1f1b", 3), ("interleaved_1f1b", 4))


@dataclass(frozen=True)
class MeasuredCosts:
    """Seconds and bytes per micro-batch measured at ``sizes`` (two micro-batch sizes, in samples): for each size, a
    list over the blocks (``forward[k][block]``); ``before`` and ``after`` the blocks ``(forward, backward)`` per
    size."""

    sizes: tuple[float, float]
    forward: tuple[list[float], list[float]]
    input_backward: tuple[list[float], list[float]]
    weight_backward: tuple[list[float], list[float]]
    saved_bytes: tuple[list[float], list[float]]
    output_bytes: tuple[list[float], list[float]]
    before: tuple[tuple[float, float], tuple[float, float]]
    after: tuple[tuple[float, float], tuple[float, float]]
    # the bytes the step's work before and after the blocks saves for the backward (embeddings; the head, the loss)
    outside_saved_bytes: tuple[tuple[float, float], tuple[float, float]]
    latency_s: float  # one point-to-point message
    seconds_per_byte: float
    framework_s: float  # the runtime's own time per action
    outside_s: float = 0.0  # the step's time outside the schedule (the optimizer, Lightning's loop); 0: not measured
    # per block, the bytes it saved that earlier work saved too (its input, the block before's output: `saved_bytes`
    # counts them once, there): held again by a stage that starts at the block. None: nothing shared
    shared_bytes: tuple[list[float], list[float]] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.forward[0])

    def at(self, size: float, values: tuple[Sequence[float], Sequence[float]]) -> list[float]:
        """``values`` at micro-batch ``size``, on the line through the two measurements (never below zero)."""
        (low, high), (a, b) = self.sizes, values
        if high == low:
            return list(a)
        t = (size - low) / (high - low)
        return [max(0.0, x + t * (y - x)) for x, y in zip(a, b, strict=True)]


@dataclass(frozen=True)
class Candidate:
    """One configuration and what the simulator predicts for it."""

    schedule: str
    stages_per_rank: int
    microbatches: int
    balance: tuple[int, ...]
    recompute: bool  # activation checkpointing of every block
    step_s: float  # predicted step (the schedule's makespan, and the time outside it where that was measured)
    bubble: float  # predicted share of the step the ranks compute nothing
    peak_bytes: float  # predicted most activation bytes a rank holds at once

    def describe(self) -> str:
        extra = f" v={self.stages_per_rank}" if self.stages_per_rank > 1 else ""
        return (f"{self.schedule}{extra} m={self.microbatches} split={list(self.balance)}"
                f"{' recompute' if self.recompute else ''}: step {1e3 * self.step_s:.1f} ms, bubble {self.bubble:.3f}, "
                f"peak activations {self.peak_bytes / 2**20:.1f} MiB")


@cache
def candidate_schedule(name: str, ranks: int, microbatches: int, stages_per_rank: int) -> Schedule | None:
    try:
        return build_schedule(name, ranks, microbatches, stages_per_rank=stages_per_rank)
    except PipelineConfigError:  # a count this schedule does not run
        return None


def _stage_sums(values: list[float], balance: Sequence[int]) -> list[float]:
    return [sum(values[r.start:r.stop]) for r in stage_layer_ranges(balance)]


@dataclass(frozen=True)
class StageCosts:
    """What one configuration's stages cost per micro-batch: seconds of F, I and W per stage (the work before and after
    the blocks included; the first stage's whole backward is W), the activation bytes each holds per micro-batch and
    the bytes each sends."""

    split: tuple[int, ...]
    forward: list[float]
    input_backward: list[float]
    weight_backward: list[float]
    held: list[float]
    sent: list[float]


def stage_costs(costs: MeasuredCosts, stages: int, microbatch: float, recompute: bool,
                balance: Sequence[int] | None) -> StageCosts:
    """The stages' costs at ``microbatch`` samples per micro-batch, on ``balance`` (None: the split that balances
    F + I + W)."""
    f, i, w = (costs.at(microbatch, v) for v in (costs.forward, costs.input_backward, costs.weight_backward))
    saved, out = costs.at(microbatch, costs.saved_bytes), costs.at(microbatch, costs.output_bytes)
    shared = costs.at(microbatch, costs.shared_bytes) if costs.shared_bytes is not None else [0.0] * len(saved)
    if recompute:  # the forward runs again in the backward, and a block keeps only its input
        i = [a + b for a, b in zip(i, f, strict=True)]
        saved = [out[k - 1] if k else out[0] for k in range(len(out))]
        shared = [0.0] * len(saved)
    before, after = costs.at(microbatch, costs.before), costs.at(microbatch, costs.after)  # (forward, backward) each
    totals = [a + b + c for a, b, c in zip(f, i, w, strict=True)]
    split = list(balance) if balance is not None else min_max_partition(
        totals, stages, first_extra=sum(before), last_extra=sum(after))
    forward, input_b, weight_b = (_stage_sums(v, split) for v in (f, i, w))
    ranges = stage_layer_ranges(split)
    held, sent = _stage_sums(saved, split), [out[r.stop - 1] for r in ranges]
    for stage, blocks in enumerate(ranges[1:], start=1):  # what the block before kept, here a received activation
        held[stage] += shared[blocks.start] if blocks else 0.0
    saved_before, saved_after = costs.at(microbatch, costs.outside_saved_bytes)
    held[0] += saved_before
    held[-1] += saved_after
    forward[0] += before[0]
    weight_b[0] += before[1] + input_b[0]  # the first stage hands no gradient upstream: its whole backward is W
    input_b[0] = 0.0
    forward[-1] += after[0]
    input_b[-1] += after[1]
    return StageCosts(tuple(split), forward, input_b, weight_b, held, sent)


def _evaluate(costs: MeasuredCosts, schedule: Schedule, batch_size: int, recompute: bool,
              balance: Sequence[int] | None) -> Candidate:
    m = schedule.num_microbatches
    base, extra = divmod(batch_size, m)  # the runtime's split: the first `extra` micro-batches get a sample more
    staged = stage_costs(costs, schedule.num_stages, batch_size / m, recompute, balance)
    by_size = {size: stage_costs(costs, schedule.num_stages, size, recompute, staged.split)
               for size in {base, base + (1 if extra else 0)}}
    of = [by_size[base + (1 if mb < extra else 0)] for mb in range(m)]

    def cost(action: Action) -> float:
        s, kind, at = action.stage, action.type, of[action.microbatch]
        if kind is ActionType.FORWARD:
            return at.forward[s] + costs.framework_s
        if kind is ActionType.BACKWARD:
            return at.input_backward[s] + at.weight_backward[s] + costs.framework_s
        if kind is ActionType.BACKWARD_INPUT:
            return at.input_backward[s] + costs.framework_s
        if kind is ActionType.BACKWARD_WEIGHT:
            return at.weight_backward[s] + costs.framework_s
        return costs.framework_s / 2  # posting a send or a receive; the message flies meanwhile (below)

    def in_flight(send: Action) -> float:  # an activation forward, a gradient of the same size back
        source = send.stage if send.type is ActionType.SEND_F else send.stage - 1
        return costs.latency_s + of[send.microbatch].sent[source] * costs.seconds_per_byte

    timeline = simulate(schedule, cost, in_flight)
    return Candidate(schedule.name, schedule.stages_per_rank, m, staged.split, recompute,
                     timeline.makespan + costs.outside_s, timeline.bubble_fraction(),
                     _peak_held(schedule, max(by_size.values(), key=lambda c: sum(c.held)).held))


def _peak_held(schedule: Schedule, held: list[float]) -> float:
    """The most activation bytes any rank holds at once: a forward keeps its stage's, a B or W frees them."""
    peak = 0.0
    for rank in range(schedule.num_ranks):
        now = 0.0
        for action in schedule.compute_actions(rank):
            if action.type is ActionType.FORWARD:
                now += held[action.stage]
                peak = max(peak, now)
            elif action.type in (ActionType.BACKWARD, ActionType.BACKWARD_WEIGHT):
                now -= held[action.stage]
    return peak


def search(costs: MeasuredCosts, num_ranks: int, batch_size: int, *, max_memory: float | None = None,
           microbatches: int | None = None, stages_per_rank: int | None = None,
           balance: Sequence[int] | None = None, recompute: bool | None = None) -> list[Candidate]:
    """Every candidate that fits ``max_memory`` (activation bytes per rank; None: no limit): those without activation
    checkpointing fastest first, then those with it. What the user fixed (``microbatches``, ``stages_per_rank``,
    ``balance``, ``recompute``) is not searched. Raises our error when nothing fits."""
    counts = [microbatches] if microbatches is not None else range(num_ranks, min(batch_size, MAX_MICROBATCHES) + 1)
    candidates = []
    for order, (name, v) in enumerate(_SCHEDULES):
        stages = num_ranks * v
        if (stages_per_rank is not None and v != stages_per_rank) or stages > costs.num_blocks or (
                balance is not None and len(balance) != stages):
            continue
        for m in counts:
            schedule = candidate_schedule(name, num_ranks, m, v)
            if schedule is None:
                continue
            for again in ([recompute] if recompute is not None else [False, True]):
                candidate = _evaluate(costs, schedule, batch_size, again, balance)
                candidates.append((candidate.step_s, m, order, again, candidate))
    if not candidates:
        given = {"microbatches": microbatches, "stages_per_rank": stages_per_rank, "balance": balance}
        fixed = ", ".join(f"{k}={v}" for k, v in given.items() if v is not None) or "nothing fixed"
        raise PipelineConfigError(
            f"schedule='auto' found no configuration to run {costs.num_blocks} blocks on {num_ranks} ranks with a "
            f"batch of {batch_size} and {fixed}: a schedule needs a block per stage (2-4 stages per rank with "
            f"several) and at least one sample per micro-batch. Fix fewer of these, or name a schedule.")
    # recomputation costs time: chosen only where no configuration without it fits (then the fastest with it)
    fitting = [c for *_, c in sorted(candidates, key=lambda c: (c[3], *c[:3]))
               if max_memory is None or c.peak_bytes <= max_memory]
    if not fitting:
        least = min(c[-1].peak_bytes for c in candidates)
        raise PipelineConfigError(
            f"schedule='auto' found no configuration whose activations fit max_memory={max_memory} bytes per rank "
            f"(the least any needs is {least:.0f}). Raise max_memory, use more pipeline ranks, or smaller batches.")
    return fitting
