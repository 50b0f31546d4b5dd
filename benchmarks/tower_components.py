"""Where one clip's tower forward goes, stock against the slow path against patched (issue 40, item 1).

One vision tower (default ``ref:qwen3-vl-4b``: published dimensions, random weights) on one synthetic clip
at the report's size (8 frames of 512x384: grid (4, 24, 32), 3,072 patches), timed by component with the
profiler's own hooks (``vlfast.diagnosis.profiler.time_components``: patch_embed, position embedding, rotary,
blocks, DeepStack mergers, merger, the tower's inline work, the whole forward). Three variants:

- ``stock``: the conv as this device runs it (oneDNN on CPU, cuDNN on CUDA);
- ``slow``: the same conv with oneDNN (CPU) or cuDNN (CUDA) disabled *for the Conv3d alone*, the
  vol2col / slow_conv3d path torch >= 2.9 takes for bf16/fp16 5-D convs when cuDNN is 9.8-9.14 (the rest of
  the tower keeps its kernels); timed ``--slow-calls`` times (default 1, as the report timed it: one call
  costs seconds on a CPU and 22-41 s on an H200);
- ``patched``: after ``vlfast.patch``.

Stock and patched alternate round by round after a warm-up round (patching is an attribute swap), so a
busy machine slows both alike; the table gives medians, the ratios are medians of the per-round ratios with
their range. The slow path runs after the last round, the tower warm. The machine, torch, thread count,
OMP_WAIT_POLICY and the load average at start and end are printed with the table.

    python benchmarks/tower_components.py                       # CPU or CUDA, bf16, 3,072 patches
    python benchmarks/tower_components.py --device cuda --json  # what benchmarks/gpu.py runs
    python benchmarks/tower_components.py --tiny --frame-size 64x64 --rounds 1   # seconds: the plumbing
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # timing on a shared CPU: idle threads must sleep

import torch  # noqa: E402
from torch import nn  # noqa: E402

from vlfast.diagnosis.probe import selected_backend  # noqa: E402
from vlfast.diagnosis.profiler import INLINE, component_modules, time_components  # noqa: E402
from vlfast.models import build_reference, synthetic_inputs, tower_spec  # noqa: E402
from vlfast.patching.gemm import patch, unpatch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (benchmarks/harness.py)
from harness import cpu_model  # noqa: E402

VARIANTS = ("stock", "slow", "patched")
ORDER = ("patch_embed", "position_embedding", "rotary_embedding", "blocks", "deepstack_mergers", "merger")
FORWARD = "forward (total)"


def clip_grid(tower: nn.Module, frames: int, width: int, height: int) -> tuple[int, int, int]:
    """One clip's patch grid as the Qwen-VL processors make it: frames padded to a multiple of T, each side
    rounded down to a multiple of patch x merge (at least one merge window)."""
    spec = tower_spec(tower)
    unit = spec.patch_size * spec.spatial_merge_size
    t = max(1, math.ceil(frames / spec.temporal_patch_size))
    return (
        t,
        max(1, height // unit) * spec.spatial_merge_size,
        max(1, width // unit) * spec.spatial_merge_size,
    )


def _backend_off(device: torch.device):
    if device.type == "cuda":
        return torch.backends.cudnn.flags(enabled=False)
    return torch.backends.mkldnn.flags(enabled=False)


warnings.filterwarnings("ignore", "TF32 acceleration on top of oneDNN")  # mkldnn.flags() says it each time


@contextmanager
def slow_path(tower: nn.Module, device: torch.device):
    """oneDNN / cuDNN disabled around each Conv3d call of ``tower`` and nowhere else."""
    open_: list = []

    def pre(module, args):
        flags = _backend_off(device)
        flags.__enter__()
        open_.append(flags)

    def post(module, args, output):
        open_.pop().__exit__(None, None, None)

    convs = [m for m in tower.modules() if isinstance(m, nn.Conv3d)]
    handles = [h for m in convs for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        while open_:  # a forward that raised inside the conv
            open_.pop().__exit__(None, None, None)


def conv_backends(tower: nn.Module, pixels: torch.Tensor, device: torch.device) -> dict[str, str | None]:
    """ATen's conv backend for the patch embedding, as the stock and the slow variant call it."""
    conv = next(m for m in tower.modules() if isinstance(m, nn.Conv3d))
    x = pixels[:1].view(1, conv.in_channels, *conv.kernel_size).to(conv.weight.dtype)
    out = {"stock": selected_backend(x, conv.weight, conv.bias, tuple(conv.kernel_size))}
    with _backend_off(device):
        out["slow"] = selected_backend(x, conv.weight, conv.bias, tuple(conv.kernel_size))
    return out


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def machine(device: torch.device) -> dict:
    info = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }
    if device.type == "cuda":
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        info.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda, cudnn=cudnn)
    return info


