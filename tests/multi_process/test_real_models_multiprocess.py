"""Multi-process tier for modules shaped like real models (issue 11), unmodified, pipelined on 2 and 4 gloo ranks and
compared with plain single-device Lightning run in this process (the models: ``real_models.py``, trained by
``models.fit``; the comparisons: ``support.assert_like``).

Compared for every run: the gradients every optimizer step applied, against one device's at the run's own weights (each
element within 1e-5 of its tensor's largest magnitude), everything logged (within 1e-5, relative below 1), that weights
replicated on several stages are identical there, and on every rank the callback metrics, predictions, generated
samples and checkpoint decisions. Also the parameters element-wise, but for AdamW runs, which turn fp32
summation-order noise in near-zero gradients (an attention key bias) into full-size steps (see
``test_equivalence.py``).

Each test is one launch of several runs (process start-up dominates); a rank stops at the first run that fails, so a
failure report lists that run's error and the runs after it as not run.
The single-process tests are in ``single_process/test_real_models.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _launch import launch
from support import (
    SCHEDULE_NAMES,
    Result,
    assert_like,
    check_all,
    like,
    logged,
    merged_state,
    pipelined,
    prefixed,
    reference,
    stage_results,
)


# ------------------------------------------------------------------------------------------------ checks of one run
def dropout_trains(results: list[Result], label: str) -> None:
    """Dropout masks differ from one device's (drawn per micro-batch and stage), so only: replicas identical, losses
    finite and falling over 3 epochs of the same 4 batches, and close to one device's."""
    merged_state(results)
    losses = [value for _, value in logged(results[0]["history"], "train_loss")]
    want = [value for _, value in logged(reference("hf_gpt2_dropout")["history"], "train_loss")]
    assert len(losses) == len(want) == 12, losses
    assert all(math.isfinite(value) for value in losses), losses
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < first - 0.2, f"loss does not fall: first epoch {first:.3f}, last {last:.3f} ({losses})"
    want_last = sum(want[-4:]) / 4
    assert abs(last - want_last) < 0.25, f"last epoch's mean loss {last:.3f}, one device's {want_last:.3f}"
    print(f"{label}: mean loss first epoch {first:.3f}, last epoch {last:.3f} (one device {want_last:.3f})")


def drawn_per_step(results: list[Result], steps: int, microbatches: int, label: str) -> list[torch.Tensor]:
    """The noise every stage drew must be the same for each (step, micro-batch); returns it joined per step."""
    counts = [len(result["drawn"]) for result in results]
    assert counts == [steps * microbatches] * len(results), (
        f"training_step ran {counts} times on the stages; expected once per micro-batch and step "
        f"({steps} x {microbatches})")
    for stage, result in enumerate(results[1:], start=1):
        for call, (got, want) in enumerate(zip(result["drawn"], results[0]["drawn"], strict=True)):
            assert torch.equal(got, want), (f"{label}: stage {stage} drew other noise than stage 0 in step "
                                            f"{call // microbatches}, micro-batch {call % microbatches}")
    drawn = results[0]["drawn"]
    return [torch.cat(drawn[step * microbatches:(step + 1) * microbatches]) for step in range(steps)]


def identity_denoiser(microbatches: int) -> Callable[[list[Result], str], None]:
    def check(results: list[Result], label: str) -> None:
        drawn_per_step(results, 4, microbatches, label)
        losses = [value for _, value in logged(results[0]["history"], "train_loss")]
        assert losses == [0.0] * 4, f"identity blocks regressing the noise they were fed must log 0, got {losses}"
        assert_like(results, reference("denoiser_identity"), label)

    return check


def trainable_denoiser(microbatches: int) -> Callable[[list[Result], str], None]:
    """Compared with one device replaying the noise the pipeline drew: which numbers a pipeline draws is its choice;
    that every stage uses the same ones, and trains as one device would on them, is the contract."""

    def check(results: list[Result], label: str) -> None:
        noise = drawn_per_step(results, 4, microbatches, label)
        own = reference("denoiser")["drawn"]
        same = all(torch.equal(a, b) for a, b in zip(noise, own, strict=True))
        print(f"{label}: the pipeline's noise {'equals' if same else 'differs from'} one device's own draws")
        assert_like(results, reference("denoiser", replay=tuple(noise)), label)

    return check


