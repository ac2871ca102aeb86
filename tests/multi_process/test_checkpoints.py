"""Multi-process tier: full and sharded checkpoints, plain-Lightning loading, resuming across stage counts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _launch import launch
from models import MLPClassifier
from support import (
    assemble,
    assert_params_close,
    assert_params_match,
    assert_seen_alike,
    epochs_run,
    logged,
    single_device_state,
    stage_results,
)

from lightning_pp.parallel.nccl_emulation import ENV_VAR


def test_full_checkpoint_loads_in_plain_lightning_and_resumes_everywhere(tmp_path: Path) -> None:
    uninterrupted = single_device_state(max_epochs=2)
    single_ckpt = str(tmp_path / "single.ckpt")
    single_device_state(max_epochs=1, save_to=single_ckpt)
    two_stage_ckpt = str(tmp_path / "two.ckpt")

    ranks = launch(2, [epochs_run(schedule="1f1b", microbatches=2, max_epochs=1, save_to=two_stage_ckpt,
                                  trainer={}),
                       epochs_run(schedule="gpipe", microbatches=2, max_epochs=2, ckpt_path=single_ckpt,
                                  trainer={})],
                   timeout=200)
    pipelined_epoch1, _ = assemble(ranks, 0)
    assert_params_close(assemble(ranks, 1)[0], uninterrupted, "single-device checkpoint resumed on 2 stages")

    # the pipelined checkpoint is a plain Lightning checkpoint: weights_only load, one device
    checkpoint = torch.load(two_stage_ckpt, weights_only=True)
    assert sorted(checkpoint["state_dict"]) == sorted(pipelined_epoch1)
    loaded = MLPClassifier.load_from_checkpoint(two_stage_ckpt, weights_only=True)
    assert_params_close(loaded.state_dict(), pipelined_epoch1, "load_from_checkpoint")
    resumed_single = single_device_state(max_epochs=2, ckpt_path=two_stage_ckpt)
    assert_params_close(resumed_single, uninterrupted, "2-stage checkpoint resumed on one device")

    ranks = launch(4, [epochs_run(schedule="1f1b", microbatches=4, max_epochs=2, ckpt_path=two_stage_ckpt,
                                  trainer={}),
                       epochs_run(schedule="dualpipev", microbatches=8, max_epochs=2, ckpt_path=two_stage_ckpt,
                                  trainer={}),
                       epochs_run(schedule="auto", max_epochs=2, ckpt_path=two_stage_ckpt, trainer={})],
                   timeout=200)
    assert_params_close(assemble(ranks, 0)[0], uninterrupted, "2-stage checkpoint resumed on 4 stages")
    assert_params_close(assemble(ranks, 1)[0], uninterrupted, "2-stage checkpoint resumed on DualPipeV's 8 stages")
    assert_params_close(assemble(ranks, 2)[0], uninterrupted, "2-stage checkpoint resumed as schedule='auto' chose")


def test_sharded_checkpoint_resumes_on_other_stage_counts(tmp_path: Path) -> None:
    uninterrupted = single_device_state(max_epochs=2)
    four = str(tmp_path / "four_stages.ckpt")
    ranks = launch(4, [epochs_run(schedule="gpipe", microbatches=4, max_epochs=1, save_to=four,
                                  state_dict_type="sharded", trainer={})], timeout=200)
    # torch's distributed checkpoint: one file per rank (each stage writes its blocks), and the rest of the checkpoint
    assert sorted(p.name for p in Path(four).iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "checkpoint.pt"]
    ranks = launch(2, [epochs_run(schedule="1f1b", microbatches=2, max_epochs=2, ckpt_path=four,
                                  state_dict_type="sharded", trainer={}),
                       epochs_run(schedule="dualpipev", microbatches=4, max_epochs=2, ckpt_path=four,
                                  state_dict_type="sharded", trainer={})], timeout=200)
    assert_params_close(assemble(ranks, 0)[0], uninterrupted, "4-stage sharded checkpoint resumed on 2 stages")
    assert_params_close(assemble(ranks, 1)[0], uninterrupted, "4-stage sharded checkpoint resumed on DualPipeV's V")


def test_model_checkpoint_early_stopping_and_lr_monitor_decide_as_single_device(tmp_path: Path) -> None:
    import models

    expected = models.with_callbacks(str(tmp_path / "single"))
    assert expected["stopped_epoch"] > 0, "EarlyStopping should trigger in this configuration"
    ranks = launch(2, [{"scenario": "with_callbacks", "kwargs": {"dirpath": str(tmp_path / "pipe"),
                                                                  "schedule": "1f1b", "microbatches": 2}}],
                   timeout=300)
    results = stage_results(ranks, 0)
    for rank, got in enumerate(results):  # the best k, the stopping epoch, the files: one device's on every rank
        assert_seen_alike(got, expected, f"rank {rank}")
    assert logged(results[0]["history"], "lr-AdamW") == logged(expected["history"], "lr-AdamW")
    best = torch.load(tmp_path / "pipe" / expected["best_path"], weights_only=True)
    want = torch.load(tmp_path / "single" / expected["best_path"], weights_only=True)
    assert_params_match(best["state_dict"], want["state_dict"], "the best checkpoint")


def test_a_checkpoint_saved_by_hand_after_fit_gathers_on_a_gloo_group_of_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under NCCL's emulation (object collectives on a gloo group of their own, as on NCCL), ``save_checkpoint``
    after ``fit`` (whose teardown destroyed that group) still gathers, and writes sharded checkpoints, over a gloo
    group and never over the default group: on a GPU that would be NCCL, with every stage's pickled state in global
    rank 0's GPU memory. The saved state is the trained one."""
    monkeypatch.setenv(ENV_VAR, "1")  # the ranks inherit the environment
    full, sharded = str(tmp_path / "full.ckpt"), str(tmp_path / "sharded")
    ranks = launch(2, [{"scenario": "save_by_hand_after_fit",
                        "kwargs": {"save_to": path, "schedule": "1f1b", "microbatches": 2, "state_dict_type": form}}
                       for path, form in ((full, "full"), (sharded, "sharded"))], timeout=200)
    for rank in ranks:
        assert not rank.errors, rank.errors
        for run in rank.results:
            assert run["used"], "the checkpoint gathered nothing: the test no longer sees its collectives"
            assert all(group == "own" and backend == "gloo" for _, group, backend in run["used"]), run["used"]
    trained, _ = assemble(ranks, 0)
    assert_params_close(torch.load(full, weights_only=True)["state_dict"], trained, "full checkpoint saved after fit")
    assert (Path(sharded) / ".metadata").exists() and (Path(sharded) / "checkpoint.pt").exists()


