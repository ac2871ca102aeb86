"""Launch a multi-process test job the way torchrun would, with a hard timeout and every process reaped.

Every process of a job ends with the call that launched it, however that call ends (results, a timeout, an exception
such as pytest's own timeout): each rank runs in its own session, and the whole process group of each rank (the rank
and anything it started) is SIGKILLed on the way out; SIGTERM is not enough, Lightning handles it and carries on. When
the launching process is killed outright (no ``finally`` runs), a small reaper process it started does the same, and
each rank is SIGKILLed by the kernel (``_DIE_WITH_LAUNCHER``, through which every rank starts; ``_worker.py`` too).
Launch timeouts stay well below pytest's per-test timeout (pyproject) so that a stuck job fails here, with the ranks'
logs, and never inside pytest's own error reporting.

Warm ranks: starting a rank (Python, torch, Lightning) takes 10-20 s on a busy 2-core machine, most of a small job.
Within a pytest session (`worker_pools`, opened by conftest.py), `launch` runs each job on the ranks of a pool kept
per (world size, environment), as torch's ``MultiProcContinuousTest`` does: they stay alive between jobs and each job
starts in what a fresh process would hold (``_worker.py``: the launcher's environment, the random generators, signal
handlers, logging and warning filters as after the imports; the default process group ended after each job). A pool
takes the next job only when every rank ran the last one through and left nothing running; a job that fails, dies,
times out or is interrupted closes its pool (SIGKILL, as above). After a job that failed (the failure tiers run
several in a row) a new pool starts at once, its ranks importing while the test checks the results; otherwise the
next job starts one. Jobs that need a fresh process (`FRESH_SCENARIOS`, ``launch(fresh=True)``) and
``launch_torchrun`` start their own processes.
``LPP_TEST_FRESH_PROCESSES=1`` starts fresh processes for every job.

Ports: as under torchrun, the launching process hosts the rendezvous store (``TORCHELASTIC_USE_AGENT_STORE``) and every
rank connects to it as a client. The store is bound to its port from before the ranks start until they are dead (or,
with a pool, until the job is over), so no other process can take the port in between (choosing a free port and
releasing it for rank 0 to bind is a race), and a job never rendezvouses with another job's store. One store per run,
so a run that re-initialises the process group starts from empty keys.

Scripts: `launch_processes` runs any command (the benchmarks' workers: ``benchmarks/_workers.py``) in fresh processes
the same way, as torchrun starts its ranks (``RANK`` too), with the same store, reaping and timeout; it is the one
fresh-process launch, which `launch` uses for its own fresh jobs.

``launch_torchrun`` starts the ranks through torchrun itself, one torchrun agent per simulated node, so that Lightning
sees a real TorchElastic job (``RANK``, ``GROUP_RANK``, ``LOCAL_WORLD_SIZE``, the agent's store); see its docstring for
what differs (the first run's port, the node-level return codes).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
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
class ProcessesResult:
    """How the processes of `launch_processes` ended, by rank."""

    returncodes: list[int | None]  # negative: killed by that signal (-9: SIGKILLed on the way out)
    outputs: list[str]  # each process's stdout and stderr
    timed_out: bool  # the timeout came first: the processes still running then were killed
    pids: list[int]


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


# Makes the kernel SIGKILL this process when the launching thread ends (``PR_SET_PDEATHSIG``, which survives exec), then
# becomes the command (exec keeps the pid): a rank in a session of its own ends with the launcher even where the
# launcher and its reaper are killed together (a SIGKILL of the launcher's process group reaches neither the ranks nor,
# then, a reaper that could still act).
_DIE_WITH_LAUNCHER = """
import os, signal, sys
if sys.platform == "linux":
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):  # the launcher ended before the line above
    os._exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def _start_process(reaper: subprocess.Popen[str], command: list[str], env: dict[str, str], log: IO[str],
                   **popen: Any) -> subprocess.Popen[bytes]:
    """Start ``command`` as a rank: in a session of its own (its process group: it and whatever it starts), output to
    ``log``, handed to ``reaper``, killed by the kernel when the launching thread ends."""
    proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _DIE_WITH_LAUNCHER, str(os.getpid()), *command],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **popen)
    assert reaper.stdin is not None
    reaper.stdin.write(f"{proc.pid}\n")  # its process group id: it leads a new session
    reaper.stdin.flush()
    return proc


