"""benchmarks/gpu.sh, the one command for a lent GPU, checked for its structure on a machine without one.

The GPU parts are decided from facts (versions, device count) in pure functions, so fabricated facts plan a
GPU run here (``--dry-run --facts-file``); the real no-CUDA path, a failing step, a hanging step and one real
step on CPU run as they would on the lent machine. Nothing here times anything.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"


def _load(name: str):
    """A benchmark script as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gpu = _load("gpu")

GPU_FACTS = {  # what collect_facts reports on a lent H100, trimmed to what the plan reads
    "schema": gpu.FACTS_SCHEMA,
    "torch": {"version": "2.14.1+cu130", "cuda": "13.0"},
    "cuda": {
        "available": True,
        "device_count": 1,
        "devices": [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "capability": "9.0", "memory_gib": 79.2}],
    },
    "cudnn": {"version": 91002, "version_text": "9.10.2"},
    "nvidia_smi": {"driver_version": "550.54.15"},
}
CPU_FACTS = {
    "schema": gpu.FACTS_SCHEMA,
    "torch": {"version": "2.14.1+cpu", "cuda": None},
    "cuda": {"available": False, "device_count": 0, "devices": []},
    "cudnn": {"version": None},
    "nvidia_smi": None,
}
FACTS_KEYS = {
    "schema", "collected_at", "host", "platform", "python", "cpu", "torch", "cuda", "cudnn", "matmul",
    "nvidia_smi", "packages", "vlfast_git", "env",
}  # fmt: skip
RUN_KEYS = {
    "schema", "mode", "command", "started_at", "finished_at", "budget_s", "exit_code", "exit_meaning", "cuda",
    "cuda_skip_reason", "device", "facts_source", "facts", "steps",
}  # fmt: skip
STEP_KEYS = {f.name for f in fields(gpu.Outcome)}
STEP_NAMES = [s.name for s in gpu.STEPS]


def _script(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCH / "gpu.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )


def _read(out: Path) -> dict:
    run = json.loads((out / "run.json").read_text())
    assert set(run) == RUN_KEYS
    assert run["schema"] == gpu.SCHEMA
    for step in run["steps"]:
        assert set(step) == STEP_KEYS, step["name"]
        assert json.loads((out / "steps" / f"{step['name']}.json").read_text()) == step
        for stream in ("stdout", "stderr"):
            if step["status"] in ("ok", "failed", "timeout"):
                assert (out / step[stream]).is_file(), f"{step['name']}: no {stream} file"
    return run


def test_without_cuda_records_the_facts_and_skips_every_cuda_step(tmp_path):
    """The real entry point, on a machine with no usable GPU (CUDA_VISIBLE_DEVICES="" hides one if present):
    versions recorded, every CUDA step skipped with one clear reason, exit 3."""
    out = tmp_path / "run"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(BENCH / "gpu.sh"), str(out)], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == gpu.EXIT_NO_CUDA, done.stderr
    assert "CUDA absent" in done.stderr

    facts = json.loads((out / "facts.json").read_text())
    assert set(facts) == FACTS_KEYS
    assert facts["schema"] == gpu.FACTS_SCHEMA
    assert facts["torch"]["version"] == torch.__version__
    assert facts["torch"]["cuda"] == torch.version.cuda
    assert facts["cuda"]["available"] is False and facts["cuda"]["device_count"] == 0
    assert {"version", "version_text", "available", "enabled"} <= set(facts["cudnn"])

    run = _read(out)
    assert (run["mode"], run["cuda"], run["exit_code"]) == ("cuda", False, gpu.EXIT_NO_CUDA)
    assert run["cuda_skip_reason"].startswith("CUDA absent: torch ")
    assert run["facts"] == facts
    assert [s["name"] for s in run["steps"]] == STEP_NAMES
    facts_step, *rest = run["steps"]
    assert (facts_step["status"], facts_step["returncode"]) == ("ok", 0)
    for step in rest:
        assert (step["status"], step["reason"], step["stdout"]) == ("skipped", "CUDA absent", None), step

    summary = (out / "summary.md").read_text()
    assert "**CUDA absent: torch" in summary
    assert "| step | status | exit | seconds | result |" in summary
    for name in STEP_NAMES:
        assert f"| {name} | " in summary
    assert "Exit status 3" in summary


