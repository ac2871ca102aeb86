"""One rank of a multi-process test: runs the jobs named on the command line, saves results per rank."""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(1)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out_dir"])
    rank = int(os.environ["LOCAL_RANK"])
    import scenarios

    for index, run in enumerate(spec["runs"]):
        try:
            result = getattr(scenarios, run["scenario"])(**run.get("kwargs", {}))
        except BaseException as error:  # report, then stop this rank like an uncaught error would
            (out / f"{index}_rank{rank}.error").write_text(
                json.dumps({"type": type(error).__name__, "message": str(error),
                            "traceback": traceback.format_exc()})
            )
            sys.exit(1)
        torch.save(result, out / f"{index}_rank{rank}.pt")


if __name__ == "__main__":
    main()
