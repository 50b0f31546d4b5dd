"""One command for a lent GPU: every CUDA figure vlfast states, measured in one run of under ten minutes.

A GPU is lent to this project now and then, for half an hour, ten minutes a command. This runs, in order,
each step in its own process with its own timeout (a hung step is killed, recorded, and the run goes on):

1. ``facts``: device, driver, torch, CUDA and runtime cuDNN versions, TF32 flags, ``nvidia-smi``.
2. ``tower_components`` (issue 40): ``benchmarks/tower_components.py``, the ``ref:qwen3-vl-4b`` tower in bf16
   on one 8-frame 512x384 clip, by component (patch_embed, position embedding, rotary, blocks, mergers,
   total): the stock conv, the slow path (cuDNN off for the Conv3d, one call) and patched.
3. ``clips_per_hour`` (issue 40): ``benchmarks/clips_per_hour.py``, ``vlfast extract`` against the report's
   own loop (DataLoader, processor, hand-made Linear patch embed, ``torch.save`` per batch) and that loop on
   the slow path (projected from a timed call), 256 8-frame clips through Qwen3-VL-4B's tower and a 4-layer
   LLM: clips per hour, where the time goes, peak memory.
4. ``verify_tiny``: ``vlfast verify --tiny`` on CUDA, fp32 + bf16 + fp16, gradients and the error of each
   path against float64 included.
5. ``patch_embed_{bf16,fp32,fp16}``: ``benchmarks/patch_embed.py`` on CUDA, one process per dtype, every
   reference shape: the stock conv (cuDNN on), the fallback (cuDNN off), channels_last_3d, the patched
   conv, raw ``F.linear``; ``patch_call_bf16``: the patched call per call against ``F.linear``.
6. ``doctor``: ``vlfast doctor --json`` on CUDA.
7. ``inputs``, ``extract_tiny``, ``extract_2b``: short ``vlfast extract`` throughput runs on synthetic
   images and videos, with the tiny Qwen3-VL checkpoint and the full-width ``ref:qwen3-vl-2b`` tower;
   ``embed_throughput``: embeddings/s against the Qwen3-VL-Embedding reference's loop.
8. ``verify_full``: ``vlfast verify`` on the full-size ``ref:qwen3-vl-4b`` tower; ``patch_accuracy``: each
   path's error against float64 with the slow path among them (its calls cost seconds each on a GPU).

The default budget (540 s) fits a lent machine's 15 minutes with its start: the steps run in this order
until it is spent, and the rest are skipped, each saying so. Steps 2-4 should take about 4 minutes on an H200
(an estimate from the runs of 2026-11-27; they have not run on a GPU yet).

Everything lands in OUT: ``facts.json``, ``run.json`` (facts and every step), ``steps/NAME.json`` beside
``steps/NAME.stdout.txt`` and ``.stderr.txt``, and ``summary.md``; all rewritten after each step, so a run
cut short still leaves what it measured. Extraction outputs go to a scratch folder, deleted at the end.

Without CUDA the facts are recorded and every CUDA step is skipped with the reason (exit 3).
``--cpu-smoke`` runs the steps on CPU at tiny sizes (about 2 min on 2 cores; the slowest are left out) to
check the plumbing; ``--dry-run`` writes the plan and runs nothing but the facts probe. This process never
imports torch: a CUDA initialisation that hangs can only hang a step, which its timeout ends.

    bash benchmarks/gpu.sh                    # -> ./gpu-run-YYYYmmdd-HHMMSS/
    bash benchmarks/gpu.sh "$OUT/gpu-run"     # on the lent machine
    python benchmarks/gpu.py OUT --cpu-smoke --steps patch_embed_fp32,verify_tiny
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the steps time on CPU too: idle threads must sleep

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SCHEMA = "vlfast.gpu-run/1"
FACTS_SCHEMA = "vlfast.gpu-facts/1"
DEFAULT_BUDGET_S = 540.0  # the lent machine stops a command at 600 s; leave room to start and copy back
RESERVE_S = 10.0  # kept back from the steps to write the results
MIN_STEP_S = 15.0  # a step offered less time than this is skipped, and says so

# Exit codes, as vlfast's own commands use them.
EXIT_OK = 0  # every step that was to run passed (with --dry-run: the plan is written)
EXIT_FAILED = 1  # a step failed or timed out; the others ran and everything is written
EXIT_USAGE = 2  # bad arguments, or OUT already holds a run
EXIT_NO_CUDA = 3  # no CUDA device: facts recorded, CUDA steps skipped
EXIT_INTERRUPTED = 130
EXIT_MEANING = {
    EXIT_OK: "every step that was to run passed",
    EXIT_FAILED: "a step failed or timed out (see its stderr); the others ran",
    EXIT_NO_CUDA: "no CUDA device: facts recorded, CUDA steps skipped",
    EXIT_INTERRUPTED: "interrupted: the steps so far are recorded",
}


@dataclass(frozen=True)
class Step:
    """One command of the run, as shell words. Placeholders that :func:`expand` fills in: ``{python}``,
    ``{vlfast}`` (``python -m vlfast.cli.main``), ``{self}`` (this script), ``{bench}`` (this folder),
    ``{work}`` (the scratch folder), ``{device}`` (cuda, or cpu with --cpu-smoke)."""

    name: str
    about: str
    command: str
    full: str = ""  # appended on the GPU
    smoke: str | None = ""  # appended with --cpu-smoke; None: not run there
    timeout_s: float = 120.0
    cuda: bool = True  # skipped when CUDA is absent
    ok_codes: tuple[int, ...] = (0,)
    output: str = "json"  # how stdout is read: json, markdown (tables) or text
    kind: str = ""  # which headline reads the result (default: the name)
    needs: tuple[str, ...] = ()  # steps that must have passed first

    def __post_init__(self) -> None:
        if self.output not in ("json", "markdown", "text"):
            raise ValueError(f"step {self.name}: output must be json, markdown or text, got {self.output!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"step {self.name}: timeout_s must be positive, got {self.timeout_s}")


# Most wanted first: when the budget runs out, what is lost is the least needed. Issue 40's steps lead; the
# patch-embed, doctor and extract figures after them were measured on two H200 runs already.
STEPS: tuple[Step, ...] = (
    Step(
        "facts",
        "device, driver, torch, CUDA and runtime cuDNN versions; nvidia-smi",
        "{python} {self} --facts",
        timeout_s=60,
        cuda=False,
    ),
    # Issue 40: where one clip's tower forward goes, stock / slow path / patched, and clips per hour against
    # the report's own loop. The slow path costs 22-41 s a call on an H200: each step times it once.
    Step(
        "tower_components",
        "ref:qwen3-vl-4b tower, bf16, one 8-frame 512x384 clip (3,072 patches), by component: stock conv, "
        "slow path (cuDNN off for the Conv3d, one call), patched",
        "{python} {bench}/tower_components.py --device {device} --json",
        smoke="--tiny --frame-size 64x64 --rounds 1",
        timeout_s=150,
        kind="components",
    ),
    Step(
        "clips_per_hour",
        "clips/hour end to end: vlfast extract against the report's DataLoader loop (hand-made Linear patch "
        "embed, torch.save per batch) and that loop on the slow path (projected), 256 8-frame 512x384 clips, "
        "Qwen3-VL-4B's tower with a 4-layer LLM, bf16",
        "{python} {bench}/clips_per_hour.py --device {device} --json",
        full="--model reduced --llm-layers 4 --clips 256 --clip-size 512x384 --loop-workers 8 --rounds 2",
        smoke="--model tiny --clips 2 --batch 2 --clip-size 64x48 --loop-workers 0 --rounds 1 --slow-patches 64",
        timeout_s=300,
        kind="clips",
    ),
    Step(
        "verify_tiny",
        "vlfast verify, tiny ref:qwen3-vl-4b tower: fp32, bf16, fp16, gradients",
        "{vlfast} verify --model ref:qwen3-vl-4b --tiny --device {device} --json",
        full="--dtype bfloat16 --dtype float16",
        smoke="--no-backward --windows 64",
        timeout_s=120,
        kind="verify",
    ),
    # One process per dtype: a slow path in bf16 (the cuDNN 9.8-9.14 case) cannot cost the fp32 figures.
    *(
        Step(
            f"patch_embed_{dt}",
            f"patch-embed forward, {dt}, every reference shape: conv (cuDNN on), fallback (cuDNN off), "
            "channels_last_3d, patched, F.linear",
            # the fallback takes 22-31 s a call on an H200: one shape's call, then "not timed"
            f"{{python}} {{bench}}/patch_embed.py --devices {{device}} --channels-last --dtypes {dt} "
            "--fallback-budget 30",
            # on CPU, fp32 alone checks the plumbing: a bf16 fallback there takes seconds per call
            smoke="--refs qwen3-vl-4b --patches 32 --rounds 2 --fallback-rounds 1 --no-per-call"
            if dt == "fp32"
            else None,
            timeout_s=150,
            output="markdown",
            kind="patch_embed",
        )
        for dt in ("bf16", "fp32", "fp16")  # bf16 first: the slow path's dtype
    ),
    Step(
        "patch_call_bf16",
        "the patched call against nn.Linear and F.linear per call, bf16, N = 4 to 3,072 (issue 37's row: "
        "patched / F.linear <= 1.1 at the report's N), calls queued back to back as a training step does",
        "{python} {bench}/patch_embed.py --devices {device} --refs qwen3-vl-4b --per-call-only --call-dtype bf16",
        smoke=None,  # fp32 at N = 3,072 on one CPU thread: a minute; the CPU figures come from the benchmark
        timeout_s=120,
        output="markdown",
        kind="patch_call",
    ),
    Step(
        "doctor",
        "vlfast doctor on every reference (exit 1, a slow path found, and 4, an ordinary gain, are findings, "
        "not failures)",
        "{vlfast} doctor --json --device {device}",
        smoke="--no-probe",
        timeout_s=90,
        ok_codes=(0, 1, 4),
    ),
    Step(
        "inputs",
        "extract inputs: 640x480 JPEGs, 2 s videos, the tiny Qwen3-VL checkpoint",
        "{python} {self} --make-inputs {work}/inputs",
        full="--images 256 --videos 16",
        smoke="--images 2 --videos 1",
        timeout_s=90,
    ),
    Step(
        "extract_tiny",
        "vlfast extract throughput, tiny Qwen3-VL checkpoint, vision and LLM features",
        "{vlfast} extract {work}/inputs/media {work}/extract_tiny --model {work}/inputs/tiny-qwen3-vl "
        "--features vision,vision_mean,llm --device {device} --json --overwrite",
        timeout_s=120,
        kind="extract",
        needs=("inputs",),
    ),
    Step(
        "extract_2b",
        "vlfast extract throughput, full-width ref:qwen3-vl-2b tower (random weights)",
        "{vlfast} extract {work}/inputs/media {work}/extract_2b --model ref:qwen3-vl-2b --device {device} "
        "--json --overwrite",
        full="--dtype bfloat16",
        # 224x224 images and videos: a full-size tower on 2 CPU cores in seconds, not minutes
        smoke="--dtype float32 --min-pixels 3136 --max-pixels 50176 --video-max-pixels 200704",
        timeout_s=150,
        kind="extract",
        needs=("inputs",),
    ),
    Step(
        "embed_throughput",
        "embeddings/s: vlfast extract --features embedding against the reference's one padded forward "
        "per list (Qwen3-VL-Embedding-shaped random model, images, videos, texts)",
        "{python} {bench}/embed_throughput.py --device {device} --json",
        full="--size small --rows 256 --rounds 3 --dtype bfloat16",
        smoke="--size tiny --rows 8 --rounds 1",
        timeout_s=180,
        kind="embed",
    ),
    Step(
        "verify_full",
        "vlfast verify, full-size ref:qwen3-vl-4b tower: fp32, bf16, gradients",
        "{vlfast} verify --model ref:qwen3-vl-4b --device {device} --json",
        smoke=None,  # a full-size tower's gradients on 2 CPU cores: minutes; the tiny one checks the plumbing
        timeout_s=150,
        kind="verify",
    ),
    Step(
        "patch_accuracy",
        "patch-embed error against float64, forward and weight gradient, bf16 and fp16: stock conv, slow path "
        "(cuDNN off), patched (vlfast verify's accuracy check, 128 windows)",
        "{python} {bench}/patch_accuracy.py --device {device} --json",
        full="--windows 128",
        smoke="--tiny --windows 32",
        timeout_s=150,
        kind="accuracy",
    ),
)


@dataclass
class Outcome:
    """What one step did; written as ``steps/NAME.json`` and into ``run.json``."""

    name: str
    about: str
    argv: list[str]
    command: str  # argv as a shell line, for reading and pasting
    status: str = "planned"  # planned, ok, failed, timeout, skipped, interrupted
    reason: str | None = None
    returncode: int | None = None
    timeout_s: float | None = None
    wall_s: float | None = None
    stdout: str | None = None  # paths relative to OUT
    stderr: str | None = None
    result: Any = None  # stdout parsed: JSON, or markdown tables
    parse_error: str | None = None
    headline: str = ""


# ---------------------------------------------------------------------------------------------------------
# Facts (run as a step: `gpu.py --facts`, the only place torch is imported)


def _soft(fn: Callable[[], Any]) -> Any:
    """``fn()``, or None when it raises: a fact that cannot be collected is recorded as unknown."""
    try:
        return fn()
    except Exception:
        return None


def _cmd(argv: list[str], timeout: float = 20.0) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def cudnn_version_text(v: int | None) -> str | None:
    """torch's integer cuDNN version as major.minor.patch: 91002 -> 9.10.2 (cuDNN 9), 8902 -> 8.9.2."""
    if not v:
        return None
    major, rest = (v // 10000, v % 10000) if v >= 90000 else (v // 1000, v % 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def nvidia_smi() -> dict | None:
    """nvidia-smi's own report and a per-GPU query, or None where it is not installed."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    text = _cmd([exe])
    fields = ("index", "name", "driver_version", "memory.total", "compute_cap", "pstate", "mig.mode.current")
    query = _cmd([exe, f"--query-gpu={','.join(fields)}", "--format=csv,noheader"])
    gpus = [dict(zip(fields, (c.strip() for c in line.split(",")))) for line in (query or "").splitlines()]
    driver = gpus[0]["driver_version"] if gpus else None
    if driver is None and text:
        m = re.search(r"Driver Version:\s*(\S+)", text)
        driver = m.group(1) if m else None
    m = re.search(r"CUDA Version:\s*(\S+)", text or "")
    return {
        "path": exe,
        "driver_version": driver,
        "driver_cuda_version": m.group(1) if m else None,  # the newest CUDA this driver supports
        "gpus": gpus or None,
        "text": text,
    }


def _cuda_driver_api_version() -> int | None:
    """cuDriverGetVersion from libcuda, e.g. 12080; None without a driver."""
    import ctypes

    lib = ctypes.CDLL("libcuda.so.1")
    v = ctypes.c_int()
    return v.value if lib.cuDriverGetVersion(ctypes.byref(v)) == 0 else None


def _git(*args: str) -> str | None:
    # --no-optional-locks: reading must not rewrite the index other engineers' git commands use.
    out = _cmd(["git", "--no-optional-locks", "-C", str(REPO), *args], timeout=10)
    return out.strip() if out is not None else None


def _version(dist: str) -> str | None:
    from importlib import metadata

    return _soft(lambda: metadata.version(dist))


def collect_facts() -> dict:
    """Everything a GPU figure needs beside it to mean something. Every probe fails soft to None."""
    import torch

    cuda_ok = bool(_soft(torch.cuda.is_available))
    devices = []
    for i in range(_soft(torch.cuda.device_count) or 0) if cuda_ok else ():
        p = _soft(lambda i=i: torch.cuda.get_device_properties(i))
        devices.append(
            {
                "index": i,
                "name": getattr(p, "name", None),
                "capability": f"{p.major}.{p.minor}" if p is not None else None,
                "memory_gib": round(p.total_memory / 2**30, 1) if p is not None else None,
                "multiprocessors": getattr(p, "multi_processor_count", None),
            }
        )
    cudnn_v = _soft(torch.backends.cudnn.version) if _soft(torch.backends.cudnn.is_available) else None
    compiled = _soft(lambda: ".".join(map(str, torch._C._cudnn.getCompileVersion())))
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "schema": FACTS_SCHEMA,
        "collected_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": {"model": _cpu_model(), "cores": os.cpu_count()},
        "torch": {
            "version": torch.__version__,
            "cuda": torch.version.cuda,  # the CUDA torch was built for (None: a CPU build)
            "git": getattr(torch.version, "git_version", None),
        },
        "cuda": {
            "available": cuda_ok,
            "device_count": len(devices),
            "devices": devices,
            "driver_api_version": _soft(_cuda_driver_api_version),
        },
        "cudnn": {
            "available": _soft(torch.backends.cudnn.is_available),
            "enabled": torch.backends.cudnn.enabled,
            "version": cudnn_v,  # the cuDNN loaded at run time, which decides the conv path
            "version_text": cudnn_version_text(cudnn_v),
            "compiled_version": compiled,
            "benchmark": torch.backends.cudnn.benchmark,
            "allow_tf32": torch.backends.cudnn.allow_tf32,
        },
        "matmul": {
            "allow_tf32": _soft(lambda: torch.backends.cuda.matmul.allow_tf32),
            "float32_matmul_precision": _soft(torch.get_float32_matmul_precision),
        },
        "nvidia_smi": _soft(nvidia_smi),
        "packages": {d: _version(d) for d in ("vlfast", "transformers", "numpy", "av", "pillow")},
        "vlfast_git": {
            "commit": _git("rev-parse", "HEAD"),
            "dirty": bool(status) if status is not None else None,
        },
        "env": {
            k: os.environ.get(k)
            for k in (
                "CUDA_VISIBLE_DEVICES",
                "OMP_WAIT_POLICY",
                "NVIDIA_TF32_OVERRIDE",
                "TORCH_CUDNN_V8_API_DISABLED",
            )
        },
    }


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def cuda_skip_reason(facts: dict | None) -> str | None:
    """Why the CUDA steps cannot run on the machine these facts describe; None when they can."""
    if facts is None:
        return "CUDA unknown: the facts step gave no facts (see steps/facts.stderr.txt); CUDA steps skipped"
    cuda = facts.get("cuda") or {}
    if cuda.get("available") and cuda.get("device_count"):
        return None
    torch_v = (facts.get("torch") or {}).get("version")
    built = (facts.get("torch") or {}).get("cuda")
    smi = facts.get("nvidia_smi")
    return (
        f"CUDA absent: torch {torch_v} ({f'built for CUDA {built}' if built else 'a CPU-only build'}) sees no "
        f"CUDA device; nvidia-smi {'found' if smi else 'not found'}. CUDA steps skipped: run this on a "
        "machine with a GPU (or with --cpu-smoke to exercise the steps on CPU)."
    )


def describe_device(facts: dict | None) -> str:
    """One line: the GPU, its driver and the versions that decide the conv path."""
    if not facts:
        return "unknown (no facts)"
    t, cuda, cudnn = facts.get("torch") or {}, facts.get("cuda") or {}, facts.get("cudnn") or {}
    smi = facts.get("nvidia_smi") or {}
    versions = f"torch {t.get('version')}, CUDA {t.get('cuda')}, cuDNN {cudnn.get('version_text')}"
    if not cuda.get("available"):
        return f"no CUDA device; {versions}; CPU: {(facts.get('cpu') or {}).get('model')}"
    gpus = cuda.get("devices") or [{}]
    g = gpus[0]
    count = f"{len(gpus)} x " if len(gpus) > 1 else ""
    return (
        f"{count}{g.get('name')} (compute capability {g.get('capability')}, {g.get('memory_gib')} GiB), "
        f"driver {smi.get('driver_version')}; {versions}"
    )


# ---------------------------------------------------------------------------------------------------------
# Inputs for extract (run as a step: `gpu.py --make-inputs DIR`)


def make_inputs(folder: Path, images: int, videos: int) -> dict:
    """Synthetic media and the tiny offline Qwen3-VL checkpoint, as benchmarks/extract.py pipeline uses them."""
    from vlfast.demo import make_images, make_tiny_qwen3_vl, make_video

    media = folder / "media"
    make_images(media / "images", [(640, 480)] * images)
    for k in range(videos):
        make_video(media / "videos" / f"clip{k:02d}.mp4", frames=16, fps=8, width=320, height=240, seed=k)
    ckpt = make_tiny_qwen3_vl(folder / "tiny-qwen3-vl")
    return {"media": str(media), "images": images, "videos": videos, "checkpoint": str(ckpt)}


# ---------------------------------------------------------------------------------------------------------
# Reading what the steps print


def _number(cell: str) -> float | str:
    """'3.19x' -> 3.19, '+2.7' -> 2.7, '3,072' -> 3072.0; text stays text."""
    text = cell.strip().replace(",", "")
    m = re.fullmatch(r"([+-]?\d+(?:\.\d+)?(?:e[+-]?\d+)?)x?", text)
    return float(m.group(1)) if m else cell.strip()


def parse_markdown_tables(text: str) -> list[dict]:
    """Every pipe table in ``text`` as ``{"columns": [...], "rows": [{column: value}]}``, numbers as floats.

    Generic on purpose: the benchmark's tables may gain columns (``--channels-last`` adds four) and
    this reads them all by their headers."""
    tables: list[dict] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines) - 1:
        head, rule = lines[i].strip(), lines[i + 1].strip()
        if head.startswith("|") and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", rule):
            columns = [c.strip() for c in head.strip("|").split("|")]
            rows = []
            i += 2
            while i < len(lines) and lines[i].strip().startswith("|"):
                cells = [c.strip() for c in lines[i].strip().strip("|").split("|")]
                rows.append({c: _number(v) for c, v in zip(columns, cells)})
                i += 1
            tables.append({"columns": columns, "rows": rows})
        else:
            i += 1
    return tables


def read_output(step: Step, stdout: str) -> tuple[Any, str | None]:
    """(parsed stdout, None) or (None, why it could not be read)."""
    if step.output == "json":
        try:
            return json.loads(stdout), None
        except json.JSONDecodeError as e:
            return None, f"stdout is not one JSON document: {e}"
    if step.output == "markdown":
        tables = parse_markdown_tables(stdout)
        return ({"tables": tables, "markdown": stdout.strip()}, None) if tables else (None, "no table")
    return stdout, None


def _span(values: list[float], fmt: str) -> str:
    lo, hi = min(values), max(values)
    return format(lo, fmt) if lo == hi else f"{format(lo, fmt)}-{format(hi, fmt)}"


def _headline_patch_embed(result: dict) -> str:
    """Per dtype, the range over shapes of each ratio: what the patch saves, and how near the GEMM it is."""
    table = next((t for t in result["tables"] if "dtype" in t["columns"]), None)
    if table is None:
        return ""
    ratios = {  # column -> short name, format, unit
        "conv / patched": ("conv/patched", ".2f", "x"),
        "fallback / patched": ("fallback/patched", ".1f", "x"),
        "conv CL / patched": ("conv CL/patched", ".2f", "x"),
        "patched / linear": ("patched/GEMM", ".2f", ""),
    }
    parts = []
    for dtype in dict.fromkeys(r["dtype"] for r in table["rows"]):
        rows = [r for r in table["rows"] if r["dtype"] == dtype]
        spans = [
            f"{short} {_span([r[col] for r in rows], fmt)}{unit}"
            for col, (short, fmt, unit) in ratios.items()
            if col in table["columns"] and all(isinstance(r.get(col), float) for r in rows)
        ]
        parts.append(f"{dtype}: " + ", ".join(spans))
    return "; ".join(parts)


def _headline_patch_call(result: dict) -> str:
    """Per N, the patched call over raw F.linear: what the patch costs per call beyond the GEMM."""
    table = next((t for t in result["tables"] if "patched / F.linear" in t["columns"]), None)
    if table is None:
        return ""
    return "patched/F.linear " + ", ".join(
        f"N={r['N']:g}: {r['patched / F.linear']:.2f}" for r in table["rows"] if isinstance(r.get("N"), float)
    )


def _headline_verify(result: dict) -> str:
    checks = result.get("checks") or []
    bad = [f"{c.get('name')} {c.get('dtype')}" for c in checks if not c.get("passed")]
    head = f"{'passed' if result.get('passed') else 'FAILED'}: {len(checks) - len(bad)}/{len(checks)} checks"
    return head + (f"; failing: {', '.join(bad[:4])}" if bad else "")


def _headline_extract(result: dict) -> str:
    text = (
        f"{result.get('extracted')}/{result.get('total')} samples, {result.get('tokens')} tokens in "
        f"{result.get('seconds', 0):.1f} s: {result.get('samples_per_s')} samples/s, "
        f"{result.get('tokens_per_s')} tokens/s (+ {result.get('load_seconds') or 0:.1f} s model load)"
    )
    return text + (f"; {result['failed']} failed" if result.get("failed") else "")


def _headline_components(result: dict) -> str:
    """The patch embedding and the whole forward, per variant, and the embedding's share of the forward."""
    rows = {r["component"]: r for r in result["rows"]}
    pe, fwd = rows["patch_embed"], rows["forward (total)"]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:,.1f}"

    share = result.get("patch_embed_share") or {}
    return (
        f"{result['patches']:,} patches, {result['dtype']}: patch_embed stock {ms(pe['stock_ms'])} / slow "
        f"{ms(pe['slow_ms'])} / patched {ms(pe['patched_ms'])} ms; forward {ms(fwd['stock_ms'])} / "
        f"{ms(fwd['slow_ms'])} / {ms(fwd['patched_ms'])} ms; patch_embed share of the slow forward "
        f"{(share.get('slow') or 0):.0%}"
    )


