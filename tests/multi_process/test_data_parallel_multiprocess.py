"""Multi-process tier: data parallel x pipeline parallel equals Lightning's DDP with as many replicas (fp32, tight).

The reference is plain Lightning ``strategy="ddp"`` with one process per replica, not one device: Lightning's training
sampler (a ``DistributedSampler``, injected for DDP and for a pipeline with replicas alike) shuffles across replicas,
so DDP fixes which samples each replica sees and in which order. DDP run twice gives identical parameters (checked),
so one DDP run is the reference. Compared: the weights after training (SGD models, element-wise, the tolerances of
`support`), everything rank 0 logged, every rank's ``callback_metrics`` and batches (a pipeline rank against
the DDP rank of its replica), and the saved checkpoints.

The data: 32 samples in batches of 8, so each of 2 replicas runs 2 steps per epoch; 2 epochs are 4 optimizer steps.
The jobs are few and shared by the tests (module-scoped fixtures): process start-up dominates on a small machine.
The single-process tests are in ``single_process/test_data_parallel.py``.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from _launch import LaunchTimeoutError, RankResult, launch, launch_torchrun
from models import MLPClassifierSGD, fit
from support import (
    ATOL,
    RTOL,
    SCHEDULE_NAMES,
    assemble,
    assert_all_ended,
    assert_matches,
    assert_same_metrics,
    job_pids,
    prefixed,
)

from lightning_pp import PipelineLayout

REPLICAS, STAGES = 2, 2
EPOCHS = 2
# 3 does not divide a batch of 8: weighted micro-batch means; interleaved 1F1B (2 stages per rank) needs m >= p
MICROBATCHES = {"naive": 2, "gpipe": 3, "1f1b": 4, "interleaved_1f1b": 4, "zb_h1": 3, "dualpipev": 4,
                "auto": None}  # auto: chosen from measured costs
# a transfer times out after 5 s (as in test_failures); a rank stuck elsewhere ends 5 s later (the watcher's grace)
FAILURE_TIMEOUT_S = 5


def pipelined_replicas(model: str, schedule: str, **kwargs: Any) -> dict[str, Any]:
    """A `train` run of ``EPOCHS`` epochs, pipelined into ``STAGES`` stages (the world makes the replicas)."""
    return {"scenario": "train", "kwargs": {
        "model": model, "max_steps": -1, "max_epochs": EPOCHS, "schedule": schedule,
        "microbatches": MICROBATCHES[schedule], "pipeline_parallel_size": STAGES, "trainer": {"record_batches": True},
        **kwargs}}


def ddp(model: str, **kwargs: Any) -> dict[str, Any]:
    """The same run under Lightning's DDP, one replica per process."""
    return {"scenario": "train_ddp", "kwargs": {"model": model, "max_steps": -1, "max_epochs": EPOCHS,
                                                "trainer": {"record_batches": True}, **kwargs}}


@dataclass
class Job:
    """A launched job's ranks, or why it could not run (raised by every test that needs it)."""

    ranks: list[RankResult] | None
    error: BaseException | None = None

    def get(self) -> list[RankResult]:
        if self.ranks is None:
            raise AssertionError(f"the shared job failed: {self.error!r}") from self.error
        return self.ranks


def run_job(world_size: int, runs: list[dict[str, Any]], timeout: float) -> Job:
    try:
        return Job(launch(world_size, runs, timeout=timeout))
    except Exception as error:  # every test that needs this job fails with it, the others still run
        return Job(None, error)


# ----------------------------------------------------------------------------------------------------- shared jobs

# the 4-rank pipelined job: (model, schedule), then the metrics module's run, then the clipped and accumulated one
PIPELINED_RUNS = [(model, schedule) for model in ("mlp_sgd", "tied_sgd")
                  for schedule in [*SCHEDULE_NAMES, "interleaved_1f1b", "zb_h1", "dualpipev", "auto"]]
