"""How a run ends alike on every rank: a failure is told to every rank before any callback hears of it, a failed job's
ranks meet in no more collectives, and a SIGTERM stops a synchronous schedule at the same step's end on every rank.

Lightning calls the callbacks' ``on_exception`` before the strategy's, and a callback's may run a collective (the save
of ``OnExceptionCheckpoint`` gathers every stage's state and meets the others at a barrier): a peer that failed or is
stuck never joins it, and it waits for the process group's timeout (30 minutes). :class:`FirstToHear`, put first in
the Trainer's callbacks, tells every rank of the failure first (see
:class:`~lightning_pp.parallel.failures.FailureSignal`), and the strategy then skips the checkpoint's collectives with a
warning (``FailureSignal.skips``): a failed pipeline holds no state that every stage agrees on (a step half done, a peer
gone).

Lightning 2.6's SIGTERM handler broadcasts inside the signal handler, wherever the main thread is (a stage
mid-backward, waiting for its peer), and each rank that received the signal stops at the end of its own step: stages of
a pipeline, a step apart at the signal, stop at different steps and wait for each other until the transfer timeout.
:class:`SigtermAtStepStart` records the signal without a collective and has every rank agree at each training step's
start whether any rank received one: then every rank stops there, before the step, with ``trainer.received_sigterm``
set, so callbacks (``OnExceptionCheckpoint``) save alike on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_pp import _compat

__all__ = ["AgreedSigterm", "FirstToHear", "SigtermAtStepStart", "listen_first", "stop_listening"]


class AgreedSigterm(SIGTERMException):
    """The SIGTERM every rank agreed to stop at (:class:`SigtermAtStepStart`): a stop, not a failure."""


class FirstToHear(Callback):
    """Calls ``hear(exception)`` in ``on_exception``, placed first among the Trainer's callbacks (:func:`listen_first`)
    so that it runs before any other callback's."""

    def __init__(self, hear: Callable[[BaseException], None]) -> None:
        self._hear = hear

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._hear(exception)


def listen_first(trainer: Any, hear: Callable[[BaseException], None]) -> None:
    """Put a :class:`FirstToHear` of ``hear`` first in ``trainer.callbacks`` (after Lightning has ordered them), in
    place of an earlier run's."""
    trainer.callbacks[:] = [FirstToHear(hear), *(c for c in trainer.callbacks if not isinstance(c, FirstToHear))]


def stop_listening(module: Any) -> None:
    """Take :func:`listen_first`'s callback out of the callbacks of the Trainer ``module`` (a LightningModule, or
    None) is attached to, if any."""
    try:
        trainer = module.trainer if module is not None else None
    except RuntimeError:  # not attached to a Trainer
        return
    if trainer is not None:
        trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, FirstToHear)]


class SigtermAtStepStart:
    """A SIGTERM stops a synchronous schedule at the same step on every rank: the handler only records it (see
    :func:`~lightning_pp._compat.replace_sigterm_handling`), and where Lightning's training loop would broadcast rank
    0's flag at each step's start, every rank takes the largest of all ranks' flags (an all-reduce of one number in
    ``group``, a gloo group of every rank; None: the default group). Every stage is between two steps there (a
    synchronous schedule drains each step), so it costs what Lightning's broadcast costs."""

    def __init__(self, trainer: Any, group: Any) -> None:
        self.trainer, self.group = trainer, group
        self.received = False

    def record(self) -> None:
        self.received = True

    def __call__(self) -> None:
        flag = torch.tensor([int(self.received)], dtype=torch.int64, device="cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item():
            _compat.mark_sigterm_received(self.trainer)  # what callbacks read (trainer.received_sigterm)
            raise AgreedSigterm