def _headline_clips(result: dict) -> str:
    """Clips per hour in each side's loop (a long job's rate: start-up and model load excluded) and end to
    end, vlfast's ratio to the author's loop, and that loop on the slow path (projected)."""
    rows = {r["side"]: r for r in result["rows"]}
    ours, loop = rows["vlfast"], rows["loop"]
    slow = rows.get("loop, slow path (projected)", {})
    lo, hi = result["ratio_range"]
    return (
        f"{result['clips']} clips ({result['model']}), clips/h in the loop: vlfast {ours['loop_clips_per_hour']:,.0f}, "
        f"loop {loop['loop_clips_per_hour']:,.0f} ({loop['vlfast_loop_speedup']:.2f}x), slow path (projected) "
        f"{slow.get('loop_clips_per_hour', 0):,.0f} ({slow.get('vlfast_loop_speedup', 0):,.1f}x); end to end "
        f"{result['ratio_median']:.2f}x ({lo:.2f}-{hi:.2f})"
    )


def _headline_accuracy(result: dict) -> str:
    """Per low-precision dtype, each path's weight-gradient error against float64."""
    by = {}
    for r in result["rows"]:
        if r["dtype"] != "float32" and r.get("weight_grad_rel") is not None:
            by.setdefault(r["dtype"], []).append(f"{r['path']} {r['weight_grad_rel']:.2g}")
    return "weight grad vs float64: " + "; ".join(f"{d}: {', '.join(v)}" for d, v in by.items())


