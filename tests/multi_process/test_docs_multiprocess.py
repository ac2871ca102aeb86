"""The documentation: the site builds with ``mkdocs build --strict``, the README stays short, and the README's complete
module runs as it stands (2 processes on CPU). The single-process tests are in ``single_process/test_docs.py``."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from _launch import run_script

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"


def _python_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", markdown, flags=re.DOTALL | re.MULTILINE)


def _job_env() -> dict[str, str]:
    """This environment without what would make a script think it is already one rank of a job."""
    return {k: v for k, v in os.environ.items()
            if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")}


@pytest.mark.timeout(300)
def test_the_docs_build_strictly(tmp_path: Path) -> None:
    """Every page in the nav, every link and anchor, and the reference generated from the docstrings."""
    result = run_script([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                         "--site-dir", str(tmp_path / "site")],
                        timeout=240, cwd=ROOT, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert (tmp_path / "site" / "reference" / "options" / "index.html").is_file()


@pytest.mark.timeout(300)
def test_the_readmes_complete_module_runs_as_it_stands(tmp_path: Path) -> None:
    """The README's first python block, written to a file and run with this Python: 2 processes on CPU, a few steps."""
    module = _python_blocks(README.read_text())[0]
    script = tmp_path / "first_pipeline.py"
    script.write_text(module)
    result = run_script([sys.executable, str(script)], timeout=180, cwd=tmp_path, env=_job_env())
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert "max_steps=" in output and "reached" in output, output[-3000:]  # Lightning's line: fit ran to the end