METRICS_RUN, CLIPPED_RUN = len(PIPELINED_RUNS), len(PIPELINED_RUNS) + 1
# clipped by the norm of the whole model's averaged gradients (the tied weight counted once), 2 batches per step
CLIPPED = {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm", "accumulate_grad_batches": 2}
# data_parallel_mode="fsdp" (blocks sharded over the replicas): (model, schedule, trainer options); the first saves a
# full checkpoint, the second a sharded one
FSDP_RUNS = [("mlp_sgd", "1f1b", {}), ("mlp_sgd", "gpipe", {}), ("tied_sgd", "zb_h1", {}),
             ("tied_modules_sgd", "interleaved_1f1b", {}), ("tied_modules_sgd", "1f1b", CLIPPED),
             ("tied_modules_sgd", "dualpipev", {}), ("mlp_sgd", "auto", {})]
# the weights outside the blocks that data_parallel_mode="fsdp" shards (the rest stay whole where used): all of the
# MLP's; of the tied models, the norm, and the tied projection where each end reads it in a module's forward (not where
# the head reads `self.inp.weight` in training_step)
SHARDED_OUTSIDE = {"mlp_sgd": {"inp.weight", "inp.bias", "head.weight", "head.bias"},
                   "tied_sgd": {"norm.weight", "norm.bias"},
                   "tied_modules_sgd": {"inp.weight", "inp.bias", "norm.weight", "norm.bias"}}


def sharded_outside(model: str, schedule: str) -> set[str]:
    """The weights outside the blocks `SHARDED_OUTSIDE` names, but for DualPipeV's V, whose rank 0 holds the first
    and the last stage: there the tied projection is read by two modules of one rank (stays whole), the norm still
    by one; the middle stages hold none."""
    return {"norm.weight", "norm.bias"} if (model, schedule) == ("tied_modules_sgd", "dualpipev") \
        else SHARDED_OUTSIDE[model]
FIRST_FSDP_RUN = CLIPPED_RUN + 1
# pairs of runs that differ only in data_parallel ("ddp", "fsdp"): a meta build split unevenly, each rank seeded
# differently, fp16 with a gradient scaler and value clipping; a fit then validate (a later run on the module)
PAIRED = {"model": "mlp_sgd", "schedule": "1f1b", "microbatches": 4, "pipeline_parallel_size": STAGES,
          "balance": [2, 6], "fp16_scaler": True, "seed_per_rank": True,
          "trainer": {"meta": True, "gradient_clip_val": 0.05, "gradient_clip_algorithm": "value",
                      "record_weight_dtypes": True}}
FIRST_PAIRED_RUN = FIRST_FSDP_RUN + len(FSDP_RUNS)
DDP_RUNS = {"mlp_sgd": 0, "tied_sgd": 1, "synced_metrics": 2, "clipped": 3}  # run -> index in the DDP job
DDP_AGAIN, DDP_RESUMED = 4, 5  # mlp_sgd once more (determinism); resumed from its own checkpoint for one epoch


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dp_checkpoints")


@pytest.fixture(scope="module")
def ddp_job(checkpoints: Path) -> Job:
    """Lightning's DDP on 2 processes: the reference of every comparison, and a checkpoint plain DDP saves."""
    runs = [ddp("mlp_sgd", save_to=str(checkpoints / "ddp.ckpt")), ddp("tied_sgd"), ddp("synced_metrics"),
            ddp("tied_sgd", trainer={"record_batches": True, **CLIPPED}),
            ddp("mlp_sgd"), ddp("mlp_sgd", max_epochs=EPOCHS + 1, ckpt_path=str(checkpoints / "ddp.ckpt"))]
    assert [runs[i]["kwargs"]["model"] for i in DDP_RUNS.values()] == ["mlp_sgd", "tied_sgd", "synced_metrics",
                                                                      "tied_sgd"]
    return run_job(REPLICAS, runs, timeout=150)


@pytest.fixture(scope="module")
def pipelined_job(checkpoints: Path) -> Job:
    """4 processes as 2 replicas x 2 stages: both SGD models on every schedule (for the MLP, 1f1b saves a full
    checkpoint and gpipe a sharded one), the metrics module, clipping with accumulation, and `FSDP_RUNS`, in one
    launch."""
    runs = []
    for model, schedule in PIPELINED_RUNS:
        extra: dict[str, Any] = {}
        if (model, schedule) == ("mlp_sgd", "1f1b"):
            extra = {"save_to": str(checkpoints / "full.ckpt")}
        elif (model, schedule) == ("mlp_sgd", "gpipe"):
            extra = {"save_to": str(checkpoints / "sharded"), "state_dict_type": "sharded"}
        runs.append(pipelined_replicas(model, schedule, **extra))
    runs.append(pipelined_replicas("synced_metrics", "gpipe"))
    runs.append(pipelined_replicas("tied_sgd", "1f1b", trainer={"record_batches": True, **CLIPPED}))
    saves = [{"save_to": str(checkpoints / "fsdp_full.ckpt")},
             {"save_to": str(checkpoints / "fsdp_sharded"), "state_dict_type": "sharded"}]
    for index, (model, schedule, trainer) in enumerate(FSDP_RUNS):
        runs.append(pipelined_replicas(model, schedule, data_parallel_mode="fsdp",
                                       trainer={"record_batches": True, **trainer},
                                       **(saves[index] if index < len(saves) else {})))
    for data_parallel in ("ddp", "fsdp"):
        runs.append({"scenario": "train", "kwargs": {**PAIRED, "data_parallel_mode": data_parallel}})
    for data_parallel in ("ddp", "fsdp"):
        runs.append({"scenario": "fit_then_validate", "kwargs": {
            "model": "bn_head_validated", "microbatches": 2, "pipeline_parallel_size": STAGES,
            "data_parallel_mode": data_parallel}})
    for data_parallel in ("ddp", "fsdp"):
        runs.append({"scenario": "fit_twice", "kwargs": {
            "model": "tied_modules_sgd", "microbatches": 2, "pipeline_parallel_size": STAGES,
            "data_parallel_mode": data_parallel}})
    return run_job(REPLICAS * STAGES, runs, timeout=390)


@pytest.fixture(scope="module")
def failure_job() -> Job:
    """4 processes: a world that is not a multiple of the pipeline's length, then a user error on global rank 0 of
    a 2 x 2 job (its last run: the ranks end there)."""
    runs = [{"scenario": "expect_error", "kwargs": {"model": "mlp_sgd", "pipeline_parallel_size": 3}},
            {"scenario": "train", "kwargs": {"model": "fails_on_rank_zero", "pipeline_parallel_size": STAGES,
                                             "schedule": "1f1b", "microbatches": 2, "timeout": FAILURE_TIMEOUT_S}}]
    return run_job(REPLICAS * STAGES, runs, timeout=150)


# ----------------------------------------------------------------------------------------------------- comparisons


def ddp_reference(ranks: list[RankResult], index: int) -> dict[str, Any]:
    """DDP rank 0's weights and logged history (every DDP rank holds the same weights: checked)."""
    for rank in ranks:
        assert index not in rank.errors, rank.errors[index]["traceback"]
    state = ranks[0].results[index]["state"]
    for rank in ranks[1:]:
        for name, value in rank.results[index]["state"].items():
            assert torch.equal(value, state[name]), f"DDP replicas differ in {name}"
    return {"state": state, "history": ranks[0].results[index]["history"]}


def assert_layout(ranks: list[RankResult], index: int, label: str, environment: str | None = None) -> None:
    """Each rank says it holds stage ``rank // replicas`` of replica ``rank % replicas`` (the documented layout)."""
    layout = PipelineLayout(STAGES, REPLICAS)
    for global_rank, rank in enumerate(ranks):
        result = rank.results[index]
        assert result["global_rank"] == global_rank, label
        assert result["layout"] == {"stage": layout.stage_of(global_rank), "replica": layout.replica_of(global_rank),
                                    "num_stages": STAGES, "num_replicas": REPLICAS}, (label, global_rank)
        if environment is not None:
            assert result["environment"] == environment, (label, result["environment"])


def assert_replica_batches(ranks: list[RankResult], index: int, ddp_ranks: list[RankResult], ddp_index: int,
                           label: str) -> None:
    """Every stage of replica r loads exactly the batches DDP's rank r loads (its shard, in its order)."""
    for global_rank, rank in enumerate(ranks):
        replica = PipelineLayout(STAGES, REPLICAS).replica_of(global_rank)
        got, want = rank.results[index]["batches"], ddp_ranks[replica].results[ddp_index]["batches"]
        assert len(want) == 2 * EPOCHS, f"DDP rank {replica} loaded {len(want)} batches"
        assert len(got) == len(want), f"{label}: rank {global_rank} loaded {len(got)} batches, DDP {len(want)}"
        for step, (a, b) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(a, b), f"{label}: rank {global_rank} (replica {replica}) batch {step} is not DDP's"


def assert_like_ddp(ranks: list[RankResult], index: int, ddp_ranks: list[RankResult], ddp_index: int, label: str,
                    environment: str | None = None, tied: dict[str, str] | None = None) -> None:
    """A pipelined run against DDP: layout, batches per replica, weights (replicas bitwise equal), rank 0's log.
    ``tied``: names of the weight under another name in the pipelined model (not in DDP's): equal to it."""
    full, history = assemble(ranks, index)  # weights held by several ranks (replicas, shared) must agree exactly
    for alias, name in (tied or {}).items():
        assert torch.equal(full.pop(alias), full[name]), (label, alias, name)
    assert_layout(ranks, index, label, environment)
    assert_replica_batches(ranks, index, ddp_ranks, ddp_index, label)
    expected = ddp_reference(ddp_ranks, ddp_index)
    assert any("train_loss" in m for _, m in expected["history"]), "DDP logged no loss: nothing to compare"
    assert_matches(full, history, expected, label)


# ----------------------------------------------------------------------------------------------------- tests


def test_every_schedule_matches_ddp(ddp_job: Job, pipelined_job: Job) -> None:
    """2 replicas x 2 stages, naive / gpipe / 1f1b / interleaved_1f1b (2 stages per rank) / zb_h1 / dualpipev / what
    schedule="auto" chooses, the MLP and the tied model (a weight on the first and the last stage, summed over stages
    and averaged over replicas), against DDP on 2 processes."""
    ddp_ranks, ranks = ddp_job.get(), pipelined_job.get()
    first, again = ddp_reference(ddp_ranks, DDP_RUNS["mlp_sgd"]), ddp_reference(ddp_ranks, DDP_AGAIN)
    for name, value in first["state"].items():  # the reference is deterministic: one run serves
        assert torch.equal(value, again["state"][name]), f"two DDP runs differ in {name}"
    for index, (model, schedule) in enumerate(PIPELINED_RUNS):
        assert_like_ddp(ranks, index, ddp_ranks, DDP_RUNS[model], f"{model} {schedule} 2x2")


def test_global_norm_clipping_and_accumulation_match_ddp(ddp_job: Job, pipelined_job: Job) -> None:
    """Clipping by the norm of every gradient of the model once averaged over the replicas (the tied weight counted
    once, not once per stage), with 2 batches accumulated per optimizer step (gradients averaged once per step)."""
    assert_like_ddp(pipelined_job.get(), CLIPPED_RUN, ddp_job.get(), DDP_RUNS["clipped"], f"tied_sgd 1f1b {CLIPPED}")


def test_synced_logging_and_torchmetrics_match_ddp(ddp_job: Job, pipelined_job: Job) -> None:
    """``sync_dist=True`` means and sums (per step and per epoch), a max in validation, torchmetrics objects (macro
    accuracy, a sum of metrics, AUROC, a list state) and unsynced values, with the module's own shuffling loader:
    rank 0 logs what DDP's rank 0 logs, and each rank's ``callback_metrics`` and ``on_train_batch_end`` outputs are
    those of the DDP rank of its replica."""
    ddp_ranks, ranks = ddp_job.get(), pipelined_job.get()
    ddp_index = DDP_RUNS["synced_metrics"]
    label = "synced_metrics gpipe 2x2"
    assert_like_ddp(ranks, METRICS_RUN, ddp_ranks, ddp_index, label)
    history, want_history = ranks[0].results[METRICS_RUN]["history"], ddp_ranks[0].results[ddp_index]["history"]
    logged = {k for _, m in want_history for k in m}
    assert logged >= {"loss_synced_step", "loss_synced_epoch", "correct_synced_step", "correct_synced_epoch",
                      "val_loss_synced", "val_top_synced", "train_acc_step", "train_acc_epoch", "val_auroc",
                      "val_seen"}, logged
    assert [step for step, _ in history] == [step for step, _ in want_history], label
    for (step, got), (_, want) in zip(history, want_history, strict=True):
        assert_same_metrics(got, want, f"{label} step {step}", of="DDP's ")
    for global_rank, rank in enumerate(ranks):
        replica = PipelineLayout(STAGES, REPLICAS).replica_of(global_rank)
        got_result, want_result = rank.results[METRICS_RUN], ddp_ranks[replica].results[ddp_index]
        where = f"{label} rank {global_rank} (replica {replica})"
        assert_same_metrics(got_result["callback_metrics"], want_result["callback_metrics"], where, of="DDP's ")
        got_outputs, want_outputs = got_result["batch_end_outputs"], want_result["batch_end_outputs"]
        assert len(got_outputs) == len(want_outputs), where
        for got, want in zip(got_outputs, want_outputs, strict=True):
            assert got[:2] == want[:2] and torch.equal(got[2], want[2]), (where, got, want)


def test_blocks_sharded_over_the_replicas_with_fsdp2_match_ddp(ddp_job: Job, pipelined_job: Job,
                                                               checkpoints: Path) -> None:
    """``data_parallel_mode="fsdp"``: each replica holds half of each block weight (FSDP2 shards), and training equals
    DDP's under 1f1b, gpipe, zb_h1 (split backward), interleaved 1f1b, dualpipev and what schedule="auto" chooses, with
    a tied embedding/head, and with global-norm clipping over the shards and 2 accumulated batches per step. The full
    checkpoint gathers the shards into what DDP saves and plain Lightning loads."""
    ddp_ranks, ranks = ddp_job.get(), pipelined_job.get()
    for offset, (model, schedule, trainer) in enumerate(FSDP_RUNS):
        index, label = FIRST_FSDP_RUN + offset, f"fsdp {model} {schedule} {trainer} 2x2"
        reference = DDP_RUNS["clipped"] if trainer else DDP_RUNS[model.replace("tied_modules", "tied")]
        assert_like_ddp(ranks, index, ddp_ranks, reference, label,
                        tied={"head.weight": "inp.weight"} if model == "tied_modules_sgd" else None)
        full, _ = assemble(ranks, index)
        layout = PipelineLayout(STAGES, REPLICAS)
        for stage in range(STAGES):  # a sharded weight's shards: one per replica, together the whole
            numel = [ranks[layout.rank(stage, r)].results[index]["local_numel"] for r in range(REPLICAS)]
            blocks = [name for name in numel[0] if name.startswith(("layers.", "blocks.")) and "weight" in name]
            assert blocks, (label, sorted(numel[0]))
            outside = [name for name in numel[0] if not name.startswith(("layers.", "blocks."))]
            assert outside or schedule == "dualpipev", (label, sorted(numel[0]))
            for name in blocks + outside:
                sizes = [n[name] for n in numel]
                if name in blocks or name in sharded_outside(model, schedule):
                    assert sum(sizes) == full[name].numel() and max(sizes) < full[name].numel(), (label, name, sizes)
                else:
                    assert sizes == [full[name].numel()] * REPLICAS, (label, name, sizes)
    ours, theirs = (torch.load(checkpoints / "fsdp_full.ckpt", weights_only=True),
                    torch.load(checkpoints / "ddp.ckpt", weights_only=True))
    for name, value in theirs["state_dict"].items():
        torch.testing.assert_close(ours["state_dict"][name], value, rtol=RTOL, atol=ATOL,
                                   msg=prefixed(f"fsdp full checkpoint {name}"))
    assert_optimizer_states_match(ours["optimizer_states"], theirs["optimizer_states"])
    MLPClassifierSGD.load_from_checkpoint(checkpoints / "fsdp_full.ckpt", weights_only=True)


def test_fsdp2_trains_as_ddp_replicas_do_with_meta_build_fp16_value_clipping_and_a_later_run(pipelined_job: Job
                                                                                             ) -> None:
    """The same pipeline with ``data_parallel_mode="ddp"`` and ``"fsdp"``: built on the meta device and split unevenly
    ([2, 6] blocks: stages materialize and shard different numbers of blocks), each rank seeded differently (the
    blocks start from replica 0's values either way), fp16 with a gradient scaler (sharded and whole gradients unscaled
    alike) and clipping by value: equal weights, loss and scale. With fsdp, Lightning's fp16 is FSDP2's
    mixed-precision policy (the blocks' weights gathered in fp16, gradients reduced in fp32), which computes as autocast
    does on fp32 weights. Then ``trainer.validate`` after ``fit`` on the same module (the shards are kept, the gathered
    weights freed at the end of each loop): equal results; and a second ``fit`` of the tied model: equal weights."""
    ranks = pipelined_job.get()
    (ddp_state, ddp_history), (fsdp_state, fsdp_history) = (assemble(ranks, FIRST_PAIRED_RUN + i) for i in (0, 1))
    for name, value in ddp_state.items():
        torch.testing.assert_close(fsdp_state[name], value, rtol=RTOL, atol=ATOL, msg=prefixed(f"fsdp vs ddp {name}"))
        assert value.isfinite().all(), name
    for (step, got), (_, want) in zip(fsdp_history, ddp_history, strict=True):
        assert_same_metrics(got, want, f"fsdp vs ddp step {step}", of="ddp's ")
    scales = {rank.results[FIRST_PAIRED_RUN + i]["scale"] for rank in ranks for i in (0, 1)}
    assert len(scales) == 1, scales
    for rank in ranks:  # the blocks' Linear layers (the MLP's `layers`), as their forwards saw their weights
        for i, dtype in ((0, "torch.float32"), (1, "torch.float16")):
            recorded = rank.results[FIRST_PAIRED_RUN + i]["weight_dtypes"]
            seen = {name: d for name, d in recorded.items() if name.startswith("layers.")}
            assert seen and set(seen.values()) == {dtype}, (i, seen)
    validated = [[rank.results[FIRST_PAIRED_RUN + 2 + i]["validate"] for rank in ranks] for i in (0, 1)]
    for got, want in zip(validated[1], validated[0], strict=True):
        assert_same_metrics(got[0], want[0], "validate after fit, fsdp vs ddp", of="ddp's ")
    # a second fit of the same module: the weights outside the blocks stay placed and sharded, their gradients still
    # summed over the stages that share them
    (ddp_again, _), (fsdp_again, _) = (assemble(ranks, FIRST_PAIRED_RUN + 4 + i) for i in (0, 1))
    for name, value in ddp_again.items():
        torch.testing.assert_close(fsdp_again[name], value, rtol=RTOL, atol=ATOL, msg=prefixed(f"fit twice {name}"))


def test_checkpoints_equal_ddp_and_resume_at_other_replica_counts(ddp_job: Job, pipelined_job: Job,
                                                                  checkpoints: Path) -> None:
    """The full checkpoint of 2 replicas x 2 stages is what DDP saves (weights, optimizer state, progress) and loads
    in plain Lightning; the sharded one is torch's distributed checkpoint (one file per writing rank, nothing
    gathered). Each is resumed for one more epoch at
    another layout, against a reference that sees the same samples in the same order:

    - the full one on 1 replica x 2 stages, against one device resuming from the same file. With one replica the
      pipeline is promised to train as one device does, with the user's loader as it is (here unshuffled), whereas
      DDP on one process would inject a shuffling DistributedSampler: a different order, not a fair reference;
    - the sharded one on 2 replicas x 1 stage (``pipeline_parallel_size=1``, a different P), against DDP on 2
      processes resuming from the checkpoint DDP itself saved at the same point (equal to ours, checked above), with
      the same DistributedSampler;
    - the sharded one written with ``data_parallel_mode="fsdp"`` likewise, with fsdp again (the blocks sharded over the
      2 replicas of the one stage).
    """
    ddp_ranks, _ = ddp_job.get(), pipelined_job.get()
    full_path, sharded = checkpoints / "full.ckpt", checkpoints / "sharded"
    ours, theirs = torch.load(full_path, weights_only=True), torch.load(checkpoints / "ddp.ckpt", weights_only=True)
    assert sorted(ours["state_dict"]) == sorted(theirs["state_dict"])
    for name, value in theirs["state_dict"].items():
        torch.testing.assert_close(ours["state_dict"][name], value, rtol=RTOL, atol=ATOL,
                                   msg=prefixed(f"full checkpoint {name}"))
    for key in ("epoch", "global_step"):
        assert ours[key] == theirs[key], key
    assert_optimizer_states_match(ours["optimizer_states"], theirs["optimizer_states"])
    loaded = MLPClassifierSGD.load_from_checkpoint(full_path, weights_only=True)
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, ours["state_dict"][name]), name
    written = sorted(p.name for p in sharded.iterdir())
    assert written[0] == ".metadata" and written[-1] == "checkpoint.pt", written
    assert set(written[1:-1]) <= {f"__{rank}_0.distcp" for rank in range(REPLICAS * STAGES)}, written

    resume = [{"scenario": "train", "kwargs": {"model": "mlp_sgd", "max_steps": -1, "max_epochs": EPOCHS + 1,
                                               "schedule": "1f1b", "microbatches": 2, "ckpt_path": str(full_path)}},
              {"scenario": "train", "kwargs": {"model": "mlp_sgd", "max_steps": -1, "max_epochs": EPOCHS + 1,
                                               "pipeline_parallel_size": 1, "state_dict_type": "sharded",
                                               "ckpt_path": str(sharded)}},
              {"scenario": "train", "kwargs": {"model": "mlp_sgd", "max_steps": -1, "max_epochs": EPOCHS + 1,
                                               "pipeline_parallel_size": 1, "data_parallel_mode": "fsdp",
                                               "state_dict_type": "sharded",
                                               "ckpt_path": str(checkpoints / "fsdp_sharded")}}]
    ranks = launch(2, resume, timeout=180)

    resumed = fit("mlp_sgd", max_steps=-1, max_epochs=EPOCHS + 1, ckpt_path=str(full_path))
    one_device = resumed.result
    assert resumed.module.trainer.global_step == ours["global_step"] + 4  # one epoch of 4 batches on one replica
    full, history = assemble(ranks, 0)
    assert_matches(full, history, one_device, "full 2x2 checkpoint resumed on 1 replica x 2 stages")
    assert [r.results[0]["layout"]["num_replicas"] for r in ranks] == [1, 1]

    full, history = assemble(ranks, 1)
    assert [(r.results[1]["layout"]["stage"], r.results[1]["layout"]["replica"]) for r in ranks] == [(0, 0), (0, 1)]
    assert_matches(full, history, ddp_reference(ddp_ranks, DDP_RESUMED),
                   "sharded 2x2 checkpoint resumed on 2 replicas x 1 stage")
    full, history = assemble(ranks, 2)
    assert_matches(full, history, ddp_reference(ddp_ranks, DDP_RESUMED),
                   "sharded checkpoint of 2x2 with fsdp resumed on 2 replicas x 1 stage with fsdp")


