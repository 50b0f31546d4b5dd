"""How often a fresh process's first multi-threaded ``cos`` is wrong, with and without
:func:`vlfast.numerics.settle_vector_math` (MKL's vector math set up on one thread first).

Each run is a new Python process that starts torch's OpenMP threads, then computes ``cos`` of 40,000
float32 values on ``--threads`` threads (torch splits it between them, each calling MKL's VML) and compares
with the float64 result rounded to float32. A run is *wrong* when any value is off by more than 1e-6 (right
ones are within 6e-8; wrong ones were off by 1.5e-4). The sides alternate run by run, with
``OMP_WAIT_POLICY=PASSIVE`` and ``MKL_CBWR=AUTO,STRICT`` as ``vlfast`` sets them.

    python benchmarks/commands.py vector-math                 # 60 runs a side, 8 threads
    python benchmarks/commands.py vector-math --runs 100 --threads 2 --json

The same race made ``vlfast extract``'s first forward wrong in the rotary ``cos`` of Qwen3-VL's tower in 6
of 42 fresh runs on this project's 2-core Xeon (2 threads), and failed a bit-identical-resume test on CI;
how often it shows varies with the machine's state (0 of 34 runs another hour), so a rate of zero over N
runs bounds the true rate only loosely (below 3/N at 95%).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness

from harness import cpu_model  # noqa: E402  (benchmarks/patch_embed.py: the CPU's name, /proc/cpuinfo)

CHILD = """
import sys
import torch
if sys.argv[1] == "settled":
    from vlfast.numerics import settle_vector_math
    settle_vector_math()
(torch.randn(1 << 20) + 1).sum()  # the OpenMP threads exist, as in a process that ran a model
x = torch.linspace(0, 20, 40000)
print(float((x.cos() - x.double().cos().float()).abs().max()))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=60, help="runs per side (default 60)")
    p.add_argument("--threads", type=int, default=8, help="OMP_NUM_THREADS of each run (default 8)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    import torch

    env = os.environ | {
        "OMP_WAIT_POLICY": "PASSIVE",
        "MKL_CBWR": os.environ.get("MKL_CBWR", "AUTO,STRICT"),
        "OMP_NUM_THREADS": str(args.threads),
    }
    errors: dict[str, list[float]] = {"settled": [], "unsettled": []}
    for run in range(args.runs):
        for side in ("settled", "unsettled") if run % 2 == 0 else ("unsettled", "settled"):
            done = subprocess.run(
                [sys.executable, "-c", CHILD, side], env=env, capture_output=True, text=True, check=True
            )
            errors[side].append(float(done.stdout.strip().splitlines()[-1]))
    result = {
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "threads": args.threads,
        "runs_per_side": args.runs,
        **{f"{side}_wrong": sum(e > 1e-6 for e in es) for side, es in errors.items()},
        **{f"{side}_worst": max(es) for side, es in errors.items()},
    }
    record(result)
    if args.json:
        print(json.dumps(result))
    else:
        print(result["machine"], f"{args.threads} threads")
        for side in errors:
            print(
                f"{side}: {result[f'{side}_wrong']} of {args.runs} runs wrong "
                f"(worst error {result[f'{side}_worst']:.3g})"
            )


def record(result: dict) -> None:
    """The result into the run's result file (benchmarks/harness.py; a no-op outside benchmarks/SCRIPT.py MODE)."""
    try:
        import harness
    except ImportError:  # run as a child, without benchmarks/ on the path
        return
    harness.record(result)


if __name__ == "__main__":
    main()
