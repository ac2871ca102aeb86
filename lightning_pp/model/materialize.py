"""A stage of a model built on the meta device: after the split, each rank gives storage only to the tensors it holds
(its blocks and the weights outside the blocks) and initializes them, so no rank ever allocates the whole model.

Initialization follows the module's own code, as Lightning's ``ModelParallelStrategy`` does: a module inside a Hugging
Face model gets that model's ``_init_weights`` (what ``from_config`` runs); any other module its ``reset_parameters()``
(torch's layers; ``_reset_parameters()`` for ``nn.MultiheadAttention``). Modules are visited children first, so a
parent's initializer has the last word, as in a constructor. Each module draws from its own random stream, seeded from
the job's seed (``torch.initial_seed()``) and the module's name in the whole model: the initial values do not depend on
the layout (how many stages, which rank), and the global random state is left as it was.

Tensors are filled with a sentinel (NaN; the largest integer) before initialization, and any left with it afterwards
are reported: a pattern that would train on uninitialized memory is refused, never run.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["has_meta_tensors", "materialize"]


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


def _filled_with_sentinel(like: Tensor, device: torch.device) -> Tensor:
    storage = torch.empty_like(like, device=device)
    if storage.is_floating_point() or storage.is_complex():
        storage.fill_(float("nan"))
    elif storage.dtype != torch.bool:
        storage.fill_(torch.iinfo(storage.dtype).max)
    return storage


def _still_sentinel(tensor: Tensor) -> bool:
    if tensor.is_floating_point() or tensor.is_complex():
        return bool(tensor.isnan().any())
    if tensor.dtype == torch.bool:
        return False  # judged by whether its module had an initializer
    return bool((tensor == torch.iinfo(tensor.dtype).max).any())


def _initializer(module: nn.Module, hf_model: Any) -> Any:
    """The function that initializes ``module``'s own tensors, or None."""
    if hf_model is not None:
        return lambda: hf_model._init_weights(module)
    for name in ("reset_parameters", "_reset_parameters"):
        method = getattr(module, name, None)
        if callable(method):
            return method
    return None


def _is_hf_model(module: nn.Module) -> bool:
    return callable(getattr(module, "_init_weights", None)) and hasattr(module, "config")


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


def materialize(module: nn.Module, device: torch.device, *, loading_checkpoint: bool, part: str = "") -> str | None:
    """Give every meta tensor of ``module`` storage on ``device`` and initialize it (see the module docstring); tied
    weights stay tied. Returns None, or what is left uninitialized (with the fix) as a message. With
    ``loading_checkpoint`` (``fit(ckpt_path=...)``), tensors the checkpoint holds may stay uninitialized: it sets
    them. ``part``: only this submodule of ``module`` (a block), named and initialized as within the whole."""
    storage: dict[int, Tensor] = {}  # one new tensor per meta tensor, so that a tied weight stays one weight
    made: list[tuple[str, nn.Module, Tensor]] = []  # (name in the model, its module, its new storage)
    owners: list[tuple[str, nn.Module, Any]] = []
    holds_meta: set[int] = set()
    root, enclosing = _part_of(module, part)
    for path, sub, hf_model in _modules_children_first(root, part, enclosing):
        owned = list(_owned_meta(sub))
        if owned or any(id(child) in holds_meta for child in sub.children()):
            holds_meta.add(id(sub))
            owners.append((path, sub, hf_model))
        for name, tensor, is_parameter in owned:
            new = storage.get(id(tensor))
            if new is None:
                new = _filled_with_sentinel(tensor, device)
                if is_parameter:
                    new = nn.Parameter(new, requires_grad=tensor.requires_grad)
                storage[id(tensor)] = new
                made.append((f"{path}.{name}" if path else name, sub, new))
            setattr(sub, name, new)
    initialized: set[int] = set()
    base_seed = torch.initial_seed()  # the job's seed (read before the loop reseeds)
    # the CPU generator always; CUDA's where the device is one (fork_rng restores what it forks)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        for path, sub, hf_model in owners:
            init = _initializer(sub, hf_model)
            if init is not None:
                torch.manual_seed((base_seed + zlib.crc32(path.encode())) % 2**63)
                init()
                initialized.add(id(sub))
    return _uninitialized_report(root, part, made, initialized, loading_checkpoint)


def _part_of(module: nn.Module, part: str) -> tuple[nn.Module, Any]:
    """The submodule named ``part`` and the innermost Hugging Face model around it (or itself), if any."""
    hf_model = module if _is_hf_model(module) else None
    for name in part.split(".") if part else []:
        module = module.get_submodule(name)
        hf_model = module if _is_hf_model(module) else hf_model
    return module, hf_model


def _uninitialized_report(root: nn.Module, part: str, made: list[tuple[str, nn.Module, Tensor]],
                          initialized: set[int], loading_checkpoint: bool) -> str | None:
    saved = {f"{part}.{k}" if part else k for k in root.state_dict(keep_vars=True)} if loading_checkpoint else set()
    left = [f"`{key}` ({type(sub).__name__})" for key, sub, tensor in made
            if key not in saved and (_still_sentinel(tensor) or (tensor.dtype == torch.bool
                                                                 and id(sub) not in initialized))]
    if not left:
        return None
    shown = ", ".join(left[:8]) + (f" and {len(left) - 8} more" if len(left) > 8 else "")
    return (f"{len(left)} tensor(s) built on the meta device are left uninitialized: {shown}. Their modules define no "
            f"reset_parameters() (or it does not set every tensor the module registers). Give those modules a "
            f"reset_parameters() that sets each of their parameters and buffers, build them outside "
            f"trainer.init_module(empty_init=True), or resume from a checkpoint with fit(ckpt_path=...) (buffers "
            f"that are not saved, persistent=False, must still be set by reset_parameters()).")
