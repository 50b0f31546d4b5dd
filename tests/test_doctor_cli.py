"""``vlfast doctor`` through the CLI runner: exit codes, JSON schema, markdown.

Exit codes are tested with a fabricated probe (timings never gate tests); one run probes for real with
a tiny budget and checks that the JSON is self-consistent.
"""

from __future__ import annotations

import json

import pytest
import torch
import typer
from typer.testing import CliRunner

import vlfast.diagnosis.doctor
from vlfast.cli import doctor as doctor_cli
from vlfast.diagnosis.probe import ProbeResult
from vlfast.diagnosis.timing import Timing

runner = CliRunner()

TOP_KEYS = {
    "schema",
    "target",
    "verdict",
    "forward_verdict",
    "backward_verdict",
    "workload",
    "exit_code",
    "exit_codes",
    "summary",
    "slow_ratio",
    "pathological_ratio",
    "patches_per_sample",
    "expected_saving_ms_per_sample",
    "savings_ms_per_sample",
    "backward_savings_ms_per_sample",
    "fix",
    "fixes",
    "findings",
    "rules",
    "facts",
    "notes",
    "budget_s",
    "probe_s",
    "left_out",
    "dtype_reason",
    "elapsed_s",
    "wall_s",  # the CLI's: seconds from the process's start
}
FINDING_KEYS = {
    "status",
    "forward_status",
    "backward_status",
    "channels_last_escapes",
    "backward",
    "channels_last",
    "rules",
    "shape",
    "device",
    "dtype",
    "conv_ms",
    "gemm_ms",
    "ratio",
    "saving_ms_per_sample",
    "conv_timing",
    "gemm_timing",
    "onednn_enabled",
    "cudnn_enabled",
    "max_abs_diff",
    "error",
    "notes",
    "disagreements",
    "windows_timed",
    "spread",
    "reliable",
    "rounds",
    "backend",
    "kernels",
    "left_out",
}


@pytest.fixture(autouse=True)
def _started_now(monkeypatch):
    """The budget is the whole command's, counted from the process's start: here the test process's, long
    before the command. Each command starts now, and building the references takes no time of it (seconds
    under load, which would leave a fabricated probe no budget)."""
    import vlfast.cli._process

    monkeypatch.setattr(vlfast.cli._process, "since_start", lambda: 1.0)
    monkeypatch.setattr(vlfast.diagnosis.doctor, "probe_clock", lambda: 0.0)


def _app() -> typer.Typer:
    # Only this command, so the test does not depend on the other command modules.
    app = typer.Typer()
    app.callback()(lambda: None)
    doctor_cli.register(app)
    return app


def _fake_probe(ratio: float, backward: float | None = None, channels_last: float | None = None):
    """A probe that measures ``ratio`` forward (2 ms GEMM), ``backward`` for the gradients when given,
    in three rounds each (fewer would be unreliable and kept out of the savings)."""

    def probe_conv(shape, *, device, dtype, budget_s, **kw):
        return ProbeResult(
            shape,
            str(device),
            str(dtype).removeprefix("torch."),
            conv=Timing((2.0 * ratio,) * 3),
            gemm=Timing((2.0,) * 3),
            conv_backward=Timing((4.0 * backward,) * 3) if backward is not None else None,
            gemm_backward=Timing((4.0,) * 3) if backward is not None else None,
            conv_channels_last=Timing((2.0 * channels_last,) * 3) if channels_last is not None else None,
            gemm_for_channels_last=Timing((2.0,) * 3) if channels_last is not None else None,
        )

    return probe_conv


def _run(*args: str):
    return runner.invoke(_app(), ["doctor", *args])


