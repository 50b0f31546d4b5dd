"""`vlfast extract`: exit codes, JSON summary, --demo, and the messages a user acts on."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from vlfast.cli.main import app

runner = CliRunner()


def test_extract_json_then_resume(media_dir, tiny_qwen3_vl, tmp_path):
    out = tmp_path / "out"
    args = ["extract", str(media_dir / "good"), str(out), "--model", str(tiny_qwen3_vl), "--workers", "0"]
    r = runner.invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert summary["extracted"] == len(list((media_dir / "good").iterdir())) and summary["failed"] == 0
    r = runner.invoke(app, args)  # human output, resumed: nothing left to do
    assert r.exit_code == 0, r.output
    assert "already in OUT" in r.output
    r = runner.invoke(app, [*args, "--features", "vision"])
    assert r.exit_code == 2 and "features" in r.output


def test_max_errors_exit_code(media_dir, tiny_qwen3_vl, tmp_path):
    args = [
        "extract",
        str(media_dir / "bad"),
        str(tmp_path / "o"),
        "-m",
        str(tiny_qwen3_vl),
        "--workers",
        "0",
    ]
    r = runner.invoke(app, [*args, "--max-errors", "2", "--json"])
    assert r.exit_code == 1, r.output
    assert "max-errors" in r.output


def test_usage_errors(tmp_path, tiny_qwen3_vl):
    r = runner.invoke(app, ["extract", str(tmp_path), str(tmp_path / "o")])
    assert r.exit_code == 2 and "--model is required" in r.output
    r = runner.invoke(app, ["extract", str(tmp_path / "nope"), str(tmp_path / "o"), "-m", str(tiny_qwen3_vl)])
    assert r.exit_code == 2 and "neither a folder" in r.output
    r = runner.invoke(
        app, ["extract", str(tmp_path), str(tmp_path / "o"), "-m", "ref:qwen3-vl-2b", "-f", "pixels"]
    )
    assert r.exit_code == 2 and "unknown feature" in r.output


def test_demo_makes_its_own_inputs(tiny_qwen3_vl, tmp_path):
    r = runner.invoke(app, ["extract", "--demo", str(tmp_path / "demo"), "-m", str(tiny_qwen3_vl), "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert summary["extracted"] == 4 and summary["failed"] == 0
