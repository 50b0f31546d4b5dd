"""What a user gets from the package and the clone: type information, and a clean `git status` after the tour.

`.ci/run` builds the sdist and wheel and runs the installed command from outside the tree; these are the
cheap checks that need no build."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What the README's tour and docs/extract.md's export examples write in the clone, and the caches the suite
# and lint-imports leave (a build would put them in the sdist).
WRITTEN = ["demo_out/x", "tiny-ckpt/x", "demo_llm/x", "demo.parquet", "demo-f16.parquet", "demo.lance/x"]
CACHES = [".hypothesis/x", ".import_linter_cache/x"]


def test_the_package_says_it_is_typed():
    assert (ROOT / "src" / "vlfast" / "py.typed").is_file()  # PEP 561; the wheel carries it (.ci/run checks)


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git clone")
@pytest.mark.parametrize("path", WRITTEN + CACHES)
def test_what_the_tour_writes_is_ignored(path):
    out = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT)
    assert out.returncode == 0, f"{path} is not covered by .gitignore"
