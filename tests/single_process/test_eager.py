"""Single-process tier of the eager passes (generation through the pipeline, ``lightning_pp.model.eager``): the
channels' capacities both ends agree on, which caches the fast path mirrors, and that a mirrored Hugging Face cache
reads as the one its layers were computed in.
The multi-process tier is in ``test_real_models_multiprocess.py`` (``generat``)."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from lightning_pp.model import eager
from lightning_pp.model.eager import CacheMirror, cache_of

transformers = pytest.importorskip("transformers")


def test_a_channel_grows_with_headroom_and_shrinks_only_when_four_times_too_large() -> None:
    capacity = eager._FIRST_CAPACITY
    assert eager._next_capacity(capacity, 100) == capacity  # fits: the same message length next time
    grown = eager._next_capacity(capacity, 1000)
    assert grown >= 1250 and grown % 16 == 0
    assert eager._next_capacity(grown, 1100) == grown  # a sequence one token longer fits without an announcement
    assert eager._next_capacity(grown, 400) == grown
    assert eager._next_capacity(64_000, 4_000) == eager._aligned(5_000)  # the prompt's pass, then one token each


def _layers(cache: object) -> list[tuple[int, tuple[int, int]]]:
    return [(layer.get_seq_length(), layer.get_mask_sizes(1)) for layer in cache.layers]  # type: ignore[attr-defined]


def _two_kinds_of_layer() -> tuple[object, object]:
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    caches = []
    for _ in range(2):
        cache = DynamicCache()
        cache.layers = [DynamicLayer(), DynamicSlidingWindowLayer(sliding_window=3), DynamicLayer()]
        caches.append(cache)
    return caches[0], caches[1]


def test_a_dynamic_cache_is_mirrored_from_the_descriptions_its_owner_sends() -> None:
    """Layers 0 and 1 are computed on the owner, layer 2 on the receiver: after every pass the receiver's copy of 0
    and 1 (meta tensors) reads as the owner's (lengths, mask sizes, a sliding window's count), its own layer stays."""
    owner_cache, receiver_cache = _two_kinds_of_layer()
    owner, receiver = CacheMirror(), CacheMirror()
    for tokens in (5, 1, 1, 1):
        owner.before_blocks(owner_cache)
        for index in (0, 1):
            owner_cache.update(torch.randn(2, 2, tokens, 4), torch.randn(2, 2, tokens, 4), index)  # type: ignore
        owner.after_blocks()
        carried = json.loads(json.dumps(owner.carried))  # as it travels: JSON in the message's header
        assert sorted(carried) == ["0", "1"]
        receiver.arrived(carried, receiver_cache)
        receiver.before_blocks(receiver_cache)
        receiver_cache.update(torch.randn(2, 2, tokens, 4), torch.randn(2, 2, tokens, 4), 2)  # type: ignore
        receiver.after_blocks()
        receiver.arrived(json.loads(json.dumps(receiver.carried)), receiver_cache)  # its own layer: left as it is
        owner.reset()
        receiver.reset()
        owner_cache.update(torch.randn(2, 2, tokens, 4), torch.randn(2, 2, tokens, 4), 2)  # type: ignore
        assert _layers(receiver_cache) == _layers(owner_cache)
        assert receiver_cache.get_seq_length() == owner_cache.get_seq_length()  # type: ignore[attr-defined]
    assert receiver_cache.layers[0].keys.is_meta and not receiver_cache.layers[2].keys.is_meta  # type: ignore


def test_a_cache_grown_as_its_layers_are_first_updated_is_mirrored_too() -> None:
    from transformers.cache_utils import DynamicCache

    owner_cache, receiver_cache = DynamicCache(), DynamicCache()
    owner = CacheMirror()
    owner.before_blocks(owner_cache)
    for index in range(3):
        owner_cache.update(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), index)
    owner.after_blocks()
    CacheMirror().arrived(json.loads(json.dumps(owner.carried)), receiver_cache)
    assert len(receiver_cache.layers) == 3 and receiver_cache.get_seq_length() == 4
    assert list(receiver_cache.layers[2].keys.shape) == [1, 2, 4, 8]


def test_only_hugging_face_dynamic_caches_are_mirrored_others_are_told_once(caplog: pytest.LogCaptureFixture) -> None:
    from transformers.cache_utils import DynamicCache

    class OwnCache(DynamicCache):
        pass

    cache = DynamicCache()
    assert cache_of((torch.zeros(1), None), {"mask": torch.ones(1), "use_cache": True}, 0) == (None, True)
    assert cache_of((torch.zeros(1), cache), {}, 0) == (cache, True)
    with caplog.at_level(logging.INFO, logger="lightning_pp.model.eager"):
        assert cache_of((torch.zeros(1), OwnCache()), {}, 3) == (None, False)
        assert cache_of((torch.zeros(1), OwnCache()), {}, 4) == (None, False)
    told = [record.getMessage() for record in caplog.records if "OwnCache" in record.getMessage()]
    assert len(told) == 1 and "meta device" in told[0] and "block 3" in told[0], told
    assert cache_of((cache, DynamicCache()), {}, 0) == (None, False)  # two caches: not one the mirror follows


def _exchange(rank: int, port: int, host_group: bool) -> None:
    """Rank 0 sends rank 1 messages that fit, grow the channel, shrink it and grow it a token at a time; rank 2
    broadcasts structures to all. ``host_group``: the headers on a group of their own, as on NCCL."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_pp.model.eager import EagerLink

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=3, timeout=timedelta(seconds=60))
    try:
        link = EagerLink(None, torch.device("cpu"), 30.0, where=lambda: f"rank {rank}", hook=lambda: None)
        if host_group:
            link.host_group = dist.new_group(backend="gloo")
        sizes = [(2, 3), (64, 256), (2, 256), *((1, n, 8) for n in range(4, 40))]
        for step, shape in enumerate(sizes):
            value = (torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) + step, {"step": step})
            if rank == 0:
                link.send(value, [1], "a test's value", note={"0": ["layer", step]})
            elif rank == 1:
                got, note = link.recv(0, "a test's value")
                assert torch.equal(got[0], value[0]) and got[1] == {"step": step} and note == {"0": ["layer", step]}
            shared = link.broadcast([torch.full(shape, float(step)), None, "x"] if rank == 2 else None, 2, "a test's")
            assert torch.equal(shared[0], torch.full(shape, float(step))) and shared[1:] == [None, "x"]
        assert link.broadcast(None if rank else torch.ones(0), 0, "an empty tensor").shape == (0,)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("host_group", [False, True], ids=["one packet", "headers on the host"])
def test_messages_of_any_size_arrive_whole_point_to_point_and_broadcast(host_group: bool) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_exchange, args=(port, host_group), nprocs=3, join=True)
