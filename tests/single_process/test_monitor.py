"""PipelineMonitor: the measured timeline follows the schedule on sleep-timed layers, TensorBoard tags and image, trace,
table; memory per stage (saved activations and parameters) and the meters behind it. No timing is asserted: how close
measured bubbles come to theory is benchmarks/bubbles.py's to say.
The multi-process tests are in ``multi_process/test_monitor_multiprocess.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_pp import PipelineConfigError, PipelineMonitor
from lightning_pp.monitor.callback import clock_offsets
from lightning_pp.monitor.memory import AllocatorPeakMeter, SavedTensorMeter, parameter_storages, stage_parameter_bytes


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