def _run_processes(command: list[str], envs: list[dict[str, str]], out: Path, timeout: float,
                   after_failure: float | None = None) -> tuple[list[subprocess.Popen[bytes]], bool]:
    """Run ``command`` once per environment of ``envs`` (process ``r``'s output to ``out / f"rank{r}.log"``) until all
    have ended or ``timeout`` s have passed, and whether the timeout came first. With ``after_failure``, the others
    get that many seconds once one has failed, then are killed. However this ends (an exception included), each
    process's group is SIGKILLed and each process reaped before it returns."""
    reaper = _start_reaper()
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[IO[str]] = []
    timed_out = False
    try:
        for rank, env in enumerate(envs):
            logs.append(open(out / f"rank{rank}.log", "w"))  # noqa: SIM115 - closed below
            procs.append(_start_process(reaper, command, env, logs[-1]))
        deadline = time.monotonic() + timeout
        failed_at: float | None = None
        while None in [proc.poll() for proc in procs]:  # every process polled: its returncode set once it ended
            now = time.monotonic()
            if now > deadline:
                timed_out = True
                break
            if after_failure is not None:
                if failed_at is None and any(proc.returncode for proc in procs):
                    failed_at = now
                if failed_at is not None and now > failed_at + after_failure:
                    break
            time.sleep(0.05)
    finally:  # also when this process is interrupted (pytest's timeout, Ctrl-C) or Popen failed
        _kill_job(procs)
        _end_reaper(reaper)
        for log in logs:
            log.close()
    return procs, timed_out


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


# the node id of the single-process test running now (set by conftest.py for every test outside multi_process/)
single_process_test: str | None = None


def _check_tier(caller: str) -> None:
    """A single-process test starts no process: the tiers are told apart by folder (conftest.py)."""
    if single_process_test is not None:
        raise RuntimeError(f"{caller}() starts processes, which a single-process test must not: move "
                           f"{single_process_test} to tests/multi_process/ (its tests are marked multiprocess)")


def _check_timeout(caller: str, timeout: float) -> None:
    if not 0 < timeout <= MAX_TIMEOUT_S:
        raise ValueError(f"{caller}(timeout={timeout}) must be in (0, {MAX_TIMEOUT_S}] s: pytest's per-test timeout "
                         "(pyproject) must not fire first; keep a test's launches together under it too")