def test_dry_run_on_fabricated_gpu_facts_plans_every_step(tmp_path):
    """On (fabricated) H100 facts every step is planned with its CUDA command; nothing runs."""
    facts_file = tmp_path / "facts.json"
    facts_file.write_text(json.dumps(GPU_FACTS))
    out = tmp_path / "plan"
    done = _script(str(out), "--dry-run", "--facts-file", str(facts_file))
    assert done.returncode == gpu.EXIT_OK, done.stderr

    run = _read(out)
    assert (run["mode"], run["cuda"], run["cuda_skip_reason"]) == ("dry-run", True, None)
    assert "NVIDIA H100 80GB HBM3" in run["device"] and "cuDNN 9.10.2" in run["device"]
    steps = {s["name"]: s for s in run["steps"]}
    assert list(steps) == STEP_NAMES
    assert steps["facts"]["status"] == "skipped" and "facts given" in steps["facts"]["reason"]
    for name in STEP_NAMES[1:]:
        assert steps[name]["status"] == "planned", name
        assert 0 < steps[name]["timeout_s"] <= gpu.DEFAULT_BUDGET_S
        assert not (out / "steps" / f"{name}.stdout.txt").exists()  # planned, not run

    for dt in ("fp32", "bf16", "fp16"):  # one process each: a slow bf16 path cannot cost the fp32 figures
        pe = steps[f"patch_embed_{dt}"]["argv"]
        assert pe[1].endswith("benchmarks/patch_embed.py")
        assert pe[pe.index("--devices") + 1] == "cuda" and "--channels-last" in pe
        # the fallback's 22-31 s calls on an H200: one shape timed once, not 16 calls of each shape
        assert pe[pe.index("--dtypes") + 1 :] == [dt, "--fallback-budget", "30"]
    assert steps["doctor"]["command"] == "vlfast doctor --json --device cuda"
    verify = steps["verify_tiny"]["command"]
    assert "vlfast verify --model ref:qwen3-vl-4b --tiny --device cuda --json" in verify
    models = [steps[n]["argv"][steps[n]["argv"].index("--model") + 1] for n in ("extract_tiny", "extract_2b")]
    assert models[0].endswith("inputs/tiny-qwen3-vl") and models[1] == "ref:qwen3-vl-2b"
    for name in ("extract_tiny", "extract_2b"):
        assert (
            steps[name]["command"].startswith("vlfast extract ") and "--device cuda" in steps[name]["command"]
        )

    summary = (out / "summary.md").read_text()
    assert "CUDA absent" not in summary and "| patch_embed_bf16 | planned |" in summary
    again = _script(str(out), "--dry-run", "--facts-file", str(facts_file))
    assert again.returncode == gpu.EXIT_USAGE and "already holds a run" in again.stderr


def test_the_orchestrator_never_imports_torch():
    """A CUDA initialisation that hangs may hang a step, which its timeout ends, never the run itself."""
    code = f"import sys; sys.path.insert(0, {str(BENCH)!r}); import gpu; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended


def test_a_failed_and_a_hung_step_are_recorded_and_the_run_goes_on(tmp_path):
    steps = [
        gpu.Step("fails", "exits 5", "{python} -c 'import sys; print(\"partial\"); sys.exit(5)'", cuda=False),
        gpu.Step(
            "hangs",
            "starts a child, then sleeps past its timeout",
            "{python} -c 'import subprocess, sys, time; "
            'p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]); '
            'print(p.pid, flush=True); time.sleep(60); print("woke", flush=True)\'',
            timeout_s=1,
            output="text",
        ),
        gpu.Step(
            "passes",
            "prints a verify report",
            "{python} -c \"import json; print(json.dumps({'passed': True, 'checks': []}))\"",
            kind="verify",
        ),
        gpu.Step("after_failure", "needs the failed step", "{python} -c pass", needs=("fails",)),
    ]
    run = gpu.execute(
        steps, tmp_path, mode="cpu-smoke", facts=CPU_FACTS, facts_source="test", log=lambda s: None
    )
    assert run.exit_code == gpu.EXIT_FAILED
    got = {s["name"]: s for s in _read(tmp_path)["steps"]}

    assert (got["fails"]["status"], got["fails"]["returncode"]) == ("failed", 5)
    assert "exit status 5" in got["fails"]["reason"]
    assert got["fails"]["parse_error"].startswith("stdout is not one JSON document")

    hung = got["hangs"]
    assert (hung["status"], hung["returncode"], hung["timeout_s"]) == ("timeout", None, 1)
    assert "killed after 1 s" in hung["reason"]
    printed = (tmp_path / hung["stdout"]).read_text().split()
    assert "woke" not in printed  # killed at its timeout, not waited for (no wall-clock bound: CI is loaded)
    child = int(printed[0])  # printed before the hang: kept
    deadline = time.monotonic() + 60  # the child sleeps 600 s: gone before then means it was killed
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the hung step's own child outlived its timeout"

    assert (got["passes"]["status"], got["passes"]["result"]) == ("ok", {"passed": True, "checks": []})
    assert got["passes"]["headline"] == "passed: 0/0 checks"
    assert got["after_failure"]["status"] == "skipped" and "needs fails" in got["after_failure"]["reason"]
    summary = (tmp_path / "summary.md").read_text()
    assert "| hangs | timeout |" in summary and "Exit status 1" in summary


