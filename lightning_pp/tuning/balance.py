"""Balancing the stages before the split: blocks per stage by parameter count, or by the forward and backward time of
each block measured on one real micro-batch.

``balance="time"`` runs in ``Strategy.setup``, before the module is split and before ``configure_optimizers``. Global
rank 0 takes the first batch of fit's training data, moves it as Lightning would (``convert_input``, the batch-transfer
hooks), takes micro-batch 0 of it, and runs ``training_step`` on a throw-away deep copy of the module (so BatchNorm
statistics, metric states and counters of the module are untouched, and ``self.log`` is silenced), timing the code
before the first block, each block and the code after the last one, forward and backward. Every random generator
(torch's CPU one and the device's CUDA one, numpy's, Python's) is restored afterwards, so training goes on exactly as
without the probe. The costs are broadcast to every rank, and each computes the same exact split
(:func:`~lightning_pp.schedule.partition.min_max_partition`).
"""

from __future__ import annotations

import contextlib
import copy
import random
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn

from lightning_pp import _compat
from lightning_pp._logging import get_logger
from lightning_pp.errors import PipelineConfigError
from lightning_pp.model.assembly import is_assembled
from lightning_pp.model.blocks import find_blocks
from lightning_pp.model.materialize import has_meta_tensors
from lightning_pp.parallel.device import synchronize_device
from lightning_pp.run import RunContext
from lightning_pp.runtime.microbatch import batch_size, split_batch
from lightning_pp.schedule.partition import min_max_partition, stage_costs, uniform_balance

__all__ = ["BlockCosts", "balance_for", "measure_block_costs", "parameter_balance", "preserved_random_state",
           "probe_first_batch", "resolve_balance", "why_not_time"]

log = get_logger(__name__)

_T = TypeVar("_T")
_REPEATS = 3  # timed runs of the whole step and of each block alone (after one warm-up run); medians are kept


def _blocks(container: nn.Module) -> list[nn.Module]:
    return [getattr(container, key) for key in _compat.child_names(container)]


def parameter_balance(container: nn.Module, num_stages: int) -> list[int]:
    """Blocks per stage that make the stages' parameter counts as even as possible (the largest stage smallest),
    counting each block's own parameters."""
    counts = [sum(p.numel() for p in block.parameters()) for block in _blocks(container)]
    return min_max_partition(counts, num_stages)


@contextmanager
def preserved_random_state(device: torch.device) -> Iterator[None]:
    """Restore torch's CPU generator, ``device``'s CUDA generator, numpy's and Python's global generators on exit.

    A shuffling DataLoader draws its permutation (and its workers' seeds) from torch's global generator when it is
    iterated, and the probe's step may draw dropout masks: without this, training after the probe would see other
    batches and other masks than a run without it.
    """
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        np = None  # type: ignore[assignment]
    numpy_state = np.random.get_state() if np is not None else None
    python_state = random.getstate()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            yield
        finally:
            random.setstate(python_state)
            if np is not None:
                np.random.set_state(numpy_state)


@dataclass(frozen=True)
class BlockCosts:
    """Seconds per micro-batch on one device: each block's forward and backward, and the step's work before the first
    block (the first stage's: embeddings) and after the last one (the last stage's: head and loss)."""

    forward: list[float]
    backward: list[float]
    before: tuple[float, float]  # forward, backward
    after: tuple[float, float]
    # measured with ``detailed=True`` only (schedule="auto"), per block: the input gradient's part of the backward, the
    # bytes the forward saves for the backward and the bytes of its output
    input_backward: list[float] = field(default_factory=list)
    saved_bytes: list[float] = field(default_factory=list)
    output_bytes: list[float] = field(default_factory=list)
    outside_saved_bytes: tuple[float, float] = (0.0, 0.0)  # saved by the work before and after the blocks
    # per block, what it saved that earlier work had saved too (its input, kept by the block before as its output):
    # counted once in `saved_bytes` (the earlier block's), held again by a stage that starts at this block
    shared_bytes: list[float] = field(default_factory=list)

    @property
    def blocks(self) -> list[float]:
        return [f + b for f, b in zip(self.forward, self.backward, strict=True)]

    def to_tensor(self) -> Tensor:
        """``[before, block 0, ..., block n-1, after]``, forward plus backward: what every rank receives."""
        return torch.tensor([sum(self.before), *self.blocks, sum(self.after)], dtype=torch.float64,
                            device="cpu")


