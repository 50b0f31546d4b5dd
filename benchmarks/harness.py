"""The one harness every benchmark uses: alternation, timing, spread, load, the machine, the result's JSON.

    from harness import Run, alternate
    with Run("preprocess", argv) as run:                 # load before, machine, commit, date
        times = alternate({"a": fa, "b": fb}, rounds=5)   # ABAB rounds, wall and CPU seconds per call
        run.table("images", [{"variant": k, **spread_ms(t)} for k, t in times.items()])
    # -> benchmarks/results/<machine-slug>/preprocess-<YYYY-MM-DD>.json (load after added on exit)

A script of modes (``benchmarks/extract.py MODE``, ``inputs.py``, ``commands.py``) runs its mode inside a
``Run`` (``run_mode``); the mode hands its final result to ``record``. Environment: ``VLFAST_BENCH_RESULTS``
puts the result files elsewhere, ``VLFAST_BENCH_NO_SAVE=1`` writes none (gpu.py's steps, the smoke tests).

A result file holds ``name``, ``command``, ``machine`` (``machine()``), ``started`` / ``finished`` (UTC),
``load_before`` / ``load_after`` (1, 5, 15-minute load averages) and ``tables``: each a list of rows (flat
dicts of values). ``benchmarks/tables.py`` renders the tables of docs/benchmarks.md from these files.
The machine's slug (``machine_slug()``) is the CPU's model and core count, e.g. ``amd-epyc-2c``; a GPU run
names its device instead (``nvidia-h200``).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(os.environ.get("VLFAST_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")
CURRENT: list = [None]  # the Run that run_mode opened, for record()
COMMAND = [None]  # "benchmarks/SCRIPT.py MODE" while run_mode runs a mode
ISA_FLAGS = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_bf16": "AVX512-BF16", "amx_tile": "AMX"}


def cpu_model() -> str:
    """The CPU's model name (lscpu's, else /proc/cpuinfo's), or the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cpu_flags() -> list[str]:
    """The instruction sets of ISA_FLAGS this CPU has (AVX2, AVX-512, AVX512-BF16, AMX)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = set(next((ln for ln in text.splitlines() if ln.startswith("flags")), "").split())
    return [name for flag, name in ISA_FLAGS.items() if flag in flags]


def _version(dist: str) -> str | None:
    """The installed version, from the package's metadata (nothing imported: no start-up cost, no state)."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True)
        return out.stdout.decode().strip() or None
    except OSError:
        return None


def load() -> list[float]:
    """The 1, 5 and 15-minute load averages."""
    return [round(v, 2) for v in os.getloadavg()]


def _gpu() -> str | None:
    """The first CUDA device's name where the benchmark already imported torch and has one."""
    torch = sys.modules.get("torch")
    try:
        return torch.cuda.get_device_name(0) if torch is not None and torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - a broken driver: no GPU recorded
        return None


