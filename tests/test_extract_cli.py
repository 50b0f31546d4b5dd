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
    assert (
        "nothing to do: all 13 input entries are already in" in r.output and f"already in {out} " in r.output
    )
    assert "rank" not in r.output  # a single process has no ranks to tell apart
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


def test_extract_lets_idle_openmp_threads_sleep_before_torch_loads():
    """`vlfast extract` sets OMP_WAIT_POLICY=PASSIVE, unless the user chose one or torch is already loaded
    (OpenMP reads it once); the CLI's own imports must leave torch unloaded for this to work."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    # One place for every command: the CLI package sets it on import, before any command loads torch.
    code = (
        "import os, sys\n"
        "import vlfast.cli.main\n"
        "print('torch' in sys.modules, os.environ.get('OMP_WAIT_POLICY'))\n"
    )
    run = lambda code, **extra: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**env, **extra}
    ).stdout.split()
    assert run(code) == ["False", "PASSIVE"]
    assert run(code, OMP_WAIT_POLICY="ACTIVE") == ["False", "ACTIVE"]  # the user's choice stands
    assert run("import torch\n" + code) == ["True", "None"]  # too late: not set, not pretended


def test_api_warns_when_openmp_threads_spin(monkeypatch):
    """Said by the local engine when it has something to extract (``cpu_warnings``, before the model loads):
    a finished OUT runs nothing, and is answered without torch."""
    import pytest
    import torch

    from vlfast.extraction.config import ExtractConfig
    from vlfast.extraction.engines.base import Hooks
    from vlfast.extraction.engines.local import LocalEngine

    if torch.get_num_threads() < 2:
        pytest.skip("one intra-op thread: nothing spins")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    config = ExtractConfig(model="ref:qwen3-vl-2b", device="cpu", num_workers=1)
    with pytest.warns(RuntimeWarning, match="OMP_WAIT_POLICY=PASSIVE"):
        LocalEngine(Hooks(bits_probe=lambda: True)).cpu_warnings(config)


def test_demo_help_says_it_takes_model():
    """`--demo -h` names --model and its default, as the README pairs `--demo` with `--model tiny-ckpt`."""
    r = runner.invoke(app, ["extract", "-h"])
    text = " ".join(r.output.split())
    assert "extract them with --model (default ref:qwen3-vl-2b" in text, text


def test_old_modes_of_extract_name_the_command_that_does_it_now(tmp_path):
    """`vlfast extract` extracts only: --verify and --compact, once modes of it, are answered with the
    command of `vlfast out` that does it (exit 2, one line), whatever else is given, and touch nothing."""
    out = tmp_path / "out"
    for argv, command in [
        (["extract", "--verify", str(out)], "`vlfast out verify OUT`"),
        (["extract", "--compact", str(out), "--json"], "`vlfast out compact OUT`"),
        (["extract", "--verify"], "`vlfast out verify OUT`"),  # before click asks for INPUT OUT
        (["extract", str(tmp_path), str(out), "-m", "ref:qwen3-vl-2b", "--compact"], "vlfast out compact"),
    ]:
        r = runner.invoke(app, argv)
        assert r.exit_code == 2, (argv, r.output)
        assert command in r.stderr and len(r.stderr.strip().splitlines()) == 1, (argv, r.stderr)
        assert not out.exists()
    assert "--verify" not in runner.invoke(app, ["extract", "-h"]).output


def test_export_is_also_reached_by_its_old_name(tmp_path):
    """`vlfast export` (the name before `vlfast out`) is the same command as `vlfast out export`, hidden
    from the list: the same refusal, the same help but for its usage line and examples."""
    for argv in (["export"], ["out", "export"]):
        r = runner.invoke(app, [*argv, str(tmp_path / "nope"), str(tmp_path / "t.parquet")])
        assert r.exit_code == 2 and "nope does not exist" in r.output, r.output
        help_text = lambda argv: runner.invoke(app, [*argv, "-h"]).output.split("Examples:")[0]  # noqa: E731
        assert help_text(argv).split("\n\n")[1:] == help_text(["out", "export"]).split("\n\n")[1:]
    listed = runner.invoke(app, ["-h"]).output
    assert " out " in listed and "\n  export " not in listed
