"""``schedule="pipedream_2bw"``: PipeDream-2BW's asynchronous 1F1B (never draining between batches, two weight versions,
each optimizer step applying the previous batch's gradient).

Single-process: the cuts of the stream (:mod:`lightning_pp.pipedream.stream`) compose into validated schedules, what
each step runs and which weights each pass reads follow the rule, the bubble, and the refused options. Multi-process
(gloo): training equals one device running the rule (``models.DelayedGradients``: W_t = W_{t-1} - lr grad
f_{t-1}(W_{t-2})), with validation and checkpoints draining the pipeline, on 2 and 4 ranks; a failure mid-batch ends
every rank.
"""

from __future__ import annotations

import re
from pathlib import Path

import models
import pytest
import torch
from _launch import launch
from support import assemble, assert_matches, assert_params_close, check_lifecycle, delayed_reference

from lightning_pp import PipelineConfigError, PipelineParallelStrategy
from lightning_pp.checkpoint.state import PENDING_GRADIENT_KEY
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


def _train(model: str, m: int, **kwargs: object) -> dict[str, object]:
    return {"scenario": "train", "kwargs": {"model": model, "schedule": "pipedream_2bw", "microbatches": m, **kwargs}}


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_trains_as_one_device_applying_the_previous_batchs_gradient(tmp_path: Path) -> None:
    """2 ranks: the MLP over 2 epochs (the stream crosses the epoch's end), the tied model (a weight on the first and
    the last stage), and a full checkpoint (drained) that plain Lightning loads; 4 ranks: the MLP, and 2 replicas of
    2 stages. SGD with momentum, weight decay and a step LR schedule: weights and every logged loss as the rule gives
    them."""
    saved = str(tmp_path / "2bw.ckpt")
    runs2 = [_train("mlp_sgd", 4, max_steps=6, save_to=saved), _train("tied_sgd", 2, max_steps=5)]
    # 4 ranks: one pipeline of 4; two replicas of a 2-stage pipeline (each averages its handed gradient with the
    # other's, as every schedule does: the replicas stay equal)
    runs4 = [_train("mlp_sgd", 4, max_steps=6), _train("mlp_sgd", 4, max_steps=4, pipeline_parallel_size=2),
             # weights frozen after step 3: step 4 still applies batch 3's gradient to them, averaged over the replicas
             _train("freezing_mlp_sgd", 4, max_steps=6, pipeline_parallel_size=2)]
    ranks2, ranks4 = launch(2, runs2, timeout=200), launch(4, runs4, timeout=200)
    for ranks, index, run in ((ranks2, 0, runs2[0]), (ranks2, 1, runs2[1]), (ranks4, 0, runs4[0])):
        kwargs = run["kwargs"]
        expected = delayed_reference(kwargs["model"], max_steps=kwargs["max_steps"])
        full, history = assemble(ranks, index)
        assert_matches(full, history, expected, f"pipedream_2bw {len(ranks)} ranks {kwargs}")
    for index, steps in ((1, 4), (2, 6)):  # every weight equal on the ranks holding it (both replicas)
        full, history = assemble(ranks4, index)
        assert len(history) == steps and all(torch.isfinite(value).all() for value in full.values())
    loaded = models.MLPClassifierSGD.load_from_checkpoint(saved, weights_only=True)
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, assemble(ranks2, 0)[0][name]), name


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_checkpoints_drain_and_hold_the_pending_gradient_so_a_resumed_run_goes_on_as_the_uninterrupted(
        tmp_path: Path) -> None:
    """2 ranks, 2 epochs of 4 steps. The MLP with a checkpoint at every epoch's end (ModelCheckpoint; it drains the
    stream there) trains as the rule says, and resumed from its first epoch's checkpoint it ends where it ended. The
    tied model (a weight on the first and the last stage) saved after a 1-epoch fit in the sharded format, resumed for
    the second epoch, ends where the 2-epoch fit ends (both to the last bit; the MLP's resumed on 4 stages within
    rounding). The full checkpoint still loads in plain Lightning."""
    every_epoch, sharded = tmp_path / "every_epoch", str(tmp_path / "sharded")
    first_epoch = str(every_epoch / "epoch=0-step=4.ckpt")
    frozen_epoch, frozen_first = tmp_path / "frozen", str(tmp_path / "frozen" / "epoch=0-step=4.ckpt")
    after_fit = str(tmp_path / "after_fit_and_validate.ckpt")
    runs = [_train("mlp_sgd", 4, max_steps=-1, max_epochs=2, trainer={"checkpoint_every_epoch": str(every_epoch)}),
            _train("mlp_sgd", 4, max_steps=-1, max_epochs=2, ckpt_path=first_epoch),
            # frozen after step 3, before the checkpoint: its pending gradient holds theirs, the resumed step applies it
            _train("freezing_mlp_sgd", 4, max_steps=-1, max_epochs=2,
                   trainer={"checkpoint_every_epoch": str(frozen_epoch)}),
            _train("freezing_mlp_sgd", 4, max_steps=-1, max_epochs=2, ckpt_path=frozen_first),
            # saved after fit and a validate run: it still holds the gradient fit left unapplied
            _train("freezing_mlp_sgd", 4, max_steps=-1, max_epochs=1, save_to=after_fit,
                   trainer={"validate_before_saving": True}),
            _train("freezing_mlp_sgd", 4, max_steps=-1, max_epochs=2, ckpt_path=after_fit),
            _train("tied_sgd", 2, max_steps=-1, max_epochs=2),
            _train("tied_sgd", 2, max_steps=-1, max_epochs=1, save_to=sharded, state_dict_type="sharded"),
            _train("tied_sgd", 2, max_steps=-1, max_epochs=2, ckpt_path=sharded, state_dict_type="sharded")]
    ranks = launch(2, runs, timeout=300)
    uninterrupted, history = assemble(ranks, 0)
    assert_matches(uninterrupted, history, delayed_reference("mlp_sgd", max_steps=-1, max_epochs=2),
                   "pipedream_2bw with a checkpoint at each epoch's end")
    assert_matches(*assemble(ranks, 2), delayed_reference("freezing_mlp_sgd", max_steps=-1, max_epochs=2),
                   "pipedream_2bw, weights frozen after step 3, a checkpoint at each epoch's end")
    for index, expected_index, label in (
            (1, 0, "mlp resumed from its first epoch's checkpoint"),
            (3, 2, "mlp frozen after step 3 resumed from its first epoch's checkpoint"),
            (5, 2, "mlp frozen after step 3 resumed from a checkpoint saved after fit and validate"),
            (8, 6, "tied model resumed from a sharded checkpoint saved after fit")):
        resumed, expected = assemble(ranks, index)[0], assemble(ranks, expected_index)[0]
        worst = max((resumed[n] - v).abs().max().item() for n, v in expected.items())
        print(f"{label}: max |param difference| {worst:.2e}")
        for name, value in expected.items():
            torch.testing.assert_close(resumed[name], value, rtol=0, atol=1e-7, msg=f"{label} {name}")
    # on another layout: 4 stages
    four = launch(4, [_train("mlp_sgd", 4, max_steps=-1, max_epochs=2, ckpt_path=first_epoch)], timeout=200)
    assert_params_close(assemble(four, 0)[0], uninterrupted, "2-stage checkpoint resumed on 4 stages")
    checkpoint = torch.load(first_epoch, weights_only=True)
    assert sorted(checkpoint[PENDING_GRADIENT_KEY]) == sorted(dict(models.MLPClassifierSGD().named_parameters()))
    loaded = models.MLPClassifierSGD.load_from_checkpoint(first_epoch, weights_only=True)
    assert sorted(loaded.state_dict()) == sorted(uninterrupted)


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_every_pass_reads_the_version_its_batchs_forward_used() -> None:
    """Recorded by the blocks themselves (their backward reads the weights back from autograd's saved tensors): on
    2 ranks, every forward of step t used the weights the step started with, every backward read the same weights
    as its forward (also the weights the layer held meanwhile), and on stage 0 some backwards ran in a later step, after
    the optimizer step had changed the weights (the kept copy): the last stage's never did."""
    ranks = launch(2, [_train("weight_versions", 4, max_steps=6)], timeout=150)
    for rank, result in enumerate(rank.results[0] for rank in ranks):
        log = result["samples"]
        assert log, ranks[rank].output[-2000:]
        for block in {entry[0] for entry in log}:
            start, forwards, read_after_update = None, {}, 0
            for _, kind, number, value, live in (entry for entry in log if entry[0] == block):
                if kind == "S":
                    start = value
                elif kind == "F":
                    assert value == start, (rank, block, number)  # the version the step started with
                    forwards[number] = value
                else:
                    assert value == forwards[number] == live, (rank, block, number)  # the forward's version
                    read_after_update += value != start  # a later step's: its weights had changed since
            assert len(forwards) == 6 * 4, (rank, block)
            assert (read_after_update > 0) == (rank == 0), (rank, block, read_after_update)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_validation_test_predict_and_metrics_follow_the_rule() -> None:
    """fit with validation every epoch (the pipeline drains before it), then validate, test and predict, on 2 ranks:
    every logged value, metric and prediction as one device applying the rule gives them."""
    check_lifecycle(2, [("pipedream_2bw", 2)], expected=delayed_reference("lifecycle", num_sanity_val_steps=2))


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_what_it_cannot_run_fails_alike_and_a_failure_mid_batch_ends_every_rank() -> None:
    """Accumulated batches are refused on every rank; then a user error on rank 0 at step 1, with step 0's backwards
    still in flight on the other stages, ends all 4 ranks with an error naming it."""
    runs = [{"scenario": "expect_error", "kwargs": {"model": "mlp_sgd", "schedule": "pipedream_2bw", "microbatches": 4,
                                                    "trainer": {"accumulate_grad_batches": 2}}},
            _train("fails_on_rank_zero", 4, timeout=5)]
    ranks = launch(4, runs, timeout=120)
    for rank in ranks:
        refused = rank.results[0]
        assert refused["type"] == "PipelineConfigError" and "accumulate_grad_batches=2" in refused["message"], refused
        assert 1 in rank.errors, rank.output[-2000:]
    assert "a bug in the user's training_step" in ranks[0].errors[1]["message"]
    for rank in ranks[1:]:
        assert "rank 0" in rank.errors[1]["message"] or "Pipeline" in rank.errors[1]["type"], rank.errors[1]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_sigterm_on_rank_zero_stops_every_rank_at_the_same_step() -> None:
    """Lightning's per-step SIGTERM broadcast (a barrier) is replaced by a word rank 0 sends at each step's start and
    every rank acts on at the next: a signal before step 3's start stops all 4 ranks at step 4's; without one, none."""
    ranks = launch(4, [{"scenario": "sigterm_words", "kwargs": {"signal_at": 3, "steps": 8}},
                       {"scenario": "sigterm_words", "kwargs": {"signal_at": 99, "steps": 5}}], timeout=60)
    for rank in ranks:
        assert not rank.errors, rank.errors
        assert rank.results == [4, None], rank.results


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_real_sigterm_on_rank_zero_ends_every_rank() -> None:
    """With Lightning's per-step broadcast replaced, its SIGTERM handler must not broadcast either (nobody would meet
    it): a real signal on rank 0 mid-stream stops it at its step's end (Lightning's own check), and the other rank,
    waiting for it in the next step, ends at once with an error naming it; nothing hangs."""
    ranks = launch(2, [{"scenario": "sigterm_during_fit",
                        "kwargs": {"model": "mlp_sgd", "step": 2, "schedule": "pipedream_2bw", "microbatches": 4,
                                   "timeout": 20}}], timeout=60)
    ended = [rank.results[0] if rank.results and rank.results[0] else rank.errors.get(0) for rank in ranks]
    assert ended[0]["type"] == "SIGTERMException", ended
    assert ended[1]["type"] in ("SIGTERMException", "PipelineCommError", "PipelineTimeoutError", "RuntimeError"), ended
    assert ended[1]["type"] == "SIGTERMException" or "rank 0" in ended[1]["message"], ended


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_hugging_face_models_train_as_the_rule_says() -> None:
    """Unmodified Hugging Face GPT-2 (SGD; tied embedding and head on the first and the last stage) and ViT, 2 ranks:
    the weights and every logged loss as one device applying the rule gives them."""
    names = ["hf_gpt2_sgd", "hf_vit"]
    ranks = launch(2, [{"scenario": "train", "kwargs": {"model": name, "schedule": "pipedream_2bw",
                                                        "microbatches": 2}} for name in names], timeout=240)
    for index, name in enumerate(names):
        assert_matches(*assemble(ranks, index), delayed_reference(name), f"pipedream_2bw {name}")
