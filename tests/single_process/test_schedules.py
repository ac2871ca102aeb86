"""Single-process tier: schedule generators, lowering, validation, CSV exchange with torch and the simulator."""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_pp.errors import PipelineConfigError, PipelineScheduleError
from lightning_pp.schedule import (
    GENERATORS,
    SCHEDULES,
    Action,
    ActionType,
    Schedule,
    StepSchedules,
    add_communication,
    build_schedule,
    load_csv,
    validate_schedule,
)
from lightning_pp.schedule.simulate import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    Timeline,
    TimelineEvent,
    action_costs,
    execute,
    format_timeline,
    simulate,
)

# (name, ranks, micro-batches, stages per rank) -> the unit-cost picture
GOLDEN = {
    ("naive", 4, 8, 1): """\
stage 0 |F0............B0F1............B1F2............B2F3............B3F4............B4F5............B5F6............B6F7............B7
stage 1 |..F0........B0....F1........B1....F2........B2....F3........B3....F4........B4....F5........B5....F6........B6....F7........B7
stage 2 |....F0....B0........F1....B1........F2....B2........F3....B3........F4....B4........F5....B5........F6....B6........F7....B7
stage 3 |......F0B0............F1B1............F2B2............F3B3............F4B4............F5B5............F6B6............F7B7""",
    ("gpipe", 4, 8, 1): """\
stage 0 |F0F1F2F3F4F5F6F7............B0B1B2B3B4B5B6B7
stage 1 |..F0F1F2F3F4F5F6F7........B0B1B2B3B4B5B6B7
stage 2 |....F0F1F2F3F4F5F6F7....B0B1B2B3B4B5B6B7
stage 3 |......F0F1F2F3F4F5F6F7B0B1B2B3B4B5B6B7""",
    ("1f1b", 4, 8, 1): """\
stage 0 |F0F1F2F3......B0F4B1F5B2F6B3F7B4..B5..B6..B7
stage 1 |..F0F1F2....B0F3B1F4B2F5B3F6B4F7B5..B6..B7
stage 2 |....F0F1..B0F2B1F3B2F4B3F5B4F6B5F7B6..B7
stage 3 |......F0B0F1B1F2B2F3B3F4B4F5B5F6B6F7B7""",
    ("zb_h1", 4, 8, 1): """\
stage 0 |F0F1F2F3......I0W0F4I1W1F5I2W2F6I3W3F7I4W4I5W5I6W6I7W7
stage 1 |..F0F1F2....I0F3I1W0F4I2W1F5I3W2F6I4W3F7I5W4I6W5I7W6W7
stage 2 |....F0F1..I0F2I1F3I2W0F4I3W1F5I4W2F6I5W3F7I6W4I7W5W6W7
stage 3 |......F0I0F1I1F2I2F3I3W0F4I4W1F5I5W2F6I6W3F7I7W4W5W6W7""",
    ("interleaved_1f1b", 2, 4, 2): """\
rank 0 |0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 ... 2B2 ... 2B3 0B2 0B3
rank 1 |... 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3""",
    ("interleaved_1f1b", 4, 4, 2): """\
rank 0 |0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 ... ... ... 4B0 ... 4B1 ... 4B2 ... 4B3 0B0 0B1 0B2 0B3
rank 1 |... 1F0 1F1 1F2 1F3 5F0 5F1 5F2 5F3 ... 5B0 ... 5B1 ... 5B2 ... 5B3 1B0 1B1 1B2 1B3
rank 2 |... ... 2F0 2F1 2F2 2F3 6F0 6F1 6F2 6B0 6F3 6B1 ... 6B2 ... 6B3 2B0 2B1 2B2 2B3
rank 3 |... ... ... 3F0 3F1 3F2 3F3 7F0 7B0 7F1 7B1 7F2 7B2 7F3 7B3 3B0 3B1 3B2 3B3""",
    ("interleaved_1f1b", 4, 8, 2): """\
rank 0 |0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4 0F5 0F6 4B0 0F7 4B1 ... ... 4F4 4B2 4F5 4B3 4F6 0B0 4F7 0B1 0B2 0B3 ... 4B4 ... 4B5 ... 4B6 ... 4B7 0B4 0B5 0B6 0B7
rank 1 |... 1F0 1F1 1F2 1F3 5F0 5F1 5F2 5F3 1F4 5B0 1F5 5B1 1F6 5B2 1F7 5B3 5F4 1B0 5F5 1B1 5F6 1B2 5F7 1B3 ... 5B4 ... 5B5 ... 5B6 ... 5B7 1B4 1B5 1B6 1B7
rank 2 |... ... 2F0 2F1 2F2 2F3 6F0 6F1 6F2 6B0 6F3 6B1 2F4 6B2 2F5 6B3 2F6 2B0 2F7 2B1 6F4 2B2 6F5 2B3 6F6 6B4 6F7 6B5 ... 6B6 ... 6B7 2B4 2B5 2B6 2B7
rank 3 |... ... ... 3F0 3F1 3F2 3F3 7F0 7B0 7F1 7B1 7F2 7B2 7F3 7B3 3F4 3B0 3F5 3B1 3F6 3B2 3F7 3B3 7F4 7B4 7F5 7B5 7F6 7B6 7F7 7B7 3B4 3B5 3B6 3B7""",
    ("interleaved_1f1b", 2, 4, 3): """\
rank 0 |0F0 0F1 2F0 2F1 4F0 4F1 0F2 4B0 0F3 4B1 2F2 2B0 2F3 2B1 4F2 0B0 4F3 0B1 ... 4B2 ... 4B3 2B2 2B3 0B2 0B3
rank 1 |... 1F0 1F1 3F0 3F1 5F0 5B0 5F1 5B1 1F2 3B0 1F3 3B1 3F2 1B0 3F3 1B1 5F2 5B2 5F3 5B3 3B2 3B3 1B2 1B3""",
    ("zbv", 2, 4, 2): """\
rank 0 |0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3
rank 1 |... 1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3""",
    ("dualpipev", 2, 4, 2): """\
rank 0 |0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3
rank 1 |... 1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3""",
    ("dualpipev", 4, 8, 2): """\
rank 0 |0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 0F7 7B3 7F4 0B0 7B4 7F5 0B1 7B5 7F6 0B2 7B6 7F7 0B3 7B7 0I4 0W4 0I5 0W5 0I6 0W6 0I7 0W7
rank 1 |... 1F0 1F1 1F2 1F3 1F4 6F0 1F5 6F1 6I0 6W0 6F2 6I1 6W1 6F3 1F6 6B2 6F4 1B0 1F7 6B3 6F5 1B1 6B4 6F6 1B2 6B5 6F7 1B3 6B6 1B4 6I7 1I5 6W7 1I6 1W5 1I7 1W6 1W7
rank 2 |... ... 2F0 2F1 2F2 5F0 2F3 5F1 2F4 5F2 5I0 5W0 5F3 2F5 5B1 5F4 2B0 2F6 5B2 5F5 2B1 2F7 5B3 5F6 2B2 5B4 5F7 2B3 5B5 2B4 5B6 2I5 5I7 2I6 2W5 2I7 5W7 2W6 2W7
rank 3 |... ... ... 3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 3F4 4B0 4F4 3B0 3F5 4B1 4F5 3B1 3F6 4B2 4F6 3B2 3F7 4B3 4F7 3B3 4B4 3B4 4B5 3B5 4I6 3I6 4I7 3I7 4W6 3W6 4W7 3W7""",
    ("zbv", 4, 8, 2): """\
rank 0 |0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 7I3 7W3 0F7 0I0 0W0 7F4 7I4 7W4 0I1 0W1 7F5 7I5 7W5 0I2 0W2 7F6 7I6 7W6 0I3 0W3 7F7 7I7 7W7 0I4 0W4 0I5 0W5 0I6 0W6 0I7 0W7
rank 1 |... 1F0 1F1 1F2 1F3 1F4 6F0 1F5 6F1 6I0 6W0 6F2 6I1 6W1 6F3 6I2 6W2 1F6 1I0 1W0 6F4 6I3 6W3 1F7 1I1 1W1 6F5 6I4 6W4 1I2 1W2 6F6 6I5 6W5 1I3 1W3 6F7 6I6 6W6 1I4 6I7 1I5 1W4 1I6 1W5 1I7 1W6 6W7 1W7
rank 2 |... ... 2F0 2F1 2F2 5F0 2F3 5F1 2F4 5F2 5I0 5W0 5F3 5I1 5W1 2F5 2I0 2W0 5F4 5I2 5W2 2F6 2I1 2W1 5F5 5I3 5W3 2F7 2I2 2W2 5F6 5I4 5W4 2I3 2W3 5F7 5I5 5W5 2I4 5I6 2I5 5I7 2I6 2W4 2I7 2W5 5W6 5W7 2W6 2W7
rank 3 |... ... ... 3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 4I0 4W0 3F4 3I0 3W0 4F4 4I1 4W1 3F5 3I1 3W1 4F5 4I2 4W2 3F6 3I2 3W2 4F6 4I3 4W3 3F7 3I3 3W3 4F7 4I4 4W4 3I4 4I5 3I5 4I6 3I6 4I7 3I7 3W4 4W5 4W6 4W7 3W5 3W6 3W7""",
}
# the pictures each generator's docstring draws (short enough for its line length)
IN_DOCSTRING = [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("zb_h1", 4, 8, 1), ("interleaved_1f1b", 2, 4, 2),
                ("interleaved_1f1b", 4, 4, 2), ("zbv", 2, 4, 2), ("dualpipev", 2, 4, 2)]
