"""Timelines of a schedule (:mod:`lightning_pp.schedule.timeline`): predicted from per-action costs here, measured by
the runtime, drawn by one function.

With unit costs, GPipe and 1F1B both have the bubble fraction (p - 1) / (m + p - 1) for p ranks and m micro-batches,
interleaved 1F1B with v stages per rank (p - 1) / (v m + p - 1), ZB-H1 (F = I = W) (p - 1) / (3 m + p - 1).

:func:`execute` is the one loop that runs action lists: :func:`simulate` draws its timeline, and
:func:`lightning_pp.schedule.validate_schedule` uses it to find deadlocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_pp.schedule.actions import Action, ActionType, Schedule
from lightning_pp.schedule.timeline import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    CATEGORY_OF,
    COMM_TRANSFER,
    COMM_WAIT,
    COMPUTE_CATEGORIES,
    FORWARD,
    Timeline,
    TimelineEvent,
)

__all__ = ["BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "CATEGORY_OF", "COMM_TRANSFER", "COMM_WAIT",
           "COMPUTE_CATEGORIES", "FORWARD", "Execution", "Timeline", "TimelineEvent", "action_costs", "execute",
           "format_timeline", "simulate", "unit_cost"]


def unit_cost(action: Action) -> float:
    """One tick per compute action (F = B = I = W = 1); transfers are free.

    So a zero-bubble schedule is pictured with F = I = W, and B is as long as one of its halves. To compare 1F1B
    with a zero-bubble schedule on equal terms (B = I + W), use :func:`action_costs`.
    """
    return 1.0 if action.is_compute else 0.0


def action_costs(forward: float = 1.0, backward: float | None = None, backward_input: float = 1.0,
                 backward_weight: float = 1.0, transfer: float = 0.0) -> Callable[[Action], float]:
    """A cost function for :func:`simulate` from one cost per kind; ``backward`` defaults to I + W."""
    costs = {
        ActionType.FORWARD: forward,
        ActionType.BACKWARD: backward_input + backward_weight if backward is None else backward,
        ActionType.BACKWARD_INPUT: backward_input,
        ActionType.BACKWARD_WEIGHT: backward_weight,
    }
    return lambda action: costs.get(action.type, transfer)


@dataclass
class Execution:
    """What :func:`execute` did: the events, and where each rank stopped (its list's length when it finished)."""

    events: list[TimelineEvent]
    position: list[int]
    lengths: list[int]

    @property
    def unfinished(self) -> list[int]:
        """The ranks that did not reach the end of their list (all blocked on a receive: a deadlock)."""
        return [rank for rank, (at, length) in enumerate(zip(self.position, self.lengths, strict=True))
                if at < length]

    @property
    def finished(self) -> bool:
        return not self.unfinished


def execute(actions: Sequence[Sequence[Action]], cost: Callable[[Action], float] = unit_cost,
            delay: Callable[[Action], float] | None = None, in_flight: frozenset[Action] = frozenset()
            ) -> Execution:
    """Run per-rank action lists with one clock per rank; the one execution loop (simulator and validator).

    Each rank runs its list in order; an action starts when the previous one on its rank ended, a receive also not
    before its send ended plus the send's ``delay`` (the message in flight, while the sender goes on; sends never
    block); a receive in ``in_flight`` (its send ran in the previous step) finds its message there from the start. A
    transfer between two stages of one rank is no action: the consumer
    comes later in the same list, so the order already says when its input is there. Stops when every rank finished
    or every unfinished rank waits on a receive whose send will never come (a deadlock: see ``unfinished``).
    """
    num_ranks = len(actions)
    clock = [0.0] * num_ranks
    position = [0] * num_ranks
    # (receiving stage, receive type, mb) -> time
    arrival: dict[tuple[int, ActionType, int], float] = {(a.stage, a.type, a.microbatch): 0.0 for a in in_flight}
    events: list[TimelineEvent] = []
    progressed = True
    while progressed:
        progressed = False
        for rank, rank_actions in enumerate(actions):
            while position[rank] < len(rank_actions):
                action = rank_actions[position[rank]]
                start = clock[rank]
                if action.is_recv:
                    key = (action.stage, action.type, action.microbatch)
                    if key not in arrival:
                        break
                    if arrival[key] > start:
                        events.append(TimelineEvent(action.stage, action, COMM_WAIT, start, arrival[key], rank))
                        start = arrival[key]
                end = start + cost(action)
                if action.is_compute:
                    events.append(TimelineEvent(action.stage, action, CATEGORY_OF[action.type], start, end, rank))
                elif end > start:
                    events.append(TimelineEvent(action.stage, action, COMM_TRANSFER, start, end, rank))
                if action.is_send:
                    recv = ActionType.RECV_F if action.type is ActionType.SEND_F else ActionType.RECV_B
                    arrival[(action.peer, recv, action.microbatch)] = end + (delay(action) if delay else 0.0)
                clock[rank] = end
                position[rank] += 1
                progressed = True
    return Execution(events, position, [len(rank_actions) for rank_actions in actions])


def simulate(schedule: Schedule, cost: Callable[[Action], float] = unit_cost,
             delay: Callable[[Action], float] | None = None) -> Timeline:
    """Predict the timeline of ``schedule`` (one row per rank); see :func:`execute` for the rules."""
    run = execute(schedule.actions, cost, delay, schedule.in_flight)
    if not run.finished:  # unreachable for a validated schedule
        raise RuntimeError(f"Schedule {schedule.name!r} deadlocks; run validate_schedule for the grid.")
    return Timeline(schedule.num_ranks, run.events, schedule.stage_to_rank)


def format_timeline(timeline: Timeline, tick: float = 1.0) -> str:
    """Draw compute events as text, one column per ``tick`` of time and one row per rank ('.' is idle).

    With one stage per rank a row is ``stage s`` and a cell the kind and micro-batch (``F3``, ``I3``), cells side by
    side. With several stages per rank a row is ``rank r`` and a cell the whole action, stage included (``4F3``:
    stage 4, the second stage of rank 0 when there are 4 ranks, forwards micro-batch 3), cells separated by a space.
    """
    compute = [e for e in timeline.events if e.category in COMPUTE_CATEGORIES]
    several = timeline.stage_to_rank != tuple(range(timeline.num_ranks))

    def label(action: Action) -> str:
        return str(action) if several else f"{action.type.value}{action.microbatch}"

    width = max((len(label(e.action)) for e in compute), default=2)
    columns = round(timeline.makespan / tick)
    rows = []
    for rank in range(timeline.num_ranks):
        cells = ["." * width] * columns
        for event in compute:
            if event.rank == rank:
                first = round((event.start - timeline.start) / tick)
                last = max(first + 1, round((event.end - timeline.start) / tick))
                for column in range(first, last):
                    cells[column] = f"{label(event.action):<{width}}"
        row = (" " if several else "").join(cells).rstrip(". ")
        rows.append(f"{'rank' if several else 'stage'} {rank} |{row}")
    return "\n".join(rows)
