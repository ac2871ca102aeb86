"""Recording the last stage's ``self.log`` calls per micro-batch and replaying one combined call per key everywhere.

The loss and the user's metrics only exist on the last stage, but Lightning's logger writes from global rank 0 and
callbacks decide on every rank. So during a pipelined step ``LightningModule.log`` is recorded instead of executed,
the records are combined over micro-batches (``reduce_fx`` "mean" weighted by micro-batch size, which equals the
single-device value of a batch mean; "sum", "max", "min" as named), sent to every stage and replayed there.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_pp.errors import PipelineConfigError

_LOG_SIGNATURE = inspect.signature(pl.LightningModule.log)
_REDUCTIONS = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min",
               torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min"}  # fmt: skip

# (name, value, log keyword arguments) with value a float, ready to send and replay
LogRecord = tuple[str, float, dict[str, Any]]


class LogRecorder:
    """Collects ``self.log`` calls of one step, tagged with the micro-batch they came from."""

    def __init__(self) -> None:
        self._calls: list[tuple[int, str, torch.Tensor, dict[str, Any]]] = []

    @contextmanager
    def recording(self, module: pl.LightningModule, microbatch: int | None) -> Iterator[None]:
        """Within the block, ``module.log`` records (``microbatch`` None: discards) instead of logging."""

        def log(*args: Any, **kwargs: Any) -> None:
            bound = _LOG_SIGNATURE.bind(module, *args, **kwargs)
            bound.apply_defaults()
            options = dict(bound.arguments)
            options.pop("self")
            name, value = options.pop("name"), options.pop("value")
            if microbatch is None:
                return
            if not isinstance(value, (torch.Tensor, int, float)):
                raise PipelineConfigError(
                    f"self.log({name!r}, ...) got a {type(value).__name__}; inside a pipelined step log tensors or "
                    f"numbers, e.g. metric.update(...) then self.log({name!r}, metric.compute()) in an epoch hook."
                )
            self._calls.append((microbatch, name, torch.as_tensor(value).detach(), options))

        module.log = log  # type: ignore[method-assign]
        try:
            yield
        finally:
            del module.log

    def combine(self, microbatch_sizes: list[int]) -> list[LogRecord]:
        """One record per key: micro-batch values reduced with the key's ``reduce_fx``."""
        by_name: dict[str, list[tuple[int, torch.Tensor, dict[str, Any]]]] = {}
        for microbatch, name, value, options in self._calls:
            by_name.setdefault(name, []).append((microbatch, value, options))
        records: list[LogRecord] = []
        for name, entries in by_name.items():
            options = dict(entries[-1][2])
            reduction = _REDUCTIONS.get(options["reduce_fx"])
            if reduction is None:
                raise PipelineConfigError(
                    f"self.log({name!r}, reduce_fx={options['reduce_fx']!r}) cannot be combined over micro-batches; "
                    f"use one of 'mean', 'sum', 'max', 'min'."
                )
            values = torch.stack([v.double().reshape(()) for _, v, _ in entries])
            if reduction == "mean":
                weights = torch.tensor([float(microbatch_sizes[mb]) for mb, _, _ in entries], dtype=torch.float64)
                combined = (values * weights).sum() / weights.sum()
            else:
                combined = getattr(values, reduction)()
            if options.get("batch_size") is not None:
                options["batch_size"] = sum(int(o["batch_size"]) for _, _, o in entries)
            records.append((name, float(combined), options))
        self._calls.clear()
        return records


def replay(module: pl.LightningModule, records: list[LogRecord]) -> None:
    """Call ``module.log`` once per record, with the combined value."""
    for name, value, options in records:
        module.log(name, torch.tensor(value, dtype=torch.get_default_dtype(), device=module.device), **options)
