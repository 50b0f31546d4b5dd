"""The doctor's verdicts, headline and fixes on fabricated measurements: each claim it prints is checked.

- slow path against ordinary gain, each with its own exit status, per pass (forward / backward);
- every number of the headline belongs to the one model it names;
- every fix listed fixes every losing conv: each is applied as printed, and the model probed again;
- the rules issue 12 added (runtime cuDNN, channels_last_3d, Windows, cuDNN 9.20 backward, CPU backward).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

import vlfast
import vlfast.diagnosis.doctor as D
from test_doctor_cli import _fake_probe
from vlfast.diagnosis.facts import Facts
from vlfast.diagnosis.probe import ProbeResult
from vlfast.diagnosis.rules import RULES, ConvGeometry, evaluate

FAKE_PROBE = '''
def fake_probe(shape, *, device, dtype, budget_s, **kw):
    """GLM's downsample 4x forward, every Conv3d 3x; the GEMM 2 ms (GLM's patch embedding 100 ms)."""
    from vlfast.diagnosis.probe import ProbeResult
    from vlfast.diagnosis.timing import Timing

    gemm = 100.0 if shape.out_channels == 1536 else 2.0
    ratio = 4.0 if shape.kind == "Conv2d" else 3.0
    return ProbeResult(shape, str(device), str(dtype), conv=Timing((gemm * ratio,) * 3), gemm=Timing((gemm,) * 3))
'''
exec(FAKE_PROBE)  # the same fake in this process and in the subprocesses below  # noqa: S102


_probe = _fake_probe  # the CLI tests' fabricated probe: ratio forward, backward, channels-last


@pytest.fixture(autouse=True)
def _no_time_before_the_probe(monkeypatch):
    """The budget counts building the models (seconds under load: the first imports transformers' model
    code); a fabricated probe is never short of it here."""
    monkeypatch.setattr(D, "probe_clock", lambda: 0.0)


# ------------------------------------------------------------------- slow path against ordinary gain


@pytest.mark.parametrize(
    ("forward", "backward", "workload", "verdict", "code"),
    [
        (3.5, None, "training", "gain", 4),  # the CPU forward: a gain, not a slow path
        (3.5, 1.5, "training", "gain", 4),
        (3.5, 35.0, "training", "slow-path", 1),  # the CPU bf16 backward
        (3.5, 35.0, "inference", "gain", 4),  # inference never counts the backward
        (12.0, 1.0, "training", "slow-path", 1),
        (1.2, 1.1, "training", "ok", 0),
    ],
)
def test_slow_path_and_gain_have_their_own_exit_status(
    monkeypatch, forward, backward, workload, verdict, code
):
    monkeypatch.setattr(D, "probe_conv", _probe(forward, backward))
    report = D.doctor("ref:qwen3-vl-4b", device="cpu", dtype="float32", workload=workload)
    assert (report.verdict, report.exit_code) == (verdict, code)
    guard = D.doctor("ref:qwen3-vl-4b", device="cpu", dtype="float32", workload=workload, fail_on="slow-path")
    assert guard.exit_code == (1 if verdict == "slow-path" else 0)


def test_each_pass_has_its_verdict(monkeypatch):
    monkeypatch.setattr(D, "probe_conv", _probe(3.5, 35.0))
    data = D.doctor("ref:qwen3-vl-4b", device="cpu", dtype="bfloat16").to_dict()
    assert (data["forward_verdict"], data["backward_verdict"], data["verdict"]) == (
        "gain",
        "slow-path",
        "slow-path",
    )
    (finding,) = data["findings"]
    assert (finding["forward_status"], finding["backward_status"]) == ("gain", "slow-path")
    assert finding["backward"]["ratio"] == pytest.approx(35.0)
    assert data["backward_savings_ms_per_sample"] == {"qwen3-vl-4b": pytest.approx(136.0)}
    inference = D.doctor("ref:qwen3-vl-4b", device="cpu", dtype="bfloat16", workload="inference").to_dict()
    assert inference["backward_verdict"] is None and inference["findings"][0]["backward_status"] is None


def test_a_pathological_rule_makes_a_measured_gain_a_slow_path(monkeypatch):
    import torch

    monkeypatch.setattr(D, "probe_conv", _probe(3.0))
    with torch.backends.mkldnn.flags(enabled=False):  # cpu-no-onednn: ATen's reference kernels
        report = D.doctor("ref:qwen3-vl-4b", device="cpu", dtype="bfloat16", workload="inference")
    assert "cpu-no-onednn" in report.findings[0].rules
    assert report.verdict == "slow-path" and report.exit_code == 1
    # with oneDNN on the same 3x is the ordinary CPU gain
    report = D.doctor("ref:qwen3-vl-4b", device="cpu", dtype="bfloat16", workload="inference")
    assert report.verdict == "gain" and report.findings[0].rules == ["cpu-onednn-window-conv"]


def test_a_channels_last_escape_is_reported(monkeypatch):
    monkeypatch.setattr(D, "probe_conv", _probe(20.0, channels_last=1.1))
    report = D.doctor("ref:qwen3-vl-4b", device="cpu", dtype="float32", workload="inference")
    assert report.findings[0].channels_last_escapes is True
    assert any("channels_last_3d" in n and "1.10x" in n for n in report.notes), report.notes
    monkeypatch.setattr(D, "probe_conv", _probe(20.0, channels_last=15.0))
    report = D.doctor("ref:qwen3-vl-4b", device="cpu", dtype="float32", workload="inference")
    assert report.findings[0].channels_last_escapes is False
    assert not any("channels_last_3d" in n for n in report.notes)


def test_the_real_probe_times_the_backward_and_the_channels_last_candidate():
    import torch

    from vlfast.diagnosis.probe import ConvShape, probe_conv

    shape = ConvShape("Conv3d", 3, 16, (2, 4, 4), True, 32, ("m:p",))
    r = probe_conv(shape, device="cpu", dtype=torch.float32, budget_s=0.4, channels_last=True)
    assert r.error is None and r.backward_ratio > 0 and r.channels_last_ratio > 0
    r = probe_conv(
        shape, device="cpu", dtype=torch.float32, budget_s=0.4, backward=False, channels_last=False
    )
    assert r.conv_backward is None and r.conv_channels_last is None and r.ratio > 0


# --------------------------------------------------------------------------- the headline's numbers


def test_the_headline_numbers_belong_to_the_model_they_name(monkeypatch):
    monkeypatch.setattr(D, "probe_conv", fake_probe)  # noqa: F821 (defined by exec above)
    report = D.doctor(None, device="cpu", dtype="float32", workload="inference")
    # GLM loses most: 200 ms in its patch embedding + 4x in its downsample; the Qwen models 4 ms.
    glm = report.savings_ms_per_sample["glm-4.1v-9b"]
    assert glm > max(v for k, v in report.savings_ms_per_sample.items() if k != "glm-4.1v-9b")
    s = report.summary
    assert "glm-4.1v-9b:downsample is 4.0x" in s, s  # GLM's own worst conv, with its own ratio
    assert f"patching glm-4.1v-9b saves ~{glm:,.1f} ms" in s, s
    assert "qwen" not in s, s


def test_the_headline_model_does_not_change_with_the_noise(monkeypatch):
    """Issue 39: the headline named qwen3-vl-4b in one run and qwen2-vl-7b in the next. The model is chosen
    from the shapes (the most multiply-adds per sample among its losing convs), so timings cannot flip it."""
    from vlfast.diagnosis.timing import Timing

    def probe(favoured: int):
        def probe_conv(shape, *, device, dtype, budget_s, **kw):  # 3x forward; one shape's GEMM 50x slower
            gemm = 100.0 if shape.out_channels == favoured else 2.0
            conv, gemm = Timing((3 * gemm,) * 3), Timing((gemm,) * 3)
            return ProbeResult(shape, str(device), str(dtype), conv=conv, gemm=gemm)

        return probe_conv

    saves_most, named = set(), set()
    for favoured in (1280, 1024, 1152):  # Qwen2-VL's, Qwen3-VL-2B/4B's, Qwen3-VL-8B's patch embedding
        monkeypatch.setattr(D, "probe_conv", probe(favoured))
        report = D.doctor(None, device="cpu", dtype="float32", workload="inference")
        savings = report.savings_ms_per_sample
        saves_most.add(max(savings, key=savings.get))
        named.add(report.summary.split(":")[1].strip())
    assert saves_most == {"qwen2-vl-7b", "qwen3-vl-2b", "qwen3-vl-8b"}  # the timings disagree every run
    # GLM's downsample (1536 -> 4096 over 2x2 windows) is the most work of any model's losing convs
    assert named == {"glm-4.1v-9b"}, named


# ------------------------------------------------------------------------ every fix fixes everything


def _apply_and_reprobe(fix: D.Fix, tmp_path) -> str:
    """Apply ``fix`` exactly as printed to the tiny GLM-4.1V tower, probe again; the new verdict."""
    script = FAKE_PROBE + textwrap.dedent(
        """
        import vlfast.diagnosis.doctor as D
        from vlfast.models import build_reference

        D.probe_conv = fake_probe
        model = build_reference("glm-4.1v-9b", tiny=True)
        {apply}
        print("VERDICT", D.doctor(model, device="cpu", dtype="float32", workload="inference").verdict)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "VLFAST_PATCH"}
    if fix.kind == "code":  # run the line as the user would paste it; "Model" names the model's class
        apply = "" if "patch_transformers" in fix.text else fix.text
        prelude = fix.text if "patch_transformers" in fix.text else ""
        path = tmp_path / "fix.py"
        path.write_text(prelude + "\n" + script.replace("{apply}", apply))
        cmd = [sys.executable, str(path)]
    elif fix.kind == "env":  # "VLFAST_PATCH=all python train.py ..."
        assignment, _ = fix.text.split(" python ", 1)
        key, value = assignment.split("=", 1)
        env[key] = value
        path = tmp_path / "train.py"
        path.write_text(script.replace("{apply}", ""))
        cmd = [sys.executable, str(path)]
    elif fix.kind == "cli":  # "python -m vlfast.run [--all-convs] train.py ...   |   torchrun ..."
        first = fix.text.split("|")[0].split()
        assert first[:3] == ["python", "-m", "vlfast.run"] and first[-2:] == ["train.py", "..."], fix.text
        path = tmp_path / "train.py"
        path.write_text(script.replace("{apply}", ""))
        cmd = [sys.executable, *first[1:-2], str(path)]
    else:
        raise AssertionError(f"no way to apply a {fix.kind} fix here: {fix.text}")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return re.search(r"VERDICT (\S+)", out.stdout).group(1)


