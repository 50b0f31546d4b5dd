"""What integrity costs in the extraction store: writes, reads, resume checks, the full verification.

All in one process, rounds alternating between the sides so a busy shared machine slows both alike;
medians over rounds, and the ratio per round. The files stay in the page cache (what a resume right after
a crash sees); a cold disk makes every side slower by the same read, which the checksums do not add to.

- write: ``FeatureStore`` add + commit of K samples (600 merged tokens x 2560 dims bf16, ~3 MiB each, a
  pooled vector and a grid), this store (per-tensor xxh3, a hashed index part, commits every 60 s) against
  the store of the commit before the integrity work (``git show BASE:src/vlfast/extraction/store.py``,
  loaded as a module of its own);
- read: every sample through ``FeatureCache`` with and without ``verify=True``;
- resume: opening a store on the finished folder with ``resume_check="full"`` and ``"quick"``;
- verify: ``check_folder`` (``vlfast extract --verify``), in GB/s.

    python benchmarks/extract.py store                    # 120 samples, 5 rounds
    python benchmarks/extract.py store --samples 300 --rounds 7 --json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # timing on a shared CPU: idle threads must sleep

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BASE = "e82d833"  # the last commit before checksums, umask and commit_every


def old_store_module(base: str = BASE):
    """The store module of commit ``base``, imported from git without touching the working tree."""
    src = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{base}:src/vlfast/extraction/store.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = Path(tempfile.mkdtemp(prefix="vlfast-oldstore-")) / "old_store.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("vlfast_old_store", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def samples(n: int, tokens: int, dim: int):
    torch.manual_seed(0)
    base = torch.randn(tokens, dim).to(torch.bfloat16)  # (L, D)
    for i in range(n):
        tok = base + i  # a fresh tensor per sample, as a model would return
        yield (
            f"clip-{i:06d}",
            {"tokens": tok, "mean": tok.float().mean(0), "grid_thw": torch.tensor([[4, 30, 40]])},
        )


def write(store_cls, out: str, n: int, tokens: int, dim: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) to write n samples through ``store_cls``."""
    shutil.rmtree(out, ignore_errors=True)
    t0, c0 = time.perf_counter(), time.process_time()
    with store_cls(out, {"model": "benchmark", "tokens": tokens, "dim": dim}) as store:
        for sid, feats in samples(n, tokens, dim):
            store.add(sid, feats, {"path": f"videos/{sid}.mp4", "n_tokens": tokens})
    return time.perf_counter() - t0, time.process_time() - c0


def read_all(out: str, verify: bool) -> float:
    from vlfast.extraction import FeatureCache

    t0 = time.perf_counter()
    cache = FeatureCache(out, verify=verify)
    for i in range(len(cache)):
        cache[i]
    return time.perf_counter() - t0


