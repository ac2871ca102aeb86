"""NCCL's control flow on CPU, for CI: with ``LIGHTNING_PP_NCCL_EMULATION=1`` a gloo run takes every branch an NCCL
run takes that needs no GPU.

What differs on NCCL, and what the emulation does instead:

- the transfers' headers travel on the host, in gloo groups of their own, and the payloads are posted in batches
  (``batch_isend_irecv``) after a warm-up collective on each payload group: the same here;
- a payload operation completes in the background (``is_completed`` turns true without anyone waiting) and waiting for
  it again is harmless, while a gloo operation reports completion only once waited for, and a second wait of a receive
  waits for another message: :class:`EmulatedNcclWork` gives gloo's payload operations NCCL's behaviour, so the host
  polls them with a deadline as on NCCL;
- ``Work.wait()`` makes the compute stream wait, not the host: on CPU the host is the stream, so it waits;
- object collectives go through a gloo group of their own, not the default group: the same here.

What it cannot show: anything of the device itself (streams running ahead of the host, CUDA events, device memory).
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import torch.distributed as dist

__all__ = ["ENV_VAR", "EmulatedNcclWork", "emulating_nccl"]

ENV_VAR = "LIGHTNING_PP_NCCL_EMULATION"


def emulating_nccl() -> bool:
    """Whether this process emulates NCCL's control flow (``LIGHTNING_PP_NCCL_EMULATION`` set, and not to 0). It acts
    only where the backend is gloo: a real NCCL run takes the real branches. Set it alike on every rank."""
    return os.environ.get(ENV_VAR, "0").strip().lower() not in ("", "0", "false", "no")


class EmulatedNcclWork:
    """A gloo operation seen by the host as an NCCL one: a thread waits for it, so :meth:`is_completed` turns true by
    itself, and :meth:`wait` may be called any number of times (each returns once the operation has completed, or
    raises what it failed with). Where NCCL's ``wait()`` would only make the stream wait, the host waits here, at most
    ``timeout_s`` seconds."""

    def __init__(self, work: dist.Work, timeout_s: float) -> None:
        self._work = work
        self._timeout_s = timeout_s
        self._done = threading.Event()
        self._error: BaseException | None = None
        threading.Thread(target=self._complete, name="lightning_pp-nccl-emulation", daemon=True).start()

    def _complete(self) -> None:
        try:  # bounded: a thread left waiting in gloo when its group is destroyed could abort the process
            self._work.wait(timedelta(seconds=self._timeout_s))
        except BaseException as error:  # handed to whoever waits
            self._error = error
        finally:
            self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        seconds = self._timeout_s if timeout is None else timeout.total_seconds()
        if not self._done.wait(seconds):
            raise RuntimeError(f"timed out after {seconds} s")
        if self._error is not None:
            raise RuntimeError(str(self._error)) from self._error
        return True