def backbone_finetuning(results: list[Result], label: str) -> None:
    """The embedding (tied to the head) is frozen for epoch 0 and trained from epoch 1: its gradient must be summed
    over the stages from then on, and the parameters follow one device's."""
    want = reference("finetune")
    tied = "backbone.token.weight"
    assert tied not in want["grads"][0] and tied in want["grads"][-1], "the reference did not unfreeze the backbone"
    assert_like(results, want, label)


def generated_as_on_one_device(model: str) -> Callable[[list[Result], str], None]:
    """Training as on one device, and on every rank the samples generated at the end of each validation epoch (if
    it generates there) and the tokens and scores ``generate`` gives in ``predict_step``."""
    def check(results: list[Result], label: str) -> None:
        want = reference(model)
        assert want["predict"] and (want["samples"] or "_generate_" in model), f"{model} generated nothing"
        assert_like(results, want, label)

    return check


@pytest.mark.timeout(420)
@pytest.mark.parametrize("world_size", [2, 4])
def test_gpt2_and_nanogpt_every_schedule(world_size: int) -> None:
    """Hugging Face GPT-2 (blocks in ``model.transformer.h``, an ``nn.ModuleList`` looped with a mask, position ids and
    a cache; head tied to ``wte``) and a nanoGPT module (``transformer.h`` inside an ``nn.ModuleDict``, boolean mask),
    found automatically, under every schedule; on 2 stages also the container named by ``blocks=``, GPT-2 with dropout
    (default GPT2Config), which must train, not match, and GPT-2 on padded sequences (labels -100 on the padding) with
    ``microbatch_weight`` counting each micro-batch's real tokens; and both built on the meta device
    (``trainer.init_module(empty_init=True)``), each rank materializing its own stage, against one device materializing
    the whole model alike."""
    runs = [pipelined(model, schedule=schedule, microbatches=world_size * (2 if schedule == "1f1b" else 1))
            for model in ("hf_gpt2", "nanogpt") for schedule in SCHEDULE_NAMES]
    checks = [like(run["kwargs"]["model"]) for run in runs]
    if world_size == 2:
        runs += [pipelined("hf_gpt2", blocks="model.transformer.h", schedule="1f1b", microbatches=2),
                 pipelined("nanogpt", blocks="transformer.h", schedule="gpipe", microbatches=4),
                 pipelined("nanogpt", blocks="transformer.h", schedule="1f1b", microbatches=2),
                 pipelined("hf_gpt2_dropout", schedule="1f1b", microbatches=2),
                 pipelined("hf_gpt2_padded", schedule="1f1b", microbatches=4, microbatch_weight="label_tokens"),
                 pipelined("hf_gpt2_meta", schedule="1f1b", microbatches=2),
                 pipelined("nanogpt_meta", schedule="gpipe", microbatches=2)]
        checks += [like("hf_gpt2"), like("nanogpt"), like("nanogpt"), dropout_trains,
                   like("hf_gpt2_padded"), like("hf_gpt2_meta"), like("nanogpt_meta")]
    check_all(world_size, runs, checks, timeout=200 if world_size == 2 else 280)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("world_size", [2, 4])
def test_inplace_sliced_tuple_and_dict_blocks(world_size: int) -> None:
    """An ``nn.Sequential`` whose later stages start with ``nn.ReLU(inplace=True)`` (a ``balance`` that puts one first
    on every stage after the first); ``for index, layer in enumerate(self.layers[: n])`` with ``len(self.layers)``,
    rotary tables and a mask passed as keywords; blocks taking and returning ``(hidden, aux)``; blocks returning
    ``(hidden, None)`` of which the loop keeps ``[0]``; blocks taking and returning a dict with a ``None`` entry, a
    gate that is ``None`` before the first block and a long counter."""
    inplace = (pipelined("inplace", blocks="features", balance=[3, 5], schedule="1f1b", microbatches=2)
               if world_size == 2 else
               pipelined("inplace", blocks="features", balance=[1, 2, 2, 3], schedule="gpipe", microbatches=4))
    runs = [inplace,
            pipelined("sliced", schedule="1f1b", microbatches=world_size),
            pipelined("tuple_carry", schedule="1f1b", microbatches=world_size),
            pipelined("dict_state", schedule="gpipe", microbatches=world_size),
            pipelined("tuple_output", schedule="1f1b", microbatches=world_size)]
    check_all(world_size, runs, [like(run["kwargs"]["model"]) for run in runs], timeout=180 if world_size == 2
              else 240)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("world_size", [2, 4])
