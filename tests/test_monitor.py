"""PipelineMonitor: measured bubble vs theory on sleep-timed layers, TensorBoard tags and image, trace, table."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from _launch import launch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_pp import PipelineConfigError, PipelineMonitor

STAGE_KEYS = ["forward_ms", "backward_ms", "comm_wait_ms", "comm_transfer_ms", "idle_ms", "bubble_fraction"]
RANK_KEYS = ["bubble_fraction", "grad_sync_ms"]
PIPELINE_KEYS = ["bubble_fraction", "predicted_bubble_fraction", "bubble_fraction_error", "step_ms",
                 "samples_per_sec"]


@pytest.mark.parametrize(("world_size", "microbatches"), [(2, 4), (4, 8)])
def test_measured_bubble_matches_theory_and_logs(world_size: int, microbatches: int, tmp_path: Path) -> None:
    """Bubble runs draw no pictures (rank 0 rendering a PNG would delay the next step); a third run draws them."""
    schedules = ["gpipe", "1f1b"]
    runs = [{"scenario": "monitored", "kwargs": {"model": f"sleepy{world_size}", "schedule": s,
                                                  "microbatches": microbatches, "log_dir": str(tmp_path / s),
                                                  "timeline_every_n_steps": 0}}
            for s in schedules]
    runs.append({"scenario": "monitored", "kwargs": {"model": f"sleepy{world_size}", "schedule": "1f1b",
                                                      "microbatches": microbatches, "log_dir": str(tmp_path / "pics"),
                                                      "max_steps": 3, "timeline_every_n_steps": 2}})
    ranks = launch(world_size, runs, timeout=300)
    theory = (world_size - 1) / (microbatches + world_size - 1)
    for index, schedule in enumerate(schedules):
        assert not ranks[0].errors, ranks[0].errors
        history = ranks[0].results[index]["history"]
        assert [h["step"] for h in history] == [0, 1, 2]
        measured = statistics.median(h["pipeline/bubble_fraction"] for h in history)
        predicted = statistics.median(h["pipeline/predicted_bubble_fraction"] for h in history)
        assert measured == pytest.approx(theory, abs=0.03), (schedule, measured, theory)
        assert predicted == pytest.approx(measured, abs=0.03), (schedule, predicted, measured)

        events = next((tmp_path / schedule / "tb").rglob("events.out.tfevents.*"))
        accumulator = EventAccumulator(str(events), size_guidance={"images": 0, "scalars": 0})
        accumulator.Reload()
        tags = set(accumulator.Tags()["scalars"])
        expected = {f"pipeline/{k}" for k in PIPELINE_KEYS}
        expected |= {f"pipeline/stage{s}/{k}" for s in range(world_size) for k in STAGE_KEYS}
        expected |= {f"pipeline/rank{r}/{k}" for r in range(world_size) for k in RANK_KEYS}
        assert expected <= tags, expected - tags

    events = next((tmp_path / "pics" / "tb").rglob("events.out.tfevents.*"))
    accumulator = EventAccumulator(str(events), size_guidance={"images": 0})
    accumulator.Reload()
    assert accumulator.Tags()["images"] == ["pipeline/timeline"]
    assert len(accumulator.Images("pipeline/timeline")) == 2  # steps 0 and 2
    trace = json.loads((tmp_path / "pics" / "traces" / "pipeline_step0.json").read_text())
    tracks = {e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert tracks == set(range(world_size))
    assert names == {f"stage {s}" for s in range(world_size)}
    assert (tmp_path / "pics" / "traces" / "pipeline_step2.png").exists()


def test_bubbles_of_interleaved_and_zero_bubble_schedules_match_theory() -> None:
    """4 ranks x 8 micro-batches of layers whose forward, input gradient and weight gradient each sleep alike
    (F = I = W): the measured bubble is the theory's, and both are below 1F1B's."""
    p, m, v = 4, 8, 2
    theory = {"1f1b": (p - 1) / (m + p - 1), "interleaved_1f1b": (p - 1) / (v * m + p - 1),
              "zb_h1": (p - 1) / (3 * m + p - 1)}
    runs = [{"scenario": "monitored", "kwargs": {"model": "split_sleepy8", "schedule": s, "microbatches": m,
                                                  "log_dir": None, "timeline_every_n_steps": 0}} for s in theory]
    ranks = launch(p, runs, timeout=300)
    measured = {}
    for index, schedule in enumerate(theory):
        assert not ranks[0].errors, ranks[0].errors
        history = ranks[0].results[index]["history"]
        measured[schedule] = statistics.median(h["pipeline/bubble_fraction"] for h in history)
        print(f"{schedule}: measured bubble {measured[schedule]:.3f}, theory {theory[schedule]:.3f}")
        assert measured[schedule] == pytest.approx(theory[schedule], abs=0.03), schedule
    assert measured["interleaved_1f1b"] < measured["1f1b"] and measured["zb_h1"] < measured["1f1b"]
    zb = ranks[0].results[2]["history"][-1]
    assert zb["pipeline/stage1/backward_input_ms"] > 0 and zb["pipeline/stage1/backward_weight_ms"] > 0


def test_summary_table_without_logger() -> None:
    ranks = launch(2, [{"scenario": "monitored", "kwargs": {"model": "sleepy2", "schedule": "1f1b",
                                                             "microbatches": 2, "log_dir": None}}], timeout=200)
    assert "PipelineMonitor: mean over 3 measured steps" in ranks[0].output
    assert "bubble" in ranks[0].output and "comm wait ms" in ranks[0].output and "grad sync ms" in ranks[0].output
    assert "PipelineMonitor: mean over" not in ranks[1].output


def test_monitor_arguments_are_checked() -> None:
    with pytest.raises(PipelineConfigError, match="multiple of logging_interval=10"):
        PipelineMonitor(logging_interval=10, timeline_every_n_steps=15)
    with pytest.raises(PipelineConfigError, match="logging_interval=0 must be at least 1"):
        PipelineMonitor(logging_interval=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"logging_interval": True}, r"logging_interval=True\): logging_interval must be an int .*got bool"),
        ({"logging_interval": 2.0}, r"logging_interval=2\.0\): logging_interval must be an int .*got float"),
        ({"logging_interval": "10"}, r"logging_interval='10'\): .*got str; e\.g\. logging_interval=10"),
        ({"logging_interval": -3}, r"logging_interval=-3 must be at least 1 step; e\.g\. logging_interval=10"),
        ({"timeline_every_n_steps": None}, r"timeline_every_n_steps=None\): .*got NoneType; .*0 for no pictures"),
        ({"timeline_every_n_steps": False}, r"timeline_every_n_steps=False\): .*got bool"),
        ({"timeline_every_n_steps": -10}, r"timeline_every_n_steps=-10 must be 0 or a multiple"),
        ({"trace_dir": 123}, r"trace_dir=123\): trace_dir must be a folder path \(str or os\.PathLike\) or None, "
                             r"got int; e\.g\. trace_dir=\"lightning_logs/pipeline_traces\""),
        ({"trace_dir": b"traces"}, r"trace_dir=b'traces'\): .*got bytes"),
    ],
)
def test_monitor_argument_types_are_checked(kwargs: dict[str, object], match: str) -> None:
    """Bad types fail in the constructor with our error (not a TypeError at the first measured step)."""
    with pytest.raises(PipelineConfigError, match=match):
        PipelineMonitor(**kwargs)  # type: ignore[arg-type]


def test_monitor_accepts_paths_and_turning_pictures_off(tmp_path: Path) -> None:
    class Folder:  # any os.PathLike, not only pathlib
        def __fspath__(self) -> str:
            return str(tmp_path / "traces")

    assert PipelineMonitor(trace_dir=Folder()).trace_dir == tmp_path / "traces"  # type: ignore[arg-type]
    assert PipelineMonitor(trace_dir=str(tmp_path)).trace_dir == tmp_path
    monitor = PipelineMonitor(logging_interval=5, timeline_every_n_steps=0, trace_dir=None)
    assert (monitor.logging_interval, monitor.timeline_every_n_steps, monitor.trace_dir) == (5, 0, None)
