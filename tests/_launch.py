"""Launch a multi-process test job the way torchrun would, with a hard timeout and every process reaped.

Every process of a job ends with the call that launched it, however that call ends (results, a timeout, an exception
such as pytest's own timeout): each rank runs in its own session, and the whole process group of each rank (the rank
and anything it started) is SIGKILLed on the way out; SIGTERM is not enough, Lightning handles it and carries on. When
the launching process is killed outright (no ``finally`` runs), a small reaper process it started does the same, and
each rank is SIGKILLed by the kernel (see ``_worker.py``). Launch timeouts stay well below pytest's per-test timeout
(pyproject) so that a stuck job fails here, with the ranks' logs, and never inside pytest's own error reporting.

Ports: as under torchrun, the launching process hosts the rendezvous store (``TORCHELASTIC_USE_AGENT_STORE``) and every
rank connects to it as a client. The store is bound to its port from before the ranks start until they are dead, so no
other process can take the port in between (choosing a free port and releasing it for rank 0 to bind is a race), and a
job never rendezvouses with another job's store. One store per run, so a run that re-initialises the process group
starts from empty keys.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed import TCPStore

WORKER = Path(__file__).with_name("_worker.py")
DEFAULT_TIMEOUT_S = 240.0
MAX_TIMEOUT_S = 400.0  # pytest's per-test timeout is 600 s (pyproject): a launch must time out well before it


@dataclass
class RankResult:
    returncode: int | None
    results: list[Any]  # per run: the scenario's return value, or None where it failed
    errors: dict[int, dict[str, str]]  # run index -> {"type", "message", "traceback"}
    output: str


class LaunchTimeoutError(TimeoutError):
    """The job did not finish in time. ``pids`` are its ranks' process ids (every process of the job is dead)."""

    def __init__(self, message: str, pids: list[int]) -> None:
        super().__init__(message)
        self.pids = pids


# Reads the ranks' process group ids, one a line, until end of input: "done" when the launcher has ended the job itself,
# anything else (the launcher died, so its end of the pipe closed) means SIGKILL every group.
_REAPER = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
lines = [line.strip() for line in sys.stdin]
if "done" not in lines:
    for group in lines:
        try:
            os.killpg(int(group), signal.SIGKILL)
        except OSError:
            pass
"""


def _kill_job(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILL each rank's process group (the rank and whatever it started), then reap the ranks."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # raised when nothing is left in the group
            os.killpg(proc.pid, signal.SIGKILL)  # the group outlives its leader while any member lives
    for proc in procs:
        proc.wait()


def launch(world_size: int, runs: list[dict[str, Any]], timeout: float = DEFAULT_TIMEOUT_S) -> list[RankResult]:
    """Run ``runs`` (each ``{"scenario": name, "kwargs": {...}}``) on ``world_size`` fresh processes.

    Raises:
        ValueError: ``timeout`` is not positive or exceeds ``MAX_TIMEOUT_S``.
        LaunchTimeoutError: the job ran longer than ``timeout`` seconds (its processes are killed first).
    """
    if not 0 < timeout <= MAX_TIMEOUT_S:
        raise ValueError(f"launch(timeout={timeout}) must be in (0, {MAX_TIMEOUT_S}] s: pytest's per-test timeout "
                         "(pyproject) must not fire first; keep a test's launches together under it too")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        stores = [TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timedelta(seconds=timeout),
                           wait_for_workers=False) for _ in runs]
        spec = out / "spec.json"
        spec.write_text(json.dumps({"out_dir": str(out), "runs": runs, "ports": [store.port for store in stores],
                                    "launcher_pid": os.getpid()}))
        reaper = subprocess.Popen([sys.executable, "-I", "-c", _REAPER], stdin=subprocess.PIPE, text=True)
        assert reaper.stdin is not None
        procs: list[subprocess.Popen[bytes]] = []
        logs: list[IO[str]] = []
        timed_out = False
        try:
            for rank in range(world_size):
                env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(stores[0].port),
                           TORCHELASTIC_USE_AGENT_STORE="True", WORLD_SIZE=str(world_size), NODE_RANK="0",
                           LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
                logs.append(open(out / f"rank{rank}.log", "w"))  # noqa: SIM115 - closed below
                procs.append(subprocess.Popen([sys.executable, str(WORKER), str(spec)], env=env, stdout=logs[-1],
                                              stderr=subprocess.STDOUT, start_new_session=True))
                reaper.stdin.write(f"{procs[-1].pid}\n")  # its process group id: it leads a new session
                reaper.stdin.flush()
            deadline = time.monotonic() + timeout
            for proc in procs:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = True
                    break
        finally:  # also when this process is interrupted (pytest's timeout, Ctrl-C) or Popen failed
            _kill_job(procs)
            with contextlib.suppress(OSError):  # the reaper may be gone already (killed with this process's group)
                reaper.stdin.write("done\n")
                reaper.stdin.close()
            reaper.wait()
            for log in logs:
                log.close()
            del stores
        ranks = []
        for rank, proc in enumerate(procs):
            results, errors = [], {}
            for index in range(len(runs)):
                result_file, error_file = out / f"{index}_rank{rank}.pt", out / f"{index}_rank{rank}.error"
                results.append(torch.load(result_file, weights_only=False) if result_file.exists() else None)
                if error_file.exists():
                    errors[index] = json.loads(error_file.read_text())
            ranks.append(RankResult(proc.returncode, results, errors, (out / f"rank{rank}.log").read_text()))
        if timed_out:
            logs_text = "\n".join(f"--- rank {r} ---\n{res.output[-3000:]}" for r, res in enumerate(ranks))
            raise LaunchTimeoutError(f"multi-process job did not finish within {timeout} s:\n{logs_text}",
                                     [proc.pid for proc in procs])
        return ranks


def run_script(args: list[str], timeout: float, **popen: Any) -> subprocess.CompletedProcess[str]:
    """Run a script that starts processes of its own (Lightning's launcher, the benchmark's workers) like
    ``subprocess.run(capture_output=True, text=True)``; however it ends, its whole process group is SIGKILLed."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **popen)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)
