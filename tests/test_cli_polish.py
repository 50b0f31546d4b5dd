"""The CLI's small promises (issue 12, point 6): help as written, fail-fast checks, the switch, the runner.

Help is scanned for every command the app registers, so a command added later is checked too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch.nn as nn
from typer.testing import CliRunner

import vlfast
from _commands import COMMANDS, IDS, PATHS
from vlfast.cli.main import app
from vlfast.patching.gemm import PatchReport
from vlfast.switches import env as switch_env

runner = CliRunner()


def _help(path: tuple[str, ...]) -> str:
    res = runner.invoke(app, [*path, "--help"])
    assert res.exit_code == 0, res.output
    return res.stdout


def _source_texts(cmd) -> list[str]:
    """The help strings as written in the source: the command's docstring and each parameter's help."""
    return [cmd.help or ""] + [p.help or "" for p in cmd.params]


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)  # help wraps lines (and breaks after hyphens) at 80 columns


def _must_not_run(*args, **kwargs):
    raise AssertionError("called although the command should have stopped before")


def test_every_command_is_scanned():
    assert {"vlfast", "doctor", "profile", "verify", "extract", "models", "tokens"} <= set(IDS)
    assert {"tokens audit", "tokens fix", "tokens rewrite"} <= set(IDS)


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_help_prints_square_brackets_as_written(path):
    bracketed = {m for text in _source_texts(COMMANDS[path]) for m in re.findall(r"\[[^\[\]]*\]", text)}
    out = _squash(_help(path))
    assert [b for b in bracketed if _squash(b) not in out] == []


def test_known_bracketed_help_survives():
    assert "pip install 'vlfast[plot]'" in " ".join(_help(("profile",)).split())
    assert "[unused*]/reserved" in _help(("tokens", "audit"))


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_help_reads_like_git(path):
    cmd = COMMANDS[path]
    text = _help(path)
    for tag in ("<bool>", "<str>", "<int", "<float", "<list", "<path", "<text>"):
        assert tag not in text, f"type tag {tag} in `vlfast {' '.join(path)} --help`:\n{text}"
    usage = text.split("\n\n")[0]
    assert usage.startswith("Usage: vlfast") and "{" not in usage and "}" not in usage, usage
    rest = _squash(text)
    for text_in_source in _source_texts(cmd):  # braces written in a help text ('{kind}', JSON) are content
        source = _squash(text_in_source)
        while braced := re.findall(r"\{[^{}]*\}", source):  # nested ones too, innermost first
            for b in braced:
                rest, source = rest.replace(b, ""), source.replace(b, "")
    assert "{" not in rest and "}" not in rest, text
    for p in cmd.params:
        if getattr(p, "hidden", False):
            continue
        if p.param_type_name == "argument":
            assert p.metavar and p.metavar in usage, (p.name, usage)
            continue
        for opt in [*p.opts, *p.secondary_opts]:
            assert re.search(rf"(^|[\s,/]){re.escape(opt)}(?![\w-])", text), (opt, text)
        if not p.is_flag:  # a value is named: `--device DEVICE`, `--repeats N`
            long = max(p.opts, key=len)
            assert re.search(rf"{re.escape(long)} [A-Za-z]", text), (long, text)
    for name, sub in getattr(cmd, "commands", {}).items():  # a group lists each command's first sentence
        if sub.hidden:  # an old name kept working (`vlfast export`), listed under its group instead
            continue
        assert name in text and _squash(sub.get_short_help_str(limit=1000)) in _squash(text)


def test_profile_plot_without_matplotlib_fails_before_measuring(monkeypatch, tmp_path):
    import vlfast.diagnosis.profiler as profiler

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    monkeypatch.setattr(profiler, "profile", _must_not_run)
    res = runner.invoke(app, ["profile", "--tiny", "--device", "cpu", "--plot", str(tmp_path / "p.png")])
    assert res.exit_code == 2, res.output
    assert "pip install 'vlfast[plot]'" in res.stderr
    assert not (tmp_path / "p.png").exists()


def test_profile_text_only_checkpoint_fails_before_loading(monkeypatch, tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import vlfast.models as models

    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "text-only")
    for loader in ("load_model", "load_vision_tower", "build_reference"):
        monkeypatch.setattr(models, loader, _must_not_run)
    res = runner.invoke(app, ["profile", "--model", str(tmp_path / "text-only"), "--device", "cpu"])
    assert res.exit_code == 2, res.output
    assert "no vision_config" in res.stderr and "text-only" in res.stderr


def _child(code: str, env_value: str) -> subprocess.CompletedProcess:
    env = {**os.environ, switch_env.PATCH_VAR: env_value}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


# The start-up hook's work, then an explicit call: the warning must come once, the hook must not be armed.
_ARMED = (
    "import sys; from vlfast.switches import hook, patch as a; "
    "print(a.install_from_env(), any(isinstance(f, hook._PatchAfterImport) for f in sys.meta_path))"
)


def test_unknown_vlfast_patch_value_warns_once_and_patches_nothing():
    res = _child(_ARMED, "bogus")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", "False"]
    warnings = [line for line in res.stderr.splitlines() if "VLFAST_PATCH" in line]
    assert len(warnings) == 1, res.stderr
    assert "'bogus'" in warnings[0]
    for accepted in ("1", "true", "yes", "on", "all", "0", "false", "no", "off"):
        assert re.search(rf"\b{accepted}\b", warnings[0]), warnings[0]


def test_known_vlfast_patch_value_arms_the_hook_at_start_up():
    pth = Path(sysconfig.get_paths()["purelib"]) / "vlfast_autopatch.pth"
    if not pth.is_file():
        pytest.skip(f"{pth} is not installed (not an editable or wheel install)")
    code = "import sys; print(any(type(f).__name__ == '_PatchAfterImport' for f in sys.meta_path))"
    assert _child(code, " On ").stdout.split() == ["True"]  # by the .pth alone
    assert _child(code, "bogus").stdout.split() == ["False"]


@pytest.mark.parametrize(
    ("value", "expected"),
    [("", None), ("off", None), (" NO ", None), ("0", None), ("1", "1"), ("Yes", "yes"), (" ALL", "all")],
)
def test_env_setting_values(value, expected):
    assert switch_env.env_setting({switch_env.PATCH_VAR: value}) == expected


def test_env_setting_unknown_value_is_off(monkeypatch, capsys):
    monkeypatch.setattr(switch_env, "_warned", False)
    assert switch_env.env_setting({switch_env.PATCH_VAR: "al"}) is None
    assert switch_env.env_setting({switch_env.PATCH_VAR: "al"}) is None
    assert capsys.readouterr().err.count("VLFAST_PATCH='al'") == 1


def test_run_missing_script_is_one_line_and_exit_2(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "vlfast.run", "missing.py", "--lr", "1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines() == ["vlfast.run: error: cannot run 'missing.py': no such file"]


def test_run_missing_module_is_one_line_and_exit_2(monkeypatch, capsys):
    from vlfast import run

    monkeypatch.setattr("vlfast.patching.integrations.patch_transformers", lambda **kw: None)
    for name in ("vlfast_no_such_module", "vlfast_no_such_pkg.sub", "json.no_such_sub"):
        with pytest.raises(SystemExit) as exit_info:
            run.main(["-m", name])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.strip() == f"vlfast.run: error: no module named {name!r}"


def test_unpatch_report_is_headed_unpatch():
    model = nn.Sequential(nn.Conv3d(3, 8, (2, 4, 4), stride=(2, 4, 4)), nn.Conv2d(8, 8, 3))
    patched = vlfast.patch(model)
    assert str(patched).splitlines()[0] == "vlfast patch: 1 patched, 1 skipped"  # unchanged
    undone = vlfast.unpatch(model)
    assert undone.action == "unpatch" and bool(undone)
    assert str(undone).splitlines() == [
        "vlfast unpatch: 1 unpatched",
        "  unpatched       0: Conv3d k=(2, 4, 4) s=(2, 4, 4)",
    ]
    again = vlfast.unpatch(model)
    assert str(again) == "vlfast unpatch: nothing was patched" and not again
    with pytest.raises(ValueError, match="action"):
        PatchReport(action="undo")


def test_verify_table_and_notes_keep_brackets(monkeypatch, tmp_path, tiny_qwen3_vl):
    import shutil

    from vlfast.diagnosis import verification

    # a real checkpoint folder: verify refuses a path that is none, or whose tensors disagree, before loading
    ckpt = Path(shutil.copytree(tiny_qwen3_vl, tmp_path / "qwen[v2]"))
    report = verification.VerifyReport(model=str(ckpt), device="cpu")
    report.notes.append("reserved rows [unused*] skipped")
    monkeypatch.setattr(verification, "verify", lambda *a, **kw: report)
    res = runner.invoke(app, ["verify", "--model", str(ckpt)])
    assert str(ckpt) in "".join(res.stdout.split("\n")) and "[unused*]" in res.stdout, res.output


def test_token_audit_prints_bracket_tags(tmp_path):
    from test_tokens import make_model

    make_model(tmp_path)
    res = runner.invoke(app, ["tokens", "audit", "--model", str(tmp_path), "--tags", "[THINK],[/THINK]"])
    assert res.exit_code in (0, 1), res.output  # a verdict, not a markup error
    assert "[THINK]" in res.stdout and "[/THINK]" in res.stdout


# ------------------------------------------------------------------ issue 20: tables survive a pipe


def test_models_table_keeps_names_whole_in_a_pipe():
    from vlfast.models import REF_PREFIX, list_references

    res = runner.invoke(app, ["models"])  # CliRunner's stdout is no terminal: as `vlfast models | cat`
    assert res.exit_code == 0, res.output
    for r in list_references():
        assert REF_PREFIX + r.name in res.stdout, r.name
        assert r.source.split(" ")[0].removeprefix("huggingface.co/") in res.stdout, r.source
    assert "…" not in res.stdout


def test_verify_table_keeps_names_and_values_whole_in_a_pipe(monkeypatch):
    from vlfast.diagnosis import verification

    report = verification.VerifyReport(model="ref:qwen3-vl-30b-a3b", device="cpu")
    name = "blocks.0.attn.qkv sample 0 grid=(2, 16, 16) last_hidden_state"
    metrics = {"max_abs": 50.123456, "max_rel": 1.234e-05, "cosine": 0.99999912, "mean_abs": 0.00321}
    report.checks.append(verification.Check("tower", name, "bfloat16", metrics, {"cosine": ">= 0.999"}, True))

    def run(*a, progress, **kw):
        progress(verification.Step(0, None, "load ref:qwen3-vl-30b-a3b", 0.1))  # the model built
        return report

    monkeypatch.setattr(verification, "verify", run)
    monkeypatch.setattr(verification, "expected_seconds", lambda *a, **kw: 42.0)
    res = runner.invoke(app, ["verify", "--model", "ref:qwen3-vl-30b-a3b"])
    assert "ref:qwen3-vl-30b-a3b" in res.stdout and name in res.stdout, res.stdout
    assert "max_abs=50.1" in res.stdout and "cosine=1" in res.stdout and "…" not in res.stdout
    assert "then ~42 s of checks" in res.stderr  # told before the checks, on stderr


def test_verify_expected_time_comes_from_the_tower_and_a_measured_rate(monkeypatch):
    from vlfast.diagnosis import verification

    monkeypatch.setattr(verification, "_gemm_rate", lambda dtype, device: 1e9)  # 1 G multiply-adds/s
    small = verification.expected_seconds("ref:qwen3-vl-4b", grids=[(1, 4, 4)], backward=False)
    big = verification.expected_seconds("ref:qwen3-vl-4b", grids=[(2, 16, 16)], backward=False)
    with_grads = verification.expected_seconds("ref:qwen3-vl-4b", grids=[(2, 16, 16)])
    assert 0 < small < big < with_grads


def test_every_command_is_short():
    """Each command parses, calls one library function and renders its result: no function in cli/ is over
    80 lines (`vlfast extract` was 377, three commands in one)."""
    from test_architecture import PACKAGE, long_functions

    assert long_functions(PACKAGE / "cli", limit=80) == []
