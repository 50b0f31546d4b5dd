"""Patch-embedding speed: stock ``nn.Conv3d`` vs vlfast's patched conv vs raw ``F.linear`` (the limit).

For every reference tower's patch-embed shape (read from ``build_reference(name, device="meta")``, so
nothing is allocated or downloaded) this times one forward over N patches, shaped the way Qwen-VL calls
it: ``pixel_values.view(-1, C, T, P, P)``. Four variants:

- ``conv``: the stock module (oneDNN on CPU, cuDNN on CUDA).
- ``patched``: the same module after ``vlfast.patch`` (a view plus one ``F.linear``).
- ``linear``: ``F.linear(x, W2d, b)`` on a pre-reshaped weight: the GEMM itself, the physical limit.
- ``fallback``: the stock conv with oneDNN (CPU) or cuDNN (CUDA) disabled, i.e. the vol2col /
  slow_conv3d path that torch 2.9+ takes for bf16/fp16 5-D convs on cuDNN 9.8-9.14.

With ``--channels-last``, two more: ``conv_cl`` and ``patched_cl``, the same two modules after
``.to(memory_format=torch.channels_last_3d)`` called on a channels_last_3d input (converted before timing),
the layout users reach for to get cuDNN's NDHWC kernels.

Variants are interleaved round by round (conv, patched, linear, fallback, next round...) and medians
taken, so a noisy shared machine slows them alike and the ratios from one run stay comparable. The
fallback is slow enough (seconds per call in bf16) that it gets fewer rounds.

    python benchmarks/patch_embed.py                       # all shapes, fp32 + bf16, CPU (+ CUDA)
    python benchmarks/patch_embed.py --refs qwen3-vl-4b         # one shape; the result file: benchmarks/harness.py
    python benchmarks/patch_embed.py --devices cuda --dtypes fp32 bf16 fp16 --channels-last
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import re
import subprocess
import sys
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # timing on a shared CPU: idle threads must sleep

import torch  # noqa: E402
import torch.nn.functional as F
from torch import nn

import vlfast
from vlfast.diagnosis.timing import measure

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from vlfast.models import REFERENCES, build_reference, tower_spec

ROOT = Path(__file__).resolve().parents[1]
# One 8-frame 512x384 clip for Qwen3-VL: (8 / T=2) * (384 / 16) * (512 / 16) = 4 * 24 * 32 = 3,072 patches.
DEFAULT_PATCHES = 3072
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Shape:
    refs: tuple[str, ...]  # references sharing this patch embedding
    in_channels: int
    temporal: int
    patch: int
    out: int

    @property
    def label(self) -> str:
        return f"{self.in_channels}x{self.temporal}x{self.patch}x{self.patch} -> {self.out}"


def reference_shapes(names: list[str]) -> list[Shape]:
    """Distinct patch-embed shapes of ``names``, each with the references that share it."""
    by_shape: dict[tuple[int, int, int, int], list[str]] = {}
    for name in names:
        spec = tower_spec(build_reference(name, device="meta"))
        key = (spec.in_channels, spec.temporal_patch_size, spec.patch_size, spec.hidden_size)
        by_shape.setdefault(key, []).append(name)
    return [Shape(tuple(refs), *key) for key, refs in by_shape.items()]


cpu_model = harness.cpu_model  # the siblings import it from here


def hardware(device: torch.device) -> str:
    cpu = cpu_model()
    flags = ""
    try:
        info = Path("/proc/cpuinfo").read_text()
        has = [f for f in ("avx512_bf16", "amx_bf16") if re.search(rf"\b{f}\b", info)]
        flags = f" ({', '.join(has)})" if has else ""
    except OSError:
        pass
    text = (
        f"CPU: {cpu}{flags}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads; "
        f"torch {torch.__version__}; Python {platform.python_version()}"
    )
    if hasattr(os, "getloadavg"):  # a shared machine: say how busy it was (ratios, not times, are the claim)
        text += f"; load average {os.getloadavg()[0]:.1f} at the end of the run"
    if device.type == "cuda":
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        text += f"; GPU: {torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}, cuDNN {cudnn}"
    return text


def _fallback_flags(device: torch.device):
    if device.type == "cuda":
        return torch.backends.cudnn.flags(enabled=False)
    return torch.backends.mkldnn.flags(enabled=False)


def bench_shape(
    shape: Shape,
    dtype: torch.dtype,
    device: torch.device,
    n: int,
    rounds: int,
    fallback_rounds: int,
    channels_last: bool = False,
    fallback_budget: FallbackBudget | None = None,
) -> dict[str, list[float]]:
    """Milliseconds per variant and round (the fallback in the first rounds only) for one configuration;
    with ``channels_last``, also ``conv_cl`` and ``patched_cl`` (module and input in channels_last_3d).

    A fallback call slower than ``fallback_budget.once_ms`` is timed once, its warm-up call being the
    figure (on an H200 one call took 22-31 s: three rounds and a warm-up of every shape would take half an
    hour); once the budget's seconds are spent, the remaining shapes' fallback is not timed (an empty
    list)."""
    c, t, p, d = shape.in_channels, shape.temporal, shape.patch, shape.out
    gen = torch.Generator().manual_seed(0)
    conv = nn.Conv3d(c, d, (t, p, p), stride=(t, p, p)).to(device=device, dtype=dtype)
    patched = nn.Conv3d(c, d, (t, p, p), stride=(t, p, p)).to(device=device, dtype=dtype)
    patched.load_state_dict(conv.state_dict())
    vlfast.patch(patched, strict=True)
    pixels = torch.randn(n, c * t * p * p, generator=gen).to(device=device, dtype=dtype)  # (N, C*T*P*P)
    w2d = conv.weight.detach().reshape(d, -1)  # a view: (D, C*T*P*P)
    bias = conv.bias.detach()

    def run_conv():
        conv(pixels.view(-1, c, t, p, p)).view(-1, d)

    def run_patched():
        patched(pixels.view(-1, c, t, p, p)).view(-1, d)

    def run_linear():
        F.linear(pixels, w2d, bias)

    def run_fallback():
        with _fallback_flags(device):
            run_conv()

    variants = {"conv": run_conv, "patched": run_patched, "linear": run_linear, "fallback": run_fallback}
    if channels_last:
        fmt = torch.channels_last_3d
        conv_cl = copy.deepcopy(conv).to(memory_format=fmt)
        patched_cl = copy.deepcopy(patched).to(memory_format=fmt)
        x_cl = pixels.view(-1, c, t, p, p).contiguous(memory_format=fmt)  # (N, C, T, P, P), NDHWC in memory
        variants["conv_cl"] = lambda: conv_cl(x_cl)
        variants["patched_cl"] = lambda: patched_cl(x_cl)
    times: dict[str, list[float]] = {k: [] for k in variants}
    with torch.inference_mode():
        _check_agreement(conv, patched, pixels, w2d, bias)
        if channels_last:
            _check_channels_last(conv, conv_cl, patched_cl, pixels.view(-1, c, t, p, p), x_cl)
        budget = fallback_budget or FallbackBudget()
        for name, fn in variants.items():  # warm-up: allocator, oneDNN primitive cache, cuBLAS handles
            if name == "fallback":
                if not budget.allows():
                    fallback_rounds = 0
                    continue
                first = budget.spend(measure(fn, device=device, warmup=0, repeats=1).times_ms[0])
                if first >= budget.once_ms:
                    times["fallback"].append(first)
                    budget.once += 1
                    fallback_rounds = 0
                continue
            measure(fn, device=device, warmup=0, repeats=1)
        names = list(variants)
        for r in range(rounds):
            # Rotate the order each round so no variant always runs right after the slow fallback.
            for name in names[r % len(names) :] + names[: r % len(names)]:
                if name == "fallback" and (r >= fallback_rounds or not budget.allows()):
                    continue
                ms = measure(variants[name], device=device, warmup=0, repeats=1).times_ms[0]
                times[name].append(budget.spend(ms) if name == "fallback" else ms)
    return times


@dataclass
class FallbackBudget:
    """How much time the fallback (seconds per call on a GPU) may take in one run: ``seconds`` in all
    (None: no limit), and ``once_ms``, past which one call is its only timing."""

    seconds: float | None = None
    once_ms: float = 10_000.0
    spent_s: float = 0.0
    once: int = 0  # shapes whose fallback was timed once, being slower than once_ms

    def allows(self) -> bool:
        return self.seconds is None or self.spent_s < self.seconds

    def spend(self, ms: float) -> float:
        self.spent_s += ms / 1e3
        return ms


def _fallback_ms(t: dict[str, list[float]], once: bool) -> str:
    v = t["fallback"]
    return "not timed" if not v else f"{harness.median(v):.1f}" + ("\\*" if once else "")


def _fallback_ratio(t: dict[str, list[float]]) -> str:
    return f"{paired_ratio(t, 'fallback', 'patched'):.1f}x" if t["fallback"] else "-"


def paired_ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    """Median over rounds of ``a / b`` within the same round: both ran seconds apart under the same load."""
    return harness.median(x / y for x, y in zip(times[a], times[b]))


def _check_agreement(conv, patched, pixels, w2d, bias) -> None:
    """Time only what is right: the patched module is F.linear exactly, and agrees with the conv."""
    c, t, p = conv.in_channels, *conv.kernel_size[:2]
    d = conv.out_channels
    x = pixels.view(-1, c, t, p, p)
    ours, gemm, ref = patched(x).view(-1, d), F.linear(pixels, w2d, bias), conv(x).view(-1, d)
    if not torch.equal(ours, gemm):
        raise AssertionError("the patched conv does not compute exactly F.linear")
    cos = F.cosine_similarity(ours.double().flatten(), ref.double().flatten(), dim=0).item()
    if cos < 0.999:
        raise AssertionError(f"the patched conv disagrees with nn.Conv3d: cosine {cos:.6f}")


def _check_channels_last(conv, conv_cl, patched_cl, x, x_cl) -> None:
    """The channels-last modules compute what the contiguous conv does (a different summation order)."""
    d = conv.out_channels
    ref = conv(x).reshape(-1, d).double().flatten()
    for name, module in (("conv_cl", conv_cl), ("patched_cl", patched_cl)):
        got = module(x_cl).reshape(-1, d).double().flatten()
        cos = F.cosine_similarity(got, ref, dim=0).item()
        if cos < 0.999:
            raise AssertionError(f"{name} disagrees with the contiguous nn.Conv3d: cosine {cos:.6f}")


def load_baseline(rev: str):
    """vlfast's ``patching`` module as it was at git revision ``rev``, to time the patch before a change
    beside it after, in one run (the machine is shared: only ratios from one run compare)."""
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:src/vlfast/patching/gemm.py"],
        capture_output=True,
        text=True,
    )
    if source.returncode != 0:
        raise SystemExit(
            f"--baseline {rev}: git cannot show src/vlfast/patching/gemm.py there: {source.stderr.strip()}"
        )
    name = f"_vlfast_patching_at_{re.sub(r'[^0-9A-Za-z]', '_', rev)}"
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses look their module up there
    exec(compile(source.stdout, f"{rev}:src/vlfast/patching/gemm.py", "exec"), module.__dict__)
    return module


# N = 4 with 8 outputs isolates the fixed cost; 16 to 256 patches (thumbnails, low-resolution frames,
# streaming one frame at a time) are where a fixed cost could still show against the GEMM; 3,072 is the
# report's clip, where the target is patched / F.linear <= 1.05 on a CPU and <= 1.1 on a GPU.
CALL_SIZES = ((4, 8), (16, None), (64, None), (256, None), (DEFAULT_PATCHES, None))


def call_overhead_us(
    shape: Shape,
    device: torch.device,
    baseline=None,
    rounds: int = 9,
    budget_ms: float = 20.0,
    dtype: torch.dtype = torch.float32,
) -> list[dict]:
    """Microseconds per module call for each N in ``CALL_SIZES``, in ``dtype``, one thread: the patched conv
    against an ``nn.Linear`` of the same weight (module call against module call; the caller's own
    ``view`` before and after, the same with or without the patch, excluded), the stock conv, raw
    ``F.linear``, and the patch at ``baseline`` (a module from :func:`load_baseline`) when given.

    Each variant runs a loop of calls sized to ~``budget_ms``; rounds interleave the variants and the
    minimum over rounds is taken, as timeit advises for fixed costs; the spread (max / min over rounds) of
    the patched variant is reported beside it. On a GPU the loop's calls are queued back to back, as a
    training step queues them, so a host cost the device hides does not count, one it does not hide does.
    """
    threads = torch.get_num_threads()
    # One thread: waking a second one for a small GEMM costs more, and more erratically, than the work.
    torch.set_num_threads(1)
    try:
        return [
            _call_times(shape, n, d or shape.out, device, baseline, rounds, budget_ms, dtype)
            for n, d in CALL_SIZES
        ]
    finally:
        torch.set_num_threads(threads)


def _call_times(
    shape: Shape,
    n: int,
    d: int,
    device: torch.device,
    baseline,
    rounds: int,
    budget_ms: float,
    dtype: torch.dtype = torch.float32,
) -> dict:
    c, t, p = shape.in_channels, shape.temporal, shape.patch
    k = c * t * p * p
    gen = torch.Generator().manual_seed(0)
    conv = nn.Conv3d(c, d, (t, p, p), stride=(t, p, p)).to(device, dtype)
    patched = copy.deepcopy(conv)
    vlfast.patch(patched, strict=True)
    linear = nn.Linear(k, d).to(device, dtype)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.reshape(d, -1))
        linear.bias.copy_(conv.bias)
    pixels = torch.randn(n, k, generator=gen).to(device, dtype)
    x5 = pixels.view(n, c, t, p, p)
    w2d, bias = conv.weight.detach().reshape(d, -1), conv.bias.detach()
    fns = {
        "nn.Linear": lambda: linear(pixels),
        "patched": lambda: patched(x5),
        "F.linear": lambda: F.linear(pixels, w2d, bias),
        "conv": lambda: conv(x5),
    }
    if baseline is not None:
        before = copy.deepcopy(conv)
        baseline.patch(before, strict=True)
        fns["before"] = lambda: before(x5)

    def loop(fn, calls):
        return lambda: [fn() for _ in range(calls)]

    with torch.inference_mode():
        if not torch.equal(patched(x5).view(n, d), linear(pixels)):
            raise AssertionError(f"N={n}: the patched conv does not compute exactly nn.Linear")
        once = min(measure(loop(f, 20), device=device, warmup=1, repeats=3).min_ms / 20 for f in fns.values())
        calls = max(3, int(budget_ms / max(once, 1e-4)))
        times: dict[str, list[float]] = {name: [] for name in fns}
        names = list(fns)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                ms = measure(loop(fns[name], calls), device=device, warmup=0, repeats=1).times_ms[0]
                times[name].append(ms * 1e3 / calls)
    us = {name: min(v) for name, v in times.items()}
    spread = max(times["patched"]) / min(times["patched"])
    return {"n": n, "d": d, "calls": calls, "us": us, "spread": spread}


def render(
    rows: list[dict],
    header: str,
    n: int,
    rounds: int,
    fallback_rounds: int,
    command: str,
) -> str:
    clip = " (one 8-frame 512x384 Qwen3-VL clip)" if n == DEFAULT_PATCHES else ""
    # Channels-last columns only with --channels-last: the default table stays as it was.
    cl = any("conv_cl" in r["times"] for r in rows)
    lines = [
        f"Patch embedding, one forward over N = {n:,} patches{clip}, "
        f"median of {rounds} interleaved rounds ({fallback_rounds} for the fallback), milliseconds.",
        "",
        f"{header}",
        "",
        f"`{command}`",
        "",
        "| references | C x T x P x P -> D | device | dtype | conv | fallback | patched | F.linear "
        + ("| conv CL | patched CL " if cl else "")
        + "| conv / patched | fallback / patched | patched / linear |"
        + (" conv CL / patched | patched CL / linear |" if cl else ""),
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" * 4 if cl else ""),
    ]
    for r in rows:
        t = r["times"]
        m = {k: harness.median(v) for k, v in t.items() if v}
        cl_times = f"| {m['conv_cl']:.1f} | {m['patched_cl']:.1f} " if cl else ""
        cl_ratios = (
            f" {paired_ratio(t, 'conv_cl', 'patched'):.2f}x | {paired_ratio(t, 'patched_cl', 'linear'):.3f} |"
            if cl
            else ""
        )
        lines.append(
            f"| {', '.join(r['shape'].refs)} | {r['shape'].label} | {r['device']} | {r['dtype']} "
            f"| {m['conv']:.1f} | {_fallback_ms(t, r.get('fallback_once', False))} | {m['patched']:.1f} | {m['linear']:.1f} "
            + cl_times
            + f"| {paired_ratio(t, 'conv', 'patched'):.2f}x | {_fallback_ratio(t)} "
            f"| {paired_ratio(t, 'patched', 'linear'):.3f} |" + cl_ratios
        )
    lines += [
        "",
        "Times are medians; ratios are medians of the per-round ratios (each pair ran seconds apart, so a "
        "busy machine slows both alike).",
        "",
        "conv: stock `nn.Conv3d` (oneDNN on CPU, cuDNN on CUDA); fallback: the same conv with oneDNN/cuDNN "
        "disabled, the slow path torch >= 2.9 takes for bf16 5-D convs with cuDNN 9.8-9.14; patched: after "
        "`vlfast.patch`; F.linear: the raw GEMM on a pre-reshaped weight (the limit).",
    ]
    if any(r.get("fallback_once") or not r["times"]["fallback"] for r in rows):
        lines += [
            "",
            "fallback\\*: one call, its first (a call that takes seconds leaves no warm-up effect to "
            "measure); not timed: the run's `--fallback-budget` was spent on the shapes above it.",
        ]
    if cl:
        lines += [
            "",
            "conv CL, patched CL: the same two modules after `.to(memory_format=torch.channels_last_3d)`, "
            "called on a channels_last_3d input (converted before timing).",
        ]
    return "\n".join(lines)


def render_calls(
    calls: list[dict],
    shape: Shape,
    device: str,
    header: str,
    command: str,
    baseline: str | None,
    dtype: str = "fp32",
) -> str:
    before = f"before ({baseline})" if baseline else None
    lines = [
        f"Per call, module against module: the patched conv against an `nn.Linear` of the same weight, "
        f"{shape.label.split(' ->')[0]} kernel, {dtype}, {device}, one thread, OMP_WAIT_POLICY "
        f"{os.environ.get('OMP_WAIT_POLICY', 'default')}; minimum over 9 interleaved rounds of ~20 ms "
        "loops, microseconds. The caller's own `view` before and after the conv is left out: it is the "
        "same with or without the patch.",
        "",
        header,
        "",
        f"`{command}`",
        "",
        "| N | D | nn.Linear | patched | "
        + (f"{before} | " if before else "")
        + "F.linear | conv | patched - nn.Linear | "
        + ("before - nn.Linear | " if before else "")
        + "patched / nn.Linear | patched / F.linear | spread (patched, max/min) |",
        "|---:|---:|---:|---:|"
        + ("---:|" if before else "")
        + "---:|---:|---:|"
        + ("---:|" if before else "")
        + "---:|---:|---:|",
    ]
    for r in calls:
        us = r["us"]
        cells = [f"{r['n']}", f"{r['d']}", f"{us['nn.Linear']:.1f}", f"{us['patched']:.1f}"]
        if before:
            cells.append(f"{us['before']:.1f}")
        cells += [f"{us['F.linear']:.1f}", f"{us['conv']:.1f}", f"{us['patched'] - us['nn.Linear']:+.1f}"]
        if before:
            cells.append(f"{us['before'] - us['nn.Linear']:+.1f}")
        cells += [
            f"{us['patched'] / us['nn.Linear']:.3f}",
            f"{us['patched'] / us['F.linear']:.3f}",
            f"{r['spread']:.2f}x",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--refs", nargs="+", default=list(REFERENCES), help="reference names (default: all)")
    ap.add_argument("--patches", type=int, default=DEFAULT_PATCHES, help="patches per call (default 3072)")
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    ap.add_argument(
        "--devices", nargs="+", default=None, help="cpu and/or cuda (default: cpu, +cuda if present)"
    )
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--fallback-rounds", type=int, default=3)
    ap.add_argument(
        "--fallback-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="time the fallback for at most this long in all; the shapes after it show 'not timed' "
        "(default: no limit). A fallback call over 10 s is timed once either way",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    ap.add_argument(
        "--no-save", action="store_true", help="print only; write no result JSON (benchmarks/harness.py)"
    )
    ap.add_argument(
        "--baseline",
        metavar="REV",
        help="also time the patch as it was at this git revision (per-call table), in the same run",
    )
    ap.add_argument("--per-call-only", action="store_true", help="only the per-call table (about a minute)")
    ap.add_argument(
        "--no-per-call",
        action="store_true",
        help="leave the per-call table out (two minutes on a 2-core CPU)",
    )
    ap.add_argument(
        "--call-dtype",
        choices=sorted(DTYPES),
        default="fp32",
        help="dtype of the per-call table (bf16 on a GPU: the training case; fp32 on a CPU without native bf16)",
    )
    ap.add_argument(
        "--channels-last",
        action="store_true",
        help="also time conv and patched with module and input in channels_last_3d (conv CL, patched CL)",
    )
    args = ap.parse_args(argv)
    if args.per_call_only and args.no_per_call:
        ap.error("--per-call-only and --no-per-call leave nothing to time")
    # torch warns about oneDNN TF32 on Intel GPUs each time the mkldnn flags change: noise here.
    warnings.filterwarnings("ignore", message="TF32 acceleration on top of oneDNN")
    if args.patches < 1 or args.rounds < 1 or not 1 <= args.fallback_rounds <= args.rounds:
        ap.error("need --patches >= 1, --rounds >= 1 and 1 <= --fallback-rounds <= --rounds")
    if args.threads:
        torch.set_num_threads(args.threads)
    devices = args.devices or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    for name in args.refs:
        if name not in REFERENCES:
            ap.error(f"unknown reference {name!r}; choose from {', '.join(REFERENCES)}")
    shapes = reference_shapes(args.refs)
    baseline = load_baseline(args.baseline) if args.baseline else None
    command = "python benchmarks/patch_embed.py " + " ".join(argv if argv is not None else sys.argv[1:])
    dev = torch.device("cuda") if "cuda" in devices else torch.device("cpu")
    budget = FallbackBudget(args.fallback_budget)
    with harness.Run(
        "patch_embed" + ("-" + "-".join(devices) if devices != ["cpu"] else ""), argv, save=not args.no_save
    ) as run:
        _run(args, shapes, devices, baseline, command, dev, budget, run)
    return 0


def _rows_json(rows: list[dict]) -> list[dict]:
    """The result file's rows: each variant's median, min and max ms, conv / patched of the medians."""
    out = []
    for r in rows:
        row = {"shape": r["shape"].label, "device": r["device"], "dtype": r["dtype"]}
        for k, v in r["times"].items():
            if v:
                row[k] = harness.spread(v, digits=3)
        med = {k: harness.median(v) for k, v in r["times"].items() if v}
        row["conv_over_patched"] = round(med["conv"] / med["patched"], 2)
        row["patched_over_linear"] = round(med["patched"] / med["linear"], 2)
        out.append(row)
    return out


def _run(args, shapes, devices, baseline, command, dev, budget, run) -> None:
    rows = []
    for dev_name in [] if args.per_call_only else devices:
        device = torch.device(dev_name)
        for shape in shapes:
            for dt in args.dtypes:
                before = budget.once
                times = bench_shape(
                    shape,
                    DTYPES[dt],
                    device,
                    args.patches,
                    args.rounds,
                    args.fallback_rounds,
                    args.channels_last,
                    budget,
                )
                once = budget.once > before  # timed once: one slow call
                rows.append(
                    {"shape": shape, "dtype": dt, "device": dev_name, "times": times, "fallback_once": once}
                )
                print(
                    f"{shape.label:>22} {dev_name:>4} {dt}: "
                    + "  ".join(f"{k} {harness.median(v):.1f} ms" for k, v in times.items() if v),
                    file=sys.stderr,
                    flush=True,
                )
    tables = []
    if rows:
        table = render(rows, hardware(dev), args.patches, args.rounds, args.fallback_rounds, command.strip())
        tables.append(table)
    for dev_name in [] if args.no_per_call else devices:
        calls = call_overhead_us(shapes[0], torch.device(dev_name), baseline, dtype=DTYPES[args.call_dtype])
        table = render_calls(
            calls, shapes[0], dev_name, hardware(dev), command.strip(), args.baseline, args.call_dtype
        )
        run.table("per_call", [{"device": dev_name, "dtype": args.call_dtype, **c} for c in calls])
        if dev_name == "cpu" or len(devices) == 1:
            tables.append(table)
        else:
            print(table)
    for table in tables:
        print(table + "\n")
    run.table("patch_embed", _rows_json(rows))


if __name__ == "__main__":
    raise SystemExit(main())
