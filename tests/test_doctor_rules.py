"""The slow-path rules on fabricated facts: no GPU needed, every machine is a dataclass."""

from __future__ import annotations

import pytest

from vlfast.diagnosis.facts import Facts, cudnn_version_str, dtype_name, version_tuple
from vlfast.diagnosis.rules import RULES, ConvGeometry, evaluate, rule_fires

QWEN = ConvGeometry((2, 16, 16), "patch_embed.proj")  # Conv3d, 5-D weight
POINTWISE = ConvGeometry((1, 1, 1), "pointwise")
CONV2D = ConvGeometry((2, 2), "downsample")


def gpu(**kw) -> Facts:
    """An H100 on the torch 2.9.0 + cuDNN 9.10.2 wheel, diagnosing bf16, unless overridden."""
    base = dict(
        device="cuda:0",
        dtype="bfloat16",
        torch_version="2.9.0+cu128",
        torch_build="cuda",
        torch_cuda="12.8",
        cudnn_runtime=91002,
        cudnn_enabled=True,
        gpu_capability=(9, 0),
    )
    return Facts(**{**base, **kw})


def fired(facts: Facts, conv: ConvGeometry = QWEN) -> set[str]:
    return {h.id for h in evaluate(facts, [conv])}


def slow(facts: Facts, conv: ConvGeometry = QWEN) -> set[str]:
    """The pathological rules that fire: a machine that is "fine" may still have an ordinary gain."""
    return {h.id for h in evaluate(facts, [conv]) if h.pathological}


def test_torch_29_cudnn_910_bf16_is_slow():
    assert "cudnn-skip-conv3d" in fired(gpu())


def test_fp16_is_slow_too():
    assert "cudnn-skip-conv3d" in fired(gpu(dtype="float16"))


@pytest.mark.parametrize("cudnn", [91500, 91900, 90701])
def test_cudnn_outside_9_8_to_9_15_is_fine(cudnn):
    assert not slow(gpu(cudnn_runtime=cudnn))


def test_fp32_is_fine():
    assert not slow(gpu(dtype="float32"))


def test_torch_28_is_fine():
    assert not slow(gpu(torch_version="2.8.0+cu128"))


def test_torch_210_with_its_default_cudnn_910_is_slow():
    # The default torch 2.10 CUDA 12 wheel still ships cuDNN 9.10.
    assert "cudnn-skip-conv3d" in fired(gpu(torch_version="2.10.0+cu128", cudnn_runtime=91002))


def test_torch_211_default_wheel_is_fine():
    assert not slow(gpu(torch_version="2.11.0+cu128", cudnn_runtime=91900))


def test_pointwise_and_2d_convs_keep_cudnn():
    assert "cudnn-skip-conv3d" not in fired(gpu(), POINTWISE)
    assert "cudnn-skip-conv3d" not in fired(gpu(), CONV2D)


def test_unknown_cudnn_version_fires_nothing():
    assert not slow(gpu(cudnn_runtime=None))


def test_blackwell_cudnn_910_bf16():
    hits = slow(gpu(gpu_capability=(12, 0), torch_version="2.8.0+cu128"))
    assert hits == {"blackwell-cudnn910-bf16"}
    assert "blackwell-cudnn910-bf16" not in fired(gpu(gpu_capability=(12, 0), dtype="float16"))
    assert "blackwell-cudnn910-bf16" not in fired(gpu(gpu_capability=(12, 0), cudnn_runtime=91500))


def test_cudnn_disabled():
    assert fired(gpu(cudnn_enabled=False, dtype="float32")) == {"cudnn-disabled"}


def test_rocm_is_not_cuda():
    rocm = gpu(torch_build="rocm", torch_cuda=None, cudnn_runtime=None)
    assert fired(rocm) == {"rocm-miopen-conv3d"}
    assert not fired(rocm, CONV2D)


def test_mps_conv3d():
    mps = Facts(device="mps", dtype="bfloat16", torch_version="2.9.0", torch_build="cpu")
    assert fired(mps) == {"mps-conv3d"}
    assert not fired(mps, CONV2D)


def test_cpu_bf16_with_onednn_off_is_slow():
    cpu = Facts(
        device="cpu", dtype="bfloat16", torch_version="2.13.0", onednn_available=True, onednn_enabled=False
    )
    assert "cpu-no-onednn" in fired(cpu)
    assert "cpu-no-onednn" in fired(cpu, CONV2D)


