"""`vlfast profile` beside a busy process: does the reported patch gain hold, and what does it flag?

Runs `vlfast profile --json` (the command, in a fresh process, as users run it) alternately quiet and
beside a busy neighbour (a Python spin loop per --busy), several rounds, and compares the patch-embedding
gain each reports. Target (issue 12): the busy gain within 25% of the quiet one, and no speedup shown for
a component the patch does not touch. With `--omp default` the command runs with OpenMP's default
(spinning) wait policy instead of the PASSIVE one it sets, to show what the policy is worth.

    python benchmarks/commands.py contention                    # tiny Qwen3-VL tower, 3 rounds
    python benchmarks/commands.py contention --model ref:qwen3-vl-4b --size 224x224 --frames 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402


def run_profile(args, busy: int, omp: str) -> dict:
    cmd = [sys.executable, "-m", "vlfast.cli.main", "profile", "--model", args.model, "--device", "cpu"]
    cmd += [
        "--dtype",
        args.dtype,
        "--size",
        args.size,
        "--frames",
        args.frames,
        "--repeats",
        str(args.repeats),
    ]
    cmd += ["--json"] + (["--tiny"] if args.tiny else [])
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if omp != "passive":
        env["OMP_WAIT_POLICY"] = "ACTIVE"  # what the default does on a busy machine: threads spin
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    finally:
        for h in hogs:
            h.kill()
    if out.returncode != 0:
        raise SystemExit(f"vlfast profile failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="ref:qwen3-vl-4b")
    ap.add_argument("--tiny", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--size", default="224x224")
    ap.add_argument("--frames", default="8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--busy", type=int, default=1, help="spinning neighbour processes (default 1)")
    ap.add_argument("--omp", choices=["passive", "default"], default="passive")
    args = ap.parse_args(argv)

    def profile(kind: str) -> dict:  # `vlfast profile` measures itself: its speedups, one round's
        data = run_profile(args, args.busy if kind == "busy" else 0, args.omp)
        (entry,) = data["speedups"]
        print(
            f"{kind}: patch_embed gain {entry['patch_embed_speedup']:.2f}x "
            f"(reliable: {entry['reliable']}), load {data['load_average']}",
            file=sys.stderr,
        )
        return entry

    got = harness.alternate_measured({k: lambda k=k: profile(k) for k in ("quiet", "busy")}, args.rounds)
    rows = {kind: [e["patch_embed_speedup"] for e in v] for kind, v in got.items()}
    flagged = {kind: sum(not e["reliable"] for e in v) for kind, v in got.items()}
    untouched_speedups = sum(
        1
        for v in got.values()
        for e in v
        for c in e["components"].values()
        if not c["changed"] and c["speedup"] is not None
    )
    quiet, busy = harness.median(rows["quiet"]), harness.median(rows["busy"])
    print(
        f"{args.model}{' (tiny)' if args.tiny else ''}, {args.dtype}, {args.size} x {args.frames} frames, "
        f"{args.rounds} rounds, {args.busy} busy process(es), OMP_WAIT_POLICY {args.omp}: patch-embedding gain "
        f"quiet {quiet:.2f}x (rounds {', '.join(f'{v:.2f}' for v in rows['quiet'])}), busy {busy:.2f}x "
        f"(rounds {', '.join(f'{v:.2f}' for v in rows['busy'])}): busy / quiet {busy / quiet:.2f} "
        f"(target 0.75-1.25); flagged unreliable: quiet {flagged['quiet']}, busy {flagged['busy']} of "
        f"{args.rounds}; speedups shown for untouched components: {untouched_speedups}"
    )
    record(
        {
            "gain": {
                kind: {"median": harness.median(v), "rounds": v, "flagged": flagged[kind]}
                for kind, v in rows.items()
            },
            "untouched_speedups": untouched_speedups,
            "busy_over_quiet": busy / quiet,
        }
    )
    return 0


def record(result: dict) -> None:
    """The result into the run's result file (a no-op outside benchmarks/SCRIPT.py MODE)."""
    harness.record(result)


if __name__ == "__main__":
    raise SystemExit(main())
