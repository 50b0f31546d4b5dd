"""float32 settings that round one side of the patch and not the other (TF32 on NVIDIA GPUs by default,
oneDNN's bf16 math mode on CPU): verify proves the identity in IEEE float32 and reports the settings'
difference as a note. Found on an H200 (benchmarks/gpu-runs/2026-11-27-h200): with cuDNN's default TF32,
verify failed its float32 checks on an exact patch."""

from __future__ import annotations

import contextlib

import pytest
import torch

from vlfast.diagnosis import verification
from vlfast.diagnosis.verification import verify
from vlfast.patching import precision


def _knobs() -> dict[str, str]:
    return {
        f"{b}.{o}": getattr(getattr(torch.backends, b), o).fp32_precision
        for b, o in (("cudnn", "conv"), ("cuda", "matmul"), ("mkldnn", "conv"), ("mkldnn", "matmul"))
    }


@pytest.fixture
def restore_settings():
    before = _knobs()
    yield
    for key, value in before.items():
        b, o = key.split(".")
        getattr(getattr(torch.backends, b), o).fp32_precision = value


def _bf16_math_rounds() -> bool:
    """Whether oneDNN's bf16 math mode changes a float32 conv on this CPU (it needs bf16 instructions)."""
    x, w = torch.randn(64, 3, 2, 16, 16), torch.randn(32, 3, 2, 16, 16)
    exact = torch.nn.functional.conv3d(x, w)
    torch.backends.mkldnn.conv.fp32_precision = "bf16"
    try:
        rounded = torch.nn.functional.conv3d(x, w)
    finally:
        torch.backends.mkldnn.conv.fp32_precision = "none"
    return not torch.equal(exact, rounded)


def test_settings_read_in_torchs_order(restore_settings):
    # the default: cuDNN convs in TF32, cuBLAS matmuls in IEEE, oneDNN both IEEE
    assert precision.fp32_settings("cuda")["conv"] == ("tf32", "torch.backends.cudnn.conv.fp32_precision")
    assert precision.fp32_settings("cuda")["matmul"][0] == "ieee"
    assert {k: v[0] for k, v in precision.fp32_settings("cpu").items()} == {"conv": "ieee", "matmul": "ieee"}
    torch.set_float32_matmul_precision("high")  # the call most training scripts make
    try:
        assert precision.fp32_settings("cuda")["matmul"][0] == "tf32"
    finally:
        torch.set_float32_matmul_precision("highest")
    torch.backends.mkldnn.conv.fp32_precision = "bf16"
    assert precision.fp32_settings("cpu")["conv"][0] == "bf16"
    assert precision.fp32_settings("mps")["conv"][0] == "bf16"  # the CPU family's settings


def test_ieee_fp32_sets_every_knob_and_puts_each_back_also_on_error(restore_settings):
    torch.backends.mkldnn.conv.fp32_precision = "bf16"
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    before = _knobs()
    with pytest.raises(RuntimeError, match="inside"), precision.ieee_fp32():
        assert set(_knobs().values()) == {"ieee"}
        assert {v[0] for s in ("cpu", "cuda") for v in precision.fp32_settings(s).values()} == {"ieee"}
        raise RuntimeError("inside")
    assert _knobs() == before


def test_ieee_fp32_on_a_torch_with_only_the_legacy_flags(monkeypatch, restore_settings):
    monkeypatch.setattr(precision, "_new_api", lambda: False)
    assert precision.fp32_settings("cuda")["conv"] == ("tf32", "torch.backends.cudnn.allow_tf32")
    with precision.ieee_fp32():
        assert torch.backends.cudnn.allow_tf32 is False
        assert torch.backends.cuda.matmul.allow_tf32 is False
        assert torch.get_float32_matmul_precision() == "highest"
        assert precision.fp32_settings("cuda")["conv"][0] == "ieee"
    assert torch.backends.cudnn.allow_tf32 is True  # torch's default, put back


def test_verify_proves_the_identity_under_a_rounding_conv_setting_and_reports_it(restore_settings):
    """The H200's failure, made on CPU: the stock conv in bf16 math, the GEMM in IEEE float32."""
    torch.backends.mkldnn.conv.fp32_precision = "bf16"
    report = verify("ref:qwen3-vl-4b", tiny=True, n_windows=256, dtypes=("float32",))
    assert report.passed, [(c.name, c.metrics) for c in report.failures]
    d = report.precision
    assert d is not None and (d["conv"], d["matmul"]) == ("bf16", "ieee")
    assert d["conv_setting"] == "torch.backends.mkldnn.conv.fp32_precision"
    note = next(n for n in report.notes if "settings" in n)
    assert "torch.backends.mkldnn.conv.fp32_precision = 'ieee'" in note
    assert "torch.backends.mkldnn.matmul.fp32_precision = 'bf16'" in note
    assert report.to_dict()["precision"] == d
    assert _knobs()["mkldnn.conv"] == "bf16"  # the user's setting, put back
    if _bf16_math_rounds():
        # measured: the stock conv is the one off, by bf16's rounding; the patched one is float32 round-off
        assert d["patched_vs_stock_max_rel"] > 1e-4
        assert d["stock_vs_float64_max_rel"] > 1e-4 > 1e-5 > d["patched_vs_float64_max_rel"]
        assert "closer to exact" in note


def test_without_ieee_the_same_settings_fail_verify(monkeypatch, restore_settings):
    """The reason for ieee_fp32: without it an exact patch fails (where this CPU has bf16 math)."""
    if not _bf16_math_rounds():
        pytest.skip("oneDNN's bf16 math mode changes nothing on this CPU")
    torch.backends.mkldnn.conv.fp32_precision = "bf16"
    monkeypatch.setattr(verification, "ieee_fp32", contextlib.nullcontext)
    report = verify("ref:qwen3-vl-4b", tiny=True, n_windows=256, dtypes=("float32",), backward=False)
    assert not report.passed
    assert any(c.scope == "layer" and c.dtype == "float32" for c in report.failures)


def test_no_note_when_conv_and_matmul_agree(restore_settings):
    report = verify("ref:qwen3-vl-4b", tiny=True, n_windows=64, dtypes=("float32",), backward=False)
    assert report.passed and report.precision is None
    assert not any("settings" in n for n in report.notes)


def test_doctor_facts_read_the_conv_setting_even_when_the_apis_were_mixed(restore_settings):
    """torch raises on reading the legacy cudnn.allow_tf32 once conv and rnn were set apart by the new
    settings; the facts read the conv's own setting instead of recording nothing."""
    from vlfast.diagnosis.facts import collect_facts

    torch.backends.cudnn.conv.fp32_precision = "ieee"  # rnn stays "tf32": the legacy getter now raises
    with pytest.raises(RuntimeError):
        torch.backends.cudnn.allow_tf32  # noqa: B018
    assert collect_facts("cpu", "float32").cudnn_allow_tf32 is False
    torch.backends.cudnn.conv.fp32_precision = "tf32"
    assert collect_facts("cpu", "float32").cudnn_allow_tf32 is True