@pytest.mark.slow  # one real vlfast command: ~6 s of CPU, mostly importing transformers
def test_cpu_smoke_runs_a_real_step_end_to_end(tmp_path):
    """One real vlfast command through the whole path: subprocess, files, JSON read back, headline."""
    facts_file = tmp_path / "facts.json"
    facts_file.write_text(json.dumps(CPU_FACTS))
    out = tmp_path / "smoke"
    done = _script(str(out), "--cpu-smoke", "--steps", "verify_tiny", "--facts-file", str(facts_file))
    assert done.returncode == gpu.EXIT_OK, done.stderr
    run = _read(out)
    assert run["mode"] == "cpu-smoke" and run["cuda"] is False
    step = run["steps"][-1]
    assert step["name"] == "verify_tiny" and step["status"] == "ok"
    assert "--device cpu" in step["command"] and "--tiny" in step["command"]
    assert step["result"]["passed"] is True and step["headline"].startswith("passed: ")
    assert "CPU smoke run" in (out / "summary.md").read_text()


def test_budget_steps_and_facts_are_pure_decisions():
    assert gpu.step_timeout(240, elapsed=0, budget_s=540) == 240
    assert gpu.step_timeout(240, elapsed=400, budget_s=540) == 540 - gpu.RESERVE_S - 400
    assert gpu.step_timeout(240, elapsed=520, budget_s=540) is None  # too little left: skipped, said so
    assert [s.name for s in gpu.select(["extract_2b"])] == ["facts", "inputs", "extract_2b"]
    with pytest.raises(ValueError, match="unknown step"):
        gpu.select(["nope"])
    assert gpu.cuda_skip_reason(GPU_FACTS) is None
    assert "a CPU-only build" in gpu.cuda_skip_reason(CPU_FACTS)
    assert gpu.cuda_skip_reason(None).startswith("CUDA unknown")
    assert (gpu.cudnn_version_text(91002), gpu.cudnn_version_text(8902), gpu.cudnn_version_text(None)) == (
        "9.10.2",
        "8.9.2",
        None,
    )
    assert (
        sum(s.timeout_s for s in gpu.STEPS if s.name in ("facts", "patch_embed_fp32")) < gpu.DEFAULT_BUDGET_S
    )


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")
def test_patch_embed_channels_last_variant_and_its_table_read_back():
    """--channels-last adds conv CL and patched CL; without it the table is as before. gpu.py reads either
    table back by its headers."""
    pe = _load("patch_embed")
    shape = pe.Shape(("tiny",), 3, 2, 4, 16)
    cpu = torch.device("cpu")
    plain = pe.bench_shape(shape, torch.float32, cpu, 8, rounds=2, fallback_rounds=1)
    cl = pe.bench_shape(shape, torch.float32, cpu, 8, rounds=2, fallback_rounds=1, channels_last=True)
    assert set(plain) == {"conv", "patched", "linear", "fallback"}
    assert set(cl) == set(plain) | {"conv_cl", "patched_cl"} and len(cl["conv_cl"]) == 2

    def table(times):
        return pe.render(
            [{"shape": shape, "dtype": "fp32", "device": "cpu", "times": times}], "hw", 8, 2, 1, "cmd"
        )

    old_header = (
        "| references | C x T x P x P -> D | device | dtype | conv | fallback | patched | F.linear "
        "| conv / patched | fallback / patched | patched / linear |"
    )
    assert old_header in table(plain).splitlines() and "CL" not in table(plain)
    (parsed,) = gpu.parse_markdown_tables(table(cl))
    assert parsed["columns"][-2:] == ["conv CL / patched", "patched CL / linear"]
    assert len(parsed["columns"]) == 15
    row = parsed["rows"][0]
    assert row["dtype"] == "fp32" and all(isinstance(row[c], float) for c in parsed["columns"][4:])
    line = gpu._headline_patch_embed({"tables": [parsed]})
    assert line.startswith("fp32: conv/patched ") and "conv CL/patched" in line


