"""Pipeline schedules as data: per-rank action lists (``actions``), their generators (``generators``), the
communication lowering (``lowering``), the checker (``validate``), CSV files (``files``), building by name and count
(``build``), the simulator (``simulate``, ``timeline``) and how blocks are split into stages (``partition``). Pure
logic: imports nothing of lightning_pp but ``errors``.

A schedule is the single source of truth for what every rank does in one optimizer step. The same action lists
(:mod:`lightning_pp.schedule.actions`) are validated in :mod:`lightning_pp.schedule.validate`, simulated in
:mod:`lightning_pp.schedule.simulate`, executed by the runtime and drawn by the monitor. Schedules are exchanged with
torch as CSV files (:meth:`Schedule.to_csv`, :func:`~lightning_pp.schedule.files.load_csv`).

What a runtime does with a rank's list, in order: ``F`` of stage ``s`` takes stage ``s - 1``'s output of the
micro-batch, from its ``RECV_F`` or, when stage ``s - 1`` lives on the same rank, straight from that stage's earlier
``F`` (no transfer is scheduled between stages of one rank; the runtime keeps the value, as torch's
``set_local_fwd_input`` does). ``B`` back-propagates the stage's output gradient (from ``RECV_B``, or left by stage
``s + 1``'s earlier ``B`` / ``I`` on the same rank) into its input and its weights. ``I`` computes only the gradient
with respect to the input, which ``SEND_B`` (or the same-rank hand-over) passes on, and keeps what the weight
gradient needs (torch's ``stage_backward_input`` keeps the gradients where the weight paths branch off); ``W`` later
computes and accumulates the weight gradients from them. A stage holds a micro-batch from its ``F`` until its ``B``,
or until its ``W`` (most of the activations can go after ``I``).
"""

from lightning_pp.schedule.actions import Action, ActionType, Schedule, format_grid
from lightning_pp.schedule.build import StepSchedules, build_schedule
from lightning_pp.schedule.files import load_csv
from lightning_pp.schedule.generators import GENERATORS, SCHEDULES
from lightning_pp.schedule.lowering import add_communication, forward_sweep
from lightning_pp.schedule.validate import infer_stage_to_rank, validate_schedule

__all__ = [
    "GENERATORS",
    "SCHEDULES",
    "Action",
    "ActionType",
    "Schedule",
    "StepSchedules",
    "add_communication",
    "build_schedule",
    "format_grid",
    "forward_sweep",
    "infer_stage_to_rank",
    "load_csv",
    "validate_schedule",
]
