"""`vlfast tokens audit|rewrite|fix` through typer's CliRunner: exit codes and JSON."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from test_tokens import make_model

runner = CliRunner()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli_model")
    return folder, make_model(folder)


def test_audit_json_exit_1_on_untrained(tokens_app, model):
    folder, info = model
    r = runner.invoke(tokens_app, ["tokens", "audit", "--model", str(folder), "--json"])
    assert r.exit_code == 1, r.output
    data = json.loads(r.stdout)
    assert data["verdict"] == "untrained" and data["untrained_tags"] == ["<think>", "</think>"]
    assert [t["token_ids"] for t in data["tags"]] == [[i] for i in info["added"]]
    assert data["suggested_mapping"]["<think>"] == "<thinking>"


def test_audit_trained_tags_exit_0_and_table(tokens_app, model):
    folder, _ = model
    r = runner.invoke(tokens_app, ["tokens", "audit", "-m", str(folder), "--tags", "<thinking>,</thinking>"])
    assert r.exit_code == 0, r.output
    assert "verdict" in r.stdout and "trained" in r.stdout


def test_audit_table_for_untrained(tokens_app, model):
    folder, _ = model
    r = runner.invoke(tokens_app, ["tokens", "audit", "-m", str(folder)])
    assert r.exit_code == 1
    assert "untrained" in r.stdout and "vlfast tokens rewrite" in r.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["--model", "/nonexistent/dir"],
        ["--reward-regex", "<think>("],
        ["--reference-ids", "a-b"],
    ],
)
def test_audit_bad_input_exit_2(tokens_app, model, args):
    folder, _ = model
    if "--model" not in args:
        args = ["--model", str(folder), *args]
    r = runner.invoke(tokens_app, ["tokens", "audit", *args])
    assert r.exit_code == 2, r.output


def test_fix_then_audit_passes(tokens_app, model, tmp_path):
    folder, _ = model
    out = tmp_path / "fixed"
    r = runner.invoke(
        tokens_app, ["tokens", "fix", str(out), "--model", str(folder), "--init", "pieces", "--json"]
    )
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["ok"] and data["after"]["verdict"] != "untrained"
    r = runner.invoke(tokens_app, ["tokens", "audit", "--model", str(out), "--json"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(tokens_app, ["tokens", "fix", str(out), "--model", str(folder)])
    assert r.exit_code == 2  # OUT exists and is not empty


def test_rewrite_json(tokens_app, tmp_path):
    src = tmp_path / "d.jsonl"
    src.write_text(json.dumps({"text": "<think>x</think>"}) + "\n")
    r = runner.invoke(
        tokens_app,
        [
            "tokens",
            "rewrite",
            "--map",
            "think=thinking",
            "--dataset",
            str(src),
            "--field",
            "text",
            "--out",
            str(tmp_path / "o.jsonl"),
            "--reward-regex",
            "^<think>.*</think>$",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["reward_regex_out"] == "^<thinking>.*</thinking>$"
    assert json.loads((tmp_path / "o.jsonl").read_text())["text"] == "<thinking>x</thinking>"
    r = runner.invoke(tokens_app, ["tokens", "rewrite", "--map", "think"])
    assert r.exit_code == 2