def test_shared_randomness_whole_batch_metrics_and_unfreezing(world_size: int, tmp_path: Path) -> None:
    """The diffusion pattern (noise drawn in the step, added before the blocks, the target after them) with identity
    blocks, where one device's loss is exactly 0, and with trainable blocks; ``exp(loss)`` logged in validation and
    monitored by ``ModelCheckpoint``; ``BackboneFinetuning`` unfreezing an embedding tied to the head at epoch 1."""
    m = world_size
    runs = [pipelined("denoiser_identity", schedule="1f1b", microbatches=m),
            pipelined("denoiser", schedule="gpipe" if world_size == 2 else "1f1b", microbatches=m),
            pipelined("val_ppl", schedule="gpipe", microbatches=m, dirpath=str(tmp_path / "checkpoints")),
            pipelined("finetune", schedule="1f1b", microbatches=m)]
    checks = [identity_denoiser(m), trainable_denoiser(m), like("val_ppl"), backbone_finetuning]
    check_all(world_size, runs, checks, timeout=180 if world_size == 2 else 240)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("world_size", [2, 4])
def test_pytorch_transformer_encoder(world_size: int, tmp_path: Path) -> None:
    """PyTorch's ``nn.TransformerEncoder``, unmodified: its loop reads the first layer's attributes (a stand-in on
    later stages), and in validation and predict it runs the layers on nested tensors built from the padding mask,
    which then cross stages. Also a causal language model on ``norm_first`` layers."""
    runs = [pipelined("torch_encoder", schedule="1f1b", microbatches=world_size, dirpath=str(tmp_path / "encoder")),
            pipelined("torch_causal", schedule="gpipe", microbatches=world_size, dirpath=str(tmp_path / "causal"))]
    check_all(world_size, runs, [like("torch_encoder"), like("torch_causal")],
              timeout=180 if world_size == 2 else 240)


@pytest.mark.timeout(300)
def test_hugging_face_vit_and_a_container_of_alternating_blocks() -> None:
    """Hugging Face's ``ViTForImageClassification``, unmodified, with the weights outside the blocks kept where used:
    its forward reads the patch embedding's weight dtype on every stage, also where that weight is not kept. A
    container of attention and feed-forward blocks alternating (no type a majority), found automatically."""
    runs = [pipelined("hf_vit", schedule=schedule, microbatches=4) for schedule in ("1f1b", "zb_h1")]
    runs += [pipelined("alternating", schedule=schedule, microbatches=4) for schedule in ("1f1b", "interleaved_1f1b")]
    check_all(2, runs, [like(run["kwargs"]["model"]) for run in runs], timeout=240)


@pytest.mark.timeout(300)
def test_compiled_blocks_compile_once_not_per_microbatch() -> None:
    """Blocks compiled with ``torch.compile``: training equals one device, and each rank compiles the block's graph
    once for the first step, whose weight observation watches every torch call, and once for the rest (one device
    compiles it once; before, the observation made dynamo compile anew for every micro-batch: 8 graphs)."""
    def check(results: list[Result], label: str) -> None:
        like("compiled")(results, label)
        assert [result["graphs"] for result in results] == [2, 2], label

    check_all(2, [pipelined("compiled", schedule="1f1b", microbatches=4)], [check], timeout=240)