HEADLINES: dict[str, Callable[[Any], str]] = {
    "components": _headline_components,
    "clips": _headline_clips,
    "accuracy": _headline_accuracy,
    "facts": describe_device,
    "patch_embed": _headline_patch_embed,
    "patch_call": _headline_patch_call,
    "doctor": lambda r: f"verdict {r.get('verdict')}: {r.get('summary')}",
    "verify": _headline_verify,
    "inputs": lambda r: f"{r['images']} images (640x480), {r['videos']} videos (2 s), tiny checkpoint",
    "extract": _headline_extract,
    "embed": lambda r: (
        f"vlfast/reference {r['ratio_median']:.2f}x (min {r['ratio_min']:.2f}, max {r['ratio_max']:.2f}), "
        f"{r['rows']} rows, {r['size']} model, {r['dtype']}"
    ),
}


def headline(step: Step, result: Any) -> str:
    fn = HEADLINES.get(step.kind or step.name)
    if fn is None or result is None:
        return ""
    text = _soft(lambda: fn(result)) or ""
    return text if len(text) <= 300 else text[:297] + "..."


# ---------------------------------------------------------------------------------------------------------
# Running the steps


def expand(step: Step, *, mode: str, work: Path) -> list[str]:
    """The step's command line for ``mode`` ("cuda" or "cpu-smoke")."""
    extra = step.full if mode == "cuda" else (step.smoke or "")
    values = {
        "{python}": sys.executable,
        "{self}": str(Path(__file__).resolve()),
        "{bench}": str(HERE),
        "{work}": str(work),
        "{device}": "cuda" if mode == "cuda" else "cpu",
    }
    argv: list[str] = []
    for word in shlex.split(f"{step.command} {extra}"):
        if word == "{vlfast}":
            argv += [sys.executable, "-m", "vlfast.cli.main"]
            continue
        for key, value in values.items():
            word = word.replace(key, value)
        argv.append(word)
    return argv


