"""The test launcher: every process of a job ends with the launch, however the launch ends, on fresh processes and on
the session's warm ranks alike; a warm rank starts each job as a fresh process would, and a pool whose job failed is
not used again."""

from __future__ import annotations

import _thread
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from _launch import LaunchTimeoutError, launch, worker_pools
from support import assert_all_ended, job_pids, process_alive

# each rank ignores SIGTERM, starts a child that ignores it too, writes both pids, and sleeps forever
STUBBORN_JOB = "ignore_sigterm_forever"
STARTED_WITHIN_S = 90.0  # a rank imports torch, Lightning and lightning_pp first: ~10 s on a busy 2-core machine


def _wait_for_pid_files(pid_dir: Path, world_size: int, stop: threading.Event | None = None) -> bool:
    """Whether every rank wrote its pids within ``STARTED_WITHIN_S`` (and before ``stop`` was set)."""
    deadline = time.monotonic() + STARTED_WITHIN_S
    while len(list(pid_dir.glob("*.pids"))) < world_size:
        if time.monotonic() > deadline or (stop is not None and stop.is_set()):
            return False
        time.sleep(0.1)
    return True


@pytest.mark.parametrize("fresh", [False, True], ids=["warm", "fresh"])
def test_timed_out_job_leaves_no_process(tmp_path: Path, fresh: bool) -> None:
    """A short timeout usually fires once the ranks sleep; on a machine too busy for them to get there, try longer.
    The launch ends within its timeout (a hang guard: killing the job takes a moment, 10 s is plenty)."""
    for timeout in (20, 60):
        for path in tmp_path.glob("*.pids"):
            path.unlink()
        start = time.monotonic()
        with pytest.raises(LaunchTimeoutError, match=f"did not finish within {timeout} s") as info:
            launch(2, [{"scenario": STUBBORN_JOB, "kwargs": {"pid_dir": str(tmp_path)}}], timeout=timeout, fresh=fresh)
        assert time.monotonic() - start < timeout + 10
        pids = sorted({*info.value.pids, *job_pids(tmp_path)})
        assert_all_ended(pids)
        if len(pids) == 2 + 2:  # the ranks had started their children and were ignoring SIGTERM
            return
    pytest.fail("the ranks never got as far as their sleep before the launch timed out")


@pytest.mark.parametrize("fresh", [False, True], ids=["warm", "fresh"])
def test_exception_in_the_launching_process_leaves_no_process(tmp_path: Path, fresh: bool) -> None:
    """Ctrl-C (or pytest's timeout, or any error) arrives in the test process while the job runs."""
    launch_ended = threading.Event()

    def interrupt_once_started() -> None:
        _wait_for_pid_files(tmp_path, 2, stop=launch_ended)
        if not launch_ended.is_set():  # never interrupt whatever runs after this test
            _thread.interrupt_main()  # KeyboardInterrupt in the test's thread, inside launch's wait

    interrupter = threading.Thread(target=interrupt_once_started, daemon=True)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)  # interrupt_main needs Python's own handler
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            launch(2, [{"scenario": STUBBORN_JOB, "kwargs": {"pid_dir": str(tmp_path)}}],
                   timeout=STARTED_WITHIN_S + 60, fresh=fresh)
    finally:
        launch_ended.set()
        interrupter.join()
        signal.signal(signal.SIGINT, handler)
    pids = job_pids(tmp_path)
    assert len(pids) == 4, "the ranks did not start their children in time"
    assert_all_ended(pids)


