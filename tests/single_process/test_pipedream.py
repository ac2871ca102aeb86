"""``schedule="pipedream_2bw"``: PipeDream-2BW's asynchronous 1F1B (never draining between batches, two weight versions,
each optimizer step applying the previous batch's gradient).

Single-process: the cuts of the stream (:mod:`lightning_pp.pipedream.stream`) compose into validated schedules, what
each step runs and which weights each pass reads follow the rule, the bubble, and the refused options. Multi-process
(gloo): training equals one device running the rule (``models.DelayedGradients``: W_t = W_{t-1} - lr grad
f_{t-1}(W_{t-2})), with validation and checkpoints draining the pipeline, on 2 and 4 ranks; a failure mid-batch ends
every rank.
The multi-process tests are in ``multi_process/test_pipedream_multiprocess.py``.
"""

from __future__ import annotations

import re

import pytest
import torch

from lightning_pp import PipelineConfigError, PipelineParallelStrategy
from lightning_pp.options import PipelineOptions
from lightning_pp.pipedream.stream import stream_cuts, stream_schedule
from lightning_pp.schedule import validate_schedule
from lightning_pp.schedule.actions import Action, ActionType
from lightning_pp.schedule.simulate import simulate

SHAPES = [(2, 2), (2, 4), (3, 3), (4, 4), (4, 7)]
F_B = {ActionType.FORWARD: 1.0, ActionType.BACKWARD: 2.0}  # F = I = W: B = 2 F


def _steps(p: int, m: int, steady: int) -> list[tuple[str, int]]:
    """The cuts a run takes: a first step, ``steady`` steady ones, then a drain (cut, batch)."""
    return [("first", 0)] + [("steady", t) for t in range(1, steady + 1)] + [("drain", steady)]


@pytest.mark.parametrize("across", [True, False])
@pytest.mark.parametrize(("p", "m"), SHAPES)
def test_cuts_compose_into_the_validated_stream(p: int, m: int, across: bool) -> None:
    """first + steady... + drain, rank by rank, is a valid schedule (every transfer matched, in order, no deadlock
    across the steps' boundaries); stage s leaves its last p - s - 1 backwards to the next step. The same for the
    cuts of NCCL (``sends_across_steps=False``)."""
    cuts = stream_cuts(p, m, across)
    for steady in (0, 1, 2):
        lists = [[] for _ in range(p)]  # type: list[list[Action]]
        for cut, batch in _steps(p, m, steady):
            own = range((batch % 2) * m, (batch % 2) * m + m)  # the step's batch; the other half: the batch before
            for rank, actions in enumerate(cuts.for_step(cut, batch).actions):
                # numbered apart per batch across the run, as the runtime keeps the two batches in flight apart
                lists[rank] += [Action(a.stage, a.type, a.microbatch % m + m * (batch - (a.microbatch not in own)))
                                for a in actions]
        validate_schedule(lists, m * (steady + 1))
    assert [cuts.leftovers(rank) for rank in range(p)] == [p - s - 1 for s in range(p)]


@pytest.mark.parametrize(("p", "m"), SHAPES)
def test_on_nccl_no_transfer_spans_a_steps_end(p: int, m: int) -> None:
    """Issue 37: on NCCL a send in flight across a step's end meets the step-end collectives and device synchronizes
    (a deadlock). Its cuts open each step with the sends the previous step's last backward made, so every receive
    of a step is matched by a send of the same step; the stream itself, rank by rank, is unchanged."""
    across, within = stream_cuts(p, m), stream_cuts(p, m, sends_across_steps=False)
    for cut, batch in _steps(p, m, 3):
        assert not within.for_step(cut, batch).in_flight, (cut, batch)
    assert any(across.for_step("steady", 1).in_flight)
    for rank in range(p):  # the same actions, the cut points moved
        assert [*across.lists["first"][rank], *across.lists["drain"][rank]] == [
            *within.lists["first"][rank], *within.lists["drain"][rank]]
    assert [within.leftovers(rank) for rank in range(p)] == [across.leftovers(rank) for rank in range(p)]


