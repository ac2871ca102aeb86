"""Models larger than one device. One built on the meta device (``trainer.init_module(empty_init=True)``): each rank
gives storage to, and initializes, only what its stage holds (``lightning_pp.model.materialize``).

Single-process: initialization follows the model's own code (Hugging Face's ``_init_weights``, torch's
``reset_parameters``), tied weights stay tied, the values do not depend on which blocks a rank holds, the global random
state is untouched, and what nothing initializes is reported. Multi-process (2 gloo ranks): the memory a rank takes
before training (2 stages; 1 stage sharded over 2 replicas), an uninitialized weight on one stage failing every stage,
and sharding the module applies itself refused. Training equivalence of meta-built GPT-2 and nanoGPT against one
device: ``test_real_models_multiprocess.py``;
of blocks sharded with FSDP2 against DDP: ``test_data_parallel_multiprocess.py``.
The multi-process tests are in ``multi_process/test_large_models_multiprocess.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pp.model.materialize import has_meta_tensors, left_uninitialized, materialize

CPU = torch.device("cpu")


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=64, n_positions=16))


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=64, vocab_size=64))


def _on_meta(build: type[nn.Module] | object) -> nn.Module:
    with torch.device("meta"):
        return build()  # type: ignore[operator, no-any-return]


@pytest.mark.parametrize("build", [_gpt2, _llama, lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4), 2)],
                         ids=["gpt2", "llama", "torch_encoder"])
def test_initialized_as_the_model_initializes_itself(build: object) -> None:
    """Every tensor set, with the statistics of a normal build (HF's normal(0, 0.02), ones and zeros for norms,
    torch's uniform for linear layers), the rotary tables computed, and the global random state as it was."""
    torch.manual_seed(3)
    model = _on_meta(build)
    state = torch.get_rng_state()
    made = materialize(model, CPU)
    assert made and left_uninitialized(model, made) is None
    assert torch.equal(torch.get_rng_state(), state)
    assert not has_meta_tensors(model)
    reference = build()  # type: ignore[operator]
    for (name, got), (_, want) in zip(model.state_dict().items(), reference.state_dict().items(), strict=True):
        assert got.isfinite().all(), name
        if got.is_floating_point() and got.numel() > 64:
            assert abs(got.std() - want.std()) <= 0.2 * want.std() + 1e-6, (name, got.std(), want.std())
            assert abs(got.mean() - want.mean()) <= 0.02 + 0.2 * want.std(), (name, got.mean(), want.mean())
        elif not got.is_floating_point() or got.std() == 0:
            assert torch.equal(got, want), name  # constants (norm weights, rotary tables, ids) exactly


def test_tied_weights_stay_tied_and_values_do_not_depend_on_the_layout() -> None:
    """A stage holding blocks 1-2 gets the values the whole model gets there: each module draws from a stream seeded
    by the job's seed and its name."""
    torch.manual_seed(5)
    whole, stage = _on_meta(_gpt2), _on_meta(_gpt2)
    stage.transformer.h[0] = nn.Identity()  # held by another stage
    for model in (whole, stage):
        assert left_uninitialized(model, materialize(model, CPU)) is None
        assert model.lm_head.weight is model.transformer.wte.weight
    for name, value in stage.state_dict().items():
        assert torch.equal(value, whole.state_dict()[name]), name
    torch.manual_seed(6)
    other_seed = _on_meta(_gpt2)
    materialize(other_seed, CPU)
    assert not torch.equal(other_seed.transformer.h[1].mlp.c_fc.weight, whole.transformer.h[1].mlp.c_fc.weight)


class _Custom(nn.Module):
    """What nothing initializes: a bare parameter, a persistent and a non-persistent buffer, a boolean mask; and a
    norm of its own with ``reset_parameters`` (initialized, though the module has ``_init_weights`` and ``config``
    attributes as a Hugging Face model has: only a real one is treated as one)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)  # fine: reset_parameters
        self.norm = _Norm()
        self.scale = nn.Parameter(torch.ones(4))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("freqs", torch.arange(4.0), persistent=False)
        self.register_buffer("mask", torch.ones(4, 4, dtype=torch.bool).tril(), persistent=False)
        self.config = {}

    def _init_weights(self, module: nn.Module) -> None:
        pass


class _Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def test_what_nothing_initializes_is_reported_with_the_fix() -> None:
    model = _on_meta(_Custom)
    made = materialize(model, CPU)
    report = left_uninitialized(model, made)
    assert report is not None
    for name in ("`scale` (_Custom)", "`steps` (_Custom)", "`freqs` (_Custom)", "`mask` (_Custom)"):
        assert name in report
    assert "linear" not in report and "norm" not in report
    assert "reset_parameters()" in report and "ckpt_path" in report
    # what a checkpoint sets afterwards counts as set
    with torch.no_grad():
        model.scale.fill_(1.0)
        model.steps.zero_()
    report = left_uninitialized(model, made)
    assert report is not None and "`scale`" not in report and "`steps`" not in report and "`mask`" in report


def test_a_module_off_the_meta_device_is_left_alone() -> None:
    model = nn.Linear(3, 3)
    before = model.weight.detach().clone()
    assert materialize(model, CPU) == []
    assert torch.equal(model.weight, before)


def test_the_calculator_prints_its_table() -> None:
    """benchmarks/calculator.py (memory per GPU and the simulator's step for Llama 3 at P x D x T) runs end to end."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[2] / "benchmarks" / "calculator.py"
    table = subprocess.run([sys.executable, str(script), "--table"], capture_output=True, text=True, timeout=120,
                           check=True).stdout
    assert table.count("| llama3-") >= 4, table