@pytest.mark.timeout(300)
def test_mixture_of_experts_router_loss_over_every_layer(tmp_path: Path) -> None:
    """Hugging Face's Mixtral with ``output_router_logits=True``: transformers records each layer's router logits with
    forward hooks inside the layers and adds the load-balancing loss over all of them. The first stage's routers'
    logits reach the last stage, so the loss, its gradient to the first stage's routers, the logged auxiliary loss and
    validation (on the whole batch) equal one device's. The router loss is a batch statistic: the reference averages
    the losses of each batch's four quarters, the micro-batches. The same with a module of our own whose ``__init__``
    registers the hooks that keep its gates' logits (before the split: the stand-ins get the same hooks)."""
    # each run's router loss, its gradient to every layer's routers, the logged auxiliary loss and validation as one
    # device averaging the quarters (the micro-batches) gives them
    check = like("hf_mixtral_quarters")
    # the penalty over the gates' logits, logged and in the loss
    hooked = like("hooked_aux_loss")

    # each run its own checkpoint folder: a temporary one would be rank 0's, gone while another rank lists it
    runs = [pipelined("hf_mixtral", schedule=schedule, microbatches=4, dirpath=str(tmp_path / schedule))
            for schedule in ("1f1b", "interleaved_1f1b")]
    runs += [pipelined("hooked_aux_loss", schedule=schedule, microbatches=4) for schedule in ("1f1b", "zb_h1")]
    check_all(2, runs, [check, check, hooked, hooked], timeout=240)


@pytest.mark.timeout(300)
def test_hidden_states_of_every_layer_in_the_loss() -> None:
    """GPT-2 with ``output_hidden_states=True`` and a loss over all of them: transformers records them with forward
    hooks on the blocks; every block's output reaches the last stage (and its gradient the stage that computed it)."""
    runs = [pipelined("hf_gpt2_hidden_states", schedule=schedule, microbatches=4) for schedule in ("1f1b", "zb_h1")]
    check_all(2, runs, [like("hf_gpt2_hidden_states")] * 2, timeout=240)


@pytest.mark.timeout(300)
def test_unet_skips_across_stages_with_either_container(tmp_path: Path) -> None:
    """A U-Net whose down blocks' outputs are concatenated back into the up blocks, with ``carry_block_outputs=True``:
    split along its down blocks (the skips are read after them, on the last stage) and along its up blocks (each
    skip joins the previous up block's output between the blocks), training and validation equal one device's."""
    runs = [pipelined("unet", blocks=blocks, schedule=schedule, microbatches=4, carry_block_outputs=True,
                dirpath=str(tmp_path / f"{blocks}-{schedule}"))
            for blocks, schedule in (("net.downs", "1f1b"), ("net.downs", "interleaved_1f1b"), ("net.ups", "1f1b"),
                                     ("net.ups", "zb_h1"))]
    check_all(2, runs, [like("unet")] * len(runs), timeout=240)


def grad_norms_logged(model: str) -> Callable[[list[Result], str], None]:
    """Training as on one device, and every gradient norm ``grad_norm`` logged in ``on_before_optimizer_step``: each
    parameter's and the totals (over every stage's parameters, each counted once)."""
    def check(results: list[Result], label: str) -> None:
        assert any(key.startswith("grad_") for _, metrics in reference(model)["history"] for key in metrics), model
        like(model)(results, label)

    return check


@pytest.mark.timeout(300)
def test_gradient_norms_logged_before_the_optimizer_step() -> None:
    """Lightning's ``grad_norm`` in ``on_before_optimizer_step`` of GPT-2 and of our own nanoGPT: every logged norm is
    one device's (before, each stage logged its own partial total and the logger got rank 0's)."""
    runs = [pipelined(model, schedule=schedule, microbatches=4) for model in ("hf_gpt2_grad_norm", "nanogpt_grad_norm")
            for schedule in ("1f1b", "zb_h1")]
    check_all(2, runs, [grad_norms_logged(run["kwargs"]["model"]) for run in runs], timeout=240)
    check_all(4, [pipelined("hf_gpt2_grad_norm", schedule="1f1b", microbatches=4)],
              [grad_norms_logged("hf_gpt2_grad_norm")], timeout=240)