def run(
    model: str = "ref:qwen3-vl-4b",
    *,
    tiny: bool = False,
    device: str = "cpu",
    dtype: str = "bfloat16",
    frames: int = 8,
    width: int = 512,
    height: int = 384,
    rounds: int = 3,
    warmup: int = 1,
    slow_calls: int = 1,
    say=lambda line: None,
) -> dict:
    """Every variant's component medians and per-round times, the ratios, and the facts beside them."""
    dev = torch.device(device)
    dt = getattr(torch, dtype)
    load_start = _load()
    with harness.Stopwatch() as sw:
        tower = build_reference(model.removeprefix("ref:"), tiny=tiny, device=dev, dtype=dt).eval()
    build_s = sw.wall
    grid = clip_grid(tower, frames, width, height)
    pixels, grid_thw = synthetic_inputs(tower, [grid], dtype=dt, device=dev)
    say(f"{model}{' (tiny)' if tiny else ''} on {dev} ({dtype}), grid {grid}: {pixels.shape[0]:,} patches")
    per_round: dict[str, list[tuple[float, dict[str, float]]]] = {v: [] for v in VARIANTS}
    unpatch(tower)
    for r in range(warmup + rounds):
        ms = {}
        for variant in ("stock", "patched"):
            (patch if variant == "patched" else unpatch)(tower)
            total, labels, _ = time_components(tower, (pixels, grid_thw), dev)
            ms[variant] = (total, labels.get("patch_embed", 0.0))
            if r >= warmup:
                per_round[variant].append((total, labels))
        unpatch(tower)
        what = f"round {r - warmup + 1}/{rounds}" if r >= warmup else f"warm-up {r + 1}/{warmup}"
        say(f"{what}: " + ", ".join(f"{v} {f:,.1f} ms (patch_embed {p:,.1f})" for v, (f, p) in ms.items()))
    with slow_path(tower, dev):
        for k in range(slow_calls):
            total, labels, _ = time_components(tower, (pixels, grid_thw), dev)
            per_round["slow"].append((total, labels))
            say(f"slow path {k + 1}/{slow_calls}: {total:,.0f} ms")
    backends = conv_backends(tower, pixels, dev)
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    touched = {
        label
        for label, _, m in component_modules(tower)
        if any(isinstance(x, nn.Conv3d) for x in m.modules())
    }
    return summarise(per_round, touched) | {
        "model": model + (" (tiny)" if tiny else ""),
        "device": str(dev),
        "dtype": dtype,
        "frames": frames,
        "frame_size": f"{width}x{height}",
        "grid_thw": list(grid),
        "patches": int(pixels.shape[0]),
        "rounds": rounds,
        "slow_calls": slow_calls,
        "conv_backend": backends,
        "build_s": round(build_s, 2),
        "cuda_peak_gib": round(peak, 2) if peak is not None else None,
        "machine": machine(dev),
        "load_average": {"start": load_start, "end": _load()},
    }


def summarise(per_round: dict[str, list[tuple[float, dict[str, float]]]], touched: set[str]) -> dict:
    """Medians per component and variant; stock/patched and slow/patched ratios (medians of per-round
    ratios where rounds pair up, with their min and max) for the forward and the components holding the
    conv. The others compute the same thing in every variant (the patch is exact): their ratios would only
    be the machine's noise, so, as in ``vlfast profile``, none is given."""
    parts = [p for p in ORDER if any(p in labels for rs in per_round.values() for _, labels in rs)]
    parts += sorted({p for rs in per_round.values() for _, labels in rs for p in labels} - set(parts))

    def series(variant: str, part: str) -> list[float]:
        out = []
        for total, labels in per_round[variant]:
            if part == FORWARD:
                out.append(total)
            elif part == INLINE:
                out.append(max(0.0, total - sum(labels.values())))
            else:
                out.append(labels.get(part, 0.0))
        return out

    rows = []
    for part in [*parts, INLINE, FORWARD]:
        s = {v: series(v, part) for v in VARIANTS}
        med = {v: harness.median(x) if x else None for v, x in s.items()}
        ratios = [a / b for a, b in zip(s["stock"], s["patched"]) if b > 0]
        row = {
            "component": part,
            "touched": part in touched or part == FORWARD,
            **{f"{v}_ms": med[v] for v in VARIANTS},
        }
        if not row["touched"]:
            ratios = []
        row["stock_over_patched"] = harness.median(ratios) if ratios else None
        row["stock_over_patched_range"] = [min(ratios), max(ratios)] if ratios else None
        row["slow_over_patched"] = (
            med["slow"] / med["patched"] if row["touched"] and med["slow"] and med["patched"] else None
        )
        row["stock_rounds_ms"], row["patched_rounds_ms"], row["slow_calls_ms"] = (
            s["stock"],
            s["patched"],
            s["slow"],
        )
        rows.append(row)
    forward = rows[-1]
    shares = {
        v: (rows[0][f"{v}_ms"] / forward[f"{v}_ms"]) if rows and forward[f"{v}_ms"] else None
        for v in VARIANTS
    }
    return {"rows": rows, "patch_embed_share": shares if parts[:1] == ["patch_embed"] else None}


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if v >= 100 else f"{v:,.1f}" if v >= 1 else f"{v:.2f}"