def display(argv: list[str]) -> str:
    """``argv`` as a shell line a person reads: the interpreter as ``python``, ``-m vlfast.cli.main`` as
    ``vlfast``, this repository's paths relative."""
    words = list(argv)
    if words[:3] == [sys.executable, "-m", "vlfast.cli.main"]:
        words = ["vlfast", *words[3:]]
    elif words and words[0] == sys.executable:
        words[0] = "python"
    return shlex.join(w.replace(f"{REPO}/", "") for w in words)


def step_timeout(nominal: float, elapsed: float, budget_s: float) -> float | None:
    """The timeout a step gets: its own, cut to what the budget has left; None when too little is left."""
    left = budget_s - RESERVE_S - elapsed
    return None if left < MIN_STEP_S else min(nominal, left)


def select(names: Sequence[str] | None, steps: Sequence[Step] = STEPS) -> list[Step]:
    """The steps named (all when None), with what they need, in the table's order; facts always."""
    known = {s.name: s for s in steps}
    unknown = [n for n in names or () if n not in known]
    if unknown:
        raise ValueError(f"unknown step(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    wanted = set(names or known) | ({"facts"} & set(known))
    for name in list(wanted):
        wanted.update(known[name].needs)
    return [s for s in steps if s.name in wanted]


class Interrupted(Exception):
    pass


def _on_sigterm(signum, frame):  # the lent machine's limit, or a person: record what was done, then stop
    raise Interrupted(f"signal {signum}")


def run_process(
    argv: list[str], timeout_s: float, stdout: Path, stderr: Path, env: dict
) -> tuple[int | None, float]:
    """Run ``argv`` with output to files (kept when it hangs); (exit status or None on timeout, seconds).

    It gets its own process group, so a timeout ends it and every process it started (decode workers)."""
    t0 = time.monotonic()
    with stdout.open("wb") as out, stderr.open("wb") as err:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=REPO, env=env, start_new_session=True
        )
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _end_group(proc)
            rc = None
        except BaseException:
            _end_group(proc)
            raise
    return rc, time.monotonic() - t0


