"""Weights outside the blocks kept only on the ranks that use them (``outside_weights="where_used"``).

Single-process tier: the decision rule on a toy module, the other rank's flags given by hand. Multi-process tier: who
holds what in real jobs (that training still equals one device is checked by every equivalence test, which run with
the default placement).
The multi-process tests are in ``multi_process/test_placement_multiprocess.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from lightning_pp import PipelineParallelStrategy
from lightning_pp.errors import PipelineConfigError
from lightning_pp.model.placement import WeightPlacement


class Toy(nn.Module):
    """An embedding and a position table before the blocks, a head after them, a scale the module holds itself."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, padding_idx=0)
        self.pos = nn.Embedding(8, 4)
        self.blocks = nn.Sequential(nn.Linear(4, 4))
        self.head = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.ones(()))


def outside(module: nn.Module) -> list[nn.Parameter]:
    return [p for name, p in module.named_parameters() if not name.startswith("blocks.")]


def place(module: nn.Module, step: Callable[[], torch.Tensor], position: int, used_elsewhere: bool = True,
          optimizer: torch.optim.Optimizer | None = None) -> tuple[WeightPlacement, list[str]]:
    """Observe ``step`` (whose loss is back-propagated) on ``position`` of 2; the other rank keeps every weight and,
    with ``used_elsewhere``, uses every weight."""
    placement = WeightPlacement(module, outside(module), position, 2, module.blocks)
    assert placement.wants_observation()
    placement.observe()
    with placement.reads():
        loss = step()
    loss.backward()

    def any_rank(flags: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(flags) if used_elsewhere else flags

    def every_rank(keeps: torch.Tensor) -> torch.Tensor:
        other = torch.ones_like(keeps)
        return torch.stack([keeps, other] if position == 0 else [other, keeps])

    lines = placement.decide(any_rank, every_rank, lambda rank: rank, [optimizer] if optimizer else [])
    return placement, lines


def test_a_module_whose_output_is_replaced_becomes_a_shape_only_stand_in() -> None:
    """The last stage runs the embedding, but the received activation replaces its output: the embedding's weight
    leaves, and its module returns NaN of the right shape and dtype; the position table, never called, raises."""
    toy = Toy()
    emb_weight, pos_weight = toy.emb.weight, toy.pos.weight
    toy.pos.forward = toy.pos.forward  # type: ignore[method-assign]  # set on the instance (as hook libraries do): must not bypass the stand-in
    optimizer = torch.optim.AdamW(toy.parameters())
    received = torch.randn(2, 5, 4)

    def last_stage_step() -> torch.Tensor:
        toy.emb(torch.randint(10, (2, 5)))  # computed, then replaced by what the previous stage sent
        assert toy.emb.weight.dtype == torch.float32  # a metadata read is no use
        return (toy.head(toy.blocks(received)) * toy.scale).sum()

    placement, lines = place(toy, last_stage_step, position=1, optimizer=optimizer)
    assert placement.users == {id(emb_weight): {0}, id(pos_weight): {0}}
    out = toy.emb(torch.tensor([[1, 2, 3]]))
    assert out.shape == (1, 3, 4) and out.dtype == torch.float32 and out.isnan().all() and not out.requires_grad
    assert toy.emb.padding_idx == 0  # plain attributes stay readable
    assert toy.emb.weight.shape == (10, 4) and toy.emb.weight.device.type == "meta"  # metadata reads work
    with pytest.raises(PipelineConfigError, match="did not call it"):
        toy.pos(torch.tensor([0]))
    assert emb_weight.numel() == 0 and emb_weight.grad is None  # the memory is gone
    assert sorted(toy.state_dict()) == ["blocks.0.bias", "blocks.0.weight", "head.bias", "head.weight", "scale"]
    assert {id(p) for p in optimizer.param_groups[0]["params"]} == {id(p) for p in toy.parameters()}
    assert placement.missing_keys(1) == {"emb.weight", "pos.weight"} and placement.missing_keys(0) == set()
    assert "of 5 weights" in lines[0] and ", 2 (" in lines[0], lines
    assert {id(p) for p in placement.held()} == {id(toy.head.weight), id(toy.head.bias), id(toy.scale)}

    sources: list[tuple[list[torch.Tensor], int]] = []
    placement.restore(lambda tensors, position: sources.append((tensors, position)))
    assert isinstance(toy.emb, nn.Embedding) and toy.emb.weight is emb_weight and emb_weight.shape == (10, 4)
    assert [(len(tensors), position) for tensors, position in sources] == [(2, 0)]
    assert placement.users == {} and placement.wants_observation()


def test_a_module_whose_output_the_step_reads_after_the_blocks_stays() -> None:
    """On the last stage the embedding of the targets, read after the blocks without a gradient (a regression target),
    is used by value: its module stays whole there (a stand-in would hand NaN to the loss)."""
    toy = Toy()
    received = torch.randn(2, 5, 4)

    def last_stage_step() -> torch.Tensor:
        hidden = toy.head(toy.blocks(received))
        target = toy.emb(torch.randint(10, (2, 5))).detach()[..., :3]
        return ((hidden - target) ** 2).sum() * toy.scale

    _, lines = place(toy, last_stage_step, position=1)
    assert isinstance(toy.emb, nn.Embedding) and toy.emb.weight.numel() == 40
    assert any("`emb` stays here: the step calls it after the blocks" in line for line in lines), lines


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.temperature = nn.Parameter(torch.ones(()))  # a scalar: FSDP2 cannot shard it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.temperature


def test_shardable_modules_are_those_read_only_in_their_own_forward() -> None:
    """With ``data_parallel_mode="fsdp"`` (one replica here: the world's agreement is this rank's flags): the head, read
    in its own forward, becomes a unit; a scalar weight's module and the scale the LightningModule holds itself stay
    whole."""
    toy = Toy()
    toy.temp = Scaled()
    received = torch.randn(2, 5, 4)

    def last_stage_step() -> torch.Tensor:
        return toy.temp(toy.head(toy.blocks(received)) * toy.scale).sum()

    placement, _ = place(toy, last_stage_step, position=1)
    units, bare = placement.shardable(lambda flags: flags)
    assert [path for path, _ in units] == ["head"] and bare == []
    sharded = {id(p) for p in placement.sharded_weights()}  # and those this rank released: the other rank's to say
    assert {id(toy.head.weight), id(toy.head.bias)} <= sharded
    assert id(toy.temp.temperature) not in sharded and id(toy.scale) not in sharded


class PatchEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.projection = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection(x)


class Embeddings(nn.Module):
    """A weight of its own and a submodule with weights, as Hugging Face's ``ViTEmbeddings``."""

    def __init__(self) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(4))
        self.patch_embeddings = PatchEmbedding()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.patch_embeddings(x) + self.cls_token


