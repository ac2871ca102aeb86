"""The schedule IR: an :class:`Action` (one step of one stage), an :class:`ActionType`, and a :class:`Schedule` (every
rank's action list for one optimizer step). What the generators and the checker (:mod:`lightning_pp.schedule`), the
simulator, the runtime and the monitor all speak.

The string form of an action follows ``torch.distributed.pipelining``: ``0F3`` is stage 0 forwarding micro-batch 3,
``1B2`` stage 1 backwarding micro-batch 2, ``1I2`` / ``1W2`` the two halves of that backward (gradient with respect to
the stage's input, then with respect to its weights), ``1SEND_F1`` stage 1 sending micro-batch 1's activation
downstream. A rank may hold several stages (interleaved and V-shaped schedules): ``Schedule.actions[rank]`` is that
rank's list, ``Action.stage`` the global stage index and ``Schedule.stage_to_rank`` says which rank holds each stage.
"""

from __future__ import annotations

import csv
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from lightning_pp.errors import PipelineScheduleError

__all__ = ["Action", "ActionType", "Schedule", "format_grid"]


class ActionType(str, Enum):
    """What a stage does: compute (F, B, or B split into I and W) or one side of a point-to-point transfer."""

    FORWARD = "F"
    BACKWARD = "B"  # the full backward: gradients with respect to the stage's input and its weights
    BACKWARD_INPUT = "I"  # only the gradient with respect to the stage's input (what the previous stage waits for)
    BACKWARD_WEIGHT = "W"  # only the gradient with respect to the weights, after the stage's I of the micro-batch
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"


_COMPUTE = (ActionType.FORWARD, ActionType.BACKWARD, ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT)
_SENDS = (ActionType.SEND_F, ActionType.SEND_B)
_RECVS = (ActionType.RECV_F, ActionType.RECV_B)
# the direction (+1 downstream, -1 upstream) each transfer's message travels
_DIRECTION = {ActionType.SEND_F: +1, ActionType.RECV_B: +1, ActionType.RECV_F: -1, ActionType.SEND_B: -1}
_ACTION_PATTERN = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one stage: ``type`` applied to ``microbatch`` on (global) ``stage``."""

    stage: int
    type: ActionType
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.type.value}{self.microbatch}"

    @staticmethod
    def parse(text: str) -> Action:
        """Parse the string form (``"0F3"``, ``"2I1"``, ``"1SEND_B2"``)."""
        match = _ACTION_PATTERN.match(text.strip())
        if match is None:
            raise PipelineScheduleError(
                f"Cannot parse action {text!r}; expected stage, kind, micro-batch, e.g. '0F3', '1B2', '1I2', '1W2' or "
                f"'1SEND_F1' (kinds: {', '.join(kind.value for kind in ActionType)})."
            )
        return Action(int(match[1]), ActionType(match[2]), int(match[3]))

    @property
    def is_compute(self) -> bool:
        return self.type in _COMPUTE

    @property
    def is_send(self) -> bool:
        return self.type in _SENDS

    @property
    def is_recv(self) -> bool:
        return self.type in _RECVS

    @property
    def peer(self) -> int:
        """The stage at the other end of a transfer (a stage, not a rank: see ``Schedule.stage_to_rank``)."""
        if self.is_compute:
            raise PipelineScheduleError(f"Compute action {self} has no peer.")
        return self.stage + _DIRECTION[self.type]


@dataclass(frozen=True)
class Schedule:
    """The lowered action list of every rank for one step of ``num_microbatches`` micro-batches.

    ``actions[rank]`` is what rank ``rank`` runs, in order; ``stage_to_rank[stage]`` is the rank holding ``stage``
    (left out: one stage per rank, stage ``s`` on rank ``s``). ``num_stages`` counts all stages of the model,
    ``num_ranks * stages_per_rank``.
    """

    name: str
    num_stages: int
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    stage_to_rank: tuple[int, ...] = ()
    # receives whose sends ran in the previous step (a step cut out of a longer stream: lightning_pp.pipedream.stream)
    in_flight: frozenset[Action] = frozenset()

    def __post_init__(self) -> None:
        if not self.stage_to_rank:
            object.__setattr__(self, "stage_to_rank", tuple(range(self.num_stages)))

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // max(1, self.num_ranks)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages rank ``rank`` holds, in increasing order (``(rank,)`` for one stage per rank)."""
        return tuple(stage for stage, owner in enumerate(self.stage_to_rank) if owner == rank)

    def compute_actions(self, rank: int) -> list[Action]:
        """Rank ``rank``'s compute actions (F, B, I, W) in order, without the transfers."""
        return [action for action in self.actions[rank] if action.is_compute]

    def to_csv(self, path: str | os.PathLike[str]) -> None:
        """Write torch.distributed.pipelining's compute-only CSV: one row per rank, e.g. ``0F0,0F1,2F0,...,0W3``."""
        with open(path, "w", newline="") as file:
            writer = csv.writer(file)
            for rank in range(self.num_ranks):
                writer.writerow([str(action) for action in self.compute_actions(rank)])

    def __str__(self) -> str:
        return format_grid(self.actions)


def format_grid(actions: Sequence[Sequence[Action]], mark: tuple[int, int] | None = None) -> str:
    """Draw the rank x step grid; the cell ``mark`` = (rank, step) is wrapped in ``>> <<``.

    Rows are labelled ``stage s`` when every row holds only its own stage (one stage per rank), ``rank r`` otherwise.
    """
    one_per_rank = all(a.stage == row for row, row_actions in enumerate(actions) for a in row_actions)
    label = "stage" if one_per_rank else "rank"
    cells = [
        [f">>{a}<<" if mark == (row, index) else str(a) for index, a in enumerate(row_actions)]
        for row, row_actions in enumerate(actions)
    ]
    width = max((len(c) for row in cells for c in row), default=1)
    steps = max((len(row) for row in cells), default=0)
    header = f"{'step':<{len(label) + 3}} " + " ".join(f"{i:<{width}}" for i in range(steps))
    rows = [f"{label} {r:<2} " + " ".join(f"{c:<{width}}" for c in row) for r, row in enumerate(cells)]
    return "\n".join([header.rstrip(), *(row.rstrip() for row in rows)])