STAGES_PER_RANK = {"naive": 1, "gpipe": 1, "1f1b": 1, "zb_h1": 1, "interleaved_1f1b": 2, "zbv": 2, "dualpipev": 2,
                   "pipedream_2bw": 1}


def _build(name: str, ranks: int, microbatches: int, stages_per_rank: int | None = None,
           forward_only: bool = False) -> Schedule:
    v = STAGES_PER_RANK[name] if stages_per_rank is None else stages_per_rank
    return build_schedule(name, ranks, microbatches, forward_only=forward_only, stages_per_rank=v)


@pytest.mark.parametrize("case", sorted(GOLDEN), ids=lambda case: "-".join(map(str, case)))
def test_golden_timeline(case: tuple[str, int, int, int]) -> None:
    name, ranks, microbatches, stages_per_rank = case
    assert format_timeline(simulate(_build(name, ranks, microbatches, stages_per_rank))) == GOLDEN[case]


@pytest.mark.parametrize("case", IN_DOCSTRING, ids=lambda case: "-".join(map(str, case)))
def test_docstring_draws_the_golden_picture(case: tuple[str, int, int, int]) -> None:
    docstring = inspect.cleandoc(GENERATORS[case[0]].__doc__ or "")
    assert GOLDEN[case] in docstring


