"""The private Lightning APIs lightning_pp relies on, gathered in one place so an upgrade touches one file."""

from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

__all__ = [
    "_SubprocessScriptLauncher",
    "_get_default_process_group_backend_for_device",
    "_init_dist_connection",
    "_optimizers_to_device",
    "_sync_ddp_if_available",
]
