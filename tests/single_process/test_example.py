"""Every script in examples/ runs end to end with 2 processes on CPU and writes TensorBoard logs.
The multi-process tests are in ``multi_process/test_example_multiprocess.py``."""

from __future__ import annotations

from copy import deepcopy

import pytest
import torch
from models import _example_gpt


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon: torch 2.9 or later")
def test_the_examples_muon_with_adamw_is_one_optimizer_with_both_parts_state() -> None:
    """Muon steps the blocks' matrices, AdamW the rest; a scheduler's learning rate reaches both; a state dict loaded
    into a fresh copy (as a checkpoint's) continues exactly as the original."""
    example = _example_gpt()

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        torch.manual_seed(0)
        model = example.GPT(vocab_size=11, dim=16, layers=2, heads=2)
        matrices = [p for p in model.blocks.parameters() if p.ndim == 2]
        kept = {id(p) for p in matrices}
        optimizer = example.MuonWithAdamW(matrices, [p for p in model.parameters() if id(p) not in kept], 1e-2, 0.01)
        return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)

    def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: object, seed: int) -> None:
        tokens = torch.randint(0, 11, (4, 9), generator=torch.Generator().manual_seed(seed))
        optimizer.zero_grad()
        model(tokens[:, :-1]).logsumexp(-1).mean().backward()
        optimizer.step()
        scheduler.step()  # type: ignore[attr-defined]

    model, optimizer, scheduler = build()
    muon, adamw = optimizer.parts
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    for seed in range(2):
        step(model, optimizer, scheduler, seed)
    assert [group["lr"] for part in optimizer.parts for group in part.param_groups] == [2.5e-3, 2.5e-3]
    assert all("momentum_buffer" in optimizer.state[p] for p in muon.param_groups[0]["params"])
    assert all("exp_avg" in optimizer.state[p] for p in adamw.param_groups[0]["params"])
    copy, copy_optimizer, copy_scheduler = build()
    copy.load_state_dict(model.state_dict())
    # through a copy, as a checkpoint file would (loading keeps Adam's step-count tensors, so they would be shared)
    copy_optimizer.load_state_dict(deepcopy(optimizer.state_dict()))
    copy_scheduler.load_state_dict(scheduler.state_dict())
    for seed in (2, 3):
        step(model, optimizer, scheduler, seed)
        step(copy, copy_optimizer, copy_scheduler, seed)
    for (name, value), other in zip(model.state_dict().items(), copy.state_dict().values(), strict=True):
        assert torch.equal(value, other), name
    with pytest.raises(ValueError, match="takes its parameters when it is built"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, 2))]})