_ISSUE_40_SCRIPTS = ("tower_components", "clips_per_hour", "patch_accuracy")


def _argparse_flags(main, capsys) -> set[str]:
    with pytest.raises(SystemExit):
        main(["--help"])
    return set(re.findall(r"--[a-z][a-z0-9-]*", capsys.readouterr().out))


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")
def test_every_planned_flag_exists(capsys):
    """The plan names flags of commands other people edit: each must still be accepted, or a lent GPU's half
    hour ends in usage errors."""
    from typer.main import get_command

    from vlfast.cli.main import app

    cli = get_command(app)
    known = {
        "patch_embed.py": _argparse_flags(_load("patch_embed").main, capsys),
        "gpu.py": _argparse_flags(gpu.main, capsys),
        "embed_throughput.py": _argparse_flags(_load("embed_throughput").main, capsys),
        **{f"{n}.py": _argparse_flags(_load_bench(n).main, capsys) for n in _ISSUE_40_SCRIPTS},
    }
    for name, command in cli.commands.items():
        known[name] = {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
    for mode in ("cuda", "cpu-smoke"):
        for step in gpu.STEPS:
            if mode == "cpu-smoke" and step.smoke is None:
                continue
            argv = gpu.expand(step, mode=mode, work=Path("/work"))
            program = argv[3] if argv[1:3] == ["-m", "vlfast.cli.main"] else Path(argv[1]).name
            flags = {w for w in argv if w.startswith("--")}
            assert flags <= known[program], f"{step.name} ({mode}): {sorted(flags - known[program])} unknown"


def test_patch_embed_fallback_budget_times_a_slow_call_once_and_then_stops():
    """On an H200 one fallback call took 22-31 s (benchmarks/gpu-runs/2026-11-27-h200): a call over
    ``once_ms`` is its own only timing (its warm-up call), and a spent budget leaves the rest 'not timed'."""
    pe = _load("patch_embed")
    shape = pe.Shape(("tiny",), 3, 2, 4, 16)
    cpu = torch.device("cpu")
    budget = pe.FallbackBudget(seconds=1e-9, once_ms=0.0)  # every call is "slow"; one call spends it all
    first = pe.bench_shape(shape, torch.float32, cpu, 8, rounds=3, fallback_rounds=3, fallback_budget=budget)
    later = pe.bench_shape(shape, torch.float32, cpu, 8, rounds=3, fallback_rounds=3, fallback_budget=budget)
    assert len(first["fallback"]) == 1 and budget.once == 1 and len(first["conv"]) == 3
    assert later["fallback"] == [] and len(later["conv"]) == 3
    unlimited = pe.bench_shape(shape, torch.float32, cpu, 8, rounds=3, fallback_rounds=2)
    assert len(unlimited["fallback"]) == 2  # the default: fallback_rounds, the warm-up untimed
    rows = [
        {"shape": shape, "dtype": "fp32", "device": "cpu", "times": first, "fallback_once": True},
        {"shape": shape, "dtype": "fp32", "device": "cpu", "times": later, "fallback_once": False},
    ]
    text = pe.render(rows, "hw", 8, 3, 3, "cmd")
    cells = [line.split(" | ") for line in text.splitlines() if line.startswith("| tiny")]
    assert cells[0][5].endswith("\\*") and cells[1][5] == "not timed" and cells[1][9] == "-"
    assert "fallback\\*: one call" in text


def test_doctor_step_takes_every_verdict_doctor_can_exit_with_as_a_finding():
    """On the H200 doctor found an ordinary gain (exit 4) and the step was marked failed: each verdict's exit
    status (vlfast.diagnosis.doctor.EXIT_CODES) is a finding, not a failure of the step."""
    from vlfast.diagnosis.doctor import EXIT_CODES

    (doctor,) = [s for s in gpu.STEPS if s.name == "doctor"]
    assert set(doctor.ok_codes) == {0, *EXIT_CODES.values()}


def test_patch_call_step_reads_the_ratio_to_f_linear_per_n():
    """Issue 37's GPU row: the per-call table's patched / F.linear, read back by its headers."""
    step = next(s for s in gpu.STEPS if s.name == "patch_call_bf16")
    table = (
        "| N | D | nn.Linear | patched | F.linear | conv | patched - nn.Linear | patched / nn.Linear "
        "| patched / F.linear | spread (patched, max/min) |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
        "| 4 | 8 | 5.5 | 8.2 | 3.6 | 37.6 | +2.7 | 1.503 | 2.278 | 1.02x |\n"
        "| 3072 | 1024 | 150.0 | 151.0 | 149.0 | 900.0 | +1.0 | 1.007 | 1.013 | 1.01x |\n"
    )
    result, error = gpu.read_output(step, table)
    assert error is None
    assert gpu.headline(step, result) == "patched/F.linear N=4: 2.28, N=3072: 1.01"


def test_issue_40_steps_lead_the_plan_and_fit_the_budget():
    """The component table and clips/hour are the most wanted figures: first after the facts, on the report's
    sizes, and within the default budget even if each runs to its timeout."""
    names = [s.name for s in gpu.STEPS]
    assert names[:4] == ["facts", "tower_components", "clips_per_hour", "verify_tiny"]
    assert names[-1] == "patch_accuracy"  # its slow-path calls cost seconds each on a GPU: last
    steps = {s.name: s for s in gpu.STEPS}
    tc = gpu.expand(steps["tower_components"], mode="cuda", work=Path("/w"))
    assert tc[1].endswith("benchmarks/tower_components.py") and tc[tc.index("--device") + 1] == "cuda"
    assert "--tiny" not in tc  # defaults: ref:qwen3-vl-4b, bf16, 8 frames of 512x384, one slow call
    cph = gpu.expand(steps["clips_per_hour"], mode="cuda", work=Path("/w"))
    assert cph[cph.index("--model") + 1] == "reduced" and cph[cph.index("--clip-size") + 1] == "512x384"
    worst = sum(s.timeout_s for s in gpu.STEPS[:3])  # each running to its timeout, they still all run
    assert worst <= gpu.DEFAULT_BUDGET_S - gpu.RESERVE_S, worst
    for name in ("tower_components", "clips_per_hour", "patch_accuracy"):  # each has a CPU smoke
        assert steps[name].smoke, name


def _load_bench(name: str):
    sys.path.insert(0, str(BENCH))  # the benchmarks import their sibling patch_embed
    try:
        return _load(name)
    finally:
        sys.path.remove(str(BENCH))


def _aten_conv3d_backend(dtype: torch.dtype) -> str:
    """The backend ATen selects on this CPU for a patch embedding's Conv3d (stride = kernel) in ``dtype``,
    asked directly (torch._C._select_conv_backend), not through the benchmark's code."""
    x, w = torch.zeros(1, 3, 2, 16, 16, dtype=dtype), torch.zeros(8, 3, 2, 16, 16, dtype=dtype)
    backend = torch._C._select_conv_backend(x, w, None, [2, 16, 16], [0] * 3, [1] * 3, False, [0] * 3, 1)
    return str(backend).rsplit(".", 1)[-1]


@pytest.mark.cpu_kernels
@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")
def test_tower_components_times_three_variants_and_gpu_reads_its_table(tmp_path):
    """A tiny tower through benchmarks/tower_components.py in this process (the profiler's hooks, the slow
    path switched on for the Conv3d alone), then its JSON through gpu.py's reader, headline and summary."""
    tc = _load_bench("tower_components")
    result = tc.run(tiny=True, width=32, height=32, frames=2, rounds=1, warmup=0, slow_calls=1)
    # The stock path is what ATen picks for a bf16 Conv3d on this CPU: oneDNN where it has bf16 kernels
    # (AVX-512), else Slow3d (an AVX2-only CPU, or ONEDNN_MAX_CPU_ISA=AVX2: issue 46); the slow path is Slow3d.
    stock = _aten_conv3d_backend(torch.bfloat16)
    assert stock == ("Mkldnn" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "Slow3d")
    assert result["conv_backend"] == {"stock": stock, "slow": "Slow3d"}
    rows = {r["component"]: r for r in result["rows"]}
    assert {"patch_embed", "blocks", "merger", "other (inline)", "forward (total)"} <= set(rows)
    for variant in tc.VARIANTS:
        assert rows["forward (total)"][f"{variant}_ms"] > 0 and rows["patch_embed"][f"{variant}_ms"] > 0
    assert rows["blocks"]["stock_over_patched"] is None and rows["patch_embed"]["stock_over_patched"] > 0
    result["markdown"] = tc.render(result)
    assert "| **forward (total)** |" in result["markdown"] and "no conv" in result["markdown"]

    step = next(s for s in gpu.STEPS if s.name == "tower_components")
    parsed, error = gpu.read_output(step, json.dumps(result))
    assert error is None
    line = gpu.headline(step, parsed)
    assert (
        line.startswith(f"{result['patches']} patches, bfloat16: patch_embed stock ")
        and "slow forward" in line
    )
    run = gpu.Run(out=tmp_path, mode="cpu-smoke", budget_s=60, started_at="now")
    run.outcomes = [gpu.Outcome("tower_components", "", [], "", status="ok", result=parsed, headline=line)]
    assert "## tower_components" in gpu.render_summary(run)


def test_clips_per_hour_summary_and_headline_read_back():
    """clips_per_hour's summary from fabricated rounds (no process started): the projection swaps the loop's
    own patch-embed time for the projected calls; gpu.py's headline reads it."""
    cph = _load_bench("clips_per_hour")
    proj = {"timed_at_patches": 64, "slow_calls_ms": [900.0], "stock_ms": 2.0, "slow_s": 30.0, "stock_s": 0.1}
    loop = {
        "clips": 16, "processor": "steps", "seconds": 20.0, "load_s": 4.0, "loop_s": 16.0, "wait_s": 6.0,
        "processor_s": 4.0, "forward_s": 5.0, "patch_embed_s": 0.5, "save_s": 0.1, "peak_rss_gib": 1.0,
        "tree_peak_rss_gib": 2.0, "patch_embed_calls": [[128, 250.0], [128, 250.0]],
    }  # fmt: skip
    ours = {"clips": 16, "seconds": 10.0, "load_s": 1.0, "fingerprint_s": 0.2, "loop_s": 8.0, "forward_s": 5.0,
            "peak_rss_gib": 1.5, "tree_peak_rss_gib": 2.5}  # fmt: skip
    rounds = {"loop": [{**loop, "projection": proj}, {**loop, "seconds": 22.0}], "vlfast": [ours, ours]}
    args = argparse.Namespace(model="tiny", llm_layers=2, device="cpu", dtype="bfloat16", clip_size="64x48",
                              batch=8, loop_workers=2, rounds=2)  # fmt: skip
    s = cph.summarise(rounds, args, 0.9999, 1.0, 0.5)
    by = {r["side"]: r for r in s["rows"]}
    assert by["vlfast"]["clips_per_hour"] == pytest.approx(3600 * 16 / 10)
    assert s["ratio_median"] == pytest.approx(2.1) and s["ratio_range"] == [2.0, 2.2]
    assert by["loop, slow path (projected)"]["seconds"] == pytest.approx(21.0 - 0.5 + 30.0)
    s["markdown"] = cph.render(s)
    assert "| loop, slow path (projected) |" in s["markdown"] and "min cosine 0.999900" in s["markdown"]
    step = next(x for x in gpu.STEPS if x.name == "clips_per_hour")
    line = gpu.headline(step, gpu.read_output(step, json.dumps(s))[0])
    assert (
        by["loop"]["loop_clips_per_hour"] == pytest.approx(3600 * 16 / 16)
        and by["loop"]["vlfast_loop_speedup"] == 2
    )
    assert line == (
        "16 clips (tiny), clips/h in the loop: vlfast 7,200, loop 3,600 (2.00x), slow path (projected) 1,266 "
        "(5.7x); end to end 2.10x (2.00-2.20)"
    ), line
