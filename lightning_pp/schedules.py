"""Pipeline schedules as data: per-stage action lists, their generators, the communication lowering and the checker.

A schedule is the single source of truth for what every stage does in one optimizer step. The same action lists are
validated here, simulated in :mod:`lightning_pp.simulate`, executed by the runtime and drawn by the monitor.

The string form of an action follows ``torch.distributed.pipelining``: ``0F3`` is stage 0 forwarding micro-batch 3,
``1B2`` stage 1 backwarding micro-batch 2, ``1SEND_F1`` stage 1 sending micro-batch 1's activation downstream.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from lightning_pp.errors import PipelineConfigError, PipelineScheduleError

__all__ = [
    "SCHEDULES",
    "Action",
    "ActionType",
    "Schedule",
    "add_communication",
    "build_schedule",
    "format_grid",
    "validate_schedule",
]


class ActionType(str, Enum):
    """What a stage does: compute (F, B) or one side of a point-to-point transfer."""

    FORWARD = "F"
    BACKWARD = "B"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"


_COMPUTE = (ActionType.FORWARD, ActionType.BACKWARD)
_SENDS = (ActionType.SEND_F, ActionType.SEND_B)
# the receive that matches each send, and the direction (+1 downstream, -1 upstream) the message travels
_MATCHING_RECV = {ActionType.SEND_F: ActionType.RECV_F, ActionType.SEND_B: ActionType.RECV_B}
_DIRECTION = {ActionType.SEND_F: +1, ActionType.RECV_B: +1, ActionType.RECV_F: -1, ActionType.SEND_B: -1}
_ACTION_PATTERN = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B)(\d+)$")


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one stage: ``type`` applied to ``microbatch`` on ``stage``."""

    stage: int
    type: ActionType
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.type.value}{self.microbatch}"

    @staticmethod
    def parse(text: str) -> Action:
        """Parse the string form (``"0F3"``, ``"1SEND_B2"``)."""
        match = _ACTION_PATTERN.match(text.strip())
        if match is None:
            raise PipelineScheduleError(f"Cannot parse action {text!r}; expected e.g. '0F3', '1B2' or '1SEND_F1'.")
        return Action(int(match[1]), ActionType(match[2]), int(match[3]))

    @property
    def is_compute(self) -> bool:
        return self.type in _COMPUTE

    @property
    def is_send(self) -> bool:
        return self.type in _SENDS

    @property
    def peer(self) -> int:
        """The stage at the other end of a transfer."""
        if self.is_compute:
            raise PipelineScheduleError(f"Compute action {self} has no peer.")
        return self.stage + _DIRECTION[self.type]


@dataclass(frozen=True)
class Schedule:
    """The lowered action list of every stage for one step of ``num_microbatches`` micro-batches."""

    name: str
    num_stages: int
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]

    def compute_actions(self, stage: int) -> list[Action]:
        return [action for action in self.actions[stage] if action.is_compute]

    def __str__(self) -> str:
        return format_grid(self.actions)


# ----------------------------------------------------------------------------------------------------------------------
# Generators: compute-only action lists, one per stage. The pictures below are unit-cost timelines (F and B one tick
# each) for 4 stages x 8 micro-batches, as drawn by `simulate.format_timeline`; `tests/test_schedules.py` asserts them.
# ----------------------------------------------------------------------------------------------------------------------


