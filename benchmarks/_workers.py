"""Run a benchmark's worker in several fresh processes on this machine, one CPU thread each, as torchrun would: the
environment Lightning's cluster detection reads, a rendezvous store hosted by the launching process, every process
killed on the way out. The launch itself is the test suite's (``tests/_launch.py``, `launch_processes`): one copy."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from _launch import ProcessesResult

TESTS = Path(__file__).resolve().parents[1] / "tests"

__all__ = ["answer_as_worker", "batch_clock", "launch_processes", "mse_module", "run_workers"]


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


def launch_processes(command: list[str], processes: int, timeout: float, env: Mapping[str, str] | None = None
                     ) -> ProcessesResult:
    """``command`` in ``processes`` fresh processes as torchrun would start them: ``tests/_launch.py``'s
    `launch_processes` (the store hosted here, no port to race for; every process reaped however this ends)."""
    if str(TESTS) not in sys.path:
        sys.path.append(str(TESTS))
    import _launch

    return _launch.launch_processes(command, processes, timeout, env=env)


def run_workers(script: str, processes: int, spec: dict[str, Any], timeout: float = 3600, *,
                env: Mapping[str, str] | None = None) -> Any:
    """Start ``python script --worker <json spec>`` in ``processes`` processes (with ``env`` on top of this process's
    environment); ``spec["out"]`` names the file rank 0 writes its JSON result to (`answer_as_worker`). Returns that
    result.

    Raises:
        SystemExit: a process failed or the job ran past ``timeout`` s (the exit codes and each process's last output
            in the message).
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        job = launch_processes([sys.executable, script, "--worker", json.dumps({**spec, "out": str(out)})], processes,
                               timeout, env)
        if job.timed_out or any(job.returncodes):
            what = f"did not finish within {timeout:g} s" if job.timed_out else "failed"
            outputs = "".join(f"\n--- rank {rank} (exit {code}) ---\n{output[-3000:]}"
                              for rank, (code, output) in enumerate(zip(job.returncodes, job.outputs, strict=True)))
            raise SystemExit(f"{Path(script).name} {spec} {what}: exit codes {job.returncodes}{outputs}")
        return json.loads(out.read_text())


def answer_as_worker(spec_json: str, worker: Any) -> None:
    """The worker side of :func:`run_workers`: run ``worker`` on the spec; global rank 0 writes its JSON result to
    ``spec["out"]``."""
    spec = json.loads(spec_json)
    result = worker(spec)
    if int(os.environ["RANK"]) == 0:
        Path(spec["out"]).write_text(json.dumps(result))