def test_old_call_still_builds_one_stage_per_rank() -> None:
    """The runtime's call: positional ranks (= stages) and micro-batches; actions[rank], peers are stages."""
    schedule = build_schedule("1f1b", 4, 8)
    assert (schedule.num_stages, schedule.num_ranks, schedule.stages_per_rank) == (4, 4, 1)
    assert schedule.stage_to_rank == (0, 1, 2, 3)
    assert [schedule.stages_of(rank) for rank in range(4)] == [(0,), (1,), (2,), (3,)]
    assert all(a.stage == rank for rank in range(4) for a in schedule.actions[rank])
    assert Schedule("x", 2, 1, ((), ())).stage_to_rank == (0, 1)
    assert set(SCHEDULES) == {"naive", "gpipe", "1f1b"}  # one stage per rank, full backward


# ---------------------------------------------------------------------------------------------------------- bubbles


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


@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize(("ranks", "microbatches"),
                         [(1, 1), (1, 3), (2, 2), (2, 3), (2, 4), (2, 6), (2, 8), (3, 3), (3, 6),
                          (4, 4), (4, 5), (4, 7), (4, 8), (4, 10), (4, 12), (4, 15), (4, 16)])
def test_interleaved_bubble_matches_formula(ranks: int, microbatches: int, v: int) -> None:
    timeline = simulate(build_schedule("interleaved_1f1b", ranks, microbatches, stages_per_rank=v))
    assert timeline.bubble_fraction() == pytest.approx((ranks - 1) / (v * microbatches + ranks - 1))
    one_f_one_b = simulate(build_schedule("1f1b", ranks, microbatches)).bubble_fraction()
    assert timeline.bubble_fraction() <= one_f_one_b


@pytest.mark.parametrize(("ranks", "microbatches"), [(1, 3), (2, 2), (2, 5), (3, 3), (3, 7), (4, 4), (4, 8),
                                                     (4, 9), (8, 8), (8, 16)])
def test_zb_h1_bubble_matches_formula(ranks: int, microbatches: int) -> None:
    """F = I = W = 1: (p - 1) / (3m + p - 1); with B = I + W, a third of 1F1B's bubble time."""
    zb = simulate(build_schedule("zb_h1", ranks, microbatches))
    assert zb.bubble_fraction() == pytest.approx((ranks - 1) / (3 * microbatches + ranks - 1))
    costs = action_costs(forward=1, backward_input=1, backward_weight=1)  # B = 2
    one_f_one_b = simulate(build_schedule("1f1b", ranks, microbatches), costs)
    assert one_f_one_b.makespan - 3 * microbatches == pytest.approx(3 * (ranks - 1))
    assert simulate(build_schedule("zb_h1", ranks, microbatches), costs).makespan - 3 * microbatches == \
        pytest.approx(ranks - 1)


@pytest.mark.parametrize(("ranks", "microbatches"), [(2, 1), (3, 2), (4, 1), (4, 3), (8, 5)])
def test_zb_h1_with_fewer_microbatches_than_stages_still_beats_1f1b(ranks: int, microbatches: int) -> None:
    costs = action_costs()
    zb = simulate(build_schedule("zb_h1", ranks, microbatches), costs).bubble_fraction()
    assert (ranks - 1) / (3 * microbatches + ranks - 1) < zb
    assert zb < simulate(build_schedule("1f1b", ranks, microbatches), costs).bubble_fraction()


@pytest.mark.parametrize(("ranks", "microbatches"), [(1, 2), (2, 3), (2, 4), (2, 8), (3, 5), (4, 7), (4, 8),
                                                     (4, 12), (8, 16)])
