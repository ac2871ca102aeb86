"""Single-process tier: schedule generators, lowering, validation and the simulator."""

from __future__ import annotations

import pytest

from lightning_pp.errors import PipelineConfigError, PipelineScheduleError
from lightning_pp.schedules import SCHEDULES, Action, ActionType, add_communication, build_schedule, validate_schedule
from lightning_pp.simulate import format_timeline, simulate

GOLDEN = {
    "naive": """\
stage 0 |F0............B0F1............B1F2............B2F3............B3F4............B4F5............B5F6............B6F7............B7
stage 1 |..F0........B0....F1........B1....F2........B2....F3........B3....F4........B4....F5........B5....F6........B6....F7........B7
stage 2 |....F0....B0........F1....B1........F2....B2........F3....B3........F4....B4........F5....B5........F6....B6........F7....B7
stage 3 |......F0B0............F1B1............F2B2............F3B3............F4B4............F5B5............F6B6............F7B7""",
    "gpipe": """\
stage 0 |F0F1F2F3F4F5F6F7............B0B1B2B3B4B5B6B7
stage 1 |..F0F1F2F3F4F5F6F7........B0B1B2B3B4B5B6B7
stage 2 |....F0F1F2F3F4F5F6F7....B0B1B2B3B4B5B6B7
stage 3 |......F0F1F2F3F4F5F6F7B0B1B2B3B4B5B6B7""",
    "1f1b": """\
stage 0 |F0F1F2F3......B0F4B1F5B2F6B3F7B4..B5..B6..B7
stage 1 |..F0F1F2....B0F3B1F4B2F5B3F6B4F7B5..B6..B7
stage 2 |....F0F1..B0F2B1F3B2F4B3F5B4F6B5F7B6..B7
stage 3 |......F0B0F1B1F2B2F3B3F4B4F5B5F6B6F7B7""",
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_golden_timeline_4_stages_8_microbatches(name: str) -> None:
    assert format_timeline(simulate(build_schedule(name, 4, 8))) == GOLDEN[name]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "microbatches"), [(2, 1), (2, 4), (4, 4), (4, 8), (3, 5), (8, 16)])
def test_unit_cost_bubble_matches_formula(name: str, stages: int, microbatches: int) -> None:
    bubble = simulate(build_schedule(name, stages, microbatches)).bubble_fraction()
    assert bubble == pytest.approx((stages - 1) / (microbatches + stages - 1))


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 4), (4, 8)])
def test_naive_bubble_is_larger(stages: int, microbatches: int) -> None:
    naive = simulate(build_schedule("naive", stages, microbatches)).bubble_fraction()
    assert naive > (stages - 1) / (microbatches + stages - 1) + 0.1
    assert naive == pytest.approx(1 - 1 / stages)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize(("stages", "microbatches"), [(1, 1), (1, 3), (2, 1), (2, 3), (3, 2), (4, 3), (4, 9)])
def test_every_schedule_validates(name: str, stages: int, microbatches: int) -> None:
    schedule = build_schedule(name, stages, microbatches)
    for stage in range(stages):
        computes = schedule.compute_actions(stage)
        assert sorted(map(str, computes)) == sorted(
            f"{stage}{kind}{mb}" for kind in "FB" for mb in range(microbatches)
        )
    forward_only = build_schedule(name, stages, microbatches, forward_only=True)
    assert all(a.type is not ActionType.BACKWARD for actions in forward_only.actions for a in actions)


def _peak_in_flight(actions: list[Action]) -> int:
    """The most micro-batches a stage holds activations for at once: +1 at each forward, -1 at each backward."""
    in_flight = peak = 0
    for action in actions:
        in_flight += 1 if action.type is ActionType.FORWARD else -1
        peak = max(peak, in_flight)
    return peak


def test_1f1b_bounds_in_flight_microbatches() -> None:
    stages, microbatches = 4, 8
    one_f_one_b, gpipe = build_schedule("1f1b", stages, microbatches), build_schedule("gpipe", stages, microbatches)
    for stage in range(stages):
        assert _peak_in_flight(one_f_one_b.compute_actions(stage)) == stages - stage
        assert _peak_in_flight(gpipe.compute_actions(stage)) == microbatches


def test_action_string_round_trip() -> None:
    for text in ["0F3", "1B2", "1SEND_F1", "2RECV_B10"]:
        assert str(Action.parse(text)) == text
    with pytest.raises(PipelineScheduleError, match="Cannot parse"):
        Action.parse("F3")


def _lowered(rows: list[str]) -> list[list[Action]]:
    return [[Action.parse(cell) for cell in row.split()] for row in rows]


def test_validator_marks_the_deadlocked_cell() -> None:
    # both stages wait for the other's message before sending their own
    actions = _lowered(["0F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"])
    validate_schedule(actions, 1)
    deadlock = _lowered(["0RECV_B0 0F0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"])
    with pytest.raises(PipelineScheduleError, match="Deadlock") as info:
        validate_schedule(deadlock, 1)
    assert ">>0RECV_B0<<" in str(info.value)


def test_validator_reports_missing_and_unmatched_actions() -> None:
    compute = SCHEDULES["gpipe"](2, 2)
    lowered = add_communication(compute)
    broken = [list(lowered[0]), [a for a in lowered[1] if str(a) != "1B1"]]
    with pytest.raises(PipelineScheduleError, match="never runs 1B1"):
        validate_schedule(broken, 2)
    unmatched = [list(lowered[0]), [a for a in lowered[1] if str(a) != "1RECV_F1"]]
    with pytest.raises(PipelineScheduleError, match="1F1 runs before its RECV_F") as info:
        validate_schedule(unmatched, 2)
    assert ">>1F1<<" in str(info.value)
    backward_first = [[Action.parse(c) for c in ["0B0", "0F0"]]]
    with pytest.raises(PipelineScheduleError, match="before the forward"):
        validate_schedule(backward_first, 1)


def test_unknown_schedule_lists_valid_names() -> None:
    with pytest.raises(PipelineConfigError, match="1f1b, gpipe, naive"):
        build_schedule("zero-bubble", 2, 4)
