"""A stage of a model built on the meta device: after the split, each rank gives storage only to the tensors it holds
(its blocks and the weights outside the blocks) and initializes them, so no rank ever allocates the whole model.

Initialization follows the module's own code, as Lightning's ``ModelParallelStrategy`` does: each module that holds
meta tensors itself runs its ``reset_parameters()`` (torch's layers; ``_reset_parameters()`` for
``nn.MultiheadAttention``), and inside a Hugging Face model every module above them also runs that model's
``_init_weights`` after it (what ``from_config`` runs; it dispatches on the module's type, so a parent's scaled
initialization of its children has the last word, as in a constructor). Modules are visited children first. Each
module draws from its own random stream, seeded from the job's seed (``torch.initial_seed()``) and the module's name in
the whole model: the initial values do not depend on the layout (how many stages, which rank), and the global random
state is left as it was.

Tensors are filled with a sentinel (NaN; the largest integer; the byte 0xFF for booleans) before initialization, and
:func:`left_uninitialized` finds those still holding it once a checkpoint had its chance to set them: a pattern that
would train on uninitialized memory is refused, never run.
"""

from __future__ import annotations

import mmap
import sys
import zlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pp import _compat

__all__ = ["has_meta_tensors", "left_uninitialized", "materialize"]


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _owned_meta(module: nn.Module) -> Iterator[tuple[str, Tensor, bool]]:
    """``(name, tensor, is_parameter)`` for the meta tensors ``module`` registers itself."""
    for name, param in module.named_parameters(recurse=False):
        if param.is_meta:
            yield name, param, True
    for name, buffer in module.named_buffers(recurse=False):
        if buffer.is_meta:
            yield name, buffer, False


def _filled_with_sentinel(like: Tensor, device: torch.device, off_heap: bool = False) -> Tensor:
    storage = _off_heap(like, device) if off_heap else torch.empty_like(like, device=device)
    if storage.is_floating_point() or storage.is_complex():
        storage.fill_(float("nan"))
    elif storage.dtype == torch.bool:
        storage.view(torch.uint8).fill_(0xFF)  # not a valid boolean: set ones hold 0 or 1
    else:
        storage.fill_(torch.iinfo(storage.dtype).max)
    return storage


def _off_heap(like: Tensor, device: torch.device) -> Tensor:
    """An uninitialized tensor shaped like ``like`` that, on the CPU, lives in its own anonymous memory map: a whole
    tensor made only to be cut (see :func:`materialize`) is returned to the system when freed, instead of leaving a
    hole in the heap between the shards kept before and after it (glibc serves allocations below its mmap threshold,
    32 MiB here, from the heap: see :mod:`lightning_pp.runtime.allocator`)."""
    nbytes = like.numel() * like.element_size()
    if device.type != "cpu" or nbytes == 0:
        return torch.empty_like(like, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=like.dtype).view(like.shape)


def _still_sentinel(tensor: Tensor) -> bool:
    if tensor.is_floating_point() or tensor.is_complex():
        return bool(tensor.isnan().any())
    if tensor.dtype == torch.bool:
        return bool((tensor.view(torch.uint8) > 1).any())
    return bool((tensor == torch.iinfo(tensor.dtype).max).any())


def _is_hf_model(module: nn.Module) -> bool:
    modeling = sys.modules.get("transformers.modeling_utils")  # only where Hugging Face is in use
    return modeling is not None and isinstance(module, modeling.PreTrainedModel)


def _modules_children_first(module: nn.Module, prefix: str = "", hf_model: Any = None,
                            seen: set[int] | None = None) -> Iterator[tuple[str, nn.Module, Any]]:
    """``(name, module, enclosing Hugging Face model or None)``, each module once, children before their parent."""
    seen = set() if seen is None else seen
    if id(module) in seen:
        return
    seen.add(id(module))
    hf_model = module if _is_hf_model(module) else hf_model
    for name, child in module.named_children():
        yield from _modules_children_first(child, f"{prefix}.{name}" if prefix else name, hf_model, seen)
    yield prefix, module, hf_model


def _initializers(module: nn.Module, owns_meta: bool, hf_model: Any) -> list[Any]:
    """What initializes ``module``: its own ``reset_parameters`` where it holds meta tensors itself, then the
    enclosing Hugging Face model's ``_init_weights``."""
    found = []
    if owns_meta:
        method = _compat.own_initializer(module)
        if method is not None:
            found.append(method)
    if hf_model is not None:
        found.append(lambda: _compat.hf_init_weights(hf_model, module))
    return found


def _part_of(module: nn.Module, part: str) -> tuple[nn.Module, Any]:
    """The submodule named ``part`` and the innermost Hugging Face model around it (or itself), if any."""
    hf_model = module if _is_hf_model(module) else None
    for name in part.split(".") if part else []:
        module = module.get_submodule(name)
        hf_model = module if _is_hf_model(module) else hf_model
    return module, hf_model