def test_zbv_bubble_matches_formula(ranks: int, microbatches: int) -> None:
    """F = I = W = 1 per stage, 2 stages per rank, m >= 2p - 1: (p - 1) / (6m + p - 1)."""
    bubble = simulate(build_schedule("zbv", ranks, microbatches, stages_per_rank=2)).bubble_fraction()
    assert bubble == pytest.approx((ranks - 1) / (6 * microbatches + ranks - 1))


@pytest.mark.parametrize(("ranks", "microbatches"), [(1, 2), (2, 4), (2, 8), (3, 7), (4, 8), (4, 12), (8, 16)])
def test_dualpipev_bubble_is_zbv_bubble(ranks: int, microbatches: int) -> None:
    """F = I = W per stage, B = I + W, m >= 2p: ZB-V's (p - 1) / (6m + p - 1), though half the backwards are whole."""
    bubble = simulate(build_schedule("dualpipev", ranks, microbatches, stages_per_rank=2), action_costs())
    assert bubble.bubble_fraction() == pytest.approx((ranks - 1) / (6 * microbatches + ranks - 1))


# ------------------------------------------------------------------------------------------------ shapes and memory


CONFIGS = [(1, 1), (1, 3), (2, 1), (2, 3), (2, 4), (3, 2), (3, 3), (4, 3), (4, 4), (4, 9), (4, 10)]


def _runs(name: str, ranks: int, microbatches: int) -> bool:
    if name == "interleaved_1f1b":
        return microbatches >= ranks and microbatches % (microbatches // ranks) == 0
    if name == "dualpipev":
        return microbatches >= 2 * ranks
    return True


@pytest.mark.parametrize("name", sorted(GENERATORS))
@pytest.mark.parametrize(("ranks", "microbatches"), CONFIGS)
def test_every_schedule_validates(name: str, ranks: int, microbatches: int) -> None:
    if not _runs(name, ranks, microbatches):
        with pytest.raises(PipelineConfigError, match=name):
            _build(name, ranks, microbatches)
        return
    schedule = _build(name, ranks, microbatches)
    v = STAGES_PER_RANK[name]
    assert (schedule.num_ranks, schedule.stages_per_rank, schedule.num_stages) == (ranks, v, ranks * v)
    split = name in ("zb_h1", "zbv")
    for rank in range(ranks):
        expected = {f"{stage}{kind}{mb}" for stage in schedule.stages_of(rank) for mb in range(microbatches)
                    for kind in ("FIW" if split else "FB")}
        computes = [str(a) for a in schedule.compute_actions(rank)]
        if name == "dualpipev":  # a B, or an I and a W, per micro-batch and stage
            computes = [c.replace("I", "B") for c in computes if "W" not in c]
        assert sorted(computes) == sorted(expected)
    forward_only = _build(name, ranks, microbatches, forward_only=True)
    assert all(a.type in (ActionType.FORWARD, ActionType.SEND_F, ActionType.RECV_F)
               for actions in forward_only.actions for a in actions)
    assert [len(forward_only.compute_actions(rank)) for rank in range(ranks)] == [v * microbatches] * ranks


def test_a_short_last_batch_runs_dualpipev_as_zbv() -> None:
    """DualPipeV needs 2p micro-batches; a last batch with fewer trains with ZB-V's lists over the same V."""
    schedules = StepSchedules("dualpipev", 2, 4, 2, fixed_count=False)
    assert schedules(4, False).name == "dualpipev"
    short = schedules(3, False)
    assert (short.name, short.num_microbatches, short.stage_to_rank) == ("zbv", 3, (0, 1, 1, 0))


def test_placements() -> None:
    assert _build("interleaved_1f1b", 4, 8, 3).stage_to_rank == (0, 1, 2, 3) * 3  # round-robin
    zbv = _build("zbv", 4, 8)
    assert zbv.stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0)  # V
    assert [zbv.stages_of(rank) for rank in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]


def _peak(actions: list[Action], until: ActionType) -> int:
    """The most micro-batches a rank holds at once: +1 at each forward, -1 at each ``until`` (B, I or W)."""
    in_flight = peak = 0
    for action in actions:
        in_flight += {ActionType.FORWARD: 1, until: -1}.get(action.type, 0)
        peak = max(peak, in_flight)
    return peak


def test_1f1b_bounds_in_flight_microbatches() -> None:
    stages, microbatches = 4, 8
    one_f_one_b, gpipe = build_schedule("1f1b", stages, microbatches), build_schedule("gpipe", stages, microbatches)
    for stage in range(stages):
        assert _peak(one_f_one_b.compute_actions(stage), ActionType.BACKWARD) == stages - stage
        assert _peak(gpipe.compute_actions(stage), ActionType.BACKWARD) == microbatches


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 8), (4, 8), (4, 16), (8, 16)])
def test_zb_h1_memory_is_1f1b_memory(stages: int, microbatches: int) -> None:
    """Until its I a micro-batch holds its activations: p - s on stage s, as 1F1B; until its W, at most p anywhere."""
    schedule = build_schedule("zb_h1", stages, microbatches)
    for stage in range(stages):
        assert _peak(schedule.compute_actions(stage), ActionType.BACKWARD_INPUT) == stages - stage
        assert _peak(schedule.compute_actions(stage), ActionType.BACKWARD_WEIGHT) <= stages


