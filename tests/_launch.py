"""Launch a multi-process test job the way torchrun would, with a hard timeout and every process reaped."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

WORKER = Path(__file__).with_name("_worker.py")


@dataclass
class RankResult:
    returncode: int | None
    results: list[Any]  # per run: the scenario's return value, or None where it failed
    errors: dict[int, dict[str, str]]  # run index -> {"type", "message", "traceback"}
    output: str


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(world_size: int, runs: list[dict[str, Any]], timeout: float = 240.0) -> list[RankResult]:
    """Run ``runs`` (each ``{"scenario": name, "kwargs": {...}}``) on ``world_size`` fresh processes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        spec = out / "spec.json"
        spec.write_text(json.dumps({"out_dir": str(out), "runs": runs}))
        port = _free_port()
        procs = []
        for rank in range(world_size):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
                       NODE_RANK="0", LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
            log = open(out / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
            procs.append((subprocess.Popen([sys.executable, str(WORKER), str(spec)], env=env, stdout=log,
                                           stderr=subprocess.STDOUT), log))
        timed_out = False
        deadline = time.monotonic() + timeout
        for proc, _ in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
        ranks = []
        for rank, (proc, _) in enumerate(procs):
            results, errors = [], {}
            for index in range(len(runs)):
                result_file, error_file = out / f"{index}_rank{rank}.pt", out / f"{index}_rank{rank}.error"
                results.append(torch.load(result_file, weights_only=False) if result_file.exists() else None)
                if error_file.exists():
                    errors[index] = json.loads(error_file.read_text())
            ranks.append(RankResult(proc.returncode, results, errors, (out / f"rank{rank}.log").read_text()))
        if timed_out:
            logs = "\n".join(f"--- rank {r} ---\n{res.output[-3000:]}" for r, res in enumerate(ranks))
            raise TimeoutError(f"multi-process job did not finish within {timeout} s:\n{logs}")
        return ranks