def _rank_env(world_size: int, rank: int, port: int | None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a rank of `launch` finds in its environment on top of the launching process's (or ``base``)."""
    env = dict(os.environ if base is None else base, MASTER_ADDR="127.0.0.1", TORCHELASTIC_USE_AGENT_STORE="True",
               WORLD_SIZE=str(world_size), NODE_RANK="0", LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    if port is not None:
        env["MASTER_PORT"] = str(port)
    return env


def _stores(world_size: int, count: int, timeout: float) -> list[TCPStore]:
    """``count`` rendezvous stores (one per run), bound here until the job ends (see the module docstring)."""
    return [TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timedelta(seconds=timeout),
                     wait_for_workers=False) for _ in range(count)]


def _start_reaper() -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-I", "-c", _REAPER], stdin=subprocess.PIPE, text=True)


def _end_reaper(reaper: subprocess.Popen[str]) -> None:
    """Tell the reaper the launcher has ended its processes itself, and reap it."""
    # OSError: the reaper may be gone already (killed with this process's group); ValueError: told already
    with contextlib.suppress(OSError, ValueError):
        assert reaper.stdin is not None
        reaper.stdin.write("done\n")
        reaper.stdin.close()
    reaper.wait()


def _timeout_error(what: str, timeout: float, ranks: list[RankResult], pids: list[int]) -> LaunchTimeoutError:
    logs_text = "\n".join(f"--- rank {r} ---\n{res.output[-3000:]}" for r, res in enumerate(ranks))
    return LaunchTimeoutError(f"{what} did not finish within {timeout} s:\n{logs_text}", pids)


def launch(world_size: int, runs: list[dict[str, Any]], timeout: float = DEFAULT_TIMEOUT_S, *,
           fresh: bool = False) -> list[RankResult]:
    """Run ``runs`` (each ``{"scenario": name, "kwargs": {...}}``) on ``world_size`` ranks: the warm ranks of the
    session's worker pool for ``world_size`` and this environment, or ``world_size`` fresh processes with ``fresh``,
    for a scenario in `FRESH_SCENARIOS`, for more ranks than the pools keep (``LPP_TEST_POOL_PROCESSES``, 6), outside
    pytest (no `worker_pools`) or with ``LPP_TEST_FRESH_PROCESSES=1``.
    The results are the same either way (see the module docstring).

    Raises:
        ValueError: ``timeout`` is not positive or exceeds ``MAX_TIMEOUT_S``.
        LaunchTimeoutError: the job ran longer than ``timeout`` seconds (its processes are killed first).
    """
    _check_tier("launch")
    _check_timeout("launch", timeout)
    pools = _pools
    if (pools is None or fresh or any(run["scenario"] in FRESH_SCENARIOS for run in runs)
            or world_size > pools.max_processes  # would close every other pool, and not be kept itself
            or threading.current_thread() is not threading.main_thread()):  # see _Pool (the kernel's parent death)
        return _launch_fresh(world_size, runs, timeout)
    return pools.launch(world_size, runs, timeout)


def _launch_fresh(world_size: int, runs: list[dict[str, Any]], timeout: float) -> list[RankResult]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        stores = _stores(world_size, len(runs), timeout)
        spec = out / "spec.json"
        spec.write_text(json.dumps({"out_dir": str(out), "runs": runs, "ports": [store.port for store in stores],
                                    "launcher_pid": os.getpid()}))
        try:
            procs, timed_out = _run_processes([sys.executable, str(WORKER), str(spec)],
                                              [_rank_env(world_size, rank, stores[0].port)
                                               for rank in range(world_size)], out, timeout)
        finally:
            del stores
        ranks = [_read_rank(out, rank, len(runs), proc.returncode, (out / f"rank{rank}.log").read_text())
                 for rank, proc in enumerate(procs)]
        if timed_out:
            raise _timeout_error("multi-process job", timeout, ranks, [proc.pid for proc in procs])
        return ranks


def launch_processes(command: list[str], world_size: int, timeout: float, *, env: Mapping[str, str] | None = None,
                     after_failure: float | None = 60.0) -> ProcessesResult:
    """Run ``command`` (``[sys.executable, script, ...]``) in ``world_size`` fresh processes as torchrun starts its
    ranks: ``MASTER_ADDR`` and ``MASTER_PORT`` of a rendezvous store this process hosts (see the module docstring),
    ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``NODE_RANK``, ``OMP_NUM_THREADS=1``, on top of this process's
    environment updated with ``env``. Lightning sees an external launcher (``LOCAL_RANK`` is set); a plain
    ``torch.distributed.init_process_group`` meets at the store by ``env://``. Returns when every process has ended,
    ``timeout`` s have passed, or ``after_failure`` s after one failed (the others are killed then: they would wait
    for it until their own timeouts; None: wait for them). Every process (and whatever it started) is dead when this
    returns or raises, however it ends: as in `launch`. Each process's output is kept (``outputs``)."""
    _check_tier("launch_processes")
    if timeout <= 0:
        raise ValueError(f"launch_processes(timeout={timeout}) must be positive")
    base = dict(os.environ, **(env or {}))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        stores = _stores(world_size, 1, timeout)
        try:
            envs = [dict(_rank_env(world_size, rank, stores[0].port, base), RANK=str(rank))
                    for rank in range(world_size)]
            procs, timed_out = _run_processes(command, envs, out, timeout, after_failure)
        finally:
            del stores
        outputs = [(out / f"rank{rank}.log").read_text(errors="replace") for rank in range(len(procs))]
    return ProcessesResult([proc.returncode for proc in procs], outputs, timed_out, [proc.pid for proc in procs])


# ------------------------------------------------------------------------------------------------ warm worker pools

# scenarios whose job always runs on fresh processes, and why
FRESH_SCENARIOS = {
    "meta_memory": "measures how far a fresh process's resident memory rises",
    "sigterm_during_fit": "a real SIGTERM to a rank, handled by the handlers a fresh process installs",
    "teardown_scenarios:sigterm_every_rank": "a real SIGTERM to every rank",
}
# what the launching process's environment may hold that a rank's imports do not read: set per job, not per pool
_PER_JOB_ENV = ("PYTEST_CURRENT_TEST", "PL_GLOBAL_SEED", "PL_SEED_WORKERS", "TORCHINDUCTOR_CACHE_DIR",
                "PYTORCH_NVML_BASED_CUDA_CHECK", "MASTER_ADDR", "MASTER_PORT")
POOL_PROCESSES = int(os.environ.get("LPP_TEST_POOL_PROCESSES", "6"))  # warm ranks kept, all pools together


class _Pool:
    """``world_size`` ranks (``_worker.py --serve``) that run one job after another. Each leads a session of its own,
    is handed to a reaper and dies with the launching thread (``PR_SET_PDEATHSIG``: pools are used from the main
    thread only), as in `launch`; `close` SIGKILLs every rank's process group."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.jobs = 0
        self.ahead = False  # started before any job asked for it (see WorkerPools.launch)
        self._dir = Path(tempfile.mkdtemp(prefix="lpp-pool-"))
        self._reaper = _start_reaper()
        self.procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[IO[str]] = []
        try:
            for rank in range(world_size):
                self._logs.append(open(self._dir / f"rank{rank}.log", "w"))  # noqa: SIM115 - closed in close
                self.procs.append(_start_process(
                    self._reaper, [sys.executable, str(WORKER), "--serve", str(os.getpid())],
                    _rank_env(world_size, rank, None), self._logs[-1], stdin=subprocess.PIPE))
        except BaseException:
            self.close()
            raise

    def alive(self) -> bool:
        return all(proc.poll() is None for proc in self.procs)

    def run(self, runs: list[dict[str, Any]], timeout: float, deadline: float, out: Path
            ) -> tuple[list[RankResult], str | None]:
        """The job's ranks, and why the pool cannot take another job (None: it can). The caller closes it then, and
        on any exception (a timeout included: `LaunchTimeoutError`)."""
        stores = _stores(self.world_size, len(runs), timeout)
        try:
            spec = out / "spec.json"
            spec.write_text(json.dumps({"out_dir": str(out), "runs": runs, "ports": [s.port for s in stores],
                                        "envs": [_rank_env(self.world_size, rank, stores[0].port)
                                                 for rank in range(self.world_size)]}))
            for proc in self.procs:
                assert proc.stdin is not None
                with contextlib.suppress(OSError):  # a rank that died idle: seen as ended below
                    proc.stdin.write(f"{spec}\n".encode())
                    proc.stdin.flush()
            self.jobs += 1
            ended: dict[int, str] = {}  # rank -> "clean", why it is unfit, or "exited"
            while len(ended) < self.world_size:
                for rank, proc in enumerate(self.procs):
                    if rank in ended:
                        continue
                    done = out / f"rank{rank}.done"
                    if done.exists():
                        ended[rank] = done.read_text()
                    elif proc.poll() is not None:
                        ended[rank] = "exited"
                if len(ended) < self.world_size:
                    if time.monotonic() > deadline:
                        _kill_job(self.procs)  # dead before their logs are read: close() removes a start-up log
                        ranks = self._ranks(out, runs, ended)  # (a rank that never took the job has only that)
                        self.close()
                        raise _timeout_error("multi-process job", timeout, ranks, [p.pid for p in self.procs])
                    time.sleep(0.02)
        finally:
            del stores
        ranks = self._ranks(out, runs, ended)
        unfit = sorted({why for why in ended.values() if why != "clean"})
        exited = sorted(rank for rank, why in ended.items() if why == "exited")
        return ranks, (f"ranks {exited} ended" if exited else "; ".join(unfit) or None)

    def _ranks(self, out: Path, runs: list[dict[str, Any]], ended: dict[int, str]) -> list[RankResult]:
        ranks = []
        for rank, proc in enumerate(self.procs):
            log = out / f"rank{rank}.log"
            # a rank that died before it took the job: what it said while starting
            output = (log if log.exists() else self._dir / f"rank{rank}.log").read_text(errors="replace")
            returncode = 0 if ended.get(rank, "exited") != "exited" else proc.poll()
            ranks.append(_read_rank(out, rank, len(runs), returncode, output))
        return ranks

    def close(self) -> None:
        _kill_job(self.procs)
        _end_reaper(self._reaper)
        for proc in self.procs:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
        for log in self._logs:
            log.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class WorkerPools:
    """The warm ranks of a pytest session (see `worker_pools`): a `_Pool` per (world size, environment), at most
    ``max_processes`` ranks in all (the least recently used pools close first). A pool takes the next job only when
    every rank of its last job ran it through and left nothing running (`_worker.py`'s ``tidy``); otherwise, and
    when a job times out or the launching process is interrupted, it is closed (SIGKILLed): a new one starts at once
    after a job that ended on its own, else with the next job of its kind."""

    def __init__(self, max_processes: int = POOL_PROCESSES) -> None:
        self.max_processes = max_processes
        self._pools: dict[tuple[int, tuple[tuple[str, str], ...]], _Pool] = {}
        self.started = self.warm_jobs = self.jobs = 0
        self.early_jobs = self.unused_ahead = 0  # jobs on pools started ahead (see launch); such pools never used
        self.closed_because: list[str] = []

    def launch(self, world_size: int, runs: list[dict[str, Any]], timeout: float) -> list[RankResult]:
        deadline = time.monotonic() + timeout  # a pool's start counts, as a fresh job's does
        key = (world_size, tuple(sorted((k, v) for k, v in os.environ.items() if k not in _PER_JOB_ENV)))
        pool = self._pools.pop(key, None)
        if pool is not None and not pool.alive():
            self._close(pool, "a rank died between jobs")
            pool = None
        if pool is None:
            pool = self._start(world_size)
        self.jobs += 1
        self.warm_jobs += pool.jobs > 0
        self.early_jobs += pool.jobs == 0 and pool.ahead
        unfit: str | None = "the launching process was interrupted"
        try:
            with tempfile.TemporaryDirectory() as tmp:
                ranks, unfit = pool.run(runs, timeout, deadline, Path(tmp))
        except LaunchTimeoutError:
            unfit = "a job timed out"
            raise
        finally:
            if unfit is None and world_size <= self.max_processes:
                self._pools[key] = pool  # the most recently used: last
            else:
                self._close(pool, unfit)
        if unfit is not None and world_size <= self.max_processes:
            # the job ended on its own (failed, or left something running): its kind of job usually comes next
            # (the failure tiers), so its replacement imports while this process checks the results
            self._pools[key] = self._start(world_size, ahead=True)
        return ranks

    def _start(self, world_size: int, ahead: bool = False) -> _Pool:
        """A new pool, after closing the least recently used ones while the ranks would be too many."""
        while self._pools and sum(p.world_size for p in self._pools.values()) + world_size > self.max_processes:
            self._close(self._pools.pop(next(iter(self._pools))), None)
        self.started += 1
        pool = _Pool(world_size)
        pool.ahead = ahead
        return pool

    def _close(self, pool: _Pool, why: str | None) -> None:
        pool.close()
        self.unused_ahead += pool.jobs == 0 and pool.ahead
        if why is not None:
            self.closed_because.append(why)

    def close(self) -> None:
        while self._pools:
            self._close(self._pools.popitem()[1], None)

    def summary(self) -> str:
        reasons = "; ".join(f"{n} x {why}" for why, n in Counter(self.closed_because).most_common())
        return (f"worker pools: {self.jobs} jobs, {self.warm_jobs} on warm ranks and {self.early_jobs} on ranks "
                f"started ahead; {self.started} pools started, {self.unused_ahead} of them ahead in vain"
                + (f"; {len(self.closed_because)} closed after a job: {reasons}" if reasons else ""))


_pools: WorkerPools | None = None


@contextlib.contextmanager
def worker_pools(max_processes: int = POOL_PROCESSES) -> Iterator[WorkerPools | None]:
    """Within the block, `launch` runs jobs on warm ranks of pools of its own (conftest.py opens them for the pytest
    session; a test may open its own within), every rank SIGKILLed on the way out. With
    ``LPP_TEST_FRESH_PROCESSES=1`` (or ``max_processes=0``) it changes nothing and yields None."""
    global _pools
    if os.environ.get("LPP_TEST_FRESH_PROCESSES", "") not in ("", "0") or max_processes <= 0:
        yield None
        return
    outer, _pools = _pools, WorkerPools(max_processes)
    pools = _pools
    try:
        yield pools
    finally:
        _pools = outer
        pools.close()


def run_script(args: list[str], timeout: float, **popen: Any) -> subprocess.CompletedProcess[str]:
    """Run a script that starts processes of its own (Lightning's launcher, the benchmark's workers) like
    ``subprocess.run(capture_output=True, text=True)``; however it ends, its whole process group is SIGKILLed."""
    _check_tier("run_script")
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
    reaper = _start_reaper()
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
        _end_reaper(reaper)
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
    _check_tier("launch_torchrun")
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