@pytest.mark.parametrize(("p", "m"), SHAPES)
def test_each_pass_reads_its_batchs_version(p: int, m: int) -> None:
    """Batch t's forwards all run in step t, its backwards in step t or (leftovers) step t + 1, never later: so its
    passes read W_{t-1}, live during step t and kept (copied before step t's optimizer step) during step t + 1. Two
    versions suffice; the last stage keeps none."""
    cuts = stream_cuts(p, m)
    for cut, batch in _steps(p, m, 3):
        schedule = cuts.for_step(cut, batch)
        for rank, actions in enumerate(schedule.actions):
            for action in (a for a in actions if a.is_compute):
                own = (batch % 2) * m <= action.microbatch < (batch % 2) * m + m
                if cut == "drain" or not own:  # a leftover: the previous batch's backward, on the kept version
                    assert action.type is ActionType.BACKWARD and rank < p - 1, (cut, batch, action)
                else:
                    assert cut != "drain", action
    steady = cuts.for_step("steady", 1)
    assert all(a.microbatch in range(m, 2 * m) or a.type is ActionType.BACKWARD
               for rank in steady.actions for a in rank if a.is_compute)


def test_the_stream_has_no_fill_or_drain_between_batches() -> None:
    """2 stages x 4 micro-batches, F = I = W (B = 2 F): 1F1B's bubble is 0.2; the stream of 10 batches 0.024 (its
    one fill and drain spread over them). A step cut out of it (the steady cut, the ranks meeting at its ends) takes
    13 units against 1F1B's 15."""
    one = simulate(stream_schedule(2, 4, 1), lambda a: F_B.get(a.type, 0.0))
    stream = simulate(stream_schedule(2, 4, 10), lambda a: F_B.get(a.type, 0.0))
    steady = simulate(stream_cuts(2, 4).for_step("steady", 1), lambda a: F_B.get(a.type, 0.0))
    assert one.bubble_fraction() == pytest.approx(0.2) and one.makespan == 15
    assert stream.bubble_fraction() == pytest.approx(1 / 41) and stream.makespan == 123
    assert steady.makespan == 13  # its first receive of a gradient sent in the previous step finds it there


def _gradients_across_an_update(params: list[torch.nn.Parameter], loss: object) -> float:
    """Max error of the gradients of ``loss()`` taken after an in-place update of ``params`` (the kept version read
    back, the way a leftover backward runs) against those at the weights of the forward."""
    from lightning_pp.pipedream.step import _Version

    for p in params:
        p.grad = None
    version = _Version(params)
    with torch.autograd.graph.saved_tensors_hooks(version.pack, _Version.unpack):
        out = loss()  # type: ignore[operator]
    before = [p.detach().clone() for p in params]
    version.keep()
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    with version.in_place():
        out.backward()
    got = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    with torch.no_grad():
        for p, value in zip(params, before, strict=True):
            p.copy_(value)
            p.grad = None
    loss().backward()  # type: ignore[operator]
    return max(float((a - p.grad).abs().max()) for a, p in zip(got, params, strict=True))  # type: ignore[operator]


def test_the_kept_version_is_read_back_wherever_the_weights_lie() -> None:
    """Parameters sharing one storage (a fused tensor's rows), one starting inside its storage, a zero-size tensor
    saved beside them, and a forward recomputed in backward (activation checkpointing inside the user's block): the
    gradients after an in-place update of the weights are those at the forward's weights."""
    x = torch.randn(3, 4)
    fused = torch.randn(3, 4, 4)
    q, k = torch.nn.Parameter(fused[1]), torch.nn.Parameter(fused[2])
    assert _gradients_across_an_update([q, k], lambda: ((x @ q) * (x @ k)).sum()) == 0.0
    inner = torch.nn.Parameter(torch.randn(8, 4)[2:])
    assert _gradients_across_an_update([inner], lambda: (x @ inner[:4].t()).pow(2).sum()) == 0.0
    w = torch.nn.Parameter(torch.randn(4, 4))
    empty = torch.zeros(0, dtype=torch.int64)
    assert _gradients_across_an_update([w], lambda: (x @ w).tanh().sum() + empty.sum()) == 0.0
    def recomputed() -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(lambda h: (h @ w).tanh(), x, use_reentrant=False).sum()

    assert _gradients_across_an_update([w], recomputed) == 0.0


