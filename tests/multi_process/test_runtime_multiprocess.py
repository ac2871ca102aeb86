"""Multi-process tier of the runtime: CPU memory it keeps is reused without page faults (in a subprocess).
The single-process tests are in ``single_process/test_runtime.py``."""

from __future__ import annotations

import subprocess
import sys

import pytest

FAULTS_PER_REALLOCATION = """
import resource, sys, torch
from lightning_pp.runtime.allocator import keep_freed_cpu_memory
if sys.argv[1] == "keep":
    assert keep_freed_cpu_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):  # what a micro-batch does: allocate weight-gradient-sized buffers, then free them
    [torch.ones(1024, 1024) for _ in range(4)]
before = faults()
for _ in range(20):
    [torch.ones(1024, 1024) for _ in range(4)]
print((faults() - before) / 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_kept_cpu_memory_is_reused_without_page_faults() -> None:
    def faults(mode: str) -> float:
        run = subprocess.run([sys.executable, "-c", FAULTS_PER_REALLOCATION, mode], capture_output=True, text=True,
                             check=True, timeout=60)
        return float(run.stdout.split()[-1])

    # by default glibc returns the 16 MiB to the kernel when no small allocation sits above it in the heap (usually:
    # ~4,000 faults per round), which makes the default count vary from run to run; kept memory never faults back in
    assert faults("keep") < 50
