"""The core install without the extract extra: the patch, the switch, the record, verify and doctor work; a
command that needs the extra says which one and exits 2 before it does anything (vlfast.cli._extras)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from vlfast.cli._extras import MODULES, missing

# Runs in a subprocess: makes the named modules unimportable (as in an environment without them), then runs
# `vlfast ARGS...` or, with -c, the given code.
_BLOCK = textwrap.dedent(
    """
    import importlib.abc, sys
    blocked = set(sys.argv[1].split(","))

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.partition(".")[0] in blocked:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Block())
    if sys.argv[2] == "-c":
        exec(sys.argv[3])
    else:
        sys.argv = ["vlfast", *sys.argv[2:]]
        from vlfast.cli.main import main
        main()
    """
)
EXTRACT = ",".join(MODULES["extract"])


def _run(blocked: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("VLFAST_")} | (env or {})
    return subprocess.run(
        [sys.executable, "-c", _BLOCK, blocked, *args],
        capture_output=True,
        text=True,
        env=environ,
        timeout=240,
    )


def test_missing_names_each_module_and_the_transformers_floor():
    assert missing("extract", importable=lambda m: True, transformers_version="5.24.0") == []
    assert missing("extract", importable=lambda m: m != "av", transformers_version="5.18.0") == ["av"]
    assert missing("extract", importable=lambda m: True, transformers_version="4.57.1") == [
        "transformers>=5.18 (installed: 4.57.1)"
    ]
    assert missing("extract", importable=lambda m: True, transformers_version="5.6.0.dev0") != []
    # reading the store builds no model: any transformers will do
    assert missing("extract", models=False, importable=lambda m: True, transformers_version="4.45.0") == []
    assert missing("ray") == []  # an extra without a list here is not checked


@pytest.mark.parametrize(
    "args",
    [
        ("extract", "--demo", "OUT"),
        ("out", "verify", "OUT"),
        ("export", "OUT", "DEST.parquet"),
        ("demo-checkpoint", "OUT"),
        ("tokens", "rewrite", "--map", "think=thinking", "--dataset", "DEST.parquet", "--field", "text"),
    ],
    ids=lambda a: " ".join(a[:2]),
)
def test_a_command_that_needs_the_extra_names_it_and_exits_2(args, tmp_path):
    args = tuple(str(tmp_path / a) if a.isupper() or a.startswith("DEST") else a for a in args)
    r = _run("pyarrow", *args)
    assert r.returncode == 2, r.stderr
    named = {"tokens": "vlfast tokens rewrite of Parquet", "out": "vlfast out verify"}
    command = named.get(args[0], f"vlfast {args[0]}")
    assert f"{command} needs the extract extra (pyarrow missing): pip install 'vlfast[extract]'" in (
        " ".join(r.stderr.split())
    ), r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "OUT").exists() and not (tmp_path / "DEST.parquet").exists()


def test_an_old_transformers_is_named_with_the_extra(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from vlfast.cli import _extras
    from vlfast.cli.main import app

    monkeypatch.setattr(_extras, "_transformers_version", lambda: "4.57.1")
    r = CliRunner().invoke(app, ["extract", "--demo", str(tmp_path / "out")])
    assert r.exit_code == 2, r.output
    assert "transformers>=5.18 (installed: 4.57.1) missing): pip install 'vlfast[extract]'" in r.output
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_core_works_without_the_extract_extra(tmp_path):
    """pyarrow, av, xxhash and PIL unimportable: VLFAST_PATCH=1 patches, the record counts, verify passes."""
    code = textwrap.dedent(
        """
        import sys, torch
        from vlfast.models import build_reference, synthetic_inputs
        tower = build_reference("qwen2-vl-7b", tiny=True)
        import vlfast
        assert vlfast.is_patched(tower)
        with vlfast.record_calls() as rec, torch.no_grad():
            tower(*synthetic_inputs(tower, [(2, 4, 4)]))
        assert rec.gemm_calls == 1 and rec.stock_calls == 0, rec
        assert not {"pyarrow", "av", "xxhash", "PIL"} & set(sys.modules)
        print("CORE OK")
        """
    )
    switch = _run(EXTRACT, "-c", code, env={"VLFAST_PATCH": "1"})
    assert "CORE OK" in switch.stdout, switch.stderr
    verify = _run(EXTRACT, "verify", "--model", "ref:qwen2-vl-7b", "--tiny", "--no-backward", "--json")
    assert verify.returncode == 0, verify.stderr
    assert '"passed": true' in verify.stdout
