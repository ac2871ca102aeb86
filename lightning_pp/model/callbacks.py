"""Lightning's own callbacks on a pipeline stage (the outcome for each: ``docs/compatibility.md``).

Most need nothing. Before the split (:func:`check_callbacks`): those that cannot give one device's result are refused,
naming what to use instead, and norms with batch statistics are warned about (they see micro-batches). Once the stage
exists (:func:`adapt_callbacks`): ``WeightAveraging`` and ``EMAWeightAveraging``, which copied the whole module in
their ``setup``, average the stage's module as split, and a checkpoint holds the whole averaged model gathered as the
live one is; ``ThroughputMonitor`` counts a pipeline, not each of its ranks, as one device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MethodType
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import (
    BatchSizeFinder,
    ModelPruning,
    StochasticWeightAveraging,
    ThroughputMonitor,
    WeightAveraging,
)
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.optim.swa_utils import AveragedModel

from lightning_pp import _compat
from lightning_pp.errors import PipelineConfigError

__all__ = ["StageAveragedModel", "adapt_callbacks", "batch_statistics_modules", "check_callbacks"]

# the callbacks refused, each with why and what to use instead
_REFUSED: dict[type, str] = {
    StochasticWeightAveraging: (
        "it deep-copies the whole module before the split and saves that copy in its own state (rank 0's, whose other "
        "stages' blocks never change), and its BatchNorm epoch skips a backward the pipelined step runs itself. Use "
        "lightning.pytorch.callbacks.WeightAveraging() instead (its default is SWA's equal-weight average; override "
        "`should_update` to average from an epoch on) with torch.optim.swa_utils.SWALR as the scheduler returned by "
        "configure_optimizers"),
    ModelPruning: (
        "each rank holds only its stage's blocks, so a global threshold (use_global_unstructured=True, the default) "
        "would be each stage's own, and a pruned weight's entries (weight_orig, weight_mask) are not the ones the "
        "split gathers into checkpoints. Prune on one device before or after the pipelined run "
        "(torch.nn.utils.prune, then prune.remove so that only `weight` remains)"),
    BatchSizeFinder: (
        "it (also what Tuner.scale_batch_size runs) catches an out-of-memory error on the rank where it happens while "
        "the other stages wait for that rank's transfers (Lightning refuses it under every distributed strategy too). "
        "Set the batch size by hand (a multiple of `microbatches`): try sizes in short runs and read each stage's "
        "peak memory from PipelineMonitor (pipeline/stage{s}/peak_memory_mb)"),
}


def check_callbacks(trainer: Any, module: nn.Module, *, options: Any, microbatches: int) -> None:
    """Before any collective, alike on every rank: refuse the callbacks a pipeline cannot run as one device would
    (``options``: the strategy's :class:`~lightning_pp.options.PipelineOptions`), and warn about the norms with batch
    statistics in ``module`` when it trains on several ``microbatches`` (1: nothing to warn about).

    Raises:
        PipelineConfigError: naming the callback, why, and what to use instead.
    """
    for callback in trainer.callbacks:
        for cls, why in _REFUSED.items():
            if isinstance(callback, cls):
                raise PipelineConfigError(
                    f"{type(callback).__name__} does not work with PipelineParallelStrategy: {why}.")
        if isinstance(callback, WeightAveraging):
            _check_averaging(callback, options)
    if microbatches > 1:
        _warn_batch_statistics(module, microbatches)


def _check_averaging(callback: Any, options: Any) -> None:
    """What a stage's averaged model does not cover: sharded weights and checkpoints, and delayed updates."""
    unsupported = [what for what, bad in (
        ("state_dict_type='sharded'", options.state_dict_type == "sharded"),
        ("data_parallel_mode='fsdp'", options.data_parallel_mode == "fsdp"),
        (f"tensor_parallel_size={options.tensor_parallel_size}", options.tensor_parallel_size > 1),
        ("schedule='pipedream_2bw'", options.schedule == "pipedream_2bw")) if bad]
    if unsupported:
        raise PipelineConfigError(
            f"{type(callback).__name__} with PipelineParallelStrategy({', '.join(unsupported)}) is not supported: "
            f"each stage averages its own weights whole and a checkpoint gathers the averaged model into one file. "
            f"Use state_dict_type='full', data_parallel_mode='ddp', tensor_parallel_size=1 and a synchronous schedule "
            f"(schedule='1f1b'), or drop the callback.")


def batch_statistics_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The submodules whose training output or state depends on the batch they see: every BatchNorm (SyncBatchNorm
    too) and an InstanceNorm with ``track_running_stats=True`` (its running statistics)."""
    batch_norm, instance_norm = _compat.batch_statistics_classes()
    return [(name, sub) for name, sub in module.named_modules()
            if isinstance(sub, batch_norm) or (isinstance(sub, instance_norm) and bool(sub.track_running_stats))]


def _warn_batch_statistics(module: nn.Module, microbatches: int) -> None:
    found = batch_statistics_modules(module)
    if not found:
        return
    names = ", ".join(f"{name} ({type(sub).__name__})" for name, sub in found[:4])
    more = f" and {len(found) - 4} more" if len(found) > 4 else ""
    rank_zero_warn(
        f"lightning_pp: {names}{more} compute batch statistics, and the pipeline runs them on each of the "
        f"{microbatches} micro-batches of a batch: training equals one device accumulating gradients over "
        f"{microbatches} micro-batches (accumulate_grad_batches={microbatches} on batches {microbatches} times "
        f"smaller), not one device on the whole batch. SyncBatchNorm does not change this (it synchronizes over "
        f"data-parallel replicas, not over micro-batches). For one device's result use microbatches=1 (which gives up "
        f"the pipeline's overlap), or GroupNorm or LayerNorm, or statistics of the input computed over the whole "
        f"batch in on_train_batch_start (which every stage runs on the whole batch).")


def adapt_callbacks(trainer: Any, module: pl.LightningModule, *, gather: Callable[[], dict[str, Any]],
                    num_replicas: int, split: bool, fitting: bool) -> None:
    """Once this rank's stage exists: weight averaging over the stage (``split``: the module holds one stage;
    ``gather()``: the whole module's state on global rank 0, a collective), and throughput counted per pipeline."""
    for callback in trainer.callbacks:
        if isinstance(callback, WeightAveraging) and split:
            _average_the_stage(callback, module, gather, fitting)
        elif isinstance(callback, ThroughputMonitor):
            for meter in _compat.throughputs(callback):
                # the stages of a pipeline process the same samples: one device per replica (1: no global metrics)
                meter.world_size = num_replicas


class StageAveragedModel(AveragedModel):
    """An ``AveragedModel`` of one pipeline stage: ``module`` holds copies of the parameters and buffers the stage
    holds now (under the whole model's names, in the stage's order), so that ``WeightAveraging`` updates and swaps
    them as it would the whole module's on one device. When the stage's weights change (the first training step keeps
    the weights outside the blocks only where they are used), ``module`` follows at its next use, keeping the averaged
    values by name. Its ``state_dict`` is the whole averaged model gathered on global rank 0 (a collective: every rank
    calls it when a checkpoint is saved), and ``load_state_dict`` takes a whole model's.

    ``gather()`` gives the live module's whole state on global rank 0; ``previous``: an averaged model of the same
    module whose values to keep.
    """

    def __init__(self, live: nn.Module, gather: Callable[[], dict[str, Any]], device: Any, use_buffers: bool,
                 previous: StageAveragedModel | None = None, **kwargs: Any) -> None:
        super().__init__(_mirror(live), device=device, use_buffers=use_buffers, **kwargs)
        # plain attributes, not submodules or parameters
        self.__dict__.update(live=live, gather=gather, device=device, held=self._held(live))
        if previous is not None:
            self._keep(_compat.submodule(previous, "module"))  # the copies as they are (no _follow)
            self.n_averaged.copy_(previous.n_averaged)

    @staticmethod
    def _held(module: nn.Module) -> list[int]:
        return [id(t) for t in (*module.parameters(), *module.buffers())]

    def __getattr__(self, name: str) -> Any:
        if name == "module" and "live" in self.__dict__:  # every use of the copies by name (nn.Module keeps them in
            self._follow()                                 # _modules, so attribute reads come here)
        return super().__getattr__(name)

    def _follow(self) -> None:
        """Copies of what the stage holds now, if that changed since they were made."""
        live = self.__dict__["live"]
        held = self._held(live)
        if held != self.__dict__["held"]:
            kept = _compat.submodule(self, "module")
            _compat.set_submodule(self, "module", _mirror(live).to(self.__dict__["device"]))
            self._keep(kept)
            self.__dict__["held"] = held

    def update_parameters(self, model: nn.Module) -> None:
        self._follow()  # (without use_buffers, torch reads the copies through self.parameters())
        super().update_parameters(model)

    def _keep(self, kept: nn.Module | None) -> None:
        """Copy the values of ``kept`` (an earlier copy) into the copies of the same names."""
        if kept is None:
            return
        values = kept.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, value in _compat.submodule(self, "module").state_dict(keep_vars=True).items():
                if name in values and values[name].shape == value.shape:
                    value.copy_(values[name])

    def _tensors(self, module: nn.Module) -> list[torch.Tensor]:
        return [*module.parameters(), *module.buffers()]

    def swap(self) -> None:
        """Exchange the averaged values and the live module's (as ``WeightAveraging`` does for validation)."""
        for averaged, current in zip(self._tensors(self.module), self._tensors(self.__dict__["live"]), strict=True):
            kept = averaged.detach().clone()
            averaged.detach().copy_(current.detach())
            current.detach().copy_(kept)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        own = {k: v for k, v in super().state_dict(*args, **kwargs).items() if not k.startswith("module.")}
        self.swap()  # gathered as the live module is: the averaged values in its place for the while
        try:
            whole = self.__dict__["gather"]()
        finally:
            self.swap()
        return {**own, **{f"module.{k}": v for k, v in whole.items()}}

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load this stage's entries of a whole averaged model's state (``module.`` names, ``n_averaged``)."""
        whole = {k[len("module."):]: v for k, v in state_dict.items() if k.startswith("module.")}
        own = self.module.state_dict()
        missing = [k for k in own if k not in whole]
        if missing and strict:
            raise PipelineConfigError(
                f"The averaged model in the checkpoint has no entries for {missing[:5]} (of {len(missing)} missing): "
                f"it was saved from a different model.")
        with torch.no_grad():
            for name, value in own.items():
                if name in whole:
                    value.copy_(whole[name])
            if "n_averaged" in state_dict:
                self.n_averaged.copy_(state_dict["n_averaged"])

    def load_current(self, state: Mapping[str, Any]) -> None:
        """Load this stage's entries of a whole model's state into the live module."""
        live = self.__dict__["live"]
        own = live.state_dict()
        missing = [k for k in own if k not in state]
        if missing:
            raise PipelineConfigError(
                f"The checkpoint's current_model_state has no entries for {missing[:5]} (of {len(missing)} missing): "
                f"it was saved from a different model.")
        live.load_state_dict({k: state[k] for k in own})


def _mirror(module: nn.Module) -> nn.Module:
    """Detached copies of ``module``'s parameters and buffers in a tree of plain modules with the same names, built
    in ``named_modules`` order so that ``parameters()`` and ``buffers()`` come in the order the module gives them."""
    root = nn.Module()
    nodes: dict[str, nn.Module] = {"": root}
    owners = dict(module.named_modules())
    for name in owners:
        if name:
            parent, _, leaf = name.rpartition(".")
            nodes[name] = nn.Module()
            nodes[parent].add_module(leaf, nodes[name])
    for name, param in module.named_parameters():
        parent, _, leaf = name.rpartition(".")
        nodes[parent].register_parameter(leaf, nn.Parameter(param.detach().clone(), param.requires_grad))
    for name, buffer in module.named_buffers():
        parent, _, leaf = name.rpartition(".")
        persistent = _compat.is_persistent_buffer(owners[parent], leaf)
        nodes[parent].register_buffer(leaf, buffer.detach().clone(), persistent=persistent)
    return root


def _average_the_stage(callback: Any, module: pl.LightningModule, gather: Callable[[], dict[str, Any]],
                       fitting: bool) -> None:
    """Give ``callback`` an averaged model of this stage. In fit, the one its ``setup`` made (of the whole module,
    before the split) is replaced; in a later run (validate, test) the averaged values are carried over by name, and
    those of weights this run holds and fit's did not are the live module's (which fit's end set to the averages)."""
    previous = _compat.averaging_model(callback)
    if previous is None:
        return
    device, use_buffers, kwargs = _compat.averaging_arguments(callback)
    kept = previous if not fitting and isinstance(previous, StageAveragedModel) else None
    averaged = StageAveragedModel(module, gather, device or module.device, use_buffers, kept, **kwargs)
    _compat.set_averaging_model(callback, averaged)
    if "on_load_checkpoint" not in vars(callback):
        callback.on_load_checkpoint = MethodType(_on_load_checkpoint(type(callback).on_load_checkpoint), callback)


def _on_load_checkpoint(lightning: Callable[..., None]) -> Callable[..., None]:
    """``WeightAveraging.on_load_checkpoint`` for a stage: the live module's state goes through the stage's loader
    (Lightning's would load the whole model's into the stage with ``load_state_dict``)."""

    def on_load_checkpoint(callback: Any, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        averaged = _compat.averaging_model(callback)
        if not (isinstance(averaged, StageAveragedModel) and "current_model_state" in checkpoint
                and "averaging_state" in checkpoint):
            lightning(callback, trainer, pl_module, checkpoint)  # no stage's model, or no averaged state saved
            return
        averaged.load_state_dict({**{f"module.{k}": v for k, v in checkpoint["state_dict"].items()},
                                  **checkpoint["averaging_state"]})
        averaged.load_current(checkpoint["current_model_state"])

    return on_load_checkpoint