def test_every_listed_fix_fixes_every_losing_conv(monkeypatch, tmp_path):
    monkeypatch.setattr(D, "probe_conv", fake_probe)  # noqa: F821
    report = D.doctor("ref:glm-4.1v-9b", device="cpu", dtype="float32", workload="inference")
    assert report.verdict == "gain"
    kinds = {f.probe.shape.kind for f in report.findings if f.status == "gain"}
    assert kinds == {"Conv3d", "Conv2d"}  # the downsample loses time too
    texts = [f.text for f in report.fixes]
    assert any("patch_transformers(all_convs=True)" in t for t in texts), texts
    assert any(t.startswith("VLFAST_PATCH=all ") for t in texts), texts
    assert any("vlfast.run --all-convs" in t for t in texts), texts
    assert not any("fusion_config" in t for t in texts), texts  # it replaces the patch embedding only
    from concurrent.futures import ThreadPoolExecutor

    fixes = [fix for fix in report.fixes if fix.kind != "environment"]  # no environment rule covers a CPU
    folders = [tmp_path / f"fix{k}" for k in range(len(fixes))]
    for folder in folders:
        folder.mkdir()
    with ThreadPoolExecutor(2) as pool:  # each fix in a process and a folder of its own: one per core
        verdicts = list(pool.map(_apply_and_reprobe, fixes, folders))
    for fix, verdict in zip(fixes, verdicts):
        assert verdict == "patched", fix.text


