"""Multi-process tier: pipeline x tensor parallelism (x data parallelism) equals Lightning's ``ModelParallelStrategy``
running the same ``configure_model`` (fp32, tight).

``models.TensorParallelMLP`` is a module written for ``ModelParallelStrategy``: ``configure_model`` parallelizes each
block (``up`` column-wise, ``down`` row-wise over ``self.device_mesh["tensor_parallel"]``) and, with data-parallel
ranks, applies FSDP2 over ``"data_parallel"`` to each module its step calls; ``FullyShardsItsModel`` follows
Lightning's documented pattern instead (FSDP2 on each block, then on the whole network, which the step calls);
``TensorParallelPlanOnly`` applies the plan alone, leaving the replicas to ``data_parallel``. Their weights outside
the blocks stay plain tensors without FSDP, so torch's ``clip_grad_norm_`` under ``ModelParallelStrategy`` (which
cannot mix meshes) is not the reference for clipping: one device is, and one device equals
``ModelParallelStrategy(1, 2)`` (both checked below).

Jobs (module-scoped, shared by the tests): the references on 2 and 4 processes, 2 stages x 2 tensor-parallel ranks on
4, and 2 stages x 2 replicas x 2 tensor-parallel ranks on 8 (the one 8-process job of the suite).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _launch import RankResult, launch
from models import TensorParallelMLP, fit
from support import assemble, assert_like, assert_matches, assert_params_match, stage_results

from lightning_pp.model.materialize import materialize

STAGES, REPLICAS, TP = 2, 2, 2
ACCUMULATED = {"accumulate_grad_batches": 2}  # 2 replicas x 2 batches per epoch: one optimizer step per epoch
CLIPPED = {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"}
# the user's loader kept, as a pipeline with one replica keeps it (ModelParallelStrategy would inject a sampler)
OWN_LOADER = {"use_distributed_sampler": False}


def pipelined(schedule: str = "1f1b", trainer: dict[str, Any] | None = None, model: str = "tp_mlp",
              **strategy: Any) -> dict[str, Any]:
    return {"scenario": "train", "kwargs": {"model": model, "schedule": schedule, "microbatches": 2,
                                            "pipeline_parallel_size": STAGES, "tensor_parallel_size": TP,
                                            "trainer": trainer or {}, **strategy}}


def model_parallel(data_parallel_size: int, trainer: dict[str, Any], model: str = "tp_mlp") -> dict[str, Any]:
    return {"scenario": "train_model_parallel", "kwargs": {
        "model": model, "data_parallel_size": data_parallel_size, "tensor_parallel_size": TP, "trainer": trainer}}


def ok(ranks: list[RankResult], index: int) -> list[RankResult]:
    for global_rank, rank in enumerate(ranks):
        assert index not in rank.errors, f"rank {global_rank}: {rank.errors[index]['traceback']}\n{rank.output[-3000:]}"
    return ranks


def reference_of(ranks: list[RankResult], index: int = 0) -> dict[str, Any]:
    result = ok(ranks, index)[0].results[index]
    return {"state": result["state"], "history": result["history"]}


# ----------------------------------------------------------------------------------------------------- shared jobs


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tp_checkpoints")


@pytest.fixture(scope="module")
def references() -> dict[str, list[RankResult]]:
    """Lightning's ModelParallelStrategy: 1 x 2 on 2 processes; 2 x 2 (the modules' FSDP2 over the replicas) on 4, for
    `TensorParallelMLP`, `FullyShardsItsModel` and `TensorParallelMLP` materialized as a meta build is."""
    return {"tp": launch(2, [model_parallel(1, OWN_LOADER)], timeout=150),
            "dp_tp": launch(4, [model_parallel(2, ACCUMULATED, model) for model in
                                ("tp_mlp", "tp_fully_shards_its_model", "tp_mlp_materialized")], timeout=200)}


@pytest.fixture(scope="module")
def job8(checkpoints: Path) -> list[RankResult]:
    """8 processes, 2 stages x 2 replicas x 2 tensor-parallel ranks: the plan alone with ddp, and with fsdp (2-D: FSDP2
    over the replicas of tensor-parallel blocks) saving a sharded checkpoint; the modules that apply FSDP2 themselves,
    built normally and (TensorParallelMLP) on the meta device; a meta build of the plan alone with fsdp, not trained
    (its initial values); sequence parallelism with ddp, every replica loading the same batches."""
    runs = [pipelined(trainer=ACCUMULATED, model="tp_mlp_plan_only"),
            pipelined(trainer=ACCUMULATED, model="tp_mlp_plan_only", data_parallel_mode="fsdp",
                      save_to=str(checkpoints / "sharded"), state_dict_type="sharded"),
            pipelined(trainer=ACCUMULATED),
            pipelined(trainer=ACCUMULATED, model="tp_fully_shards_its_model"),
            pipelined(trainer={"meta": True, **ACCUMULATED}),
            pipelined(trainer={"meta": True}, model="tp_mlp_plan_only", data_parallel_mode="fsdp", max_steps=0),
            pipelined(trainer=OWN_LOADER, model="sp_mlp")]
    return launch(STAGES * REPLICAS * TP, runs, timeout=300)


@pytest.fixture(scope="module")
def job4(checkpoints: Path, job8: list[RankResult]) -> list[RankResult]:
    """4 processes, 2 stages x 2 tensor-parallel ranks: the memory a meta build takes; 1f1b saving a full checkpoint,
    zb_h1, interleaved 1F1B, clipping by the global norm; the 8-process job's sharded checkpoint resumed here (no step
    left: its weights); tensor_parallel_size with a module that applies no plan; blocks that hand each other DTensors;
    the sharded checkpoint resumed at 2 stages x 2 replicas without tensor parallelism; Hugging Face's Llama with its
    layers split; sequence parallelism; dualpipev; a skip connection across stages over DTensors."""
    runs = [{"scenario": "meta_memory", "kwargs": {"model": "wide_tp", "pipeline_parallel_size": STAGES,
                                                   "tensor_parallel_size": TP}},  # first: in fresh processes
            pipelined(trainer=OWN_LOADER, save_to=str(checkpoints / "full.ckpt")),
            pipelined("zb_h1", trainer=OWN_LOADER),
            pipelined("interleaved_1f1b", trainer=OWN_LOADER, stages_per_rank=2),
            pipelined(trainer={**OWN_LOADER, **CLIPPED}),
            pipelined(trainer=OWN_LOADER, ckpt_path=str(checkpoints / "sharded")),
            {"scenario": "expect_error", "kwargs": {"model": "mlp_sgd", "pipeline_parallel_size": STAGES,
                                                    "tensor_parallel_size": TP}},
            pipelined(trainer=OWN_LOADER, model="samples_dtensors"),
            pipelined(ckpt_path=str(checkpoints / "sharded"), tensor_parallel_size=1),
            pipelined(trainer=OWN_LOADER, model="llama_tp", microbatches=4),
            pipelined(trainer=OWN_LOADER, model="sp_mlp"),
            pipelined("dualpipev", trainer=OWN_LOADER, microbatches=4),
            # last: the job ends where a stage fails
            {"scenario": "expect_error", "kwargs": {"model": "skips_over_dtensors", "trainer": OWN_LOADER,
                                                    "pipeline_parallel_size": STAGES, "tensor_parallel_size": TP,
                                                    "timeout": 10}}]
    return launch(STAGES * TP, runs, timeout=240)


# ----------------------------------------------------------------------------------------------------- tests


@pytest.mark.timeout(600)
def test_pipeline_by_tensor_parallel_equals_model_parallel_strategy(
        references: dict[str, list[RankResult]], job4: list[RankResult]) -> None:
    expected = reference_of(references["tp"])
    one_device = fit("tp_mlp", **OWN_LOADER).result  # ModelParallelStrategy(1, 2) equals one device
    assert_params_match(expected["state"], one_device["state"], "ModelParallelStrategy(1, 2) against one device")
    runs = {1: "pp2 x tp2 1f1b", 2: "pp2 x tp2 zb_h1", 3: "pp2 x tp2 interleaved_1f1b", 11: "pp2 x tp2 dualpipev"}
    for index, label in runs.items():
        full, history = assemble(ok(job4, index), index)
        assert_matches(full, history, expected, label)


@pytest.mark.timeout(600)
def test_global_norm_clipping_counts_each_tensor_parallel_shard_once(job4: list[RankResult]) -> None:
    full, history = assemble(ok(job4, 4), 4)
    assert_matches(full, history, fit("tp_mlp", **OWN_LOADER, **CLIPPED).result, "clipped pp2 x tp2")


@pytest.mark.timeout(600)
def test_pipeline_by_data_by_tensor_parallel_equals_model_parallel_strategy(
        references: dict[str, list[RankResult]], job8: list[RankResult]) -> None:
    runs = [("plan alone, ddp", 0, TP), ("plan alone, fsdp", 0, TP * REPLICAS), ("the module's own FSDP2", 0, None),
            ("Lightning's pattern: FSDP2 on blocks, then the network", 1, None),
            ("the module's own FSDP2, built on the meta device", 2, None)]
    for index, (label, reference, share) in enumerate(runs):
        expected = reference_of(references["dp_tp"], reference)
        full, history = assemble(ok(job8, index), index)
        assert_matches(full, history, expected, f"pp2 x dp2 x tp2, {label}")
        prefix = "model." if reference == 1 else ""
        for global_rank, rank in enumerate(job8):  # a block weight: 1/T of it (ddp), 1/(D*T) (fsdp) on each rank
            numel = rank.results[index]["local_numel"]
            weight = f"{prefix}blocks.{2 if global_rank >= 4 else 0}.up.weight"
            assert numel[weight] == full[weight].numel() // (share or TP * REPLICAS), label
            if share is None:  # the module sharded its weights outside the blocks too: kept by every stage
                assert numel[f"{prefix}inp.weight"] == full[f"{prefix}inp.weight"].numel() // REPLICAS, label


@pytest.mark.timeout(600)
def test_meta_build_materializes_each_shard_as_one_device_would(job8: list[RankResult]) -> None:
    """Made whole and cut: the initial values do not depend on P, D or T (one device materializing alike)."""
    torch.manual_seed(7)
    with torch.device("meta"):
        model = TensorParallelMLP()
    materialize(model, torch.device("cpu"))
    full, _ = assemble(ok(job8, 5), 5)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=0, atol=0, msg=name)
    for global_rank, rank in enumerate(job8):
        block = 2 if global_rank >= 4 else 0
        assert rank.results[5]["local_numel"][f"blocks.{block}.up.weight"] == 32 * 16 // (REPLICAS * TP)


@pytest.mark.timeout(600)
def test_checkpoints_of_tensor_parallel_stages(checkpoints: Path, job8: list[RankResult],
                                                job4: list[RankResult]) -> None:
    """The full checkpoint (pp2 x tp2) loads in plain Lightning; the sharded one (pp2 x dp2 x tp2 with fsdp) resumes
    with its weights at pp2 x tp2 (another D) and at pp2 x dp2 (another T)."""
    full, _ = assemble(ok(job4, 1), 1)
    loaded = TensorParallelMLP.load_from_checkpoint(checkpoints / "full.ckpt", weights_only=True)
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, full[name], rtol=0, atol=0, msg=name)
    saved, _ = assemble(ok(job8, 1), 1)
    for index in (5, 8):
        resumed, _ = assemble(ok(job4, index), index)
        for name, value in saved.items():
            torch.testing.assert_close(resumed[name], value, rtol=0, atol=0, msg=f"run {index}: {name}")


@pytest.mark.timeout(600)
def test_tensor_parallel_size_without_a_plan_is_refused_on_every_rank(job4: list[RankResult]) -> None:
    for rank in ok(job4, 6):
        error = rank.results[6]
        assert error["type"] == "PipelineConfigError", error
        assert "tensor_parallel_size=2, but the module applies no tensor-parallel plan" in error["message"]


@pytest.mark.timeout(600)
def test_blocks_handing_each_other_dtensors_train_as_one_device(job4: list[RankResult]) -> None:
    """A DTensor a block hands on crosses the stage boundary as each tensor-parallel rank's local part, to the same
    rank of the next stage, rebuilt there with its placements (gradients back alike); in an eager pass through the
    blocks at the end of each epoch too, where every rank gets one device's output."""
    want = fit("samples_dtensors", **OWN_LOADER).result
    assert want["samples"]
    assert_like(stage_results(ok(job4, 7), 7), want, "DTensors across stages", params=True)


