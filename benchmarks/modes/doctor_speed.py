"""How long ``vlfast doctor`` takes with no arguments, quiet and beside a busy process, on this CPU as it
is and limited to AVX2 (no native bf16), and whether its probe agrees with the direct benchmark.

1. Wall time of ``vlfast doctor --json`` in a fresh interpreter (imports included), ``--runs`` times per
   row, with ``OMP_WAIT_POLICY=PASSIVE`` (what the ``vlfast`` command sets). Rows: each instruction set
   of ``--isa`` (``native``; ``avx2``: ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``, which makes
   an AVX-512-BF16 CPU compute like the AVX2-only machine of issue 20) x each of ``--load`` (``quiet``;
   ``busy``: beside one ``python -c 'while True: pass'``). Targets (issue 20): <= 30 s quiet, <= 60 s busy,
   the probe within 20% of its budget.
2. With ``--agreement``, for every Conv3d shape the doctor probed in the native quiet row, its conv / GEMM
   ratio against the conv / F.linear ratio ``benchmarks/patch_embed.py`` measures directly on the same
   shape, patch count, dtype and device right after each run. Target: within 25%.

The table it prints is ready to paste into docs/doctor.md and the README; it names the CPU, each row's
instruction set and dtype, the torch version and the load average during the row.

    python benchmarks/commands.py doctor                         # 4 rows x 3 runs
    python benchmarks/commands.py doctor --runs 1 --isa native --load quiet   # a sanity run
    python benchmarks/commands.py doctor --agreement --rounds 7
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: the harness, patch_embed

import harness  # noqa: E402
import patch_embed  # noqa: E402  (benchmarks/patch_embed.py: the direct measurement)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
ISA_ENV = {"native": {}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}
TARGET_S = {"quiet": 30.0, "busy": 60.0}


def run_doctor(extra: list[str], env: dict[str, str]) -> tuple[float, dict]:
    """Wall seconds of one ``vlfast doctor --json`` in a new interpreter, and its report."""
    cmd = [sys.executable, "-m", "vlfast.cli.main", "doctor", "--json", *extra]
    out = harness.process_time(cmd, env=env)
    if out["returncode"] not in (0, 1, 4):
        raise SystemExit(f"doctor failed ({out['returncode']}):\n{out['stderr']}")
    return out["wall_s"], json.loads(out["stdout"])


def _load() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def _row(isa: str, load: str, runs: int, extra: list[str]) -> dict:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_WAIT_POLICY": "PASSIVE", **ISA_ENV[isa]}
    for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        if k not in ISA_ENV[isa]:
            env.pop(k, None)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load == "busy" else None
    walls, probes, loads, reports = [], [], [_load()], []
    try:
        for i in range(runs):
            wall, report = run_doctor(extra, env)
            walls.append(wall)
            probes.append(report["probe_s"] or 0.0)
            loads.append(_load())
            reports.append(report)
            print(
                f"{isa} {load} run {i + 1}: {wall:.1f} s wall, probe {report['probe_s']:.1f} s of "
                f"{report['budget_s']:g}, {report['facts']['dtype']}, verdict {report['verdict']}, "
                f"left out {len(report['left_out'])}, load {loads[-1]:.1f}",
                file=sys.stderr,
                flush=True,
            )
    finally:
        if hog is not None:
            hog.kill()  # the one process this script started
            hog.wait()
    last = reports[-1]
    return {
        "isa": isa,
        "load": load,
        "walls": walls,
        "probes": probes,
        "loads": loads,
        "budget": last["budget_s"],
        "dtype": last["facts"]["dtype"],
        "capability": last["facts"]["cpu_capability"],
        "left_out": max(len(r["left_out"]) for r in reports),
        "shapes": len(last["findings"]),
        "reports": reports,
    }


def _agreement(reports: list[dict], rounds: int) -> None:
    doctor_ratios: dict[str, list[float]] = {}
    direct_ratios: dict[str, list[float]] = {}
    for report in reports:
        facts = report["facts"]
        device, dtype = torch.device(facts["device"]), DTYPES[facts["dtype"]]
        for f in report["findings"]:
            s = f["shape"]
            if s["kind"] != "Conv3d" or f["ratio"] is None:
                continue
            t, p, _ = s["kernel_size"]
            refs = tuple(n.split(":")[0] for n in s["names"])
            shape = patch_embed.Shape(refs, s["in_channels"], t, p, s["out_channels"])
            ms = patch_embed.bench_shape(shape, dtype, device, s["windows"], rounds, 1)
            doctor_ratios.setdefault(shape.label, []).append(f["ratio"])
            direct_ratios.setdefault(shape.label, []).append(patch_embed.paired_ratio(ms, "conv", "linear"))
    print(
        "\n| shape (C x T x P x P -> D) | doctor conv/GEMM (runs) | benchmark conv/F.linear (runs) | difference |"
    )
    print("|---|---:|---:|---:|")
    worst = 0.0
    for label, ours in doctor_ratios.items():
        theirs = direct_ratios[label]
        diff = harness.median(ours) / harness.median(theirs) - 1
        worst = max(worst, abs(diff))
        print(
            f"| {label} | {harness.median(ours):.2f}x ({', '.join(f'{r:.2f}' for r in ours)}) "
            f"| {harness.median(theirs):.2f}x ({', '.join(f'{r:.2f}' for r in theirs)}) | {diff:+.0%} |"
        )
    print(f"\nworst disagreement {worst:.0%} (target <= 25%; the doctor times fewer windows on a slow CPU)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="doctor runs per row")
    ap.add_argument("--isa", default="native,avx2", help="comma-separated: native, avx2")
    ap.add_argument("--load", default="quiet,busy", help="comma-separated: quiet, busy")
    ap.add_argument("--doctor-args", default="", help="extra arguments for vlfast doctor, e.g. '--budget 8'")
    ap.add_argument("--agreement", action="store_true", help="also compare ratios with patch_embed.py")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds of the direct measurement")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", message="TF32 acceleration on top of oneDNN")
    isas = [x.strip() for x in args.isa.split(",") if x.strip()]
    loads = [x.strip() for x in args.load.split(",") if x.strip()]
    for x in isas:
        if x not in ISA_ENV:
            raise SystemExit(f"--isa {x!r}: use native or avx2")
    for x in loads:
        if x not in TARGET_S:
            raise SystemExit(f"--load {x!r}: use quiet or busy")

    with harness.Run("doctor_speed", argv) as run:
        rows = [_row(isa, load, args.runs, args.doctor_args.split()) for isa in isas for load in loads]
        run.table("doctor", [_json_row(r) for r in rows])
        _print(rows)
        if args.agreement:
            quiet = [r for r in rows if r["isa"] == "native" and r["load"] == "quiet"]
            if quiet:
                _agreement(quiet[0]["reports"], args.rounds)
    return 0


def _json_row(r: dict) -> dict:
    return {
        "isa": r["isa"],
        "capability": r["capability"],
        "beside": "nothing" if r["load"] == "quiet" else "one busy process",
        "dtype": r["dtype"],
        "runs": len(r["walls"]),
        "wall_s": harness.spread(r["walls"], digits=1),
        "probe_s": harness.spread(r["probes"], digits=1),
        "budget_s": r["budget"],
        "left_out": r["left_out"],
        "target_s": TARGET_S[r["load"]],
    }


def _print(rows: list[dict]) -> None:
    print(
        f"\n`vlfast doctor` with no arguments ({rows[0]['shapes']} conv shapes of the built-in references), "
        f"{time.strftime('%Y-%m-%d')}"
    )
    print(f"machine: {patch_embed.hardware(torch.device('cpu'))}; OMP_WAIT_POLICY=PASSIVE\n")
    print(
        "| instruction set (ATen capability) | beside | dtype probed | wall, median (max) of runs "
        "| probe s / budget | left out | load avg (1 min) | target |"
    )
    print("|---|---|---|---:|---:|---:|---:|---|")
    for r in rows:
        isa = "as is" if r["isa"] == "native" else "limited to AVX2 (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA)"
        med, top = harness.median(r["walls"]), max(r["walls"])
        ok = top <= TARGET_S[r["load"]] and max(r["probes"]) <= 1.2 * r["budget"]
        print(
            f"| {isa} ({r['capability']}) | {'nothing' if r['load'] == 'quiet' else 'one busy process'} "
            f"| {r['dtype']} | {med:.1f} s ({top:.1f} s) of {len(r['walls'])} "
            f"| {harness.median(r['probes']):.1f} s ({max(r['probes']):.1f} s) / {r['budget']:g} s "
            f"| {r['left_out']} | {min(r['loads']):.1f}-{max(r['loads']):.1f} "
            f"| <= {TARGET_S[r['load']]:g} s: {'met' if ok else 'MISSED'} |"
        )


if __name__ == "__main__":
    raise SystemExit(main())