def machine() -> dict:
    """What a figure depends on: CPU, instruction sets, cores, versions, the commit, the date; the GPU
    (``gpu``) where there is one, which then names the machine's folder."""
    gpu = _gpu()
    return {
        **({"gpu": gpu} if gpu else {}),
        "cpu": cpu_model(),
        "isa": cpu_flags(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "commit": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
    }


def machine_slug(info: dict | None = None) -> str:
    info = info or machine()
    if info.get("gpu"):
        return re.sub(r"[^a-z0-9]+", "-", info["gpu"].lower()).strip("-")
    name = re.sub(r"\(r\)|\(tm\)|processor|cpu|@.*", "", info["cpu"].lower())
    words = re.sub(r"[^a-z0-9]+", "-", name).strip("-").split("-")[:4]
    return "-".join([*words, f"{info['cores']}c"])


class Stopwatch:
    """Wall and CPU seconds of a block (``with Stopwatch() as sw: ...; sw.wall, sw.cpu``), and of its phases
    (``sw.lap()``: wall seconds since the last lap or the start). CPU: this process (all its threads), or with
    ``children=True`` the children it waited for (their rusage), or ``both``; frozen when the block ends."""

    def __init__(self, children: bool = False, both: bool = False):
        self.children, self.both = children, both
        self.t0 = self.t_lap = time.perf_counter()
        self.c0, self.end = self._cpu(), None

    def _cpu(self) -> float:
        if not (self.children or self.both):
            return time.process_time()
        import resource

        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        return ru.ru_utime + ru.ru_stime + (time.process_time() if self.both else 0.0)

    def lap(self) -> float:
        now = time.perf_counter()
        dt, self.t_lap = now - self.t_lap, now
        return dt

    def stop(self) -> Stopwatch:
        self.end = (time.perf_counter() - self.t0, self._cpu() - self.c0)
        return self

    @property
    def wall(self) -> float:
        return self.end[0] if self.end else time.perf_counter() - self.t0

    @property
    def cpu(self) -> float:
        return self.end[1] if self.end else self._cpu() - self.c0

    def __enter__(self) -> Stopwatch:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def timed(
    fn: Callable[[], object], n: int = 1, sync: Callable[[], object] | None = None
) -> tuple[float, float]:
    """Wall and CPU seconds per call over ``n`` calls (CPU: this process, all its threads; on a loaded
    machine the wall time also counts waits for a core, the CPU time is the work). ``sync`` runs before the
    clock stops (``torch.cuda.synchronize``: the device's work counted)."""
    sw = Stopwatch()
    for _ in range(n):
        fn()
    if sync is not None:
        sync()
    sw.stop()
    return sw.wall / n, sw.cpu / n


def seconds(fn: Callable[[], object]) -> float:
    """Wall seconds of one call."""
    return timed(fn)[0]


def best_of(fn: Callable[[], object], repeat: int) -> float:
    """The fewest wall seconds of ``repeat`` calls (a floor: what a call costs with nothing in its way)."""
    return min(seconds(fn) for _ in range(repeat))


def abab(names: list[str], rounds: int, rotate: bool = False):
    """The ABAB order: (round, name) for every name once per round, reversed every other round so a drift
    in load favours none; ``rotate``: each round starts one name later instead (ABC BCA CAB: with three or
    more, each goes first in turn)."""
    for r in range(rounds):
        if rotate:
            k = r % len(names)
            yield from ((r, name) for name in names[k:] + names[:k])
        else:
            yield from ((r, name) for name in (names if r % 2 == 0 else names[::-1]))


def alternate(
    variants: dict[str, Callable[[], object]],
    rounds: int,
    n: int = 1,
    warmup: bool = True,
    setup: Callable[[str], object] | None = None,
    sync: Callable[[], object] | None = None,
) -> dict[str, dict[str, list[float]]]:
    """ABAB rounds (``abab``): every variant once per round (``n`` calls). ``setup(name)``, untimed, before
    each timed call (a fresh folder, a cleared cache); ``sync`` before the clock stops (see ``timed``).
    Returns {variant: {"wall": [s per call, per round], "cpu": [...]}}."""
    if warmup:
        for name, fn in variants.items():
            if setup is not None:
                setup(name)
            fn()
    out = {k: {"wall": [], "cpu": []} for k in variants}
    for _, name in abab(list(variants), rounds):
        if setup is not None:
            setup(name)
        wall, cpu = timed(variants[name], n, sync)
        out[name]["wall"].append(wall)
        out[name]["cpu"].append(cpu)
    return out


def alternate_measured(
    variants: dict[str, Callable[[], dict]], rounds: int, warmup: bool = False, rotate: bool = False
) -> dict[str, list[dict]]:
    """ABAB rounds (``abab``) of variants that measure themselves (a whole child process, ``process_time``;
    a call that times its own phases, ``Stopwatch``): each returns a dict of figures. Returns {variant:
    [dict per round]}."""
    if warmup:
        for fn in variants.values():
            fn()
    out: dict[str, list[dict]] = {k: [] for k in variants}
    for _, name in abab(list(variants), rounds, rotate):
        out[name].append(variants[name]())
    return out


def alternate_processes(commands: dict[str, list[str]], rounds: int, warmup: bool = False, **kw) -> dict:
    """ABAB rounds of whole processes (``process_time`` each): {variant: [process_time's dict per round]}."""
    return alternate_measured(
        {k: (lambda c=c: process_time(c, **kw)) for k, c in commands.items()}, rounds, warmup
    )


def process_time(cmd: list[str], **kw) -> dict:
    """One child process timed whole: wall seconds, CPU seconds (user + system, from the children's rusage
    before and after) and exit status, its stdout and stderr. ``kw`` goes to subprocess.run (env, cwd...)."""
    with Stopwatch(children=True) as sw:
        proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    return {
        "wall_s": sw.wall,
        "cpu_s": sw.cpu,
        "returncode": proc.returncode,
        "stdout": proc.stdout,
        "stderr": proc.stderr,
    }


def child_env(first: str | None = None, **extra: str) -> dict[str, str]:
    """This environment with benchmarks/ on PYTHONPATH (after ``first``: another tree's src, say), so a
    child process (``python -c STEP``) times through the harness too (``from harness import Stopwatch``)."""
    parts = (first, str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH"))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in parts if p), **extra}


def spread(xs: list[float], scale: float = 1.0, digits: int = 2) -> dict[str, float]:
    """min / median / max of ``xs`` times ``scale``, rounded."""
    return {
        "min": round(min(xs) * scale, digits),
        "median": round(statistics.median(xs) * scale, digits),
        "max": round(max(xs) * scale, digits),
    }


def fmt_spread(s: dict, digits: int = 1) -> str:
    """'median (min-max)'."""
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def median(xs) -> float:
    """The median of ``xs`` (any iterable)."""
    return statistics.median(list(xs))


def median_ratio(a: list[float], b: list[float]) -> float:
    """The median of the per-round ratios a/b (rounds paired by ``alternate``: each ratio is one round's,
    so a drift in load between rounds cancels)."""
    return statistics.median(x / y for x, y in zip(a, b))


class Run:
    """One benchmark run: its machine, load before and after, its tables; written as JSON on exit."""

    def __init__(self, name: str, argv: list[str] | None = None, out: Path | None = None, save: bool = True):
        self.name, self.save_on_exit = name, save
        args = sys.argv[1:] if argv is None else argv
        self.data: dict = {
            "name": name,
            "command": " ".join(["python", COMMAND[0] or f"benchmarks/{Path(sys.argv[0]).name}", *args]),
            "machine": machine(),
            "started": _now(),
            "load_before": load(),
            "tables": {},
        }
        self.out = out

    def __enter__(self) -> Run:
        return self

    def table(self, key: str, rows: list[dict], note: str | None = None) -> None:
        self.data["tables"].setdefault(key, []).extend(rows)
        if note:
            self.data.setdefault("notes", {})[key] = note

    def __exit__(self, exc_type, exc, tb) -> None:
        self.data["finished"], self.data["load_after"] = _now(), load()
        if exc_type is None and self.save_on_exit and not os.environ.get("VLFAST_BENCH_NO_SAVE"):
            path = self.write()
            print(
                f"results: {path.relative_to(REPO) if path.is_relative_to(REPO) else path}", file=sys.stderr
            )

    def write(self) -> Path:
        path = self.out or result_path(self.name, self.data["machine"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.data, indent=1) + "\n")
        return path


def run_mode(modes: dict[str, str], doc: str, argv: list[str] | None = None) -> None:
    """A script of modes: ``python benchmarks/SCRIPT.py MODE [ARGS]`` runs ``benchmarks/modes/<modes[MODE]>.py``
    as ``__main__`` with ARGS (each mode's ``--help`` says its own); no mode or ``-h`` lists them."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in modes:
        print(doc)
        print("modes: " + ", ".join(modes))
        raise SystemExit(0 if not argv or argv[0] in ("-h", "--help") else 2)
    import runpy

    path = Path(__file__).resolve().parent / "modes" / f"{modes[argv[0]]}.py"
    sys.path[:0] = [str(path.parent), str(path.parents[1])]
    COMMAND[0] = f"benchmarks/{Path(sys.argv[0]).name} {argv[0]}"  # the dispatcher's name and the mode
    sys.argv = [str(path), *argv[1:]]
    with Run(modes[argv[0]], argv[1:], save=False) as run:
        CURRENT[0] = run
        try:
            runpy.run_path(str(path), run_name="__main__")
        except SystemExit as e:
            if e.code not in (None, 0):
                raise
        run.save_on_exit = bool(run.data["tables"] or run.data.get("result"))


def record(result: dict, name: str | None = None) -> None:
    """A mode's final result (the dict it prints as JSON) into the result file of the run in progress
    (``run_mode``'s): every list of flat rows in it, and every dict of dicts (rows named by their key),
    becomes a table, the whole dict is kept under ``result``. Outside ``run_mode`` (a child process) it
    does nothing."""
    run = CURRENT[0]
    if run is None:
        return
    if name:
        run.name = run.data["name"] = name
    run.data["result"] = result
    for key, rows in tables_of(result).items():
        run.table(key, rows)


def tables_of(result: dict) -> dict[str, list[dict]]:
    """A result's lists of dicts, and dicts of dicts (each row named by its key), as tables."""
    out = {}
    for key, value in result.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            out[key] = value
        elif isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            out[key] = [{"name": k, **v} for k, v in value.items()]
    return out


def save_result(name: str, result: dict, argv: list[str] | None = None) -> Path | None:
    """A script's final result as its result file: the load when the harness was imported (the script's
    start) and now, the machine, the tables of ``tables_of``, the whole result under ``result``. Not under
    benchmarks/gpu.py (VLFAST_BENCH_NO_SAVE: that run keeps every step's JSON in its own OUT)."""
    if os.environ.get("VLFAST_BENCH_NO_SAVE"):
        return None
    run = Run(name, argv, save=True)
    run.data["started"], run.data["load_before"] = STARTED
    run.data["result"] = {k: v for k, v in result.items() if k != "markdown"}
    for key, rows in tables_of(result).items():
        run.table(key, rows)
    run.data["finished"], run.data["load_after"] = _now(), load()
    path = run.write()
    print(f"results: {path}", file=sys.stderr)
    return path


def result_path(name: str, info: dict) -> Path:
    return RESULTS / machine_slug(info) / f"{name}-{info['date']}.json"


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


STARTED = (_now(), load())  # when a script imported the harness: its start
