"""Whole-command wall times of the commands a user runs first, start-up and exit included (issue 39).

Each command runs in a new process, its stdout and stderr into a pipe (as in a CI log), ``--runs`` times, and
the rounds alternate between the trees given (``--tree NAME=PATH``: a checkout whose ``src`` is put first on
``PYTHONPATH``) and the interpreters given (``--python NAME=PATH``: e.g. a venv with the CUDA build of torch,
which pip installs by default, beside this one; default: this interpreter), reversing their order every round
so that a change of load hits every one alike. It prints the median and the spread (min - max) per command
and tree (and interpreter), the load average over the rounds and each interpreter's torch.

Commands (the README's first ones):

- ``vlfast -h``, ``vlfast models``;
- ``vlfast extract INPUT OUT --model ref:qwen3-vl-2b`` on a finished OUT (each tree's own OUT, extracted
  once before the rounds, which also records what transformers answered in ``OUT/facts.json`` where the
  tree does): the "nothing to do" answer; and the same with ``--model TINY``, the tiny checkpoint
  ``vlfast demo-checkpoint`` writes (made once), whose config and processor files transformers reads;
- ``vlfast verify --model ref:qwen3-vl-4b --tiny``;
- ``vlfast demo-checkpoint DIR`` (a new DIR each run);
- refusals, each exit 2 (issue 46): ``export`` with an unknown ``--dtype`` and with a ``--feature`` OUT does not
  hold, ``doctor --dtype float64``, ``verify`` and ``profile`` with an unknown reference, ``tokens audit`` of
  a folder that does not exist; and ``tokens rewrite`` of a one-line JSONL (a text rewrite, exit 0).

    python benchmarks/startup.py --tree before=/work/wt-before --tree after=. --runs 5
    python benchmarks/startup.py --tree here=. --runs 3 --only help models
    python benchmarks/startup.py --tree here=. --python cpu=python --python cuda=/tmp/cudavenv/bin/python
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

COMMANDS: dict[str, list[str]] = {  # id -> arguments ({input}, {out}, {ckpt}, ... filled in per run)
    "help": ["-h"],
    "models": ["models"],
    "nothing-to-do": ["extract", "{input}", "{out}", "--model", "ref:qwen3-vl-2b"],
    "nothing-to-do-checkpoint": ["extract", "{input}", "{out_tiny}", "--model", "{tiny}"],
    "verify-tiny": ["verify", "--model", "ref:qwen3-vl-4b", "--tiny"],
    "demo-checkpoint": ["demo-checkpoint", "{ckpt}"],
    "export-bad-dtype": ["export", "{out_tiny}", "{table}", "--dtype", "float64"],
    "export-no-such-feature": ["export", "{out_tiny}", "{table}", "--feature", "nope"],
    "doctor-bad-dtype": ["doctor", "--dtype", "float64"],
    "verify-unknown-model": ["verify", "--model", "ref:nope"],
    "profile-unknown-model": ["profile", "--model", "ref:nope"],
    "tokens-audit-missing": ["tokens", "audit", "--model", "{missing}"],
    "tokens-rewrite": [
        "tokens",
        "rewrite",
        "--map",
        "think=thinking",
        "--dataset",
        "{jsonl}",
        "--field",
        "text",
        "--out",
        "{rewritten}",
    ],
}
SHOWN = {
    "input": "INPUT",
    "out": "OUT",
    "ckpt": "DIR",
    "out_tiny": "OUT",
    "tiny": "TINY",
    "table": "T.parquet",
    "missing": "MISSING",
    "jsonl": "D.jsonl",
    "rewritten": "D2.jsonl",
}
REFUSED = {  # each exits 2 (verify-tiny, a verify that runs, does not)
    k
    for k in COMMANDS
    if k.startswith(("export-", "doctor-", "profile-", "tokens-audit")) or k.endswith("-unknown-model")
}
EXIT_REFUSED = 2


def _env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree / "src"), *filter(None, [env.get("PYTHONPATH")])])
    return env


def vlfast(
    tree: Path, args: list[str], python: str = sys.executable, expect: int | None = 0
) -> tuple[float, subprocess.CompletedProcess]:
    """Wall seconds of ``vlfast ARGS`` from ``tree`` run by ``python``, in a new process, and what it printed;
    an exit status other than ``expect`` (None: any) stops the benchmark."""
    with harness.Stopwatch(children=True) as sw:
        out = subprocess.run(
            [python, "-m", "vlfast.cli.main", *args], capture_output=True, text=True, env=_env(tree)
        )
    wall = sw.wall
    if expect is not None and out.returncode != expect:
        raise SystemExit(
            f"{tree} ({python}): vlfast {' '.join(args)} exited {out.returncode}, not {expect}:\n"
            f"{out.stdout[-1000:]}{out.stderr[-3000:]}"
        )
    return wall, out


def torch_of(python: str) -> str:
    """The torch ``python`` has, from its package metadata (nothing imported), and its build."""
    code = (
        "import importlib.metadata as m, importlib.util as u, pathlib as p\n"
        "v = m.version('torch')\n"
        "t = p.Path(u.find_spec('torch').submodule_search_locations[0], 'version.py').read_text()\n"
        "cuda = [l for l in t.splitlines() if l.startswith('cuda')]\n"
        "print(v, '(CUDA ' + cuda[0].split('=')[-1].strip().strip(\"'\") + ' build)' if cuda and 'None' not in cuda[0] "
        "else '(CPU build)')"
    )
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def _bytecode() -> str:
    """Whether the trees' modules are compiled at every start: PYTHONDONTWRITEBYTECODE (set on this project's
    machines) keeps Python from caching vlfast's bytecode, ~0.1 s of each command that imports its extraction."""
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        return "PYTHONDONTWRITEBYTECODE set: vlfast's modules compiled at every start"
    return "bytecode cached as Python writes it"


