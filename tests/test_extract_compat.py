"""An OUT of an earlier development format is refused, in one line naming its version and what to do, before
anything is written: vlfast reads and writes one format (``store.format.FORMAT_VERSION``), with no branches
for the formats it wrote while in development.

The folder under tests/data/out_written_before_issue21 was written at commit 5e7f751 (format 2; see its
README.md): every reader and the run itself refuse it, and leave it byte for byte as it was.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from vlfast.extraction.store.format import FORMAT_VERSION, OldFormat

DATA = Path(__file__).parent / "data" / "out_written_before_issue21"
WAY_FORWARD = "re-run into a new folder, or read it with the vlfast that wrote it"


@pytest.fixture
def old(tmp_path) -> Path:
    root = tmp_path / "old"
    shutil.copytree(DATA, root)
    return root


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _says_so(message: str) -> None:
    assert "\n" not in message.strip(), message
    assert "development format 2 of vlfast" in message and f"reads format {FORMAT_VERSION} only" in message
    assert WAY_FORWARD in message


def test_extract_refuses_it_with_exit_2_in_one_line_and_writes_nothing(old, tmp_path):
    from typer.testing import CliRunner

    from vlfast.cli.main import app

    before = _snapshot(old / "out")
    # the model is never looked at: the refusal comes first (the checkpoint the OUT names does not exist)
    args = ["extract", str(old / "all.jsonl"), str(old / "out"), "--model", str(tmp_path / "no-checkpoint")]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2, r.output
    _says_so(" ".join(r.output.split()))
    assert _snapshot(old / "out") == before


def test_the_library_refuses_it_too(old):
    from vlfast import extract

    before = _snapshot(old / "out")
    with pytest.raises(OldFormat) as e:
        extract(str(old / "all.jsonl"), str(old / "out"), model="/nonexistent", features="vision")
    _says_so(str(e.value))
    assert _snapshot(old / "out") == before


def test_readers_checks_and_compaction_refuse_it(old):
    from vlfast.extraction import FeatureCache
    from vlfast.extraction.store.compact import compact_folder
    from vlfast.extraction.store.integrity import check_folder

    before = _snapshot(old / "out")
    for use in (FeatureCache, check_folder, compact_folder):
        with pytest.raises(OldFormat) as e:
            use(old / "out")
        _says_so(str(e.value))
    assert _snapshot(old / "out") == before


def test_without_its_run_json_its_index_parts_say_the_format(old):
    from vlfast.extraction.store.out import Out

    (old / "out" / "run.json").unlink()
    before = _snapshot(old / "out")
    with pytest.raises(OldFormat) as e:
        Out.open(old / "out")
    _says_so(str(e.value))
    assert _snapshot(old / "out") == before


def test_overwrite_replaces_it(old):
    """--overwrite reads nothing of what OUT holds, so the refusal is not in its way."""
    from vlfast.extraction.store.out import Out

    assert Out.open(old / "out", check_format=False).run_file() is None