def test_cpu_bf16_without_onednn_in_the_build_is_slow():
    assert "cpu-no-onednn" in fired(Facts(device="cpu", dtype="bfloat16", onednn_available=False))


def test_cpu_fp32_or_onednn_on_has_no_onednn_rule():
    assert "cpu-no-onednn" not in fired(Facts(device="cpu", dtype="float32", onednn_enabled=False))
    assert "cpu-no-onednn" not in fired(Facts(device="cpu", dtype="bfloat16", onednn_enabled=True))


def test_cpu_default_path_rule_names_onednn_convs_only():
    assert "cpu-onednn-window-conv" in fired(Facts(device="cpu", dtype="float32", onednn_enabled=True))
    assert "cpu-onednn-window-conv" not in fired(Facts(device="cpu", dtype="float32", onednn_enabled=False))
    assert "cpu-onednn-window-conv" not in fired(gpu())


def test_gpu_default_path_rule_names_cudnn_convs_only():
    """What the H200 showed: cuDNN 9.19 in use, 2.9-3.5x, explained instead of 'please report it'."""
    h200 = gpu(torch_version="2.11.0+cu130", cudnn_runtime=91900, cudnn_compile=91900)
    assert "cudnn-window-conv" in fired(h200) and "cudnn-skip-conv3d" not in fired(h200)
    assert "cudnn-window-conv" in fired(gpu(torch_version="2.11.0+cu130", dtype="float32"))
    assert "cudnn-window-conv" not in fired(gpu())  # skipped by torch: the fallback rule instead
    assert "cudnn-window-conv" not in fired(gpu(cudnn_enabled=False))
    assert "cudnn-window-conv" not in fired(Facts(device="cpu", dtype="float32"))


def test_every_rule_has_a_source_and_fix_and_unique_id():
    ids = [r.id for r in RULES]
    assert len(ids) == len(set(ids))
    for r in RULES:
        assert r.source and r.explanation and r.env_fix and r.title


def test_rule_fires_by_id_and_unknown_id():
    assert rule_fires("cudnn-skip-conv3d", gpu(), QWEN)
    with pytest.raises(ValueError, match="unknown rule"):
        rule_fires("nope", gpu(), QWEN)


def test_evaluate_lists_the_convs_each_rule_concerns():
    (hit,) = [h for h in evaluate(gpu(), [QWEN, POINTWISE, CONV2D]) if h.pathological]
    assert hit.id == "cudnn-skip-conv3d" and hit.convs == ["patch_embed.proj"]
    assert set(hit.to_dict()) == {
        "id",
        "title",
        "source",
        "explanation",
        "env_fix",
        "convs",
        "pathological",
        "phases",
    }


def test_facts_validation_and_round_trip():
    with pytest.raises(ValueError):
        Facts(dtype="int8")
    with pytest.raises(TypeError):
        Facts(device=None)
    f = gpu()
    d = f.to_dict()
    assert d["cudnn_runtime_str"] == "9.10.2" and d["gpu_capability"] == [9, 0]
    assert Facts.from_dict(d) == f


def test_version_helpers():
    assert version_tuple("2.10.0+cu128") == (2, 10, 0)
    assert version_tuple("garbage") is None and version_tuple(None) is None
    assert cudnn_version_str(91900) == "9.19.0" and cudnn_version_str(8902) == "8.9.2"
    assert cudnn_version_str(None) is None
    assert dtype_name("bf16") == "bfloat16" and dtype_name("torch.float16") == "float16"
    with pytest.raises(ValueError):
        dtype_name("int8")


def test_docs_list_every_rule_and_every_json_key():
    # Meta-test: the documented rules and schema stay in step with the code.
    from pathlib import Path

    from vlfast.diagnosis.doctor import DoctorReport

    docs = (Path(__file__).resolve().parents[1] / "docs" / "doctor.md").read_text()
    for r in RULES:
        assert f"`{r.id}`" in docs, r.id
    report = DoctorReport("t", gpu(), [], [], "ok", "", [], {}, 1)
    for key in report.to_dict():
        assert key in docs, key


