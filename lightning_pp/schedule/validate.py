"""The schedule checker: a lowered schedule (one action list per rank) breaks a rule, or it runs as one device would;
a broken rule raises :class:`~lightning_pp.errors.PipelineScheduleError` with the rank x step grid, the cell marked.

Rules:

- Placement: every stage lives on one rank (``stage_to_rank``, read off the lists when left out), every rank holds as
  many stages as the others.
- Compute: each stage forwards every micro-batch once and (unless ``forward_only``) backwards it once, either with one
  B or with one I and, later, one W; B and I come after the stage's F.
- Data: a compute that needs another stage's output finds it first: on another rank, its receive comes earlier in the
  list; on the same rank, the producing compute does (no transfer between stages of one rank). A send comes after the
  compute that produces it.
- Transfers: every send has exactly one matching receive on the peer's rank, and vice versa; and on each channel
  (source rank, destination rank, activations or gradients) the receives are posted in the order of the sends: gloo
  matches messages per peer and tag in posting order, and the transfers reuse the same tags for every micro-batch, so
  a swapped pair would silently deliver the wrong tensors.
- Progress: executing the lists with the simulator's loop (sends never block, a receive waits for its send) finishes,
  i.e. there is no deadlock.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

from lightning_pp.errors import PipelineScheduleError
from lightning_pp.schedule.actions import Action, ActionType, format_grid
from lightning_pp.schedule.simulate import execute

__all__ = ["infer_stage_to_rank", "validate_schedule"]

_F, _B, _I, _W = ActionType.FORWARD, ActionType.BACKWARD, ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT
# the receive that matches each send
_MATCHING_RECV = {ActionType.SEND_F: ActionType.RECV_F, ActionType.SEND_B: ActionType.RECV_B}
_MATCHING_SEND = {recv: send for send, recv in _MATCHING_RECV.items()}
_CHANNEL_NAME = {ActionType.SEND_F: "activations", ActionType.SEND_B: "gradients"}
Cell = tuple[int, int]


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


def validate_schedule(actions: Sequence[Sequence[Action]], num_microbatches: int, forward_only: bool = False,
                      stage_to_rank: Sequence[int] | None = None) -> None:
    """Check a lowered schedule (one list per rank) against the rules of this module.

    Raises:
        PipelineScheduleError: the first rule broken, with the grid and the broken cell marked.
    """
    check = _Checker(actions, num_microbatches, forward_only, stage_to_rank)
    for rank in range(len(actions)):
        check.rank(rank)
    check.matching_transfers()
    check.channel_order()
    check.progress()


class _Checker:
    """One schedule's rules, checked in turn (the placement on construction)."""

    def __init__(self, actions: Sequence[Sequence[Action]], num_microbatches: int, forward_only: bool,
                 stage_to_rank: Sequence[int] | None) -> None:
        self.actions, self.num_microbatches, self.forward_only = actions, num_microbatches, forward_only
        placement = infer_stage_to_rank(actions)
        if stage_to_rank is not None:
            given = tuple(stage_to_rank)
            for rank, rank_actions in enumerate(actions):
                for index, action in enumerate(rank_actions):
                    if not 0 <= action.stage < len(given) or given[action.stage] != rank:
                        holder = given[action.stage] if 0 <= action.stage < len(given) else None
                        self.fail(f"Action {action} is in the list of rank {rank}, but stage {action.stage} lives on "
                                  f"rank {holder} (stage_to_rank={given}).", (rank, index))
            placement = given
        self.placement, self.last = placement, len(placement) - 1
        self.seen: set[tuple[int, ActionType, int]] = set()

    def fail(self, message: str, cell: Cell | None) -> NoReturn:
        raise PipelineScheduleError(f"{message}\n{format_grid(self.actions, mark=cell)}")

    def local(self, stage: int, peer: int) -> bool:
        return self.placement[peer] == self.placement[stage]

    def done(self, stage: int, kinds: tuple[ActionType, ...], mb: int) -> bool:
        return any((stage, kind, mb) in self.seen for kind in kinds)

    def rank(self, rank: int) -> None:
        """Each action of ``rank``'s list in order, then that its stages ran every micro-batch."""
        self.seen = set()
        for index, action in enumerate(self.actions[rank]):
            self._action(action, (rank, index))
            self.seen.add((action.stage, action.type, action.microbatch))
        self._complete(rank)

    def _action(self, action: Action, cell: Cell) -> None:
        stage, kind, mb, rank = action.stage, action.type, action.microbatch, cell[0]
        if not 0 <= mb < self.num_microbatches:
            self.fail(f"Action {action} names micro-batch {mb}; valid: 0..{self.num_microbatches - 1}.", cell)
        if not action.is_compute:
            if not 0 <= action.peer <= self.last:
                self.fail(f"Action {action} talks to stage {action.peer}, which does not exist.", cell)
            if self.local(stage, action.peer):
                self.fail(f"Action {action} transfers between stages {stage} and {action.peer}, which both live on "
                          f"rank {rank}: the runtime hands the value over in memory. Drop the transfer (or let "
                          f"add_communication lower the compute-only lists).", cell)
        if (stage, kind, mb) in self.seen:
            self.fail(f"Action {action} appears twice on rank {rank}.", cell)
        if kind in (_B, _I) and self.done(stage, (_B, _I), mb):
            self.fail(f"Action {action}: stage {stage} already backwarded micro-batch {mb} (one B, or one I and one "
                      f"W).", cell)
        if kind is _F and stage > 0:
            self._forward_input(action, cell)
        if kind in (_B, _I):
            self._backward_input(action, cell)
        if kind is _W and not self.done(stage, (_I,), mb):
            self.fail(f"Action {action} runs before {stage}I{mb}: the weight gradient needs the input gradient's "
                      f"pass first (B does both at once).", cell)
        if kind is ActionType.SEND_F and not self.done(stage, (_F,), mb):
            self.fail(f"Send {action} comes before {stage}F{mb}, which produces what it sends.", cell)
        if kind is ActionType.SEND_B and not self.done(stage, (_B, _I), mb):
            self.fail(f"Send {action} comes before {stage}B{mb} or {stage}I{mb}, which produces what it sends.", cell)

    def _forward_input(self, action: Action, cell: Cell) -> None:
        stage, mb, rank = action.stage, action.microbatch, cell[0]
        if self.local(stage, stage - 1) and not self.done(stage - 1, (_F,), mb):
            self.fail(f"Action {action} runs before {stage - 1}F{mb}, whose output it takes (both on rank {rank}).",
                      cell)
        if not self.local(stage, stage - 1) and not self.done(stage, (ActionType.RECV_F,), mb):
            self.fail(f"Action {action} runs before its RECV_F on rank {rank}.", cell)

    def _backward_input(self, action: Action, cell: Cell) -> None:
        stage, mb, rank = action.stage, action.microbatch, cell[0]
        if not self.done(stage, (_F,), mb):
            self.fail(f"Action {action} runs before the forward of micro-batch {mb} ({stage}F{mb}).", cell)
        if stage < self.last and self.local(stage, stage + 1) and not self.done(stage + 1, (_B, _I), mb):
            self.fail(f"Action {action} runs before {stage + 1}B{mb} or {stage + 1}I{mb}, whose input gradient it "
                      f"takes (both on rank {rank}).", cell)
        if stage < self.last and not self.local(stage, stage + 1) and not self.done(stage, (ActionType.RECV_B,), mb):
            self.fail(f"Action {action} runs before its RECV_B on rank {rank}.", cell)

    def _complete(self, rank: int) -> None:
        for stage in (s for s, owner in enumerate(self.placement) if owner == rank):
            for mb in range(self.num_microbatches):
                if not self.done(stage, (_F,), mb):
                    self.fail(f"Stage {stage} never runs {stage}F{mb}.", None)
                if self.forward_only:
                    continue
                if not self.done(stage, (_B, _I), mb):
                    self.fail(f"Stage {stage} never runs {stage}B{mb} (or {stage}I{mb} and {stage}W{mb}).", None)
                if self.done(stage, (_I,), mb) != self.done(stage, (_W,), mb):
                    have, lacks = ("I", "W") if self.done(stage, (_I,), mb) else ("W", "I")
                    self.fail(f"Stage {stage} runs {stage}{have}{mb} but never {stage}{lacks}{mb}: a backward is one "
                              f"B, or one I and one W.", None)
        if self.forward_only:
            backward = (_B, _I, _W, ActionType.SEND_B, ActionType.RECV_B)
            extra = next((i for i, a in enumerate(self.actions[rank]) if a.type in backward), None)
            if extra is not None:
                self.fail(f"Rank {rank} has a backward in a forward-only schedule.", (rank, extra))

    def matching_transfers(self) -> None:
        """Every send has exactly one matching receive on the peer, and vice versa."""
        posted = {(a.stage, a.type, a.microbatch) for rank_actions in self.actions for a in rank_actions
                  if not a.is_compute}
        for rank, rank_actions in enumerate(self.actions):
            for index, action in enumerate(rank_actions):
                peer_rank = self.placement[action.peer] if not action.is_compute else None
                if action.is_send and (action.peer, _MATCHING_RECV[action.type], action.microbatch) not in posted:
                    self.fail(f"Send {action} has no matching receive on stage {action.peer} (rank {peer_rank}).",
                              (rank, index))
                if action.is_recv and (action.peer, _MATCHING_SEND[action.type], action.microbatch) not in posted:
                    self.fail(f"Receive {action} has no matching send on stage {action.peer} (rank {peer_rank}).",
                              (rank, index))

    def channel_order(self) -> None:
        """Per channel, the receives in the order of the sends."""
        # (src rank, dst rank, send kind) -> [(sending stage, mb), ...]; receives also keep their index
        sends: dict[tuple[int, int, ActionType], list[tuple[int, int]]] = {}
        receives: dict[tuple[int, int, ActionType], list[tuple[int, int, int]]] = {}
        for rank, rank_actions in enumerate(self.actions):
            for index, action in enumerate(rank_actions):
                if action.is_send:
                    sends.setdefault((rank, self.placement[action.peer], action.type), []).append(
                        (action.stage, action.microbatch))
                elif action.is_recv:
                    receives.setdefault((self.placement[action.peer], rank, _MATCHING_SEND[action.type]), []).append(
                        (action.peer, action.microbatch, index))
        for (source, destination, kind), posted_receives in sorted(receives.items()):
            sent = sends.get((source, destination, kind), [])
            for order, (peer, mb, index) in enumerate(posted_receives):
                if order < len(sent) and sent[order] != (peer, mb):
                    sent_stage, sent_mb = sent[order]
                    wanted = next(i for i, s in enumerate(sent) if s == (peer, mb))
                    self.fail(
                        f"Receive {self.actions[destination][index]} is the receive number {order} on the "
                        f"{_CHANNEL_NAME[kind]} channel from rank {source} to rank {destination}, but rank {source} "
                        f"sends {sent_stage}{kind.value}{sent_mb} as message number {order} there and "
                        f"{peer}{kind.value}{mb} as number {wanted}. gloo matches the messages of one channel in "
                        f"posting order, so this receive would get the tensors of micro-batch {sent_mb} (stage "
                        f"{sent_stage}). Post rank {destination}'s receives from rank {source} in the order rank "
                        f"{source} sends.", (destination, index))

    def progress(self) -> None:
        """Executed with the simulator's loop (sends complete when posted, a receive waits for its send), every rank
        finishes."""
        run = execute(self.actions)
        if not run.finished:
            waiting = ", ".join(f"rank {r} at {self.actions[r][run.position[r]]}" for r in run.unfinished)
            stuck = run.unfinished[0]
            self.fail(f"Deadlock: every unfinished rank waits on a receive ({waiting}).", (stuck, run.position[stuck]))
