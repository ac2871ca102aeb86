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

``launch_torchrun`` starts the ranks through torchrun itself, one torchrun agent per simulated node, so that Lightning
sees a real TorchElastic job (``RANK``, ``GROUP_RANK``, ``LOCAL_WORLD_SIZE``, the agent's store); see its docstring for
what differs (the first run's port, the node-level return codes).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
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
    node_output: str = ""  # launch_torchrun: the output of the rank's torchrun agent (its node)


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


def _read_rank(out: Path, file_rank: int, num_runs: int, returncode: int | None, output: str,
               node_output: str = "") -> RankResult:
    """What `_worker.py` left in ``out`` for the rank it named ``file_rank``."""
    results, errors = [], {}
    for index in range(num_runs):
        result_file, error_file = out / f"{index}_rank{file_rank}.pt", out / f"{index}_rank{file_rank}.error"
        results.append(torch.load(result_file, weights_only=False) if result_file.exists() else None)
        if error_file.exists():
            errors[index] = json.loads(error_file.read_text())
    return RankResult(returncode, results, errors, output, node_output)


def _check_timeout(caller: str, timeout: float) -> None:
    if not 0 < timeout <= MAX_TIMEOUT_S:
        raise ValueError(f"{caller}(timeout={timeout}) must be in (0, {MAX_TIMEOUT_S}] s: pytest's per-test timeout "
                         "(pyproject) must not fire first; keep a test's launches together under it too")


def launch(world_size: int, runs: list[dict[str, Any]], timeout: float = DEFAULT_TIMEOUT_S) -> list[RankResult]:
    """Run ``runs`` (each ``{"scenario": name, "kwargs": {...}}``) on ``world_size`` fresh processes.

    Raises:
        ValueError: ``timeout`` is not positive or exceeds ``MAX_TIMEOUT_S``.
        LaunchTimeoutError: the job ran longer than ``timeout`` seconds (its processes are killed first).
    """
    _check_timeout("launch", timeout)
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
        ranks = [_read_rank(out, rank, len(runs), proc.returncode, (out / f"rank{rank}.log").read_text())
                 for rank, proc in enumerate(procs)]
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


# Runs torchrun in this very process (exec keeps the pid) once the spec naming that pid as the ranks' parent exists.
_TORCHRUN_SHIM = """
import os, sys, time
spec = sys.argv[1]
while not os.path.exists(spec):
    time.sleep(0.01)
os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", *sys.argv[2:]])
"""
# what launch() or pytest's environment may hold that would confuse torchrun's agent or Lightning's detection
_JOB_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "SLURM_JOB_NAME")
_PORT_TAKEN = ("address already in use", "eaddrinuse")


def _free_port() -> int:
    """A port nothing listens on now. Another process may take it before torchrun binds it (see launch_torchrun)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _children(parents: set[int]) -> set[int]:
    """The processes whose parent is in ``parents`` (Linux: read from /proc; elsewhere none are found)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) in parents:  # the field after the state
                found.add(int(stat.parent.name))
    return found


def _torchrun_node_log(node_dir: Path, local_rank: int) -> str:
    """What torchrun's ``--redirects 3`` wrote for ``local_rank`` of this node (stdout, then stderr)."""
    parts = [path.read_text(errors="replace") for name in ("stdout.log", "stderr.log")
             for path in sorted(node_dir.glob(f"logs/*/attempt_*/{local_rank}/{name}"))]
    return "".join(parts)


@dataclass
class _Attempt:
    ranks: list[RankResult]  # by global rank
    timed_out: bool
    port_taken: bool  # node 0's agent could not bind the master port
    pids: list[int]  # the agents' and the ranks'


