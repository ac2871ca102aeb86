"""PipeDream-2BW's schedule as data: 1F1B over the stream of every batch's micro-batches, cut into Lightning's steps.

A synchronous schedule drains the pipeline at every batch: its last backward on stage 0 waits for the whole
pipeline, and the next batch's first forward waits for it. PipeDream's asynchronous 1F1B (Narayanan et al., "Memory-
Efficient Pipeline-Parallel DNN Training", ICML 2021) never drains: the stream of micro-batches of batch after batch
runs as one 1F1B schedule, so the next batch's forwards fill the idle slots of this batch's cool-down.

The stream is :func:`lightning_pp.schedule.build_schedule`'s 1F1B over ``K * m`` micro-batches (validated and
simulated like every schedule); batch ``k`` holds the stream's micro-batches ``k * m`` to ``k * m + m - 1``. Lightning
calls the step once per batch, so each rank's list is cut where the next batch's first action starts: the step of
batch ``t`` runs all of batch ``t``'s forwards (and, on the last stage, all its backwards), and on stage ``s`` the
last ``p - s - 1`` backwards of batch ``t - 1``, which the previous step left in flight. Three cuts are enough:

- ``first``: the step after a drain (or the first step): batch ``t``'s part, nothing of an earlier batch;
- ``steady``: batch ``t - 1``'s leftovers interleaved with batch ``t``'s part (every later step);
- ``drain``: batch ``t``'s leftovers alone, run outside a step (before validation, at a checkpoint, at the end of
  fit).

Where a transfer may span two steps: cut where each batch's first action starts, a stage's last backward of a batch
sends its input gradient at the end of its step, and the previous stage receives it in its next step. On gloo that
is free overlap. On NCCL (and its emulation) a send in flight across a step's end is a hazard: the host meets other
ranks there (a gradient all-reduce, the placement of the weights outside the blocks), and any device synchronize in
that window (a timed step's, or one the allocator does) waits for a send whose receive the peer posts only after
meeting this rank. ``sends_across_steps=False`` cuts each rank's list before such trailing sends instead, so they
open the next step and no transfer spans a step's end; the stream, and so what runs, is the same.

In the lists a micro-batch's number is ``(t mod 2) * m + i`` for micro-batch ``i`` of batch ``t``: the two batches in
flight never share a number, and each number's channel carries tensors of the same layout every other step.

Which weights each pass uses (2BW's rule, with ``W_{-1} = W_0``): batch ``t``'s forwards and backwards all use
``W_{t-1}``, and the optimizer step that ends Lightning's step ``t`` applies batch ``t - 1``'s gradient:
``W_t = W_{t-1} - lr * grad f_{t-1}(W_{t-2})``. A stage's leftover backwards of batch ``t - 1`` run after that step
made ``W_{t-1}`` from ``W_{t-2}``, so the stage keeps ``W_{t-2}`` for them: two versions of its weights.

What Lightning sees: the optimizer and the LR scheduler step at every step, as Lightning calls them (the first step
applies no gradient: the optimizer's state does not move, the scheduler counts the step); step ``t`` returns and
logs batch ``t``'s loss and ``self.log`` values, computed at ``W_{t-1}``. An epoch's end does not drain by itself
(Lightning's default ModelCheckpoint saves there without a validation loop, which does). Validation, a checkpoint and
the end of fit do: the live weights are ``W_t`` (what validation evaluates and a checkpoint holds) and batch ``t``'s
gradient stays pending for the next step; a checkpoint holds it too (synchronized, by name), so a run resumed from it
applies it at its first step and goes on as the uninterrupted run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

from lightning_pp.errors import PipelineConfigError
from lightning_pp.schedule import build_schedule
from lightning_pp.schedule.actions import Action, ActionType, Schedule

__all__ = ["CUTS", "StreamCuts", "stream_cuts", "stream_schedule"]

NAME = "pipedream_2bw"
CUTS = ("first", "steady", "drain")
_STREAM_BATCHES = 3  # a stream long enough to hold a first, a steady and a final cut
_SEND_OF = {ActionType.RECV_F: ActionType.SEND_F, ActionType.RECV_B: ActionType.SEND_B}


def stream_schedule(num_ranks: int, num_microbatches: int, batches: int) -> Schedule:
    """1F1B over ``batches`` batches of ``num_microbatches`` micro-batches, drained only at the end: what
    ``pipedream_2bw`` runs between two drains (validated; micro-batch ``k * m + i`` is batch ``k``'s ``i``)."""
    _check(num_ranks, num_microbatches)
    return build_schedule("1f1b", num_ranks, batches * num_microbatches)


def _check(num_ranks: int, num_microbatches: int) -> None:
    if num_microbatches < num_ranks:
        raise PipelineConfigError(
            f"schedule='{NAME}' needs at least as many micro-batches as ranks (microbatches={num_microbatches}, "
            f"{num_ranks} ranks): with fewer, batches older than the previous one would still be in flight when a "
            f"batch starts, needing more than two weight versions. Pass microbatches={num_ranks} or more."
        )


@dataclass(frozen=True)
class StreamCuts:
    """Each rank's list for each cut (``CUTS``), micro-batches numbered as batch ``t = 0``'s step sees them; use
    :meth:`for_step` for another batch."""

    num_ranks: int
    num_microbatches: int
    lists: dict[str, tuple[tuple[Action, ...], ...]]
    _built: dict[tuple[str, int], Schedule] = field(default_factory=dict, init=False, compare=False, repr=False)

    def for_step(self, cut: str, batch: int) -> Schedule:
        """The lists of ``cut`` (``"first"``, ``"steady"``, ``"drain"``) for the step of batch ``batch`` (for
        ``"drain"``: the batch whose leftovers it runs); built once per cut and parity of the batch."""
        key = (cut, batch % 2)
        if key not in self._built:
            actions = tuple(tuple(_shifted(a, key[1] * self.num_microbatches, self.num_microbatches) for a in rank)
                            for rank in self.lists[cut])
            sent = {(a.peer, a.microbatch, a.type) for rank in actions for a in rank if a.is_send}
            in_flight = frozenset(a for rank in actions for a in rank if a.is_recv
                                  and (a.stage, a.microbatch, _SEND_OF[a.type]) not in sent)
            self._built[key] = Schedule(NAME, self.num_ranks, 2 * self.num_microbatches, actions, in_flight=in_flight)
        return self._built[key]

    def leftovers(self, rank: int) -> int:
        """How many of a batch's backwards rank ``rank`` runs in the next step (or the drain)."""
        return sum(1 for a in self.lists["drain"][rank] if a.is_compute)


def _shifted(action: Action, shift: int, m: int) -> Action:
    """``action`` with its micro-batch moved by ``shift`` among the two batches' numbers ``0 .. 2m - 1``."""
    return Action(action.stage, action.type, (action.microbatch + shift) % (2 * m))


@cache
def stream_cuts(num_ranks: int, num_microbatches: int, sends_across_steps: bool = True) -> StreamCuts:
    """Cut a validated stream of three batches where each batch's first action starts on each rank (without
    ``sends_across_steps``: before the trailing sends whose receive lies in the peer's next part, see the module's
    docstring): the first cut is the first batch's step, the steady cut the second's; the drain is the first batch's
    leftovers in a stream that ends after it (which must equal what the first cut leaves)."""
    m = num_microbatches
    stream = stream_schedule(num_ranks, m, _STREAM_BATCHES)
    single = stream_schedule(num_ranks, m, 1)
    lists: dict[str, list[tuple[Action, ...]]] = {cut: [] for cut in CUTS}
    cuts = [[next(i for i, a in enumerate(actions) if a.microbatch == k * m) for k in range(_STREAM_BATCHES)]
            for actions in stream.actions]
    if not sends_across_steps:
        cuts = _before_sends_across(stream, cuts)
    for rank in range(num_ranks):
        actions = stream.actions[rank]
        starts = cuts[rank]
        first = actions[starts[0]:starts[1]]
        steady = tuple(_shifted(a, m, m) for a in actions[starts[1]:starts[2]])  # its batch's own numbers first
        whole = single.actions[rank]
        if whole[:len(first)] != first:  # the stream's first cut is the start of one drained batch
            raise AssertionError(f"rank {rank}: the stream's first step is not the start of a drained batch")
        drain = whole[len(first):]
        lists["first"].append(first)
        lists["steady"].append(steady)
        lists["drain"].append(drain)
    return StreamCuts(num_ranks, m, {cut: tuple(rank_lists) for cut, rank_lists in lists.items()})


def _before_sends_across(stream: Schedule, cuts: list[list[int]]) -> list[list[int]]:
    """Each rank's cut points moved back over its trailing sends whose matching receive lies at or after the peer's
    cut point (in the peer's next part), so that they open the next part. One stage per rank (1F1B's stream)."""
    moved = [list(points) for points in cuts]
    for rank, actions in enumerate(stream.actions):
        for k in range(1, len(moved[rank])):
            while moved[rank][k] > moved[rank][k - 1] and actions[moved[rank][k] - 1].is_send:
                send = actions[moved[rank][k] - 1]
                peer = stream.actions[send.peer]
                receive = next(i for i, a in enumerate(peer) if a.is_recv and a.peer == send.stage
                               and a.microbatch == send.microbatch and _SEND_OF[a.type] == send.type)
                if receive < cuts[send.peer][k]:
                    break
                moved[rank][k] -= 1
    return moved
