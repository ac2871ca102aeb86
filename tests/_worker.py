"""One rank of a multi-process test: runs the jobs named on the command line, saves results per rank."""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import traceback
from pathlib import Path


def _die_with_launcher(launcher_pid: int) -> None:
    """Have the kernel SIGKILL this rank when the launching process ends: its ``finally`` kills the job, but nothing
    of it runs when it is itself killed or ends by ``os._exit`` (pytest-timeout's thread method)."""
    if sys.platform == "linux":
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != launcher_pid:  # it ended before the line above
        os._exit(1)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    _die_with_launcher(spec["launcher_pid"])

    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    torch.set_num_threads(1)
    out = Path(spec["out_dir"])
    rank = int(os.environ["LOCAL_RANK"])
    import scenarios

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


if __name__ == "__main__":
    main()