@pytest.mark.parametrize(("ranks", "microbatches"), [(2, 3), (4, 8), (8, 16)])
def test_zbv_memory_is_1f1b_peak(ranks: int, microbatches: int) -> None:
    schedule = _build("zbv", ranks, microbatches)
    for rank in range(ranks):  # half-size stages: 2p of them weigh as much as 1F1B's p full ones on stage 0
        assert _peak(schedule.compute_actions(rank), ActionType.BACKWARD_WEIGHT) <= 2 * ranks


# --------------------------------------------------------------------------------------------------- lowering


def test_lowering_of_split_backward() -> None:
    actions = [str(a) for a in build_schedule("zb_h1", 3, 1).actions[1]]
    assert actions == ["1RECV_F0", "1F0", "1SEND_F0", "1RECV_B0", "1I0", "1SEND_B0", "1W0"]


def test_stages_on_one_rank_hand_over_without_transfers() -> None:
    zbv = _build("zbv", 2, 4)  # rank 1 holds stages 1 and 2; rank 0 holds 0 and 3
    transfers = {(a.stage, a.peer) for a in zbv.actions[1] if not a.is_compute}
    assert transfers == {(1, 0), (2, 3)}  # nothing between stages 1 and 2
    single = _build("interleaved_1f1b", 1, 3, 3)  # every stage on the one rank
    assert all(a.is_compute for a in single.actions[0])


def test_action_string_round_trip() -> None:
    for text in ["0F3", "1B2", "2I1", "2W1", "1SEND_F1", "2RECV_B10"]:
        assert str(Action.parse(text)) == text
    assert Action.parse("0I3").type is ActionType.BACKWARD_INPUT
    assert Action.parse("0W3").type is ActionType.BACKWARD_WEIGHT
    with pytest.raises(PipelineScheduleError, match="Cannot parse"):
        Action.parse("F3")


# --------------------------------------------------------------------------------------------------- validator


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
    run = execute(deadlock)  # the simulator's loop is the one that finds it
    assert not run.finished and run.unfinished == [0, 1]


def test_validator_reports_missing_and_unmatched_actions() -> None:
    compute = SCHEDULES["gpipe"](2, 2)
    lowered = add_communication(compute)
    broken = [list(lowered[0]), [a for a in lowered[1] if str(a) not in ("1B1", "1SEND_B1")]]
    with pytest.raises(PipelineScheduleError, match="never runs 1B1"):
        validate_schedule(broken, 2)
    unmatched = [list(lowered[0]), [a for a in lowered[1] if str(a) != "1RECV_F1"]]
    with pytest.raises(PipelineScheduleError, match="1F1 runs before its RECV_F") as info:
        validate_schedule(unmatched, 2)
    assert ">>1F1<<" in str(info.value)
    backward_first = [[Action.parse(c) for c in ["0B0", "0F0"]]]
    with pytest.raises(PipelineScheduleError, match="before the forward"):
        validate_schedule(backward_first, 1)


def test_validator_rejects_receives_out_of_send_order() -> None:
    """gloo would hand the first message on a channel to the first receive: the tensors of the wrong micro-batch."""
    lowered = add_communication(SCHEDULES["gpipe"](2, 2))
    assert [str(a) for a in lowered[1][:4]] == ["1RECV_F0", "1F0", "1RECV_F1", "1F1"]
    swapped = [list(lowered[0]), _lowered(["1RECV_F1 1RECV_F0 1F0 1F1"])[0] + list(lowered[1][4:])]
    with pytest.raises(PipelineScheduleError, match="in posting order") as info:
        validate_schedule(swapped, 2)
    message = str(info.value)
    assert "channel from rank 0 to rank 1" in message and "0SEND_F0 as message number 0" in message
    assert ">>1RECV_F1<<" in message and "stage 0  0F0" in message  # the grid, the broken cell marked
    # several stages per rank: stages 0 -> 1 and 2 -> 3 share the channel rank 0 -> rank 1 (0F0 0F1 2F0 2F1 sent)
    interleaved = [list(actions) for actions in _build("interleaved_1f1b", 2, 2).actions]
    assert [str(a) for a in interleaved[1][:7]] == ["1RECV_F0", "1F0", "1SEND_F0", "1RECV_F1", "1F1", "1SEND_F1",
                                                    "3RECV_F0"]
    interleaved[1].insert(3, interleaved[1].pop(6))  # 3RECV_F0 posted before 1RECV_F1
    with pytest.raises(PipelineScheduleError, match="in posting order") as info:
        validate_schedule(interleaved, 2)
    assert ">>3RECV_F0<<" in str(info.value) and "rank 1" in str(info.value)


