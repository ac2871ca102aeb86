"""Single-process tier: the backward split into input and weight gradients (zero-bubble schedules) gives autograd's
gradients, whatever reaches a stage's blocks from outside them."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_pp.runtime.backward import backward_input, backward_weight, split_declined
from lightning_pp.runtime.executor import run_stage
from lightning_pp.schedule import build_schedule

WIDTH = 4


class _TwoOutputs(torch.autograd.Function):
    """``(x * w, x + w)``: one operation with two outputs, both of which reach the loss."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(x, w)
        return x * w, x + w

    @staticmethod
    def backward(ctx: Any, product: torch.Tensor, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return product * w + total, product * x + total


def _weight_used_twice(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w @ w  # w joins the input's path at two matmuls, one after the other


def _two_outputs(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    product, total = _TwoOutputs.apply(x, w)
    return 2 * product + 3 * total


@pytest.mark.parametrize("forward", [_weight_used_twice, _two_outputs])
def test_split_backward_gives_every_gradient(forward: Any) -> None:
    """Shapes where torch's own weight pass was wrong before 2.13 (a weight used twice on one path, pytorch#180952)
    or 2.12 (an operation with several outputs, pytorch#170277): ours is split and exact on every torch."""
    torch.manual_seed(0)
    x, w = torch.randn(3, 3, requires_grad=True), nn.Parameter(torch.randn(3, 3))
    grad_out = torch.randn(3, 3)
    dx, dw = torch.autograd.grad(forward(x, w), [x, w], grad_out)
    received = x.detach().requires_grad_()
    assert split_declined([forward(received, w)], [received], [w]) is None
    dinputs, work = backward_input([forward(received, w)], [grad_out], [received], [w])
    assert w.grad is None  # left to the weight pass
    backward_weight(work)
    torch.testing.assert_close(dinputs[0], dx)
    torch.testing.assert_close(w.grad, dw)


def test_an_output_without_the_inputs_runs_the_whole_backward_in_the_input_pass(
        caplog: pytest.LogCaptureFixture) -> None:
    """An output that weights alone lead to (a stage passing on ``norm(table)`` beside its hidden state): the split
    cannot keep its gradient for W, so I runs the whole backward, and says so once."""
    torch.manual_seed(0)
    x, w, table = torch.randn(3, 3, requires_grad=True), nn.Parameter(torch.randn(3, 3)), nn.Parameter(torch.randn(3))
    grads = [torch.randn(3, 3), torch.randn(3)]
    expected = torch.autograd.grad([x @ w, table.tanh()], [x, w, table], grads)
    with caplog.at_level(logging.INFO, logger="lightning_pp.runtime.backward"):
        for _ in range(2):
            w.grad = table.grad = None
            received = x.detach().requires_grad_()
            dinputs, work = backward_input([received @ w, table.tanh()], grads, [received], [w, table])
            torch.testing.assert_close([dinputs[0], w.grad, table.grad], list(expected))  # before W
            backward_weight(work)
            torch.testing.assert_close([w.grad, table.grad], list(expected[1:]))
    said = [r.message for r in caplog.records if "does not depend on its inputs" in r.message]
    assert len(said) <= 1  # once per process (an earlier test may have said it)


class _Block(nn.Module):
    """Attention-like: the hidden state meets ``r`` (computed outside the blocks) through the block's own weights, as
    DeBERTa's disentangled attention meets its relative position embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.query, self.key, self.value = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        content = torch.softmax(self.query(h) @ self.key(r).T, -1) @ self.value(h)
        position = torch.softmax(self.query(r) @ h.T, -1) @ r  # the same query weight on both paths
        return h + content + position.tanh()


class _Model(nn.Module):
    """Two stages of two blocks; ``r = norm(table)`` is computed before the blocks on every stage (``carried``: on stage
    0 only, and sent to stage 1 beside the hidden state) and passed to each block; how it reaches them is ``shape``."""

    def __init__(self, shape: str) -> None:
        super().__init__()
        self.shape = shape
        self.table = nn.Parameter(torch.randn(6, WIDTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        self.head = nn.Linear(WIDTH, 1)

    def outside(self) -> list[nn.Parameter]:
        return [self.table, *self.norm.parameters(), *self.head.parameters()]

    def stage(self, stage: int, h: Any) -> Any:
        r = self.norm(self.table)
        if self.shape == "without_grad":
            r = r.detach()
        if self.shape == "carried" and stage == 1:  # computed on stage 0 only, and sent on beside the hidden state
            h, r = h
        for block in self.blocks[2 * stage:2 * stage + 2]:
            h = block(h, r) if self.shape != "added" else block(h + r, r.detach())
        if stage == 0:
            return (h, r) if self.shape == "carried" else h
        loss = self.head(h).square().mean()
        return loss + r.square().mean() if self.shape == "in_the_loss" else loss


# every forward, then every input gradient, then the weight gradients: each W runs after every other micro-batch's I
_WEIGHTS_LAST = ",".join([*(f"{s}F{mb}" for mb in range(4) for s in (0, 1)),
                          *(f"{s}I{mb}" for mb in range(4) for s in (1, 0)),
                          *(f"{s}W{mb}" for s in (1, 0) for mb in range(4))])


@pytest.mark.parametrize("shape", ["through_block_weights", "added", "without_grad", "in_the_loss", "carried"])
@pytest.mark.parametrize("schedule", ["zbv", "weights_last"])
def test_weight_pass_is_exact_with_a_tensor_from_outside_the_blocks(schedule: str, shape: str,
                                                                     tmp_path: Path) -> None:
    """Stages 0 and 1 on one process (a one-rank V, and a schedule holding every W to the end): stage 1's backward is
    split, and every gradient equals one device's. Before, torch's weight pass ran the graph of ``norm(table)`` twice
    (``Trying to backward through the graph a second time``)."""
    if schedule == "weights_last":
        (tmp_path / "weights_last.csv").write_text(_WEIGHTS_LAST + "\n")
        schedule = str(tmp_path / "weights_last.csv")
    torch.manual_seed(0)
    model = _Model(shape)
    batches = [torch.randn(6, WIDTH) for _ in range(4)]
    for x in batches:
        (model.stage(1, model.stage(0, x)) / len(batches)).backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    def params(stage: int) -> list[nn.Parameter]:
        return [p for block in model.blocks[2 * stage:2 * stage + 2] for p in block.parameters()] + model.outside()

    def forward(stage: int, mb: int, received: Any) -> Any:
        output = model.stage(stage, batches[mb] if received is None else received)
        return output / len(batches) if stage == 1 else output

    run = run_stage(build_schedule(schedule, 1, len(batches), stages_per_rank=2), 0, forward, None, training=True,
                    params=params)
    assert not run.weight_work and not run.outputs  # every W ran, nothing is held
    got = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, msg=name)
