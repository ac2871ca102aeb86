"""What a rank does in the tests of how a job ends (tests/multi_process/test_teardown.py): a failure with a callback
that saves on exception, a SIGTERM to every rank, and many fits in one process.
Run by _worker.py as ``teardown_scenarios:name``."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from models import fit
from scenarios import DEVICES, GLOBAL_RANK

from lightning_pp import PipelineParallelStrategy


def _open_files() -> tuple[int, int]:
    """This process's open descriptors, and how many of them are sockets."""
    fds = sockets = 0
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed since the listing (the listing's own descriptor)
            continue
        fds += 1
        sockets += target.startswith("socket:")
    return fds, sockets


def resources_over_fits(fits: int, model: str = "mlp", **strategy: Any) -> list[dict[str, Any]]:
    """``fits`` fits of ``model`` one after the other in this process, each with a new Trainer and strategy; after
    each, this process's threads (by name), open descriptors and sockets."""
    counts = []
    for _ in range(fits):
        fit(model, PipelineParallelStrategy(transfer_timeout=60, **strategy), devices=DEVICES, max_steps=2)
        time.sleep(0.2)  # a thread told to stop at teardown may still be on its way out
        fds, sockets = _open_files()
        counts.append({"threads": sorted(t.name for t in threading.enumerate()),
                       "os_threads": len(os.listdir("/proc/self/task")), "fds": fds, "sockets": sockets})
    return counts


class _SignalEveryRank(L.Callback):
    """Every rank sends itself SIGTERM in the middle of step ``step``'s backward pass (the first gradient reaching
    one of its blocks): as a cluster preempting the job signals every process."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.sent_at: float | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step != self.step or self.sent_at is not None:
            return
        blocks = [p for name, p in pl_module.named_parameters() if name.startswith("layers.") and p.requires_grad]

        def signal_once(grad: torch.Tensor) -> torch.Tensor:
            if self.sent_at is None:
                self.sent_at = time.monotonic()
                os.kill(os.getpid(), signal.SIGTERM)
            return grad

        self.handles = [p.register_hook(signal_once) for p in blocks[-1:]]

    def on_train_batch_end(self, *args: Any) -> None:
        for handle in getattr(self, "handles", []):
            handle.remove()
        self.handles = []


def sigterm_every_rank(dirpath: str, step: int, timeout: float = 30, max_steps: int = 6,
                       **strategy: Any) -> dict[str, Any]:
    """Train with ``OnExceptionCheckpoint(dirpath)``; every rank gets SIGTERM mid-backward in step ``step``. Returns
    how this rank's fit ended, the step it ended at and the seconds from its signal to the end."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    signaller = _SignalEveryRank(step)
    ended: dict[str, Any] = {"type": "none", "message": ""}
    trainer_ref: list[L.Trainer] = []

    class Keep(L.Callback):
        def setup(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
            trainer_ref.append(trainer)

    try:
        fit("mlp", PipelineParallelStrategy(transfer_timeout=timeout, **strategy), devices=DEVICES, max_steps=max_steps,
            callbacks=[signaller, OnExceptionCheckpoint(dirpath), Keep()], enable_checkpointing=True)
    except BaseException as error:  # SIGTERMException is a SystemExit
        ended = {"type": type(error).__name__, "message": str(error)[:2000]}
    stopped = time.monotonic()
    ended["seconds"] = stopped - signaller.sent_at if signaller.sent_at is not None else None
    ended["global_step"] = trainer_ref[0].global_step if trainer_ref else None
    ended["rank"] = GLOBAL_RANK
    return ended


def fail_with_on_exception_checkpoint(dirpath: str | None, how: str, rank: int, step: int, timeout: float = 5,
                                      **strategy: Any) -> dict[str, Any]:
    """Train with ``OnExceptionCheckpoint(dirpath)`` (None: without); global rank ``rank`` fails at the start of step
    ``step``:
    ``how="raise"`` raises an error, ``how="stuck"`` gets stuck for good (SIGTERM ignored). Returns how this rank's fit
    ended and the seconds from the failure's step start to the end."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    started: list[float] = []

    class Fail(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.global_step != step:
                return
            started.append(time.monotonic())
            if trainer.global_rank != rank:
                return
            if how == "raise":
                raise RuntimeError(f"the user's callback failed on rank {rank}")
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            while True:
                time.sleep(3600)

    ended: dict[str, Any] = {"type": "none", "message": ""}
    try:
        fit("mlp", PipelineParallelStrategy(transfer_timeout=timeout, **strategy), devices=DEVICES, max_steps=step + 3,
            callbacks=[Fail(), *([OnExceptionCheckpoint(dirpath)] if dirpath is not None else [])],
            enable_checkpointing=dirpath is not None)
    except BaseException as error:
        ended = {"type": type(error).__name__, "message": str(error)[:2000]}
    ended["seconds"] = time.monotonic() - started[0] if started else None
    return ended
