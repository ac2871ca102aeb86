"""Run a benchmark's worker in several fresh processes on this machine, one CPU thread each, as torchrun would: the
environment Lightning's cluster detection reads, a free port, every process killed on the way out."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["answer_as_worker", "batch_clock", "mse_module", "run_workers"]


def mse_module(blocks: Any) -> Any:
    """A LightningModule training ``blocks`` on ``(x, y)`` batches with an MSE loss and SGD (lr 0.01): the model of the
    benchmarks whose blocks only sleep."""
    import lightning as L
    import torch
    from torch import nn

    class Blocks(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = blocks

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.blocks(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Blocks()


def batch_clock() -> Any:
    """A Lightning callback reading the clock at every ``on_train_batch_start`` into ``marks``: the benchmarks' window
    is one batch start to the next (the whole step, Lightning's loop included)."""
    import time

    import lightning as L

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                                 batch_idx: int) -> None:
            self.marks.append(time.perf_counter())

    return Clock()


def run_workers(script: str, processes: int, spec: dict[str, Any], timeout: float = 3600) -> Any:
    """Start ``python script --worker <json spec>`` in ``processes`` processes; ``spec["out"]`` names the file rank 0
    writes its JSON result to. Returns that result.

    Raises:
        SystemExit: a process failed (its exit codes in the message).
    """
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        out = Path(tmp) / "result.json"
        arguments = json.dumps({**spec, "out": str(out)})
        procs = []
        for rank in range(processes):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(processes),
                       RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0", OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen([sys.executable, script, "--worker", arguments], env=env))
        sock.close()
        try:
            codes = [proc.wait(timeout=timeout) for proc in procs]
        finally:
            for proc in procs:
                proc.kill()
        if any(codes):
            raise SystemExit(f"{Path(script).name} {spec} failed: exit codes {codes}")
        return json.loads(out.read_text())


def answer_as_worker(spec_json: str, worker: Any) -> None:
    """The worker side of :func:`run_workers`: run ``worker`` on the spec; global rank 0 writes its JSON result to
    ``spec["out"]``."""
    spec = json.loads(spec_json)
    result = worker(spec)
    if int(os.environ["RANK"]) == 0:
        Path(spec["out"]).write_text(json.dumps(result))