def test_the_conv3d_only_switch_would_not_have_fixed_it(tmp_path):
    """The check above has teeth: the default switch leaves GLM's Conv2d downsample slow."""
    fix = D.Fix("env", "VLFAST_PATCH=1 python train.py ...")
    assert _apply_and_reprobe(fix, tmp_path) == "gain"


def test_a_qwen_model_keeps_the_plain_fixes(monkeypatch):
    monkeypatch.setattr(D, "probe_conv", _probe(3.0))
    texts = [f.text for f in D.doctor("ref:qwen3-vl-4b", device="cpu", dtype="float32").fixes]
    assert "import vlfast; vlfast.patch_transformers()" in texts
    assert any(t.startswith("VLFAST_PATCH=1 ") for t in texts)


def test_transformers_own_fusion_fix_is_applied_as_printed(monkeypatch, tiny_qwen3_vl):
    """Listed for a model whose only losing conv is its patch embedding; loading with it leaves none.

    Applied in a fresh process: fusion_config registers process-wide patches and checkpoint conversions
    for the model type, which would change how every later test loads a Qwen3-VL checkpoint.
    """
    monkeypatch.setattr(D, "probe_conv", _probe(3.0))
    report = D.doctor(str(tiny_qwen3_vl), device="cpu", dtype="float32", workload="inference")
    if not report.facts.transformers_fusion:
        pytest.skip("this transformers has no fusion_config")
    (fusion,) = [f for f in report.fixes if "fusion_config" in f.text]
    text = fusion.text.replace("Model", "Qwen3VLForConditionalGeneration").replace(
        "path", repr(str(tiny_qwen3_vl))
    )
    code = (
        "import vlfast.diagnosis.doctor as D\n"
        "from transformers import Qwen3VLForConditionalGeneration\n"
        f"model = {text}\n"
        "print('VERDICT', D.doctor(model, device='cpu', dtype='float32', probe=False).verdict)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "VERDICT no-convs" in out.stdout


def test_an_environment_fix_for_some_convs_only_is_a_note():
    from vlfast.diagnosis.probe import ConvShape

    facts = Facts(device="cpu", dtype="float32")
    shapes = [
        ConvShape("Conv3d", 3, 8, (2, 2, 2), True, 4, ("m:a",)),
        ConvShape("Conv2d", 8, 8, (2, 2), True, 1, ("m:b",)),
    ]
    findings = [D.Finding(ProbeResult(s, "cpu", "float32"), [], "gain", "gain") for s in shapes]
    hit = evaluate(facts, [ConvGeometry((2, 2, 2), shapes[0].describe())])
    hit = [type(hit[0])("r", "t", "s", "e", "upgrade X", [shapes[0].describe()])] if hit else []
    fixes, notes = D._fixes("gain", findings, hit, facts)
    assert not any(f.kind == "environment" for f in fixes)
    assert any("upgrade X" in n and shapes[1].describe() in n for n in notes), notes


# --------------------------------------------------------------------------------------- new rules


def _gpu(**kw) -> Facts:
    base = dict(
        device="cuda:0",
        dtype="bfloat16",
        torch_version="2.10.0+cu128",
        torch_build="cuda",
        torch_cuda="12.8",
        cudnn_runtime=91002,
        cudnn_enabled=True,
        gpu_capability=(9, 0),
        platform="Linux-6.8-x86_64",
    )
    return Facts(**{**base, **kw})


QWEN = ConvGeometry((2, 16, 16), "patch_embed.proj")


def _fired(facts: Facts, conv: ConvGeometry = QWEN) -> dict:
    return {h.id: h for h in evaluate(facts, [conv])}


def test_a_channels_last_3d_input_escapes_the_cudnn_guard():
    assert "cudnn-skip-conv3d" in _fired(_gpu())
    assert "cudnn-skip-conv3d" not in _fired(_gpu(), ConvGeometry((2, 16, 16), "p", channels_last=True))


@pytest.mark.parametrize(
    ("torch_version", "cudnn", "fires"),
    [
        ("2.14.0+cu126", 91002, True),  # the cu126 builds still ship 9.10.2: the runtime decides
        ("2.9.0+cu128", 91500, False),  # a runtime cuDNN >= 9.15 fixes it even on 2.9
        ("2.10.0+cu128", 91900, False),
    ],
)
def test_the_runtime_cudnn_decides_not_the_torch_version(torch_version, cudnn, fires):
    assert ("cudnn-skip-conv3d" in _fired(_gpu(torch_version=torch_version, cudnn_runtime=cudnn))) is fires


def test_windows_gets_a_fix_that_works_there():
    linux = _fired(_gpu())["cudnn-skip-conv3d"].env_fix
    windows = _fired(_gpu(platform="Windows-10-10.0.19045-SP0"))["cudnn-skip-conv3d"].env_fix
    assert "nvidia-cudnn-cu12>=9.15" in linux
    assert "torch\\lib" in windows and "does not help" in windows and "cu130" in windows


def test_cudnn_920_bf16_backward():
    hit = _fired(_gpu(cudnn_runtime=92001))
    assert "cudnn-920-bf16-backward" in hit and hit["cudnn-920-bf16-backward"].phases == ("backward",)
    for facts in (
        _gpu(cudnn_runtime=92001, dtype="float16"),
        _gpu(cudnn_runtime=92100),
        _gpu(cudnn_runtime=91900),
    ):
        assert "cudnn-920-bf16-backward" not in _fired(facts)
    assert "cudnn-920-bf16-backward" not in _fired(
        _gpu(cudnn_runtime=92001), ConvGeometry((2, 2), "downsample")
    )


def test_cpu_conv3d_backward():
    cpu = Facts(device="cpu", dtype="float32")
    assert "cpu-conv3d-backward" in _fired(cpu)
    assert "cpu-conv3d-backward" not in _fired(cpu, ConvGeometry((2, 2), "downsample"))
    assert "cpu-conv3d-backward" not in _fired(_gpu())


def test_only_the_window_rules_are_ordinary_gains():
    assert {r.id for r in RULES if not r.pathological} == {"cpu-onednn-window-conv", "cudnn-window-conv"}


def test_the_json_is_strict_and_carries_schema_2(monkeypatch):
    monkeypatch.setattr(D, "probe_conv", _probe(3.5, 35.0))
    text = json.dumps(D.doctor("ref:qwen3-vl-4b", device="cpu", dtype="float32").to_dict())

    def refuse(name):
        raise ValueError(name)

    data = json.loads(text, parse_constant=refuse)
    assert data["schema"] == "vlfast.doctor/2" and data["exit_codes"] == {
        "slow-path": 1,
        "gain": 4,
        "fail_on": "any",
    }
    assert vlfast.doctor is D.doctor