def test_slow_path_exits_1_with_the_fix(monkeypatch):
    monkeypatch.setattr(vlfast.diagnosis.doctor, "probe_conv", _fake_probe(40.0))
    res = _run("--model", "ref:qwen3-vl-4b", "--device", "cpu", "--dtype", "bf16", "--json")
    assert res.exit_code == 1, res.output
    data = json.loads(res.stdout)
    assert data["verdict"] == "slow-path" and data["exit_code"] == 1
    assert data["fix"] == "import vlfast; vlfast.patch(model)"
    texts = " ".join(f["text"] for f in data["fixes"])
    for fix in ("vlfast.patch_transformers()", "VLFAST_PATCH=1", "python -m vlfast.run", "torchrun"):
        assert fix in texts, fix
    assert data["expected_saving_ms_per_sample"] == pytest.approx(78.0)
    assert data["savings_ms_per_sample"] == {"qwen3-vl-4b": pytest.approx(78.0)}


def test_fast_path_exits_0(monkeypatch):
    monkeypatch.setattr(vlfast.diagnosis.doctor, "probe_conv", _fake_probe(1.3))
    res = _run("--model", "ref:qwen3-vl-4b", "--device", "cpu", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["verdict"] == "ok" and data["fix"] is None and data["fixes"] == []


def test_thresholds_gain_at_2x_slow_path_at_10x(monkeypatch):
    # On CPU the oneDNN rule explains a few x but is not pathological: 2x..10x is an ordinary gain.
    args = ("--model", "ref:qwen3-vl-4b", "--device", "cpu", "--dtype", "fp32", "--json")
    for ratio, code, verdict in [(1.99, 0, "ok"), (2.0, 4, "gain"), (9.9, 4, "gain"), (10.0, 1, "slow-path")]:
        monkeypatch.setattr(vlfast.diagnosis.doctor, "probe_conv", _fake_probe(ratio))
        res = _run(*args)
        assert (res.exit_code, json.loads(res.stdout)["verdict"]) == (code, verdict), ratio


def test_fail_on_slow_path_passes_a_gain_and_fails_a_slow_path(monkeypatch):
    args = ("--model", "ref:qwen3-vl-4b", "--device", "cpu", "--dtype", "fp32", "--fail-on", "slow-path")
    monkeypatch.setattr(vlfast.diagnosis.doctor, "probe_conv", _fake_probe(3.0))
    assert _run(*args).exit_code == 0
    monkeypatch.setattr(vlfast.diagnosis.doctor, "probe_conv", _fake_probe(3.0, backward=35.0))
    assert _run(*args).exit_code == 1  # training: the backward is the slow path
    assert _run(*args, "--inference").exit_code == 0  # inference: the forward alone counts
    assert _run("--fail-on", "never", "--no-probe").exit_code == 2


def test_patched_model_is_not_a_finding(monkeypatch):
    from vlfast import patch
    from vlfast.models import build_reference

    monkeypatch.setattr(vlfast.diagnosis.doctor, "probe_conv", _fake_probe(40.0))
    tower = build_reference("qwen3-vl-4b", tiny=True)
    patch(tower)
    report = vlfast.diagnosis.doctor.doctor(tower, device="cpu", dtype="bfloat16")
    assert report.verdict == "patched" and report.exit_code == 0 and report.facts.model_patched is True
    assert report.fixes == [] and report.savings_ms_per_sample == {}


def test_no_args_scans_every_reference(monkeypatch):
    from vlfast.models import REFERENCES

    monkeypatch.setattr(vlfast.diagnosis.doctor, "probe_conv", _fake_probe(3.0))
    res = _run("--device", "cpu", "--dtype", "fp32", "--json")
    assert res.exit_code == 4, res.output
    data = json.loads(res.stdout)
    names = {n.split(":")[0] for f in data["findings"] for n in f["shape"]["names"]}
    assert names == set(REFERENCES)
    # qwen2-vl and qwen2.5-vl share a geometry: probed once
    assert len(data["findings"]) < len(REFERENCES) + 1


def test_real_probe_json_schema_is_stable():
    res = _run("--model", "ref:qwen3-vl-4b", "--device", "cpu", "--patches", "64", "--budget", "3", "--json")
    assert res.exit_code in (0, 1, 4), res.output
    data = json.loads(res.stdout)
    assert set(data) == TOP_KEYS
    assert data["schema"] == "vlfast.doctor/2" and data["exit_code"] == res.exit_code
    assert data["workload"] == "training"
    assert data["patches_per_sample"] == 64
    (finding,) = data["findings"]
    assert set(finding) == FINDING_KEYS
    # On a loaded host the 3 s budget may leave the backward, or the whole shape, out: the report says so
    # (never a guessed ratio), and the schema is the same.
    left_out = finding["left_out"] or ""
    if left_out.startswith("the whole shape"):
        assert finding["ratio"] is None and any("the whole shape" in line for line in data["left_out"])
    else:
        assert finding["ratio"] > 0 and finding["conv_timing"]["n"] == finding["gemm_timing"]["n"]
    if finding["backward"]["ratio"] is not None:
        assert finding["backward"]["ratio"] > 0 and finding["backward_status"] in ("ok", "gain", "slow-path")
        assert data["backward_verdict"] is not None
    else:
        assert finding["backward_status"] == "skipped", finding["backward_status"]
        assert data["backward_verdict"] in (None, "skipped", "unmeasured"), data["backward_verdict"]
        assert left_out.startswith(("the backward", "the whole shape")), left_out
        assert any(("the backward" in line or "the whole shape" in line) for line in data["left_out"])
    assert finding["shape"]["kernel_size"] == [2, 16, 16]
    facts = data["facts"]
    for key in ("torch_version", "cudnn_runtime", "onednn_enabled", "transformers_version", "model_patched"):
        assert key in facts
    assert {r["id"] for r in data["rules"]} >= set(finding["rules"])


def test_markdown_block(monkeypatch):
    monkeypatch.setattr(vlfast.diagnosis.doctor, "probe_conv", _fake_probe(40.0))
    res = _run("--model", "ref:qwen3-vl-4b", "--device", "cpu", "--markdown")
    assert res.exit_code == 1
    assert res.stdout.startswith("### vlfast doctor")
    assert "| Conv3d 3->1024 k=2x16x16" in res.stdout and "40.0x" in res.stdout
    assert "vlfast.patch(model)" in res.stdout


def test_human_output(monkeypatch):
    monkeypatch.setattr(vlfast.diagnosis.doctor, "probe_conv", _fake_probe(40.0))
    res = _run("--model", "ref:qwen3-vl-4b", "--device", "cpu")
    assert res.exit_code == 1
    assert "verdict: slow-path" in res.stdout and "vlfast.patch(model)" in res.stdout


def test_bad_model_is_a_usage_error():
    assert _run("--model", "ref:nope", "--no-probe").exit_code == 2
    assert _run("--model", "/no/such/dir", "--no-probe").exit_code == 2
    assert _run("--dtype", "int8", "--no-probe").exit_code == 2
    if not torch.cuda.is_available():
        res = _run("--model", "ref:qwen3-vl-4b", "--device", "cuda", "--no-probe")
        assert res.exit_code == 2 and "not usable here" in res.output


def test_a_pipe_gets_tables_within_100_columns_and_the_wall_time(monkeypatch):
    """Issue 39: the probe table was ~330 columns wide in a pipe, and the footer's time was not the wall's."""
    monkeypatch.setattr(vlfast.diagnosis.doctor, "probe_conv", _fake_probe(3.0, 30.0))
    res = _run("--device", "cpu", "--dtype", "fp32")  # every reference: the widest table
    assert res.exit_code == 1, res.output
    tables = res.stdout.split("fix (any one of these):")[0]  # the fixes stay whole lines, to paste
    widest = max(tables.splitlines(), key=len)
    assert len(widest) <= 100, widest
    assert "ratio               3.00x (spread 0%)" in res.stdout  # one block per conv, a line per column
    words = " ".join(res.stdout.split())
    assert " s since the process started: " in words and " s starting up " in words, words[-300:]
    assert "the headline names the model whose losing convs do the most multiply-adds" in words
