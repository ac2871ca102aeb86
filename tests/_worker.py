"""One rank of a multi-process test: runs a job's runs and saves results per rank; with ``--serve``, one job after
another (a warm rank of `_launch`'s worker pool), each in the state a fresh process would start it in."""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import logging
import os
import random
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# a rank holding more than this after a job is retired (lightning_pp keeps freed memory: see its allocator module)
RETIRE_ABOVE_BYTES = 1536 * 2**20
THREADS_END_WITHIN_S = 2.0  # threads a job's fit told to stop at teardown may still be on their way out
# threads a library starts once and keeps for the process by design, watching nothing of a job's
LIBRARY_THREADS = {"tqdm_monitor"}


def _die_with_launcher(launcher_pid: int) -> None:
    """Have the kernel SIGKILL this rank when the launching process ends: its ``finally`` kills the job, but nothing
    of it runs when it is itself killed or ends by ``os._exit`` (pytest-timeout's thread method)."""
    if sys.platform == "linux":
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != launcher_pid:  # it ended before the line above
        os._exit(1)


def _run_job(spec: dict[str, Any], rank: int) -> None:
    """Run the spec's runs in order, each saving its result; on an error, report it and end this process with 1."""
    import scenarios
    import torch

    out = Path(spec["out_dir"])
    for index, run in enumerate(spec["runs"]):
        # each run's process group meets at its own store, hosted by the launcher (see _launch.py)
        os.environ["MASTER_PORT"] = str(spec["ports"][index])
        try:
            # "name": scenarios.name; "module:name": name in the tests' module `module`
            module, _, name = run["scenario"].rpartition(":")
            result = getattr(importlib.import_module(module) if module else scenarios, name)(**run.get("kwargs", {}))
        except BaseException as error:  # report, then stop this rank like an uncaught error would
            (out / f"{index}_rank{rank}.error").write_text(
                json.dumps({"type": type(error).__name__, "message": str(error),
                            "traceback": traceback.format_exc()})
            )
            sys.exit(1)
        torch.save(result, out / f"{index}_rank{rank}.pt")


def _setup() -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    torch.set_num_threads(1)
    import scenarios  # noqa: F401 - imports torch, Lightning and lightning_pp: the bulk of a rank's start


def main() -> None:
    if sys.argv[1] == "--serve":
        _die_with_launcher(int(sys.argv[2]))
        _serve(int(os.environ["LOCAL_RANK"]))
        return
    spec = json.loads(Path(sys.argv[1]).read_text())
    _die_with_launcher(spec["launcher_pid"])
    _setup()
    _run_job(spec, int(os.environ["LOCAL_RANK"]))


# ------------------------------------------------------------------------------------------------ a warm rank