def _x(v: float | None, rng: list[float] | None = None, touched: bool = True) -> str:
    if not touched:
        return "no conv"
    if v is None:
        return "-"
    text = f"{v:,.0f}x" if v >= 100 else f"{v:.2f}x"
    return text + (f" ({rng[0]:.2f}-{rng[1]:.2f})" if rng and rng[0] != rng[1] else "")


def render(result: dict) -> str:
    m, load = result["machine"], result["load_average"]
    where = f"GPU: {m['gpu']}, CUDA {m['cuda']}, cuDNN {m['cudnn']}; " if m.get("gpu") else ""
    off = "cuDNN" if result["device"].startswith("cuda") else "oneDNN"
    be = result["conv_backend"]
    lines = [
        f"{result['model']} tower, {result['dtype']}, {result['device']}: one {result['frames']}-frame "
        f"{result['frame_size']} clip, grid {tuple(result['grid_thw'])} = {result['patches']:,} patches; "
        f"medians of {result['rounds']} alternating rounds (slow path: {result['slow_calls']} call), ms.",
        "",
        f"{where}CPU: {m['cpu']}, {m['cores']} cores, {m['threads']} torch threads; torch {m['torch']}; "
        f"Python {m['python']}; OMP_WAIT_POLICY {m['omp_wait_policy']}; load average {load['start']} at the "
        f"start, {load['end']} at the end",
        "",
        f"| component | stock ({be.get('stock')}) | slow path ({off} off for the conv: {be.get('slow')}) | patched "
        "| stock / patched (range) | slow / patched |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        name = f"**{r['component']}**" if r["component"] == FORWARD else r["component"]
        lines.append(
            f"| {name} | {_ms(r['stock_ms'])} | {_ms(r['slow_ms'])} | {_ms(r['patched_ms'])} "
            f"| {_x(r['stock_over_patched'], r['stock_over_patched_range'], r['touched'])} "
            f"| {_x(r['slow_over_patched'], None, r['touched'])} |"
        )
    share = result.get("patch_embed_share") or {}
    if share:
        lines += [
            "",
            "patch_embed's share of the forward: "
            + ", ".join(f"{v} {share[v]:.1%}" for v in VARIANTS if share.get(v) is not None),
        ]
    return "\n".join(lines)


def _size(text: str) -> tuple[int, int]:
    w, _, h = text.lower().partition("x")
    return int(w), int(h)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", default="ref:qwen3-vl-4b", help="a reference, ref:NAME (default ref:qwen3-vl-4b)"
    )
    ap.add_argument("--tiny", action="store_true", help="the reference at test size (seconds: the plumbing)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--frame-size", default="512x384", help="WIDTHxHEIGHT of a frame (default 512x384)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds of stock and patched, alternating")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--slow-calls", type=int, default=1, help="timed forwards on the slow path (0: none)")
    ap.add_argument("--json", action="store_true", help="print JSON (the table is its 'markdown')")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0 or args.slow_calls < 0 or args.frames < 1:
        ap.error("need --rounds >= 1, --warmup >= 0, --slow-calls >= 0, --frames >= 1")
    width, height = _size(args.frame_size)
    result = run(
        args.model,
        tiny=args.tiny,
        device=args.device,
        dtype=args.dtype,
        frames=args.frames,
        width=width,
        height=height,
        rounds=args.rounds,
        warmup=args.warmup,
        slow_calls=args.slow_calls,
        say=lambda line: print(line, file=sys.stderr, flush=True),
    )
    result["markdown"] = render(result)
    result["command"] = "python benchmarks/tower_components.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    harness.save_result("tower_components", result, argv)
    print(json.dumps(result, indent=2) if args.json else result["markdown"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
