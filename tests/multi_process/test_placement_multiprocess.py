"""Weights outside the blocks kept only on the ranks that use them (``outside_weights="where_used"``).

Single-process tier: the decision rule on a toy module, the other rank's flags given by hand. Multi-process tier: who
holds what in real jobs (that training still equals one device is checked by every equivalence test, which run with
the default placement).
The single-process tests are in ``single_process/test_placement.py``.
"""

from __future__ import annotations

from typing import Any

from _launch import launch
from torch import nn


def outside(module: nn.Module) -> list[nn.Parameter]:
    return [p for name, p in module.named_parameters() if not name.startswith("blocks.")]


def held_outside(result: dict[str, Any], blocks: str) -> set[str]:
    return {k for k in result["state"] if not k.startswith(blocks)}


def test_real_jobs_hold_each_weight_where_it_is_used() -> None:
    """Hugging Face GPT-2 on 2 stages: the tied embedding/head on both, the position table on the first, the final
    norm on the last; the tied LM on 4 stages: the embedding on the first and last only (their own group sums its
    gradient); with ``outside_weights="everywhere"`` every stage holds everything."""
    gpt2 = launch(2, [{"scenario": "train", "kwargs": {"model": "hf_gpt2", "schedule": "1f1b"}}], timeout=200)
    first, last = (held_outside(rank.results[0], "model.transformer.h.") for rank in gpt2)
    assert any("wpe" in k for k in first) and not any("wpe" in k for k in last), (first, last)
    assert any("ln_f" in k for k in last) and not any("ln_f" in k for k in first), (first, last)
    assert any("wte" in k for k in first) and any("wte" in k for k in last), (first, last)
    runs = [{"scenario": "train", "kwargs": {"model": "tied", "microbatches": 4, **extra}}
            for extra in ({}, {"outside_weights": "everywhere"})]
    tied = launch(4, runs, timeout=200)
    assert [sorted(held_outside(rank.results[0], "blocks.")) for rank in tied] == [
        ["embed.weight"], [], [], ["embed.weight", "norm.bias", "norm.weight"]]
    assert all(sorted(held_outside(rank.results[1], "blocks.")) == ["embed.weight", "norm.bias", "norm.weight"]
               for rank in tied)