class _FreshState:
    """What a job may change in this process that a fresh process would start with: captured once the imports are
    done, put back before each job (`restore`); `tidy` ends what a job left running, or says why this process is
    unfit for another job."""

    def __init__(self, env_before_imports: dict[str, str]) -> None:
        import numpy as np
        import torch

        # what the imports set themselves (a fresh process sets it again on top of the launcher's environment)
        self.import_env = {k: v for k, v in os.environ.items() if env_before_imports.get(k) != v}
        self.rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
        self.torch = (torch.get_default_dtype(), torch.is_grad_enabled(), torch.are_deterministic_algorithms_enabled(),
                      torch.get_float32_matmul_precision())
        self.signals = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1,
                                                          signal.SIGUSR2, signal.SIGHUP)}
        self.warning_filters = list(warnings.filters)
        self.loggers = {name: (logger.level, list(logger.handlers), logger.propagate, logger.disabled)
                        for name, logger in [("", logging.getLogger()), *logging.root.manager.loggerDict.items()]
                        if isinstance(logger, logging.Logger)}
        self.cwd = os.getcwd()
        self.threads = set(threading.enumerate())
        self.path = list(sys.path)

    def restore(self, env: dict[str, str]) -> None:
        import numpy as np
        import torch

        os.environ.clear()
        os.environ.update(env)
        for key, value in self.import_env.items():
            os.environ.setdefault(key, value)
        os.chdir(self.cwd)
        sys.path[:] = self.path
        torch.set_rng_state(self.rng[0])
        random.setstate(self.rng[1])
        np.random.set_state(self.rng[2])
        dtype, grad, deterministic, matmul = self.torch
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)
        torch.use_deterministic_algorithms(deterministic)
        torch.set_float32_matmul_precision(matmul)
        torch.set_num_threads(1)
        for signum, handler in self.signals.items():
            if handler is not None:
                signal.signal(signum, handler)
        warnings.filters[:] = self.warning_filters  # type: ignore[index]
        with contextlib.suppress(AttributeError):  # forget what was shown "once" under the old filters
            warnings._filters_mutated()  # type: ignore[attr-defined]
        for name, (level, handlers, propagate, disabled) in self.loggers.items():
            logger = logging.getLogger(name or None)
            logger.setLevel(level)
            logger.handlers[:] = handlers
            logger.propagate, logger.disabled = propagate, disabled
        # lightning_pp's once-per-process state, found by name wherever the package keeps it: fits counted from 0
        # (`_fits_started`, every rank alike), each log line said once (`_logged`)
        for name, module in list(sys.modules.items()):
            if name.startswith("lightning_pp"):
                if isinstance(getattr(module, "_fits_started", None), int):
                    module._fits_started = 0  # type: ignore[attr-defined]
                if isinstance(getattr(module, "_logged", None), set):
                    module._logged.clear()

    def tidy(self) -> str | None:
        """End the job's process group; None when this process is as fit for the next job as a fresh one."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()
        self.threads |= {t for t in threading.enumerate() if t.name in LIBRARY_THREADS}
        left = [t for t in threading.enumerate() if t not in self.threads]
        for thread in left:
            thread.join(timeout=THREADS_END_WITHIN_S / max(1, len(left)))
        names = [t.name for t in threading.enumerate() if t not in self.threads]
        if names:
            return f"threads left running: {names}"
        children = _children(os.getpid())
        if children:
            return f"child processes left running: {sorted(children)}"
        resident = _resident_bytes()
        if resident > RETIRE_ABOVE_BYTES:
            return f"holds {resident / 2**20:.0f} MiB"
        return None


def _children(parent: int) -> set[int]:
    """This process's live children (Linux: read from /proc; elsewhere none are found)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == parent and fields[0] not in ("Z", "X"):
                found.add(int(stat.parent.name))
    return found


def _resident_bytes() -> int:
    with contextlib.suppress(OSError, StopIteration, ValueError):
        line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmRSS:"))
        return int(line.split()[1]) * 1024
    return 0


@contextlib.contextmanager
def _output_to(path: Path) -> Iterator[None]:
    """This process's stdout and stderr (Python's and the C libraries') go to ``path`` until the block ends."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def _serve(rank: int) -> None:
    """Read job spec paths from stdin, one a line, until it closes; run each job as `main` runs one, in the state a
    fresh process starts in, then write ``rank{rank}.done`` to the job's folder: ``clean``, or why this process is
    unfit for another job (it ends then). An error in a run ends the process as in `main` (no done file)."""
    env_before_imports = dict(os.environ)
    _setup()
    fresh = _FreshState(env_before_imports)
    for line in sys.stdin:
        spec = json.loads(Path(line.strip()).read_text())
        out = Path(spec["out_dir"])
        with _output_to(out / f"rank{rank}.log"):
            fresh.restore(spec["envs"][rank])
            _run_job(spec, rank)
            unfit = fresh.tidy()
        done = out / f"rank{rank}.done"
        done.with_suffix(".tmp").write_text(unfit or "clean")
        done.with_suffix(".tmp").rename(done)  # whole or absent for the launcher
        if unfit:
            return


if __name__ == "__main__":
    main()
