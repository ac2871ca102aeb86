"""Every script in examples/ runs end to end with 2 processes on CPU and writes TensorBoard logs.
The single-process tests are in ``single_process/test_example.py``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from _launch import run_script

EXAMPLES = Path(__file__).parents[2] / "examples"


@pytest.mark.parametrize("options", [[], pytest.param(
    ["--schedule", "pipedream_2bw", "--optimizer", "muon"], id="pipedream_muon",
    marks=pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon: torch 2.9 or later"))],
    ids=["default", "pipedream_muon"])
def test_gpt_example_trains_and_writes_tensorboard_logs(options: list[str], tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")}
    result = run_script(
        [sys.executable, str(EXAMPLES / "train_gpt.py"), "--max-steps", "20", "--log-dir", str(tmp_path), *options],
        timeout=240, env=env, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    final = [line for line in result.stdout.splitlines() if line.startswith("final train_loss")]
    assert final and float(final[0].split()[-1]) < 10, result.stdout[-3000:]  # from 43 at the start
    assert "step   20 sample: 'the " in result.stdout  # generated in a hook, a pass through the pipeline per character
    assert list(tmp_path.glob("gpt_pipeline/version_*/events.out.tfevents.*"))


