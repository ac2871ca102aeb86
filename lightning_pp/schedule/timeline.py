"""What a step's timeline is made of, measured (the runtime, the monitor) or predicted (the simulator): one
:class:`TimelineEvent` per action's compute, wait or transfer, and the :class:`Timeline` of every rank with its bubble.

The bubble of a rank is the share of the step's wall time in which it computes nothing (F, B, I and W are compute).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from lightning_pp.schedule.actions import Action, ActionType

__all__ = ["BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "CATEGORY_OF", "COMM_TRANSFER", "COMM_WAIT",
           "COMPUTE_CATEGORIES", "FORWARD", "Timeline", "TimelineEvent"]

FORWARD = "forward"
BACKWARD = "backward"
BACKWARD_INPUT = "backward_input"
BACKWARD_WEIGHT = "backward_weight"
COMM_WAIT = "comm_wait"
COMM_TRANSFER = "comm_transfer"
COMPUTE_CATEGORIES = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
CATEGORY_OF = {
    ActionType.FORWARD: FORWARD,
    ActionType.BACKWARD: BACKWARD,
    ActionType.BACKWARD_INPUT: BACKWARD_INPUT,
    ActionType.BACKWARD_WEIGHT: BACKWARD_WEIGHT,
}


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    """One interval on one rank: an action's compute, or the wait / transfer part of a transfer.

    ``rank`` is the row the event belongs to (the rank that ran it); left out, it is ``stage``, which is right for
    one stage per rank.
    """

    stage: int
    action: Action
    category: str
    start: float
    end: float
    rank: int = -1

    def __post_init__(self) -> None:
        if self.rank < 0:
            object.__setattr__(self, "rank", self.stage)

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    """Events of one step on every rank; times are seconds (measured) or cost units (predicted).

    ``stage_to_rank[stage]`` is the rank holding ``stage``; left out, one stage per rank (stage ``s`` on rank ``s``).
    """

    num_ranks: int
    events: list[TimelineEvent] = field(default_factory=list)
    stage_to_rank: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.stage_to_rank:
            self.stage_to_rank = tuple(range(self.num_ranks))

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // max(1, self.num_ranks)

    @property
    def start(self) -> float:
        return min((e.start for e in self.events), default=0.0)

    @property
    def makespan(self) -> float:
        return max((e.end for e in self.events), default=0.0) - self.start

    def span(self, rank: int) -> float:
        """Time from the start of rank ``rank``'s first event to the end of its last (0 without events)."""
        own = [e for e in self.events if e.rank == rank]
        return max(e.end for e in own) - min(e.start for e in own) if own else 0.0

    def total(self, rank: int, categories: Iterable[str]) -> float:
        """Time rank ``rank`` spent in ``categories`` (for one stage per rank, the time of stage ``rank``)."""
        wanted = set(categories)
        return sum(e.duration for e in self.events if e.rank == rank and e.category in wanted)

    def stage_total(self, stage: int, categories: Iterable[str]) -> float:
        """Time spent in ``categories`` on actions of stage ``stage``."""
        wanted = set(categories)
        return sum(e.duration for e in self.events if e.stage == stage and e.category in wanted)

    def bubble_fraction(self, rank: int | None = None) -> float:
        """Share of the makespan in which ``rank`` computes nothing; the mean over all ranks when ``rank`` is None."""
        makespan = self.makespan
        if makespan <= 0:
            return 0.0
        ranks = range(self.num_ranks) if rank is None else [rank]
        busy = sum(self.total(r, COMPUTE_CATEGORIES) for r in ranks)
        return 1.0 - busy / (makespan * len(ranks))
