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
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torchmetrics import Metric

from lightning_pp.errors import PipelineConfigError

_LOG_SIGNATURE = inspect.signature(pl.LightningModule.log)
_REDUCTIONS = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min",
               torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min"}  # fmt: skip



@dataclass(frozen=True)
class MetricRef:
    """A logged ``Metric``: its attribute path in the module and the batch value of its forward (if it ran)."""

    attribute: str
    forward_value: float | None


# (name, value, log keyword arguments), ready to send and replay
LogRecord = tuple[str, "float | MetricRef", dict[str, Any]]


class LogRecorder:
    """Collects ``self.log`` calls of one step, tagged with the micro-batch they came from."""

    def __init__(self) -> None:
        self._calls: list[tuple[int, str, torch.Tensor | MetricRef, dict[str, Any]]] = []

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
            if isinstance(value, Metric):
                attribute = next((n for n, m in module.named_modules() if m is value), None)
                if attribute is None:
                    raise PipelineConfigError(
                        f"self.log({name!r}, <{type(value).__name__}>): the metric must be an attribute of the "
                        f"LightningModule so that every pipeline stage can replay it; assign it in __init__."
                    )
                cache = value._forward_cache
                forward_value = float(cache) if isinstance(cache, torch.Tensor) and cache.numel() == 1 else None
                self._calls.append((microbatch, name, MetricRef(attribute, forward_value), options))
                return
            if not isinstance(value, (torch.Tensor, int, float)):
                raise PipelineConfigError(
                    f"self.log({name!r}, ...) got a {type(value).__name__}; log a tensor, a number or a torchmetrics "
                    f"Metric that is an attribute of the module."
                )
            self._calls.append((microbatch, name, torch.as_tensor(value).detach(), options))

        module.log = log  # type: ignore[method-assign]
        try:
            yield
        finally:
            del module.log

    def combine(self, microbatch_sizes: list[int]) -> list[LogRecord]:
        """One record per key: micro-batch values reduced with the key's ``reduce_fx``."""
        by_name: dict[str, list[tuple[int, Any, dict[str, Any]]]] = {}
        for microbatch, name, value, options in self._calls:
            by_name.setdefault(name, []).append((microbatch, value, options))
        records: list[LogRecord] = []
        for name, entries in by_name.items():
            options = dict(entries[-1][2])
            last_value = entries[-1][1]
            sizes = [float(microbatch_sizes[mb]) for mb, _, _ in entries]
            if isinstance(last_value, MetricRef):
                # the step value of a metric's forward: weighted like a batch mean over the micro-batches
                forwards = [v.forward_value for _, v, _ in entries]
                forward_value = None
                if all(f is not None for f in forwards):
                    forward_value = _weighted_mean(torch.tensor(forwards, dtype=torch.float64), sizes)
                records.append((name, MetricRef(last_value.attribute, forward_value), options))
                continue
            reduction = _REDUCTIONS.get(options["reduce_fx"])
            if reduction is None:
                raise PipelineConfigError(
                    f"self.log({name!r}, reduce_fx={options['reduce_fx']!r}) cannot be combined over micro-batches; "
                    f"use one of 'mean', 'sum', 'max', 'min'."
                )
            values = torch.stack([v.double().reshape(()) for _, v, _ in entries])
            combined = _weighted_mean(values, sizes) if reduction == "mean" else float(getattr(values, reduction)())
            if options.get("batch_size") is not None:
                options["batch_size"] = sum(int(o["batch_size"]) for _, _, o in entries)
            records.append((name, combined, options))
        self._calls.clear()
        return records


def _weighted_mean(values: torch.Tensor, weights: list[float]) -> float:
    weight = torch.tensor(weights, dtype=torch.float64)
    return float((values * weight).sum() / weight.sum())


def replay(module: pl.LightningModule, records: list[LogRecord]) -> None:
    """Call ``module.log`` once per record, with the combined value (or this stage's copy of the metric)."""
    for name, value, options in records:
        if isinstance(value, MetricRef):
            metric = module.get_submodule(value.attribute)
            assert isinstance(metric, Metric)
            if value.forward_value is not None:
                metric._forward_cache = torch.tensor(value.forward_value, device=module.device)  # type: ignore[assignment]
            module.log(name, metric, **options)
        else:
            module.log(name, torch.tensor(value, dtype=torch.get_default_dtype(), device=module.device), **options)