def test_validator_checks_split_backwards() -> None:
    ok = _lowered(["0F0 0I0 0W0"])
    validate_schedule(ok, 1)
    with pytest.raises(PipelineScheduleError, match=r"0W0 runs before 0I0") as info:
        validate_schedule(_lowered(["0F0 0W0 0I0"]), 1)
    assert ">>0W0<<" in str(info.value)
    with pytest.raises(PipelineScheduleError, match="runs 0I0 but never 0W0"):
        validate_schedule(_lowered(["0F0 0I0"]), 1)
    with pytest.raises(PipelineScheduleError, match="already backwarded micro-batch 0"):
        validate_schedule(_lowered(["0F0 0B0 0I0 0W0"]), 1)
    with pytest.raises(PipelineScheduleError, match="0I0 runs before the forward"):
        validate_schedule(_lowered(["0I0 0F0 0W0"]), 1)
    with pytest.raises(PipelineScheduleError, match="backward in a forward-only"):
        validate_schedule(_lowered(["0F0 0I0 0W0"]), 1, forward_only=True)


def test_validator_checks_stages_sharing_a_rank() -> None:
    zbv = [list(actions) for actions in _build("zbv", 2, 1).actions]
    assert [str(a) for a in zbv[1]][:4] == ["1RECV_F0", "1F0", "2F0", "2SEND_F0"]
    early = [zbv[0], [zbv[1][0], zbv[1][2], zbv[1][1], *zbv[1][3:]]]  # 2F0 before 1F0, whose output it takes
    with pytest.raises(PipelineScheduleError, match=r"2F0 runs before 1F0, whose output it takes") as info:
        validate_schedule(early, 1)
    assert ">>2F0<<" in str(info.value) and "rank 1" in str(info.value)
    transfer = [zbv[0], [*zbv[1][:2], Action.parse("1SEND_F0"), Action.parse("2RECV_F0"), *zbv[1][2:]]]
    with pytest.raises(PipelineScheduleError, match="both live on rank 1: the runtime hands the value over"):
        validate_schedule(transfer, 1)
    with pytest.raises(PipelineScheduleError, match="Stage 0 has actions on rank 0 and on rank 1"):
        validate_schedule(_lowered(["0F0 0B0", "0F1 0B1"]), 2)
    with pytest.raises(PipelineScheduleError, match="different numbers of stages"):
        validate_schedule(_lowered(["0F0 0B0 2F0 2B0", "1F0 1B0"]), 1)


# ------------------------------------------------------------------------------------------------ configuration


def test_unknown_schedule_lists_valid_names() -> None:
    with pytest.raises(PipelineConfigError, match="1f1b, dualpipev, gpipe, interleaved_1f1b, naive, pipedream_2bw, zb_h1, zbv, or the path"):
        build_schedule("zero-bubble", 2, 4)


@pytest.mark.parametrize(
    ("ranks", "microbatches", "match"),
    [
        (4, 9, r"num_microbatches=9, num_ranks=4 \(rounds = 2, 9 % 2 = 1\)\. Use 8 or 10 micro-batches"),
        (4, 13, r"rounds = 3, 13 % 3 = 1\)\. Use 12 or 15 micro-batches"),
        (4, 3, r"at least num_ranks .*num_microbatches=3, num_ranks=4\. Use 4 micro-batches"),
    ],
)
def test_interleaved_rule_names_values_and_fix(ranks: int, microbatches: int, match: str) -> None:
    with pytest.raises(PipelineConfigError, match=match):
        build_schedule("interleaved_1f1b", ranks, microbatches, stages_per_rank=2)


def test_stages_per_rank_is_checked() -> None:
    with pytest.raises(PipelineConfigError, match="'interleaved_1f1b' needs at least 2 stages per rank"):
        build_schedule("interleaved_1f1b", 2, 4)
    with pytest.raises(PipelineConfigError, match="'1f1b' runs one stage per rank, got stages_per_rank=2"):
        build_schedule("1f1b", 2, 4, stages_per_rank=2)
    with pytest.raises(PipelineConfigError, match="'zbv' runs exactly 2 stages per rank"):
        build_schedule("zbv", 2, 4, stages_per_rank=3)
    with pytest.raises(PipelineConfigError, match="num_microbatches=0"):
        build_schedule("1f1b", 2, 0)


# ------------------------------------------------------------------------------------------------------------ CSV


@pytest.mark.parametrize(("name", "ranks", "microbatches"),
                         [("1f1b", 4, 8), ("zb_h1", 3, 5), ("interleaved_1f1b", 2, 4), ("zbv", 4, 8)])