def materialize(module: nn.Module, device: torch.device, part: str = "") -> list[str]:
    """Give every meta tensor of ``module`` storage on ``device`` and initialize it (see the module docstring); tied
    weights stay tied. ``part``: only this submodule of ``module`` (a block), named and initialized as within the
    whole. Returns the names of the tensors it made, for :func:`left_uninitialized`.

    A meta DTensor (a tensor-parallel plan or FSDP2 applied to the meta build) is made and initialized whole, then
    each rank keeps its own shard of it (no communication): its values do not depend on the layout either. One
    module's whole tensors exist at a time (all of ``part``'s where an initializer above them may still change them,
    as a Hugging Face model's ``_init_weights`` does)."""
    from torch.distributed.tensor import DTensor

    storage: dict[int, Tensor] = {}  # one new tensor per meta tensor, so that a tied weight stays one weight
    shards: dict[int, Tensor] = {}  # the storage of this rank's shard of each meta DTensor
    made: list[str] = []
    # (path, module, its initializers, the meta tensors it registers itself), children before their parent
    to_initialize: list[tuple[str, nn.Module, list[Any], list[tuple[str, Tensor, bool]]]] = []
    holds_meta: set[int] = set()
    root, enclosing = _part_of(module, part)
    for path, sub, hf_model in _modules_children_first(root, part, enclosing):
        owned = list(_owned_meta(sub))
        if owned or any(id(child) in holds_meta for child in sub.children()):
            holds_meta.add(id(sub))
            to_initialize.append((path, sub, _initializers(sub, bool(owned), hf_model), owned))
    # a module's tensors are final once it and every initializer above it ran: where none runs above it (torch's own
    # layers), its tensor-parallel ones are cut at once, so only one module's are whole at a time
    initialized_above = {path for path, _, initializers, _ in to_initialize if initializers}
    cut_later: list[tuple[nn.Module, str, DTensor]] = []
    base_seed = torch.initial_seed()  # the job's seed (read before the loop reseeds)
    # the CPU generator always; CUDA's where the device is one (fork_rng restores what it forks)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        for path, sub, initializers, owned in to_initialize:
            distributed = []
            for name, tensor, is_parameter in owned:
                new = storage.get(id(tensor))
                if new is None:
                    whole: Tensor = tensor
                    if isinstance(tensor, DTensor):  # its shard's storage, then the whole tensor (off the heap)
                        shards[id(tensor)] = torch.empty_like(tensor.to_local(), device=device)
                        whole = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
                    new = _filled_with_sentinel(whole, device, off_heap=isinstance(tensor, DTensor))
                    if is_parameter:
                        new = nn.Parameter(new, requires_grad=tensor.requires_grad)
                    storage[id(tensor)] = new
                    made.append(f"{path}.{name}" if path else name)
                if isinstance(tensor, DTensor):
                    distributed.append((sub, name, tensor))
                setattr(sub, name, new)
            torch.manual_seed((base_seed + zlib.crc32(path.encode())) % 2**63)
            for init in initializers:
                init()
            if any(_is_above(other, path) for other in initialized_above):
                cut_later += distributed
            else:
                _cut(distributed, storage, shards)
    _cut(cut_later, storage, shards)
    return made


def _is_above(path: str, below: str) -> bool:
    """Whether the module at ``path`` encloses the one at ``below`` (paths within the whole model, "" the model)."""
    return (path == "" and below != "") or below.startswith(path + ".")


def _cut(distributed: list[tuple[nn.Module, str, Any]], storage: dict[int, Tensor], shards: dict[int, Tensor]) -> None:
    """Replace each whole tensor made for a meta DTensor by this rank's shard of it (no communication), copied into
    the shard's own storage (``shards``), so that the whole one is freed."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for sub, name, spec in distributed:
        whole = storage[id(spec)]
        if not isinstance(whole, DTensor):
            local = shards.pop(id(spec))
            local.copy_(distribute_tensor(whole.detach(), spec.device_mesh, spec.placements,
                                          src_data_rank=None).to_local())
            shard: Tensor = DTensor.from_local(local, spec.device_mesh, spec.placements, shape=spec.shape,
                                               stride=spec.stride(), run_check=False)
            if isinstance(whole, nn.Parameter):
                shard = nn.Parameter(shard, requires_grad=whole.requires_grad)
            storage[id(spec)] = shard  # a tied weight's other module gets the same shard
        setattr(sub, name, storage[id(spec)])


def left_uninitialized(module: nn.Module, made: list[str]) -> str | None:
    """None, or which of the tensors :func:`materialize` ``made`` (by name) still hold its sentinel now, with the fix,
    as a message. Sharded tensors are checked by this rank's shard."""
    from torch.distributed.tensor import DTensor

    state = module.state_dict(keep_vars=True)
    named = {**dict(module.named_parameters(remove_duplicate=False)), **dict(module.named_buffers()), **state}
    left = []
    for key in made:
        tensor = named.get(key)
        if tensor is not None and _still_sentinel(tensor.to_local() if isinstance(tensor, DTensor) else tensor):
            owner = module.get_submodule(key.rpartition(".")[0])
            left.append(f"`{key}` ({type(owner).__name__})")
    if not left:
        return None
    shown = ", ".join(left[:8]) + (f" and {len(left) - 8} more" if len(left) > 8 else "")
    return (f"{len(left)} tensor(s) built on the meta device are left uninitialized: {shown}. Their modules define no "
            f"reset_parameters() (or it does not set every tensor the module registers). Give those modules a "
            f"reset_parameters() that sets each of their parameters and buffers, build them outside "
            f"trainer.init_module(empty_init=True), or resume from a checkpoint that holds them with "
            f"fit(ckpt_path=...) (buffers that are not saved, persistent=False, must still be set by "
            f"reset_parameters()).")
