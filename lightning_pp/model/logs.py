"""Recording the last stage's ``self.log`` calls per micro-batch and replaying one combined call per key everywhere.

The loss and the user's metrics only exist on the last stage, but Lightning's logger writes from global rank 0 and
callbacks decide on every rank. So during a pipelined step ``LightningModule.log`` is recorded instead of executed,
the records are combined over micro-batches (``reduce_fx`` "mean" weighted by micro-batch size, which equals the
single-device value of a batch mean; "sum", "max", "min" as named), sent to every stage and replayed there.

torchmetrics objects are handled whole. Their step value is what one update with the whole batch gives: a copy of the
metric is updated with every micro-batch the step passes to the metric's forward, then computed once (a mean of
per-micro-batch values would be wrong for, e.g., macro-averaged accuracy). Their epoch value is computed on every
stage from the last stage's state, which replaces torchmetrics' all-gather over processes: the stages are not
data-parallel replicas, and the other stages' states are empty.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities import move_data_to_device
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torchmetrics import Metric

from lightning_pp import _compat
from lightning_pp.errors import PipelineConfigError
from lightning_pp.parallel.topology import StageGroups
from lightning_pp.runtime.remote import refuse_remote

_LOG_SIGNATURE = inspect.signature(pl.LightningModule.log)
_TOTAL_NORM = re.compile(r"^grad_(.+)_norm_total$")  # Lightning's grad_norm total, e.g. grad_2.0_norm_total
_REDUCTIONS = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min",
               torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min"}  # fmt: skip


@dataclass(frozen=True)
class MetricRef:
    """A logged ``Metric``: its attribute path in the module and the batch value of its forward (if it ran)."""

    attribute: str
    forward_value: float | None


@dataclass(frozen=True)
class _MetricCall:
    """A ``self.log`` of a ``Metric`` during a micro-batch: its attribute path and its forward's value, left where it
    was computed (read once per step, in :meth:`LogRecorder.combine`: not a device sync per micro-batch)."""

    attribute: str
    forward_value: torch.Tensor | None


# (name, value, log keyword arguments), ready to send and replay
LogRecord = tuple[str, "float | MetricRef", dict[str, Any]]
# a record without its number: (name, the metric's attribute path or None for a plain value, whether a number goes
# with it, log keyword arguments). From step to step the layout of a step's records rarely changes, only the numbers.
RecordLayout = tuple[str, "str | None", bool, dict[str, Any]]


def split_records(records: list[LogRecord]) -> tuple[list[RecordLayout], list[float]]:
    """``records`` as their layout and their numbers (what changes from step to step), for sending apart."""
    layout: list[RecordLayout] = []
    numbers: list[float] = []
    for name, value, options in records:
        if isinstance(value, MetricRef):
            layout.append((name, value.attribute, value.forward_value is not None, options))
            if value.forward_value is not None:
                numbers.append(value.forward_value)
        else:
            layout.append((name, None, True, options))
            numbers.append(value)
    return layout, numbers


def join_records(layout: list[RecordLayout], numbers: list[float]) -> list[LogRecord]:
    """The records :func:`split_records` took apart."""
    records: list[LogRecord] = []
    values = iter(numbers)
    for name, attribute, has_number, options in layout:
        number = next(values) if has_number else None
        if attribute is None:
            assert number is not None  # a plain value always has its number
            records.append((name, number, options))
        else:
            records.append((name, MetricRef(attribute, number), options))
    return records


class _StateFromLastStage:
    """Stands in for a metric's ``_sync_dist``: every stage takes the last stage's whole state, in one broadcast inside
    the pipeline; with data-parallel replicas, torchmetrics' own sync then reduces those states over the stage's
    replicas, as DDP reduces over its ranks.

    The last stage's state is the pipeline's (the other stages never update), so the state's own reduction (sum, cat,
    ...) is not applied within the pipeline. One broadcast per metric keeps the collectives equal on every stage
    whatever its states are (torchmetrics' all-gather runs one per list element, which differs per stage).
    """

    def __init__(self, metric: Metric, groups: StageGroups) -> None:
        self.metric = metric
        self.groups = groups

    def __call__(self, dist_sync_fn: Any = None, process_group: Any = None) -> None:
        source = self.groups.last_stage_rank
        mine = dist.get_rank() == source
        box = [move_data_to_device(self.metric.metric_state, torch.device("cpu")) if mine else None]
        dist.broadcast_object_list(box, src=source, group=self.groups.pipeline)
        state = box[0]
        assert state is not None
        for name, value in state.items():
            setattr(self.metric, name, move_data_to_device(value, self.metric.device))
        if self.groups.layout.num_replicas > 1:
            _compat.sync_metric_states(self.metric, dist_sync_fn, self.groups.replicas)


def _not_distributed() -> bool:
    """A torchmetrics ``distributed_available_fn``: compute from this process's state alone."""
    return False


class LogRecorder:
    """Collects ``self.log`` calls of one step, tagged with the micro-batch they came from."""

    def __init__(self) -> None:
        self._calls: list[tuple[int, str, torch.Tensor | _MetricCall, dict[str, Any]]] = []
        self._metrics: list[Metric] = []  # the module's metrics, watched during recording
        self._logged_metrics: dict[str, Metric] = {}  # attribute path -> metric logged in this step
        # id(metric) -> its copy updated with this step's micro-batches (the step value is computed from it); by id
        # because a Metric's hash follows its state
        self._step_copies: dict[int, Metric] = {}
        self._updated: set[int] = set()

    def attach(self, module: pl.LightningModule, groups: StageGroups | None) -> None:
        """Watch the module's metrics; with ``groups`` (more than one stage), sync their states from the pipeline's
        last stage (see the module's docstring)."""
        self.detach()
        self._metrics = [m for m in module.modules() if isinstance(m, Metric)]
        if groups is None:
            return
        for metric in self._metrics:
            _compat.replace_metric_sync(metric, _StateFromLastStage(metric, groups))

    def detach(self) -> None:
        """Undo :meth:`attach`."""
        for metric in self._metrics:
            _compat.replace_metric_sync(metric, None)
        self._metrics = []
        self._step_copies.clear()
        self._updated.clear()

    def _step_copy(self, metric: Metric) -> Metric:
        copy = self._step_copies.get(id(metric))
        if copy is None:
            copy = metric.clone()
            for part in copy.modules():  # nested metrics (compositions, wrappers) too
                if isinstance(part, Metric):
                    _compat.replace_metric_sync(part, None)
                    part.distributed_available_fn = _not_distributed  # the step's value is this stage's alone
            copy.reset()
            self._step_copies[id(metric)] = copy
        self._updated.add(id(metric))
        return copy

    def _step_value(self, metric: Metric) -> float | None:
        """The metric over this step's micro-batches, as one forward over the whole batch gives it (scalars only)."""
        if id(metric) not in self._updated:
            return None
        value = self._step_copies[id(metric)].compute()
        return float(value) if isinstance(value, torch.Tensor) and value.numel() == 1 else None

    @contextmanager
    def recording(self, module: pl.LightningModule, microbatch: int | None) -> Iterator[None]:
        """Within the block, ``module.log`` records (``microbatch`` None: discards) instead of logging, and each
        metric's forward also updates the metric's step copy."""
        recorder = self

        # a plain function, not a bound method: a deep copy of the metric (Metric.clone) shares it, not the recorder
        def on_metric_forward(metric: Metric, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            recorder._step_copy(metric).update(*args, **kwargs)

        hooks = ([m.register_forward_hook(on_metric_forward, with_kwargs=True) for m in self._metrics]
                 if microbatch is not None else [])

        def log(*args: Any, **kwargs: Any) -> None:
            name, value, options = _log_arguments(module, args, kwargs)
            if microbatch is None:
                return
            if isinstance(value, Metric):
                attribute = next((n for n, m in module.named_modules() if m is value), None)
                if attribute is None:
                    raise PipelineConfigError(
                        f"self.log({name!r}, <{type(value).__name__}>): the metric must be an attribute of the "
                        f"LightningModule so that every pipeline stage can replay it; assign it in __init__."
                    )
                cache = _compat.metric_forward_value(value)
                forward_value = cache.detach() if isinstance(cache, torch.Tensor) and cache.numel() == 1 else None
                self._calls.append((microbatch, name, _MetricCall(attribute, forward_value), options))
                self._logged_metrics[attribute] = value
                return
            if not isinstance(value, (torch.Tensor, int, float)):
                raise PipelineConfigError(
                    f"self.log({name!r}, ...) got a {type(value).__name__}; log a tensor, a number or a torchmetrics "
                    f"Metric that is an attribute of the module."
                )
            refuse_remote(value, f"The value logged as {name!r}")
            value = value.detach() if isinstance(value, torch.Tensor) else torch.tensor(value, device="cpu")
            self._calls.append((microbatch, name, value, options))

        with _logging_through(module, log):
            try:
                yield
            finally:
                for hook in hooks:
                    hook.remove()

    def combine(self, microbatch_sizes: list[float]) -> list[LogRecord]:
        """One record per key: micro-batch values reduced with the key's ``reduce_fx`` (means weighted by
        ``microbatch_sizes``: samples, or the strategy's ``microbatch_weight``)."""
        by_name: dict[str, list[tuple[int, Any, dict[str, Any]]]] = {}
        for microbatch, name, value, options in self._calls:
            by_name.setdefault(name, []).append((microbatch, value, options))
        records: list[LogRecord] = []
        for name, entries in by_name.items():
            options = dict(entries[-1][2])
            last_value = entries[-1][1]
            sizes = [float(microbatch_sizes[mb]) for mb, _, _ in entries]
            if isinstance(last_value, _MetricCall):
                forward_value = self._step_value(self._logged_metrics[last_value.attribute])
                forwards = [v.forward_value for _, v, _ in entries]
                if forward_value is None and all(f is not None for f in forwards):
                    # the metric was not called through its forward in this step: keep what the step's calls gave
                    forward_value = float(weighted_mean(stacked(forwards), sizes))
                records.append((name, MetricRef(last_value.attribute, forward_value), options))
                continue
            reduction = _REDUCTIONS.get(options["reduce_fx"])
            if reduction is None:
                raise PipelineConfigError(
                    f"self.log({name!r}, reduce_fx={options['reduce_fx']!r}) cannot be combined over micro-batches; "
                    f"use one of 'mean', 'sum', 'max', 'min'."
                )
            values = stacked([v for _, v, _ in entries])
            combined = float(weighted_mean(values, sizes) if reduction == "mean" else getattr(values, reduction)())
            if options.get("batch_size") is not None:
                options["batch_size"] = sum(int(o["batch_size"]) for _, _, o in entries)
            records.append((name, combined, options))
        self._calls.clear()
        self._logged_metrics.clear()
        for key in self._updated:
            self._step_copies[key].reset()
        self._updated.clear()
        return records


def _log_arguments(module: pl.LightningModule, args: tuple[Any, ...], kwargs: dict[str, Any]
                   ) -> tuple[str, Any, dict[str, Any]]:
    """A ``self.log(...)`` call's name, value and other arguments (defaults filled in)."""
    bound = _LOG_SIGNATURE.bind(module, *args, **kwargs)
    bound.apply_defaults()
    options = dict(bound.arguments)
    options.pop("self")
    return options.pop("name"), options.pop("value"), options


@contextmanager
def _logging_through(module: pl.LightningModule, log: Any) -> Iterator[None]:
    """``module.log`` is ``log`` within the block; what it was before (another recording's) afterwards."""
    previous = module.__dict__.get("log")
    module.log = log  # type: ignore[method-assign]
    try:
        yield
    finally:
        if previous is None:
            del module.log
        else:
            module.log = previous  # type: ignore[method-assign]


class HookLogs:
    """``self.log`` calls in the hooks around an optimizer step (``on_after_backward``, ``on_before_optimizer_step``,
    of the module and of callbacks), combined over the pipeline's stages so that every rank logs what one device logs.

    Each stage computes such values from its own parameters: Lightning's ``grad_norm`` gives each stage its own
    parameters' norms and a partial total. The calls are recorded, gathered over the pipeline when the step ends, and
    replayed on every stage: a key logged by one stage takes that stage's value (a parameter's norm); a key several
    stages log alike stays; ``grad_{p}_norm_total`` becomes the p-norm of every parameter's ``grad_{p}_norm...`` entry
    (each parameter once, as one device counts it). A key the stages log differently otherwise (a norm computed by
    hand over ``self.parameters()``) takes the last stage's value, with a warning naming it: only the user's code knows
    how such values combine.
    """

    def __init__(self, group: Any) -> None:
        self.group = group  # the pipeline's group
        self._active = False
        self._warned: set[str] = set()

    @contextmanager
    def combining(self, module: pl.LightningModule,
                  collective: Callable[[str], AbstractContextManager[None]]) -> Iterator[None]:
        """Record ``module.log`` within the block (nested blocks record into the outer one); on leaving it without an
        error, every stage of the pipeline combines and logs the records."""
        if self._active:
            yield
            return
        calls: list[tuple[str, float, dict[str, Any]]] = []

        def log(*args: Any, **kwargs: Any) -> None:
            name, value, options = _log_arguments(module, args, kwargs)
            if isinstance(value, Metric):  # a metric's state is the pipeline's already (see _StateFromLastStage)
                type(module).log(module, name, value, **options)
            else:
                calls.append((name, float(value), options))

        self._active = True
        try:
            with _logging_through(module, log):
                yield
        finally:
            self._active = False
        gathered: list[Any] = [None] * dist.get_world_size(self.group)
        with collective("combining what the hooks around the optimizer step logged"):
            dist.all_gather_object(gathered, calls, group=self.group)
        for name, value, options in self._combined(gathered):
            type(module).log(module, name, torch.tensor(value, dtype=torch.get_default_dtype(), device=module.device),
                             **options)

    def _combined(self, per_stage: list[list[tuple[str, float, dict[str, Any]]]]
                  ) -> list[tuple[str, float, dict[str, Any]]]:
        values: dict[str, list[float]] = {}
        options: dict[str, dict[str, Any]] = {}
        for calls in per_stage:
            for name, value, call_options in calls:
                values.setdefault(name, []).append(value)
                options.setdefault(name, call_options)
        combined = []
        for name, logged in values.items():
            total = _TOTAL_NORM.match(name)
            if total is not None:
                parts = [v[0] for key, v in values.items() if key.startswith(f"grad_{total[1]}_norm") and key != name]
                value = float(torch.tensor(parts, dtype=torch.float64, device="cpu").norm(float(total[1])))
            else:
                value = logged[-1]
                if len(set(logged)) > 1 and name not in self._warned:
                    self._warned.add(name)
                    rank_zero_warn(
                        f"{name!r} was logged with different values on the pipeline's stages ({logged}) in a hook "
                        f"around the optimizer step; each stage holds only its own parameters, so a value computed "
                        f"over self.parameters() covers one stage. The last stage's value is logged. Lightning's "
                        f"grad_norm is combined exactly.")
            combined.append((name, value, options[name]))
        return combined


def stacked(values: list[Any]) -> torch.Tensor:
    """Logged scalars (on the device they were computed on, or the host) as one float64 tensor on the first's device."""
    device = values[0].device
    return torch.stack([v.to(device=device, dtype=torch.float64).reshape(()) for v in values])


def weighted_mean(values: torch.Tensor, weights: list[float]) -> torch.Tensor:
    """The mean of ``values`` weighted by ``weights``, computed where ``values`` are (read it once, with ``float``)."""
    weight = torch.tensor(weights, dtype=torch.float64, device=values.device)
    return (values * weight).sum() / weight.sum()


def replay(module: pl.LightningModule, records: list[LogRecord], updated_here: bool) -> None:
    """Call ``module.log`` once per record, with the combined value (or this stage's copy of the metric).

    On stages where the metrics were not updated (all but the last), a logged metric is marked as updated, as it was
    on the last stage: its next ``compute`` then syncs afresh instead of warning about a missing update.
    """
    for name, value, options in records:
        if isinstance(value, MetricRef):
            metric = module.get_submodule(value.attribute)
            assert isinstance(metric, Metric)
            forward_value = (torch.tensor(value.forward_value, device=module.device)
                             if value.forward_value is not None else None)
            _compat.mark_metric_updated(metric, counted=not updated_here, forward_value=forward_value)
            type(module).log(module, name, metric, **options)
        else:
            type(module).log(module, name, torch.tensor(value, dtype=torch.get_default_dtype(), device=module.device),
                             **options)
