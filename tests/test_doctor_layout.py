"""`vlfast doctor` (issue 46 item 11): its table in a 100-column terminal, a ratio that is the ratio of the
times printed beside it, and a budget for the whole command.

Timings are fabricated (timings never gate tests); the slow step is a sleep, so the check is that the
probe was given what the step left, whatever this machine's speed.
"""

from __future__ import annotations

import io
import re
import time

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

import vlfast.cli._common as common
import vlfast.cli._process
import vlfast.diagnosis.doctor as D
from vlfast.cli import doctor as doctor_cli
from vlfast.diagnosis.probe import ConvShape, ProbeResult
from vlfast.diagnosis.timing import Timing

QWEN = ConvShape("Conv3d", 3, 1024, (2, 16, 16), True, 3072, ("qwen3-vl-4b:patch_embed.proj",))
HEADERS = (
    "windows x rounds",
    "conv ms/sample",
    "GEMM ms/sample",
    "bwd conv ms/sample",
    "bwd GEMM ms/sample",
    "backward ratio",
    "channels-last ratio",
)


def _fake_probe(conv: tuple[float, ...], gemm: tuple[float, ...], backward: float = 30.0):
    def probe_conv(shape, *, device, dtype, budget_s, **kw):
        return ProbeResult(
            shape,
            str(device),
            str(dtype).removeprefix("torch."),
            conv=Timing(conv),
            gemm=Timing(gemm),
            conv_backward=Timing((4.0 * backward,) * len(conv)),
            gemm_backward=Timing((4.0,) * len(conv)),
            conv_channels_last=Timing((3.0,) * len(conv)),
            gemm_for_channels_last=Timing((2.0,) * len(conv)),
            windows_timed=shape.windows,
        )

    return probe_conv


def _doctor_in_a_terminal(monkeypatch, width: int, *args: str) -> str:
    """What `vlfast doctor ARGS` shows in a terminal ``width`` columns wide (colours off, to read it)."""
    screen = io.StringIO()
    terminal = Console(file=screen, force_terminal=True, width=width, color_system=None)
    monkeypatch.setattr(common, "console", terminal)
    monkeypatch.setattr(doctor_cli, "console", terminal)
    monkeypatch.setattr(vlfast.cli._process, "since_start", lambda: 1.0)
    app = typer.Typer()
    app.callback()(lambda: None)
    doctor_cli.register(app)
    result = CliRunner().invoke(
        app, ["doctor", "--device", "cpu", "--dtype", "fp32", "--budget", "600", *args]
    )
    assert result.exit_code in (1, 4), result.output
    return screen.getvalue()


def test_a_100_column_terminal_splits_no_header_and_no_number(monkeypatch):
    """Rich squeezed the 13 columns into 6-character cells: 'conv' over 'ms/s' over 'ampl' over 'e'."""
    monkeypatch.setattr(D, "probe_conv", _fake_probe((64.65, 64.0, 66.0), (125.18, 120.0, 130.0)))
    shown = _doctor_in_a_terminal(monkeypatch, 100)  # every reference: the most rows
    lines = shown.split("fix (any one of these):")[0].splitlines()  # the fixes stay whole, to paste
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)
    for header in HEADERS:  # each whole on one line
        assert any(header in line for line in lines), header
    for number in ("64.65", "125.18", "0.52x", "30.00x", "1.50x", "3,072 x 3"):
        assert re.search(rf"(?<![\d.,]){re.escape(number)}", shown), number


def test_a_wide_terminal_keeps_the_table(monkeypatch):
    monkeypatch.setattr(D, "probe_conv", _fake_probe((6.0,) * 3, (2.0,) * 3))
    shown = _doctor_in_a_terminal(monkeypatch, 1000, "--model", "ref:qwen3-vl-4b")
    header = next(line for line in shown.splitlines() if "conv ms/sample" in line)
    assert all(h in header for h in HEADERS)


