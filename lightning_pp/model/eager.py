"""Passes through the blocks run now, on the whole input, every rank of the pipeline in step: for model code that passes
through the blocks several times in one step (autoregressive generation in ``predict_step``) or outside the steps
(sampling text in ``on_validation_epoch_end``).

Every rank runs the model's code. When the loop reaches a block this rank holds, the block runs. The output of a stage's
last block goes, as one message, to the rank of the next stage only, whose stand-in of that block returns it; the last
stage's output goes to every rank (the first stage's first: it goes on with the next pass's blocks), so the code after
the blocks (the head, a generation loop's sampling and stopping test) sees the real activation everywhere and continues
identically. A stand-in of any other block returns zeros of its input's shape, marked as held elsewhere
(:mod:`lightning_pp.runtime.remote`).

A key/value cache the model hands its blocks (Hugging Face's ``DynamicCache``) must advance on every rank as on one
device, because the model reads it outside the blocks (the length of layer 0 places positions and masks). Its layers
that another stage's blocks fill are mirrored, not recomputed: the rank holding a block describes the cache layers its
blocks changed (each tensor's dtype and shape, the layer's plain values), the description travels with the stage's
output down the pipeline and with the last stage's to every rank, and every other rank sets its copy of those layers to
meta-device tensors of those shapes and those values. A cache of a type :func:`cache_of` does not know keeps the exact
way that needs no knowledge of it: the block's weightless copy runs on the meta device (slower), with one log line.
``LIGHTNING_PP_EAGER=replay`` forces that way and the old transfers (every stage's output broadcast, in three
collectives), for benchmarks and tests.

A message is one collective or one point-to-point transfer: its first bytes say how long it is, its JSON header what it
holds, then the tensors. Both ends of a channel expect a message of the channel's capacity, which both update alike from
each message's length; only a message that does not fit is announced first (a second message). A transfer that does not
complete within the transfer timeout (a pass run on some ranks only, as under ``if self.global_rank == 0``) raises
:class:`~lightning_pp.PipelineCommError` naming the hook and the way out.
"""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_pp._logging import get_logger
from lightning_pp.errors import PipelineCommError
from lightning_pp.runtime.p2p import described_dtensor, rebuilt_dtensor
from lightning_pp.runtime.wire import flatten, pack, packed_size, unflatten, unpack

__all__ = ["CacheMirror", "EagerLink", "cache_of", "replaying"]

log = get_logger(__name__)

_PREFIX = 16  # two int64 before the header: the content's length (negative: the message follows, that long), header's
_ALIGN = 16
_TAG = 0x4541  # gloo matches point-to-point messages per peer and tag: eager messages keep to their own
_FIRST_CAPACITY = 256


def _dtype(name: str) -> torch.dtype:
    """The dtype ``str(dtype)`` names (``"torch.float32"``): any of torch's, as the packets carry bytes."""
    return getattr(torch, name.removeprefix("torch."))  # type: ignore[no-any-return]


