"""Whole-command wall times of the commands a user runs first, start-up and exit included (issue 39).

Each command runs in a new process, its stdout and stderr into a pipe (as in a CI log), ``--runs`` times, and
the rounds alternate between the trees given (``--tree NAME=PATH``: a checkout whose ``src`` is put first on
``PYTHONPATH``), reversing their order every round so that a change of load hits every tree alike. It prints
the median and the spread (min - max) per command and tree, and the load average over the rounds.

Commands (the README's first ones):

- ``vlfast -h``, ``vlfast models``;
- ``vlfast extract INPUT OUT --model ref:qwen3-vl-2b`` on a finished OUT (each tree's own OUT, extracted
  once before the rounds, which also records what transformers answered in ``OUT/facts.json`` where the
  tree does): the "nothing to do" answer; and the same with ``--model TINY``, the tiny checkpoint
  ``vlfast demo-checkpoint`` writes (made once), whose config and processor files transformers reads;
- ``vlfast verify --model ref:qwen3-vl-4b --tiny``;
- ``vlfast demo-checkpoint DIR`` (a new DIR each run).

    python benchmarks/startup.py --tree before=/work/wt-before --tree after=. --runs 5
    python benchmarks/startup.py --tree here=. --runs 3 --only help models
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMANDS: dict[str, list[str]] = {  # id -> arguments ({input}, {out}, {ckpt}, ... filled in per run)
    "help": ["-h"],
    "models": ["models"],
    "nothing-to-do": ["extract", "{input}", "{out}", "--model", "ref:qwen3-vl-2b"],
    "nothing-to-do-checkpoint": ["extract", "{input}", "{out_tiny}", "--model", "{tiny}"],
    "verify-tiny": ["verify", "--model", "ref:qwen3-vl-4b", "--tiny"],
    "demo-checkpoint": ["demo-checkpoint", "{ckpt}"],
}
SHOWN = {"input": "INPUT", "out": "OUT", "ckpt": "DIR", "out_tiny": "OUT", "tiny": "TINY"}


def _env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree / "src"), *filter(None, [env.get("PYTHONPATH")])])
    return env


def vlfast(tree: Path, args: list[str], check: bool = True) -> tuple[float, subprocess.CompletedProcess]:
    """Wall seconds of ``vlfast ARGS`` from ``tree``, in a new process, and what it printed."""
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "vlfast.cli.main", *args], capture_output=True, text=True, env=_env(tree)
    )
    wall = time.perf_counter() - t0
    if check and out.returncode != 0:
        raise SystemExit(f"{tree}: vlfast {' '.join(args)} exited {out.returncode}:\n{out.stderr[-3000:]}")
    return wall, out


def _bytecode() -> str:
    """Whether the trees' modules are compiled at every start: PYTHONDONTWRITEBYTECODE (set on this project's
    machines) keeps Python from caching vlfast's bytecode, ~0.1 s of each command that imports its extraction."""
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        return "PYTHONDONTWRITEBYTECODE set: vlfast's modules compiled at every start"
    return "bytecode cached as Python writes it"


def _load() -> float:
    return os.getloadavg()[0]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", required=True, metavar="NAME=PATH")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--only", nargs="+", choices=list(COMMANDS), help="time only these commands")
    args = ap.parse_args()
    trees = {}
    for item in args.tree:
        name, _, path = item.partition("=")
        trees[name] = Path(path).resolve()
    commands = {k: v for k, v in COMMANDS.items() if not args.only or k in args.only}
    work = Path(tempfile.mkdtemp(prefix="vlfast-startup-"))
    try:
        sys.path.insert(0, str(next(iter(trees.values())) / "src"))
        from vlfast.demo import make_demo_inputs

        fill = {"input": str(make_demo_inputs(work / "input"))}
        if "nothing-to-do-checkpoint" in commands:
            from vlfast.demo import make_tiny_qwen3_vl

            fill["tiny"] = str(make_tiny_qwen3_vl(work / "tiny"))
        for name, tree in trees.items():
            where = subprocess.run(
                [sys.executable, "-c", "import vlfast; print(vlfast.__file__)"],
                capture_output=True,
                text=True,
                env=_env(tree),
                check=True,
            ).stdout.strip()
            if not Path(where).is_relative_to(tree):  # the tree's source, not the installed vlfast
                raise SystemExit(f"{name}: vlfast imports from {where}, not from {tree}")
            for label, out, model in (
                ("nothing-to-do", work / f"out-{name}", "ref:qwen3-vl-2b"),
                ("nothing-to-do-checkpoint", work / f"out-tiny-{name}", fill.get("tiny")),
            ):
                if label in commands:  # the finished OUT each tree answers about
                    wall, _ = vlfast(tree, ["extract", fill["input"], str(out), "--model", str(model)])
                    print(f"{name}: {out.name} extracted in {wall:.1f} s", file=sys.stderr, flush=True)
        times: dict[tuple[str, str], list[float]] = {}
        loads = [_load()]
        for r in range(args.runs):
            order = list(trees.items()) if r % 2 == 0 else list(reversed(trees.items()))
            for label, argv in commands.items():
                for name, tree in order:
                    ckpt = work / f"ckpt-{name}-{r}"
                    values = {**fill, "out": str(work / f"out-{name}"), "ckpt": str(ckpt)}
                    values["out_tiny"] = str(work / f"out-tiny-{name}")
                    wall, out = vlfast(tree, [a.format(**values) for a in argv])
                    if label.startswith("nothing-to-do") and "nothing to do" not in out.stdout:
                        raise SystemExit(f"{name}: extract did not answer 'nothing to do':\n{out.stdout}")
                    shutil.rmtree(ckpt, ignore_errors=True)
                    times.setdefault((label, name), []).append(wall)
            loads.append(_load())
            print(f"round {r + 1}/{args.runs} done, load {loads[-1]:.2f}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    import torch

    print(
        f"\n{cpu_name()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch.__version__}; "
        f"{args.runs} runs a command and tree, alternated; load average (1 min) {min(loads):.2f}-{max(loads):.2f} "
        f"(median {statistics.median(loads):.2f}); {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"{_bytecode()}\n"
    )
    names = list(trees)
    print("| command | " + " | ".join(f"{n}: median (min-max)" for n in names) + " |")
    print("|---|" + "---:|" * len(names))
    for label in commands:
        cells = []
        for name in names:
            t = times[(label, name)]
            cells.append(f"{statistics.median(t):.2f} s ({min(t):.2f}-{max(t):.2f})")
        shown = " ".join(a.format(**SHOWN) for a in COMMANDS[label])
        print(f"| `vlfast {shown}` | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
