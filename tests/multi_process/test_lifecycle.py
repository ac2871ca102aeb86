"""Multi-process tier: validation, test, predict, logging and torchmetrics equal single-device Lightning."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _launch import launch
from models import fit, make_data
from support import (
    Result,
    assemble,
    assert_like,
    assert_params_match,
    check_all,
    check_lifecycle,
    pipelined,
    reference,
    summarized,
)


@pytest.mark.parametrize("world_size", [2, 4])
def test_validation_test_predict_and_metrics_match_single_device(world_size: int) -> None:
    # interleaved on 2 ranks: predict's batches of 5 break its rule (5 % (5 // 2) != 0) and run as a forward sweep
    extra = [("interleaved_1f1b", 8), ("dualpipev", 4)] if world_size == 2 else [("zbv", 8)]
    check_lifecycle(world_size, [("1f1b", world_size), ("gpipe", 3), *extra])


@pytest.mark.parametrize("world_size", [2, 4])
def test_module_written_without_pipelines_in_mind_matches_single_device(world_size: int) -> None:
    """Shuffled epochs, metrics of every kind (macro average, a sum of metrics, list states), and the extra entries
    of training_step's dict as on_train_batch_end sees them: all as on one device, on every rank."""
    want = reference("everyday", max_steps=-1, max_epochs=3)
    assert want["batch_end_outputs"], "the reference kept no outputs of on_train_batch_end"
    runs = [pipelined("everyday", max_steps=-1, max_epochs=3, schedule=s, microbatches=m)
            for s, m in [("1f1b", 4), ("gpipe", 3)]]

    def check(results: list[Result], label: str) -> None:
        assert_like(results, want, label)
        assert {k for _, m in results[0]["history"] for k in m} >= {
            "train_acc_step", "train_acc_epoch", "train_mixed_step", "val_auroc", "val_seen"}, label

    check_all(world_size, runs, [check] * len(runs), timeout=300)


def test_buffers_outside_the_sequential_are_saved_from_the_stage_that_updates_them(tmp_path: Path) -> None:
    """A BatchNorm head runs only on the last stage; the full checkpoint must hold its running statistics, and a
    validate after fit must evaluate with them (its set-up must not overwrite them with the first stage's)."""
    state = fit("bn_head").result["state"]
    validated = fit("bn_head_validated").module
    want = validated.trainer.validate(validated, make_data("bn_head_validated", seed=99), verbose=False)
    path = str(tmp_path / "bn.ckpt")
    ranks = launch(2, [{"scenario": "train", "kwargs": {"model": "bn_head", "max_steps": 4, "schedule": "1f1b",
                                                         "microbatches": 1, "save_to": path}},
                       *[{"scenario": "fit_then_validate", "kwargs": {"model": "bn_head_validated", "microbatches": 1,
                                                                      "outside_weights": where}}
                         for where in ("where_used", "everywhere")]], timeout=200)
    assert not any(rank.errors for rank in ranks), [rank.errors for rank in ranks]
    for rank in ranks:
        for index in (1, 2):
            assert rank.results[index]["validate"][0]["val_loss"] == pytest.approx(want[0]["val_loss"], abs=1e-6)
    saved = torch.load(path, weights_only=True)["state_dict"]
    assert int(saved["norm.num_batches_tracked"]) == 4
    assert_params_match(saved, state, "the checkpoint of bn_head")


def test_weights_held_by_every_stage_start_from_rank_zero() -> None:
    """Each rank seeded differently builds a different head and input layer; as DDP does, every stage starts from
    rank 0's, so after training they are still identical on every stage (``assemble`` checks; kept on every stage
    with ``outside_weights="everywhere"``)."""
    ranks = launch(2, [{"scenario": "train", "kwargs": {"model": "mlp", "microbatches": 2, "seed_per_rank": True,
                                                         "outside_weights": "everywhere"}}], timeout=120)
    full, _ = assemble(ranks, 0)
    assert {"inp.weight", "head.weight"} <= set(ranks[0].results[0]["state"]) & set(ranks[1].results[0]["state"])
    assert "layers.0.weight" in full and "layers.6.weight" in full


@pytest.mark.timeout(200)
def test_model_summary_counts_the_whole_model() -> None:
    """The summary Lightning prints when fit starts: every layer's parameters, the totals and the size are the whole
    model's (a tied embedding and head counted once), as on one device; a line gives each stage's own count."""
    want, _ = summarized(lambda **kwargs: fit("tied", max_steps=1, enable_model_summary=True, **kwargs))
    ranks = launch(2, [{"scenario": "model_summary", "kwargs": {"model": "tied"}}], timeout=150)
    got, messages = ranks[0].results[0]
    assert len(want) == 1 and got == want, (got, want)
    assert ranks[1].results[0][0] == [], "the summary is printed on global rank 0 only"
    per_stage = [message for message in messages if message.startswith("parameters per stage")]
    assert len(per_stage) == 1 and "stage 0: " in per_stage[0] and "stage 1: " in per_stage[0], messages
