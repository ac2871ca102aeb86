"""Point-to-point transfers between neighbouring stages: a small metadata header, then the tensors.

What crosses a boundary is whatever one block hands the next: a tensor or a structure of tensors and plain values.
The fixed-size header (per tensor: dtype code, ``requires_grad``, number of dimensions, shape) tells the receiver what
was sent without pickling and without shapes or dtypes fixed in advance, so hidden sizes may change from stage to stage
and from batch to batch; the structure itself travels as JSON only when it differs from the channel's last one. The
receiver does not wait for the header to size its buffers, though: both ends expect a transfer to have the layout of
the previous transfer on the same channel (source stage, destination stage, micro-batch), and they agree on that
without talking because both saw that transfer. In the steady state every step looks like the last, and a transfer is
one message, a packet: the header, then the payloads at aligned offsets, which the receiver uses in place (each tensor
shares the packet's memory). When the layout differs (or nothing is expected yet: the first step), the header says so,
the rest of the packet is filler, and the tensors follow in a second packet under another tag. One message per
transfer matters on gloo, where posting a message costs tens of microseconds of the sending and the receiving thread.

Posting receives before the peer sends is what makes transfers cheap: on gloo a send that finds its receive waiting
leaves at once from the sending thread, while one that does not waits for gloo's background thread, which competes
with compute for the CPU. So on gloo each stage keeps the receives of its next ``prefetch`` transfers per direction
posted (:meth:`StageP2P.start_step`).

On NCCL, reading a header on the device would block the host until the transfer arrived, so the host could not queue
work ahead. With ``header_groups`` (gloo groups between the same ranks) the headers travel on the host instead, and are
received ahead as on gloo; a header arrives as soon as the peer's host has posted its send, long before the data. The
payloads then go over NCCL into buffers sized by the header, and the payload operations of consecutive transfer actions
are posted together (``batch_isend_irecv``, :meth:`StageP2P.flush`, which the runtime calls before computing); the
compute stream, not the host, waits for them. Without ``header_groups``, NCCL uses packets as gloo does, each receive
posted when its action runs (NCCL runs the operations between two ranks in posting order, so a receive posted early
could hold back a send to the same peer). On NCCL a payload send's buffers are dropped as soon as it has completed,
checked whenever the next send is posted; gloo's operations (the headers' sends on NCCL too) report completion only once
waited for, so theirs are dropped at the end of the step. A nested tensor (evaluation) is rebuilt from its payloads,
so with ``header_groups`` they are posted and waited for as soon as its header is read.

Sends are asynchronous; a receive waits, at most ``timeout`` seconds, and turns any failure into an error that names
this stage, the action and the peer.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from lightning_pp.errors import PipelineCommError, PipelineConfigError, PipelineTimeoutError
from lightning_pp.parallel.nccl_emulation import EmulatedNcclWork, emulating_nccl, follows_nccl
from lightning_pp.parallel.topology import StageGroups, create_device_mesh, create_groups
from lightning_pp.runtime.wire import (
    Layout,
    Spec,
    decode_spec,
    encode_spec,
    flatten,
    has_nested,
    pack,
    packed_size,
    unflatten,
    unpack,
)
from lightning_pp.schedule.actions import Action, ActionType

__all__ = ["StageP2P", "connect_stages", "described_dtensor", "rebuilt_dtensor"]

_DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    torch.complex64, torch.complex128,
)  # fmt: skip
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}
_MAX_DIMS = 8
_MAX_TENSORS = 16
_PER_TENSOR = 3 + _MAX_DIMS  # dtype code, requires_grad, number of dimensions, dimensions
# spec length (0: the same structure as the channel's previous transfer), number of tensors, then each tensor
_HEADER_LEN = 2 + _MAX_TENSORS * _PER_TENSOR
# gloo matches messages per peer and tag in posting order, so each kind of message has its own tag: a resized tensor
# can then never be taken for the next transfer's payload (NCCL ignores tags: there the order of messages is the same
# on both ends: header, expected payloads or fillers, spec, resized tensors)
_HEADER_TAG, _PAYLOAD_TAG, _RESIZED_TAG, _SPEC_TAG = 1, 2, 3, 4
_RECEIVES = (ActionType.RECV_F, ActionType.RECV_B)

_HEADER_BYTES = 8 * _HEADER_LEN
_TENSOR_SPEC: Spec = {"T": 0}  # the structure of a plain tensor

# (packet buffer, or the header alone on the host; its work; the payload layout the packet has room for)
_PostedReceive = tuple[torch.Tensor, dist.Work, Layout]
_PendingSend = tuple[Action, list[dist.Work], list[torch.Tensor], bool]


_DTENSORS = "dtensors"  # beside a structure's spec: [index, mesh dimension names, placements, shape, stride] each


def described_dtensor(tensor: DTensor) -> list[Any]:
    """How to rebuild ``tensor`` from its local part: mesh dimension names, placements, shape, stride (JSON)."""
    if not tensor.device_mesh.mesh_dim_names:
        raise PipelineConfigError(
            "A block handed on a DTensor on a mesh without dimension names, which the next stage cannot "
            "find. Distribute it on the strategy's mesh (self.device_mesh['tensor_parallel']).")
    codes = []
    for placement in tensor.placements:
        if type(placement) is Shard:
            codes.append(["S", placement.dim])
        elif type(placement) is Replicate:
            codes.append(["R"])
        elif type(placement) is Partial:
            codes.append(["P", placement.reduce_op])
        else:
            raise PipelineConfigError(
                f"A block handed on a DTensor placed as {placement}, which cannot cross pipeline stages "
                f"(Shard, Replicate and Partial can). Let the plan's last layer of each block return a plain tensor "
                f"(use_local_output=True) or redistribute it.")
    return [list(tensor.device_mesh.mesh_dim_names or ()), codes, list(tensor.shape), list(tensor.stride())]


def rebuilt_dtensor(local: torch.Tensor, mesh: Any, codes: list[list[Any]], shape: list[int],
             stride: list[int]) -> torch.Tensor:
    """The DTensor ``local`` is this rank's part of, a leaf that requires gradients where ``local`` does."""
    placements = [Shard(c[1]) if c[0] == "S" else Replicate() if c[0] == "R" else Partial(c[1]) for c in codes]
    rebuilt = DTensor.from_local(local.detach(), mesh, placements, shape=torch.Size(shape), stride=tuple(stride),
                                 run_check=False)
    return rebuilt.requires_grad_(local.requires_grad)


