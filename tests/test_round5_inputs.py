"""Valid JSON that Python still cannot read (an integer past its 4,300-digit limit, nesting past the parser's
recursion limit) is that row's problem in every input that carries JSON, never the run's exit 3."""

from __future__ import annotations

import json
import shutil
import sys

import pyarrow as pa
import pyarrow.parquet as pq
from typer.testing import CliRunner

from vlfast.cli.main import app
from vlfast.extraction.sources import load_inputs
from vlfast.extraction.sources.manifest import load_manifest

BIG = "9" * 5000  # past sys.get_int_max_str_digits() (4,300 by default)
DEEP = "[" * (sys.getrecursionlimit() * 20)


def test_the_limit_is_what_the_fault_needs():
    assert 0 < sys.get_int_max_str_digits() < len(BIG)


def _names(samples) -> list[str]:
    return [s.id for s in samples]


def test_a_jsonl_row_with_a_huge_integer_is_that_rows_problem(tmp_path):
    m = tmp_path / "m.jsonl"
    m.write_text(
        '{"id": "good", "path": "a.jpg"}\n'
        f'{{"id": "big", "path": "a.jpg", "score": {BIG}}}\n'
        f'{{"path": "a.jpg", "id": "deep", "x": {DEEP}}}\n'
        '{"id": "after", "path": "b.jpg"}\n'
    )
    samples, problems = load_manifest(m)
    assert _names(samples) == ["good", "after"]
    assert [p.where for p in problems] == [f"{m} line 2", f"{m} line 3"]
    assert "an integer of 5,000 digits" in problems[0].reason
    assert "in quotes, as text" in problems[0].reason
    assert "nested too deeply" in problems[1].reason


def test_a_frame_list_written_as_text_with_a_huge_integer_is_that_rows_problem(tmp_path):
    """CSV and Parquet hold no JSON but a frame list written as JSON text in ``path``."""
    c = tmp_path / "m.csv"
    c.write_text(f'id,path\ngood,a.jpg\nbig,"[{BIG}]"\ndeep,"{DEEP}]"\nafter,b.jpg\n')
    samples, problems = load_manifest(c)
    assert _names(samples) == ["good", "after"]
    assert [p.id for p in problems] == ["big", "deep"]
    assert problems[0].reason.startswith("path looks like a JSON list but is JSON that Python cannot read")
    p = tmp_path / "m.parquet"
    rows = {"id": ["good", "big", "after"], "path": ["a.jpg", f"[{BIG}]", "b.jpg"]}
    pq.write_table(pa.table(rows), p)
    samples, problems = load_manifest(p)
    assert _names(samples) == ["good", "after"]
    assert [(p.id, "5,000 digits" in p.reason) for p in problems] == [("big", True)]


def test_a_webdataset_json_member_with_a_huge_integer_is_that_keys_problem(tmp_path):
    import io
    import tarfile

    from vlfast.demo import pattern

    png = io.BytesIO()
    from PIL import Image

    Image.fromarray(pattern(32, 32, 1)).save(png, "PNG")
    members = [
        ("ok.png", png.getvalue()),
        ("big.png", png.getvalue()),
        ("big.json", f'{{"prompt": "p", "score": {BIG}}}'.encode()),
    ]
    with tarfile.open(tmp_path / "0.tar", "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    samples, problems = load_inputs(str(tmp_path / "0.tar"))
    assert _names(samples) == ["0.tar/ok"]
    assert [p.id for p in problems] == ["0.tar/big"]
    assert "json member is JSON that Python cannot read" in problems[0].reason


def test_extract_records_the_row_and_extracts_the_rest(media_dir, tiny_qwen3_vl, tmp_path):
    """The reported run: exit 3 ('Exceeds the limit (4300 digits)') and nothing extracted."""
    shutil.copy(media_dir / "good" / "rgb.jpg", tmp_path / "a.jpg")
    m = tmp_path / "m.jsonl"
    m.write_text(
        '{"id": "good", "path": "a.jpg"}\n'
        f'{{"id": "big", "path": "a.jpg", "score": {BIG}}}\n'
        '{"id": "after", "path": "a.jpg"}\n'
    )
    out = tmp_path / "out"
    args = ["extract", str(m), str(out), "-m", str(tiny_qwen3_vl), "--workers", "0", "--features", "vision"]
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output  # a bad row is recorded and the run goes on, as for other bad rows
    summary = json.loads(r.stdout)
    assert summary["extracted"] == 2 and summary["failed"] == 1, summary
    assert "Exceeds the limit" not in r.output
