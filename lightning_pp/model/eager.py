"""Passes through the blocks run now, on the whole input, every rank of the pipeline in step: for model code that
passes through the blocks several times in one step (autoregressive generation in ``predict_step``) or outside the
steps (sampling text in ``on_validation_epoch_end``).

Every rank runs the model's code. When the loop reaches a block this rank holds, the block runs; after the last block
of each stage, that stage's output is broadcast over the pipeline from the rank holding it, and the stand-in of that
block returns it on every other rank, so the next stage's first block and the code after the blocks see the real
activation everywhere: the model's own loop (a generation loop, its stopping test) continues identically on every
rank. A stand-in of any other block runs the block's weightless copy on the meta device first, so per-layer state the
model passes to its layers (a key/value cache whose length is read from layer 0) advances as on one device; it returns
zeros of the block's output shape, marked as held elsewhere (:mod:`lightning_pp.runtime.remote`). A module outside the
blocks whose weights this rank does not hold gets its output the same way, broadcast from a rank holding it.

A broadcast that does not complete within the transfer timeout (a pass run on some ranks only, as under
``if self.global_rank == 0``) raises :class:`~lightning_pp.PipelineCommError` naming the hook and the way out.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_pp.errors import PipelineCommError
from lightning_pp.runtime.p2p import described_dtensor, rebuilt_dtensor
from lightning_pp.runtime.wire import flatten, pack, packed_size, unflatten, unpack

__all__ = ["EagerLink"]

_DTYPES = {str(dtype): dtype for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                                           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


class EagerLink:
    """Broadcasts of whole structures over the pipeline, each step waited for at most ``timeout`` seconds.

    ``where()`` names this rank (its stage), ``hook()`` the Lightning hook running now (None: none). A DTensor (a
    tensor-parallel block's output) travels as this rank's part, to the ranks of its pipeline, which hold the same
    part of the next stage, and is rebuilt there on the mesh ``mesh_of`` gives for its dimension names.
    """

    def __init__(self, group: Any, device: torch.device, timeout: float, where: Callable[[], str],
                 hook: Callable[[], str | None], mesh_of: Callable[[tuple[str, ...]], Any] | None = None) -> None:
        self.group, self.device, self.timeout = group, device, timeout
        self.where, self.hook, self.mesh_of = where, hook, mesh_of

    def broadcast(self, value: Any, source: int, what: str) -> Any:
        """``value`` (meaningful on global rank ``source`` only) on every rank of the pipeline."""
        mine = dist.get_rank() == source
        header = b""
        tensors: list[torch.Tensor] = []
        distributed: list[list[Any]] = []
        if mine:
            tensors, spec = flatten(value)
            distributed = [[i, *described_dtensor(t)] for i, t in enumerate(tensors) if isinstance(t, DTensor)]
            tensors = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
            header = json.dumps([spec, [[str(t.dtype), list(t.shape)] for t in tensors], distributed]).encode()
        size = torch.tensor([len(header)], dtype=torch.int64, device=self.device)
        self._broadcast(size, source, what)
        data = (torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device) if mine
                else torch.empty(int(size.item()), dtype=torch.uint8, device=self.device))
        self._broadcast(data, source, what)
        spec, described, distributed = json.loads(data.cpu().numpy().tobytes().decode())
        layout = [(_DTYPES[dtype], shape) for dtype, shape in described]
        if not layout:
            return value if mine else unflatten(spec, [])
        # the tensors travel packed in one buffer: one collective, whatever their number
        payload = (pack([t.detach() for t in tensors], self.device) if mine
                   else torch.empty(packed_size(layout), dtype=torch.uint8, device=self.device))
        self._broadcast(payload, source, what)
        if mine:
            return value
        received = unpack(payload, layout)
        for index, dims, placements, shape, stride in distributed:
            assert self.mesh_of is not None  # a DTensor was sent: the job has a mesh
            received[index] = rebuilt_dtensor(received[index], self.mesh_of(tuple(dims)), placements, shape, stride)
        return unflatten(spec, received)

    def _broadcast(self, tensor: torch.Tensor, source: int, what: str) -> None:
        try:
            dist.broadcast(tensor, source, group=self.group, async_op=True).wait(timedelta(seconds=self.timeout))
        except RuntimeError as error:
            hook = self.hook()
            during = f" in `{hook}`" if hook else ""
            raise PipelineCommError(
                f"Pipeline {self.where()} waited for {what} from rank {source}{during} and failed ({error}). A pass "
                f"through the blocks outside the pipelined step (generation in a hook, several passes in one step) "
                f"runs every stage's blocks on its own rank, so every rank of the pipeline must run it: code under "
                f"`if self.global_rank == 0` runs it on one rank only. Run it on every rank and print or log the "
                f"result on rank 0."
            ) from error
