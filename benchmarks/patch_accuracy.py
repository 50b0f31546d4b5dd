"""Each path's error against float64 for the patch embedding, forward and weight gradient (issue 40, item 3).

Three paths of one reference's patch-embedding Conv3d (default ``ref:qwen3-vl-4b``: 3 -> 1024, kernel
(2, 16, 16), random weights, seed 0): the stock conv as the device runs it (oneDNN on CPU, cuDNN on CUDA),
the slow path (the same conv with oneDNN / cuDNN disabled: vol2col / slow_conv3d), and the patched GEMM.
The figures are ``vlfast verify``'s own accuracy check (``vlfast.verify`` on the bare conv, scope
"accuracy"): inputs, weights and upstream gradient rounded to the dtype once, a float64 copy of the same
layer as the reference, ``||path - float64|| / ||float64||`` over ``--windows`` windows (at most 512). The
stock and patched rows come from one call as the device runs; the slow path's row is the stock row of a
second call with the backend disabled (that call's patched row is not used: the GEMM does not go through
the backend the flag turns off on CUDA, and on CPU the flag also changes the bf16 GEMM's kernel).

    python benchmarks/patch_accuracy.py                          # CPU: bf16 and fp16, about 1.5 min
    python benchmarks/patch_accuracy.py --device cuda --windows 128 --json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import warnings
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

import vlfast  # noqa: E402
from vlfast.diagnosis.probe import selected_backend  # noqa: E402
from vlfast.models import build_reference  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (benchmarks/harness.py)
from harness import cpu_model  # noqa: E402

warnings.filterwarnings("ignore", "TF32 acceleration on top of oneDNN")


def accuracy_rows(report) -> dict[str, dict[str, float]]:
    """dtype -> the accuracy check's metrics (stock_fwd_rel, stock_wgrad_rel, patched_fwd_rel, ...)."""
    return {c.dtype: dict(c.metrics) for c in report.checks if c.scope == "accuracy" and c.metrics}


def run(model: str, device: str, dtypes: list[str], windows: int, tiny: bool = False) -> dict:
    dev = torch.device(device)
    tower = build_reference(model.removeprefix("ref:"), tiny=tiny, device=dev)
    conv = next(m for m in tower.modules() if isinstance(m, torch.nn.Conv3d))
    off = torch.backends.cudnn.flags if dev.type == "cuda" else torch.backends.mkldnn.flags
    clock = harness.Stopwatch()
    usual = vlfast.verify(conv, dtypes=["float32", *dtypes], device=dev, n_windows=windows)
    usual_s = clock.lap()
    with off(enabled=False):
        slow = vlfast.verify(conv, dtypes=["float32", *dtypes], device=dev, n_windows=windows)
    slow_s = clock.lap()
    a, b = accuracy_rows(usual), accuracy_rows(slow)
    rows = []
    for dtype in a:
        # ATen's conv backend for each conv path (a CPU without native fp16 runs Slow3d with oneDNN on too)
        x = torch.zeros(1, conv.in_channels, *conv.kernel_size, device=dev, dtype=getattr(torch, dtype))
        w = conv.weight.detach().to(x.dtype)
        backend = {"stock": selected_backend(x, w, None, tuple(conv.kernel_size)), "patched": "GEMM"}
        with off(enabled=False):
            backend["slow path"] = selected_backend(x, w, None, tuple(conv.kernel_size))
        for path, src, key in (("stock", a, "stock"), ("slow path", b, "stock"), ("patched", a, "patched")):
            m = src.get(dtype, {})
            rows.append(
                {
                    "dtype": dtype,
                    "path": path,
                    "backend": backend[path],
                    "forward_rel": m.get(f"{key}_fwd_rel"),
                    "weight_grad_rel": m.get(f"{key}_wgrad_rel"),
                }
            )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {
        "model": model + (" (tiny)" if tiny else ""),
        "conv": f"Conv3d {conv.in_channels}->{conv.out_channels} k={'x'.join(map(str, conv.kernel_size))}",
        "device": str(dev),
        "windows": min(windows, 512),
        "rows": rows,
        "passed": usual.passed,
        "seconds": {"usual": round(usual_s, 1), "slow": round(slow_s, 1)},
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        },
        "load_average_end": round(load, 2) if load is not None else None,
    }


def render(r: dict) -> str:
    m = r["machine"]
    where = f"GPU: {m['gpu']}; " if m.get("gpu") else ""
    off = "cuDNN" if r["device"].startswith("cuda") else "oneDNN"
    lines = [
        f"{r['model']} patch embedding ({r['conv']}), {r['device']}: relative L2 error against float64 over "
        f"{r['windows']} windows (vlfast verify's accuracy check); slow path: {off} disabled.",
        "",
        f"{where}CPU: {m['cpu']}, {m['cores']} cores; torch {m['torch']}; Python {m['python']}; load average "
        f"{r['load_average_end']} at the end",
        "",
        "| dtype | path | backend | forward | weight gradient |",
        "|---|---|---|---:|---:|",
    ]
    for row in r["rows"]:
        f = "-" if row["forward_rel"] is None else f"{row['forward_rel']:.3g}"
        g = "-" if row["weight_grad_rel"] is None else f"{row['weight_grad_rel']:.3g}"
        lines.append(f"| {row['dtype']} | {row['path']} | {row.get('backend')} | {f} | {g} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="ref:qwen3-vl-4b")
    ap.add_argument("--tiny", action="store_true", help="the reference at test size (the plumbing)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"], choices=("bfloat16", "float16"))
    ap.add_argument(
        "--windows", type=int, default=512, help="windows per check (the accuracy check uses <= 512)"
    )
    ap.add_argument("--json", action="store_true", help="print JSON (the table is its 'markdown')")
    args = ap.parse_args(argv)
    result = run(args.model, args.device, args.dtypes, args.windows, args.tiny)
    result["markdown"] = render(result)
    result["command"] = "python benchmarks/patch_accuracy.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    harness.save_result("patch_accuracy", result, argv)
    print(json.dumps(result, indent=2) if args.json else result["markdown"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
