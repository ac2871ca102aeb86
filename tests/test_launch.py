"""The test launcher: every process of a job ends with the launch, however the launch ends."""

from __future__ import annotations

import _thread
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _launch import LaunchTimeoutError, launch
from support import assert_all_ended, job_pids, process_alive

pytestmark = pytest.mark.multiprocess

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


def test_timed_out_job_leaves_no_process(tmp_path: Path) -> None:
    """A short timeout usually fires once the ranks sleep; on a machine too busy for them to get there, try longer."""
    for timeout in (20, 60):
        for path in tmp_path.glob("*.pids"):
            path.unlink()
        start = time.monotonic()
        with pytest.raises(LaunchTimeoutError, match=f"did not finish within {timeout} s") as info:
            launch(2, [{"scenario": STUBBORN_JOB, "kwargs": {"pid_dir": str(tmp_path)}}], timeout=timeout)
        assert time.monotonic() - start < timeout + 10
        pids = sorted({*info.value.pids, *job_pids(tmp_path)})
        assert_all_ended(pids)
        if len(pids) == 2 + 2:  # the ranks had started their children and were ignoring SIGTERM
            return
    pytest.fail("the ranks never got as far as their sleep before the launch timed out")


def test_exception_in_the_launching_process_leaves_no_process(tmp_path: Path) -> None:
    """Ctrl-C (or pytest's timeout, or any error) arrives in the test process while the job runs."""
    launch_ended = threading.Event()

    def interrupt_once_started() -> None:
        _wait_for_pid_files(tmp_path, 2, stop=launch_ended)
        if not launch_ended.is_set():  # never interrupt whatever runs after this test
            _thread.interrupt_main()  # KeyboardInterrupt in the test's thread, inside launch's wait

    interrupter = threading.Thread(target=interrupt_once_started, daemon=True)
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            launch(2, [{"scenario": STUBBORN_JOB, "kwargs": {"pid_dir": str(tmp_path)}}],
                   timeout=STARTED_WITHIN_S + 60)
    finally:
        launch_ended.set()
        interrupter.join()
    pids = job_pids(tmp_path)
    assert len(pids) == 4, "the ranks did not start their children in time"
    assert_all_ended(pids)


def test_killed_launching_process_leaves_no_process(tmp_path: Path) -> None:
    """The launching process is SIGKILLed (no ``finally`` runs there): its ranks and their children end anyway."""
    script = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from _launch import launch; "
              f"launch(2, [{{'scenario': {STUBBORN_JOB!r}, 'kwargs': {{'pid_dir': {str(tmp_path)!r}}}}}], "
              f"timeout={STARTED_WITHIN_S + 60})")
    launcher = subprocess.Popen([sys.executable, "-c", script])
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
