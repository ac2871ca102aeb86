"""The one device helper several rooms need."""

from __future__ import annotations

import torch

__all__ = ["synchronize_device"]


def synchronize_device(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA kernels run asynchronously), so that a host clock read next times
    what ran, not what was launched."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