def test_csv_round_trip(name: str, ranks: int, microbatches: int, tmp_path: Path) -> None:
    schedule = _build(name, ranks, microbatches)
    path = tmp_path / f"{name}.csv"
    schedule.to_csv(path)
    rows = path.read_text().splitlines()
    assert rows[0].split(",")[:2] == ["0F0", "0F1"] and len(rows) == ranks
    loaded = load_csv(path)
    assert (loaded.actions, loaded.stage_to_rank, loaded.num_microbatches) == \
        (schedule.actions, schedule.stage_to_rank, microbatches)
    by_name = build_schedule(str(path), ranks, microbatches)
    assert by_name.actions == schedule.actions and by_name.stages_per_rank == STAGES_PER_RANK[name]
    evaluation = build_schedule(str(path), ranks, microbatches, forward_only=True)
    assert evaluation.actions == _build(name, ranks, microbatches, forward_only=True).actions


def test_csv_errors(tmp_path: Path) -> None:
    path = tmp_path / "s.csv"
    _build("interleaved_1f1b", 2, 4).to_csv(path)
    with pytest.raises(PipelineConfigError, match=r"has 2 rows .* but num_ranks=4"):
        build_schedule(str(path), 4, 4)
    with pytest.raises(PipelineConfigError, match=r"micro-batches 0\.\.3 but num_microbatches=8"):
        build_schedule(str(path), 2, 8)
    with pytest.raises(PipelineConfigError, match=r"places 2 stage.* on each rank but stages_per_rank=1"):
        build_schedule(str(path), 2, 4, stages_per_rank=1)
    with pytest.raises(PipelineConfigError, match="does not exist"):
        build_schedule(str(tmp_path / "missing.csv"), 2, 4)
    path.write_text("0F0,0B0\n1F0\n")
    with pytest.raises(PipelineScheduleError, match="never runs 1B0") as info:
        load_csv(path)
    assert "stage 1  1RECV_F0" in str(info.value)


def _torch_stages(ranks: int, stage_indices: tuple[int, ...], num_stages: int) -> list[SimpleNamespace]:
    """What torch's schedule constructors read from their stages, without a process group or a model."""
    import torch

    return [SimpleNamespace(submod=torch.nn.Identity(), num_stages=num_stages, group_size=ranks, group_rank=0,
                            stage_index=index) for index in stage_indices]


@pytest.mark.parametrize(("ranks", "v", "microbatches"), [(2, 2, 4), (4, 2, 8), (4, 3, 10), (3, 2, 6)])
def test_torch_interleaved_csv_loads_and_matches_ours(ranks: int, v: int, microbatches: int,
                                                      tmp_path: Path) -> None:
    pipelining = pytest.importorskip("torch.distributed.pipelining.schedules")
    stages = _torch_stages(ranks, tuple(k * ranks for k in range(v)), ranks * v)
    theirs = pipelining.ScheduleInterleaved1F1B(stages, microbatches)
    ours = build_schedule("interleaved_1f1b", ranks, microbatches, stages_per_rank=v)
    for format in ("compute_only", "compute_comms"):  # torch's idle slots, transfers and FSDP actions included
        path = tmp_path / f"{format}.csv"
        theirs._dump_csv(str(path), format=format)
        loaded = build_schedule(str(path), ranks, microbatches)
        assert loaded.actions == ours.actions and loaded.stage_to_rank == ours.stage_to_rank
        assert simulate(loaded).bubble_fraction() == pytest.approx((ranks - 1) / (v * microbatches + ranks - 1))


@pytest.mark.parametrize(("torch_name", "ours_name", "ranks", "microbatches"),
                         [("ScheduleInterleavedZeroBubble", "zb_h1", 4, 8), ("ScheduleZBVZeroBubble", "zbv", 4, 8),
                          ("ScheduleZBVZeroBubble", "zbv", 3, 2)])
def test_torch_zero_bubble_csv_matches_ours(torch_name: str, ours_name: str, ranks: int, microbatches: int,
                                            tmp_path: Path) -> None:
    pipelining = pytest.importorskip("torch.distributed.pipelining.schedules")
    v = STAGES_PER_RANK[ours_name]
    indices = (0,) if v == 1 else (0, 2 * ranks - 1)
    theirs = getattr(pipelining, torch_name)(_torch_stages(ranks, indices, ranks * v), microbatches)
    theirs._dump_csv(str(tmp_path / "theirs.csv"), format="compute_only")
    assert load_csv(tmp_path / "theirs.csv").actions == _build(ours_name, ranks, microbatches).actions


@pytest.mark.parametrize(("name", "ranks", "microbatches"),
                         [("1f1b", 4, 8), ("interleaved_1f1b", 4, 8), ("zb_h1", 4, 8), ("zbv", 2, 4)])
def test_torch_loads_our_csv(name: str, ranks: int, microbatches: int, tmp_path: Path) -> None:
    """torch's own loader validates our file (its checker) and lowers it with the same stage placement."""
    pipelining = pytest.importorskip("torch.distributed.pipelining.schedules")
    ours = _build(name, ranks, microbatches)
    ours.to_csv(tmp_path / "ours.csv")
    runtime = pipelining._PipelineScheduleRuntime(
        _torch_stages(ranks, ours.stages_of(0), ours.num_stages), microbatches)
    runtime._load_csv(str(tmp_path / "ours.csv"))
    assert runtime.stage_index_to_group_rank == dict(enumerate(ours.stage_to_rank))


