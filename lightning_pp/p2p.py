"""Point-to-point transfers between neighbouring stages: a small metadata header, then the tensors.

What crosses a boundary is whatever one block hands the next: a tensor or a structure of tensors and plain values.
The fixed-size header (per tensor: dtype code, ``requires_grad``, number of dimensions, shape) tells the receiver what
was sent without pickling and without shapes or dtypes fixed in advance, so hidden sizes may change from stage to stage
and from batch to batch; the structure itself travels as JSON only when it differs from the channel's last one. The
receiver does not wait for the header to size its buffers, though: both ends expect a transfer to have the layout of
the previous transfer on the same channel (source stage, destination stage, micro-batch), and they agree on that
without talking because both saw that transfer. In the steady state every step looks like the last, the receives of
the payloads are posted together with the header's, and the tensors land in place. When the layout differs (or nothing
is expected yet: the first step), the header says so, the expected payloads are filler, and the tensors follow under
another tag.

Posting receives before the peer sends is what makes transfers cheap: on gloo a send that finds its receive waiting
leaves at once from the sending thread, while one that does not waits for gloo's background thread, which competes
with compute for the CPU. So on gloo each stage keeps the receives of its next ``prefetch`` transfers per direction
posted (:meth:`StageP2P.start_step`). NCCL runs the operations between two ranks in posting order, so a receive
posted early could hold back a send to the same peer; there each receive is posted when its action runs.

Sends are asynchronous; a receive waits, at most ``timeout`` seconds, and turns any failure into an error that names
this stage, the action and the peer.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_pp._tree import Spec, decode_spec, encode_spec, flatten, unflatten
from lightning_pp.errors import PipelineCommError, PipelineConfigError, PipelineTimeoutError
from lightning_pp.schedules import Action, ActionType

__all__ = ["StageP2P"]

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

# (dtype, shape) of each tensor of a transfer
_Layout = list[tuple[torch.dtype, list[int]]]
# (header buffer, its work, payload buffers as expected, their works)
_PostedReceive = tuple[torch.Tensor, dist.Work, list[torch.Tensor], list[dist.Work]]


def _posted(work: dist.Work | None) -> dist.Work:
    if work is None:  # torch returns None when this rank is not in the group
        raise RuntimeError("this rank is not a member of the pipeline's process group")
    return work


class StageP2P:
    """The transfers of one rank's stages: ``send`` posts and returns, ``recv`` waits for the peer (bounded by
    ``timeout``). ``stage_ranks[s]`` is the global rank holding stage ``s``.

    What is sent is whatever one block hands the next: a tensor, or tuples / lists / dicts of tensors and plain values
    (see :mod:`lightning_pp._tree`). Each tensor keeps its ``requires_grad`` across the boundary, so the receiver
    back-propagates exactly into what the sender's graph can use. Call :meth:`start_step` with the stage's actions
    before running them and :meth:`wait_sends` after.
    """

    def __init__(
        self,
        stage_ranks: Sequence[int],
        device: torch.device,
        timeout: float,
        groups: Sequence[Any] = (None, None),
        prefetch: int = 2,
    ) -> None:
        self.stage_ranks = list(stage_ranks)
        self.device = device
        self.timeout = timeout
        # activations and gradients travel in separate process groups, i.e. separate connections: on one gloo TCP
        # connection, two stages sending to each other at once stall for milliseconds now and then; on NCCL the two
        # directions get their own streams and do not wait for each other. With several stages per rank one kind can
        # travel both ways between two ranks (interleaved on 2 ranks, the V of zbv): then ``groups`` has four, one
        # per kind and direction (activations up, down, gradients up, down, in rank order)
        self.groups = tuple(groups)
        # NCCL's Work.wait does not block the host, so bound its wait by polling; gloo's wait takes a timeout itself
        self._poll = dist.get_backend(groups[0]) != "gloo"
        self._prefetch = 0 if self._poll else prefetch
        # (source stage, destination stage, micro-batch) -> layout and structure of the last transfer; both ends agree
        self._expected: dict[tuple[int, int, int], _Layout] = {}
        self._specs: dict[tuple[int, int, int], Spec] = {}
        self._unposted: dict[ActionType, deque[Action]] = {kind: deque() for kind in _RECEIVES}
        self._posted: dict[Action, _PostedReceive] = {}
        # (action, works, buffers): works and the buffers they read stay referenced until the send has completed
        self._pending_sends: list[tuple[Action, list[dist.Work], list[torch.Tensor]]] = []

    def start_step(self, actions: Sequence[Action]) -> None:
        """Queue this step's receives in order and post the first ``prefetch`` of each direction."""
        for kind in _RECEIVES:
            self._unposted[kind] = deque(a for a in actions if a.type is kind)
            self._post_ahead(kind)

    def send(self, obj: Any, action: Action) -> None:
        """Post ``obj`` to ``action.peer``; what is sent stays referenced until :meth:`wait_sends`."""
        tensors, spec = flatten(obj)
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
        payloads = [t.detach().contiguous() for t in tensors]
        layout = [(t.dtype, list(t.shape)) for t in payloads]
        expected = self._expected.get(key)
        messages = [(torch.tensor(header, dtype=torch.int64).to(self.device), _HEADER_TAG)]
        if expected == layout:
            messages += [(t, _PAYLOAD_TAG) for t in payloads]
        elif expected is not None:  # the receiver has posted payload receives for the old layout: fill them
            messages += [(torch.zeros(shape, dtype=dtype, device=self.device), _PAYLOAD_TAG)
                         for dtype, shape in expected]
        if spec_bytes:
            messages.append((torch.frombuffer(bytearray(spec_bytes), dtype=torch.uint8).to(self.device), _SPEC_TAG))
        if expected != layout:
            messages += [(t, _RESIZED_TAG) for t in payloads]
            self._expected[key] = layout
        peer = self.stage_ranks[action.peer]
        try:
            works = [_posted(dist.isend(buffer, peer, group=self._group_of(action), tag=tag))
                     for buffer, tag in messages]
        except RuntimeError as error:
            raise self._error(action, "posting the send", error) from error
        self._pending_sends.append((action, works, [buffer for buffer, _ in messages]))

    def recv(self, action: Action) -> tuple[Any, float]:
        """Receive what ``action``'s peer sent; also return when its header arrived (perf_counter).

        Floating-point tensors that required gradients on the sender require them here too (when grad mode is on).
        """
        if action not in self._posted:  # not prefetched (NCCL): it is the next receive of its direction
            self._post(self._unposted[action.type].popleft())
        header, header_work, payloads, payload_works = self._posted.pop(action)
        self._wait(header_work, action, "waiting for the header")
        header_arrived = time.perf_counter()
        self._post_ahead(action.type)
        values = header.tolist()
        spec_len, count = values[0], values[1]
        layout: _Layout = []
        requires_grad: list[bool] = []
        for i in range(count):
            code, grad, ndim, *dims = values[2 + i * _PER_TENSOR : 2 + (i + 1) * _PER_TENSOR]
            layout.append((_DTYPES[code], dims[:ndim]))
            requires_grad.append(bool(grad))
        key = (action.peer, action.stage, action.microbatch)
        for work in payload_works:
            self._wait(work, action, "receiving the tensor")
        if spec_len:
            spec_buffer = torch.empty(spec_len, dtype=torch.uint8, device=self.device)
            self._wait(self._irecv(spec_buffer, action, _SPEC_TAG), action, "receiving the structure")
            self._specs[key] = decode_spec(spec_buffer.cpu().numpy().tobytes())
        if self._expected.get(key) != layout:
            payloads = [torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in layout]
            for payload in payloads:
                self._wait(self._irecv(payload, action, _RESIZED_TAG), action, "receiving the resized tensor")
            self._expected[key] = layout
        if torch.is_grad_enabled():
            for payload, grad in zip(payloads, requires_grad, strict=True):
                if grad and payload.is_floating_point():
                    payload.requires_grad_()
        return unflatten(self._specs[key], payloads), header_arrived

    def wait_sends(self) -> None:
        """Wait until every posted send has left; called once per step so send buffers can be freed."""
        for action, works, _ in self._pending_sends:
            for work in works:
                self._wait(work, action, "completing the send")
        self._pending_sends.clear()

    def _post_ahead(self, kind: ActionType) -> None:
        """Keep the receives of the next ``prefetch`` transfers of ``kind`` posted (in the order the peer sends)."""
        queue = self._unposted[kind]
        while queue and sum(a.type is kind for a in self._posted) < self._prefetch:
            self._post(queue.popleft())

    def _post(self, action: Action) -> None:
        header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
        header_work = self._irecv(header, action, _HEADER_TAG)
        expected = self._expected.get((action.peer, action.stage, action.microbatch), [])
        payloads = [torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in expected]
        works = [self._irecv(payload, action, _PAYLOAD_TAG) for payload in payloads]
        self._posted[action] = (header, header_work, payloads, works)

    def _group_of(self, action: Action) -> Any:
        kind = 0 if action.type in (ActionType.SEND_F, ActionType.RECV_F) else 1
        if len(self.groups) == 2:
            return self.groups[kind]
        here, there = self.stage_ranks[action.stage], self.stage_ranks[action.peer]
        upward = there > here if action.is_send else here > there
        return self.groups[2 * kind + int(upward)]

    def _irecv(self, buffer: torch.Tensor, action: Action, tag: int) -> dist.Work:
        try:
            return _posted(dist.irecv(buffer, self.stage_ranks[action.peer], group=self._group_of(action), tag=tag))
        except RuntimeError as error:
            raise self._error(action, "posting the receive", error) from error

    def _wait(self, work: dist.Work, action: Action, what: str) -> None:
        try:
            if self._poll:
                deadline = time.monotonic() + self.timeout
                while not work.is_completed():
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"not completed after {self.timeout} s")
                    time.sleep(0)
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
            f"legitimately needs longer, raise PipelineParallelStrategy(timeout=...)."
        )