@pytest.mark.timeout(600)
def test_a_skip_connection_across_stages_over_dtensors_is_refused(job4: list[RankResult]) -> None:
    """A DTensor cannot be marked as another stage's block output: what stands in for it is a NaN leaf, and the first
    training step refuses a result whose graph reaches one, on the stage that computed it (the others end too)."""
    index = len(job4[0].results) - 1
    errors = [rank.results[index] for rank in job4]
    last_stage = errors[STAGES * TP - TP:]
    for error in last_stage:
        assert error["type"] == "PipelineConfigError", error
        assert "is computed from the output of a block held by another pipeline stage" in error["message"], error
        assert "carry_block_outputs=True" in error["message"]
    assert all(error["type"] != "none" for error in errors), errors


@pytest.mark.timeout(600)
def test_a_meta_build_takes_each_rank_its_share_of_memory(job4: list[RankResult]) -> None:
    """`models.WideTensorParallel` (1 GiB of blocks) built on the meta device, 2 stages x 2 tensor-parallel ranks:
    each rank holds a quarter of the blocks, and its peak memory grows by less than half the model before training
    (each layer is made whole, initialized and cut in turn: 16 MiB at a time)."""
    for rank, result in enumerate(ok(job4, 0)):
        seen = result.results[0]
        whole, held, growth = seen["whole"], seen["held"], seen["growth"]
        print(f"rank {rank}: the model {whole / 2**20:.1f} MiB, held {held / 2**20:.1f} MiB, peak memory grew "
              f"{growth / 2**20:.1f} MiB ({growth / whole:.2f} of the model)")
        assert seen["finite"]
        assert 0.22 * whole < held < 0.28 * whole, (held, whole)
        assert growth < 0.5 * whole, (growth, whole)


