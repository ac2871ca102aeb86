"""Single-process tier: finding the block container, a stage's view of it, and structures crossing a boundary."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_pp import PipelineConfigError
from lightning_pp.model.blocks import find_blocks
from lightning_pp.model.stage import StageOutput, StageView
from lightning_pp.runtime.wire import decode_spec, encode_spec, flatten, unflatten


class Block(nn.Module):
    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))  # a container inside a block
        self.attention_type = "causal"

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.linear(x)) * mask


class NanoStyle(nn.Module):
    """Blocks in an nn.ModuleList inside an nn.ModuleDict, looped in forward with a mask (nanoGPT's layout)."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        blocks = nn.ModuleList([Block() for _ in range(layers)])
        self.transformer = nn.ModuleDict({"wte": nn.Embedding(10, 4), "h": blocks, "ln_f": nn.LayerNorm(4)})
        self.head = nn.Linear(4, 10)

    @property
    def blocks(self) -> nn.ModuleList:
        blocks = self.transformer["h"]
        assert isinstance(blocks, nn.ModuleList)
        return blocks

    def forward(self, tokens: torch.Tensor, upto: int | None = None) -> torch.Tensor:
        x = self.transformer["wte"](tokens)
        mask = torch.ones_like(x)
        blocks = self.blocks
        for block in blocks[: upto if upto is not None else len(blocks)]:
            assert block.attention_type == "causal"  # a plain attribute the loop reads, on stand-ins too
            x = block(x, mask)
        return self.head(self.transformer["ln_f"](x))


def test_finds_the_module_list_of_blocks_not_containers_inside_a_block() -> None:
    name, container = find_blocks(NanoStyle(), None)
    assert name == "transformer.h" and isinstance(container, nn.ModuleList)


def test_finds_a_container_of_blocks_of_a_few_types_not_their_insides() -> None:
    """Attention and feed-forward blocks alternating, a projection block in the middle: no type is a majority, every
    block holds weights. The container is found, not a container inside one of its blocks."""
    from real_models import AlternatingLM

    name, container = find_blocks(AlternatingLM(), None)
    assert name == "layers" and len(container) == 9
    with pytest.raises(PipelineConfigError, match=r"Containers of repeated blocks found: 'layers' \(9 blocks, "):
        find_blocks(AlternatingLM(), "head")
    mixed = nn.ModuleDict({"wte": nn.Embedding(10, 4), "h": nn.ModuleList([Block(), Block()]), "ln_f": nn.LayerNorm(4)})
    assert find_blocks(nn.ModuleDict({"transformer": mixed}), None)[0] == "transformer.h"  # 3 types in 3: no


def test_a_container_of_one_block_is_named_not_reported_missing() -> None:
    """Issue 39, finding 8: a container holding 1 block was reported as no container at all."""
    from models import TooFewLayers

    with pytest.raises(PipelineConfigError, match=r"TooFewLayers's block container 'layers' \(Sequential, 272 "
                                                  r"parameters\) has 1 block; .* at least one block per stage"):
        find_blocks(TooFewLayers(), None)


def test_named_container_and_errors() -> None:
    model = NanoStyle()
    assert find_blocks(model, "transformer.h")[0] == "transformer.h"
    with pytest.raises(PipelineConfigError, match=r"has Linear at 'head', not an nn.Sequential.*'transformer.h' "
                                                  r"\(4 blocks, "):
        find_blocks(model, "head")
    with pytest.raises(PipelineConfigError, match="has nothing at 'nope'"):
        find_blocks(model, "nope")
    with pytest.raises(PipelineConfigError, match=r"has no nn\.Sequential, nn\.ModuleList or nn\.ModuleDict"):
        find_blocks(nn.Sequential(nn.Linear(2, 2)), None)


def test_encoder_decoder_is_ambiguous_and_says_so() -> None:
    model = nn.Transformer(d_model=8, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=16,
                           batch_first=True)
    with pytest.raises(PipelineConfigError, match=r"'decoder.layers' \(2 blocks, .*'encoder.layers' \(2 blocks.*"
                                                  r"encoder-decoder such as nn.Transformer or T5"):
        find_blocks(model, None)


def run_stage_step(model: NanoStyle, view: StageView, received: Any, stop: bool, **kwargs: Any) -> Any:
    with view.microbatch(view.stages[0], received, stop_after_blocks=stop):
        try:
            return model(torch.tensor([[1, 2, 3]]), **kwargs)
        except StageOutput as end:
            return end.output


def test_two_stages_in_one_process_equal_the_whole_model() -> None:
    torch.manual_seed(0)
    whole = NanoStyle()
    expected = whole(torch.tensor([[1, 2, 3]]))
    first, last = NanoStyle(), NanoStyle()
    first.load_state_dict(whole.state_dict())
    last.load_state_dict(whole.state_dict())
    ranges = [range(0, 3), range(3, 4)]
    first_view = StageView("transformer.h", first.transformer["h"], [0], ranges)
    last_view = StageView("transformer.h", last.transformer["h"], [1], ranges)
    # stand-ins hold no weights; state-dict keys keep their full-model names
    assert sorted({k.split(".")[2] for k in last.state_dict() if k.startswith("transformer.h.")}) == ["3"]
    assert len(last.blocks) == 4
    sent = run_stage_step(first, first_view, None, stop=True)
    received = sent.detach().requires_grad_()
    out = run_stage_step(last, last_view, received, stop=False)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out.sum().backward()
    assert received.grad is not None  # the gradient to send upstream
    with pytest.raises(PipelineConfigError, match=r"Block 0 of `transformer\.h` is held by pipeline stage 0"):
        last(torch.tensor([[1, 2, 3]]))  # outside a pipelined step


def test_stand_in_reads_the_blocks_metadata_and_names_the_stage_otherwise() -> None:
    """A model's loop may read its blocks' settings and weights' metadata (``nn.TransformerEncoder`` does): a stand-in
    answers from a meta-device twin, holding no weights itself."""
    model = NanoStyle()
    StageView("transformer.h", model.transformer["h"], [1], [range(0, 2), range(2, 4)])
    stand_in = model.blocks[0]
    assert stand_in.attention_type == "causal"
    twin, real = stand_in.linear, model.blocks[2].linear
    assert isinstance(twin, nn.Linear) and isinstance(real, nn.Linear)
    assert twin.weight.is_meta and twin.weight.shape == real.weight.shape
    assert list(stand_in.parameters()) == [] and list(stand_in.buffers()) == []
    with pytest.raises(AttributeError, match=r"Block 0 of `transformer.h` \(Block\) is held by pipeline stage 0"):
        _ = stand_in.no_such_attribute


def test_in_place_first_block_gets_a_fresh_tensor() -> None:
    blocks = nn.Sequential(nn.Linear(3, 3), nn.ReLU(inplace=True), nn.Linear(3, 3))
    view = StageView("blocks", blocks, [1], [range(0, 1), range(1, 3)])
    received = torch.randn(2, 3).requires_grad_()
    with view.microbatch(1, received, stop_after_blocks=False):
        blocks(torch.zeros(2, 3)).sum().backward()
    assert received.grad is not None


@pytest.mark.parametrize("obj", [
    torch.ones(2),
    (torch.ones(2), None, 3, "x"),
    {"h": torch.ones(2, 3), "scale": None, 1: [torch.zeros(1), 2.5, True]},
    [],
])
def test_structures_round_trip(obj: Any) -> None:
    tensors, spec = flatten(obj)
    rebuilt = unflatten(decode_spec(encode_spec(spec)), tensors)
    assert repr(rebuilt) == repr(obj)


def test_nested_tensors_cross_padded_and_merge_over_microbatches() -> None:
    """What PyTorch's nn.TransformerEncoder hands from layer to layer in evaluation: a nested tensor of sequences of
    different lengths. It travels as a padded tensor and the sizes; micro-batches' nested outputs join into one."""
    from lightning_pp.runtime.microbatch import merge_microbatches

    nested = torch.nested.nested_tensor([torch.randn(3, 4), torch.randn(1, 4)])
    tensors, spec = flatten({"h": nested})
    assert [t.shape for t in tensors] == [(2, 3, 4), (2, 2)]
    rebuilt = unflatten(decode_spec(encode_spec(spec)), tensors)["h"]
    assert rebuilt.is_nested and all(torch.equal(a, b) for a, b in zip(rebuilt.unbind(), nested.unbind(), strict=True))
    more = torch.nested.nested_tensor([torch.randn(2, 4)])
    joined = merge_microbatches([nested, more], [2, 1])
    assert [t.shape[0] for t in joined.unbind()] == [3, 1, 2]
    with pytest.raises(PipelineConfigError, match="nested tensor that requires gradients"):
        flatten(torch.nested.nested_tensor([torch.randn(2, 4)], requires_grad=True))


def test_unsupported_structure_is_our_error() -> None:
    from collections import namedtuple

    Pair = namedtuple("Pair", "a b")
    with pytest.raises(PipelineConfigError, match="handed the next block a Pair"):
        flatten(Pair(torch.ones(1), torch.ones(1)))


def test_checkpointed_blocks_keep_fewer_activations_and_the_same_gradients_with_dropout() -> None:
    """activation_checkpointing: the blocks' activations are recomputed in backward (fewer tensors saved), with the
    random state restored, so dropout draws the same masks and the gradients are the same."""

    def run(every: int) -> tuple[int, list[torch.Tensor]]:
        torch.manual_seed(0)
        blocks = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Tanh()) for _ in range(4)])
        view = StageView("blocks", blocks, [0], [range(0, 4)])
        if every:
            view.checkpoint_blocks(every)
        saved: list[torch.Tensor] = []

        def keep(tensor: torch.Tensor) -> torch.Tensor:
            saved.append(tensor)
            return tensor

        torch.manual_seed(1)
        counting = torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t)
        with counting, view.microbatch(0, None, stop_after_blocks=False):
            loss = blocks(torch.randn(3, 8)).sum()
        loss.backward()
        return len(saved), [p.grad for p in blocks.parameters() if p.grad is not None]

    kept, grads = run(0)
    recomputed, same = run(1)
    assert recomputed < kept / 2, (recomputed, kept)
    for a, b in zip(grads, same, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert run(2)[0] < kept


def test_side_records_travel_packed_and_carry_gradients_back() -> None:
    """A deep model's records cross as one flat tensor per dtype (and gradient need), not one per layer: a 32-layer
    mixture of experts' router logits fit the boundary's tensor limit; gradients reach every record."""
    from lightning_pp.model.sides import split_sides, with_sides

    logits = [torch.randn(6, 4, requires_grad=True) for _ in range(32)]
    records = [[i, "mlp.gate", (logit * 2, logit.argmax(-1))] for i, logit in enumerate(logits)]
    sent = with_sides(torch.ones(2, 3), records)
    tensors, _ = flatten(sent)
    assert len(tensors) == 3  # the activation, the float records, the integer records
    received = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
    output, back = split_sides(unflatten(flatten(sent)[1], received))
    assert torch.equal(output, torch.ones(2, 3)) and [r[:2] for r in back] == [r[:2] for r in records]
    torch.stack([r[2][0].sum() * (i + 1) for i, r in enumerate(back)]).sum().backward()
    sent_float = [t for t in flatten(sent)[0] if t.requires_grad]
    assert len(sent_float) == 1
    torch.autograd.backward(sent_float, [received[k].grad for k, t in enumerate(tensors) if t.requires_grad])
    for i, logit in enumerate(logits):
        assert torch.equal(logit.grad, torch.full((6, 4), 2.0 * (i + 1)))


def test_stand_ins_keep_the_blocks_hooks_pickle_and_leave_submodule_modes_alone() -> None:
    """Forward hooks registered on a block's submodules before the split are on the stand-in's copies too (a user's
    auxiliary-loss collector); a module with stand-ins pickles; swapping a stage's own blocks out and back keeps the
    train/eval mode the user gave their submodules."""
    import pickle

    model = NanoStyle()
    seen: list[int] = []
    for block in model.blocks:
        block.mlp.register_forward_hook(lambda module, args, output: seen.append(output.shape[0]))
        block.mlp[1].eval()  # a submodule kept in eval mode inside a block in train mode
    view = StageView("transformer.h", model.transformer["h"], [0, 2], [range(0, 1), range(1, 2), range(2, 3),
                                                                       range(3, 4)])
    stand_in = model.blocks[1]
    assert next(stand_in.parameters(), None) is None and isinstance(stand_in, Block)
    stand_in.mlp(torch.ones(5, 4, device="meta"))
    assert seen == [5]
    plain = NanoStyle()  # (the lambdas above do not pickle)
    StageView("transformer.h", plain.transformer["h"], [1], [range(0, 2), range(2, 4)])
    assert isinstance(pickle.loads(pickle.dumps(plain)).blocks[0], Block)
    with view.microbatch(0, None, stop_after_blocks=False):
        assert model.blocks[2] is not view.blocks_of(2)[0]  # stage 2's own block is a stand-in in stage 0's pass
    assert model.blocks[2] is view.blocks_of(2)[0] and not model.blocks[2].mlp[1].training