def slug(name: str) -> str:
    """A variant's name ("after/cuda") as one file name."""
    return name.replace("/", "-")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", metavar="NAME=PATH", help="default: here=. (this checkout)")
    ap.add_argument(
        "--python",
        action="append",
        metavar="NAME=PATH",
        help="an interpreter to run the commands with (repeatable); default: this one",
    )
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--name", default="startup", help="the result file's name (default startup)")
    ap.add_argument("--only", nargs="+", choices=list(COMMANDS), help="time only these commands")
    args = ap.parse_args()
    run = harness.Run(args.name)
    runs, pythons, trees = _variants(args)
    commands = {k: v for k, v in COMMANDS.items() if not args.only or k in args.only}
    work = Path(tempfile.mkdtemp(prefix="vlfast-startup-"))
    try:
        sys.path.insert(0, str(next(iter(trees.values())) / "src"))
        from vlfast.demo import make_demo_inputs

        fill = {"input": str(make_demo_inputs(work / "input")), "missing": str(work / "missing")}
        (work / "d.jsonl").write_text('{"text": "<think>a</think> b"}\n')
        fill["jsonl"] = str(work / "d.jsonl")
        if "nothing-to-do-checkpoint" in commands or any(c.startswith("export") for c in commands):
            from vlfast.demo import make_tiny_qwen3_vl

            fill["tiny"] = str(make_tiny_qwen3_vl(work / "tiny"))
        for name, (tree, python) in runs.items():
            where = subprocess.run(
                [python, "-c", "import vlfast; print(vlfast.__file__)"],
                capture_output=True,
                text=True,
                env=_env(tree),
                check=True,
            ).stdout.strip()
            if not Path(where).is_relative_to(tree):  # the tree's source, not the installed vlfast
                raise SystemExit(f"{name}: vlfast imports from {where}, not from {tree}")
            for label, out, model in (
                ("nothing-to-do", work / f"out-{slug(name)}", "ref:qwen3-vl-2b"),
                ("nothing-to-do-checkpoint", work / f"out-tiny-{slug(name)}", fill.get("tiny")),
            ):
                exports = any(c.startswith("export") for c in commands)  # of the tiny checkpoint's OUT
                needs = label in commands or (label == "nothing-to-do-checkpoint" and exports)
                if needs:  # the finished OUT each tree and interpreter answers about
                    wall, _ = vlfast(
                        tree, ["extract", fill["input"], str(out), "--model", str(model)], python
                    )
                    print(f"{name}: {out.name} extracted in {wall:.1f} s", file=sys.stderr, flush=True)
        times: dict[tuple[str, str], list[float]] = {}
        loads = [os.getloadavg()[0]]
        for r in range(args.runs):
            order = list(runs.items()) if r % 2 == 0 else list(reversed(runs.items()))
            for label, argv in commands.items():
                for name, (tree, python) in order:
                    ckpt = work / f"ckpt-{slug(name)}-{r}"
                    values = {**fill, "out": str(work / f"out-{slug(name)}"), "ckpt": str(ckpt)}
                    values["out_tiny"] = str(work / f"out-tiny-{slug(name)}")
                    values["table"] = str(work / f"table-{slug(name)}-{r}.parquet")
                    values["rewritten"] = str(work / f"d2-{slug(name)}-{r}.jsonl")
                    expect = EXIT_REFUSED if label in REFUSED else 0
                    wall, out = vlfast(tree, [a.format(**values) for a in argv], python, expect)
                    if label.startswith("nothing-to-do") and "nothing to do" not in out.stdout:
                        raise SystemExit(f"{name}: extract did not answer 'nothing to do':\n{out.stdout}")
                    shutil.rmtree(ckpt, ignore_errors=True)
                    times.setdefault((label, name), []).append(wall)
            loads.append(os.getloadavg()[0])
            print(f"round {r + 1}/{args.runs} done, load {loads[-1]:.2f}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _report(run, args, runs, commands, times, loads, pythons)


def _variants(args) -> tuple[dict[str, tuple[Path, str]], dict[str, str], dict[str, Path]]:
    """Every tree with every interpreter, each named by what differs; the interpreters; the trees."""
    trees = {}
    for item in args.tree or [f"here={harness.REPO}"]:
        name, _, path = item.partition("=")
        trees[name] = Path(path).resolve()
    pythons = {}
    for item in args.python or [f"python={sys.executable}"]:
        name, _, path = item.partition("=")
        pythons[name] = shutil.which(path) or path
    # Every tree with every interpreter, each named by what differs.
    runs: dict[str, tuple[Path, str]] = {}
    for tname, tree in trees.items():
        for pname, python in pythons.items():
            label = "/".join(n for n, many in ((tname, len(trees) > 1), (pname, len(pythons) > 1)) if many)
            runs[label or tname] = (tree, python)
    return runs, pythons, trees


def _report(run, args, runs: dict, commands: dict, times: dict, loads: list, pythons: dict) -> None:
    """The table, printed and into the run's result file."""
    torches = "; ".join(f"{name}: torch {torch_of(python)}" for name, python in pythons.items())
    print(
        f"\n{harness.cpu_model()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, {torches}; "
        f"{args.runs} runs a command and variant, alternated; load average (1 min) "
        f"{min(loads):.2f}-{max(loads):.2f} (median {harness.median(loads):.2f}); "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {_bytecode()}\n"
    )
    names = list(runs)
    print("| command | " + " | ".join(f"{n}: median (min-max)" for n in names) + " |")
    print("|---|" + "---:|" * len(names))
    for label in commands:
        cells = []
        for name in names:
            t = times[(label, name)]
            cells.append(f"{harness.median(t):.2f} s ({min(t):.2f}-{max(t):.2f})")
        shown = " ".join(a.format(**SHOWN) for a in COMMANDS[label])
        print(f"| `vlfast {shown}` | " + " | ".join(cells) + " |")
        for name in names:
            row = {"command": f"vlfast {shown}", "variant": name}
            run.table("commands", [{**row, "wall_s": harness.spread(times[(label, name)])}])
    run.data["bytecode"] = _bytecode()
    run.data["torch_of"] = {name: torch_of(python) for name, python in pythons.items()}
    run.__exit__(None, None, None)


if __name__ == "__main__":
    main()
