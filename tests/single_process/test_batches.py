"""Batches: micro-batches of any batch Lightning accepts (per-sample lists, dataclasses), and the same batch on every
stage of a pipeline, checked (issue 39, findings 1 and 2).
The multi-process tests are in ``multi_process/test_batches_multiprocess.py``."""

from __future__ import annotations

import time
from collections import namedtuple
from dataclasses import dataclass, field

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_pp import PipelineConfigError
from lightning_pp.model.batches import BatchGuard, fingerprint, refuse_wrong_sampler
from lightning_pp.runtime.microbatch import merge_microbatches, split_batch, whole


def test_per_sample_lists_are_split_with_the_tensors() -> None:
    batch = {"x": torch.arange(10).reshape(5, 2), "text": ["a", "b", "c", "d", "e"], "ids": (1, 2, 3, 4, 5),
             "config": [0.1, 0.2], "name": "run"}
    micro, sizes = split_batch(batch, 2)
    assert sizes == [3, 2]
    assert micro[0]["text"] == ["a", "b", "c"] and micro[1]["text"] == ["d", "e"]
    assert micro[1]["ids"] == (4, 5) and type(micro[1]["ids"]) is tuple
    assert micro[0]["config"] == micro[1]["config"] == [0.1, 0.2]  # another length: shared
    assert micro[1]["name"] == "run"
    assert merge_microbatches([m["text"] for m in micro], sizes) == batch["text"]


def test_a_batch_of_strings_alone_and_transposed_columns() -> None:
    micro, sizes = split_batch(["a", "b", "c", "d"], 2)
    assert micro == [["a", "b"], ["c", "d"]] and sizes == [2, 2]
    # default_collate of two string fields per sample: one list per field, one string per sample in each
    columns = [torch.zeros(3), [["a", "b", "c"], ["x", "y", "z"]]]
    micro, _ = split_batch(columns, 3)
    assert micro[2][1] == [["c"], ["z"]]


@dataclass
class _Batch:
    x: torch.Tensor
    names: list[str]
    scale: float = 1.0
    derived: int = field(init=False, default=0)


@dataclass(frozen=True)
class _Frozen:
    x: torch.Tensor
    y: torch.Tensor


def test_dataclasses_and_namedtuples_are_split_like_dicts() -> None:
    batch = _Batch(torch.arange(8), [str(i) for i in range(8)], scale=2.0)
    batch.derived = 5
    micro, sizes = split_batch(batch, 4)
    assert sizes == [2, 2, 2, 2]
    assert isinstance(micro[1], _Batch) and torch.equal(micro[1].x, torch.tensor([2, 3]))
    assert micro[1].names == ["2", "3"] and micro[1].scale == 2.0 and micro[1].derived == 5
    merged = merge_microbatches(micro, sizes)
    assert torch.equal(merged.x, batch.x) and merged.names == batch.names
    frozen, _ = split_batch(_Frozen(torch.zeros(4, 2), torch.ones(4)), 2)
    assert isinstance(frozen[0], _Frozen) and frozen[0].x.shape == (2, 2)
    pair = namedtuple("pair", "x tags")
    micro, _ = split_batch(pair(torch.zeros(4), ["a", "b", "c", "d"]), 2)
    assert micro[1].tags == ["c", "d"] and isinstance(micro[1], pair)


def test_whole_keeps_a_list_as_long_as_the_batch_in_every_microbatch() -> None:
    weights = whole([1.0, 0.5, 0.5, 1.0])
    assert weights == [1.0, 0.5, 0.5, 1.0] and isinstance(weights, list)
    micro, _ = split_batch({"x": torch.zeros(4, 3), "loss_weights": weights}, 2)
    assert micro[0]["loss_weights"] == micro[1]["loss_weights"] == [1.0, 0.5, 0.5, 1.0]
    with pytest.raises(PipelineConfigError, match="whole\\(\\) marks a list or tuple"):
        whole(torch.zeros(2))  # type: ignore[type-var]


def test_ambiguous_sequences_are_refused_with_the_rule() -> None:
    with pytest.raises(PipelineConfigError, match=r"list of 2 sequences of 2 items each.*rows.*columns.*whole"):
        split_batch({"x": torch.zeros(2), "tokens": [["a", "b"], ["c", "d"]]}, 2)
    with pytest.raises(PipelineConfigError, match=r"lists of values have lengths \[2, 3\]"):
        split_batch({"a": ["x", "y"], "b": ["x", "y", "z"]}, 2)
    guard = BatchGuard(None, 0, lambda rank: 0, 10.0, lambda: None, (1, 0))
    with guard.checking("training_step", ({"x": torch.zeros(8, 2), "config": [1, 2, 3, 4]}, 0)):
        pass  # four items in a batch of eight: shared
    with pytest.raises(PipelineConfigError, match=r"batch\['config'\] is a list of 4 items in a batch of 4 samples, "
                                                  r"so it is split.*earlier batch of 8 samples.*whole\(\.\.\.\)"), \
            guard.checking("training_step", ({"x": torch.zeros(4, 2), "config": [1, 2, 3, 4]}, 1)):
        pass


def test_fingerprint_tells_batches_apart_cheaply() -> None:
    x = torch.randn(8, 3, 32, 32)
    batch = {"x": x, "y": torch.arange(8), "text": [str(i) for i in range(8)]}
    same = {"x": x.clone(), "y": torch.arange(8), "text": [str(i) for i in range(8)]}
    assert fingerprint(batch) == fingerprint(same)
    one_sample = {**same, "x": x.clone()}
    one_sample["x"][5, 1, 16, 16] += 1  # a sampled element of the sixth sample
    swapped = {**same, "y": torch.tensor([1, 0, 2, 3, 4, 5, 6, 7])}
    other_text = {**same, "text": [*same["text"][:7], "z"]}
    shorter = {"x": x[:6], "y": torch.arange(6), "text": same["text"][:6]}
    prints = [fingerprint(b) for b in (batch, one_sample, swapped, other_text, shorter)]
    assert len({tuple(p) for p in prints}) == 5, prints
    assert prints[4][0] == 6.0
    for _ in range(20):
        fingerprint(batch)
    start = time.perf_counter()
    for _ in range(200):
        fingerprint(batch)
    print(f"fingerprint of a batch of 8 images, labels and strings: "
          f"{(time.perf_counter() - start) / 200 * 1e6:.0f} us")


def test_a_distributed_sampler_over_the_world_is_refused_with_the_right_arguments() -> None:
    dataset = TensorDataset(torch.zeros(16, 2))
    world = DataLoader(dataset, sampler=DistributedSampler(dataset, num_replicas=4, rank=3))
    with pytest.raises(PipelineConfigError, match=r"The train DataLoader's DistributedSampler has num_replicas=4, "
                                                  r"rank=3 on global rank 3.*DistributedSampler\(dataset, "
                                                  r"num_replicas=2, rank=1\)"):
        refuse_wrong_sampler(world, 2, 1, "train", 3)
    replicas = DataLoader(dataset, sampler=DistributedSampler(dataset, num_replicas=2, rank=1))
    refuse_wrong_sampler(replicas, 2, 1, "train", 3)
    refuse_wrong_sampler(DataLoader(dataset, shuffle=True), 2, 1, "train", 3)


# ------------------------------------------------------------------------------------------------ 2 gloo ranks


