"""scripts/gpu_check.sh, the one-GPU check, in its --cpu mode (CI's fast tier): every check passes, a spent budget
skips what is left, and a check that hangs ends the run instead of hanging it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def run(*args: str, timeout: float = 280) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK")}
    return subprocess.run(["bash", str(SCRIPT), *args], env={**env, "LPP_PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=timeout)


def outcomes(stdout: str) -> dict[str, str]:
    return dict(re.findall(r"^CHECK (\S+) (PASS|FAIL|SKIP)", stdout, flags=re.M))


@pytest.mark.timeout(300)
def test_every_check_passes_on_the_cpu() -> None:
    result = run("--cpu")
    checks = outcomes(result.stdout)
    assert result.returncode == 0 and set(checks.values()) == {"PASS"}, result.stdout + result.stderr[-3000:]
    assert result.stdout.startswith("VERSIONS python=")
    assert {"equal/mlp/interleaved_1f1bx4", "equal/mlp/zbvx2", "equal/mlp/dualpipevx2", "bf16_mixed", "monitor",
            "generate/gpt", "generate/hf_gpt2", "checkpoint/full", "checkpoint/sharded", "compiled_blocks",
            "pipedream_2bw/weight_stash", "timing/mlp", "timing/gpt"} <= set(checks)
    assert result.stdout.rstrip().endswith(f"gpu_check: {len(checks)} passed, 0 failed, 0 skipped")
    assert "torch.distributed.pipelining" in next(line for line in result.stdout.splitlines() if "timing/mlp" in line)


@pytest.mark.timeout(120)
def test_a_spent_budget_skips_what_is_left() -> None:
    result = run("--cpu", "--budget", "0", "-k", "equal/mlp")
    assert result.returncode == 0, result.stdout + result.stderr
    assert set(outcomes(result.stdout).values()) == {"SKIP"}
    assert re.search(r"gpu_check: 0 passed, 0 failed, \d+ skipped$", result.stdout.rstrip())


@pytest.mark.timeout(120)
def test_a_hanging_check_fails_and_ends_the_run() -> None:
    code = (f"import sys, time; sys.path.insert(0, {str(ROOT / 'scripts')!r}); import gpu_check as g; "
            "g.checks = lambda: [('sleeps', lambda: time.sleep(600)), ('after', lambda: 'never')]; "
            "sys.exit(g.main(['--cpu', '--budget', '0.5', '--grace', '1']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert result.returncode == 1, result.stdout + result.stderr
    assert outcomes(result.stdout) == {"sleeps": "FAIL", "after": "SKIP"}
    assert result.stdout.rstrip().endswith("gpu_check: 0 passed, 1 failed, 1 skipped")