# ------------------------------------------------------------------------------------------------------ simulator


def test_timeline_rows_are_ranks() -> None:
    timeline = simulate(_build("interleaved_1f1b", 2, 4))
    assert timeline.num_ranks == 2 and timeline.num_stages == 4 and timeline.stages_per_rank == 2
    assert {(e.stage, e.rank) for e in timeline.events} == {(0, 0), (1, 1), (2, 0), (3, 1)}
    assert timeline.total(0, [FORWARD]) == timeline.stage_total(0, [FORWARD]) + timeline.stage_total(2, [FORWARD])
    assert timeline.makespan == 2 * (2 * 4 + 2 - 1)
    zb = simulate(build_schedule("zb_h1", 2, 2))
    assert zb.total(0, [BACKWARD_INPUT]) == zb.total(0, [BACKWARD_WEIGHT]) == 2
    assert zb.bubble_fraction(0) == pytest.approx(1 - 6 / zb.makespan)  # I and W count as compute
    assert TimelineEvent(3, Action.parse("3F0"), FORWARD, 0.0, 1.0).rank == 3  # rank defaults to the stage


def test_costs_per_kind() -> None:
    costs = action_costs(forward=1, backward_input=2, backward_weight=3)
    assert [costs(Action.parse(a)) for a in ("0F0", "0B0", "0I0", "0W0", "0SEND_F0")] == [1, 5, 2, 3, 0]
    timeline = simulate(build_schedule("zb_h1", 1, 2), costs)
    assert timeline.makespan == 12


def test_monitor_metrics_and_pictures_take_split_backwards_and_shared_ranks() -> None:
    pytest.importorskip("matplotlib")
    from lightning_pp.monitor.callback import draw_timelines, stage_metrics, summary_table, to_chrome_trace

    zb = simulate(build_schedule("zb_h1", 2, 2))
    metrics = stage_metrics(zb, zb, samples=8)
    assert metrics["pipeline/stage0/backward_input_ms"] == metrics["pipeline/stage0/backward_weight_ms"] == 2e3
    assert metrics["pipeline/rank1/bubble_fraction"] == metrics["pipeline/stage1/bubble_fraction"]
    assert "backward" in summary_table([metrics], (0, 1))
    interleaved_table = simulate(_build("interleaved_1f1b", 2, 4))
    table = summary_table([stage_metrics(interleaved_table, interleaved_table, samples=8)], (0, 1, 0, 1))
    assert "nan" not in table and len(table.splitlines()) == 3 + 4 + 1
    one_f_one_b = simulate(build_schedule("1f1b", 2, 2))
    keys = set(stage_metrics(one_f_one_b, one_f_one_b, samples=8))
    assert "pipeline/stage0/idle_ms" in keys and "pipeline/stage0/backward_input_ms" not in keys

    interleaved = simulate(_build("interleaved_1f1b", 2, 4))
    metrics = stage_metrics(interleaved, interleaved, samples=8)
    assert {f"pipeline/stage{s}/forward_ms" for s in range(4)} <= set(metrics)
    assert metrics["pipeline/rank0/bubble_fraction"] == pytest.approx(interleaved.bubble_fraction(0))
    assert "pipeline/stage0/bubble_fraction" not in metrics  # a rank's idle time is not split between its stages
    trace = to_chrome_trace(interleaved)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names == {"rank 0 (stages 0, 2)", "rank 1 (stages 1, 3)"}
    assert {e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1}
    import matplotlib.pyplot as plt

    plt.close(draw_timelines(interleaved, simulate(_build("zbv", 2, 4))))
    plt.close(draw_timelines(Timeline(2, [TimelineEvent(0, Action.parse("0W0"), BACKWARD_WEIGHT, 0.0, 1.0)])))


@pytest.mark.parametrize(("name", "ranks", "microbatches"), [("interleaved_1f1b", 4, 3), ("zbv", 2, 1),
                                                              ("1f1b", 2, 5)])
def test_forward_sweep_evaluates_any_count_on_a_schedules_placement(name: str, ranks: int,
                                                                    microbatches: int) -> None:
    """Evaluation batches a schedule's rule cannot split run as a forward sweep over the same stage placement."""
    from lightning_pp.schedule import forward_sweep

    placement = build_schedule(name, ranks, 2 * ranks, stages_per_rank=STAGES_PER_RANK.get(name, 1)).stage_to_rank
    sweep = forward_sweep(placement, microbatches)
    assert sweep.stage_to_rank == placement and sweep.num_microbatches == microbatches
    assert all(a.type is ActionType.FORWARD for actions in sweep.actions for a in actions if a.is_compute)