def _torchrun_attempt(nnodes: int, nproc_per_node: int, runs: list[dict[str, Any]], timeout: float, out: Path
                      ) -> _Attempt:
    """One try of `launch_torchrun`, on a port found free just before."""
    world_size = nnodes * nproc_per_node
    port = _free_port()
    stores = [TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timedelta(seconds=timeout),
                       wait_for_workers=False) for _ in runs[1:]]
    env = {k: v for k, v in os.environ.items() if k not in _JOB_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    reaper = subprocess.Popen([sys.executable, "-I", "-c", _REAPER], stdin=subprocess.PIPE, text=True)
    assert reaper.stdin is not None
    agents: list[subprocess.Popen[bytes]] = []
    logs: list[IO[str]] = []
    worker_groups: set[int] = set()
    timed_out = False
    try:
        for node in range(nnodes):
            node_dir = out / f"node{node}"
            node_dir.mkdir()
            spec = node_dir / "spec.json"
            args = ["--nnodes", str(nnodes), "--node-rank", str(node), "--master-addr", "127.0.0.1",
                    "--master-port", str(port), "--nproc-per-node", str(nproc_per_node), "--max-restarts", "0",
                    "--monitor-interval", "0.5", "--log-dir", str(node_dir / "logs"), "--redirects", "3",
                    str(WORKER), str(spec)]
            logs.append(open(node_dir / "agent.log", "w"))  # noqa: SIM115 - closed below
            agents.append(subprocess.Popen([sys.executable, "-c", _TORCHRUN_SHIM, str(spec), *args], env=env,
                                           stdout=logs[-1], stderr=subprocess.STDOUT, start_new_session=True))
            reaper.stdin.write(f"{agents[-1].pid}\n")
            reaper.stdin.flush()
            # _worker.py names its files by LOCAL_RANK (0..nproc-1 on every node): one folder per node keeps them
            # apart. The first run meets at torchrun's own store, later ones at a store of theirs (see launch).
            temporary = spec.with_suffix(".tmp")
            temporary.write_text(json.dumps({"out_dir": str(node_dir), "runs": runs,
                                             "ports": [port, *(store.port for store in stores)],
                                             "launcher_pid": agents[-1].pid}))
            temporary.rename(spec)  # the shim waits for it whole: the ranks' parent is named before they start
        deadline = time.monotonic() + timeout
        while any(agent.poll() is None for agent in agents):
            for group in _children({agent.pid for agent in agents}) - worker_groups:
                worker_groups.add(group)
                reaper.stdin.write(f"{group}\n")
                reaper.stdin.flush()
            if agents[0].poll() is not None and _port_taken(out):
                break  # node 0 could not host the store; the other agents would wait for it until the timeout
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.2)
    finally:  # as in launch: whatever happened, every process of the job is SIGKILLed here
        for group in worker_groups:  # each rank leads a session of its own (torchrun starts it so)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
        _kill_job(agents)
        with contextlib.suppress(OSError):
            reaper.stdin.write("done\n")
            reaper.stdin.close()
        reaper.wait()
        for log in logs:
            log.close()
        del stores
    agent_logs = [(out / f"node{node}" / "agent.log").read_text(errors="replace") for node in range(nnodes)]
    ranks = []
    for rank in range(world_size):
        node, local_rank = divmod(rank, nproc_per_node)
        node_dir = out / f"node{node}"
        ranks.append(_read_rank(node_dir, local_rank, len(runs), agents[node].returncode,
                                _torchrun_node_log(node_dir, local_rank), agent_logs[node]))
    return _Attempt(ranks, timed_out, _port_taken(out), [agent.pid for agent in agents] + sorted(worker_groups))


def _port_taken(out: Path) -> bool:
    """Whether node 0's agent failed to bind the master port (before any rank ran)."""
    log = (out / "node0" / "agent.log").read_text(errors="replace").lower()
    return any(word in log for word in _PORT_TAKEN) and not any((out / "node0").glob("*_rank*.*"))


def launch_torchrun(nnodes: int, nproc_per_node: int, runs: list[dict[str, Any]],
                    timeout: float = DEFAULT_TIMEOUT_S) -> list[RankResult]:
    """Run ``runs`` as one torchrun job of ``nnodes`` simulated nodes on this machine; results by global rank.

    Each node is ``torchrun --nnodes N --node-rank n --master-addr 127.0.0.1 --master-port PORT --nproc-per-node P
    _worker.py spec`` (static rendezvous, no restarts), so the ranks get torchrun's environment and Lightning picks its
    TorchElastic cluster environment. The guarantees of `launch` hold: each agent runs in its own session; every rank
    (torchrun starts each in a session of its own) is found as it starts and handed to the reaper; all of them are
    SIGKILLed however the call ends; each rank is also SIGKILLed by the kernel when its agent dies (``_worker.py``
    checks its parent is the agent named in the spec, which is written before the agent execs torchrun).

    What differs from `launch`: the first run meets at torchrun's own store on ``PORT``, which node 0's agent binds
    (static rendezvous takes no store of ours), so the port is chosen free and released first; if another process
    takes it in between, node 0 fails to bind and the job is retried on a new port (twice at most, within
    ``timeout``). Later runs meet at stores this process hosts, as in `launch`. ``returncode`` is the rank's node's
    agent's (torchrun reports a rank's own only in its log, ``node_output``); ``output`` is the rank's own output.

    Raises:
        ValueError: ``timeout`` is not positive or exceeds ``MAX_TIMEOUT_S``.
        LaunchTimeoutError: the job ran longer than ``timeout`` seconds (its processes are killed first).
    """
    _check_timeout("launch_torchrun", timeout)
    deadline = time.monotonic() + timeout
    for attempt in range(3):
        with tempfile.TemporaryDirectory() as tmp:
            tried = _torchrun_attempt(nnodes, nproc_per_node, runs, max(1.0, deadline - time.monotonic()), Path(tmp))
        if tried.timed_out:
            logs_text = "\n".join(f"--- rank {r} ---\n{res.output[-2000:]}\n--- its node's agent ---\n"
                                  f"{res.node_output[-1000:]}" for r, res in enumerate(tried.ranks))
            raise LaunchTimeoutError(f"torchrun job did not finish within {timeout} s:\n{logs_text}", tried.pids)
        if not tried.port_taken or attempt == 2:
            break
    return tried.ranks
