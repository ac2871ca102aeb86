"""Gradients across stages: weights held by every stage, the global clipping norm and the fp16 inf/NaN verdict."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_pp import _compat

__all__ = ["PipelineGradients", "broadcast_from_rank_zero"]


def _coalesced(tensors: Iterable[Tensor]) -> dict[torch.dtype, list[Tensor]]:
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    return by_dtype


def _through_one_collective(tensors: list[Tensor], collective: Callable[[Tensor], object],
                            device: torch.device) -> list[Tensor]:
    """Run ``collective`` in place on one flat copy of ``tensors`` (one dtype); return its pieces, shaped like them."""
    flat = torch.cat([t.detach().reshape(-1).to(device) for t in tensors])
    collective(flat)
    pieces, offset = [], 0
    for t in tensors:
        pieces.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return pieces


def broadcast_from_rank_zero(tensors: Iterable[Tensor], device: torch.device) -> None:
    """Give every rank rank 0's values of ``tensors`` (the weights and buffers every stage holds), as DDP does at start:
    ranks seeded differently would otherwise each train their own copy. One broadcast per dtype."""
    with torch.no_grad():
        for group in _coalesced(t for t in tensors if t.numel() > 0).values():
            for t, value in zip(group, _through_one_collective(group, lambda flat: dist.broadcast(flat, src=0), device),
                                strict=True):
                t.copy_(value)


class PipelineGradients:
    """What the optimizer step needs beyond one stage: ``shared`` are the parameters every stage holds (outside the
    blocks), whose gradients are summed over the pipeline; the others belong to one stage's blocks."""

    def __init__(self, shared: list[nn.Parameter], stage: int, num_stages: int, device: torch.device) -> None:
        self.shared = shared
        self.stage = stage
        self.num_stages = num_stages
        self.device = device

    def sum_shared(self) -> None:
        """Sum the gradients of the shared parameters over all stages (one collective per dtype).

        Which of them have gradients is decided each step from ``grad`` (so weights frozen or unfrozen during training,
        as ``BackboneFinetuning`` does, are followed), and agreed on by every stage.
        """
        if self.num_stages == 1 or not self.shared:
            return
        has_grad = torch.tensor([p.grad is not None for p in self.shared], dtype=torch.int32, device=self.device)
        dist.all_reduce(has_grad)
        used = [p for p, n in zip(self.shared, has_grad.tolist(), strict=True) if n > 0]
        for group in _coalesced(used).values():
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in group]
            for p, summed in zip(group, _through_one_collective(grads, dist.all_reduce, self.device), strict=True):
                p.grad = summed.clone()

    def clip_by_global_norm(self, params: Iterable[nn.Parameter], clip_val: float) -> None:
        """``clip_grad_norm_`` over the whole pipeline: squared norms summed over stages, each weight counted once."""
        shared = {id(p) for p in self.shared}
        grads = [(p, p.grad) for p in params if p.grad is not None]
        squared = torch.zeros((), dtype=torch.float64, device=self.device)
        for p, grad in grads:
            if id(p) not in shared or self.stage == 0:
                squared += torch.linalg.vector_norm(grad.detach(), dtype=torch.float64) ** 2
        if self.num_stages > 1:
            dist.all_reduce(squared)
        scale = torch.clamp(clip_val / (squared.sqrt() + 1e-6), max=1.0)
        for _, grad in grads:
            grad.mul_(scale.to(grad.dtype))

    def unscale_agreeing(self, scaler: torch.amp.GradScaler, unscale: Callable[[Optimizer], None],
                         optimizer: Optimizer) -> None:
        """Unscale, then make the inf/NaN verdict the same on every stage (the max over the pipeline)."""
        unscale(optimizer)
        found = _compat._found_inf_per_device(scaler, optimizer)
        verdict = torch.zeros((), dtype=torch.float32, device=self.device)
        for value in found.values():
            verdict = torch.maximum(verdict, value.to(self.device).reshape(()))
        if self.num_stages > 1:
            dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
        if not found:
            found[self.device] = verdict
        for value in found.values():
            value.copy_(verdict.to(value.device))
