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
- object collectives go through a gloo group of their own, not the default group: the same here;
- the step's results travel wherever a real NCCL run sends them (:class:`~lightning_pp.model.results.ResultExchange`
  decides alike);
- a device synchronize (``torch.cuda.synchronize``, and a stream's too: on a GPU any CUDA call may synchronize the
  device) waits for NCCL's streams, and so for every NCCL operation in flight on the rank, such as a pipeline's send
  whose receive the peer posts only in its next step: :func:`wait_for_operations_in_flight` (called by
  :mod:`lightning_pp.parallel.device` where a GPU run synchronizes) waits for every :class:`EmulatedNcclWork` this rank
  posted and that has not completed, so a run that deadlocks there on NCCL hangs here too, then fails after the
  transfers' timeout with an error naming what it waited for.

What it cannot show: anything else of the device itself (streams running ahead of the host, CUDA events, device
memory).
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_pp.errors import PipelineCommError, PipelineTimeoutError

__all__ = ["ENV_VAR", "EmulatedNcclWork", "emulating_nccl", "follows_nccl", "wait_for_operations_in_flight"]

ENV_VAR = "LIGHTNING_PP_NCCL_EMULATION"

# every EmulatedNcclWork of this process (this rank) not completed yet, in posting order: what a device synchronize
# waits for (a dict as an ordered set)
_in_flight: dict[EmulatedNcclWork, None] = {}
_in_flight_lock = threading.Lock()


def follows_nccl(group: Any) -> bool:
    """Whether transfers over ``group`` follow NCCL's control flow: a group of another backend than gloo (NCCL on
    GPUs), or a gloo group under the emulation. The one place this is decided, so every part decides alike."""
    return dist.get_backend(group) != "gloo" or emulating_nccl()


def emulating_nccl() -> bool:
    """Whether this process emulates NCCL's control flow (``LIGHTNING_PP_NCCL_EMULATION`` set, and not to 0). It acts
    only where the backend is gloo: a real NCCL run takes the real branches. Set it alike on every rank."""
    return os.environ.get(ENV_VAR, "0").strip().lower() not in ("", "0", "false", "no")


class EmulatedNcclWork:
    """A gloo operation seen by the host as an NCCL one: a thread waits for it, so :meth:`is_completed` turns true by
    itself, and :meth:`wait` may be called any number of times (each returns once the operation has completed, or
    raises what it failed with). Where NCCL's ``wait()`` would only make the stream wait, the host waits here, at most
    ``timeout_s`` seconds. Until it completes it counts as in flight on this rank (see
    :func:`wait_for_operations_in_flight`); ``what`` names it there (the action it belongs to)."""

    def __init__(self, work: dist.Work, timeout_s: float, what: str = "an NCCL operation") -> None:
        self._work = work
        self._timeout_s = timeout_s
        self.what = what
        self._done = threading.Event()
        self._error: BaseException | None = None
        with _in_flight_lock:
            _in_flight[self] = None
        threading.Thread(target=self._complete, name="lightning_pp-nccl-emulation", daemon=True).start()

    def _complete(self) -> None:
        try:  # bounded: a thread left waiting in gloo when its group is destroyed could abort the process
            self._work.wait(timedelta(seconds=self._timeout_s))
        except BaseException as error:  # handed to whoever waits
            self._error = error
        finally:
            self._done.set()
            with _in_flight_lock:
                _in_flight.pop(self, None)

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        seconds = self._timeout_s if timeout is None else timeout.total_seconds()
        if not self._done.wait(seconds):
            raise RuntimeError(f"timed out after {seconds} s")
        if self._error is not None:
            raise RuntimeError(str(self._error)) from self._error
        return True


def wait_for_operations_in_flight(waiter: str) -> None:
    """What ``waiter`` (a device or stream synchronize) does under the emulation: wait until every emulated NCCL
    operation this rank posted has completed, at most each one's timeout (the strategy's ``transfer_timeout``) from now.

    Raises:
        PipelineTimeoutError: one did not complete in time: on a GPU the synchronize would never return.
        PipelineCommError: one failed.
    """
    with _in_flight_lock:
        works = list(_in_flight)
    if not works:
        return
    started = time.monotonic()
    for work in works:
        work._done.wait(max(0.0, started + work._timeout_s - time.monotonic()))
    # not completed, or given up by its own bounded wait (posted earlier, it may time out before this wait does)
    late = [work.what for work in works if not work.is_completed() or _timed_out(work._error)]
    if late:
        raise PipelineTimeoutError(
            f"Rank {_rank()}: {waiter} under NCCL's emulation ({ENV_VAR}=1) waited "
            f"{time.monotonic() - started:.1f} s for {len(late)} NCCL operation(s) still in flight: {', '.join(late)}. "
            f"On a GPU this synchronize can hang for ever: each is matched only by an operation its peer posts later, "
            f"after something that waits for this rank's host (a collective, the step's results). Hand the peer what "
            f"it waits for before synchronizing (point to point, as early as it is known), or leave no operation in "
            f"flight across a synchronize; if a stage legitimately needs longer, raise "
            f"PipelineParallelStrategy(transfer_timeout=...).")
    failed = [(work.what, work._error) for work in works if work._error is not None]
    if failed:
        what, error = failed[0]
        raise PipelineCommError(f"Rank {_rank()}: {waiter} under NCCL's emulation found {what} failed: {error}. "
                                f"Look at the peer's output for the first error.")


def _timed_out(error: BaseException | None) -> bool:
    return error is not None and any(word in str(error).lower() for word in ("timed out", "timeout"))


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
