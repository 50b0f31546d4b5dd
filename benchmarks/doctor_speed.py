"""How long ``vlfast doctor`` takes with no arguments, and whether its probe agrees with the benchmark.

Two measurements in one run, on this machine:

1. Wall time of ``vlfast doctor --json`` in a fresh interpreter (imports included), ``--runs`` times;
   the target is under 30 s on a 2-core CPU.
2. For every Conv3d patch-embedding shape the doctor probed, the conv / GEMM ratio it reported against
   the conv / F.linear ratio that ``benchmarks/patch_embed.py`` measures directly on the same shape,
   patch count, dtype and device right after each doctor run (interleaved rounds, medians of per-round
   ratios); per shape, the medians over runs are compared. The target is agreement within 25%.

    python benchmarks/doctor_speed.py                 # CPU, the doctor's own defaults
    python benchmarks/doctor_speed.py --runs 3 --rounds 9
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import patch_embed  # noqa: E402  (benchmarks/patch_embed.py: the direct measurement)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def run_doctor(extra: list[str]) -> tuple[float, dict]:
    """Wall seconds of one ``vlfast doctor --json`` in a new interpreter, and its report."""
    cmd = [sys.executable, "-m", "vlfast.cli.main", "doctor", "--json", *extra]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    wall = time.perf_counter() - t0
    if out.returncode not in (0, 1):
        raise SystemExit(f"doctor failed ({out.returncode}):\n{out.stderr}")
    return wall, json.loads(out.stdout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="doctor runs for the wall-time median")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds of the direct measurement")
    ap.add_argument(
        "--doctor-args", default="", help="extra arguments for vlfast doctor, e.g. '--dtype float32'"
    )
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", message="TF32 acceleration on top of oneDNN")

    walls: list[float] = []
    doctor_ratios: dict[str, list[float]] = {}  # shape label -> ratio per doctor run
    direct_ratios: dict[str, list[float]] = {}  # shape label -> benchmark ratio measured right after
    for i in range(args.runs):
        # Each doctor run is followed at once by the direct measurement of every Conv3d shape it probed,
        # so both see the same machine; per shape, the medians over runs are compared.
        wall, report = run_doctor(args.doctor_args.split())
        walls.append(wall)
        facts = report["facts"]
        device, dtype = torch.device(facts["device"]), DTYPES[facts["dtype"]]
        for f in report["findings"]:
            s = f["shape"]
            if s["kind"] != "Conv3d" or f["ratio"] is None:
                continue
            t, p, _ = s["kernel_size"]
            refs = tuple(n.split(":")[0] for n in s["names"])
            shape = patch_embed.Shape(refs, s["in_channels"], t, p, s["out_channels"])
            ms = patch_embed.bench_shape(shape, dtype, device, s["windows"], args.rounds, 1)
            doctor_ratios.setdefault(shape.label, []).append(f["ratio"])
            direct_ratios.setdefault(shape.label, []).append(patch_embed.paired_ratio(ms, "conv", "linear"))
        print(
            f"doctor run {i + 1}: {wall:.1f} s wall, verdict {report['verdict']}; doctor / direct ratios: "
            + ", ".join(f"{doctor_ratios[k][-1]:.2f}/{direct_ratios[k][-1]:.2f}" for k in doctor_ratios),
            file=sys.stderr,
            flush=True,
        )
    print(
        f"\nvlfast doctor (no --model), {args.runs} runs: median {statistics.median(walls):.1f} s, "
        f"max {max(walls):.1f} s wall (target < 30 s)"
    )
    print(f"machine: {patch_embed.hardware(device)}")
    print(f"device {device}, dtype {facts['dtype']}, {report['patches_per_sample']:,} patches per call\n")
    print(
        "| shape (C x T x P x P -> D) | doctor conv/GEMM (runs) | benchmark conv/F.linear (runs) | difference of medians |"
    )
    print("|---|---:|---:|---:|")
    worst = 0.0
    for label, ours in doctor_ratios.items():
        theirs = direct_ratios[label]
        diff = statistics.median(ours) / statistics.median(theirs) - 1
        worst = max(worst, abs(diff))
        print(
            f"| {label} | {statistics.median(ours):.2f}x ({', '.join(f'{r:.2f}' for r in ours)}) "
            f"| {statistics.median(theirs):.2f}x ({', '.join(f'{r:.2f}' for r in theirs)}) | {diff:+.0%} |"
        )
    print(f"\nworst disagreement {worst:.0%} (target <= 25%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
