"""The private Lightning and torch APIs lightning_pp relies on, gathered in one place so an upgrade touches one file."""

from typing import Any

import torch
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher


def _found_inf_per_device(scaler: torch.amp.GradScaler, optimizer: Any) -> dict[torch.device, torch.Tensor]:
    """The scaler's per-device inf/NaN flags for ``optimizer``, filled by ``unscale_`` and read by ``step``."""
    return scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]  # type: ignore[no-any-return]


def _default_store() -> Any:
    """The store of the default process group (where a failing rank leaves word for the others)."""
    return torch.distributed.distributed_c10d._get_default_store()


def child_names(container: torch.nn.Module) -> list[str]:
    """Every entry of a block container in order, also a block listed twice (``named_children`` skips repeats)."""
    return list(container._modules)


__all__ = [
    "_SubprocessScriptLauncher",
    "_default_store",
    "_found_inf_per_device",
    "_get_default_process_group_backend_for_device",
    "_init_dist_connection",
    "_optimizers_to_device",
    "_sync_ddp_if_available",
    "child_names",
]
