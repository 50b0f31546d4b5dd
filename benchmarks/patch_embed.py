"""Patch-embedding speed: stock ``nn.Conv3d`` vs vlfast's patched conv vs raw ``F.linear`` (the limit).

For every reference tower's patch-embed shape (read from ``build_reference(name, device="meta")``, so
nothing is allocated or downloaded) this times one forward over N patches, shaped the way Qwen-VL calls
it: ``pixel_values.view(-1, C, T, P, P)``. Four variants:

- ``conv``: the stock module (oneDNN on CPU, cuDNN on CUDA).
- ``patched``: the same module after ``vlfast.patch`` (a view plus one ``F.linear``).
- ``linear``: ``F.linear(x, W2d, b)`` on a pre-reshaped weight: the GEMM itself, the physical limit.
- ``fallback``: the stock conv with oneDNN (CPU) or cuDNN (CUDA) disabled, i.e. the vol2col /
  slow_conv3d path that torch 2.9+ takes for bf16/fp16 5-D convs on cuDNN 9.8-9.14.

Variants are interleaved round by round (conv, patched, linear, fallback, next round...) and medians
taken, so a noisy shared machine slows them alike and the ratios from one run stay comparable. The
fallback is slow enough (seconds per call in bf16) that it gets fewer rounds.

    python benchmarks/patch_embed.py                       # all shapes, fp32 + bf16, CPU (+ CUDA)
    python benchmarks/patch_embed.py --refs qwen3-vl-4b --write-readme
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import vlfast
from vlfast.models import REFERENCES, build_reference, tower_spec
from vlfast.timing import measure

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- bench:patch_embed:start -->", "<!-- bench:patch_embed:end -->"
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


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


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
    shape: Shape, dtype: torch.dtype, device: torch.device, n: int, rounds: int, fallback_rounds: int
) -> dict[str, list[float]]:
    """Milliseconds per variant and round (the fallback in the first rounds only) for one configuration."""
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
    times: dict[str, list[float]] = {k: [] for k in variants}
    with torch.inference_mode():
        _check_agreement(conv, patched, pixels, w2d, bias)
        for fn in variants.values():  # warm-up: allocator, oneDNN primitive cache, cuBLAS handles
            measure(fn, device=device, warmup=0, repeats=1)
        names = list(variants)
        for r in range(rounds):
            # Rotate the order each round so no variant always runs right after the slow fallback.
            for name in names[r % len(names) :] + names[: r % len(names)]:
                if name == "fallback" and r >= fallback_rounds:
                    continue
                times[name].append(measure(variants[name], device=device, warmup=0, repeats=1).times_ms[0])
    return times


def paired_ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    """Median over rounds of ``a / b`` within the same round: both ran seconds apart under the same load."""
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


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


def call_overhead_us(
    shape: Shape, device: torch.device, calls: int = 200, rounds: int = 9
) -> dict[str, float]:
    """Microseconds per call with the shape's kernel but N = 4 patches and 8 outputs, fp32, one thread.

    The GEMM then costs next to nothing, which isolates what the patch itself adds per call (module
    call, shape checks, views): the large-N ratio patched / linear is 1 only within the machine's noise.
    """
    c, t, p, d = shape.in_channels, shape.temporal, shape.patch, 8
    conv = nn.Conv3d(c, d, (t, p, p), stride=(t, p, p)).to(device)
    patched = nn.Conv3d(c, d, (t, p, p), stride=(t, p, p)).to(device)
    vlfast.patch(patched, strict=True)
    pixels = torch.randn(4, c * t * p * p, device=device)
    w2d, bias = conv.weight.detach().reshape(d, -1), conv.bias.detach()
    fns = {
        "conv": lambda: conv(pixels.view(-1, c, t, p, p)).view(-1, d),
        "patched": lambda: patched(pixels.view(-1, c, t, p, p)).view(-1, d),
        "linear": lambda: F.linear(pixels, w2d, bias),
    }

    def loop(fn):
        return lambda: [fn() for _ in range(calls)]

    times: dict[str, list[float]] = {k: [] for k in fns}
    threads = torch.get_num_threads()
    # One thread: waking a second one for a 4 x 1536 GEMM costs more, and more erratically, than the
    # work itself on a busy machine. The minimum, as timeit advises for fixed costs.
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for fn in fns.values():
                loop(fn)()
            for _ in range(rounds):
                for k, fn in fns.items():
                    times[k].append(measure(loop(fn), device=device, warmup=0, repeats=1).times_ms[0])
    finally:
        torch.set_num_threads(threads)
    return {k: min(v) * 1e3 / calls for k, v in times.items()}


def render(
    rows: list[dict],
    overheads: list[dict],
    header: str,
    n: int,
    rounds: int,
    fallback_rounds: int,
    command: str,
) -> str:
    clip = " (one 8-frame 512x384 Qwen3-VL clip)" if n == DEFAULT_PATCHES else ""
    lines = [
        f"Patch embedding, one forward over N = {n:,} patches{clip}, "
        f"median of {rounds} interleaved rounds ({fallback_rounds} for the fallback), milliseconds.",
        "",
        f"{header}",
        "",
        f"`{command}`",
        "",
        "| references | C x T x P x P -> D | device | dtype | conv | fallback | patched | F.linear "
        "| conv / patched | fallback / patched | patched / linear |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        t = r["times"]
        m = {k: statistics.median(v) for k, v in t.items()}
        lines.append(
            f"| {', '.join(r['shape'].refs)} | {r['shape'].label} | {r['device']} | {r['dtype']} "
            f"| {m['conv']:.1f} | {m['fallback']:.1f} | {m['patched']:.1f} | {m['linear']:.1f} "
            f"| {paired_ratio(t, 'conv', 'patched'):.2f}x | {paired_ratio(t, 'fallback', 'patched'):.1f}x "
            f"| {paired_ratio(t, 'patched', 'linear'):.3f} |"
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
    for o in overheads:
        us = o["us"]
        lines += [
            "",
            f"Per-call cost with the {o['shape'].label.split(' ->')[0]} kernel, 8 outputs, N = 4 patches, fp32, "
            f"{o['device']}, one thread, best of 9 x 200 calls (the GEMM next to free): conv {us['conv']:.0f} us, patched {us['patched']:.0f} us, F.linear {us['linear']:.0f} us; "
            f"the patch itself adds {us['patched'] - us['linear']:.0f} us per call.",
        ]
    return "\n".join(lines)


def write_readme(table: str, path: Path = README) -> None:
    text = path.read_text() if path.exists() else ""
    block = f"{START}\n{table}\n{END}"
    if START in text and END in text:
        before, rest = text.split(START, 1)
        after = rest.split(END, 1)[1]
        text = before + block + after
    else:
        text = text.rstrip("\n") + "\n\n## Patch-embedding benchmark\n\n" + block + "\n"
    path.write_text(text)


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
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    ap.add_argument("--write-readme", action="store_true", help=f"write the table into {README.name}")
    args = ap.parse_args(argv)
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
    rows = []
    for dev_name in devices:
        device = torch.device(dev_name)
        for shape in shapes:
            for dt in args.dtypes:
                times = bench_shape(
                    shape, DTYPES[dt], device, args.patches, args.rounds, args.fallback_rounds
                )
                rows.append({"shape": shape, "dtype": dt, "device": dev_name, "times": times})
                print(
                    f"{shape.label:>22} {dev_name:>4} {dt}: "
                    + "  ".join(f"{k} {statistics.median(v):.1f} ms" for k, v in times.items()),
                    file=sys.stderr,
                    flush=True,
                )
    overheads = [
        {"shape": shapes[0], "device": d, "us": call_overhead_us(shapes[0], torch.device(d))} for d in devices
    ]
    command = "python benchmarks/patch_embed.py " + " ".join(argv if argv is not None else sys.argv[1:])
    dev = torch.device("cuda") if "cuda" in devices else torch.device("cpu")
    table = render(
        rows, overheads, hardware(dev), args.patches, args.rounds, args.fallback_rounds, command.strip()
    )
    print(table)
    if args.write_readme:
        write_readme(table)
        print(f"\nwrote the table into {README}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
