"""The live probe and the doctor on CPU: small shapes, tiny budgets, no timing thresholds."""

from __future__ import annotations

import math

import pytest
import torch

import vlfast
from vlfast.diagnosis.doctor import Finding, doctor, verdict_for
from vlfast.diagnosis.probe import (
    DEFAULT_PATCHES,
    ConvShape,
    ProbeResult,
    conv_shapes,
    merge_shapes,
    probe_conv,
)
from vlfast.diagnosis.timing import Timing
from vlfast.models import build_reference

SMALL = ConvShape("Conv3d", 3, 32, (2, 4, 4), True, 64, ("toy:proj",))


def test_default_patch_count_is_one_8_frame_512x384_clip():
    assert DEFAULT_PATCHES == 3072


def test_conv_shapes_on_meta_references():
    (qwen,) = conv_shapes(build_reference("qwen3-vl-4b", device="meta"), label="qwen3-vl-4b")
    assert qwen.kind == "Conv3d" and qwen.kernel_size == (2, 16, 16)
    assert (qwen.in_channels, qwen.out_channels, qwen.windows) == (3, 1024, DEFAULT_PATCHES)
    assert qwen.names == ("qwen3-vl-4b:patch_embed.proj",) and not qwen.patched
    assert qwen.gemm_shape == (3072, 3 * 2 * 16 * 16, 1024)
    glm = conv_shapes(build_reference("glm-4.1v-9b", device="meta"), patches=400)
    assert [s.kind for s in glm] == ["Conv3d", "Conv2d"]
    assert glm[1].windows == 100  # the downsample sees patches grouped 2x2


def test_merge_shapes_dedupes_geometry_and_keeps_names():
    a = conv_shapes(build_reference("qwen3-vl-2b", device="meta"), label="a")
    b = conv_shapes(build_reference("qwen3-vl-4b", device="meta"), label="b")
    (m,) = merge_shapes(a + b)
    assert m.names == ("a:patch_embed.proj", "b:patch_embed.proj")


def test_conv_shapes_sees_the_patch():
    tower = build_reference("qwen3-vl-4b", tiny=True)
    assert not conv_shapes(tower)[0].patched
    vlfast.patch(tower)
    assert conv_shapes(tower)[0].patched


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_probe_times_both_and_they_agree(dtype, tol):
    r = probe_conv(SMALL, dtype=dtype, budget_s=0.3)
    assert r.error is None, r.error
    assert r.conv.n >= 1 and r.gemm.n >= 1
    assert math.isfinite(r.ratio) and r.ratio > 0
    assert r.saving_ms >= 0
    assert r.max_abs_diff is not None and r.max_abs_diff < tol, r.max_abs_diff
    assert r.onednn_enabled is True
    d = r.to_dict()
    assert d["ratio"] == r.ratio and d["shape"]["gemm_mkn"] == [64, 96, 32]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_probe_with_onednn_off_records_it():
    with torch.backends.mkldnn.flags(enabled=False):
        r = probe_conv(SMALL, dtype=torch.bfloat16, budget_s=0.3)
    assert r.error is None and r.onednn_enabled is False
    assert r.ratio is not None and r.ratio > 0


def test_probe_fails_soft(monkeypatch):
    def oom(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch.nn.functional, "linear", oom)
    r = probe_conv(SMALL, budget_s=0.2)
    assert r.error.startswith("RuntimeError: CUDA out of memory") and r.ratio is None


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_doctor_on_cpu_with_onednn_off_explains_with_the_rule():
    tower = build_reference("qwen3-vl-4b", tiny=True)
    with torch.backends.mkldnn.flags(enabled=False):
        report = doctor(tower, device="cpu", dtype="bf16", patches=64, budget_s=10.0)
    assert report.facts.onednn_enabled is False and report.facts.dtype == "bfloat16"
    assert "cpu-no-onednn" in {r.id for r in report.rules}
    (finding,) = report.findings
    assert "cpu-no-onednn" in finding.rules
    assert finding.forward_status in ("slow-path", "ok") and finding.probe.ratio > 0
    # oneDNN off: a rule that names a fallback kernel, so a measured loss is a slow path, never a gain
    assert finding.status != "gain"
    assert report.exit_code == (1 if report.verdict == "slow-path" else 0)


