"""Batches: micro-batches of any batch Lightning accepts (per-sample lists, dataclasses), and the same batch on every
stage of a pipeline, checked (issue 39, findings 1 and 2).
The single-process tests are in ``single_process/test_batches.py``."""

from __future__ import annotations

from _launch import launch
from support import check_all, like, pipelined

# ------------------------------------------------------------------------------------------------ 2 gloo ranks


def test_per_sample_lists_and_dataclasses_train_as_on_one_device() -> None:
    """A step dividing by ``len(batch["text"])`` and weighting each sample by its text, and a dataclass batch: the
    pipeline trains as one device does (`support.assert_like`: gradients, logged loss, weights)."""
    runs = [pipelined(model, schedule="1f1b", microbatches=4) for model in ("counts_texts", "reads_a_dataclass")]
    check_all(2, runs, [like(run["kwargs"]["model"]) for run in runs], timeout=200)


def test_stages_loading_different_batches_fail_on_every_rank() -> None:
    """A DistributedSampler over the whole world is refused before any step; a shuffle seeded by the rank fails at
    the first step on both stages; a rank with fewer batches fails both stages at its last one, and the job exits
    non-zero on every rank."""
    runs = [{"scenario": "expect_error", "kwargs": {"model": model, "microbatches": 2, "timeout": 30}}
            for model in ("samples_the_whole_world", "shuffles_by_rank")]
    runs.append({"scenario": "train", "kwargs": {"model": "fewer_on_rank_1", "microbatches": 2, "timeout": 30}})
    ranks = launch(2, runs, timeout=200)
    for rank_index, rank in enumerate(ranks):
        refused, shuffled = rank.results[0], rank.results[1]
        assert refused["type"] == "PipelineConfigError", refused
        assert (f"DistributedSampler has num_replicas=2, rank={rank_index} on global rank {rank_index}"
                in refused["message"]), refused
        assert "DistributedSampler(dataset, num_replicas=1, rank=0)" in refused["message"], refused
        assert shuffled["type"] == "PipelineBatchError", shuffled
        for said in ("loaded different batches at training_step of batch 0", "differ in their values",
                     f"This is stage {rank_index} (rank {rank_index})", "sampler RandomSampler with a generator of "
                     f"seed {rank_index}", "do not seed a shuffle"):
            assert said in shuffled["message"], (said, shuffled["message"])
        assert rank.returncode != 0, rank.output[-3000:]
        error = rank.errors[2]
        assert error["type"] == "PipelineBatchError", error
        assert ("at training_step of batch 2" in error["message"] and "how many batches the loader gives: on stage 1 "
                "it ends after this batch" in error["message"]), error["message"]
