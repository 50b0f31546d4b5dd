"""What the reader's and the finished-OUT checks cost: a plain ``FeatureCache`` read now vs before, and
what answering "nothing to do" costs on a large OUT.

- read: ``FeatureCache(OUT)`` built and every sample read, this tree against the reader of ``--base``
  (``cache.py`` and ``layout.py`` of that commit, loaded from git as modules of their own), rounds
  alternating between the two; median of the per-round ratios. Two shapes: ``big`` (the store's default
  shards, read in order: a shard is opened once per ~100 samples) and ``churn`` (many 8-sample shards read
  in random order, so most reads open a shard again past the 64 open handles: the worst case for a check
  made once per shard opened, which is where the new header check sits).
- nothing to do: the read-only pre-check on a finished OUT of ``--big-mib`` MiB in ``--big-shards`` shards,
  as main answered it (the quick check: sizes, headers, ids), then as now (the quick check, then the full
  check: the first time every tensor is hashed, later only what ``OUT/checked.json`` does not vouch for).

    python benchmarks/extract.py read                         # small, for a sanity check
    python benchmarks/extract.py read --rounds 21 --big-mib 2048 --dir /dev/shm --json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # timing on a shared CPU: idle threads must sleep

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BASE = "6bed05c"  # main before the swapped-shard check and the finished-OUT check
CFG = {"model": "benchmark"}


def module_from_git(name: str, path: str, base: str, replace: tuple[tuple[str, str], ...] = ()):
    """``path`` as it was at commit ``base``, imported as module ``name`` without touching the tree."""
    src = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{base}:{path}"], capture_output=True, text=True, check=True
    ).stdout
    for old, new in replace:
        src = src.replace(old, new)
    file = Path(tempfile.mkdtemp(prefix="vlfast-old-")) / f"{name}.py"
    file.write_text(src)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def old_cache_class(base: str):
    module_from_git("vlfast_old_layout", "src/vlfast/extraction/layout.py", base)
    old = module_from_git(
        "vlfast_old_cache",
        "src/vlfast/extraction/cache.py",
        base,
        (("from vlfast.extraction.layout import", "from vlfast_old_layout import"),),
    )
    return old.FeatureCache


def fill(out: Path, n: int, tokens: int, dim: int, per_shard: int) -> None:
    from vlfast.extraction import FeatureStore

    shutil.rmtree(out, ignore_errors=True)
    torch.manual_seed(0)
    base = torch.randn(tokens, dim).to(torch.bfloat16)
    with FeatureStore(out, CFG, shard_max_samples=per_shard, commit_every=None) as store:
        for i in range(n):
            tok = base + i
            store.add(f"s{i:07d}", {"tokens": tok, "mean": tok.float().mean(0)}, {"n": i})


def read_all(cls, out: Path, order: list[int]) -> None:
    cache = cls(out)
    for i in order:
        cache[i]


def compare_reads(old_cls, out: Path, n: int, rounds: int, shuffle: bool) -> dict:
    from vlfast.extraction import FeatureCache

    order = list(range(n))
    if shuffle:
        random.Random(0).shuffle(order)
    sides = {"now": lambda: read_all(FeatureCache, out, order)}
    try:
        old_cls(out)
        sides["before"] = lambda: read_all(old_cls, out, order)
    except ValueError as e:  # the base's reader refuses this tree's format: only "now" is timed
        print(f"before ({e}): not timed", file=sys.stderr)
    got = harness.alternate(sides, rounds)  # a warm-up of each (page cache, imports), then ABAB rounds
    rows = {k: v["wall"] for k, v in got.items()}
    if "before" not in rows:
        return {"median_s": {"now": harness.median(rows["now"]), "before": None}, "now_over_before": None}
    ratios = [a / b for a, b in zip(rows["now"], rows["before"])]
    return {
        "median_s": {k: harness.median(v) for k, v in rows.items()},
        "now_over_before": harness.median(ratios),
        "per_round": [min(ratios), max(ratios)],
    }


def per_open(out: Path, repeat: int = 5) -> dict:
    """Microseconds per shard opened: safetensors' own open vs the header check added to it (one small read
    of the header and its xxh3), over every shard of ``out``; the best of ``repeat`` passes."""
    from safetensors import safe_open

    from vlfast.extraction.store.format import xxh3
    from vlfast.extraction.store.reader import _local_header

    shards = sorted((out / "shards").iterdir())

    def opened() -> None:
        for path in shards:
            safe_open(path, framework="pt", device="cpu").metadata()

    def checked() -> None:
        for path in shards:
            xxh3(_local_header(path, path.stat().st_size))

    got = harness.alternate({"safe_open_us": opened, "header_check_us": checked}, repeat, warmup=False)
    return {k: min(v["wall"]) / len(shards) * 1e6 for k, v in got.items()}


def nothing_to_do(out: Path, repeat: int = 3) -> dict:
    """Seconds of the pre-check on a finished OUT: main's (the quick check), now the first time (quick,
    then every tensor hashed) and later ones (quick, then only a stamp per shard against checked.json);
    the quick and later ones are the best of ``repeat``."""
    from vlfast.extraction.store.resume import confirm_hashed, read_state

    def quick() -> None:
        read_state(out, CFG)

    def full() -> None:
        assert confirm_hashed(out, read_state(out, CFG)) == []

    (out / "checked.json").unlink(missing_ok=True)
    time.sleep(0.05)  # past the filesystem's timestamp tick, so the record may vouch for the shards
    first = harness.seconds(full)
    return {
        "main_quick_s": harness.best_of(quick, repeat),
        "now_first_s": first,
        "now_recorded_s": harness.best_of(full, repeat),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default=BASE)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--big-samples", type=int, default=120, help="samples of ~3 MiB, 100 per shard")
    p.add_argument("--churn-samples", type=int, default=1600, help="small samples, 8 per shard")
    p.add_argument("--big-mib", type=int, default=256, help="size of the finished OUT for nothing-to-do")
    p.add_argument("--big-shards", type=int, default=64)
    p.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()

    old_cls = old_cache_class(a.base)
    tmp = Path(tempfile.mkdtemp(prefix="vlfast-read-bench-", dir=a.dir))
    try:
        fill(tmp / "big", a.big_samples, 600, 2560, 100)
        fill(tmp / "churn", a.churn_samples, 16, 64, 8)
        result = {
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
            "python": platform.python_version(),
            "torch": torch.__version__,
            "base": a.base,
            "load_average_start": os.getloadavg()[0],
            "read_big": compare_reads(old_cls, tmp / "big", a.big_samples, a.rounds, shuffle=False),
            "read_churn": compare_reads(old_cls, tmp / "churn", a.churn_samples, a.rounds, shuffle=True),
            "per_shard_open": per_open(tmp / "churn"),
        }
        per_shard = max(1, a.big_mib // a.big_shards)  # MiB per shard, one ~1 MiB sample each
        fill(tmp / "finished", a.big_shards * per_shard, 200, 2560, per_shard)
        result["nothing_to_do"] = {
            "mib": a.big_shards * per_shard * 200 * 2560 * 2 / 2**20,
            "shards": a.big_shards,
            **nothing_to_do(tmp / "finished"),
        }
        result["load_average_end"] = os.getloadavg()[0]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    record(result)
    if a.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['machine']}, load {result['load_average_start']:.1f} -> {result['load_average_end']:.1f}")
    for key, label in (("read_big", "big shards, in order"), ("read_churn", "8-sample shards, random")):
        r = result[key]
        if r["now_over_before"] is None:
            print(
                f"plain read, {label}: now {r['median_s']['now']:.3f} s (the base's reader refuses the format)"
            )
            continue
        print(
            f"plain read, {label}: before {r['median_s']['before']:.3f} s, now {r['median_s']['now']:.3f} s, "
            f"now/before median {r['now_over_before']:.3f} (per round {r['per_round'][0]:.2f}-"
            f"{r['per_round'][1]:.2f})"
        )
    o = result["per_shard_open"]
    print(
        f"per shard opened: safe_open {o['safe_open_us']:.0f} us, the header check {o['header_check_us']:.0f} us"
    )
    n = result["nothing_to_do"]
    print(
        f"nothing to do on {n['mib']:,.0f} MiB in {n['shards']} shards: main (quick check) "
        f"{n['main_quick_s']:.2f} s; now, first time (full) {n['now_first_s']:.2f} s, "
        f"then (recorded) {n['now_recorded_s']:.2f} s"
    )


def record(result: dict) -> None:
    """The result into the run's result file (a no-op outside benchmarks/SCRIPT.py MODE)."""
    harness.record(result)


if __name__ == "__main__":
    sys.exit(main())
