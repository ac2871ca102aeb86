"""``schedule="auto"``'s closed loop (:mod:`lightning_pp.tuning.closed_loop`): the decision on measurements given by
hand (single process), and every rank switching at the same step while training stays exact (2 ranks).
The multi-process tests are in ``multi_process/test_closed_loop_multiprocess.py``."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_pp.schedule.timeline import BACKWARD, FORWARD
from lightning_pp.tuning.closed_loop import MISS, AutoSearch, StepMeasurement, calibrate, rechoose
from lightning_pp.tuning.search import Candidate, MeasuredCosts, search, stage_costs

BLOCKS, BATCH = 8, 32


def costs(per_row: float = 1e-3, slow_first: float = 1.0) -> MeasuredCosts:
    """F = I = W = ``per_row`` seconds per row for each block (the first ``slow_first`` times as long), at
    micro-batches of 2 and 16 rows; nothing else costs anything."""
    def both(value: float) -> tuple[list[float], list[float]]:
        return tuple([value * rows * (slow_first if b == 0 else 1) for b in range(BLOCKS)]  # type: ignore[return-value]
                     for rows in (2, 16))

    zero = ((0.0, 0.0), (0.0, 0.0))
    return MeasuredCosts(sizes=(2.0, 16.0), forward=both(per_row), input_backward=both(per_row),
                         weight_backward=both(per_row), saved_bytes=both(1.0), output_bytes=both(1.0), before=zero,
                         after=zero, outside_saved_bytes=zero, latency_s=0.0, seconds_per_byte=0.0, framework_s=0.0)


def searched(measured: MeasuredCosts, **fixed: object) -> AutoSearch:
    return AutoSearch(measured, 2, BATCH, None, fixed.get("microbatches"), fixed.get("stages_per_rank"),  # type: ignore[arg-type]
                      fixed.get("balance"), None)  # type: ignore[arg-type]


def configuration(measured: MeasuredCosts, schedule: str, microbatches: int, balance: tuple[int, ...]) -> Candidate:
    return next(c for c in search(measured, 2, BATCH, microbatches=microbatches, stages_per_rank=1, balance=balance,
                                  recompute=False) if c.schedule == schedule)


def measurement(measured: MeasuredCosts, current: Candidate, slower: tuple[float, float] = (1.0, 1.0),
                gap_s: float = 0.0, window_s: float | None = None) -> list[StepMeasurement]:
    """What the two ranks of ``current`` would measure: stage ``s``'s compute ``slower[s]`` times the prediction,
    ``gap_s`` between actions (20 per rank), whole steps of ``window_s`` (default: the prediction)."""
    staged = stage_costs(measured, 2, BATCH / current.microbatches, False, current.balance)
    m, ranks = current.microbatches, []
    for s in range(2):
        forward = staged.forward[s] * slower[s]
        backward = (staged.input_backward[s] + staged.weight_backward[s]) * slower[s]
        wall = current.step_s * max(slower) + 20 * gap_s
        ranks.append(StepMeasurement(windows=[window_s if window_s is not None else wall] * 3,
                                     compute={(s, FORWARD): (forward * m, m), (s, BACKWARD): (backward * m, m)},
                                     wall=wall, covered=wall - 20 * gap_s, actions=20))
    return ranks


def test_the_measured_costs_move_each_stage_to_what_it_took() -> None:
    """The second stage took twice its prediction: its blocks cost that much more per call, at every micro-batch
    size; the first stage's are unchanged; the gaps between actions are the time per action, and the whole step less
    the schedule's wall time is the time outside it."""
    measured = costs()
    current = configuration(measured, "1f1b", 4, (4, 4))
    ranks = measurement(measured, current, slower=(1.0, 2.0), gap_s=1e-3, window_s=current.step_s * 3)
    calibrated = calibrate(measured, current, BATCH, ranks)
    now = stage_costs(measured, 2, BATCH / 4, False, (4, 4))
    assert stage_costs(calibrated, 2, BATCH / 4, False, (4, 4)).forward == pytest.approx([now.forward[0],
                                                                                         2 * now.forward[1]])
    extra = now.forward[1] / 4  # per block of the second stage, per call
    for k in range(2):
        assert calibrated.forward[k][:4] == pytest.approx(measured.forward[k][:4])
        assert calibrated.forward[k][4:] == pytest.approx([x + extra for x in measured.forward[k][4:]])
        assert calibrated.weight_backward[k][4:] == pytest.approx([x + extra for x in measured.weight_backward[k][4:]])
    assert calibrated.framework_s == pytest.approx(1e-3)
    assert calibrated.outside_s == pytest.approx(current.step_s * 3 - ranks[0].wall)


def test_a_step_within_the_margin_keeps_the_choice() -> None:
    measured = costs()
    current = configuration(measured, "1f1b", 4, (4, 4))
    ranks = measurement(measured, current, slower=(1 + MISS - 0.05,) * 2, window_s=2 * current.step_s)
    decided = rechoose(searched(measured), current, ranks, False)
    assert not decided.missed and not decided.switch and "(+20 %)" in decided.message
    assert "more than" not in decided.message
    # from then on, the prediction is the whole step's: the time outside the schedule measured is added
    outside = 2 * current.step_s - ranks[0].wall
    assert decided.chosen == dataclasses.replace(current, step_s=current.step_s + outside)
    assert f"{1e3 * outside:.1f} ms of it outside the schedule" in decided.message


def test_a_missed_step_with_costly_actions_switches_to_fewer_microbatches_keeping_the_split() -> None:
    """The probe saw cheap actions; the run spends 20 ms between actions: fewer micro-batches are predicted faster,
    and the switch keeps the split and each stage's rank (1F1B, GPipe or ZB-H1)."""
    measured = costs(per_row=1e-4)
    current = configuration(measured, "1f1b", 16, (4, 4))
    decided = rechoose(searched(measured), current, measurement(measured, current, gap_s=0.02), False)
    assert decided.missed and decided.switch, decided.message
    chosen = decided.chosen
    assert chosen.microbatches < 16 and chosen.balance == (4, 4) and chosen.stages_per_rank == 1
    assert chosen.schedule in ("1f1b", "gpipe", "zb_h1")
    assert f"switching to {chosen.schedule} m={chosen.microbatches}" in decided.message
    # the measured costs predict the step that was measured for the configuration that ran
    staying = rechoose(searched(measured), current, measurement(measured, current, gap_s=0.02), True)
    assert staying.chosen.microbatches == 16


def test_a_faster_split_is_named_for_the_next_run_not_switched_to() -> None:
    """The first stage measured 4x slower than predicted: a split giving it fewer blocks is predicted faster, but it
    would move blocks between ranks: the log names it; the run keeps its split."""
    measured = costs()
    current = configuration(measured, "1f1b", 8, (4, 4))
    decided = rechoose(searched(measured), current, measurement(measured, current, slower=(4.0, 1.0)), False)
    assert decided.missed and decided.chosen.balance == (4, 4)
    named = decided.message.splitlines()[-1]
    assert named.startswith("A configuration that places blocks otherwise is predicted faster"), decided.message
    assert "name it for the next one: schedule=" in named and "balance=[" in named and "balance=[4, 4]" not in named


