"""The strategy's hooks at the start and end of Lightning's loops (fit, validate, test, predict): each tells this rank's
:class:`~lightning_pp.model.session.StageSession`."""

from __future__ import annotations

from abc import abstractmethod
from contextlib import AbstractContextManager
from typing import Any

import torch
from lightning.pytorch.strategies import ParallelStrategy
from typing_extensions import override

__all__ = ["LoopHooks"]


class LoopHooks(ParallelStrategy):
    """The loop hooks of :class:`~lightning_pp.strategy.PipelineParallelStrategy`."""

    _session: Any  # this rank's StageSession during a run
    # pipedream_2bw: the gradient the latest fit left unapplied (by name), for checkpoints saved after it
    _unapplied_gradient: dict[str, torch.Tensor]

    @abstractmethod
    def _collective(self, what: str) -> AbstractContextManager[None]: ...

    @override
    def on_train_start(self) -> None:
        if self._session is not None:
            self._session.restore_example_input()
        self._start_loop("training_step")

    @override
    def on_validation_start(self) -> None:
        if self._session is not None:
            self._session.drain()
        self._start_loop("validation_step")

    @override
    def on_train_end(self) -> None:
        if self._session is not None:
            self._unapplied_gradient = self._session.end_fit(self._collective)

    @override
    def on_test_start(self) -> None:
        self._start_loop("test_step")

    @override
    def on_predict_start(self) -> None:
        self._start_loop("predict_step")

    def _start_loop(self, step_name: str) -> None:
        if self._session is not None:
            self._session.start_loop(step_name, self._collective)

    @override
    def on_validation_end(self) -> None:  # (training frees them at each optimizer step)
        self._end_loop()

    @override
    def on_test_end(self) -> None:
        self._end_loop()

    @override
    def on_predict_end(self) -> None:
        self._end_loop()

    def _end_loop(self) -> None:
        if self._session is not None:
            self._session.end_loop()