def _naive(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """One micro-batch at a time through every stage, forward then backward: no two stages ever work together.

    stage 0 |F0............B0F1............B1F2...
    stage 1 |..F0........B0....F1........B1....F2...
    stage 2 |....F0....B0........F1....B1........F2...
    stage 3 |......F0B0............F1B1............F2B2...
    """
    return [
        [Action(stage, kind, mb) for mb in range(num_microbatches) for kind in _COMPUTE]
        for stage in range(num_stages)
    ]


def _gpipe(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """Fill-drain: all forwards, then all backwards; every micro-batch's activations live until its backward.

    stage 0 |F0F1F2F3F4F5F6F7............B0B1B2B3B4B5B6B7
    stage 1 |..F0F1F2F3F4F5F6F7........B0B1B2B3B4B5B6B7
    stage 2 |....F0F1F2F3F4F5F6F7....B0B1B2B3B4B5B6B7
    stage 3 |......F0F1F2F3F4F5F6F7B0B1B2B3B4B5B6B7
    """
    return [
        [Action(stage, ActionType.FORWARD, mb) for mb in range(num_microbatches)]
        + [Action(stage, ActionType.BACKWARD, mb) for mb in range(num_microbatches)]
        for stage in range(num_stages)
    ]


def _one_f_one_b(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """Warm-up forwards, then one forward one backward, then cool-down backwards (PipeDream-flush).

    Stage ``s`` runs ``num_stages - s - 1`` warm-up forwards, so at most ``num_stages - s`` micro-batches are in
    flight on it: activation memory is bounded by the number of stages instead of the number of micro-batches.

    stage 0 |F0F1F2F3......B0F4B1F5B2F6B3F7B4..B5..B6..B7
    stage 1 |..F0F1F2....B0F3B1F4B2F5B3F6B4F7B5..B6..B7
    stage 2 |....F0F1..B0F2B1F3B2F4B3F5B4F6B5F7B6..B7
    stage 3 |......F0B0F1B1F2B2F3B3F4B4F5B5F6B6F7B7
    """
    lists = []
    for stage in range(num_stages):
        warmup = min(num_stages - stage - 1, num_microbatches)
        actions = [Action(stage, ActionType.FORWARD, mb) for mb in range(warmup)]
        for step in range(num_microbatches - warmup):
            actions.append(Action(stage, ActionType.FORWARD, warmup + step))
            actions.append(Action(stage, ActionType.BACKWARD, step))
        actions += [Action(stage, ActionType.BACKWARD, mb) for mb in range(num_microbatches - warmup, num_microbatches)]
        lists.append(actions)
    return lists


SCHEDULES: dict[str, Callable[[int, int], list[list[Action]]]] = {
    "naive": _naive,
    "gpipe": _gpipe,
    "1f1b": _one_f_one_b,
}


def add_communication(compute: Sequence[Sequence[Action]]) -> list[list[Action]]:
    """Lower compute-only lists: receive right before the compute that needs it, send right after the producer."""
    last = len(compute) - 1
    lowered: list[list[Action]] = []
    for stage, actions in enumerate(compute):
        out: list[Action] = []
        for action in actions:
            mb = action.microbatch
            if action.type is ActionType.FORWARD:
                if stage > 0:
                    out.append(Action(stage, ActionType.RECV_F, mb))
                out.append(action)
                if stage < last:
                    out.append(Action(stage, ActionType.SEND_F, mb))
            elif action.type is ActionType.BACKWARD:
                if stage < last:
                    out.append(Action(stage, ActionType.RECV_B, mb))
                out.append(action)
                if stage > 0:
                    out.append(Action(stage, ActionType.SEND_B, mb))
            else:
                raise PipelineScheduleError(f"add_communication expects compute-only lists, got {action}.")
        lowered.append(out)
    return lowered


def build_schedule(name: str, num_stages: int, num_microbatches: int, forward_only: bool = False) -> Schedule:
    """Generate, lower and validate the schedule ``name``; ``forward_only`` keeps only forwards (evaluation)."""
    if name not in SCHEDULES:
        raise PipelineConfigError(f"Unknown schedule {name!r}. Valid schedules: {', '.join(sorted(SCHEDULES))}.")
    if num_stages < 1 or num_microbatches < 1:
        raise PipelineConfigError(
            f"A schedule needs at least one stage and one micro-batch, got num_stages={num_stages}, "
            f"num_microbatches={num_microbatches}."
        )
    compute = SCHEDULES[name](num_stages, num_microbatches)
    if forward_only:
        compute = [[a for a in actions if a.type is ActionType.FORWARD] for actions in compute]
    lowered = add_communication(compute)
    validate_schedule(lowered, num_microbatches, forward_only=forward_only)
    return Schedule(name, num_stages, num_microbatches, tuple(tuple(actions) for actions in lowered))


def validate_schedule(
    actions: Sequence[Sequence[Action]], num_microbatches: int, forward_only: bool = False
) -> None:
    """Check a lowered schedule; raise :class:`PipelineScheduleError` with the grid and the broken cell marked.

    Rules: each stage forwards (and, unless ``forward_only``, backwards) every micro-batch exactly once, F before B;
    every action sits on its own stage's list; a compute that needs remote data is preceded by its receive; every send
    is matched by exactly one receive on the peer; and executing the lists (sends never block, a receive blocks until
    its send was posted) finishes, i.e. there is no deadlock.
    """
    num_stages = len(actions)
    last = num_stages - 1

    def fail(message: str, cell: tuple[int, int] | None) -> None:
        raise PipelineScheduleError(f"{message}\n{format_grid(actions, mark=cell)}")

    for stage, stage_actions in enumerate(actions):
        seen: dict[tuple[ActionType, int], int] = {}
        for index, action in enumerate(stage_actions):
            if action.stage != stage:
                fail(f"Action {action} is in the list of stage {stage}.", (stage, index))
            if not 0 <= action.microbatch < num_microbatches:
                fail(f"Action {action} names micro-batch {action.microbatch}; valid: 0..{num_microbatches - 1}.",
                     (stage, index))
            if not action.is_compute and not 0 <= action.peer <= last:
                fail(f"Action {action} talks to stage {action.peer}, which does not exist.", (stage, index))
            key = (action.type, action.microbatch)
            if key in seen:
                fail(f"Action {action} appears twice on stage {stage}.", (stage, index))
            seen[key] = index
            needs = {
                ActionType.FORWARD: ActionType.RECV_F if stage > 0 else None,
                ActionType.BACKWARD: ActionType.RECV_B if stage < last else None,
            }.get(action.type)
            if needs is not None and (needs, action.microbatch) not in seen:
                fail(f"Action {action} runs before its {needs.value} on stage {stage}.", (stage, index))
            if action.type is ActionType.BACKWARD and (ActionType.FORWARD, action.microbatch) not in seen:
                fail(f"Action {action} runs before the forward of micro-batch {action.microbatch}.", (stage, index))
        wanted = [ActionType.FORWARD] if forward_only else list(_COMPUTE)
        for kind in wanted:
            for mb in range(num_microbatches):
                if (kind, mb) not in seen:
                    fail(f"Stage {stage} never runs {stage}{kind.value}{mb}.", None)
        if forward_only and any(a.type is ActionType.BACKWARD for a in stage_actions):
            fail(f"Stage {stage} has a backward in a forward-only schedule.", None)

    # every send has exactly one matching receive on the peer, and vice versa
    posted = {(a.stage, a.type, a.microbatch) for stage_actions in actions for a in stage_actions if not a.is_compute}
    for stage, stage_actions in enumerate(actions):
        for index, action in enumerate(stage_actions):
            if action.is_send and (action.peer, _MATCHING_RECV[action.type], action.microbatch) not in posted:
                fail(f"Send {action} has no matching receive on stage {action.peer}.", (stage, index))
            if action.type in _MATCHING_RECV.values():
                send = next(s for s, r in _MATCHING_RECV.items() if r is action.type)
                if (action.peer, send, action.microbatch) not in posted:
                    fail(f"Receive {action} has no matching send on stage {action.peer}.", (stage, index))

    # execute: sends complete when posted, a receive waits for its send
    position = [0] * num_stages
    sent: set[tuple[int, ActionType, int]] = set()
    while any(position[s] < len(actions[s]) for s in range(num_stages)):
        progressed = False
        for stage in range(num_stages):
            while position[stage] < len(actions[stage]):
                action = actions[stage][position[stage]]
                if action.type in (ActionType.RECV_F, ActionType.RECV_B):
                    send = ActionType.SEND_F if action.type is ActionType.RECV_F else ActionType.SEND_B
                    if (action.peer, send, action.microbatch) not in sent:
                        break
                if action.is_send:
                    sent.add((stage, action.type, action.microbatch))
                position[stage] += 1
                progressed = True
        if not progressed:
            stuck = next(s for s in range(num_stages) if position[s] < len(actions[s]))
            waiting = ", ".join(
                f"stage {s} at {actions[s][position[s]]}" for s in range(num_stages) if position[s] < len(actions[s])
            )
            fail(f"Deadlock: every unfinished stage waits on a receive ({waiting}).", (stuck, position[stuck]))


def format_grid(actions: Sequence[Sequence[Action]], mark: tuple[int, int] | None = None) -> str:
    """Draw the stage x step grid; the cell ``mark`` = (stage, step) is wrapped in ``>> <<``."""
    cells = [
        [f">>{a}<<" if mark == (stage, index) else str(a) for index, a in enumerate(stage_actions)]
        for stage, stage_actions in enumerate(actions)
    ]
    width = max((len(c) for row in cells for c in row), default=1)
    steps = max((len(row) for row in cells), default=0)
    header = "step    " + " ".join(f"{i:<{width}}" for i in range(steps))
    rows = [f"stage {s:<2}" + " ".join(f"{c:<{width}}" for c in row) for s, row in enumerate(cells)]
    return "\n".join([header.rstrip(), *(row.rstrip() for row in rows)])