@pytest.mark.timeout(400)
def test_generate_in_predict_step_and_in_a_hook(tmp_path: Path) -> None:
    """GPT-2's ``generate`` (greedy, with and without the key/value cache) and a generation loop of our own (nanoGPT)
    in ``predict_step`` and at the end of every validation epoch during fit (weights outside the blocks kept where
    used): every pass through the blocks runs as a pipelined forward, every rank gets one device's tokens (and
    GPT-2's scores)."""
    runs = [pipelined(model, schedule=schedule, microbatches=4, dirpath=str(tmp_path / f"{model}-{schedule}"))
            for model, schedule in
            (("hf_gpt2_generate", "1f1b"), ("hf_gpt2_generate_no_cache", "1f1b"), ("hf_gpt2_generate", "zb_h1"),
             ("nanogpt_generate", "1f1b"), ("nanogpt_generate", "interleaved_1f1b"))]
    check_all(2, runs, [generated_as_on_one_device(run["kwargs"]["model"]) for run in runs], timeout=300)
    check_all(4, [pipelined("hf_gpt2_generate", schedule="1f1b", microbatches=4, dirpath=str(tmp_path / "4"))],
              [generated_as_on_one_device("hf_gpt2_generate")], timeout=300)


@pytest.mark.timeout(600)
def test_generate_llama_mamba_and_sampling_on_2_and_4_stages(tmp_path: Path) -> None:
    """Issue 42: Hugging Face Llama (rotary positions, grouped key/value heads) and Mamba (a cache of convolution and
    recurrent states) ``generate`` with and without the cache, greedy and sampled after seeding, GPT-2 sampled and
    with a cache type the fast path does not know (the meta-device replay then), and our own sampling loop: every
    rank gets one device's tokens and scores, on 2 and on 4 stages (one block each)."""
    on_two = ["llama_generate_dynamic", "llama_generate_none", "llama_generate_dynamic_sampled",
              "mamba_generate_dynamic", "mamba_generate_none_sampled", "mamba_generate_dynamic_sampled",
              "gpt2_generate_dynamic_sampled", "gpt2_generate_unknown", "nanogpt_sampled"]
    runs = [pipelined(model, schedule="1f1b", microbatches=4, dirpath=str(tmp_path / f"2-{model}")) for model in on_two]
    checks = [generated_as_on_one_device(model) for model in on_two]
    # two stages per rank: the cache's description goes on from a rank's first stage to its second (interleaved), or
    # stays on the rank between its two (the V of zbv)
    runs += [pipelined("llama_generate_dynamic", schedule="interleaved_1f1b", microbatches=4),
             pipelined("hf_gpt2_generate", schedule="zbv", microbatches=4, dirpath=str(tmp_path / "2-zbv"))]
    checks += [generated_as_on_one_device("llama_generate_dynamic"), generated_as_on_one_device("hf_gpt2_generate")]
    check_all(2, runs, checks, timeout=400)
    on_four = ["llama_generate_dynamic_sampled", "mamba_generate_dynamic", "gpt2_generate_dynamic_sampled",
               "llama_generate_unknown", "nanogpt_sampled"]
    runs = [pipelined(model, schedule="1f1b", microbatches=4, dirpath=str(tmp_path / f"4-{model}"))
            for model in on_four]
    checks = [generated_as_on_one_device(model) for model in on_four]
    check_all(4, runs, checks, timeout=400)


@pytest.mark.timeout(300)
def test_auto_chosen_configurations_of_hugging_face_models_train_as_one_device() -> None:
    """``schedule="auto"`` probing Hugging Face GPT-2 (whose blocks append to a key/value cache object they are
    handed, so a block cannot be replayed alone: the step's own per-block timings stand in) and ViT: training equals
    one device's."""
    runs = [pipelined(model, schedule="auto") for model in ("hf_gpt2", "hf_vit")]
    check_all(2, runs, [like(run["kwargs"]["model"]) for run in runs], timeout=240)


