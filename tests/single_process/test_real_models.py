"""Single-process tier for modules shaped like real models (issue 11): the single-device references the
multi-process comparisons use (``real_models.py``, trained by ``models.fit``) are sane. The pipelined runs,
compared with them by ``support.assert_like``, are in ``multi_process/test_real_models_multiprocess.py``.
"""

from __future__ import annotations

import math

import real_models
import torch
from models import REAL_MODELS
from support import (
    logged,
    reference,
)


# ------------------------------------------------------------------------------------------------------------ tests
def test_single_device_references_are_sane() -> None:
    """What the multi-process tests rely on, checked in one process: every reference trains; the identity denoiser's
    loss is exactly 0; the validation batches make a mean of per-micro-batch ``exp(loss)`` differ from ``exp`` of the
    batch loss; the fine-tuning run unfreezes the tied embedding; splitting a draw by rows gives the same noise; the
    in-place run's balances put an in-place ReLU first on every later stage."""
    for model in REAL_MODELS:
        losses = [value for _, value in logged(reference(model)["history"], "train_loss")]
        assert losses and all(math.isfinite(value) for value in losses), (model, losses)
    assert [value for _, value in logged(reference("denoiser_identity")["history"], "train_loss")] == [0.0] * 4
    for model in ("hf_gpt2", "hf_gpt2_dropout", "tuple_output", "val_ppl", "finetune"):
        losses = [value for _, value in logged(reference(model)["history"], "train_loss")]
        assert losses[-1] < losses[0], (model, losses)

    module = real_models.PerplexityLM()
    optimizer = module.configure_optimizers()
    for (tokens,) in module.train_dataloader():  # one epoch
        optimizer.zero_grad()
        real_models.next_token_loss(module(tokens), tokens).backward()
        optimizer.step()
    (tokens,) = next(iter(module.val_dataloader()))
    with torch.no_grad():
        halves = torch.stack([real_models.next_token_loss(module(half), half) for half in tokens.chunk(2)])
    whole, per_half = halves.mean().exp(), halves.exp().mean()
    assert (per_half - whole) / whole > 1e-3, (float(per_half), float(whole))
    # the best checkpoint is neither the first nor the last, and one of three is dropped: decisions worth comparing
    assert reference("val_ppl")["best_path"] == "epoch=1-step=8.ckpt", reference("val_ppl")["top_k"]

    finetune = reference("finetune")["grads"]
    assert [("backbone.token.weight" in step) for step in finetune] == [False] * 4 + [True] * 8

    generator = torch.Generator().manual_seed(0)
    whole_draw = torch.randn(8, 16, generator=generator.manual_seed(0))
    parts = [torch.randn(2, 16, generator=generator.manual_seed(0) if i == 0 else generator) for i in range(4)]
    assert torch.equal(torch.cat(parts), whole_draw)

    features = real_models.InplaceFeatures().features
    for balance in ([3, 5], [1, 2, 2, 3]):
        starts = [sum(balance[:stage]) for stage in range(1, len(balance))]
        assert all(isinstance(features[i], torch.nn.ReLU) and features[i].inplace for i in starts), balance