def _end_group(proc: subprocess.Popen) -> None:
    """SIGTERM the step's process group, SIGKILL what is left after 5 s."""
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)  # the group this script created for the step: pgid == its pid
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            if sig == signal.SIGTERM:
                os.killpg(proc.pid, signal.SIGKILL)  # children that ignored the leader's end
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env["PYTHONUNBUFFERED"] = "1"  # a step killed at its timeout still leaves what it printed
    env["VLFAST_BENCH_NO_SAVE"] = "1"  # the run's own OUT holds each step's JSON (tables.py --from-gpu-run)
    src = str(REPO / "src")  # measure this checkout's vlfast, installed or not
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return env


@dataclass
class Run:
    """The whole run, as ``run.json`` holds it."""

    out: Path
    mode: str  # cuda, cpu-smoke or dry-run (a cuda plan)
    budget_s: float
    started_at: str
    command: str = "bash benchmarks/gpu.sh"
    facts: dict | None = None
    facts_source: str | None = None
    cuda_skip_reason: str | None = None
    outcomes: list[Outcome] | None = None
    exit_code: int | None = None
    finished_at: str | None = None

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA,
            "mode": self.mode,
            "command": self.command,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "budget_s": self.budget_s,
            "exit_code": self.exit_code,
            "exit_meaning": EXIT_MEANING.get(self.exit_code) if self.exit_code is not None else None,
            "cuda": self.cuda_skip_reason is None and self.facts is not None and self.mode != "cpu-smoke",
            "cuda_skip_reason": self.cuda_skip_reason,
            "device": describe_device(self.facts),
            "facts_source": self.facts_source,
            "facts": self.facts,
            "steps": [asdict(o) for o in self.outcomes or []],
        }

    def write(self) -> None:
        (self.out / "run.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        if self.facts is not None:
            (self.out / "facts.json").write_text(json.dumps(self.facts, indent=2) + "\n")
        (self.out / "summary.md").write_text(render_summary(self))


def execute(
    steps: Sequence[Step],
    out: Path,
    *,
    mode: str = "cuda",
    budget_s: float = DEFAULT_BUDGET_S,
    facts: dict | None = None,
    facts_source: str | None = None,
    dry_run: bool = False,
    work: Path | None = None,
    command: str | None = None,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
) -> Run:
    """Run (or with ``dry_run`` plan) ``steps`` into ``out``; every outcome written as it lands.

    ``facts`` given (fabricated, or read from a file) replace the facts step's probe."""
    (out / "steps").mkdir(parents=True, exist_ok=True)
    work = work or Path(tempfile.gettempdir()) / f"vlfast-gpu-work-{os.getpid()}"
    run = Run(
        out=out,
        mode="dry-run" if dry_run else mode,
        budget_s=budget_s,
        started_at=_now(),
        command=command or f"python {display([str(Path(__file__).resolve())])}",
        facts=facts,
        facts_source=facts_source,
        outcomes=[],
    )
    if facts is not None and mode == "cuda":
        run.cuda_skip_reason = cuda_skip_reason(facts)
    try:
        _execute(run, steps, mode, budget_s, facts, dry_run, work, log)
    except (Interrupted, KeyboardInterrupt):
        run.exit_code, run.finished_at = EXIT_INTERRUPTED, _now()
        run.write()
        raise
    run.exit_code = exit_code(run)
    run.finished_at = _now()
    run.write()
    return run


def _execute(
    run: Run,
    steps: Sequence[Step],
    mode: str,
    budget_s: float,
    facts: dict | None,
    dry_run: bool,
    work: Path,
    log: Callable[[str], None],
) -> None:
    env, t0, done = child_env(), time.monotonic(), {}
    for k, step in enumerate(steps, 1):
        argv = expand(step, mode=mode, work=work)
        o = Outcome(step.name, step.about, argv, display(argv), timeout_s=step.timeout_s)
        run.outcomes.append(o)
        timeout = step_timeout(step.timeout_s, time.monotonic() - t0, budget_s)
        why_not = _why_not(run, step, mode, facts is not None, done, timeout)
        if why_not:
            o.status, o.reason = "skipped", why_not
            log(f"[{k}/{len(steps)}] {step.name}: skipped: {why_not}")
        elif dry_run and step.name != "facts":
            o.status = "planned"
            log(f"[{k}/{len(steps)}] {step.name}: would run {o.command} (timeout {step.timeout_s:.0f} s)")
        else:
            o.timeout_s = round(timeout, 1)
            log(f"[{k}/{len(steps)}] {step.name}: {o.command} (timeout {timeout:.0f} s)")
            try:
                _run_one(step, o, run.out, env)
            except BaseException:
                _finish_step(run, step, o, mode)  # the interrupted step is recorded too
                raise
        done[step.name] = o.status
        _finish_step(run, step, o, mode)
        if o.stdout is not None:  # it ran
            log(f"    {o.status} in {o.wall_s or 0:.1f} s: {o.headline or o.reason or ''}")
        if step.name == "facts" and run.cuda_skip_reason:
            log(run.cuda_skip_reason)


def _why_not(
    run: Run, step: Step, mode: str, facts_given: bool, done: dict[str, str], timeout: float | None
) -> str | None:
    """Why ``step`` is skipped, or None when it runs."""
    unmet = [n for n in step.needs if done.get(n) not in ("ok", "planned")]
    if step.name == "facts" and facts_given:
        return f"facts given: {run.facts_source}"
    if step.cuda and mode == "cuda" and run.cuda_skip_reason:
        return run.cuda_skip_reason.split(":")[0]  # the whole reason is stated once, above the steps
    if mode == "cpu-smoke" and step.smoke is None:
        return "not part of --cpu-smoke (too slow on CPU; the GPU run has it)"
    if unmet:
        return f"needs {', '.join(unmet)}, which did not pass"
    if timeout is None:
        return f"budget spent ({run.budget_s:.0f} s)"
    return None


def _run_one(step: Step, o: Outcome, out: Path, env: dict) -> None:
    so, se = out / "steps" / f"{step.name}.stdout.txt", out / "steps" / f"{step.name}.stderr.txt"
    o.stdout, o.stderr = str(so.relative_to(out)), str(se.relative_to(out))
    try:
        rc, o.wall_s = run_process(o.argv, o.timeout_s or step.timeout_s, so, se, env)
    except (Interrupted, KeyboardInterrupt) as e:
        o.status, o.reason = "interrupted", f"the run was stopped ({e or 'Ctrl-C'})"
        raise
    except OSError as e:  # the command could not start
        o.status, o.reason = "failed", f"could not start: {e}"
        return
    o.wall_s = round(o.wall_s, 2)
    o.returncode = rc
    if rc is None:
        o.status, o.reason = "timeout", f"killed after {o.timeout_s:.0f} s"
    elif rc in step.ok_codes:
        o.status = "ok"
    else:
        o.status, o.reason = "failed", f"exit status {rc}; last line of stderr: {_last_line(se)}"
    o.result, o.parse_error = read_output(step, so.read_text(errors="replace"))
    if o.status == "ok" and o.parse_error:
        o.reason = o.parse_error


def _finish_step(run: Run, step: Step, o: Outcome, mode: str) -> None:
    if step.name == "facts" and o.status == "ok" and isinstance(o.result, dict):
        run.facts, run.facts_source = o.result, "probed (steps/facts.stdout.txt)"
    if step.name == "facts" and mode == "cuda":
        run.cuda_skip_reason = cuda_skip_reason(run.facts)
    o.headline = headline(step, run.facts if step.name == "facts" else o.result)
    (run.out / "steps" / f"{step.name}.json").write_text(json.dumps(asdict(o), indent=2) + "\n")
    run.write()


def _last_line(path: Path) -> str:
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1][:200] if lines else "(empty)"


