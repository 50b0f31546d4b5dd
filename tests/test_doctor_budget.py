"""Issue 20: the doctor's budget holds on any CPU, its dtype follows the CPU, its headline is its table.

Timings never gate tests: the budget is checked on a fake clock that advances by fabricated call
costs (linear in the windows a call covers), the dtype choice on fabricated CPU facts.
"""

from __future__ import annotations

import re

import pytest
import torch

import vlfast.diagnosis.doctor as D
import vlfast.diagnosis.probe as P
from vlfast.diagnosis.facts import Facts, choose_dtype, half_native
from vlfast.diagnosis.probe import MIN_ROUNDS, Budget, ConvShape, ProbeResult, choose_windows
from vlfast.diagnosis.timing import Timing

QWEN = ConvShape("Conv3d", 3, 1024, (2, 16, 16), True, 3072, ("qwen3-vl-4b:patch_embed.proj",))


class FakeClock:
    """A clock that moves only when a fabricated call 'runs': ``ms_per_window[side] * windows``."""

    def __init__(self, ms_per_window: dict[str, float]) -> None:
        self.now = 0.0
        self.ms_per_window = ms_per_window
        self.calls: list[tuple[str, int]] = []

    def __call__(self) -> float:
        return self.now

    def time_once(self, fn, dev) -> float:
        side = {"gemm": "gemm", "conv": "conv", "gemm_bwd": "gemm_backward", "conv_bwd": "conv_backward"}
        name = side[fn.__name__]
        ms = self.ms_per_window[name] * fn.windows
        self.calls.append((name, fn.windows))
        self.now += ms / 1e3
        return ms


# The machine, roughly: bf16 emulated, the conv backward ~30x the GEMM's.
SLOW_CPU = {"gemm": 0.03, "conv": 0.12, "gemm_backward": 0.06, "conv_backward": 1.8}


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock(SLOW_CPU)
    monkeypatch.setattr(P, "_now", fake)
    monkeypatch.setattr(P, "_time_once", fake.time_once)
    return fake


# --------------------------------------------------------------------------------- choose_windows


def test_choose_windows_takes_all_that_fit():
    assert choose_windows(0.001, 3072, 1000.0, calibrated=128) == 3072


def test_choose_windows_takes_fewer_to_fit_a_warm_up_and_min_rounds():
    n = choose_windows(1.0, 3072, 2000.0, calibrated=128)  # 1 ms per window per round
    assert n == 2000 // (MIN_ROUNDS + 1)


def test_choose_windows_falls_back_to_the_calibrated_size_then_gives_up():
    # 3 rounds on 128 windows (the calibration was the warm-up) fit; 4 on more would not.
    assert choose_windows(1.0, 3072, 3 * 128 + 1, calibrated=128) == 128
    assert choose_windows(1.0, 3072, 3 * 128 - 1, calibrated=128) is None


# ---------------------------------------------------------------------------- the budget holds


@pytest.mark.parametrize("budget_s", [2.0, 4.0, 8.0, 30.0])
def test_one_shape_keeps_its_budget_and_times_both_passes_alike(clock, budget_s):
    r = P.probe_conv(QWEN, dtype=torch.float32, budget_s=budget_s)
    assert r.error is None and r.left_out is None
    assert clock.now <= 1.2 * budget_s, clock.now
    # Forward and backward on the same windows, each side at least MIN_ROUNDS times, in the same rounds.
    assert r.windows_timed == r.backward_windows and r.windows_timed <= QWEN.windows
    assert min(t.n for t in (r.conv, r.gemm, r.conv_backward, r.gemm_backward)) >= MIN_ROUNDS
    assert r.conv.n == r.conv_backward.n
    # Per sample = per window x the sample's windows: the scaling is exact on a linear machine.
    assert r.per_sample_ms("conv") == pytest.approx(SLOW_CPU["conv"] * QWEN.windows)
    assert r.backward_saving_ms == pytest.approx(
        (SLOW_CPU["conv_backward"] - SLOW_CPU["gemm_backward"]) * QWEN.windows
    )
    assert r.ratio == pytest.approx(4.0) and r.backward_ratio == pytest.approx(30.0)


def test_a_backward_that_cannot_fit_is_left_out_and_said_so(clock):
    # 3 rounds of everything on 128 windows: ~0.77 s; of the forward alone: ~0.06 s.
    r = P.probe_conv(QWEN, dtype=torch.float32, budget_s=0.5)
    assert r.conv_backward is None and r.reliable
    assert r.left_out.startswith("the backward"), r.left_out
    assert clock.now <= 1.2 * 0.5 + 0.25  # + the calibration calls, paid before anything is known


