"""PipelineMonitor: the measured timeline follows the schedule on sleep-timed layers, TensorBoard tags and image, trace,
table; memory per stage (saved activations and parameters) and the meters behind it. No timing is asserted: how close
measured bubbles come to theory is benchmarks/bubbles.py's to say.
The single-process tests are in ``single_process/test_monitor.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _launch import launch
from models import MODELS
from support import assert_runs_as_scheduled, schedule_for
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_pp.schedule.simulate import action_costs, simulate

STAGE_KEYS = ["forward_ms", "backward_ms", "comm_wait_ms", "comm_transfer_ms", "idle_ms", "framework_us_per_action",
              "bubble_fraction"]
RANK_KEYS = ["bubble_fraction", "grad_sync_ms"]
PIPELINE_KEYS = ["bubble_fraction", "predicted_bubble_fraction", "bubble_fraction_error", "step_ms",
                 "samples_per_sec"]


@pytest.mark.parametrize(("world_size", "microbatches"), [(2, 4), (4, 8)])
def test_monitor_logs_every_key_a_picture_and_a_trace_of_the_schedule(world_size: int, microbatches: int,
                                                                       tmp_path: Path) -> None:
    """GPipe and 1F1B on sleep-timed layers: every documented key logged for every measured step (the numbers'
    relations that hold by definition checked), a timeline picture every 2 steps, and a trace that follows the
    schedule (`assert_runs_as_scheduled`). How close the measured bubble comes to theory depends on the machine's
    load: benchmarks/bubbles.py measures it; no timing is asserted here."""
    schedules = ["gpipe", "1f1b"]
    runs = [{"scenario": "monitored", "kwargs": {"model": f"sleepy{world_size}", "schedule": s,
                                                  "microbatches": microbatches, "log_dir": str(tmp_path / s),
                                                  "max_steps": 3, "timeline_every_n_steps": 2}}
            for s in schedules]
    ranks = launch(world_size, runs, timeout=300)
    last = f"pipeline/stage{world_size - 1}/"
    for index, schedule in enumerate(schedules):
        assert not ranks[0].errors, ranks[0].errors
        history = ranks[0].results[index]["history"]
        assert [h["step"] for h in history] == [0, 1, 2]
        for h in history:
            assert 0 < h["pipeline/bubble_fraction"] < 1 and 0 < h["pipeline/predicted_bubble_fraction"] < 1, h
            assert h["pipeline/bubble_fraction_error"] == pytest.approx(
                h["pipeline/bubble_fraction"] - h["pipeline/predicted_bubble_fraction"])
            # m forwards and m backwards
            assert h[last + "framework_us_per_action"] == pytest.approx(1e3 * h[last + "idle_ms"] / (2 * microbatches))

        folder = tmp_path / schedule
        accumulator = EventAccumulator(str(next((folder / "tb").rglob("events.out.tfevents.*"))),
                                       size_guidance={"images": 0, "scalars": 0})
        accumulator.Reload()
        tags = set(accumulator.Tags()["scalars"])
        expected = {f"pipeline/{k}" for k in PIPELINE_KEYS}
        expected |= {f"pipeline/stage{s}/{k}" for s in range(world_size) for k in STAGE_KEYS}
        expected |= {f"pipeline/rank{r}/{k}" for r in range(world_size) for k in RANK_KEYS}
        assert expected <= tags, expected - tags
        assert accumulator.Tags()["images"] == ["pipeline/timeline"]
        assert len(accumulator.Images("pipeline/timeline")) == 2  # steps 0 and 2
        for step in (0, 2):
            trace = json.loads((folder / "traces" / f"pipeline_step{step}.json").read_text())
            names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
            assert names == {f"stage {s}" for s in range(world_size)}
            assert_runs_as_scheduled(trace, schedule_for(schedule, world_size, microbatches))
            assert (folder / "traces" / f"pipeline_step{step}.png").exists()


def test_interleaved_and_zero_bubble_schedules_run_as_scheduled(tmp_path: Path) -> None:
    """4 ranks x 8 micro-batches of layers whose forward, input gradient and weight gradient each sleep alike
    (F = I = W): each schedule runs as scheduled (`assert_runs_as_scheduled`), the zero-bubble ones with the weight
    gradients timed apart. Their theoretical bubbles, which the simulation of the schedules with these costs gives,
    fall from 1F1B's to DualPipeV's (2 stages per rank, each stage's F = I = W: ZB-V's). How close the measured
    bubbles come to them depends on the machine's load: benchmarks/bubbles.py measures it; no timing is asserted
    here (a dualpipev step once measured 0.110 against 0.059 on a busy machine)."""
    p, m, v = 4, 8, 2
    theory = {"1f1b": (p - 1) / (m + p - 1), "interleaved_1f1b": (p - 1) / (v * m + p - 1),
              "zb_h1": (p - 1) / (3 * m + p - 1), "dualpipev": (p - 1) / (6 * m + p - 1)}
    for schedule, bubble in theory.items():  # F = I = W = 1, B = I + W
        assert simulate(schedule_for(schedule, p, m), action_costs()).bubble_fraction() == pytest.approx(bubble)
    assert list(theory.values()) == sorted(theory.values(), reverse=True)
    runs = [{"scenario": "monitored", "kwargs": {"model": "split_sleepy8", "schedule": s, "microbatches": m,
                                                  "log_dir": str(tmp_path / s), "max_steps": 1,
                                                  "timeline_every_n_steps": 1}} for s in theory]
    ranks = launch(p, runs, timeout=300)
    for schedule in theory:
        assert not ranks[0].errors, ranks[0].errors
        trace = json.loads((tmp_path / schedule / "traces" / "pipeline_step0.json").read_text())
        assert_runs_as_scheduled(trace, schedule_for(schedule, p, m))
    for index in (2, 3):  # zb_h1, dualpipev
        (step,) = ranks[0].results[index]["history"]
        assert step["pipeline/stage1/backward_input_ms"] > 0 and step["pipeline/stage1/backward_weight_ms"] > 0


def test_summary_table_without_logger() -> None:
    ranks = launch(2, [{"scenario": "monitored", "kwargs": {"model": "sleepy2", "schedule": "1f1b",
                                                             "microbatches": 2, "log_dir": None}}], timeout=200)
    assert "PipelineMonitor: mean over 3 measured steps" in ranks[0].output
    assert "bubble" in ranks[0].output and "comm wait ms" in ranks[0].output and "grad sync ms" in ranks[0].output
    assert "PipelineMonitor: mean over" not in ranks[1].output


def test_rows_sent_to_rank_zero_are_reaped_while_training() -> None:
    """A gloo send reports completion only once waited for: each rank reaps its timed steps' rows two batch ends
    after sending them, so however many steps are timed at most two steps' sends (a size and a pickle each) stay
    held; waiting for them blocks no schedule, pipedream_2bw's (whose steps end at different times) included."""
    steps = 10
    runs = [{"scenario": "monitored", "kwargs": {"model": "mlp", "schedule": schedule, "microbatches": 2,
                                                  "log_dir": None, "max_steps": steps, "timeline_every_n_steps": 0}}
            for schedule in ("1f1b", "pipedream_2bw")]
    ranks = launch(2, runs, timeout=300)
    for index in range(len(runs)):
        for rank in ranks:
            assert index not in rank.errors, rank.errors[index]["traceback"]
        assert [h["step"] for h in ranks[0].results[index]["history"]] == list(range(steps))
        held = ranks[1].results[index]["held_sends"]
        assert len(held) == steps and max(held) <= 4, held


