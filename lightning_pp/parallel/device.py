"""Waiting for a device: the one place that does (so that NCCL's emulation can stand in for the device, see
:mod:`lightning_pp.parallel.nccl_emulation`)."""

from __future__ import annotations

import torch

from lightning_pp.parallel.nccl_emulation import emulating_nccl, wait_for_operations_in_flight

__all__ = ["synchronize_device", "synchronize_stream"]


def synchronize_device(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA kernels run asynchronously), so that a host clock read next times
    what ran, not what was launched. It waits for every stream, NCCL's too: never call it while a transfer is in
    flight whose peer needs this rank's host to go on (a pipeline's send posted for the peer's next step). Under
    NCCL's emulation it waits for every emulated NCCL operation in flight on this rank, as a GPU would."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif emulating_nccl():
        wait_for_operations_in_flight("a device synchronize")


def synchronize_stream(device: torch.device) -> None:
    """Wait for the work queued on ``device``'s current stream: the kernels this host queued, and the transfers it
    made that stream wait for, but not NCCL's own streams, where a pipeline's send may wait for the peer's next step.

    Under NCCL's emulation it waits, as :func:`synchronize_device` does, for every emulated NCCL operation in flight on
    this rank: on a GPU any CUDA call may synchronize the whole device (NCCL's documentation warns of it), so CI treats
    a stream's synchronize as a device's, and a schedule that relies on the difference hangs there, then fails."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    elif emulating_nccl():
        wait_for_operations_in_flight("a stream synchronize")