def exit_code(run: Run) -> int:
    statuses = [o.status for o in run.outcomes or []]
    if "interrupted" in statuses:
        return EXIT_INTERRUPTED
    if any(s in ("failed", "timeout") for s in statuses):
        return EXIT_FAILED
    if run.mode == "cuda" and run.cuda_skip_reason:
        return EXIT_NO_CUDA
    return EXIT_OK


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# ---------------------------------------------------------------------------------------------------------
# summary.md


def _cell(text: Any) -> str:
    return str(text if text is not None else "").replace("|", "\\|").replace("\n", " ")


def render_summary(run: Run) -> str:
    d = run.to_dict()
    lines = [
        f"# vlfast GPU run ({d['mode']})",
        "",
        f"Device: {d['device']}",
        "",
        f"Started {d['started_at']}, finished {d['finished_at'] or '(running)'}, budget {run.budget_s:.0f} s: "
        f"`{run.command}`.",
        "",
    ]
    if run.cuda_skip_reason:
        lines += [f"**{run.cuda_skip_reason}**", ""]
    if run.mode == "cpu-smoke":
        lines += ["**CPU smoke run**: the steps on CPU at tiny sizes; no figure here is a GPU figure.", ""]
    if run.mode == "dry-run":
        worst = sum(o.timeout_s or 0 for o in run.outcomes or [] if o.status == "planned")
        lines += [
            f"**Dry run**: nothing ran but the facts probe. The planned steps' timeouts add up to {worst:.0f} s "
            f"against a {run.budget_s:.0f} s budget: only steps that hang or run long can push the last ones "
            "out (skipped, 'budget spent').",
            "",
        ]
    lines += ["| step | status | exit | seconds | result |", "|---|---|---:|---:|---|"]
    for o in run.outcomes or []:
        result = o.headline if o.status in ("ok", "failed") and o.headline else (o.reason or o.headline)
        result = f"`{o.command}`" if o.status == "planned" else result
        lines.append(
            f"| {o.name} | {o.status} | {_cell(o.returncode)} | {_cell(o.wall_s)} | {_cell(result)} |"
        )
    if run.exit_code is not None and run.mode != "dry-run":
        lines += ["", f"Exit status {run.exit_code}: {EXIT_MEANING.get(run.exit_code, '')}."]
    for o in run.outcomes or []:  # the tables a step prints (markdown steps) or puts in its JSON ("markdown")
        if isinstance(o.result, dict) and isinstance(o.result.get("markdown"), str) and o.result["markdown"]:
            lines += ["", f"## {o.name}", "", o.result["markdown"]]
    lines += [
        "",
        "Files: `run.json` (facts and every step), `facts.json`, `steps/NAME.json`, "
        "`steps/NAME.stdout.txt`, `steps/NAME.stderr.txt`.",
    ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Exit status: "
        + "; ".join(f"{k} {v}" for k, v in EXIT_MEANING.items())
        + f"; {EXIT_USAGE} bad usage.",
    )
    ap.add_argument("out", nargs="?", help="output folder (default: ./gpu-run-YYYYmmdd-HHMMSS)")
    ap.add_argument("--steps", help=f"comma-separated subset of: {', '.join(s.name for s in STEPS)}")
    ap.add_argument(
        "--budget",
        type=float,
        default=DEFAULT_BUDGET_S,
        help=f"seconds for the whole run (default {DEFAULT_BUDGET_S:.0f})",
    )
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument(
        "--cpu-smoke", action="store_true", help="run the steps on CPU at tiny sizes, to check the plumbing"
    )
    mode.add_argument("--dry-run", action="store_true", help="write the plan; run only the facts probe")
    ap.add_argument("--facts-file", type=Path, help="facts JSON to use instead of probing (replays, tests)")
    ap.add_argument("--keep-work", action="store_true", help="keep the scratch folder (extract outputs)")
    ap.add_argument("--facts", action="store_true", help="print this machine's facts as JSON and exit")
    ap.add_argument("--make-inputs", type=Path, metavar="DIR", help="make the extract inputs in DIR and exit")
    ap.add_argument("--images", type=int, default=256, help="with --make-inputs: 640x480 JPEGs")
    ap.add_argument("--videos", type=int, default=16, help="with --make-inputs: 2 s videos")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.facts:
        print(json.dumps(collect_facts(), indent=2))
        return EXIT_OK
    if args.make_inputs:
        _print_inputs(args)
        return EXIT_OK
    if args.budget < MIN_STEP_S + RESERVE_S:
        ap.error(f"--budget must be at least {MIN_STEP_S + RESERVE_S:.0f} s")
    try:
        steps = select(args.steps.split(",") if args.steps else None)
    except ValueError as e:
        ap.error(str(e))
    out = Path(args.out or f"gpu-run-{datetime.now():%Y%m%d-%H%M%S}").resolve()
    if (out / "run.json").exists():
        print(f"error: {out} already holds a run (run.json); give a new folder", file=sys.stderr)
        return EXIT_USAGE
    facts = None
    if args.facts_file:
        try:
            facts = json.loads(args.facts_file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            ap.error(f"--facts-file {args.facts_file}: {e}")
    work = Path(tempfile.mkdtemp(prefix="vlfast-gpu-work-")) if not args.dry_run else None
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        run = execute(
            steps,
            out,
            mode="cpu-smoke" if args.cpu_smoke else "cuda",
            budget_s=args.budget,
            facts=facts,
            facts_source=str(args.facts_file) if args.facts_file else None,
            dry_run=args.dry_run,
            work=work,
            command=display(
                [sys.executable, str(Path(__file__).resolve()), *(sys.argv[1:] if argv is None else argv)]
            ),
        )
    except (Interrupted, KeyboardInterrupt):
        print(f"interrupted; what ran is in {out}", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if work is not None and not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)
    print(
        f"{out / 'summary.md'}: exit {run.exit_code} ({EXIT_MEANING.get(run.exit_code, '')})", file=sys.stderr
    )
    return run.exit_code


def _print_inputs(args) -> None:
    """``--make-inputs``: the inputs made, as JSON on stdout (what libraries print goes to stderr)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)  # what libraries print on import (deepspeed logs to stdout) must not break the JSON
    try:
        made = make_inputs(args.make_inputs, args.images, args.videos)
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    print(json.dumps(made, indent=2))


if __name__ == "__main__":
    raise SystemExit(main())