def _pack(header: list[int] | None, payloads: list[torch.Tensor], device: torch.device,
          size: int = 0) -> torch.Tensor:
    """One byte buffer (of at least ``size`` bytes) holding ``header`` (if any) and then ``payloads``."""
    packet = pack(payloads, device, _HEADER_BYTES if header else 0, size)
    if header:
        packet[:_HEADER_BYTES].view(torch.int64).copy_(torch.tensor(header, dtype=torch.int64, device=device))
    return packet


def _posted(work: dist.Work | None) -> dist.Work:
    if work is None:  # torch returns None when this rank is not in the group
        raise RuntimeError("this rank is not a member of the pipeline's process group")
    return work


class StageP2P:
    """The transfers of one rank's stages: ``send`` posts and returns, ``recv`` waits for the peer (bounded by
    ``timeout``). ``stage_ranks[s]`` is the global rank holding stage ``s``.

    What is sent is whatever one block hands the next: a tensor, or tuples / lists / dicts of tensors and plain values
    (see :mod:`lightning_pp.runtime.wire`). Each tensor keeps its ``requires_grad`` across the boundary, so the receiver
    back-propagates exactly into what the sender's graph can use. Call :meth:`start_step` with the stage's actions
    before running them, :meth:`flush` before computing with what was received, and :meth:`wait_sends` after the
    step. ``header_groups`` (gloo groups paired with ``groups``, for NCCL) carry the headers on the host. A DTensor
    (tensor parallelism) crosses as its local part, each tensor-parallel rank to the same rank of the next stage, and
    is rebuilt there as a leaf with its placements on the mesh ``mesh_of`` gives for its dimension names.
    """

    def __init__(
        self,
        stage_ranks: Sequence[int],
        device: torch.device,
        timeout: float,
        groups: Sequence[Any] = (None, None),
        prefetch: int = 2,
        header_groups: Sequence[Any] | None = None,
        mesh_of: Callable[[tuple[str, ...]], Any] | None = None,
        results_group: Any = None,
    ) -> None:
        self.stage_ranks = list(stage_ranks)
        # the lane's gloo group beside NCCL's (or its emulation's) groups, for the step's results (see
        # lightning_pp.model.results); None where the lane's groups are gloo
        self.results_group = results_group
        self.mesh_of = mesh_of
        self.device = device
        self.timeout = timeout
        # activations and gradients travel in separate process groups, i.e. separate connections: on one gloo TCP
        # connection, two stages sending to each other at once stall for milliseconds now and then; on NCCL the two
        # directions get their own streams and do not wait for each other. With several stages per rank one kind can
        # travel both ways between two ranks (interleaved on 2 ranks, the V of zbv): then ``groups`` has four, one
        # per kind and direction (activations up, down, gradients up, down, in rank order)
        self.groups = tuple(groups)
        self.header_groups = tuple(header_groups) if header_groups is not None else None
        # NCCL's control flow on gloo (LIGHTNING_PP_NCCL_EMULATION, for CI): payload operations behave as NCCL's
        self._emulate = emulating_nccl() and dist.get_backend(groups[0]) == "gloo"
        # NCCL's Work.wait does not block the host, so bound its wait by polling; gloo's wait takes a timeout itself
        # (and so do the headers' gloo groups on NCCL, whose operations report completion only once waited for)
        self._poll = follows_nccl(groups[0])
        # headers on the host (gloo) may be received ahead; NCCL receives are posted when their action runs
        self._prefetch = 0 if self._poll and self.header_groups is None else prefetch
        # (source stage, destination stage, micro-batch) -> layout and structure of the last transfer; both ends agree
        self._expected: dict[tuple[int, int, int], Layout] = {}
        self._specs: dict[tuple[int, int, int], Spec] = {}
        self._unposted: dict[ActionType, deque[Action]] = {kind: deque() for kind in _RECEIVES}
        self._posted: dict[Action, _PostedReceive] = {}
        self._posted_count: dict[ActionType, int] = dict.fromkeys(_RECEIVES, 0)
        # (action, works, buffers, polled): works and the buffers they read stay referenced until the send has
        # completed; ``polled``: payloads on NCCL, whose completion the host polls (not the headers' gloo sends)
        self._pending_sends: deque[_PendingSend] = deque()
        self._sends_before_step = 0  # how many of them were posted before this step
        # NCCL: payload operations of consecutive transfer actions, posted together by :meth:`flush`
        self._batch: list[tuple[Action, dist.P2POp]] = []
        # posted payload batches holding receives (and the buffers they use), checked at the step's end
        self._pending_recvs: list[tuple[Action, list[dist.Work], list[torch.Tensor]]] = []

    def start_step(self, actions: Sequence[Action]) -> None:
        """Queue this step's receives in order and post the first ``prefetch`` of each direction."""
        self._sends_before_step = len(self._pending_sends)
        for kind in _RECEIVES:
            self._unposted[kind] = deque(a for a in actions if a.type is kind)
            self._post_ahead(kind)

    def send(self, obj: Any, action: Action) -> None:
        """Post ``obj`` to ``action.peer``; what is sent stays referenced until the send has completed."""
        if type(obj) is torch.Tensor and not obj.is_nested:  # the common case, without walking a structure
            tensors, spec = [obj], _TENSOR_SPEC
        else:
            tensors, spec = flatten(obj)
            distributed = [[i, *described_dtensor(t)] for i, t in enumerate(tensors) if isinstance(t, DTensor)]
            if distributed:  # their local parts travel; the structure says how to rebuild them
                spec = {**spec, _DTENSORS: distributed}
                tensors = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
        for tensor in tensors:
            if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPE_CODE:
                raise PipelineCommError(
                    f"Stage {action.stage} cannot send a tensor of dtype {tensor.dtype} with shape "
                    f"{tuple(tensor.shape)} in {action}: supported are up to {_MAX_DIMS} dimensions and dtypes "
                    f"{[str(d) for d in _DTYPES]}."
                )
        if len(tensors) > _MAX_TENSORS:
            raise PipelineConfigError(
                f"Stage {action.stage} would send {len(tensors)} tensors in {action}; at most {_MAX_TENSORS} cross a "
                f"stage boundary. Return fewer tensors from each block (compute the rest on every stage)."
            )
        key = (action.stage, action.peer, action.microbatch)
        spec_bytes = encode_spec(spec) if self._specs.get(key) != spec else b""
        self._specs[key] = spec
        header = [len(spec_bytes), len(tensors)]
        for tensor in tensors:
            shape = list(tensor.shape)
            header += [_DTYPE_CODE[tensor.dtype], int(tensor.requires_grad), len(shape), *shape]
            header += [0] * (_MAX_DIMS - len(shape))
        header += [0] * (_HEADER_LEN - len(header))
        payloads = [t.detach() for t in tensors]
        layout = [(t.dtype, list(t.shape)) for t in payloads]
        peer = self.stage_ranks[action.peer]
        group = self._group_of(action)
        if self.header_groups is not None:  # NCCL: the header on the host now, the payloads with the next flush
            messages = [(torch.tensor(header, dtype=torch.int64, device="cpu"), _HEADER_TAG)]
            if spec_bytes:
                messages.append((torch.frombuffer(bytearray(spec_bytes), dtype=torch.uint8), _SPEC_TAG))
            self._post_sends(action, messages, self._header_group_of(action), on_host=True)
            self._batch += [(action, dist.P2POp(dist.isend, t.contiguous(), peer, group)) for t in payloads]
            return
        # one packet: the header, then the payloads if they have the layout the receiver expects (it has posted a
        # receive of that size); else the header alone in a packet of that size, and the tensors after it
        expected = self._expected.get(key, [])  # what the receiver has posted room for: nothing at first
        if expected == layout:
            messages = [(_pack(header, payloads, self.device), _PAYLOAD_TAG)]
        else:
            messages = [(_pack(header, [], self.device, packed_size(expected, _HEADER_BYTES)), _PAYLOAD_TAG)]
        if spec_bytes:
            messages.append((torch.frombuffer(bytearray(spec_bytes), dtype=torch.uint8).to(self.device), _SPEC_TAG))
        if expected != layout:
            if payloads:  # the receiver takes the resized tensors only when there are some
                messages.append((_pack(None, payloads, self.device), _RESIZED_TAG))
            self._expected[key] = layout
        self._post_sends(action, messages, group, on_host=False)

    def _post_sends(self, action: Action, messages: list[tuple[torch.Tensor, int]], group: Any, on_host: bool) -> None:
        """Post ``messages`` to ``action``'s peer in ``group``: a headers' group on the host (``on_host``) or one
        the payloads travel in."""
        self._reap_sends()
        peer = self.stage_ranks[action.peer]
        try:
            works = [_posted(dist.isend(buffer, peer, group=group, tag=tag)) for buffer, tag in messages]
        except RuntimeError as error:
            raise self._error(action, "posting the send", error) from error
        polled = self._poll and not on_host
        if polled:
            works = [self._as_nccl(work, action) for work in works]
        self._pending_sends.append((action, works, [buffer for buffer, _ in messages], polled))

    def _reap_sends(self) -> None:
        """Drop the sends that have completed, so their buffers are freed during the step. Any that has, not only the
        oldest: on NCCL the headers' gloo sends report completion only once waited for, at the step's end."""
        still: deque[_PendingSend] = deque()
        before_step = self._sends_before_step
        for index, (action, works, buffers, polled) in enumerate(self._pending_sends):
            if polled and all(work.is_completed() for work in works):  # gloo: only once waited for
                for work in works:  # completed: returns at once, and raises what the transfer failed with
                    self._wait(work, action, "completing the send", polled)
                before_step -= index < self._sends_before_step
            else:
                still.append((action, works, buffers, polled))
        self._pending_sends, self._sends_before_step = still, before_step

    def recv(self, action: Action) -> tuple[Any, float]:
        """Receive what ``action``'s peer sent; also return when its header arrived (perf_counter).

        Floating-point tensors that required gradients on the sender require them here too (when grad mode is on).
        With ``header_groups`` the tensors are filled once :meth:`flush` has posted their receives.
        """
        if any(op.op is dist.isend for _, op in self._batch):
            self.flush()  # before waiting: the peer may need these payloads before it can send this header
        if action not in self._posted:  # not prefetched (NCCL): it is the next receive of its direction
            self._post(self._unposted[action.type].popleft())
        packet, work, expected = self._posted.pop(action)
        self._posted_count[action.type] -= 1
        self._post_ahead(action.type)  # before waiting: posting then costs nothing where the transfer is late
        self._wait(work, action, "waiting for the header", self._poll and self.header_groups is None)
        header_arrived = time.perf_counter()
        header = packet if self.header_groups is not None else packet[:_HEADER_BYTES].view(torch.int64)
        values = header.tolist()
        spec_len, count = values[0], values[1]
        layout: Layout = []
        requires_grad: list[bool] = []
        for i in range(count):
            code, grad, ndim, *dims = values[2 + i * _PER_TENSOR : 2 + (i + 1) * _PER_TENSOR]
            layout.append((_DTYPES[code], dims[:ndim]))
            requires_grad.append(bool(grad))
        key = (action.peer, action.stage, action.microbatch)
        if spec_len:
            on_host = self.header_groups is not None
            spec_buffer = torch.empty(spec_len, dtype=torch.uint8, device="cpu" if on_host else self.device)
            self._wait(self._irecv(spec_buffer, action, _SPEC_TAG, self._header_group_of(action) if on_host else None),
                       action, "receiving the structure", self._poll and not on_host)
            self._specs[key] = decode_spec(spec_buffer.cpu().numpy().tobytes())
        if self.header_groups is not None:
            payloads = [torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in layout]
            peer, group = self.stage_ranks[action.peer], self._group_of(action)
            self._batch += [(action, dist.P2POp(dist.irecv, p, peer, group)) for p in payloads]
        elif expected == layout:
            payloads = unpack(packet, layout, _HEADER_BYTES)
        else:
            resized = torch.empty(packed_size(layout), dtype=torch.uint8, device=self.device)
            if layout:
                self._wait(self._irecv(resized, action, _RESIZED_TAG), action, "receiving the resized tensor",
                           self._poll)
            payloads = unpack(resized, layout, 0)
            self._expected[key] = layout
        if torch.is_grad_enabled():
            for payload, grad in zip(payloads, requires_grad, strict=True):
                if grad and payload.is_floating_point():
                    payload.requires_grad_()
        spec = self._specs[key]
        for index, dims, placements, shape, stride in spec.get(_DTENSORS, ()):
            payloads[index] = rebuilt_dtensor(payloads[index], self._mesh(dims), placements, shape, stride)
        if self.header_groups is not None and spec != _TENSOR_SPEC and has_nested(spec):
            # rebuilding a nested tensor reads its sizes and copies its values: their receives must be posted (and
            # waited for) first. Nested tensors cross only in evaluation, where nothing is gained by deferring them
            self.flush()
        return payloads[0] if spec == _TENSOR_SPEC else unflatten(spec, payloads), header_arrived

    def _mesh(self, dims: list[str]) -> Any:
        if self.mesh_of is None:
            raise PipelineCommError("A DTensor arrived, but these transfers know no device mesh to rebuild it on.")
        return self.mesh_of(tuple(dims))

    @property
    def on_device_streams(self) -> bool:
        """Whether transfers complete on the device's streams, where a device synchronize waits for them (NCCL, or its
        emulation): then no send may stay in flight across a step's end (see :mod:`lightning_pp.pipedream.stream`)."""
        return self._poll

    @property
    def batched(self) -> bool:
        """Whether payload operations wait for :meth:`flush` to post them."""
        return bool(self._batch)

    def flush(self) -> Action | None:
        """Post the payloads of the transfers since the last flush together (``header_groups``): one
        ``batch_isend_irecv`` per process group, every group's posted before any is waited for (a receive in one
        group must not hold back a send in another). On NCCL the current stream then waits for the batches holding
        receives, the host does not; on gloo the host waits. Returns the first receive action among them (None if
        there was none)."""
        if not self._batch:
            return None
        first_receive = next((action for action, op in self._batch if op.op is dist.irecv), None)
        by_group: dict[int, list[tuple[Action, dist.P2POp]]] = {}
        for entry in self._batch:
            by_group.setdefault(id(entry[1].group), []).append(entry)
        self._batch = []
        posted: list[tuple[list[tuple[Action, dist.P2POp]], list[dist.Work]]] = []
        for entries in by_group.values():
            try:
                works = [self._as_nccl(_posted(w), *(a for a, _ in entries))
                         for w in dist.batch_isend_irecv([op for _, op in entries])]
            except RuntimeError as error:
                raise self._error(entries[0][0], "posting the transfers", error) from error
            posted.append((entries, works))
        for entries, works in posted:
            receives = [a for a, op in entries if op.op is dist.irecv]
            buffers = [op.tensor for _, op in entries]
            if receives and self._poll:
                try:
                    for work in works:
                        work.wait()  # NCCL: the current stream waits for the batch, the host does not
                except RuntimeError as error:
                    raise self._error(receives[0], "receiving the tensor", error) from error
                self._pending_recvs.append((receives[0], works, buffers))  # the host checks them at the step's end
            elif receives:  # gloo (tests): a second wait of a receive would wait for another message
                for work in works:
                    self._wait(work, receives[0], "receiving the tensor", polled=False)
            else:
                self._pending_sends.append((entries[0][0], works, buffers, self._poll))
        return first_receive

    def wait_sends(self, this_step: bool = True) -> None:
        """Wait until every posted transfer has completed; called once per step so send buffers can be freed. Not
        ``this_step``: leave the sends posted since the last :meth:`start_step` (a step cut out of a longer stream,
        whose peer may receive them only in its next step, which this rank's next step waits for)."""
        self.flush()
        for action, works, _ in self._pending_recvs:
            for work in works:
                self._wait(work, action, "receiving the tensor", self._poll)
        self._pending_recvs.clear()
        kept = self._pending_sends if this_step else deque(self._pending_sends)
        done = len(self._pending_sends) if this_step else self._sends_before_step
        for _ in range(done):
            action, works, _, polled = kept.popleft()
            for work in works:
                self._wait(work, action, "completing the send", polled)
        self._pending_sends = kept
        self._sends_before_step = len(kept)

    def _post_ahead(self, kind: ActionType) -> None:
        """Keep the receives of the next ``prefetch`` transfers of ``kind`` posted (in the order the peer sends)."""
        queue = self._unposted[kind]
        while queue and self._posted_count[kind] < self._prefetch:
            self._post(queue.popleft())

    def _post(self, action: Action) -> None:
        """Post the receive of ``action``'s header: with ``header_groups`` alone, on the host; else as a packet of
        the header and the payloads in the layout the channel's previous transfer had."""
        if self.header_groups is not None:
            header = torch.empty(_HEADER_LEN, dtype=torch.int64, device="cpu")
            work = self._irecv(header, action, _HEADER_TAG, self._header_group_of(action))
            self._posted[action] = (header, work, [])
        else:
            expected = self._expected.get((action.peer, action.stage, action.microbatch), [])
            packet = torch.empty(packed_size(expected, _HEADER_BYTES), dtype=torch.uint8, device=self.device)
            self._posted[action] = (packet, self._irecv(packet, action, _PAYLOAD_TAG), expected)
        self._posted_count[action.type] += 1

    def _group_of(self, action: Action) -> Any:
        return self._pick(self.groups, action)

    def _header_group_of(self, action: Action) -> Any:
        assert self.header_groups is not None
        return self._pick(self.header_groups, action)

    def _pick(self, groups: tuple[Any, ...], action: Action) -> Any:
        kind = 0 if action.type in (ActionType.SEND_F, ActionType.RECV_F) else 1
        if len(groups) == 2:
            return groups[kind]
        here, there = self.stage_ranks[action.stage], self.stage_ranks[action.peer]
        upward = there > here if action.is_send else here > there
        return groups[2 * kind + int(upward)]

    def _irecv(self, buffer: torch.Tensor, action: Action, tag: int, on_host: Any = None) -> dist.Work:
        """Post a receive from ``action``'s peer: in the headers' group ``on_host`` if given, else in the payloads'."""
        try:
            if on_host is not None:
                return _posted(dist.irecv(buffer, self.stage_ranks[action.peer], group=on_host, tag=tag))
            work = _posted(dist.irecv(buffer, self.stage_ranks[action.peer], group=self._group_of(action), tag=tag))
        except RuntimeError as error:
            raise self._error(action, "posting the receive", error) from error
        return self._as_nccl(work, action) if self._poll else work

    def _as_nccl(self, work: dist.Work, *actions: Action) -> dist.Work:
        """A payload operation of ``actions`` as NCCL's behaves (under the emulation; else ``work`` itself)."""
        if not self._emulate:
            return work
        peers = sorted({self.stage_ranks[a.peer] for a in actions})
        what = f"the payloads of {', '.join(dict.fromkeys(map(str, actions)))} (peer rank {', '.join(map(str, peers))})"
        return EmulatedNcclWork(work, self.timeout, what)  # type: ignore[return-value]

    def _wait(self, work: dist.Work, action: Action, what: str, polled: bool) -> None:
        """Wait for ``work``, at most ``timeout`` seconds: ``polled`` (NCCL's payloads, whose ``wait`` does not
        block the host) by checking for completion, backing off from a spin to 1 ms sleeps; else by gloo's own wait."""
        try:
            if polled:
                deadline = time.monotonic() + self.timeout
                pause = 0.0
                while not work.is_completed():
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"not completed after {self.timeout} s")
                    time.sleep(pause)
                    pause = min(1e-3, pause * 2 or 1e-5)
                work.wait()
            else:
                work.wait(timedelta(seconds=self.timeout))
        except (RuntimeError, TimeoutError) as error:
            raise self._error(action, what, error) from error

    def _error(self, action: Action, what: str, error: BaseException) -> PipelineCommError:
        peer = action.peer
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        timed_out = isinstance(error, TimeoutError) or "timed out" in text.lower() or "timeout" in text.lower()
        kind = PipelineTimeoutError if timed_out else PipelineCommError
        return kind(
            f"Pipeline stage {action.stage} (rank {self.stage_ranks[action.stage]}) failed in action {action} while "
            f"{what} with peer stage {peer} (rank {self.stage_ranks[peer]}) (timeout {self.timeout} s): {text}. "
            f"The peer has probably crashed or is stuck: look at its output for the first error. If a stage "
            f"legitimately needs longer, raise PipelineParallelStrategy(transfer_timeout=...)."
        )