def resume(out: str, mode: str) -> float:
    from vlfast.extraction import FeatureStore

    t0 = time.perf_counter()
    FeatureStore(out, {"model": "benchmark", "tokens": 600, "dim": 2560}, resume_check=mode).close()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=120)
    p.add_argument("--tokens", type=int, default=600)
    p.add_argument("--dim", type=int, default=2560)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--dir", default=None, help="where to write (default: a temp folder; /dev/shm takes the disk out)"
    )
    p.add_argument("--json", action="store_true")
    a = p.parse_args()

    from vlfast.extraction import FeatureStore
    from vlfast.extraction.store.integrity import check_folder

    old = old_store_module().FeatureStore
    tmp = Path(tempfile.mkdtemp(prefix="vlfast-store-bench-", dir=a.dir))
    new_out, old_out = str(tmp / "new"), str(tmp / "old")
    keys = ("write_old", "write_new", "cpu_write_old", "cpu_write_new", "read", "read_verify")
    rows: dict[str, list[float]] = {k: [] for k in (*keys, "resume_full", "resume_quick", "verify")}
    try:
        write(FeatureStore, new_out, 4, a.tokens, a.dim)  # warm-up: imports, allocator
        for r in range(a.rounds):
            order = [(old, old_out, "write_old"), (FeatureStore, new_out, "write_new")]
            for cls, out, key in order if r % 2 == 0 else order[::-1]:
                wall, cpu = write(cls, out, a.samples, a.tokens, a.dim)
                rows[key].append(wall)
                rows[f"cpu_{key}"].append(cpu)
            pair = [(False, "read"), (True, "read_verify")]
            for verify, key in pair if r % 2 == 0 else pair[::-1]:
                rows[key].append(read_all(new_out, verify))
            pair = [("full", "resume_full"), ("quick", "resume_quick")]
            for mode, key in pair if r % 2 == 0 else pair[::-1]:
                rows[key].append(resume(new_out, mode))
            report = check_folder(new_out)
            assert report.ok, report.to_dict()
            rows["verify"].append(report.seconds)
        nbytes = report.bytes_checked
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def ratio(a_key: str, b_key: str) -> float:
        return statistics.median(x / y for x, y in zip(rows[a_key], rows[b_key]))

    med = {k: statistics.median(v) for k, v in rows.items()}
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average_end": os.getloadavg()[0],
        "samples": a.samples,
        "data_mib": nbytes / 2**20,
        "rounds": a.rounds,
        "median_s": med,
        "write_new_over_old": ratio("write_new", "write_old"),
        "cpu_write_new_over_old": ratio("cpu_write_new", "cpu_write_old"),
        "read_verify_over_read": ratio("read_verify", "read"),
        "write_mib_s": {"old": nbytes / 2**20 / med["write_old"], "new": nbytes / 2**20 / med["write_new"]},
        "read_mib_s": {"plain": nbytes / 2**20 / med["read"], "verify": nbytes / 2**20 / med["read_verify"]},
        "verify_gib_s": nbytes / 2**30 / med["verify"],
        "per_round": rows,
    }
    record(result)
    if a.json:
        print(json.dumps(result, indent=2))
        return
    _print(result, rows, a, nbytes)


def _print(result: dict, rows: dict, a, nbytes: int) -> None:
    """The result as lines: write, read, resume, verify."""
    med = result["median_s"]

    def spread(a_key: str, b_key: str) -> str:
        r = [x / y for x, y in zip(rows[a_key], rows[b_key])]
        return f"per round {min(r):.2f}-{max(r):.2f}"

    print(
        f"{a.samples} samples, {nbytes / 2**20:,.0f} MiB of tensors, {a.rounds} rounds, {result['machine']}"
    )
    print(
        f"write: before {med['write_old']:.2f} s, now {med['write_new']:.2f} s "
        f"(now/before median {result['write_new_over_old']:.3f}, {spread('write_new', 'write_old')}); "
        f"CPU {med['cpu_write_old']:.2f} s vs {med['cpu_write_new']:.2f} s "
        f"(median {result['cpu_write_new_over_old']:.3f}, {spread('cpu_write_new', 'cpu_write_old')})"
    )
    print(
        f"read all: {med['read']:.2f} s, with verify=True {med['read_verify']:.2f} s "
        f"(median ratio {result['read_verify_over_read']:.2f}, {spread('read_verify', 'read')})"
    )
    print(f"resume check: full {med['resume_full']:.2f} s, quick {med['resume_quick']:.3f} s")
    print(f"check_folder: {med['verify']:.2f} s ({result['verify_gib_s']:.2f} GiB/s)")
    print(f"load average at the end: {result['load_average_end']:.1f}")


def record(result: dict) -> None:
    """The result into the run's result file (benchmarks/harness.py; a no-op outside benchmarks/SCRIPT.py MODE)."""
    try:
        import harness
    except ImportError:  # run as a child, without benchmarks/ on the path
        return
    harness.record(result)


if __name__ == "__main__":
    sys.exit(main())
