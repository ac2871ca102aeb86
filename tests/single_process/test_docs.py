"""The documentation: the site builds with ``mkdocs build --strict``, the README stays short, and the README's complete
module runs as it stands (2 processes on CPU).
The multi-process tests are in ``multi_process/test_docs_multiprocess.py``."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"
README_MAX_LINES = 250
# names the API no longer has (the CHANGELOG records the renames, so it is not searched)
OLD_NAMES = re.compile(r"checkpoint_format|process_group_timeout|\bdata_parallel=|\bsequential=|(?<!_)\btimeout=\d")


def _python_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", markdown, flags=re.DOTALL | re.MULTILINE)


def test_the_readme_is_short() -> None:
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move the details into the docs (docs/).")


def test_the_readmes_module_is_the_docs_module() -> None:
    """The complete module appears in the README and, through a snippet, in the docs: one text."""
    snippet = (ROOT / "docs" / "snippets" / "first_pipeline.py").read_text()
    assert _python_blocks(README.read_text())[0] == snippet


def test_the_docs_use_the_current_names() -> None:
    """No page shows a renamed or removed argument, except as the error it now raises (the example's next line)."""
    pages = [README, *(ROOT / "docs").rglob("*.md")]
    stale = []
    for page in pages:
        lines = page.read_text().splitlines() if page.name != "changelog.md" else []
        for number, line in enumerate(lines):
            shown_refused = "PipelineConfigError" in line or (number > 0 and "PipelineConfigError" in lines[number - 1])
            stale += [f"{page.relative_to(ROOT)}:{number + 1}: {found.group()}" for found in OLD_NAMES.finditer(line)
                      if not shown_refused]
    assert not stale, stale


