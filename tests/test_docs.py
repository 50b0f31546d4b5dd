"""The README's and docs' examples run: a tagged example that breaks fails here.

A fenced block is run when the line right before its opening fence is ``<!-- docs-test -->`` (invisible
on GitHub). Shell blocks run under ``bash -eo pipefail``, Python blocks under this interpreter; one file's
blocks run in order in one fresh folder, so a block may use what an earlier one wrote (the README's tour
builds ``tiny-ckpt`` once). Every Python block, tagged or not, must at least compile.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = "<!-- docs-test -->"
FENCE = re.compile(r"^```\s*([\w+-]*)")
SHELL, PYTHON = ("bash", "sh", "shell", "console"), ("python", "py")
BLOCK_TIMEOUT_S = 120  # one block; the README's whole tour takes ~40 s on the project's 2-core machine


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    tagged: bool

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line} ({self.lang or 'no language'})"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a markdown file; raises if a marker is not right before a fence."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.strip() == MARKER and not (i + 1 < len(lines) and FENCE.match(lines[i + 1])):
            raise ValueError(
                f"{path.relative_to(ROOT)}:{i + 1}: {MARKER} must be the line right before a ```"
            )
        m = FENCE.match(line)
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise ValueError(f"{path.relative_to(ROOT)}:{i + 1}: unclosed code fence")
        tagged = i > 0 and lines[i - 1].strip() == MARKER
        out.append(Block(path, i + 1, m.group(1).lower(), "\n".join(lines[i + 1 : end]) + "\n", tagged))
        i = end + 1
    return out


def _tagged_files() -> list[Path]:
    return [p for p in DOCS if any(b.tagged for b in blocks(p))]


def test_markers_sit_on_runnable_blocks():
    for path in DOCS:
        for b in blocks(path):
            if b.tagged:
                assert b.lang in SHELL + PYTHON, f"{b}: only shell and Python blocks can be run"
    assert ROOT / "README.md" in _tagged_files(), "the README's tour must stay tagged"


def test_python_blocks_compile():
    bad = []
    for path in DOCS:
        for b in blocks(path):
            if b.lang in PYTHON:
                try:
                    compile(b.code, str(b), "exec")
                except SyntaxError as e:
                    bad.append(f"{b}: {e.msg} (block line {e.lineno})")
    assert not bad, "\n".join(bad)


@pytest.mark.slow
@pytest.mark.parametrize("path", _tagged_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_tagged_blocks_run(path: Path, tmp_path: Path):
    env = dict(os.environ)
    # this checkout's vlfast, in the `vlfast` command too (its console script imports the package)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env.pop("VLFAST_PATCH", None)
    for b in (b for b in blocks(path) if b.tagged):
        cmd = ["bash", "-eo", "pipefail", "-c", b.code] if b.lang in SHELL else [sys.executable, "-c", b.code]
        run = subprocess.run(
            cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S
        )
        assert run.returncode == 0, (
            f"{b} exited {run.returncode}\n--- block\n{b.code}--- stdout\n{run.stdout[-3000:]}"
            f"--- stderr\n{run.stderr[-3000:]}"
        )


LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_resolve():
    """A link to a moved section (README -> docs/benchmarks.md) must follow it."""
    bad = []
    for path in DOCS:
        for target in LINK.findall(path.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                bad.append(f"{path.relative_to(ROOT)}: {target}: no such file")
            elif anchor and dest.suffix == ".md":
                headings = [
                    line.lstrip("#") for line in dest.read_text().splitlines() if line.startswith("#")
                ]
                if anchor not in {_anchor(h) for h in headings}:
                    bad.append(f"{path.relative_to(ROOT)}: {target}: no such heading")
    assert not bad, "\n".join(bad)


def test_readme_test_command_is_what_ci_runs():
    """The README's set-up command 2 and .ci/run install and test alike (CI's log shows --durations=25)."""

    def command(text: str) -> str:
        (line,) = [line for line in text.splitlines() if "python -m pytest" in line and "pip install" in line]
        return line.replace("pip install -q ", "pip install ").strip()  # CI's pip is quiet

    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    assert command(readme) == command(ci)
    assert "--durations=25" in command(ci)