def test_killed_launching_process_leaves_no_process(tmp_path: Path) -> None:
    """The launching process is SIGKILLed (no ``finally`` runs there): its ranks and their children end anyway. It
    runs the job on warm ranks, as pytest does (fresh ones are started and ended alike: a reaper, the kernel's
    parent-death signal)."""
    script = (f"import sys; sys.path.insert(0, {str(Path(__file__).parents[1])!r}); "
              "from _launch import launch, worker_pools\n"
              "with worker_pools():\n"
              f"    launch(2, [{{'scenario': {STUBBORN_JOB!r}, 'kwargs': {{'pid_dir': {str(tmp_path)!r}}}}}], "
              f"timeout={STARTED_WITHIN_S + 60})")
    env = {k: v for k, v in os.environ.items() if k != "LPP_TEST_FRESH_PROCESSES"}
    launcher = subprocess.Popen([sys.executable, "-c", script], env=env)
    try:
        started = _wait_for_pid_files(tmp_path, 2)
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    assert started, "the ranks did not start their children in time"
    pids = job_pids(tmp_path)
    assert len(pids) == 4
    assert_all_ended(pids)


def test_a_timed_out_script_takes_its_processes_along(tmp_path: Path) -> None:
    """``run_script`` (the example's and the benchmark's tests): a script whose child ignores SIGTERM times out, and
    neither is left running."""
    from _launch import run_script

    pid_file = tmp_path / "pids"
    script = ("import os, signal, subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
              "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600)'])\n"
              f"open({str(pid_file)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
              "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "time.sleep(3600)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        run_script([sys.executable, "-c", script], timeout=5)
    pids = [int(p) for p in pid_file.read_text().split()]
    deadline = time.monotonic() + 10
    while any(process_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(process_alive(pid) for pid in pids), pids


def _pids(ranks: list) -> list[int]:
    assert not any(rank.errors for rank in ranks), [rank.errors for rank in ranks]
    return [rank.results[0]["pid"] if isinstance(rank.results[0], dict) else rank.results[0] for rank in ranks]


def test_warm_ranks_start_each_job_as_fresh_processes_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job on warm ranks finds what a fresh process finds, whatever the job before left (the environment, a process
    group, signal handlers, the working directory, torch's and logging's settings), the generators as the job before
    found them, and the launcher's environment of its own launch; a job whose rank fails, or that leaves a thread
    running, is the last its ranks run."""
    probe = [{"scenario": "launch_scenarios:probe"}]
    with worker_pools(max_processes=2) as pools:  # this test's own pool (None with LPP_TEST_FRESH_PROCESSES=1)
        first = launch(2, probe)
        left = launch(2, [{"scenario": "launch_scenarios:leave_traces"}])
        monkeypatch.setenv("PL_GLOBAL_SEED", "5")  # read by a rank's fit, not its imports: the same pool serves it
        after = launch(2, probe)
        fresh = launch(2, probe, fresh=True)
        if pools is not None:
            assert _pids(first) == _pids(left) == _pids(after), "the jobs ran on the same ranks"
        assert _pids(fresh) != _pids(after)
        for rank in range(2):
            got, want = after[rank].results[0], fresh[rank].results[0]
            assert got["seed_env"] == want["seed_env"] == "5"
            for key in ("left_env", "process_group", "sigterm", "cwd", "grad", "dtype", "threads",
                        "lightning_pp_level", "warning_filters"):
                assert got[key] == want[key] == first[rank].results[0][key], key
            # a fresh process's generator is seeded at random; a warm rank's is put back as it was after its imports
            torch.testing.assert_close(got["torch"], first[rank].results[0]["torch"], rtol=0, atol=0)
        if pools is None:
            return
        failed = launch(2, [{"scenario": "launch_scenarios:fail_on_rank", "kwargs": {"rank": 1}}])
        assert failed[1].returncode == 1 and failed[1].errors[0]["type"] == "RuntimeError"
        assert failed[0].returncode == 0 and failed[0].results[0] == _pids(after)[0]
        threaded = launch(2, [{"scenario": "launch_scenarios:leave_a_thread"}])
        assert not set(_pids(threaded)) & set(_pids(after)), "a failed job's ranks took another job"
        assert pools.closed_because == ["ranks [1] ended", "threads left running: ['left-behind']"], pools.summary()
