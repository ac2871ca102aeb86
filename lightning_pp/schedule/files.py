"""Schedules read from torch.distributed.pipelining's CSV format (written by :meth:`Schedule.to_csv
<lightning_pp.schedule.actions.Schedule.to_csv>` and torch's ``_dump_csv``)."""

from __future__ import annotations

import csv
import os
from pathlib import Path

from lightning_pp.errors import PipelineConfigError
from lightning_pp.schedule.actions import Action, Schedule
from lightning_pp.schedule.generators import GENERATORS
from lightning_pp.schedule.lowering import finish_schedule
from lightning_pp.schedule.validate import infer_stage_to_rank

__all__ = ["load_csv"]


_TORCH_BOOKKEEPING = ("UNSHARD", "RESHARD", "REDUCE_GRAD")  # torch's actions without micro-batch, not ours


def load_csv(
    path: str | os.PathLike[str],
    num_ranks: int | None = None,
    num_microbatches: int | None = None,
    *,
    forward_only: bool = False,
    stages_per_rank: int | None = None,
) -> Schedule:
    """Read a schedule in torch.distributed.pipelining's CSV format, lower it (add the transfers) and validate it.

    One row per rank of comma-separated actions (``0F0,0F1,2F0,...,0I0,0W0``), as :meth:`Schedule.to_csv` and torch's
    ``_dump_csv`` write them; empty cells (torch's idle slots) are skipped. Which rank holds which stage is read off
    the rows. Only the compute actions are kept: the transfers are added by :func:`add_communication`. So a file in
    torch's ``compute_comms`` format (the default of ``_PipelineScheduleRuntime._dump_csv``) loads too, its
    ``SEND``/``RECV`` placed anew: torch posts a receive early and waits for it at the compute, while here a receive
    blocks where it stands, right before its compute. Its ``UNSHARD``, ``RESHARD`` and ``REDUCE_GRAD`` actions (FSDP
    and data-parallel bookkeeping, done outside the schedule here) are dropped as well.

    Args:
        path: The CSV file.
        num_ranks: Expected number of rows (ranks); left out, the file's.
        num_microbatches: Expected micro-batches; left out, one more than the largest micro-batch in the file.
        forward_only: Keep only the forwards (evaluation).
        stages_per_rank: Expected stages per rank; left out, the file's.

    Raises:
        PipelineConfigError: The file does not exist, holds no actions or does not have the expected counts.
        PipelineScheduleError: An action cannot be parsed or the schedule is inconsistent (with the grid).
    """
    file = Path(path)
    rows = _compute_rows(file)
    if not rows:
        raise PipelineConfigError(
            f"Schedule file {str(file)!r} holds no compute actions; write one row of actions per rank."
        )
    if num_ranks is not None and len(rows) != num_ranks:
        raise PipelineConfigError(
            f"Schedule file {str(file)!r} has {len(rows)} rows (ranks) but num_ranks={num_ranks}: write one row per "
            f"rank, or run it on {len(rows)} ranks."
        )
    largest = max(a.microbatch for row in rows for a in row) + 1
    if num_microbatches is None:
        num_microbatches = largest
    elif largest != num_microbatches:
        raise PipelineConfigError(
            f"Schedule file {str(file)!r} schedules micro-batches 0..{largest - 1} but num_microbatches="
            f"{num_microbatches}: a file fixes the micro-batch count; use num_microbatches={largest} or write the "
            f"file for {num_microbatches}."
        )
    placement = infer_stage_to_rank(rows)
    found = len(placement) // len(rows)
    if stages_per_rank is not None and found != stages_per_rank:
        raise PipelineConfigError(
            f"Schedule file {str(file)!r} places {found} stage(s) on each rank but stages_per_rank={stages_per_rank}; "
            f"pass stages_per_rank={found} (or leave it out)."
        )
    return finish_schedule(str(file), rows, num_microbatches, forward_only)


def _compute_rows(file: Path) -> list[list[Action]]:
    """The compute actions of each row of ``file`` (trailing empty rows dropped)."""
    if not file.is_file():
        raise PipelineConfigError(
            f"Schedule file {str(file)!r} does not exist. Pass the path of a CSV file with one row of actions per "
            f"rank (e.g. written by Schedule.to_csv), or the name of a generator: {', '.join(sorted(GENERATORS))}."
        )
    rows: list[list[Action]] = []
    with open(file, newline="") as handle:
        for row in csv.reader(handle):
            cells = [cell.strip() for cell in row]
            actions = [Action.parse(cell) for cell in cells if cell and not cell.endswith(_TORCH_BOOKKEEPING)]
            rows.append([action for action in actions if action.is_compute])
    while rows and not rows[-1]:  # trailing empty lines
        rows.pop()
    return rows