def test_doctor_facts_are_collected_soft():
    report = doctor("ref:qwen3-vl-4b", device="cpu", dtype="float32", probe=False)
    f = report.facts
    assert f.torch_version == torch.__version__ and f.python and f.vlfast_version == vlfast.__version__
    assert f.device == "cpu" and f.model_patched is False
    assert report.verdict == "unmeasured" and report.exit_code == 0
    assert report.findings[0].status == "skipped"


def _finding(ratio: float | None, patched: bool = False, error: str | None = None) -> Finding:
    shape = ConvShape("Conv3d", 3, 8, (2, 2, 2), True, 4, ("m:p",), patched=patched)
    gemm = Timing((1.0,))
    conv = Timing((ratio,)) if ratio is not None else None
    probe = ProbeResult(shape, "cpu", "bfloat16", conv=conv, gemm=gemm if conv else None, error=error)
    status = "error" if error else ("slow-path" if ratio >= 10 else "gain" if ratio >= 2 else "ok")
    return Finding(probe, [], status, status)


def test_verdict_from_measurements():
    assert verdict_for([]) == "no-convs"
    assert verdict_for([_finding(1.2)]) == "ok"
    assert verdict_for([_finding(1.2), _finding(5.0)]) == "gain"
    assert verdict_for([_finding(5.0), _finding(12.0)]) == "slow-path"
    assert verdict_for([_finding(5.0, patched=True)]) == "patched"
    assert verdict_for([_finding(None, error="RuntimeError: x")]) == "unmeasured"


def test_doctor_validates_arguments():
    with pytest.raises(ValueError):
        doctor(patches=0)
    with pytest.raises(TypeError):
        doctor(model=42, probe=False)
    with pytest.raises(ValueError, match="unsupported dtype"):
        doctor("ref:qwen3-vl-4b", dtype="int8", probe=False)


def test_the_selected_backend_on_this_cpu():
    """The evidence beside the rule: ATen's own choice for the probed conv, on the real CPU."""
    from vlfast.diagnosis.doctor import disagreements
    from vlfast.diagnosis.probe import selected_backend

    x, w = torch.randn(16, 3, 2, 4, 4), torch.randn(8, 3, 2, 4, 4)
    assert selected_backend(x, w, None, (2, 4, 4)) == "Mkldnn"  # oneDNN's direct conv: its rule agrees
    with torch.backends.mkldnn.flags(enabled=False):
        off = selected_backend(x.bfloat16(), w.bfloat16(), None, (2, 4, 4))
        assert off == "Slow3d"  # the reference kernel cpu-no-onednn names
        report = doctor("ref:qwen3-vl-4b", device="cpu", dtype="bfloat16", budget_s=5.0, workload="inference")
    f = report.findings[0]
    assert f.probe.backend == "Slow3d" and "cpu-no-onednn" in f.rules and not f.disagreements
    assert "Slow3d" in report.to_markdown()
    # A fired rule whose path the selected backend contradicts is shown, not hidden.
    hit = next(h for h in report.rules if h.id == "cpu-no-onednn")
    (line,) = disagreements([hit], "Mkldnn")
    assert "cpu-no-onednn" in line and "Mkldnn" in line
    assert disagreements([hit], None) == []


def test_a_torch_without_select_conv_backend_reports_none(monkeypatch):
    from vlfast.diagnosis.probe import selected_backend

    monkeypatch.delattr(torch._C, "_select_conv_backend")
    assert selected_backend(torch.randn(2, 3, 2, 4, 4), torch.randn(8, 3, 2, 4, 4), None, (2, 4, 4)) is None


def test_cuda_kernel_names_are_filtered_from_a_trace(monkeypatch):
    """The CUDA evidence, on a fabricated trace: only the names that tell the path are kept."""
    import types

    import torch.profiler

    import vlfast.diagnosis.probe as probe

    names = [
        "void at::native::vol2col_kernel<c10::BFloat16>(...)",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n",
        "Memcpy DtoD (Device -> Device)",
        "cudnn::fusion::ConvolutionForward",
        "vol2col_kernel",
    ]

    class FakeTrace:
        def __init__(self, **kw):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def key_averages(self):
            return [types.SimpleNamespace(key=n) for n in names]

    monkeypatch.setattr(torch.profiler, "profile", FakeTrace)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    kernels = probe._cuda_kernels(lambda: None)
    assert kernels == [names[0], names[1], names[3], names[4]]
