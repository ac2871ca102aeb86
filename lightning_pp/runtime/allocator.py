"""Keep freed CPU memory in the process, so each micro-batch reuses pages instead of faulting fresh ones in.

glibc hands allocations above its mmap threshold (128 KiB, raised on the fly up to 32 MiB) straight to the kernel and
returns freed memory at the top of the heap once more than the trim threshold is free. A pipeline stage allocates and
frees the same activation and weight-gradient buffers for every micro-batch, so with the defaults the kernel maps,
zero-fills and unmaps them over and over: 7,600 page faults per step and 15-30 % of the compute time of a
4-layer, 1024-wide stage with 8 micro-batches (``benchmarks/compare.py``). Raising both thresholds keeps those pages in
the heap, at the price of the process holding on to its peak CPU memory.
"""

from __future__ import annotations

import ctypes
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, from glibc's malloc.h
_MMAP_THRESHOLD = 32 * 2**20  # the largest value glibc accepts on 64-bit systems
_TRIM_THRESHOLD = 2**30


def keep_freed_cpu_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where there is no glibc ``mallopt``."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