def test_the_ratio_is_of_the_times_printed_beside_it(monkeypatch):
    """Medians 64.65 ms and 125.18 ms were printed with '0.84x', the median of per-round ratios from other
    rounds (0.52, 0.84, 1.54 here): the ratio printed is 64.65 / 125.18, and a note says the rounds
    disagree."""
    conv, gemm = (64.65, 50.0, 200.0), (125.18, 59.5, 130.0)
    result = _fake_probe(conv, gemm)(QWEN, device="cpu", dtype="float32", budget_s=1.0)
    assert result.ratio == pytest.approx(64.65 / 125.18)
    assert result.ratio == pytest.approx(result.per_sample_ms("conv") / result.per_sample_ms("gemm"))
    assert result.round_ratio == pytest.approx(50.0 / 59.5)  # 0.84x, as printed before
    monkeypatch.setattr(D, "probe_conv", _fake_probe(conv, gemm))
    report = D.doctor("ref:qwen3-vl-4b", device="cpu", dtype="float32", budget_s=60)
    finding = report.findings[0]
    assert finding.probe.ratio == pytest.approx(64.65 / 125.18) and finding.forward_status == "ok"
    assert report.to_dict()["findings"][0]["ratio"] == pytest.approx(0.5165, abs=1e-4)
    assert "| 64.7 | 125.2 | 0.52x (spread 122%)" in report.to_markdown()
    assert any("rounds disagree" in n and "0.52x" in n and "0.84x" in n for n in report.notes), report.notes
    steady = _fake_probe((6.0, 6.1, 5.9), (2.0, 2.0, 2.0))
    monkeypatch.setattr(D, "probe_conv", steady)
    report = D.doctor("ref:qwen3-vl-4b", device="cpu", dtype="float32", budget_s=60)
    assert not any("rounds disagree" in n for n in report.notes)


def test_the_budget_covers_what_comes_before_the_probe(monkeypatch):
    """A slow step (building the models, under load) and the start-up are taken from the budget: the probe
    gets what they leave; when nothing is left every shape is left out, saying why."""
    given: list[float] = []

    def probe_conv(shape, *, budget_s, budget, **kw):
        given.append(budget.left_ms / 1e3)
        return _fake_probe((6.0,) * 3, (2.0,) * 3)(shape, budget_s=budget_s, **kw)

    scan = D._scan

    def slow_scan(*a, **k):
        time.sleep(0.8)
        return scan(*a, **k)

    monkeypatch.setattr(D, "probe_conv", probe_conv)
    monkeypatch.setattr(D, "_scan", slow_scan)
    t0 = time.perf_counter()
    report = D.doctor("ref:qwen3-vl-4b", device="cpu", dtype="float32", budget_s=30.0, spent_s=1.0)
    assert given and given[0] <= 30.0 - 1.0 - 0.8 - D.AFTER_PROBE_S
    assert report.findings[0].probe.left_out is None
    assert time.perf_counter() - t0 < 60  # (a bound only against a hang)

    given.clear()
    report = D.doctor("ref:qwen3-vl-4b", device="cpu", dtype="float32", budget_s=2.0, spent_s=1.5)
    assert given == [] and report.verdict == "unmeasured"
    assert "went before the probe" in report.findings[0].probe.left_out
    assert report.left_out and "--budget" in " ".join(report.notes)


def test_the_cli_counts_its_start_up(monkeypatch):
    """The command passes the seconds since its process started: here 11 of a 12 s budget."""
    seen: dict[str, float] = {}

    def doctor(model, **kw):
        seen.update(kw)
        raise typer.Exit(0)

    monkeypatch.setattr(D, "doctor", doctor)
    monkeypatch.setattr(vlfast.cli._process, "since_start", lambda: 11.0)
    app = typer.Typer()
    app.callback()(lambda: None)
    doctor_cli.register(app)
    CliRunner().invoke(app, ["doctor", "--no-probe"])
    assert seen["spent_s"] == 11.0 and seen["budget_s"] == 12.0


def test_reference_shapes_as_data_are_the_built_towers(monkeypatch):
    """The doctor reads the references' convs from their published numbers (building five families' towers
    imported their modeling code: 9 s of a 12 s budget at load 8); they are the towers' own, as built."""
    from vlfast import models
    from vlfast.diagnosis.probe import conv_shapes

    monkeypatch.delenv("VLFAST_PATCH", raising=False)
    built = [name for name, ref in models.REFERENCES.items() if ref.installed()]
    assert built
    for name in built:
        for patches in (3072, 7):
            tower = models.build_reference(name, device="meta")
            assert D.reference_conv_shapes(name, patches) == conv_shapes(
                tower, patches=patches, label=name
            ), name
    assert {ref.family for ref in models.REFERENCES.values()} <= set(D._FAMILY_CONVS)
    monkeypatch.setenv("VLFAST_PATCH", "1")  # what is built may be patched: built, not read
    assert D.reference_conv_shapes("ref:qwen3-vl-4b", 3072) is None


def test_the_fusion_offer_is_read_without_importing_transformers():
    """Whether transformers offers fusion_config is read from its source (importing it took 4-5 s of the
    budget at load 9); the answer is the module's own."""
    import subprocess
    import sys

    code = (
        "import sys; from vlfast.diagnosis import facts\n"
        "print(facts._transformers_fusion(), 'transformers' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    try:
        from transformers.fusion_mapping import _FUSION_REGISTRY
    except ImportError:
        offered = False
    else:
        offered = "patch_embeddings" in _FUSION_REGISTRY
    assert out == [str(offered), "False"]
