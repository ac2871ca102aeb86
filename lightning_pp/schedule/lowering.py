"""Lowering compute-only per-rank lists into a schedule: which rank holds each stage, the transfers added where a
value crosses ranks, the result validated (:mod:`lightning_pp.schedule.validate`) and wrapped in a
:class:`~lightning_pp.schedule.actions.Schedule`; and the forward sweep used for batches a schedule's rule cannot
split."""

from __future__ import annotations

from collections.abc import Sequence

from lightning_pp.errors import PipelineScheduleError
from lightning_pp.schedule.actions import Action, ActionType, Schedule
from lightning_pp.schedule.validate import infer_stage_to_rank, validate_schedule

__all__ = ["add_communication", "finish_schedule", "forward_sweep"]

_F, _B, _I, _W = ActionType.FORWARD, ActionType.BACKWARD, ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT


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


def finish_schedule(name: str, compute: Sequence[Sequence[Action]], num_microbatches: int,
                    forward_only: bool) -> Schedule:
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
    return finish_schedule("forward_sweep", compute, num_microbatches, forward_only=True)
