"""Point-to-point transfers between neighbouring stages, each tensor preceded by a fixed-size metadata header.

The header (dtype code, number of dimensions, shape) lets the receiver allocate its buffer from what was sent: no
pickling, no shapes or dtypes fixed in advance, so hidden sizes may change from stage to stage and from batch to batch.
Sends are asynchronous; a receive waits, at most ``timeout`` seconds, and turns any failure into an error that names
this stage, the action and the peer.

On gloo, headers and tensors travel under different tags, and a step posts the header receives of all its transfers
up front (:meth:`StageP2P.post_headers`): a header is then in place when it arrives, and a receive costs one
rendezvous (the tensor's) instead of two. NCCL ignores tags and matches in posting order, so there each header is
received right before its tensor.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_pp.errors import PipelineCommError, PipelineTimeoutError
from lightning_pp.schedules import Action

__all__ = ["StageP2P"]

_DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    torch.complex64, torch.complex128,
)  # fmt: skip
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}
_MAX_DIMS = 8
_HEADER_LEN = 2 + _MAX_DIMS
_HEADER_TAG, _TENSOR_TAG = 1, 2


def _posted(work: dist.Work | None) -> dist.Work:
    if work is None:  # torch returns None when this rank is not in the group
        raise RuntimeError("this rank is not a member of the pipeline's process group")
    return work


class StageP2P:
    """The transfers of one stage: ``send`` posts and returns, ``recv`` waits for the peer (bounded by ``timeout``)."""

    def __init__(
        self, stage: int, stage_ranks: Sequence[int], device: torch.device, timeout: float, group: Any = None
    ) -> None:
        self.stage = stage
        self.stage_ranks = list(stage_ranks)
        self.device = device
        self.timeout = timeout
        self.group = group
        # NCCL's Work.wait does not block the host, so bound its wait by polling; gloo's wait takes a timeout itself
        self._poll = dist.get_backend(group) != "gloo"
        # (action, works, buffers): works and the buffers they read stay referenced until the send has completed
        self._pending_sends: list[tuple[Action, list[dist.Work], tuple[torch.Tensor, torch.Tensor]]] = []
        self._posted_headers: dict[Action, tuple[torch.Tensor, dist.Work]] = {}

    def post_headers(self, actions: Sequence[Action]) -> None:
        """Post the header receive of every receive in ``actions`` now (gloo only; see the module docstring)."""
        if self._poll:
            return
        for action in actions:
            if not action.is_compute and not action.is_send:
                header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
                self._posted_headers[action] = (header, self._irecv(header, action, _HEADER_TAG))

    def send(self, tensor: torch.Tensor, action: Action) -> None:
        """Post the header and the tensor to ``action.peer``; both stay referenced until :meth:`wait_sends`."""
        if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPE_CODE:
            raise PipelineCommError(
                f"Stage {self.stage} cannot send a tensor of dtype {tensor.dtype} with shape {tuple(tensor.shape)} "
                f"in {action}: supported are up to {_MAX_DIMS} dimensions and dtypes {[str(d) for d in _DTYPES]}."
            )
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
        header[0] = _DTYPE_CODE[tensor.dtype]
        header[1] = tensor.dim()
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        header = header.to(self.device)
        payload = tensor.detach().contiguous()
        peer = self.stage_ranks[action.peer]
        try:
            works = [_posted(dist.isend(header, peer, group=self.group, tag=_HEADER_TAG)),
                     _posted(dist.isend(payload, peer, group=self.group, tag=_TENSOR_TAG))]
        except RuntimeError as error:
            raise self._error(action, "posting the send", error) from error
        self._pending_sends.append((action, works, (header, payload)))

    def recv(self, action: Action) -> tuple[torch.Tensor, float]:
        """Receive the tensor of ``action`` from its peer; also return when its header arrived (perf_counter)."""
        if action in self._posted_headers:
            header, work = self._posted_headers.pop(action)
        else:
            header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
            work = self._irecv(header, action, _HEADER_TAG)
        self._wait(work, action, "waiting for the header")
        header_arrived = time.perf_counter()
        code, ndim, *dims = header.tolist()
        buffer = torch.empty(dims[:ndim], dtype=_DTYPES[code], device=self.device)
        self._wait(self._irecv(buffer, action, _TENSOR_TAG), action, "receiving the tensor")
        return buffer, header_arrived

    def wait_sends(self) -> None:
        """Wait until every posted send has left; called once per step so send buffers can be freed."""
        for action, works, _ in self._pending_sends:
            for work in works:
                self._wait(work, action, "completing the send")
        self._pending_sends.clear()

    def _irecv(self, buffer: torch.Tensor, action: Action, tag: int) -> dist.Work:
        try:
            return _posted(dist.irecv(buffer, self.stage_ranks[action.peer], group=self.group, tag=tag))
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
            f"Pipeline stage {self.stage} (rank {self.stage_ranks[self.stage]}) failed in action {action} while "
            f"{what} with peer stage {peer} (rank {self.stage_ranks[peer]}) (timeout {self.timeout} s): {text}. "
            f"The peer has probably crashed or is stuck: look at its output for the first error. If a stage "
            f"legitimately needs longer, raise PipelineParallelStrategy(timeout=...)."
        )
