"""Models larger than one device. One built on the meta device (``trainer.init_module(empty_init=True)``): each rank
gives storage to, and initializes, only what its stage holds (``lightning_pp.model.materialize``).

Single-process: initialization follows the model's own code (Hugging Face's ``_init_weights``, torch's
``reset_parameters``), tied weights stay tied, the values do not depend on which blocks a rank holds, the global random
state is untouched, and what nothing initializes is reported. Multi-process (2 gloo ranks): the memory a rank takes
before training (2 stages; 1 stage sharded over 2 replicas), an uninitialized weight on one stage failing every stage,
and sharding the module applies itself refused. Training equivalence of meta-built GPT-2 and nanoGPT against one
device: ``test_real_models_multiprocess.py``;
of blocks sharded with FSDP2 against DDP: ``test_data_parallel_multiprocess.py``.
The single-process tests are in ``single_process/test_large_models.py``.
"""

from __future__ import annotations

import pytest
from _launch import launch


@pytest.mark.timeout(300)
def test_each_rank_takes_memory_for_its_part_only_and_failures_reach_every_rank() -> None:
    """`models.Wide` (256 MiB of blocks) built on the meta device, on 2 stages, then on 1 stage with its blocks sharded
    over 2 replicas (``data_parallel_mode="fsdp"``, materialized block by block): each rank's peak memory grows by about
    its half before training (the whole model before this issue), and it holds half the blocks. A weight nothing
    initializes on the second stage only, FSDP applied over a mesh of the module's own, an optimizer built from a
    parameter list kept in ``__init__`` (meta tensors after a meta build), and two blocks sharing a weight under FSDP2
    fail every rank with our error, before any rank waits on a collective."""
    ranks = launch(2, [{"scenario": "meta_memory", "kwargs": {}},
                       {"scenario": "meta_memory", "kwargs": {"pipeline_parallel_size": 1,
                                                              "data_parallel_mode": "fsdp"}},
                       {"scenario": "expect_error", "kwargs": {"model": "gain_on_last_stage",
                                                               "trainer": {"meta": True}}},
                       {"scenario": "expect_error", "kwargs": {"model": "shards_over_its_own_mesh",
                                                               "pipeline_parallel_size": 1}},
                       {"scenario": "expect_error", "kwargs": {"model": "keeps_its_parameter_list",
                                                               "trainer": {"meta": True}}},
                       {"scenario": "expect_error", "kwargs": {"model": "blocks_share_a_weight",
                                                               "pipeline_parallel_size": 1,
                                                               "data_parallel_mode": "fsdp"}}], timeout=240)
    for rank, result in enumerate(ranks):
        assert not result.errors, result.errors
        *memory, uninitialized, own_sharding, stale_list, shared = result.results
        for label, seen in zip(("2 stages", "1 stage, blocks sharded over 2 replicas"), memory, strict=True):
            whole, held, growth = seen["whole"], seen["held"], seen["growth"]
            print(f"{label}, rank {rank}: the model {whole / 2**20:.1f} MiB, held {held / 2**20:.1f} MiB, peak "
                  f"memory grew {growth / 2**20:.1f} MiB ({growth / whole:.2f} of the model)")
            assert seen["finite"], label
            assert 0.45 * whole < held < 0.55 * whole, (label, held, whole)
            assert growth < held + 0.35 * whole, (label, growth, held, whole)  # before: the whole model and more
        assert uninitialized["type"] == "PipelineConfigError", uninitialized
        assert "stage 1 (rank 1)" in uninitialized["message"], uninitialized
        assert "`layers.3.gain` (Gain)" in uninitialized["message"], uninitialized
        assert own_sharding["type"] == "PipelineConfigError", own_sharding
        assert "are DTensors on a mesh other than the strategy's" in own_sharding["message"], own_sharding
        assert "('replicas',)" in own_sharding["message"], own_sharding
        assert stale_list["type"] == "PipelineConfigError", stale_list
        assert "still on the meta device" in stale_list["message"], stale_list
        assert shared["type"] == "PipelineConfigError", shared
        assert "`layers.2` shares a weight with `layers.0`" in shared["message"], shared


