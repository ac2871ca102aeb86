"""Multi-process tier: pipelined training on gloo equals single-device Lightning training (fp32, tight tolerance).

What is compared, and why (``support.assert_like``). At every optimizer step, the gradients handed to the optimizer
(after clipping) against those one device computes at the same weights on the same batch, each element within 1e-5 of
its tensor's largest magnitude; every logged value against a single-device run, and what every rank sees after fit
(its callback metrics); and the weights after training, element-wise, for models not trained with Adam or AdamW (SGD
here). Not the weights of models trained with Adam or AdamW, nor their gradients against a free-running
single-device run: Adam divides each gradient by its running magnitude, so the fp32 noise of a gradient that is
(nearly) zero, which differs with the summation order of micro-batches, becomes a full-size update of random sign. Two
single-device runs that merely sum in a different order drift apart there too, and so do the gradients computed at the
drifted weights. SGD moves each weight in proportion to its gradient, so its noise stays noise.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _launch import launch
from models import fit
from support import SCHEDULE_NAMES, assemble, assert_trains_like, pipelined, reference


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_schedule_matches_single_device(world_size: int) -> None:
    """naive, gpipe, 1f1b x micro-batch counts 1, p, 2p and one that does not divide the batch of 8; the tied models
    (a weight on the first and the last stage) with p micro-batches."""
    microbatch_counts = [1, world_size, 2 * world_size, 3]
    models = [("mlp", m) for m in microbatch_counts] + [("mlp_sgd", world_size), ("tied", world_size),
                                                        ("tied_sgd", world_size)]
    runs = [pipelined(model, schedule=s, microbatches=m) for s in SCHEDULE_NAMES for model, m in models]
    ranks = launch(world_size, runs, timeout=300)
    for index, run in enumerate(runs):
        label = f"{world_size} stages {run['kwargs']}"
        assert_trains_like(ranks, index, run, reference(run["kwargs"]["model"]), label)


def test_balance_accumulation_uneven_batches_and_frozen_layers() -> None:
    """A custom balance, accumulate_grad_batches=2, a batch of 7 split into 2 micro-batches of 4 and 3, a first
    stage whose weights are all frozen, an input projection unfrozen after two steps (placed then: it leaves the
    last stage, which computed it only to have it replaced by the received activation), and a module with an
    ``example_input_array`` under Lightning's model summary (which would run the whole module outside the step)."""
    runs = [
        pipelined("mlp", schedule="1f1b", microbatches=2, balance=[2, 6]),
        pipelined("mlp", schedule="gpipe", microbatches=2, trainer={"accumulate_grad_batches": 2}),
        pipelined("mlp", schedule="1f1b", microbatches=2, batch_size=7),
        pipelined("frozen_front", schedule="1f1b", microbatches=2),
        pipelined("unfreezes_front", schedule="1f1b", microbatches=2),
        pipelined("example_input", schedule="1f1b", microbatches=2, trainer={"enable_model_summary": True}),
    ]
    ranks = launch(2, runs, timeout=300)
    expected = [reference("mlp"), reference("mlp", accumulate_grad_batches=2), reference("mlp", batch_size=7),
                reference("frozen_front"), reference("unfreezes_front"), reference("example_input")]
    for index, run in enumerate(runs):
        assert_trains_like(ranks, index, run, expected[index], str(run["kwargs"]))
    assert sorted(k for k in ranks[0].results[0]["state"] if k.startswith("layers.")) == [
        "layers.0.bias", "layers.0.weight"]
    assert "inp.weight" in ranks[0].results[4]["state"] and "inp.weight" not in ranks[1].results[4]["state"]
    assert "inp.weight" in ranks[1].results[3]["state"]  # frozen throughout: never placed, held by both stages


def test_gradient_clipping_by_global_norm_and_value() -> None:
    """Clipped gradients are what the optimizer gets (compared as it gets them); SGD shows their effect on weights."""
    cases = [{"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"},
             {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}]
    runs = [pipelined(model, schedule="1f1b", microbatches=2, trainer=case)
            for case in cases for model in ("mlp", "tied", "mlp_sgd", "tied_sgd")]
    ranks = launch(2, runs, timeout=300)
    for index, run in enumerate(runs):
        expected = reference(run["kwargs"]["model"], **run["kwargs"]["trainer"])
        assert_trains_like(ranks, index, run, expected, str(run["kwargs"]))


