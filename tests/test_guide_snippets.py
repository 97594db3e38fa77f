"""Run every Python snippet of the documentation pages and the README as a script.

Each fenced ```` ```python ```` block of ``docs/**/*.md`` and ``README.md`` is written to a
file and run in a fresh interpreter, the way a reader runs a snippet copied from the
page. So a snippet must define everything it uses, and a program that starts processes
(a Dask ``LocalCluster``) needs its ``if __name__ == "__main__":`` guard, as it would in
a script. A failure names the page and the line of the snippet.

A snippet that cannot run here is skipped only with a MyST comment on the line right
before its fence, which states the reason in the page source::

    % snippet: skip (needs a CUDA GPU)

Skips are rare by design: shrink a snippet's sizes instead, so that it runs in seconds.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
IGNORED_FOLDERS = {"_build", "auto_examples", "generated", "_static"}
FENCE = re.compile(r"^```python[ \t]*$")
SKIP_MARKER = re.compile(r"^% snippet: skip \((.+)\)\s*$")
TIMEOUT_S = 300


def extract_snippets(text: str) -> list[tuple[int, str, str | None]]:
    """``(line number, code, skip reason or None)`` for each ```python block of a page."""
    lines = text.splitlines()
    snippets, index = [], 0
    while index < len(lines):
        if FENCE.match(lines[index]):
            start = index + 1
            end = start
            while end < len(lines) and lines[end].strip() != "```":
                end += 1
            previous = next((line for line in reversed(lines[:index]) if line.strip()), "")
            marker = SKIP_MARKER.match(previous)
            snippets.append((start + 1, "\n".join(lines[start:end]) + "\n",
                             marker.group(1) if marker else None))
            index = end
        index += 1
    return snippets


def _cases() -> list:
    cases = []
    for page in PAGES:
        relative = page.relative_to(ROOT)
        if IGNORED_FOLDERS & set(relative.parts):
            continue
        for line, code, skip_reason in extract_snippets(page.read_text(encoding="utf-8")):
            marks = [pytest.mark.skip(reason=skip_reason)] if skip_reason else []
            cases.append(pytest.param(relative, line, code, id=f"{relative}:{line}",
                                      marks=marks))
    return cases


def test_extract_snippets_reads_fences_and_skip_markers():
    page = ("# Title\n\n```python\nx = 1\n```\n\ntext\n\n"
            "% snippet: skip (needs a CUDA GPU)\n```python\nimport cupy\n```\n"
            "```bash\nls\n```\n")
    assert extract_snippets(page) == [(4, "x = 1\n", None),
                                      (11, "import cupy\n", "needs a CUDA GPU")]


def test_the_pages_have_snippets():
    """The collection finds the guide's snippets (so the runs below cannot pass empty)."""
    pages_with_snippets = {case.values[0].as_posix() for case in _cases()}
    assert {"docs/getting_started.md", "docs/guide/02_randomness.md",
            "docs/guide/06_long_sequences.md", "README.md"} <= pages_with_snippets


@pytest.mark.parametrize(("page", "line", "code"), _cases())
def test_snippet_runs_alone(page, line, code, tmp_path):
    script = tmp_path / f"{page.stem}_line{line}.py"
    script.write_text(code, encoding="utf-8")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "MPLBACKEND": "Agg"}
    result = subprocess.run([sys.executable, script.name], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    assert result.returncode == 0, (
        f"the snippet at {page}:{line} failed when run alone:\n{code}\n"
        f"--- stderr ---\n{result.stderr[-4000:]}")


def test_pages_hold_no_control_characters():
    """A TeX escape written through a Python string (``"\\times"``, ``"\\rfloor"``) turns
    into a tab or a carriage return and breaks the formula silently: no page may hold a
    control character other than the newline."""
    control = re.compile(r"[\x00-\x09\x0b-\x1f\x7f]")
    found = [f"{page.relative_to(ROOT)}:{number}"
             for page in PAGES if not IGNORED_FOLDERS & set(page.relative_to(ROOT).parts)
             for number, line in enumerate(page.read_text(encoding="utf-8").split("\n"), 1)
             if control.search(line)]
    assert not found, f"control characters at {found}"