def replaying() -> bool:
    """Whether ``LIGHTNING_PP_EAGER=replay`` asks for the old way (see the module doc): benchmarks and tests only."""
    return os.environ.get("LIGHTNING_PP_EAGER", "") == "replay"


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _next_capacity(capacity: int, length: int) -> int:
    """A channel's capacity after a message of ``length`` bytes: a quarter's headroom when it grows (a sequence growing
    by a token per pass announces itself every few passes, not every pass), shrunk when 4 times too large."""
    if length > capacity or 4 * length < capacity:
        return max(_aligned(length + length // 4), _PREFIX)
    return capacity


class EagerLink:
    """Messages of whole structures over the pipeline, each waited for at most ``timeout`` seconds.

    ``where()`` names this rank (its stage), ``hook()`` the Lightning hook running now (None: none). A DTensor (a
    tensor-parallel block's output) travels as this rank's part, to the ranks of its pipeline, which hold the same
    part of the next stage, and is rebuilt there on the mesh ``mesh_of`` gives for its dimension names.
    """

    def __init__(self, group: Any, device: torch.device, timeout: float, where: Callable[[], str],
                 hook: Callable[[], str | None], mesh_of: Callable[[tuple[str, ...]], Any] | None = None,
                 host_group: Any = None) -> None:
        self.group, self.device, self.timeout = group, device, timeout
        self.where, self.hook, self.mesh_of = where, hook, mesh_of
        # a gloo group over the same ranks, for a device other than the CPU (NCCL): the headers travel on the host
        # there, and the tensors after them on the device, so that no receiver reads the device to learn what comes
        self.host_group = host_group if device.type != "cpu" else None
        self.replay = replaying()
        self._sending: list[tuple[Any, torch.Tensor, int, str]] = []  # posted sends: work, buffer, peer, what
        # (kind, source, destination or what) -> the length both ends expect the channel's next packet to have
        self._capacity: dict[tuple[Any, ...], int] = {}

    def broadcast(self, value: Any, source: int, what: str) -> Any:
        """``value`` (meaningful on global rank ``source`` only) on every rank of the pipeline."""
        return self.broadcast_noted(value, source, what)[0]

    def broadcast_noted(self, value: Any, source: int, what: str, note: Any = None) -> tuple[Any, Any]:
        """``value`` and ``note`` (JSON) from global rank ``source`` on every rank of the pipeline."""
        if self.replay:
            return self._broadcast_in_three(value, source, what), note

        def transfer(tensor: torch.Tensor, on_host: bool) -> None:
            self._broadcast(tensor, source, what, self.host_group if on_host else self.group)

        channel = ("broadcast", source, what)
        if dist.get_rank() == source:
            self._send(self._composed(value, note), channel, transfer)
            return value, note
        return self._receive(channel, transfer)

    def send(self, value: Any, destinations: list[int], what: str, note: Any = None, wait: bool = False) -> None:
        """``value`` and ``note`` (JSON) to each of global ranks ``destinations``, in that order (each calls
        :meth:`recv`). Unless ``wait``, returns once posted (a gloo send completes only once its receive is posted, and
        this rank has its own work to go on with): this rank's next :meth:`recv` or :meth:`send` waits for it. A pass's
        last message must be waited for: the run may end after it, and its groups with it."""
        self._finish_sends()
        composed = self._composed(value, note)
        for destination in destinations:
            def transfer(tensor: torch.Tensor, on_host: bool, destination: int = destination) -> None:
                group = self.host_group if on_host else self.group
                work = dist.isend(tensor, destination, group=group, tag=_TAG)
                self._sending.append((work, tensor, destination, what))

            self._send(composed, ("p2p", dist.get_rank(), destination), transfer)
        if wait:
            self._finish_sends()

    def _finish_sends(self) -> None:
        """Wait for the sends posted before (done by now, or at least received: what came since depends on them), so
        that their buffers go and a failure is told."""
        while self._sending:
            work, _, destination, what = self._sending.pop(0)
            self._wait(work, destination, what, "sending")

    def recv(self, source: int, what: str) -> tuple[Any, Any]:
        """What global rank ``source`` sends with :meth:`send`: the value and its note."""
        def transfer(tensor: torch.Tensor, on_host: bool) -> None:
            group = self.host_group if on_host else self.group
            self._wait(dist.irecv(tensor, source, group=group, tag=_TAG), source, what, "waiting for")

        received = self._receive(("p2p", source, dist.get_rank()), transfer)
        self._finish_sends()  # what this rank sent before in the pass has arrived: this depends on it
        return received

    def _composed(self, value: Any, note: Any) -> tuple[bytes, list[torch.Tensor]]:
        """The header (JSON: the structure, each tensor's dtype and shape, the DTensors' layouts, ``note``) and the
        tensors of ``value``."""
        tensors, spec = flatten(value)
        distributed = [[i, *described_dtensor(t)] for i, t in enumerate(tensors) if isinstance(t, DTensor)]
        tensors = [(t.to_local() if isinstance(t, DTensor) else t).detach() for t in tensors]
        header = json.dumps([spec, [[str(t.dtype), list(t.shape)] for t in tensors], distributed, note],
                            separators=(",", ":")).encode()
        return header, tensors

    def _send(self, composed: tuple[bytes, list[torch.Tensor]], channel: tuple[Any, ...],
              transfer: Callable[[torch.Tensor, bool], None]) -> None:
        """One packet of the channel's capacity (the length, the header, the tensors unless they travel apart), after
        an announcement of its length where it does not fit; with a host group, the tensors then on the device."""
        header, tensors = composed
        on_host = self.host_group is not None
        packed, device = ([], torch.device("cpu")) if on_host else (tensors, self.device)
        start = _aligned(_PREFIX + len(header))
        length = packed_size([(t.dtype, list(t.shape)) for t in packed], start)
        capacity = self._capacity.get(channel, _FIRST_CAPACITY)
        following = _next_capacity(capacity, length)
        if length > capacity:  # announced in a packet of the expected length, then sent at its own
            announcement = torch.zeros(capacity, dtype=torch.uint8, device=device)
            announcement[:8].view(torch.int64).fill_(-following)
            transfer(announcement, on_host)
        packet = pack(packed, device, start, following if length > capacity else capacity)
        prefix = torch.tensor([length, len(header)], dtype=torch.int64, device="cpu").view(torch.uint8)
        header_bytes = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        packet[:_PREFIX + len(header)].copy_(torch.cat([prefix, header_bytes]))
        transfer(packet, on_host)
        self._capacity[channel] = following
        if on_host and tensors:
            transfer(pack(tensors, self.device), False)

    def _receive(self, channel: tuple[Any, ...], transfer: Callable[[torch.Tensor, bool], None]) -> tuple[Any, Any]:
        on_host = self.host_group is not None
        device = torch.device("cpu") if on_host else self.device
        capacity = self._capacity.get(channel, _FIRST_CAPACITY)
        packet = torch.empty(capacity, dtype=torch.uint8, device=device)
        transfer(packet, on_host)
        head = _host_head(packet)
        length = int(head[:8].view(torch.int64))
        if length < 0:
            packet = torch.empty(-length, dtype=torch.uint8, device=device)
            transfer(packet, on_host)
            head = _host_head(packet)
            length = int(head[:8].view(torch.int64))
        self._capacity[channel] = _next_capacity(capacity, length)
        header_length = int(head[8:16].view(torch.int64))
        if len(head) < _PREFIX + header_length:
            head = packet[:_PREFIX + header_length].cpu()
        spec, described, distributed, note = json.loads(head[_PREFIX:_PREFIX + header_length].numpy().tobytes())
        layout = [(_dtype(dtype), shape) for dtype, shape in described]
        if on_host:
            packet = torch.empty(packed_size(layout), dtype=torch.uint8, device=self.device)
            if layout:
                transfer(packet, False)
            tensors = unpack(packet, layout)
        else:
            tensors = unpack(packet, layout, _aligned(_PREFIX + header_length))
        for index, dims, placements, shape, stride in distributed:
            assert self.mesh_of is not None  # a DTensor was sent: the job has a mesh
            tensors[index] = rebuilt_dtensor(tensors[index], self.mesh_of(tuple(dims)), placements, shape, stride)
        return unflatten(spec, tensors), note

    def _broadcast_in_three(self, value: Any, source: int, what: str) -> Any:
        """The old way (``LIGHTNING_PP_EAGER=replay``): the header's size, the header, the tensors."""
        mine = dist.get_rank() == source
        header = b""
        tensors: list[torch.Tensor] = []
        if mine:
            header, tensors = self._composed(value, None)
        size = torch.tensor([len(header)], dtype=torch.int64, device=self.device)
        self._broadcast(size, source, what)
        data = (torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device) if mine
                else torch.empty(int(size.item()), dtype=torch.uint8, device=self.device))
        self._broadcast(data, source, what)
        spec, described, distributed, _ = json.loads(data.cpu().numpy().tobytes().decode())
        layout = [(_dtype(dtype), shape) for dtype, shape in described]
        if not layout:
            return value if mine else unflatten(spec, [])
        payload = (pack(tensors, self.device) if mine
                   else torch.empty(packed_size(layout), dtype=torch.uint8, device=self.device))
        self._broadcast(payload, source, what)
        if mine:
            return value
        received = unpack(payload, layout)
        for index, dims, placements, shape, stride in distributed:
            assert self.mesh_of is not None
            received[index] = rebuilt_dtensor(received[index], self.mesh_of(tuple(dims)), placements, shape, stride)
        return unflatten(spec, received)

    def _broadcast(self, tensor: torch.Tensor, source: int, what: str, group: Any = None) -> None:
        work = dist.broadcast(tensor, source, group=group if group is not None else self.group, async_op=True)
        self._wait(work, source, what, "waiting for")

    def _wait(self, work: Any, peer: int, what: str, doing: str) -> None:
        try:
            work.wait(timedelta(seconds=self.timeout))
        except RuntimeError as error:
            hook = self.hook()
            during = f" in `{hook}`" if hook else ""
            direction = "waited for {} from" if doing == "waiting for" else "sent {} to"
            raise PipelineCommError(
                f"Pipeline {self.where()} {direction.format(what)} rank {peer}{during} and failed ({error}). A pass "
                f"through the blocks outside the pipelined step (generation in a hook, several passes in one step) "
                f"runs every stage's blocks on its own rank, so every rank of the pipeline must run it: code under "
                f"`if self.global_rank == 0` runs it on one rank only. Run it on every rank and print or log the "
                f"result on rank 0."
            ) from error


def _host_head(packet: torch.Tensor) -> torch.Tensor:
    """The packet's first bytes on the host, where its length and header are: on a device, one copy (which waits for
    the transfer) of as much as a header usually takes."""
    return packet if packet.device.type == "cpu" else packet[:4096].cpu()


# ------------------------------------------------------------------------------------------------- caches mirrored
_CACHES = {"DynamicCache"}
_LAYERS = {"DynamicLayer", "DynamicSlidingWindowLayer", "LinearAttentionLayer", "LinearAttentionAndFullAttentionLayer",
           "LinearAttentionAndSlidingWindowAttentionLayer"}
_HF_CACHES = "transformers.cache_utils"
_PLAIN = (type(None), bool, int, float, str)
_logged: set[str] = set()  # the cache types said once (a test worker resets sets of this name)


def _objects_in(value: Any, found: list[Any]) -> None:
    if isinstance(value, (tuple, list)):
        for v in value:
            _objects_in(v, found)
    elif isinstance(value, dict):
        for v in value.values():
            _objects_in(v, found)
    elif not isinstance(value, (torch.Tensor, *_PLAIN)):
        found.append(value)


def _known(cache: Any) -> bool:
    kind = type(cache)
    layers = getattr(cache, "layers", None)
    return (kind.__name__ in _CACHES and kind.__module__ == _HF_CACHES and isinstance(layers, list)
            and all(type(layer).__name__ in _LAYERS and type(layer).__module__ == _HF_CACHES for layer in cache.layers)
            and _replicated_known(getattr(cache, "layer_class_to_replicate", None))
            and all(_describable(value) for layer in cache.layers for value in vars(layer).values()))


def _describable(value: Any) -> bool:
    """Whether :func:`_described` describes ``value`` whole (a layer holding anything else is replayed instead)."""
    if isinstance(value, (torch.Tensor, torch.dtype, torch.device, *_PLAIN)):
        return True
    if type(value) is dict:
        return all(isinstance(k, (int, str)) and _describable(v) for k, v in value.items())
    return type(value) in (list, tuple) and all(_describable(v) for v in value)


def _replicated_known(kind: Any) -> bool:
    """Whether a cache's class of the layers it adds as they are first updated (None: none) is one mirrored."""
    return kind is None or (getattr(kind, "__name__", "") in _LAYERS and kind.__module__ == _HF_CACHES)


def cache_of(args: Any, kwargs: Any, index: int) -> tuple[Any, bool]:
    """The cache a block's call hands it (None: nothing besides tensors and plain values), and whether it is one
    :class:`CacheMirror` mirrors; logs once per type that it is not (block ``index`` then replays on the meta device).
    """
    found: list[Any] = []
    _objects_in((args, kwargs), found)
    if not found:
        return None, True
    if len(found) == 1 and _known(found[0]):
        return found[0], True
    kinds = ", ".join(sorted({type(v).__qualname__ for v in found}))
    if kinds not in _logged:
        _logged.add(kinds)
        log.info("Generation through the pipeline: the blocks are handed %s, which the fast path does not mirror; the "
                 "stand-ins of other stages' blocks (block %d first) run their weightless copies on the meta device "
                 "to advance it as on one device (exact, slower).", kinds, index)
    return None, False


def _described(value: Any) -> Any:
    """A JSON description of a cache layer's attribute: a tensor's dtype and shape, plain values as they are."""
    if isinstance(value, torch.Tensor):
        return ["T", str(value.dtype), list(value.shape)]
    if isinstance(value, _PLAIN):
        return ["V", value]
    if isinstance(value, torch.dtype):
        return ["D", str(value)]
    if isinstance(value, torch.device):
        return ["@"]  # mirrored layers live on the meta device
    if type(value) is dict and all(isinstance(k, (int, str)) for k in value):
        return ["{", [[k, _described(v)] for k, v in value.items()]]
    if type(value) in (list, tuple):
        return ["[" if type(value) is list else "(", [_described(v) for v in value]]
    raise TypeError(f"a cache layer's {type(value).__qualname__} (_known replays such caches)")


def _rebuilt(described: list[Any]) -> Any:
    kind = described[0]
    if kind == "T":
        return torch.empty(described[2], dtype=_dtype(described[1]), device="meta")
    if kind == "V":
        return described[1]
    if kind == "D":
        return _dtype(described[1])
    if kind == "@":
        return torch.device("meta")
    if kind == "{":
        return {k: _rebuilt(v) for k, v in described[1]}
    items = [_rebuilt(v) for v in described[1]]  # "[" or "("
    return items if kind == "[" else tuple(items)


def _layer_described(layer: Any) -> list[Any]:
    return [type(layer).__name__, [[name, _described(value)] for name, value in vars(layer).items()]]


class CacheMirror:
    """One rank's part in mirroring a pass's cache (see the module doc): the descriptions of the layers this pass
    changed so far, by layer index, as received from the previous stage and added to by this rank's blocks, and which
    of them this rank's blocks changed (never overwritten by what arrives)."""

    def __init__(self) -> None:
        self.carried: dict[int, list[Any]] = {}
        self._before: list[list[Any]] | None = None
        self._own: weakref.WeakKeyDictionary[Any, set[int]] = weakref.WeakKeyDictionary()
        self._cache: Any = None

    def __getstate__(self) -> dict[str, Any]:  # a copy or a pickle of a stage (and its view) starts with none
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def reset(self) -> None:
        """A pass through the blocks is over."""
        self.carried, self._before, self._cache = {}, None, None

    def before_blocks(self, cache: Any) -> None:
        """This rank's next stage starts its blocks with ``cache`` (one :func:`cache_of` knows, or None)."""
        self._cache = cache
        self._before = [_layer_described(layer) for layer in cache.layers] if cache is not None else None

    def after_blocks(self) -> None:
        """This rank's stage has run its blocks: what they changed joins what is carried on."""
        if self._cache is None or self._before is None:
            return
        before, own = self._before, self._own.setdefault(self._cache, set())
        for index, layer in enumerate(self._cache.layers):
            described = _layer_described(layer)
            if index >= len(before) or described != before[index]:
                self.carried[index] = described
                own.add(index)
        self._before = None

    def arrived(self, carried: dict[str, list[Any]] | None, cache: Any) -> None:
        """``carried`` came with an output (JSON: string keys): mirror it into ``cache`` (None: a cache this rank
        does not mirror) but for the layers this rank's blocks fill, and carry it on."""
        if not carried:
            return
        own = self._own.get(cache, set()) if cache is not None else set()
        for key, described in carried.items():
            index = int(key)
            self.carried[index] = described
            if cache is not None and index not in own:
                _mirror(cache, index, described)


def _mirror(cache: Any, index: int, described: list[Any]) -> None:
    while len(cache.layers) <= index:  # a cache that adds its layers as they are first updated
        cache.layers.append(cache.layer_class_to_replicate())
    layer = cache.layers[index]
    name, attributes = described
    if type(layer).__name__ != name:
        raise PipelineCommError(f"Generation through the pipeline: cache layer {index} is a {type(layer).__name__} "
                                f"here but a {name} on the stage that computes it; every rank must build the same "
                                f"cache (the same model code and transformers version on every rank).")
    state = vars(layer)
    for attribute, value in attributes:
        state[attribute] = _rebuilt(value)
