"""PipelineMonitor: the measured timeline follows the schedule on sleep-timed layers, TensorBoard tags and image, trace,
table; memory per stage (saved activations and parameters) and the meters behind it. No timing is asserted: how close
measured bubbles come to theory is benchmarks/bubbles.py's to say."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _launch import launch
from models import MODELS
from support import assert_runs_as_scheduled, schedule_for
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from lightning_pp import PipelineConfigError, PipelineMonitor
from lightning_pp.monitor.callback import clock_offsets
from lightning_pp.monitor.memory import AllocatorPeakMeter, SavedTensorMeter, parameter_storages, stage_parameter_bytes
from lightning_pp.schedule.simulate import action_costs, simulate

STAGE_KEYS = ["forward_ms", "backward_ms", "comm_wait_ms", "comm_transfer_ms", "idle_ms", "framework_us_per_action",
              "bubble_fraction"]
RANK_KEYS = ["bubble_fraction", "grad_sync_ms"]
PIPELINE_KEYS = ["bubble_fraction", "predicted_bubble_fraction", "bubble_fraction_error", "step_ms",
                 "samples_per_sec"]


@pytest.mark.multiprocess
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


@pytest.mark.multiprocess
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


def test_idle_is_the_gaps_between_a_stages_actions_not_its_bubble() -> None:
    """Stage 1 starts late (waiting for its first input is communication), leaves 0.1 ms between its actions and ends
    4 ms before stage 0: idle counts the gaps only; the bubble counts everything in which it does not compute."""
    from lightning_pp.monitor.callback import stage_metrics
    from lightning_pp.schedule import Action
    from lightning_pp.schedule.simulate import BACKWARD, COMM_TRANSFER, COMM_WAIT, FORWARD, Timeline, TimelineEvent

    def event(stage: int, action: str, category: str, start_ms: float, end_ms: float) -> TimelineEvent:
        return TimelineEvent(stage, Action.parse(action), category, start_ms / 1e3, end_ms / 1e3)

    measured = Timeline(2, [
        event(0, "0F0", FORWARD, 0, 2), event(0, "0SEND_F0", COMM_TRANSFER, 2, 2.05),
        event(0, "0RECV_B0", COMM_WAIT, 2.05, 8.2), event(0, "0B0", BACKWARD, 8.2, 12.2),
        event(1, "1RECV_F0", COMM_WAIT, 1, 2.1), event(1, "1F0", FORWARD, 2.2, 4.2),  # 0.1 ms gap
        event(1, "1B0", BACKWARD, 4.2, 8.2),  # then 4 ms of tail until stage 0's B ends
    ])
    metrics = stage_metrics(measured, measured, samples=8)
    assert metrics["pipeline/stage0/idle_ms"] == pytest.approx(0.0, abs=1e-9)
    assert metrics["pipeline/stage1/idle_ms"] == pytest.approx(0.1)
    assert metrics["pipeline/stage1/framework_us_per_action"] == pytest.approx(50.0)  # 100 µs over F and B
    assert metrics["pipeline/stage1/bubble_fraction"] == pytest.approx(1 - 6 / 12.2)
    assert metrics["pipeline/stage1/comm_wait_ms"] == pytest.approx(1.1)


@pytest.mark.multiprocess
def test_summary_table_without_logger() -> None:
    ranks = launch(2, [{"scenario": "monitored", "kwargs": {"model": "sleepy2", "schedule": "1f1b",
                                                             "microbatches": 2, "log_dir": None}}], timeout=200)
    assert "PipelineMonitor: mean over 3 measured steps" in ranks[0].output
    assert "bubble" in ranks[0].output and "comm wait ms" in ranks[0].output and "grad sync ms" in ranks[0].output
    assert "PipelineMonitor: mean over" not in ranks[1].output


@pytest.mark.multiprocess
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


@pytest.mark.multiprocess
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


def test_saved_tensor_meter_counts_each_storage_once_without_parameters_until_freed() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    nbytes = 4 * 8 * 4  # every activation here is 4 x 8 float32
    stage = [0]
    meter = SavedTensorMeter(parameter_storages(linear), stage_of=lambda: stage[0])
    with meter.measure():
        h = linear(x)  # saves x and the weight (a view of a parameter: not counted)
        assert meter.live == nbytes
        product = (h * h).sum() + (h[:2] * h[2:]).sum()  # h saved 4 times, as itself and as views: once
        assert meter.live == 2 * nbytes
        stage[0] = 1
        out = h.tanh().sum() + (h @ linear.weight.t()).sum()  # tanh saves its output; stage 1 saves h too
        assert (meter.live, meter.stage_live) == (3 * nbytes, {0: 2 * nbytes, 1: 2 * nbytes})
    (product + out).backward()  # frees every saved tensor
    assert (meter.live, meter.peak) == (0, 3 * nbytes)
    assert meter.stage_live == {0: 0, 1: 0} and meter.stage_peaks == {0: 2 * nbytes, 1: 2 * nbytes}

    reference = torch.autograd.grad(linear(x).tanh().sum(), x)[0]
    with meter.measure():
        dropped = linear(x).tanh()  # a graph dropped without backward (tanh saves its output: no cycle may keep it)
        assert meter.live == 2 * nbytes
        del dropped
        assert meter.live == 0
        gradient = torch.autograd.grad(linear(x).tanh().sum(), x)[0]
        modified = linear(x).sigmoid()
        modified.mul_(2)
    assert torch.equal(gradient, reference) and meter.live == 2 * nbytes  # x and the sigmoid's output
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        modified.sum().backward()  # autograd's in-place check, which it skips under hooks, still happens


def test_stage_parameter_bytes_counts_blocks_per_stage_and_the_rest_once_on_the_first() -> None:
    embed = nn.Embedding(10, 4)
    blocks = [nn.Linear(4, 4), nn.Linear(4, 4, bias=False)]
    head = nn.Linear(4, 10, bias=False)
    head.weight = embed.weight  # tied
    module = nn.ModuleDict({"embed": embed, "blocks": nn.ModuleList(blocks), "head": head,
                            "norm": nn.LayerNorm(4)})
    assert stage_parameter_bytes(module, {2: [blocks[1]], 0: [blocks[0]]}) == {0: 4 * (20 + 40 + 8), 2: 4 * 16}


def test_parameter_bytes_of_a_sharded_weight_are_its_local_shard() -> None:
    """A DTensor weight (FSDP2's Shard(0), as on one of 4 replicas: 2 of its 8 rows here) counts the bytes this rank
    holds, not the whole tensor's (its ``numel``); its optimizer state likewise."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from lightning_pp.monitor.memory import optimizer_state_size

    created = not dist.is_initialized()  # (an earlier one-process fit in this process may have left its group)
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("data_parallel",))
        block = nn.Linear(4, 8, bias=False)
        block.weight = nn.Parameter(DTensor.from_local(torch.zeros(2, 4), mesh, [Shard(0)], shape=torch.Size([8, 4]),
                                                       stride=(4, 1), run_check=False))
        assert block.weight.numel() == 32  # the whole tensor's
        assert stage_parameter_bytes(block, {0: [block]}) == {0: 2 * 4 * 4}
        optimizer = torch.optim.SGD(block.parameters(), lr=0.1, momentum=0.9)
        optimizer.state[block.weight]["momentum_buffer"] = torch.zeros_like(block.weight)  # a DTensor too
        assert stage_parameter_bytes(block, {0: [block]}, size=optimizer_state_size([optimizer])) == {0: 2 * 4 * 4}
    finally:
        if created:
            dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_allocator_peak_meter_measures_above_the_start() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    kept = torch.empty(2**20, device=device)
    meter = AllocatorPeakMeter(device)
    with meter.measure():
        temporary = torch.empty(2**22, dtype=torch.uint8, device=device)
        del temporary
    assert meter.peak == 2**22 and kept.numel() == 2**20


def test_clocks_are_corrected_only_across_hosts() -> None:
    """Ranks on rank 0's host share its clock (the barrier's exit skew is not a clock offset); others are shifted."""
    readings = [("node0", 100.0), ("node0", 100.003), ("node1", 5.0), ("node1", 5.002)]
    assert clock_offsets(readings) == pytest.approx([0.0, 0.0, -95.0, -94.998])