@pytest.mark.timeout(600)
def test_hugging_face_llama_split_by_tensor_parallelism_trains_as_one_device(job4: list[RankResult]) -> None:
    """An unmodified ``LlamaForCausalLM`` (grouped-query attention: 4 query and 2 key-value heads, 2 and 1 per rank;
    rotary embeddings handed to every layer), each layer parallelized in ``configure_model``: 2 stages x 2
    tensor-parallel ranks equal one device running it unsplit."""
    full, history = assemble(ok(job4, 9), 9)
    assert_matches(full, history, fit("llama_tp", **OWN_LOADER).result, "Llama pp2 x tp2")


@pytest.mark.timeout(600)
def test_sequence_parallel_blocks_train_as_one_device(job4: list[RankResult], job8: list[RankResult]) -> None:
    """Blocks whose norm runs on each rank's part of the sequence (its replicated weight gets partial-sum gradients,
    summed over the tensor-parallel ranks before the replicas' average and the optimizer): 2 stages x 2
    tensor-parallel ranks, and x 2 replicas loading the same batches, equal one device."""
    expected = fit("sp_mlp", **OWN_LOADER).result
    for ranks, index, label in ((job4, 10, "pp2 x tp2"), (job8, 6, "pp2 x dp2 x tp2")):
        full, history = assemble(ok(ranks, index), index)
        assert_matches(full, history, expected, f"sequence parallel, {label}")