def test_a_shape_that_cannot_fit_is_left_out_not_timed_once(clock):
    r = P.probe_conv(QWEN, dtype=torch.float32, budget_s=0.01, backward=False)
    assert r.conv is None and r.saving_ms is None
    assert r.left_out.startswith("the whole shape"), r.left_out


def test_the_shared_budget_is_never_overrun_by_a_late_shape(clock):
    budget = Budget(2.0)
    for _ in range(5):
        P.probe_conv(QWEN, dtype=torch.float32, budget_s=2.0, budget=budget)
    assert clock.now <= 1.2 * 2.0 + 0.3  # one calibration (~0.27 s) may start just before the end


@pytest.mark.parametrize("budget_s", [2.0, 8.0, 20.0])
def test_doctor_with_no_arguments_keeps_its_budget_and_lists_what_it_left_out(clock, budget_s):
    report = D.doctor(None, device="cpu", dtype="float32", budget_s=budget_s)
    assert report.probe_s <= 1.2 * budget_s, report.probe_s
    timed = [f for f in report.findings if f.probe.conv is not None]
    assert timed, "nothing timed"
    for f in report.findings:
        assert f.probe.conv is not None or f.probe.left_out, f.probe.shape.describe()
    if budget_s == 2.0:  # 5 shapes of the slow machine cannot all fit in 2 s
        assert report.left_out and any("--budget" in n for n in report.notes), report.notes
        assert "Left out for lack of budget" in report.to_markdown()
    # The geometry most references share is probed first.
    first = max(report.findings, key=lambda f: len(f.probe.shape.names))
    assert first.probe.conv is not None


# ------------------------------------------------------------------------ the headline is the table


def _result(shape, conv, gemm, conv_b, gemm_b, windows):
    return ProbeResult(
        shape,
        "cpu",
        "float32",
        conv=Timing(conv),
        gemm=Timing(gemm),
        conv_backward=Timing(conv_b),
        gemm_backward=Timing(gemm_b),
        windows_timed=windows,
    )


def _cells(markdown: str) -> list[list[str]]:
    rows = [line for line in markdown.splitlines() if line.startswith("| Conv")]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows]