def test_memory_per_stage_is_logged_tabulated_and_follows_the_schedule(tmp_path: Path) -> None:
    """The tied LM (4 blocks of Linear + GELU, embedding tied to the head), 2 ranks, 8 micro-batches of one sample:
    every stage logs its peak of saved activations and its parameters. GPipe keeps all 8 micro-batches' activations
    on stage 0, 1F1B at most 2; checkpointing every block keeps only the blocks' inputs."""
    common = {"model": "tied", "microbatches": 8, "max_steps": 2, "timeline_every_n_steps": 0, "log_dir": None}
    configs: dict[str, dict[str, object]] = {
        "gpipe": {"schedule": "gpipe", "log_dir": str(tmp_path)},
        "checkpointed": {"schedule": "gpipe", "activation_checkpointing": True},
        "1f1b": {"schedule": "1f1b"},  # no logger: the summary table is printed
        "interleaved": {"schedule": "interleaved_1f1b"},  # 4 stages, 2 per rank
    }
    ranks = launch(2, [{"scenario": "monitored", "kwargs": {**common, **config}} for config in configs.values()],
                   timeout=300)
    assert not ranks[0].errors and not ranks[1].errors, (ranks[0].errors, ranks[1].errors)
    block_bytes = [sum(p.numel() * p.element_size() for p in block.parameters())
                   for block in MODELS["tied"].build().blocks]  # type: ignore[union-attr]
    peaks: dict[str, list[float]] = {}
    for index, name in enumerate(configs):
        history = ranks[0].results[index]["history"]
        stages = 4 if name == "interleaved" else 2
        assert [h["step"] for h in history] == [0, 1]
        for h in history:
            for stage in range(stages):
                rank = stage % 2
                outside = sum(b for key, b in ranks[rank].results[index]["param_bytes"].items()
                              if not key.startswith("blocks."))  # counted on the rank's first stage
                blocks = range(stage, stage + 1) if stages == 4 else range(2 * stage, 2 * stage + 2)
                expected = sum(block_bytes[i] for i in blocks) + (outside if stage == rank else 0)
                assert h[f"pipeline/stage{stage}/param_memory_mb"] * 2**20 == pytest.approx(expected), (name, stage)
                # AdamW: two moments of each parameter the stage holds, and a step count each
                state = ranks[rank].results[index]["optimizer_bytes"]
                held = {key for key in state if key.startswith(tuple(f"blocks.{i}." for i in blocks))
                        or (stage == rank and not key.startswith("blocks."))}
                assert h[f"pipeline/stage{stage}/optimizer_state_mb"] * 2**20 == pytest.approx(
                    sum(state[key] for key in held)), (name, stage)
                assert sum(state[key] for key in held) > 2 * expected
                assert h[f"pipeline/stage{stage}/peak_memory_mb"] > 0, (name, stage)
        assert history[0]["pipeline/stage0/peak_memory_mb"] == history[1]["pipeline/stage0/peak_memory_mb"]
        peaks[name] = [history[-1][f"pipeline/stage{s}/peak_memory_mb"] for s in range(stages)]
        print(f"{name}: peak saved activations per stage {[f'{p * 2**20:.0f} B' for p in peaks[name]]}")
    assert peaks["gpipe"][0] > 1.5 * peaks["checkpointed"][0]  # each block saves its input instead of 2 tensors
    assert peaks["1f1b"][0] < 0.5 * peaks["gpipe"][0]  # 2 micro-batches in flight instead of 8

    events = next((tmp_path / "tb").rglob("events.out.tfevents.*"))
    accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
    accumulator.Reload()
    expected_tags = {f"pipeline/stage{s}/{k}" for s in range(2)
                     for k in ("peak_memory_mb", "param_memory_mb", "optimizer_state_mb")}
    assert expected_tags <= set(accumulator.Tags()["scalars"])
    assert ranks[0].output.count("peak memory MiB | params MiB") == 3  # the runs without a logger
    assert "peak memory MiB" not in ranks[1].output