# ------------------------------------------------------------------------------------------------ whole and matching


@pytest.fixture(scope="module")
def block_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Checkpoints of the MLP with 4 and with 6 alike blocks (tests/scenarios.py's ``mlp_blocks<n>``) after 2 steps
    on 2 stages, full and sharded: ``{"<model>_<format>": path}``."""
    folder = tmp_path_factory.mktemp("blocks")
    paths = {f"{model}_{form}": str(folder / f"{model}_{form}.ckpt")
             for model in ("mlp_blocks4", "mlp_blocks6") for form in ("full", "sharded")}
    runs = [{"scenario": "train", "kwargs": {"model": name.rpartition("_")[0], "max_steps": 2, "save_to": path,
                                             "state_dict_type": name.rpartition("_")[2], "schedule": "1f1b",
                                             "microbatches": 2}} for name, path in paths.items()]
    for rank in launch(2, runs, timeout=300):
        assert not rank.errors, rank.errors
    return paths


def _refusals(ranks: list, index: int) -> dict[str, str]:
    """Run ``index`` of an ``expect_error`` job: the error every rank raised, the same on each (its type and
    message)."""
    got = [rank.results[index] for rank in ranks]
    assert all(result is not None for result in got), [rank.errors.get(index) for rank in ranks]
    assert all(result == got[0] for result in got[1:]), f"the ranks disagree: {got}"
    return got[0]


def test_a_checkpoint_of_another_model_is_refused_alike_on_every_rank(block_checkpoints: dict[str, str]) -> None:
    """Loading is strict, as on one device: a 6-block model's checkpoint resumed into the 4-block one (it holds
    ``layers.4-5``, which that model lacks: before, the stages loaded what they had and went on) and the 4-block one's
    into the 6-block model (it lacks ``layers.4-5``: before, the last stage alone raised and the first was left
    waiting; sharded, a raw ``KeyError``) fail with the same ``PipelineCheckpointError`` on every rank, naming the
    blocks and ``strict_loading``. ``strict_loading = False`` loads what matches, as Lightning does."""
    runs = []
    for form in ("full", "sharded"):
        options = {"max_steps": 3, "state_dict_type": form, "schedule": "1f1b", "microbatches": 2}
        runs += [{"scenario": "expect_error", "kwargs": {"model": "mlp_blocks4",
                                                         "ckpt_path": block_checkpoints[f"mlp_blocks6_{form}"],
                                                         **options}},
                 {"scenario": "expect_error", "kwargs": {"model": "mlp_blocks6",
                                                         "ckpt_path": block_checkpoints[f"mlp_blocks4_{form}"],
                                                         **options}},
                 {"scenario": "expect_error", "kwargs": {"model": "mlp_blocks4_lenient",
                                                         "ckpt_path": block_checkpoints[f"mlp_blocks6_{form}"],
                                                         **options}}]
    ranks = launch(2, runs, timeout=300)
    for first in (0, 3):
        form = runs[first]["kwargs"]["state_dict_type"]
        extra, lacking, lenient = (_refusals(ranks, first + i) for i in range(3))
        for refusal, path in ((extra, block_checkpoints[f"mlp_blocks6_{form}"]),
                              (lacking, block_checkpoints[f"mlp_blocks4_{form}"])):
            assert refusal["type"] == "PipelineCheckpointError", (form, refusal)
            assert path in refusal["message"] and "strict_loading = False" in refusal["message"], refusal
        assert "4 entries this model does not have (layers.4-5): is it another model's?" in extra["message"], extra
        assert "lacks 4 entries of this model (layers.4-5)" in lacking["message"], lacking
        assert lenient["type"] == "none", (form, lenient)


def test_a_checkpoint_cut_short_or_missing_a_part_is_refused_naming_it(block_checkpoints: dict[str, str],
                                                                        tmp_path: Path) -> None:
    """A full checkpoint cut short, and a sharded one without a shard file, its ``.metadata`` or ``checkpoint.pt``,
    or with a shard cut short, fail on every rank alike with ``PipelineCheckpointError`` naming the file (before: a
    raw error from torch.load, a ``CheckpointException``, or a hang)."""
    import shutil

    full, sharded = Path(block_checkpoints["mlp_blocks4_full"]), Path(block_checkpoints["mlp_blocks4_sharded"])
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(full.read_bytes()[:full.stat().st_size // 2])
    damaged: list[tuple[Path, str, str]] = [(cut, "full", str(cut))]  # (checkpoint, format, what the error names)
    for name, damage in (("no_shard", "__1_0.distcp"), ("no_metadata", ".metadata"), ("no_state", "checkpoint.pt"),
                         ("cut_shard", "__0_0.distcp")):
        folder = tmp_path / f"{name}.ckpt"
        shutil.copytree(sharded, folder)
        if name == "cut_shard":
            shard = folder / damage
            shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])
            damaged.append((folder, "sharded", str(shard)))
        else:
            (folder / damage).unlink()
            damaged.append((folder, "sharded", damage if name != "no_metadata" else str(folder)))
    ranks = launch(2, [{"scenario": "expect_error", "kwargs": {"model": "mlp_blocks4", "ckpt_path": str(path),
                                                               "max_steps": 3, "state_dict_type": form}}
                       for path, form, _ in damaged], timeout=300)
    for index, (path, _, named) in enumerate(damaged):
        refusal = _refusals(ranks, index)
        assert refusal["type"] == "PipelineCheckpointError", (path.name, refusal)
        assert named in refusal["message"] and str(path) in refusal["message"], (path.name, refusal)


def test_a_rank_dying_while_writing_a_sharded_checkpoint_leaves_the_previous_one_whole(tmp_path: Path) -> None:
    """A sharded save writes beside its folder and is renamed into place once every rank has written. Rank 1 dies
    (``os._exit``) while the ranks write the third ``last.ckpt``, after rank 0 wrote its shard: ``last.ckpt`` is still
    the second, whole (before, rank 0's shard was the third's beside the second's step count), and resuming from it
    trains as one device does without a break; the next save removes the unfinished folder. Undisturbed,
    ``ModelCheckpoint`` replaces ``last.ckpt`` and removes older checkpoints through the renames, leaving nothing
    beside them."""
    whole, torn = tmp_path / "whole", tmp_path / "torn"
    options = {"schedule": "1f1b", "microbatches": 2}
    ranks = launch(2, [{"scenario": "die_while_saving_sharded",
                        "kwargs": {"dirpath": str(whole), "rank_to_kill": -1, "at_save": 0, **options}},
                       {"scenario": "die_while_saving_sharded",
                        "kwargs": {"dirpath": str(torn), "rank_to_kill": 1, "at_save": 3, **options}}], timeout=300)
    for rank in ranks:
        assert rank.results[0]["type"] == "none", rank.results[0]
    assert sorted(p.name for p in whole.iterdir()) == ["epoch=2-step=12.ckpt", "last.ckpt"]
    assert torch.load(whole / "last.ckpt" / "checkpoint.pt", weights_only=False)["epoch"] == 2
    assert ranks[1].returncode != 0 and ranks[1].results[1] is None, "rank 1 should have died saving"
    assert ranks[0].results[1]["type"] != "none", ranks[0].results[1]
    assert len(ranks[0].results[1]["last_saves"]) == 3, ranks[0].results[1]
    assert torch.load(torn / "last.ckpt" / "checkpoint.pt", weights_only=False)["epoch"] == 1

    uninterrupted = single_device_state(max_epochs=3)
    last = str(torn / "last.ckpt")
    ranks = launch(2, [epochs_run(max_epochs=3, ckpt_path=last, save_to=last, state_dict_type="sharded",
                                  trainer={}, **options)], timeout=200)
    assert_params_close(assemble(ranks, 0)[0], uninterrupted, "resumed from the last.ckpt a dead rank left")
    assert sorted(p.name for p in torn.iterdir()) == ["epoch=2-step=12.ckpt", "last.ckpt"]
