"""What a rank does in the tests of the launcher's warm ranks (tests/multi_process/test_launch.py): leave state behind,
then look at what the next job finds. Run by _worker.py as ``launch_scenarios:name``."""

from __future__ import annotations

import logging
import os
import random
import signal
import tempfile
import threading
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from scenarios import GLOBAL_RANK, WORLD_SIZE


def probe() -> dict[str, Any]:
    """What this rank finds when its job starts: its pid, what a job may have left behind, and torch's next random
    numbers."""
    return {"pid": os.getpid(), "left_env": os.environ.get("LPP_LEFT_BEHIND"),
            "seed_env": os.environ.get("PL_GLOBAL_SEED"), "process_group": dist.is_initialized(),
            "torch": torch.rand(3), "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
            "cwd": os.getcwd(), "grad": torch.is_grad_enabled(), "dtype": str(torch.get_default_dtype()),
            "threads": torch.get_num_threads(), "lightning_pp_level": logging.getLogger("lightning_pp").level,
            "warning_filters": len(warnings.filters)}


def leave_traces() -> int:
    """Change everything `probe` looks at, and leave the default process group up; this rank's pid."""
    os.environ["LPP_LEFT_BEHIND"] = "1"
    dist.init_process_group("gloo", rank=GLOBAL_RANK, world_size=WORLD_SIZE)
    dist.barrier()
    torch.manual_seed(123)
    random.seed(123)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.chdir(tempfile.gettempdir())
    torch.set_grad_enabled(False)
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(2)
    logging.getLogger("lightning_pp").setLevel(logging.DEBUG)
    warnings.simplefilter("error")
    return os.getpid()


def leave_a_thread(seconds: float = 60) -> int:
    """Start a thread that outlives the job (the pool must not take another job on this rank); this rank's pid."""
    threading.Thread(target=time.sleep, args=(seconds,), name="left-behind", daemon=True).start()
    return os.getpid()


def fail_on_rank(rank: int) -> int:
    """Raise on global rank ``rank``; the others return their pid."""
    if rank == GLOBAL_RANK:
        raise RuntimeError(f"rank {rank} fails on purpose")
    return os.getpid()