def test_mixed_precision() -> None:
    """bf16-mixed, and fp16 with a gradient scaler where one stage sees inf: all stages skip and back off."""
    runs = [{"scenario": "train", "kwargs": {"model": "mlp", "schedule": "1f1b", "microbatches": 2,
                                             "trainer": {"precision": "bf16-mixed"}}},
            {"scenario": "train", "kwargs": {"model": "inf_on_one_stage", "schedule": "gpipe", "microbatches": 2,
                                             "fp16_scaler": True}}]
    ranks = launch(2, runs, timeout=300)
    bf16 = reference("mlp", precision="bf16-mixed")
    full, history = assemble(ranks, 0)
    # bf16 keeps ~3 significant digits: summing micro-batch gradients rounds differently from one batch, and
    # AdamW (lr 0.01) turns a flipped sign of a tiny gradient into a full step, so parameters agree to ~1 step
    for name, value in bf16["state"].items():
        torch.testing.assert_close(full[name], value, rtol=0, atol=2e-2)
    for (_, got), (_, want) in zip(history, bf16["history"], strict=True):
        assert abs(got["train_loss"] - want["train_loss"]) < 2e-3

    fp16 = fit("inf_on_one_stage", fp16_scaler=True).result
    expected_scale = fp16["scale"]
    assert expected_scale == 2.0**9  # the single-device run skipped step 1 and halved the scale
    assert [rank.results[1]["scale"] for rank in ranks] == [expected_scale, expected_scale]
    full, history = assemble(ranks, 1)
    for name, value in fp16["state"].items():
        torch.testing.assert_close(full[name], value, rtol=0, atol=2e-3)
    for (_, got), (_, want) in zip(history, fp16["history"], strict=True):
        assert abs(got["train_loss"] - want["train_loss"]) < 2e-3


def test_example_transformer_gradients_and_losses_match_single_device() -> None:
    """The example's GPT (attention, position embedding, tied head, AdamW + cosine LambdaLR) on 2 and 4 stages.

    Compared: every gradient handed to the optimizer at every step (against one device's at the same weights) and
    the logged loss of every step. Not the weights (AdamW, see the module docstring): in attention some gradients are
    analytically zero (the key bias: softmax ignores a constant added to a row of scores) or nearly so.
    """
    expected = reference("gpt", max_steps=5)
    for world_size in (2, 4):
        run = pipelined("gpt", schedule="1f1b", microbatches=4, max_steps=5)
        ranks = launch(world_size, [run], timeout=200)
        # its perplexity, exp(loss), is logged with reduce_fx="mean": the mean over micro-batches of exp(micro-batch
        # loss), not exp(batch loss) (README, Limits), so only the loss is compared
        assert_trains_like(ranks, 0, run, expected, f"gpt on {world_size} stages", logged=("train_loss",))


def torch_interleaved_csv(path: Path, ranks: int, stages_per_rank: int, microbatches: int) -> str:
    """The CSV torch.distributed.pipelining writes for its own ScheduleInterleaved1F1B (built without a process group:
    its constructor reads only these attributes of its stages)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    stages = [SimpleNamespace(submod=torch.nn.Identity(), num_stages=ranks * stages_per_rank, group_size=ranks,
                              group_rank=0, stage_index=k * ranks) for k in range(stages_per_rank)]
    ScheduleInterleaved1F1B(stages, microbatches)._dump_csv(str(path), format="compute_comms")  # type: ignore[arg-type]
    return str(path)


@pytest.mark.parametrize("world_size", [2, 4])
def test_schedules_beyond_1f1b_match_single_device(world_size: int, tmp_path: Path) -> None:
    """interleaved_1f1b (2 stages per rank), zb_h1 (backward split into input and weight gradients), zbv (both) and
    dualpipev (the V with whole and split backwards), at several micro-batch counts, and a schedule torch wrote as CSV;
    the tied models where they have enough blocks, and frozen first layers."""
    p = world_size
    runs = [pipelined("mlp", schedule=s, microbatches=m)
            for s, counts in (("interleaved_1f1b", [p, 2 * p]), ("zb_h1", [p, 2 * p, 3]), ("zbv", [p, 2 * p]),
                              ("dualpipev", [2 * p, 4 * p]))
            for m in counts]
    runs += [pipelined("tied_sgd", schedule="zb_h1", microbatches=p), pipelined("tied", schedule="zb_h1",
                                                                               microbatches=2 * p)]
    # frozen first layers: a stage's input without gradient still hands an (empty) gradient upstream
    runs += [pipelined("frozen_front", schedule=s, microbatches=2 * p) for s in ("zb_h1", "zbv")]
    if world_size == 2:  # 4 blocks: 2 stages per rank only fit on 2 ranks
        runs += [pipelined("tied_sgd", schedule="interleaved_1f1b", microbatches=p),
                 pipelined("tied_sgd", schedule="zbv", microbatches=2 * p),
                 pipelined("tied_sgd", schedule="dualpipev", microbatches=2 * p)]
    runs.append(pipelined("mlp", schedule=torch_interleaved_csv(tmp_path / "torch.csv", p, 2, 2 * p)))
    ranks = launch(world_size, runs, timeout=380)
    for index, run in enumerate(runs):
        label = f"{world_size} ranks {run['kwargs']}"
        assert_trains_like(ranks, index, run, reference(run["kwargs"]["model"]), label)


def test_activation_checkpointing_matches_single_device_on_every_schedule() -> None:
    """Blocks recomputed in backward (every block, or every second one) give one device's gradients on every
    schedule, split backwards included."""
    schedules = ["naive", "gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev"]
    runs = [pipelined("mlp", schedule=s, microbatches=4, activation_checkpointing=True) for s in schedules]
    runs += [pipelined("tied_sgd", schedule=s, microbatches=4, activation_checkpointing=2) for s in ("1f1b", "zb_h1")]
    ranks = launch(2, runs, timeout=300)
    for index, run in enumerate(runs):
        assert_trains_like(ranks, index, run, reference(run["kwargs"]["model"]), str(run["kwargs"]))
