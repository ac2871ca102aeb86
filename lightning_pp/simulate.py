"""Timelines of a schedule: predicted from per-action costs here, measured by the runtime, drawn by one function.

The bubble of a stage is the share of the step's wall time in which it computes nothing. With unit costs, GPipe and
1F1B both have the bubble fraction (p - 1) / (m + p - 1) for p stages and m micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from lightning_pp.schedules import Action, ActionType, Schedule

__all__ = ["Timeline", "TimelineEvent", "format_timeline", "simulate"]

FORWARD = "forward"
BACKWARD = "backward"
COMM_WAIT = "comm_wait"
COMM_TRANSFER = "comm_transfer"
COMPUTE_CATEGORIES = (FORWARD, BACKWARD)
CATEGORY_OF = {ActionType.FORWARD: FORWARD, ActionType.BACKWARD: BACKWARD}


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    """One interval on one stage: an action's compute, or the wait / transfer part of a transfer."""

    stage: int
    action: Action
    category: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    """Events of one step on every stage; times are seconds (measured) or cost units (predicted)."""

    num_stages: int
    events: list[TimelineEvent] = field(default_factory=list)

    @property
    def start(self) -> float:
        return min((e.start for e in self.events), default=0.0)

    @property
    def makespan(self) -> float:
        return max((e.end for e in self.events), default=0.0) - self.start

    def total(self, stage: int, categories: Iterable[str]) -> float:
        wanted = set(categories)
        return sum(e.duration for e in self.events if e.stage == stage and e.category in wanted)

    def bubble_fraction(self, stage: int | None = None) -> float:
        """Idle share of the makespan on ``stage``, or over all stages when ``stage`` is None."""
        makespan = self.makespan
        if makespan <= 0:
            return 0.0
        stages = range(self.num_stages) if stage is None else [stage]
        busy = sum(self.total(s, COMPUTE_CATEGORIES) for s in stages)
        return 1.0 - busy / (makespan * len(stages))


def unit_cost(action: Action) -> float:
    """One tick per forward or backward; transfers are free."""
    return 1.0 if action.is_compute else 0.0


def simulate(schedule: Schedule, cost: Callable[[Action], float] = unit_cost) -> Timeline:
    """Predict the timeline of ``schedule``: each stage runs its list in order, a receive waits for its send."""
    num_stages = schedule.num_stages
    clock = [0.0] * num_stages
    position = [0] * num_stages
    arrival: dict[tuple[int, ActionType, int], float] = {}  # (receiving stage, receive type, mb) -> time
    timeline = Timeline(num_stages)
    pending = sum(len(actions) for actions in schedule.actions)
    while pending:
        progressed = False
        for stage, actions in enumerate(schedule.actions):
            while position[stage] < len(actions):
                action = actions[position[stage]]
                start = clock[stage]
                if action.type in (ActionType.RECV_F, ActionType.RECV_B):
                    key = (stage, action.type, action.microbatch)
                    if key not in arrival:
                        break
                    if arrival[key] > start:
                        timeline.events.append(TimelineEvent(stage, action, COMM_WAIT, start, arrival[key]))
                        start = arrival[key]
                end = start + cost(action)
                if action.is_compute:
                    timeline.events.append(TimelineEvent(stage, action, CATEGORY_OF[action.type], start, end))
                elif end > start:
                    timeline.events.append(TimelineEvent(stage, action, COMM_TRANSFER, start, end))
                if action.is_send:
                    recv = ActionType.RECV_F if action.type is ActionType.SEND_F else ActionType.RECV_B
                    arrival[(action.peer, recv, action.microbatch)] = end
                clock[stage] = end
                position[stage] += 1
                pending -= 1
                progressed = True
        if not progressed:  # unreachable for a validated schedule
            raise RuntimeError(f"Schedule {schedule.name!r} deadlocks; run validate_schedule for the grid.")
    return timeline


def format_timeline(timeline: Timeline, tick: float = 1.0) -> str:
    """Draw compute events as text, one column per ``tick`` of time and one row per stage ('.' is idle)."""
    compute = [e for e in timeline.events if e.category in COMPUTE_CATEGORIES]
    width = max((len(f"{e.action.type.value}{e.action.microbatch}") for e in compute), default=2)
    columns = round(timeline.makespan / tick)
    rows = []
    for stage in range(timeline.num_stages):
        cells = ["." * width] * columns
        for event in compute:
            if event.stage == stage:
                label = f"{event.action.type.value}{event.action.microbatch}"
                first = round((event.start - timeline.start) / tick)
                last = max(first + 1, round((event.end - timeline.start) / tick))
                for column in range(first, last):
                    cells[column] = f"{label:<{width}}"
        rows.append(f"stage {stage} |" + "".join(cells).rstrip("."))
    return "\n".join(rows)