class WithSubmodules(nn.Module):
    """Embeddings whose submodule the code before the blocks reads on every stage, as Hugging Face's ViT reads
    ``self.embeddings.patch_embeddings.projection.weight.dtype``."""

    def __init__(self) -> None:
        super().__init__()
        self.embeddings = Embeddings()
        self.blocks = nn.Sequential(nn.Linear(4, 4))
        self.head = nn.Linear(4, 3)


def test_a_stand_ins_submodules_can_be_read_not_called() -> None:
    model = WithSubmodules()
    received = torch.randn(2, 4)

    def last_stage_step() -> torch.Tensor:
        dtype = model.embeddings.patch_embeddings.projection.weight.dtype
        model.embeddings(torch.randn(2, 4).to(dtype))  # replaced by what the previous stage sent
        return model.head(model.blocks(received)).sum()

    place(model, last_stage_step, position=1)
    patch = model.embeddings.patch_embeddings
    assert patch.projection.weight.dtype == torch.float32 and patch.projection.weight.device.type == "meta"
    assert patch.projection.out_features == 4
    with pytest.raises(PipelineConfigError, match=r"`embeddings.patch_embeddings` was called on pipeline rank 1, "
                                                  r"where the weights of `embeddings` are not kept.*everywhere"):
        patch(torch.randn(2, 4))
    assert sorted(model.state_dict()) == ["blocks.0.bias", "blocks.0.weight", "head.bias", "head.weight"]


def test_the_first_stage_keeps_what_it_uses_and_drops_the_head() -> None:
    toy = Toy()

    def first_stage_step() -> torch.Tensor:
        ids = torch.randint(10, (2, 5))
        hidden = toy.emb(ids) + toy.pos(torch.arange(5))
        return toy.blocks(hidden).sum()  # stands for what is sent on; its gradient comes back from the next stage

    placement, _ = place(toy, first_stage_step, position=0)
    assert set(placement.users.values()) == {frozenset({1})}  # the head's weight, bias and the scale
    with pytest.raises(PipelineConfigError, match="did not call it"):
        toy.head(torch.zeros(1, 4))
    assert isinstance(toy.emb, nn.Embedding) and toy.scale.numel() == 1  # the module's own weight cannot leave


class Kept(nn.Module):
    """Weights whose use cannot be observed or stood in for."""

    def __init__(self) -> None:
        super().__init__()
        self.read_outside = nn.Linear(4, 4)  # read by the step's own code, not its module
        self.no_grad = nn.Linear(4, 4)  # run under torch.no_grad()
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.data_dependent = DataDependent()
        self.unused = nn.Linear(4, 4)  # no rank uses it
        self.blocks = nn.Sequential(nn.Linear(4, 4))


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight
        return y[: int(y.sum().item() > 0) + 1]  # reads a value: cannot run on the meta device


def test_weights_whose_use_cannot_be_observed_or_stood_in_for_stay() -> None:
    """Read by the step's own code or with gradients off: used. Frozen: not observed until trainable. A module that
    does not run on the meta device: kept, with the reason in a log line. Never called: gone."""
    kept = Kept()
    x = torch.randn(2, 4)

    def step() -> torch.Tensor:
        nn.functional.linear(x, kept.read_outside.weight)  # output unused, but read outside its module
        with torch.no_grad():
            kept.no_grad(x)
        kept.frozen(x)
        kept.data_dependent(x)  # output unused
        return kept.blocks(x).sum()

    placement, lines = place(kept, step, position=1)
    assert all(isinstance(m, nn.Linear) for m in (kept.read_outside, kept.no_grad, kept.frozen))
    assert isinstance(kept.data_dependent, DataDependent) and kept.data_dependent.weight.numel() == 16
    assert any("`data_dependent` stays here" in line and "meta device" in line for line in lines), lines
    assert not isinstance(kept.unused, nn.Linear)  # never called here, used by the other rank
    assert not placement.wants_observation()
    kept.frozen.requires_grad_(True)  # unfrozen (BackboneFinetuning): observed again on the next training step
    assert placement.wants_observation()


def test_weights_no_rank_uses_stay_everywhere() -> None:
    """An evaluation-only module (here: the embeddings, which no rank's training step used) stays on every rank."""
    toy = Toy()
    placement, _ = place(toy, lambda: toy.head(toy.blocks(torch.randn(2, 4))).sum(), position=1, used_elsewhere=False)
    assert placement.users == {} and isinstance(toy.emb, nn.Embedding) and toy.emb.weight.numel() == 40


def test_outside_weights_argument_is_checked() -> None:
    with pytest.raises(PipelineConfigError, match="outside_weights='somewhere'"):
        PipelineParallelStrategy(outside_weights="somewhere")


