"""benchmarks/compare.py runs end to end in a tiny configuration and writes a complete table (the numbers are not
checked: speed is measured by the script, never asserted in tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import run_compare


@pytest.mark.timeout(300)
def test_compare_measures_every_runner_and_writes_markdown_and_json(tmp_path: Path) -> None:
    report = run_compare(tmp_path, "--schedules", "1f1b", "--stages", "2", "--device", "cpu")
    runners = {row["runner"] for row in report["rows"]}
    assert runners == {"single process", "torch.distributed.pipelining",
                       "torch.distributed.pipelining + freed memory kept", "lightning_pp"}
    for row in report["rows"]:
        assert row["step_s"]["n"] == 3 - 1, row  # every runner times the same steps: --steps 3 after --warmup 1
        assert all(b is not None and b > 0 for b in row["peak_saved_bytes"]), row
        if row["stages"] == 2:
            assert len(row["peak_saved_bytes"]) == 2 and row["efficiency"] is not None, row
    lightning_row = next(row for row in report["rows"] if row["runner"] == "lightning_pp")
    assert 0.0 <= lightning_row["bubble_fraction"] <= 1.0
    assert report["meta"]["device"] == "cpu" and report["meta"]["stages"] == [2]
    markdown = (tmp_path / "compare.md").read_text()
    assert markdown.startswith("Measured on ") and markdown.count("\n| MLP 8x32") == len(report["rows"])


@pytest.mark.timeout(300)
def test_compare_runs_every_pipeline_in_one_process(tmp_path: Path) -> None:
    """--one-process (the default on --device cuda with one GPU): each pipeline's stages held by one process, for
    lightning_pp and torch.distributed.pipelining alike; the ideal is the single process's step."""
    report = run_compare(tmp_path, "--one-process", "--stages", "2", "--device", "cpu",
                         "--runners", "single", "torch", "lightning")
    assert report["meta"]["one_process_per_pipeline"] and report["meta"]["replicas"] == [1]
    pipelines = [row for row in report["rows"] if row["stages"] == 2]
    assert {row["runner"] for row in pipelines} == {"torch.distributed.pipelining", "lightning_pp"}
    assert {row["schedule"] for row in pipelines} == {"interleaved_1f1b"}
    for row in pipelines:
        assert row["step_s"]["n"] == 2 and row["efficiency"] is not None, row
        assert len(row["peak_saved_bytes"]) == 1, row  # one process
    assert "one process per pipeline" in (tmp_path / "compare.md").read_text()
