"""``schedule="pipedream_2bw"``: PipeDream-2BW's asynchronous 1F1B (never draining between batches, two weight versions,
each optimizer step applying the previous batch's gradient).

Single-process: the cuts of the stream (:mod:`lightning_pp.pipedream.stream`) compose into validated schedules, what
each step runs and which weights each pass reads follow the rule, the bubble, and the refused options. Multi-process
(gloo): training equals one device running the rule (``models.DelayedGradients``: W_t = W_{t-1} - lr grad
f_{t-1}(W_{t-2})), with validation and checkpoints draining the pipeline, on 2 and 4 ranks; a failure mid-batch ends
every rank.
The single-process tests are in ``single_process/test_pipedream.py``.
"""

from __future__ import annotations

from pathlib import Path

import models
import pytest
import torch
from _launch import launch
from support import assemble, assert_matches, assert_params_close, check_lifecycle, delayed_reference

from lightning_pp.checkpoint.state import PENDING_GRADIENT_KEY

# ------------------------------------------------------------------------------------------------ multi-process


def _train(model: str, m: int, **kwargs: object) -> dict[str, object]:
    return {"scenario": "train", "kwargs": {"model": model, "schedule": "pipedream_2bw", "microbatches": m, **kwargs}}


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


@pytest.mark.timeout(400)
def test_validation_test_predict_and_metrics_follow_the_rule() -> None:
    """fit with validation every epoch (the pipeline drains before it), then validate, test and predict, on 2 ranks:
    every logged value, metric and prediction as one device applying the rule gives them."""
    check_lifecycle(2, [("pipedream_2bw", 2)], expected=delayed_reference("lifecycle", num_sanity_val_steps=2))


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


@pytest.mark.timeout(240)
def test_a_sigterm_on_rank_zero_stops_every_rank_at_the_same_step() -> None:
    """Lightning's per-step SIGTERM broadcast (a barrier) is replaced by a word rank 0 sends at each step's start and
    every rank acts on at the next: a signal before step 3's start stops all 4 ranks at step 4's; without one, none."""
    ranks = launch(4, [{"scenario": "sigterm_words", "kwargs": {"signal_at": 3, "steps": 8}},
                       {"scenario": "sigterm_words", "kwargs": {"signal_at": 99, "steps": 5}}], timeout=180)
    for rank in ranks:
        assert not rank.errors, rank.errors
        assert rank.results == [4, None], rank.results


@pytest.mark.timeout(240)
def test_a_real_sigterm_on_rank_zero_ends_every_rank() -> None:
    """With Lightning's per-step broadcast replaced, its SIGTERM handler must not broadcast either (nobody would meet
    it): a real signal on rank 0 mid-stream stops it at its step's end (Lightning's own check), and the other rank,
    waiting for it in the next step, ends at once with an error naming it; nothing hangs."""
    ranks = launch(2, [{"scenario": "sigterm_during_fit",
                        "kwargs": {"model": "mlp_sgd", "step": 2, "schedule": "pipedream_2bw", "microbatches": 4,
                                   "timeout": 20}}], timeout=180)
    ended = [rank.results[0] if rank.results and rank.results[0] else rank.errors.get(0) for rank in ranks]
    assert ended[0]["type"] == "SIGTERMException", ended
    assert ended[1]["type"] in ("SIGTERMException", "PipelineCommError", "PipelineTimeoutError", "RuntimeError"), ended
    assert ended[1]["type"] == "SIGTERMException" or "rank 0" in ended[1]["message"], ended


@pytest.mark.timeout(300)
def test_hugging_face_models_train_as_the_rule_says() -> None:
    """Unmodified Hugging Face GPT-2 (SGD; tied embedding and head on the first and the last stage) and ViT, 2 ranks:
    the weights and every logged loss as one device applying the rule gives them."""
    names = ["hf_gpt2_sgd", "hf_vit"]
    ranks = launch(2, [{"scenario": "train", "kwargs": {"model": name, "schedule": "pipedream_2bw",
                                                        "microbatches": 2}} for name in names], timeout=240)
    for index, name in enumerate(names):
        assert_matches(*assemble(ranks, index), delayed_reference(name), f"pipedream_2bw {name}")