def test_the_headline_equals_what_the_table_shows(monkeypatch):
    # Fabricated rounds on 768 of 3,072 windows: every per-sample figure is x4.
    fake = {
        1536: ((40.0, 44.0, 42.0), (10.0, 11.0, 10.5), (400.0, 420.0, 410.0), (12.0, 12.5, 12.2)),
        4096: ((30.0, 31.0, 29.0), (9.0, 9.5, 9.2), (300.0, 310.0, 305.0), (9.0, 9.1, 9.3)),
    }

    def probe(shape, **kw):
        return _result(shape, *fake.get(shape.out_channels, fake[1536]), windows=shape.windows // 4)

    monkeypatch.setattr(D, "probe_conv", probe)
    report = D.doctor("ref:glm-4.1v-9b", device="cpu", dtype="float32")
    cells = _cells(report.to_markdown())
    fwd = sum(float(c[3].replace(",", "")) - float(c[4].replace(",", "")) for c in cells)
    bwd = sum(float(c[6].replace(",", "")) - float(c[7].replace(",", "")) for c in cells)
    m = re.search(
        r"saves ~([\d,.]+) ms per sample forward \+ ([\d,.]+) ms backward \(([\d,.]+) h", report.summary
    )
    assert m, report.summary
    said_fwd, said_bwd, hours = (float(g.replace(",", "")) for g in m.groups())
    assert said_fwd == pytest.approx(fwd, abs=0.15) and said_bwd == pytest.approx(bwd, abs=0.15)
    assert hours == pytest.approx((fwd + bwd) / 36, abs=0.1)  # 100,000 samples: ms / 36 = hours
    assert [c[2] for c in cells] == ["768 x 3", "192 x 3"]


def test_a_single_shot_figure_is_never_scaled_into_the_headline(monkeypatch):
    def probe(shape, **kw):  # one round only: the old doctor's "first call is the measurement"
        return _result(shape, (400.0,), (10.0,), (9000.0,), (20.0,), windows=256)

    monkeypatch.setattr(D, "probe_conv", probe)
    report = D.doctor("ref:qwen3-vl-4b", device="cpu", dtype="float32")
    assert report.savings_ms_per_sample == {} and report.backward_savings_ms_per_sample == {}
    assert "h per 100,000" not in report.summary and "no saving is estimated" in report.summary
    assert "(unreliable)" in report.to_markdown()
    assert any("unreliable" in n for n in report.notes)


# ----------------------------------------------------------------------------- dtype by capability


def cpu(**kw) -> Facts:
    """The issue's machine: AVX2 only, no native bf16, oneDNN without bf16 kernels."""
    base = dict(
        device="cpu",
        dtype="float32",
        cpu_capability="AVX2",
        cpu_flags=("avx2",),
        onednn_bf16=False,
        onednn_fp16=False,
    )
    return Facts(**{**base, **kw})


def test_avx2_only_probes_float32_and_says_why():
    c = choose_dtype(cpu(), None)
    assert (c.dtype, c.warning) == ("float32", None)
    assert "avx512_bf16" in c.reason and "emulated" in c.reason


def test_avx2_only_asked_for_bf16_warns_it_is_emulated():
    c = choose_dtype(cpu(), "bfloat16")
    assert c.dtype == "bfloat16" and c.native is False
    assert "several times slower" in c.warning


@pytest.mark.parametrize("flag", ["avx512_bf16", "amx_bf16"])
def test_native_bf16_cpus_probe_bf16(flag):
    facts = cpu(cpu_capability="AVX512", cpu_flags=("avx2", "avx512f", flag), onednn_bf16=True)
    assert choose_dtype(facts, None).dtype == "bfloat16"
    assert choose_dtype(facts, "bfloat16").warning is None


def test_avx512_without_bf16_is_emulated():
    # Skylake/Cascade Lake: AVX-512 (oneDNN reports bf16 support, by conversion) but no avx512_bf16.
    facts = cpu(cpu_capability="AVX512", cpu_flags=("avx2", "avx512f", "avx512bw"), onednn_bf16=True)
    assert choose_dtype(facts, None).dtype == "float32"


def test_the_users_onednn_limit_makes_bf16_emulated():
    native = dict(cpu_capability="AVX512", cpu_flags=("avx512_bf16",), onednn_bf16=True)
    assert choose_dtype(cpu(**native, onednn_max_cpu_isa_env="AVX2"), None).dtype == "float32"
    assert choose_dtype(cpu(**native, onednn_max_cpu_isa_env="avx512_core_amx"), None).dtype == "bfloat16"
    # ATen's limit alone leaves oneDNN's GEMM and conv native, and says so.
    native_aten = half_native(cpu(**native, aten_cpu_capability_env="avx2"), "bfloat16")
    assert native_aten[0] is True and "ATEN_CPU_CAPABILITY=avx2" in native_aten[1]


def test_unknown_flags_fall_back_to_the_capability_string():
    assert half_native(cpu(cpu_flags=None, onednn_bf16=None), "bfloat16")[0] is False
    assert half_native(cpu(cpu_flags=None, onednn_bf16=None, cpu_capability="AVX512"), "bfloat16")[0] is None


def test_fp16_needs_avx512_fp16_or_amx_fp16():
    spr = cpu(cpu_capability="AVX512", cpu_flags=("avx512_bf16", "amx_bf16", "amx_fp16"), onednn_fp16=True)
    assert half_native(spr, "float16")[0] is True
    assert choose_dtype(cpu(), "float16").warning


def test_gpu_dtype_is_left_alone():
    assert choose_dtype(Facts(device="cuda:0", dtype="bfloat16"), None).dtype == "bfloat16"


def test_doctor_on_this_cpu_reports_its_dtype_choice_and_instruction_set():
    report = D.doctor("ref:qwen3-vl-4b", device="cpu", probe=False)
    f = report.facts
    assert f.cpu_capability and report.dtype_reason
    assert f.dtype == choose_dtype(f, None).dtype
    md = report.to_markdown()
    assert "CPU capability" in md and "CPU bf16/fp16 features" in md and report.dtype_reason in md


def test_a_shape_the_ones_before_say_cannot_fit_is_left_out_without_calibrating(clock):
    budget = Budget(3.0)
    first = P.probe_conv(QWEN, dtype=torch.float32, budget_s=2.6, budget=budget)
    assert first.reliable and first.backward_reliable
    calls, now = len(clock.calls), clock.now
    wide = ConvShape("Conv2d", 1536, 4096, (2, 2), True, 768, ("glm-4.1v-9b:downsample",))
    second = P.probe_conv(wide, dtype=torch.float32, budget_s=budget.left_ms / 1e3, budget=budget)
    assert second.left_out and "at the speed of the shapes probed before it" in second.left_out, (
        second.left_out
    )
    if second.conv is None:  # the whole shape: not one call was spent on it
        assert (len(clock.calls), clock.now) == (calls, now)
    assert clock.now <= 1.2 * 3.0