def _differentiable(obj: Any) -> list[Tensor]:
    return [t for t in _compat.tree_tensors(obj) if t.requires_grad and (t.is_floating_point() or t.is_complex())]


def _fresh(obj: Any) -> Any:
    """A copy of a block's inputs cut from the step's graph: tensors cloned (a block may work in place), those that
    needed a gradient made to need one again, so the block's backward computes what it computes in the pipeline."""

    def fresh(t: Tensor) -> Tensor:
        if not t.requires_grad:
            return t.detach().clone()
        return t.detach().requires_grad_(True).clone()  # a leaf that needs its gradient, handed on as a non-leaf

    return _compat.tree_map_tensors(obj, fresh)


@dataclass
class _StepRun:
    before_forward: float
    after_forward: float
    backward: float | None  # the whole loss.backward(); None: no loss to back-propagate
    after_backward: float | None  # from backward's start until the gradient reached the last block's output
    before_backward: float | None  # from the gradient reaching the first block's inputs until backward ended
    inputs: list[tuple[tuple[Any, ...], dict[str, Any]]]  # each block's arguments in this run
    block_forward: list[float]  # each block's forward in the step
    block_backward: list[float | None] = field(default_factory=list)  # each block's backward in the step (None: unseen)
    saved_bytes: list[float] = field(default_factory=list)  # what each block's forward saved first for the backward
    output_bytes: list[float] = field(default_factory=list)
    outside_saved_bytes: tuple[float, float] = (0.0, 0.0)  # what the work before and after the blocks saved
    shared_bytes: list[float] = field(default_factory=list)  # what each block saved that earlier work saved too


