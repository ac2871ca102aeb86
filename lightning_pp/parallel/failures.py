"""A failed rank ends the whole job: it says so in the process group's store, and every other rank ends too; and a
failed collective raises an error naming this rank, the collective and the rank that failed first
(:func:`naming_failures`).

A rank blocked in a transfer with a failed peer raises its own timeout error, but a rank stuck elsewhere (in user
code, in a collective the failed rank never joins) would wait forever, and Lightning swallows SIGTERM. So each rank
runs a watcher thread while a fit runs: once another rank has reported a failure and this rank has not ended within
``grace`` seconds (long enough for its own transfer timeout to say where it was), the watcher logs why and ends the
process.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from lightning_pp._logging import get_logger
from lightning_pp.errors import PipelineCommError

__all__ = ["FailureSignal", "naming_failures"]

log = get_logger(__name__)

_POLL_S = 0.5
_fits_started = 0  # fits this process has run: names each fit's failure flag alike on every rank


class FailureSignal:
    """One fit's failure flag in ``store`` (a torch.distributed Store), and this rank's watcher of it."""

    def __init__(self, store: Any, job: int, rank: int, grace: float) -> None:
        self._store = store
        self._key = f"lightning_pp/failed/{job}"
        self._rank = rank
        self._grace = grace
        self._message: str | None = None  # another rank's report
        self._own: str | None = None  # this rank's report
        self._said_skipped = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="lightning_pp-failure-watcher", daemon=True)
        self._thread.start()

    @classmethod
    def for_this_fit(cls, store: Any, rank: int, grace: float) -> FailureSignal:
        """The flag of the fit now starting (every rank counts its fits alike), watched from now on."""
        global _fits_started
        _fits_started += 1
        return cls(store, _fits_started, rank, grace)

    def report(self, message: str) -> None:
        """Tell every rank this one failed (on the failing rank; once, later calls do nothing). Its own watcher goes
        on: should this rank not end within ``grace`` either (stuck in a callback's collective no peer joins), it
        ends the process as it ends the others."""
        if self._own is not None:
            return
        self._own = message
        with contextlib.suppress(Exception):  # the store may be gone with rank 0; the transfers' timeouts remain
            self._store.set(self._key, message)
        if self._rank == 0:
            time.sleep(1.5)  # rank 0 hosts the store: let the other ranks read the flag before this process ends

    def stop(self) -> None:
        """Stop watching, and wait for the watcher to end (a run's teardown leaves no thread behind)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * _POLL_S)

    def skips(self, what: str) -> bool:
        """Whether ``what`` (a checkpoint's gather, write or barrier) is to be skipped because the job failed, here or
        on another rank: a failed pipeline holds no state every stage agrees on, and its ranks meet no more (a peer
        may be gone or stuck). Says why once."""
        failure = self._own or self.reported()
        if failure is not None and not self._said_skipped:
            self._said_skipped = True
            log.error(f"rank {self._rank}: {what} skipped: the job failed ({failure[:500]}). A checkpoint needs every "
                      f"stage, and a failed job's ranks meet no more: resume from one saved before the failure "
                      f"(ModelCheckpoint(every_n_train_steps=N)).")
        return failure is not None

    def reported(self) -> str | None:
        """Another rank's failure report, if there is one (kept by the watcher: the store may be gone with rank 0)."""
        if self._message is None:
            with contextlib.suppress(Exception):
                if self._store.check([self._key]):
                    self._message = self._store.get(self._key).decode(errors="replace")
        return self._message

    def _watch(self) -> None:
        seen_at: float | None = None
        message = None
        while not self._stop.wait(_POLL_S):
            if seen_at is None and self._own is not None:  # its own failure: it may get stuck after it too
                seen_at, message = time.monotonic(), self._own
            elif seen_at is None:
                try:
                    if not self._store.check([self._key]):
                        continue
                    message = self._message = self._store.get(self._key).decode(errors="replace")
                except Exception:
                    return
                seen_at = time.monotonic()
            elif time.monotonic() - seen_at > self._grace:
                log.error(f"rank {self._rank} ends: {message} (this rank had not finished {self._grace:.0f} s after "
                          f"that failure)")
                os._exit(1)


@contextlib.contextmanager
def naming_failures(where: Callable[[], str], what: str, signal: FailureSignal | None) -> Iterator[None]:
    """Turn a collective's failure (gloo and NCCL name only a socket) into an error naming this rank (``where()``),
    the collective (``what``) and, when one has reported, the rank that failed first."""
    try:
        yield
    except PipelineCommError:
        raise
    except RuntimeError as error:
        reported = signal.reported() if signal is not None else None
        cause = (f"it follows another rank's failure: {reported}" if reported else
                 "a peer has probably crashed: look at the other ranks' output for the first error")
        raise PipelineCommError(f"Pipeline {where()} failed in {what}: {error}; {cause}.") from error