def connect_stages(groups: StageGroups, stage_to_rank: Sequence[int], device: torch.device, timeout: float,
                   new_gloo_group: Callable[[list[int]], Any]) -> StageP2P:
    """The transfers of this rank's stages (``stage_to_rank``: the schedule's place of each stage in the pipeline)
    over ``groups.p2p``. On NCCL (or its emulation) the headers travel on the host, in gloo groups of their own made
    with ``new_gloo_group`` (every rank creates them alike; they join ``groups.created``), after a warm-up collective
    on each payload group: ``batch_isend_irecv`` needs a group's first call to involve all its ranks. The lane's
    gloo group made with them is the step's results' (:attr:`StageP2P.results_group`)."""
    stage_ranks = [groups.pipeline_ranks[position] for position in stage_to_rank]
    header_groups = None
    results_group = None
    if follows_nccl(groups.p2p[0]):
        for group in groups.p2p:
            dist.all_reduce(torch.zeros(1, device=device), group=group)
        on_host = create_groups(groups.layout, groups.rank, new_gloo_group, p2p_groups=len(groups.p2p))
        groups.created.extend(on_host.created)
        header_groups, results_group = on_host.p2p, on_host.pipeline
    mesh = create_device_mesh(groups.layout, device.type)  # made at the start (cached): no collective
    return StageP2P(stage_ranks, device, timeout, groups.p2p, header_groups=header_groups,
                    mesh_of=lambda dims: mesh[dims if len(dims) > 1 else dims[0]], results_group=results_group)
