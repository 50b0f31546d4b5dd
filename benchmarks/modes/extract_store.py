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
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # timing on a shared CPU: idle threads must sleep

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

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


def write(store_cls, out: str, n: int, tokens: int, dim: int) -> None:
    """n samples written through ``store_cls`` into ``out`` (which the harness's setup removed)."""
    with store_cls(out, {"model": "benchmark", "tokens": tokens, "dim": dim}) as store:
        for sid, feats in samples(n, tokens, dim):
            store.add(sid, feats, {"path": f"videos/{sid}.mp4", "n_tokens": tokens})


def read_all(out: str, verify: bool) -> None:
    from vlfast.extraction import FeatureCache

    cache = FeatureCache(out, verify=verify)
    for i in range(len(cache)):
        cache[i]


def resume(out: str, mode: str, tokens: int, dim: int) -> None:
    from vlfast.extraction import FeatureStore

    FeatureStore(out, {"model": "benchmark", "tokens": tokens, "dim": dim}, resume_check=mode).close()


def measure(old, new_out: str, old_out: str, a) -> tuple[dict[str, list[float]], int]:
    """Writes (old and new store, each into a fresh folder), reads (plain, verified) and resumes (full,
    quick) of ``new_out``, each pair in the harness's ABAB rounds; then ``check_folder`` once per round."""
    from vlfast.extraction import FeatureStore
    from vlfast.extraction.store.integrity import check_folder

    outs = {"write_old": old_out, "write_new": new_out}
    got = harness.alternate(
        {
            "write_old": lambda: write(old, old_out, a.samples, a.tokens, a.dim),
            "write_new": lambda: write(FeatureStore, new_out, a.samples, a.tokens, a.dim),
        },
        a.rounds,
        warmup=False,
        setup=lambda name: shutil.rmtree(outs[name], ignore_errors=True),
    )
    rows = {k: v["wall"] for k, v in got.items()} | {f"cpu_{k}": v["cpu"] for k, v in got.items()}
    reads = {"read": lambda: read_all(new_out, False), "read_verify": lambda: read_all(new_out, True)}
    rows |= {k: v["wall"] for k, v in harness.alternate(reads, a.rounds, warmup=False).items()}
    resumes = {
        "resume_full": lambda: resume(new_out, "full", a.tokens, a.dim),
        "resume_quick": lambda: resume(new_out, "quick", a.tokens, a.dim),
    }
    rows |= {k: v["wall"] for k, v in harness.alternate(resumes, a.rounds, warmup=False).items()}
    rows["verify"] = []
    for _ in range(a.rounds):
        report = check_folder(new_out)
        assert report.ok, report.to_dict()
        rows["verify"].append(report.seconds)
    return rows, report.bytes_checked


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

    old = old_store_module().FeatureStore
    tmp = Path(tempfile.mkdtemp(prefix="vlfast-store-bench-", dir=a.dir))
    try:
        write(FeatureStore, str(tmp / "warm"), 4, a.tokens, a.dim)  # warm-up: imports, allocator
        rows, nbytes = measure(old, str(tmp / "new"), str(tmp / "old"), a)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def ratio(a_key: str, b_key: str) -> float:
        return harness.median_ratio(rows[a_key], rows[b_key])

    med = {k: harness.median(v) for k, v in rows.items()}
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
    """The result into the run's result file (a no-op outside benchmarks/SCRIPT.py MODE)."""
    harness.record(result)


if __name__ == "__main__":
    sys.exit(main())