def test_a_weight_frozen_since_its_forward_still_gets_its_leftover_gradient() -> None:
    """Frozen between a batch's forward and its leftover backward (a fine-tuning callback): autograd would skip the
    gradient; the leftover makes it trainable meanwhile, so the batch's gradient is whole (the rule applies it)."""
    from lightning_pp.pipedream.step import DelayedUpdates, _Version

    x, w = torch.randn(3, 4), torch.nn.Parameter(torch.randn(4, 4))
    delayed = DelayedUpdates(stream_cuts(2, 2), 0)
    version = _Version([w])
    with torch.autograd.graph.saved_tensors_hooks(version.pack, _Version.unpack):
        out = (x @ w).sum()
    version.keep()
    w.requires_grad_(False)
    with delayed._leftover([], version):
        out.backward()
    assert not w.requires_grad and w.grad is None
    torch.testing.assert_close(delayed.previous[w], x.sum(0)[:, None].expand(4, 4))


@pytest.mark.parametrize(("options", "match"), [
    ({"tensor_parallel_size": 2}, "with tensor_parallel_size > 1"),
    ({"data_parallel_mode": "fsdp"}, "with data_parallel_mode='fsdp'"),
    ({"activation_checkpointing": True}, "with activation_checkpointing"),
])
def test_options_it_cannot_run_are_refused(options: dict[str, object], match: str) -> None:
    with pytest.raises(PipelineConfigError, match=re.escape(match)):
        PipelineParallelStrategy(schedule="pipedream_2bw", **options)  # type: ignore[arg-type]


def test_fewer_microbatches_than_ranks_is_refused_before_any_collective() -> None:
    options = PipelineOptions(schedule="pipedream_2bw", microbatches=3)
    with pytest.raises(PipelineConfigError, match=r"microbatches=3, 4 ranks.*Pass microbatches=4 or more"):
        options.check_world(4, 4, 1)
    options.check_world(3, 3, 1)
    with pytest.raises(PipelineConfigError, match=r"on a pipeline of one rank"):
        PipelineOptions(schedule="pipedream_2bw").check_world(1, 1, 1)


class _FakeStream:
    """One CUDA stream: its events complete in order, once the host waits for the stream or for a later event."""

    def __init__(self) -> None:
        self.recorded = self.completed = self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1
        self.completed = self.recorded


class _FakeEvent:
    def __init__(self, stream: _FakeStream) -> None:
        self.stream, self.number = stream, -1

    def record(self) -> None:
        self.stream.recorded += 1
        self.number = self.stream.recorded

    def synchronize(self) -> None:
        self.stream.completed = max(self.stream.completed, self.number)

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert max(self.number, end.number) <= self.stream.completed, "an event read before it completed"
        return float(end.number - self.number)


def test_a_timed_step_waits_for_its_stream_never_the_whole_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding 3 of issue 37: a timed step's clock and the timed gradient sync called ``torch.cuda.synchronize()``,
    which also waits for NCCL's streams, where pipedream_2bw's last send of a step waits for the peer's next step (a
    deadlock with PipelineMonitor attached). They wait for the current stream now, and still read every event only
    once it has completed."""
    from lightning_pp.parallel.grads import PipelineGradients
    from lightning_pp.parallel.topology import PipelineLayout, StageGroups
    from lightning_pp.runtime.executor import step_clock

    def device_wide(device: object = None) -> None:
        raise AssertionError("torch.cuda.synchronize: waits for every stream, NCCL's too")

    stream = _FakeStream()
    monkeypatch.setattr(torch.cuda, "synchronize", device_wide)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: _FakeEvent(stream))
    cuda = torch.device("cuda", 0)
    clock = step_clock(cuda)
    stamps = [clock.now() for _ in range(3)]
    clock.finish()
    assert [clock.seconds(stamp) - clock.seconds(stamps[0]) for stamp in stamps] == pytest.approx([0, 1e-3, 2e-3])
    assert stream.synchronized == 2  # at the start (the reference event) and to read the events
    layout = PipelineLayout(1, 1)
    groups = StageGroups(layout, 0, None, (), None, [], 0)
    assert PipelineGradients([], groups, cuda).synchronize([], timed=True) >= 0.0
    assert stream.synchronized == 4  # before and after the collectives


# ------------------------------------------------------------------------------------------------ multi-process