class _BlockCalls:
    """What the blocks' forward hooks saw in one step: each call's block, start and arguments, then its end and
    output, with the clock read after the device's queued work."""

    def __init__(self, device: torch.device, weights: set[int], num_blocks: int) -> None:
        self.device = device
        self.weights = weights  # the storages of the module's parameters: not activations
        self.num_blocks = num_blocks
        self.before: dict[int, int] = {}  # storage -> bytes saved before the first block, and after the last
        self.after: dict[int, int] = {}
        self.starts: list[tuple[nn.Module, float, tuple[Any, ...], dict[str, Any]]] = []
        self.ends: list[float] = []
        self.outputs: list[Any] = []
        self.saved: list[dict[int, int]] = []  # per call: storage -> bytes its forward saved for the backward first
        self.shared: list[dict[int, int]] = []  # per call: those saved by earlier work too (the block's input, say)
        self._charged: set[int] = set()  # every storage counted so far, each once

    def before_block(self, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        synchronize_device(self.device)
        self.saved.append({})
        self.shared.append({})
        self.starts.append((block, time.perf_counter(), args, kwargs))

    def pack(self, t: Tensor) -> Tensor:
        """A saved tensor's bytes, charged once: to the block running or that ran last (work between blocks is
        theirs), or to the work before the first block or after the last. A block saving what earlier work saved (its
        input, which the block before saved as its output) notes it apart (`shared`): a stage starting at that block
        holds it again, one continuing from the block before does not."""
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.weights:
            return t
        if not self.starts:
            self.before[key] = storage.nbytes()
        elif len(self.ends) == self.num_blocks:  # the last stage holds the blocks' storages already
            if key not in self._charged:
                self.after[key] = storage.nbytes()
        elif key not in self.saved[-1]:
            (self.shared[-1] if key in self._charged else self.saved[-1])[key] = storage.nbytes()
        self._charged.add(key)
        return t

    def after_block(self, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        synchronize_device(self.device)
        self.ends.append(time.perf_counter())
        self.outputs.append(output)


def _forward_step(module: pl.LightningModule, blocks: list[nn.Module], microbatch: Any, device: torch.device,
                  step_context: Callable[[], AbstractContextManager[Any]]) -> tuple[Any, float, float, _BlockCalls]:
    """``training_step`` on ``microbatch`` with the blocks' calls recorded: what it returned, the clock when it
    started and when it returned, and the calls."""
    calls = _BlockCalls(device, {p.untyped_storage().data_ptr() for p in module.parameters()}, len(blocks))
    handles = []
    for block in {id(b): b for b in blocks}.values():  # a block listed twice is hooked once, and runs twice
        handles.append(block.register_forward_pre_hook(calls.before_block, with_kwargs=True))
        handles.append(block.register_forward_hook(calls.after_block, with_kwargs=True))
    try:
        with step_context(), torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(calls.pack, _unpacked):
            synchronize_device(device)
            started = time.perf_counter()
            output = module.training_step(microbatch, 0)
            synchronize_device(device)
            returned = time.perf_counter()
    finally:
        for handle in handles:
            handle.remove()
    return output, started, returned, calls


def _time_backward(loss: Tensor, outputs: list[Any], run: _StepRun, device: torch.device) -> None:
    """``loss.backward()`` into ``run``: the whole of it, where gradient hooks saw the gradient reach the last block's
    output and the first block's inputs, and each block's backward (from the gradient reaching its output until it
    reached the previous block's)."""
    reached: dict[str, float] = {}
    last_output = outputs[-1]

    def mark(key: str, first: bool) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            synchronize_device(device)
            now = time.perf_counter()
            reached[key] = min(reached.get(key, now), now) if first else now

        return hook

    for t in _differentiable(last_output):
        t.register_hook(mark("last output", first=True))  # the gradient reached the blocks: the head is done
    for index, output in enumerate(outputs):
        for t in _differentiable(output):
            t.register_hook(mark(f"output {index}", first=True))
    first_inputs = _differentiable(run.inputs[0])
    for t in first_inputs:
        t.register_hook(mark("first inputs", first=False))  # the blocks are done: what is left runs before them
    synchronize_device(device)
    started = time.perf_counter()
    loss.backward()
    synchronize_device(device)
    ended = time.perf_counter()
    run.backward = ended - started
    if "last output" in reached:
        run.after_backward = reached["last output"] - started
    if not first_inputs:
        run.before_backward = 0.0  # nothing before the blocks receives a gradient through them
    elif "first inputs" in reached:
        run.before_backward = ended - reached["first inputs"]
    arrivals = [reached.get(f"output {index}") for index in range(len(outputs))]
    arrivals.insert(0, reached.get("first inputs", ended))  # block 0's backward ends where the one before starts
    run.block_backward = [b - a if a is not None and b is not None else None
                          for a, b in zip(arrivals[1:], arrivals[:-1], strict=True)]


def _run_step(module: pl.LightningModule, blocks: list[nn.Module], microbatch: Any, device: torch.device,
              step_context: Callable[[], AbstractContextManager[Any]]) -> _StepRun:
    """One ``training_step`` and its backward, with the clock read where the blocks start and end."""
    output, started, returned, calls = _forward_step(module, blocks, microbatch, device, step_context)
    if [id(call[0]) for call in calls.starts] != [id(b) for b in blocks] or len(calls.ends) != len(blocks):
        raise PipelineConfigError(
            f"training_step ran {len(calls.starts)} block calls where the container has {len(blocks)} blocks; a "
            f"pipelined step must run every block once per micro-batch, in order."
        )
    loss = output.get("loss") if isinstance(output, Mapping) else output
    run = _StepRun(calls.starts[0][1] - started, returned - calls.ends[-1], None, None, None,
                   [(args, kwargs) for _, _, args, kwargs in calls.starts],
                   [end - start for (_, start, _, _), end in zip(calls.starts, calls.ends, strict=True)],
                   saved_bytes=[float(sum(saved.values())) for saved in calls.saved],
                   output_bytes=[float(sum(t.numel() * t.element_size() for t in _compat.tree_tensors(out)))
                                 for out in calls.outputs],
                   outside_saved_bytes=(float(sum(calls.before.values())), float(sum(calls.after.values()))),
                   shared_bytes=[float(sum(shared.values())) for shared in calls.shared])
    if isinstance(loss, Tensor) and loss.requires_grad:
        _time_backward(loss, calls.outputs, run, device)
    return run


@dataclass
class _BlockTiming:
    forward: float
    backward: float
    input_backward: float = 0.0


def _unpacked(t: Tensor) -> Tensor:
    return t


def _seconds(device: torch.device, since: float | None = None) -> float:
    """The clock after the device's queued work (minus ``since``)."""
    synchronize_device(device)
    return time.perf_counter() - (since or 0.0)


def _time_block(block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device,
                step_context: Callable[[], AbstractContextManager[Any]], repeats: int,
                detailed: bool = False) -> _BlockTiming:
    """Median forward and backward seconds of ``block`` alone on the arguments it had in the step; the backward
    gets a gradient of ones for each of its outputs that needs one. ``detailed``: also the input gradient alone
    (``torch.autograd.grad`` with respect to the inputs, weights left out: a zero-bubble schedule's I)."""
    forwards, backwards, inputs_only = [], [], []
    for _ in range(repeats):
        for whole in (True, False) if detailed else (True,):  # the whole backward, then the input gradient alone
            fresh = _fresh((args, kwargs))
            with step_context(), torch.enable_grad():
                started = _seconds(device)
                output = block(*fresh[0], **fresh[1])
                seconds = _seconds(device, started)
            outs, inputs = _differentiable(output), _differentiable(fresh)
            grads = [torch.ones_like(t) for t in outs]
            started = _seconds(device)
            if whole:
                if outs:
                    torch.autograd.backward(outs, grads)
                forwards.append(seconds)
                backwards.append(_seconds(device, started))
            else:
                if outs and inputs:
                    torch.autograd.grad(outs, inputs, grads, allow_unused=True)
                inputs_only.append(_seconds(device, started))
        block.zero_grad(set_to_none=True)
    timing = _BlockTiming(statistics.median(forwards), statistics.median(backwards))
    if detailed:
        timing.input_backward = min(statistics.median(inputs_only), timing.backward)
    return timing


def _time_blocks(blocks: list[nn.Module], runs: list[_StepRun], device: torch.device,
                 step_context: Callable[[], AbstractContextManager[Any]], recompute_every: int,
                 repeats: int, detailed: bool) -> list[_BlockTiming]:
    """Each block timed alone (:func:`_time_block`), on the arguments it had in the step; a block that cannot run
    again on them (one that appends to a cache object it was handed, as Hugging Face's GPT-2 does in training) gets
    what the step measured of it (its input gradient taken as half its backward). A recomputed block's backward
    (activation checkpointing: every ``recompute_every``-th block) also pays its forward."""
    timings = []
    for index, (block, (args, kwargs)) in enumerate(zip(blocks, runs[0].inputs, strict=True)):
        try:
            timing = _time_block(block, args, kwargs, device, step_context, repeats, detailed)
        except Exception:
            block.zero_grad(set_to_none=True)
            forward = statistics.median(r.block_forward[index] for r in runs)
            backward = _median_if_known([r.block_backward[index] if r.block_backward else None for r in runs])
            backward = 2 * forward if backward is None else backward
            timing = _BlockTiming(forward, backward, backward / 2)
        if recompute_every > 0 and index % recompute_every == 0:  # the recomputation runs in the input gradient's pass
            timing.backward += timing.forward
            timing.input_backward += timing.forward if detailed else 0.0
        timings.append(timing)
    return timings


def measure_block_costs(module: pl.LightningModule, container_name: str, microbatch: Any, *,
                        device: torch.device | None = None,
                        step_context: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
                        recompute_every: int = 0, repeats: int = _REPEATS, detailed: bool = False) -> BlockCosts:
    """Time one micro-batch through ``module``'s ``training_step``: each block of ``container_name``, the code before
    the first block and after the last, forward and backward. Runs ``module`` itself (pass a copy to keep its state):
    one warm-up run, then ``repeats`` runs of the step and of each block alone; medians.

    - **Blocks** are timed alone on the arguments they had in the step (forward pre-hooks capture them), forward, then
      backward with a gradient of ones for each output that needs one. With activation checkpointing
      (``recompute_every=n``: every n-th block), a recomputed block's backward also pays its forward.
    - **Before and after the blocks**, forward: clock readings in the step where the first block starts and the last
      one ends. Backward: gradient hooks read the clock when the gradient reaches the last block's output (the part
      after the blocks is done) and the first block's inputs (what remains runs before the blocks; zero when they need
      no gradient). Where a hook cannot tell (an output that needs no gradient), that part gets what ``loss.backward()``
      took beyond the other parts and the blocks' backward, split between before and after in proportion to their
      forward times. When ``training_step`` returns no loss tensor (``None``) or one without a gradient, the backward
      before and after the blocks is estimated as twice their forward (the usual ratio of a backward to a forward).
    """
    device = device if device is not None else module.device
    container = module.get_submodule(container_name)
    blocks = _blocks(container)
    runs = _timed_steps(module, blocks, microbatch, device, step_context, repeats)
    timings = _time_blocks(blocks, runs, device, step_context, recompute_every, repeats, detailed)
    forward, backward = [t.forward for t in timings], [t.backward for t in timings]
    module.zero_grad(set_to_none=True)
    before_f = statistics.median(r.before_forward for r in runs)
    after_f = statistics.median(r.after_forward for r in runs)
    before_b, after_b = _backward_outside_blocks(runs, forward, backward, before_f, after_f, recompute_every)
    if not detailed:
        return BlockCosts(forward, backward, (before_f, before_b), (after_f, after_b))
    saved, outputs, shared = list(runs[0].saved_bytes), runs[0].output_bytes, list(runs[0].shared_bytes)
    for index in range(0, len(saved), recompute_every) if recompute_every else []:  # a recomputed block keeps its
        saved[index], shared[index] = (outputs[index - 1] if index else outputs[0]), 0.0  # input only
    return BlockCosts(forward, backward, (before_f, before_b), (after_f, after_b),
                      [t.input_backward for t in timings], saved, outputs, runs[0].outside_saved_bytes, shared)


def _timed_steps(module: pl.LightningModule, blocks: list[nn.Module], microbatch: Any, device: torch.device,
                 step_context: Callable[[], AbstractContextManager[Any]], repeats: int) -> list[_StepRun]:
    """One warm-up step, then ``repeats`` timed ones; only the first timed run keeps the blocks' arguments."""
    _run_step(module, blocks, microbatch, device, step_context)  # warm-up: lazy initialisations, allocator, kernels
    module.zero_grad(set_to_none=True)
    runs = []
    for _ in range(repeats):
        runs.append(_run_step(module, blocks, microbatch, device, step_context))
        module.zero_grad(set_to_none=True)
        if len(runs) > 1:
            runs[-1].inputs = []  # the blocks are timed alone on the first run's arguments only
    return runs


def _median_if_known(values: Sequence[float | None]) -> float | None:
    """The median, or None when any run could not tell."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if len(known) == len(values) else None


def _backward_outside_blocks(runs: list[_StepRun], forward: list[float], backward: list[float], before_f: float,
                             after_f: float, recompute_every: int) -> tuple[float, float]:
    """The backward seconds before and after the blocks, as :func:`measure_block_costs` describes: what the hooks
    measured, else what ``loss.backward()`` took beyond the rest, else twice the forward."""
    total_b = _median_if_known([r.backward for r in runs])
    if total_b is None:
        return 2 * before_f, 2 * after_f
    before_b = _median_if_known([r.before_backward for r in runs])
    after_b = _median_if_known([r.after_backward for r in runs])
    if before_b is None or after_b is None:
        # blocks' backward measured alone, without recomputation (the probe's blocks are not checkpointed)
        blocks_b = sum(b - f if recompute_every > 0 and i % recompute_every == 0 else b
                       for i, (f, b) in enumerate(zip(forward, backward, strict=True)))
        rest = max(0.0, total_b - blocks_b - (before_b or 0.0) - (after_b or 0.0))
        if before_b is None and after_b is None:
            share = before_f / (before_f + after_f) if before_f + after_f > 0 else 0.5
            before_b, after_b = rest * share, rest * (1 - share)
        elif before_b is None:
            before_b = rest
        else:
            after_b = rest
    assert before_b is not None and after_b is not None
    return before_b, after_b


def why_not_time(trainer: pl.Trainer, module: pl.LightningModule) -> str | None:
    """Why ``balance='time'`` cannot measure in this run (the same answer on every rank), or None."""
    if trainer.state.fn != TrainerFn.FITTING:
        return f"trainer.{trainer.state.fn.value if trainer.state.fn else 'run'} does not train"
    if not is_overridden("training_step", module):
        return "the module has no training_step"
    if trainer.limit_train_batches == 0:
        return "limit_train_batches=0"
    if _compat.train_data_source(trainer) is None:
        return "fit has no train dataloader"
    if has_meta_tensors(module):
        return "the module is on the meta device: no rank holds every block to time it"
    return None


def _data_hook(probe: pl.LightningModule, trainer: pl.Trainer, name: str) -> Callable[..., Any]:
    """A batch hook as Lightning picks it (the datamodule's when it overrides it), the module's on the probe."""
    datamodule = getattr(trainer, "datamodule", None)  # set by the trainer's data connector
    if datamodule is not None and is_overridden(name, datamodule):
        return getattr(datamodule, name)  # type: ignore[no-any-return]
    return getattr(probe, name)  # type: ignore[no-any-return]


def _first_batch(trainer: pl.Trainer) -> tuple[Any, bool]:
    """The first batch fit's training data gives, as the fit loop receives it; ``(None, False)`` when there is none
    or when reading one would take it from training (a plain iterator instead of a re-iterable loader)."""
    source = _compat.train_data_source(trainer)
    assert source is not None
    loaders = source.dataloader()
    combined = loaders if isinstance(loaders, CombinedLoader) else CombinedLoader(loaders, "max_size_cycle")
    if any(isinstance(loader, Iterator) for loader in combined.flattened):
        return None, False
    with _compat.fresh_persistent_workers(combined.flattened):
        try:
            batch, _, _ = next(iter(combined))
        except StopIteration:
            return None, False
    return batch, True


def probe_first_batch(module: pl.LightningModule, trainer: pl.Trainer, device: torch.device, precision: Precision,
                      measure: Callable[[pl.LightningModule, Any], _T]) -> _T | None:
    """``measure(probe, batch)`` on a deep copy of ``module`` and fit's first training batch, moved as Lightning moves
    it, with every random generator restored afterwards (None: no batch to measure on)."""
    with preserved_random_state(device):
        # the job's DeviceMesh (process groups) is shared, not copied; LightningModule's pickling leaves the trainer
        # out: attach it again
        probe = copy.deepcopy(module, {id(module.device_mesh): module.device_mesh})
        probe.trainer = trainer
        for name in ("log", "log_dict"):  # the probe's calls must not reach the trainer's results
            setattr(probe, name, _silent)
        converted = precision.convert_module(probe)
        assert isinstance(converted, pl.LightningModule)
        probe = converted.to(device)
        batch, found = _first_batch(trainer)
        if not found:
            return None
        batch = precision.convert_input(batch)
        batch = _data_hook(probe, trainer, "on_before_batch_transfer")(batch, 0)
        batch = _data_hook(probe, trainer, "transfer_batch_to_device")(batch, device, 0)
        batch = _data_hook(probe, trainer, "on_after_batch_transfer")(batch, 0)
        result = measure(probe, batch)
        del probe, batch
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the copy's memory goes back before the stage's weights move to the device
    return result


def _probe_costs(module: pl.LightningModule, container_name: str, trainer: pl.Trainer, device: torch.device,
                 microbatches: int, precision: Precision, recompute_every: int) -> BlockCosts | None:
    """Global rank 0's measurement on a deep copy of ``module`` (None: no batch to measure on)."""
    def measure(probe: pl.LightningModule, batch: Any) -> BlockCosts:
        microbatch = split_batch(batch, min(microbatches, batch_size(batch)))[0][0]
        return measure_block_costs(probe, container_name, microbatch, device=device,
                                   step_context=precision.train_step_context, recompute_every=recompute_every)

    return probe_first_batch(module, trainer, device, precision, measure)


def _silent(*args: Any, **kwargs: Any) -> None:
    pass


def _ms(values: Sequence[float]) -> str:
    return ", ".join(f"{1e3 * v:.2f}" for v in values)


def resolve_balance(by: str, module: pl.LightningModule, blocks: str | None, num_stages: int, trainer: pl.Trainer, *,
                    device: torch.device, microbatches: int, precision: Precision, recompute_every: int,
                    global_rank: int, world_size: int,
                    collective: Callable[[str], AbstractContextManager[None]], object_group: Any = None,
                    stages_per_rank: int = 1) -> list[int]:
    """Blocks per stage for ``balance=by`` ("params" or "time"), the same on every rank of the job.

    ``"params"``: even parameter counts (every rank computes it alike). ``"time"``: global rank 0 measures (see
    :func:`measure_block_costs`) and broadcasts ``[before, block 0, ..., block n-1, after]`` in seconds to every rank;
    the first of the ``num_stages`` stages pays ``before``, the last ``after``. A failure on rank 0 is broadcast too
    (a NaN-marked tensor, then its message), so every rank raises a :class:`PipelineConfigError` instead of waiting.
    Outside ``fit`` (``validate``/``test``/``predict`` have no training step to time), without training data, or when
    the first training batch cannot be read without taking it from training, the split falls back to ``"params"``,
    with a log line. ``object_group`` carries the error's message (None: the default group); ``stages_per_rank``: how
    many of the ``num_stages`` each rank holds.
    """
    name, container = find_blocks(module, blocks)
    # too few blocks: an error on every rank, before measuring
    uniform_balance(len(_blocks(container)), num_stages, stages_per_rank)
    if by == "params":
        return parameter_balance(container, num_stages)
    reason = why_not_time(trainer, module)
    if reason is None:
        costs, measured, error = _costs_on_rank_zero(
            lambda: _probe_costs(module, name, trainer, device, microbatches, precision, recompute_every),
            len(_blocks(container)), global_rank)
        if world_size > 1:
            costs = _broadcast_costs(costs, device, collective)
        if costs.isnan().any():
            _raise_probe_error(name, error, world_size, collective, object_group)
        if not costs.isinf().any():
            values = costs.tolist()
            split = min_max_partition(values[1:-1], num_stages, first_extra=values[0], last_extra=values[-1])
            if global_rank == 0:
                assert measured is not None
                _report_time_split(measured, values, split)
            return split
        reason = "the train dataloader gave no batch that can be read without taking it from training"
    split = parameter_balance(container, num_stages)
    if global_rank == 0:
        log.info(f"balance='time' falls back to balance='params' ({reason}): split {split}")
    return split


def _costs_on_rank_zero(probe: Callable[[], BlockCosts | None], num_blocks: int,
                        global_rank: int) -> tuple[Tensor, BlockCosts | None, Exception | None]:
    """Global rank 0 runs ``probe``: the tensor every rank is to receive (``BlockCosts.to_tensor``; NaNs: the probe
    failed; -inf: no batch to measure on, and on other ranks), what was measured and the probe's error."""
    measured: BlockCosts | None = None
    error: Exception | None = None
    costs = torch.full((num_blocks + 2,), -torch.inf, dtype=torch.float64, device="cpu")
    if global_rank == 0:
        try:
            measured = probe()
        except Exception as caught:
            error = caught
        costs = measured.to_tensor() if measured is not None else costs.fill_(torch.nan if error else -torch.inf)
    return costs, measured, error


def _broadcast_costs(costs: Tensor, device: torch.device,
                     collective: Callable[[str], AbstractContextManager[None]]) -> Tensor:
    """Global rank 0's ``costs`` on every rank (through ``device``: NCCL sends CUDA tensors only), on the CPU."""
    with collective("the broadcast of the blocks' measured costs (balance='time')"):
        costs = costs.to(device)
        dist.broadcast(costs, src=0)
        return costs.cpu()


def _raise_probe_error(name: str, error: Exception | None, world_size: int,
                       collective: Callable[[str], AbstractContextManager[None]], object_group: Any) -> NoReturn:
    """Raise global rank 0's probe failure on every rank, with its message (broadcast: only rank 0 has ``error``)."""
    message = [f"{type(error).__name__}: {error}" if error is not None else None]
    if world_size > 1:
        with collective("the broadcast of the balance probe's error (balance='time')"):
            dist.broadcast_object_list(message, src=0, group=object_group)
    raise PipelineConfigError(
        f"balance='time': measuring the blocks of `{name}` on global rank 0 failed ({message[0]}). Pass "
        f"balance='params' or a list of blocks per stage instead."
    ) from error


def _report_time_split(measured: BlockCosts, values: list[float], split: list[int]) -> None:
    """Log what global rank 0 measured and the split it gives."""
    per_stage = stage_costs(values[1:-1], split, values[0], values[-1])
    log.info(f"balance='time': per block forward ms [{_ms(measured.forward)}], backward ms "
             f"[{_ms(measured.backward)}]; before the blocks {_ms(measured.before)} ms, after them "
             f"{_ms(measured.after)} ms (forward, backward); split {split}, stage costs "
             f"[{_ms(per_stage)}] ms per micro-batch")
    log.info(f"balance='time' split {split} (stage costs [{_ms(per_stage)}] ms per "
          f"micro-batch; per block [{_ms(values[1:-1])}] ms, before the blocks {1e3 * values[0]:.2f} ms, "
          f"after {1e3 * values[-1]:.2f} ms)")


def balance_for(run: RunContext, module: Any) -> list[int] | None:
    """Blocks per stage for the split: the user's list, ``None`` for an even split, or what ``balance="params"`` /
    ``"time"`` give (alike on every rank: ``"time"`` measures on global rank 0 and broadcasts). Nothing is measured
    for a module an earlier run split (that split is kept) or for a single stage."""
    options = run.options
    num_stages = run.layout.num_stages * (options.stages_per_rank or 1)
    if options.balance_by not in ("params", "time") or num_stages == 1 or is_assembled(module):
        return options.balance_list
    return resolve_balance(options.balance_by, module, options.blocks, num_stages, run.trainer, device=run.device,
                           microbatches=run.microbatches, precision=run.precision,
                           recompute_every=options.recompute_every, global_rank=run.rank,
                           world_size=run.layout.world_size, collective=run.collective,
                           object_group=run.object_group(), stages_per_rank=options.stages_per_rank or 1)