def assert_optimizer_states_match(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> None:
    """Per optimizer: the same per-parameter state (SGD's momentum) under the same single-device numbering, the
    same hyper-parameters per group."""
    assert len(ours) == len(theirs)
    for got, want in zip(ours, theirs, strict=True):
        assert sorted(got["state"]) == sorted(want["state"])
        for index, state in want["state"].items():
            assert sorted(got["state"][index]) == sorted(state), index
            for key, value in state.items():
                torch.testing.assert_close(got["state"][index][key], value, rtol=RTOL, atol=ATOL,
                                           msg=prefixed(f"optimizer state {index} {key}"))
        assert got["param_groups"] == want["param_groups"]


def test_two_nodes_under_torchrun_match_ddp(ddp_job: Job) -> None:
    """Two "nodes" of 2 processes each, each started by its own torchrun (static rendezvous on 127.0.0.1), as
    Trainer(devices=2, num_nodes=2) with pipeline_parallel_size=2: the replicas of a stage share a node, the pipeline
    crosses nodes. Lightning must pick its TorchElastic environment; training equals DDP's on 2 processes."""
    ddp_ranks = ddp_job.get()
    ranks = launch_torchrun(2, 2, [pipelined_replicas("mlp_sgd", "1f1b")], timeout=200)
    for rank in ranks:
        assert rank.returncode == 0 and not rank.errors, rank.errors or rank.node_output[-3000:]
    assert_like_ddp(ranks, 0, ddp_ranks, DDP_RUNS["mlp_sgd"], "mlp_sgd 1f1b on 2 torchrun nodes",
                    environment="TorchElasticEnvironment")


def test_world_not_a_multiple_of_the_pipeline_is_a_config_error_on_every_rank(failure_job: Job) -> None:
    """4 processes, pipeline_parallel_size=3: every rank raises our error naming both numbers, before any collective
    (the process group was never created) and so without waiting for another rank."""
    for rank in failure_job.get():
        error = rank.results[0]
        assert error is not None, rank.output[-3000:]
        assert error["type"] == "PipelineConfigError", error
        assert "pipeline_parallel_size=3" in error["message"] and re.search(r"\b4\b", error["message"]), error
        assert error["process_group"] is False, "the process group was created before the error"


def test_failure_on_one_rank_ends_every_rank_of_every_replica(failure_job: Job) -> None:
    """The user's step fails on global rank 0 (stage 0 of replica 0) at step 1. Its pipeline peer (rank 2) waits
    for an activation and fails naming it; the ranks of replica 1, in the gradient all-reduce with replica 0, end
    too, naming a rank that failed (not only a socket's address, as gloo does). No rank hangs."""
    ranks = failure_job.get()
    assert ranks[0].errors[1]["type"] == "RuntimeError", ranks[0].errors
    assert "a bug in the user's training_step" in ranks[0].errors[1]["message"]
    peer = ranks[2].errors.get(1)
    assert peer is not None, ranks[2].output[-3000:]
    assert peer["type"] in ("PipelineTimeoutError", "PipelineCommError"), peer
    assert "peer stage 0" in peer["message"] and "rank 0)" in peer["message"], peer
    for global_rank, rank in enumerate(ranks):
        assert rank.returncode not in (0, None), f"rank {global_rank} ended with {rank.returncode}"
        said = (rank.errors[1]["message"] + "\n" if 1 in rank.errors else "") + rank.output
        named = {int(n) for n in re.findall(r"\brank (\d+)\b", said)} - {global_rank}
        assert global_rank == 0 or named, (f"rank {global_rank} ends without naming the rank that failed (or the "
                                           f"peer it lost):\n{said[-3000:]}")


def test_timed_out_torchrun_job_leaves_no_process(tmp_path: Path) -> None:
    """`launch_torchrun` keeps `launch`'s promise: the agents, the ranks they started (each in a session of its own)
    and the ranks' children, all ignoring SIGTERM, are gone when the launch times out. A short timeout usually fires
    once the ranks sleep; on a machine too busy for them to get there, try longer."""
    for timeout in (20, 60):
        for path in tmp_path.glob("*.pids"):
            path.unlink()
        start = time.monotonic()
        with pytest.raises(LaunchTimeoutError, match=f"did not finish within {timeout} s") as info:
            launch_torchrun(2, 1, [{"scenario": "ignore_sigterm_forever", "kwargs": {"pid_dir": str(tmp_path)}}],
                            timeout=timeout)
        assert time.monotonic() - start < timeout + 10
        pids = sorted({*info.value.pids, *job_pids(tmp_path)})
        assert_all_ended(pids)
        if len(job_pids(tmp_path)) == 2 * 2:  # both ranks had started their children and were ignoring SIGTERM
            return
    pytest.fail("the ranks never got as far as their sleep before the launch timed out")
