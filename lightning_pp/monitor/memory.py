"""Memory of a pipeline step: activation storage saved for backward (CPU), the CUDA allocator's peak, parameters."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from lightning_pp import _compat
from lightning_pp.parallel.sharding import local

__all__ = [
    "AllocatorPeakMeter",
    "SavedTensorMeter",
    "optimizer_state_size",
    "parameter_storages",
    "stage_parameter_bytes",
    "step_memory_meter",
]


class _Saved:
    """What autograd keeps, while a :class:`SavedTensorMeter` measures, in place of a tensor saved for backward.

    It holds the tensor detached: for a tensor saved as an output of the operation that saves it (``tanh``, ``relu``,
    ``softmax`` save their result), holding the tensor itself would make a reference cycle through autograd's C++ graph
    (tensor -> its grad_fn -> this object -> tensor) that Python's garbage collector cannot see, so a graph dropped
    without a backward (what the user's step computes before the blocks on a stage that does not use it) would never
    be freed. Autograd restores the grad_fn when it unpacks. Dropping this object (the graph frees its saved tensors)
    uncounts the storage.
    """

    __slots__ = ("keys", "meter", "tensor", "version")

    def __init__(self, meter: SavedTensorMeter, tensor: torch.Tensor, keys: tuple[int, int | None] | None) -> None:
        self.meter = meter
        self.tensor = tensor.detach()
        self.version = _compat.tensor_version(tensor)
        self.keys = keys  # (storage pointer, stage) of a counted storage; None: not counted

    def __del__(self) -> None:
        if self.keys is not None:
            self.meter._release(*self.keys)


class SavedTensorMeter:
    """Peak bytes of activation storage saved for backward while :meth:`measure` is active.

    ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor autograd saves; its storage is counted once however
    many saved tensors (views, repeated saves) refer to it, from the first save until the last saved reference to it is
    freed (by backward, or when its graph is dropped). Storages in ``exclude`` (the parameters', so also every view of
    a parameter) and storages without data (empty, or a meta tensor's) are not counted. :attr:`live` and :attr:`peak`
    are the whole process's; with ``stage_of`` (which stage's work runs now: called at every save) each save is also
    charged to that stage, :attr:`stage_peaks`, each stage counting a storage once however many stages save it.

    Autograd skips its check that a saved tensor was not modified in place when hooks are set; the unpack hook makes
    the same check. Only one pair of saved-tensor hooks acts at a time (the innermost): tensors saved inside
    ``torch.utils.checkpoint`` regions are the checkpoint's (it saves their inputs, which are counted).
    """

    def __init__(self, exclude: set[int] | None = None, stage_of: Callable[[], int] | None = None) -> None:
        self.exclude = exclude if exclude is not None else set()
        self.stage_of = stage_of
        self._storages: dict[int, list[int]] = {}  # storage pointer -> [bytes, saved references]
        self._stage_storages: dict[tuple[int, int], list[int]] = {}  # (stage, storage pointer) -> the same
        self.live = 0
        self.peak = 0
        self.stage_live: dict[int, int] = {}
        self.stage_peaks: dict[int, int] = {}

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        try:
            storage = tensor.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # no plain storage (sparse or nested tensors, some subclasses)
            return _Saved(self, tensor, None)
        if nbytes == 0 or ptr == 0 or ptr in self.exclude:  # no data (a meta tensor's pointer is 0) or a weight
            return _Saved(self, tensor, None)
        entry = self._storages.get(ptr)
        if entry is None:
            self._storages[ptr] = [nbytes, 1]
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        else:
            entry[1] += 1
        stage = self.stage_of() if self.stage_of is not None else None
        if stage is not None:
            entry = self._stage_storages.get((stage, ptr))
            if entry is None:
                self._stage_storages[(stage, ptr)] = [nbytes, 1]
                live = self.stage_live[stage] = self.stage_live.get(stage, 0) + nbytes
                self.stage_peaks[stage] = max(self.stage_peaks.get(stage, 0), live)
            else:
                entry[1] += 1
        return _Saved(self, tensor, (ptr, stage))

    @staticmethod
    def _unpack(saved: _Saved) -> torch.Tensor:
        if _compat.tensor_version(saved.tensor) != saved.version:
            raise RuntimeError(
                f"One of the variables needed for gradient computation has been modified by an inplace operation: a "
                f"tensor of shape {list(saved.tensor.shape)} was saved at version {saved.version} and is now at "
                f"version {_compat.tensor_version(saved.tensor)} (checked by lightning_pp's saved-tensor meter, as "
                f"autograd does)."
            )
        return saved.tensor

    def _release(self, ptr: int, stage: int | None) -> None:
        entry = self._storages.get(ptr)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self.live -= entry[0]
                del self._storages[ptr]
        if stage is not None:
            entry = self._stage_storages.get((stage, ptr))
            if entry is not None:
                entry[1] -= 1
                if entry[1] == 0:
                    self.stage_live[stage] -= entry[0]
                    del self._stage_storages[(stage, ptr)]

    @contextmanager
    def measure(self) -> Iterator[None]:
        """Count what autograd saves inside the block (the peak keeps growing over several uses)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield


class AllocatorPeakMeter:
    """Peak bytes the CUDA caching allocator handed out while :meth:`measure` was active, above what was allocated
    when it began (``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``), over every stream of the
    device: activations, but also gradients, transfer buffers and the optimizer's temporaries.

    There is no device synchronisation: the allocator's counts are host-side bookkeeping, a block counting as
    allocated from the host's request until the host frees its tensor (a block another stream still uses is kept from
    reuse until that stream is done, but no longer counted), so they follow the order in which the host allocates and
    frees, which is also what bounds the device memory the step needs. Waiting for the device would change the
    numbers in no way, only the time. Resetting the peak also resets it for anyone else reading it
    (``torch.cuda.max_memory_allocated``, Lightning's ``DeviceStatsMonitor``).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0

    @contextmanager
    def measure(self) -> Iterator[None]:
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield
        finally:
            self.peak = max(self.peak, torch.cuda.max_memory_allocated(self.device) - base)


def parameter_storages(module: nn.Module) -> set[int]:
    """The storage pointers of ``module``'s parameters (a view of a parameter has its parameter's)."""
    return {p.untyped_storage().data_ptr() for p in module.parameters()}


def step_memory_meter(module: nn.Module, device: torch.device,
                      stage_of: Callable[[], int] | None = None) -> SavedTensorMeter | AllocatorPeakMeter:
    """How a step's memory is measured on ``device``: the CUDA allocator's peak on a GPU, else the bytes of
    activations saved for backward (``module``'s parameters excluded, charged to ``stage_of()`` when given)."""
    if device.type == "cuda":
        return AllocatorPeakMeter(device)
    return SavedTensorMeter(parameter_storages(module), stage_of)


def _tensor_bytes(t: torch.Tensor) -> int:
    """The bytes of ``t`` this rank holds: a DTensor's (FSDP2's, tensor parallelism's) local shard, not its global
    size (``numel`` of a DTensor is the whole tensor's)."""
    shard = local(t)
    return shard.numel() * shard.element_size()


def stage_parameter_bytes(module: nn.Module, blocks: Mapping[int, Iterable[nn.Module]],
                          size: Callable[[nn.Parameter], int] = _tensor_bytes) -> dict[int, int]:
    """Bytes of the parameters ``module`` holds now (``size`` of each: by default the parameter's own, a sharded one's
    local shard), per stage: ``blocks[s]`` are stage ``s``'s blocks; everything else ``module`` holds (weights outside
    the blocks) counts on the lowest-numbered stage. A parameter held in several places (tied weights) counts once, on
    the first stage that holds it."""
    seen: set[int] = set()

    def new_bytes(parameters: Iterable[nn.Parameter]) -> int:
        total = 0
        for p in parameters:
            if id(p) not in seen:
                seen.add(id(p))
                total += size(p)
        return total

    per_stage = {stage: new_bytes(p for block in stage_blocks for p in block.parameters())
                 for stage, stage_blocks in sorted(blocks.items())}
    if per_stage:
        per_stage[min(per_stage)] += new_bytes(module.parameters())
    return per_stage


def optimizer_state_size(optimizers: Iterable[torch.optim.Optimizer]) -> Callable[[nn.Parameter], int]:
    """A parameter's bytes of optimizer state (Adam's two moments and its step count, SGD's momentum), over
    ``optimizers``, as this rank holds them: for :func:`stage_parameter_bytes`."""
    held: dict[int, int] = {}
    for optimizer in optimizers:
        for p, state in optimizer.state.items():
            tensors = [t for t in state.values() if isinstance(t, torch.Tensor)]
            held[id(p)] = held.get(id(p), 0) + sum(_tensor_bytes(t) for t in tensors)
    return lambda p: held.get(id(p), 0)