def test_public_names():
    import vlfast

    assert vlfast.doctor.__module__ == "vlfast.diagnosis.doctor"
    assert vlfast.profile.__module__ == "vlfast.diagnosis.profiler"


# ------------------------------------------------------------------------------------ issue 20 rules


def test_torch_290_decides_from_the_compile_time_cudnn_and_says_an_upgrade_cannot_help():
    # 2.9.0 compiled against 9.10, a 9.19 package loaded: the guard still reads 9.10 (PR #167111).
    facts = gpu(torch_version="2.9.0+cu128", cudnn_compile=91002, cudnn_runtime=91900)
    assert "cudnn-skip-conv3d" in fired(facts)
    (hit,) = [h for h in evaluate(facts, [QWEN]) if h.id == "cudnn-skip-conv3d"]
    assert "2.9.1" in hit.env_fix and "cannot help" in hit.env_fix
    # 2.9.0 compiled against a fixed cuDNN: the guard does not skip, whatever loads.
    assert "cudnn-skip-conv3d" not in fired(
        gpu(torch_version="2.9.0", cudnn_compile=91500, cudnn_runtime=91002)
    )


def test_torch_291_reads_the_runtime_cudnn():
    facts = gpu(torch_version="2.9.1+cu128", cudnn_compile=91002, cudnn_runtime=91900)
    assert "cudnn-skip-conv3d" not in fired(facts)
    (hit,) = [h for h in evaluate(gpu(torch_version="2.9.1"), [QWEN]) if h.id == "cudnn-skip-conv3d"]
    assert "cannot help" not in hit.env_fix and "nvidia-cudnn-cu12>=9.15" in hit.env_fix


def test_cu126_wording_is_current():
    (hit,) = [h for h in evaluate(gpu(torch_version="2.14.0+cu126"), [QWEN]) if h.id == "cudnn-skip-conv3d"]
    assert "cu126 wheels of torch 2.9-2.14" in hit.env_fix and "#190385" in hit.env_fix


def rocm(**kw) -> Facts:
    base = dict(device="cuda:0", dtype="bfloat16", torch_version="2.10.0+rocm7.0", torch_build="rocm")
    return Facts(**{**base, **kw})


@pytest.mark.parametrize(
    ("hip", "miopen", "fires"),
    [
        ("7.0.51831", None, True),
        ("10.0.1", None, True),
        ("10.1.0", None, False),  # ROCm 10.1 runs stride == kernel as one GEMM (rocm-libraries #10912)
        ("11.0", None, False),
        (None, None, True),  # unknown: most ROCm in use is older
        ("7.0", "3.6.0", True),
        ("7.0", "3.6.1", False),  # MIOpen decides when known
        ("10.1", "3.5.0", True),
    ],
)
def test_rocm_rule_fires_only_below_rocm_101_miopen_361(hip, miopen, fires):
    assert ("rocm-miopen-conv3d" in fired(rocm(torch_hip=hip, miopen_version=miopen))) is fires


def test_mixed_cudnn_libraries_are_reported():
    wheel = "/venv/lib/python3.12/site-packages/nvidia/cudnn/lib"
    same = {"libcudnn.so.9": f"{wheel}/libcudnn.so.9", "libcudnn_cnn.so.9": f"{wheel}/libcudnn_cnn.so.9"}
    mixed = {
        **same,
        "libcudnn_engines_precompiled.so.9": "/usr/lib/x86_64-linux-gnu/libcudnn_engines_precompiled.so.9",
    }
    facts = gpu(torch_version="2.11.0+cu130", cudnn_runtime=92000, dtype="float32")
    assert "cudnn-mixed-libraries" not in fired(gpu(cudnn_libraries=same))
    assert "cudnn-mixed-libraries" not in fired(facts)  # not collected: nothing to say
    facts.cudnn_libraries = mixed
    assert "cudnn-mixed-libraries" in fired(facts)
    assert "cudnn-mixed-libraries" not in fired(Facts(device="cpu", cudnn_libraries=mixed))
    from vlfast.diagnosis.doctor import libraries_cell

    assert "/usr/lib/x86_64-linux-gnu" in libraries_cell(facts) and wheel in libraries_cell(facts)
    assert libraries_cell(gpu(cudnn_libraries=same)) == f"2 from {wheel}"