@pytest.mark.timeout(360)
def test_a_tensor_from_weights_outside_the_blocks_in_every_block_with_split_backwards() -> None:
    """Blocks that each take a tensor computed before them from weights outside them (``norm(distance_table)``; Hugging
    Face DeBERTa-v2's ``LayerNorm(rel_embeddings.weight)``): every split-backward schedule trains as one device. Before,
    the weight-gradient pass ran that tensor's graph twice (torch's ``Trying to backward through the graph a second
    time``), while 1F1B was exact. ``schedule="auto"`` too, whichever schedule it picks."""
    runs = [pipelined("relative_positions", schedule=schedule, microbatches=4)
            for schedule in ("zb_h1", "zbv", "dualpipev")]
    runs += [pipelined("hf_deberta", schedule=schedule, microbatches=4) for schedule in ("1f1b", "zb_h1", "zbv")]
    runs += [pipelined(model, schedule="auto") for model in ("relative_positions", "hf_deberta")]  # whatever it picks
    check_all(2, runs, [like(run["kwargs"]["model"]) for run in runs], timeout=300)


@pytest.mark.timeout(300)
def test_generate_with_the_weights_outside_the_blocks_sharded(tmp_path: Path) -> None:
    """GPT-2's ``generate`` at the end of each validation epoch and in ``predict_step`` on 2 stages x 2 replicas with
    ``data_parallel_mode="fsdp"``: the embeddings, the final norm and the tied embedding/head sharded, the last stage's
    embedding and the first stage's head computing shapes only. Each eager pass takes a sharded module's output from a
    rank where it is a unit, so every rank generates what the same run with ``"ddp"`` generates."""
    runs = [pipelined("hf_gpt2_generate", schedule="1f1b", microbatches=4, pipeline_parallel_size=2,
                      data_parallel_mode=mode, dirpath=str(tmp_path / mode)) for mode in ("ddp", "fsdp")]
    ranks = launch(4, runs, timeout=240)
    whole, sharded = stage_results(ranks, 0), stage_results(ranks, 1)
    for rank, (want, got) in enumerate(zip(whole, sharded, strict=True)):
        assert len(got["samples"]) == len(want["samples"]) > 0
        for a, b in zip(got["samples"], want["samples"], strict=True):
            assert torch.equal(a, b), f"rank {rank}'s sample {a} != {b}"
        torch.testing.assert_close(got["predict"], want["predict"], rtol=1e-4, atol=1e-4,
                                   msg=prefixed(f"rank {rank}'s generated tokens and scores, fsdp vs ddp"))
    assert sharded[0]["local_numel"]["model.transformer.wte.weight"] < whole[0]["local_numel"][
        "model.transformer.wte.weight"]


@pytest.mark.timeout(420)
def test_gpt2_blocks_sharded_with_fsdp2_train_as_ddp() -> None:
    """Hugging Face GPT-2 (Conv1D projections, head tied to the embedding, SGD) on 2 stages x 2 replicas with its
    blocks and the weights outside them sharded over the replicas (``data_parallel_mode="fsdp"``): the embeddings on the
    first stage, the final norm on the last, and the tied embedding/head on both (each end computes with it in a
    module's forward), against Lightning's DDP on 2 processes: the same losses, applied gradients (gathered whole) and
    weights."""
    want = launch(2, [{"scenario": "train_ddp", "kwargs": {"model": "hf_gpt2_sgd", "record_steps": True}}], timeout=150)
    assert not want[0].errors, want[0].errors
    whole = want[0].results[0]["local_numel"]

    def check(results: list[Result], label: str) -> None:
        assert_like(results, want[0].results[0], label)
        held = [result["local_numel"] for result in results]  # every rank's: stage 0's replicas, then stage 1's
        assert {"model.transformer.wte.weight", "model.transformer.wpe.weight"} <= set(held[0]), held[0]
        assert {"model.transformer.wte.weight", "model.transformer.ln_f.weight"} <= set(held[-1]), held[-1]
        for stage_held in held:
            for name, numel in stage_held.items():  # every weight, in the blocks or outside them, halved
                assert numel <= (whole[name] + 1) // 2, (label, name, numel, whole[name])

    check_all(4, [pipelined("hf_gpt2_sgd", schedule="1f1b", microbatches=2, pipeline_parallel_size=2,
                            data_parallel_mode="fsdp")], [check], timeout=200)
