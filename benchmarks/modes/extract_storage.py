"""Where OUT lives: a local folder, a ``file://`` URL, fsspec's local filesystem, S3 (moto on localhost).

Two measurements, each in one process with the sides alternating round by round (this machine is shared
and noisy), medians of the per-round ratios to the local folder, and each side's spread:

1. The store alone: ``FeatureStore`` writes K samples (merged tokens bf16, a pooled vector, a grid; as the
   pipeline hands them over) and ``FeatureCache`` reads every one back, into
   - ``local``: a local folder, today's code;
   - ``local@BASE``: the same folder through the store of commit BASE, before object-storage OUTs existed
     (``git show BASE:src/vlfast/extraction/store.py`` loaded as a module): the storage layer's overhead
     for local paths;
   - ``file://``: the folder given as a ``file://`` URL (vlfast resolves it to the local path);
   - ``fsspec-local``: the folder forced through the object-storage code path (``UPath("file://...")``:
     exclusive uploads from a temp file, no renames or locks, ranged reads), to show what that path
     costs apart from the network;
   - ``s3``: a bucket on moto's standalone S3 server, started in its own process on 127.0.0.1 (an
     in-memory server on the same 2 cores: this prices the protocol's requests, not a real network).
2. ``vlfast extract`` end to end (the tiny offline Qwen3-VL tower on small images, its own process each
   time) into a local folder, a ``file://`` URL and S3.

    python benchmarks/extract.py storage                      # 100 samples (294 MiB), 7 rounds, in /dev/shm
    python benchmarks/extract.py storage --samples 40 --rounds 5 --dir /tmp --json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # timing on a shared CPU: idle threads must sleep

import torch  # noqa: E402
from extract_store import old_store_module  # noqa: E402  (this folder is on sys.path when run as a script)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BASE = "2718c66"  # the last commit before OUT could be on object storage
BUCKET = "vlfast-bench"
CONFIG = {"model": "benchmark"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto() -> tuple[subprocess.Popen, str]:
    """moto's standalone S3 server in its own process; the environment points boto at it."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench-secret",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=endpoint,
    )
    import boto3

    waited = harness.Stopwatch()
    while True:
        try:
            boto3.client("s3").create_bucket(Bucket=BUCKET)
            return proc, endpoint
        except Exception:  # noqa: BLE001 - not listening yet
            if waited.wall > 30:
                proc.kill()
                raise
            time.sleep(0.2)


def samples(n: int, tokens: int, dim: int):
    torch.manual_seed(0)
    base = torch.randn(tokens, dim).to(torch.bfloat16)
    for i in range(n):
        tok = base + i
        yield (
            f"clip-{i:06d}",
            {"tokens": tok, "mean": tok.float().mean(0), "grid_thw": torch.tensor([[1, 2, 2]])},
        )


def clear(out) -> None:
    if isinstance(out, Path):
        shutil.rmtree(out, ignore_errors=True)
    elif out.fs.exists(out.path):
        out.fs.rm(out.path, recursive=True)


def store_round(store_cls, out, n: int, tokens: int, dim: int) -> dict[str, float]:
    """{"write": seconds, "read": seconds} of n samples through ``store_cls`` and ``FeatureCache``."""
    from vlfast.extraction import FeatureCache

    clear(out)
    sw = harness.Stopwatch()
    with store_cls(out, CONFIG, shard_max_samples=16) as store:
        for sid, feats in samples(n, tokens, dim):
            store.add(sid, feats, {"path": f"videos/{sid}.mp4"})
    write = sw.lap()
    cache = FeatureCache(out)
    for i in range(len(cache)):
        cache[i]
    assert len(cache) == n
    return {"write": write, "read": sw.lap()}


def cli_round(source: Path, out: str, model: Path) -> float:
    """The run's own time (model loading excluded) of `vlfast extract` in a fresh process."""
    cmd = [sys.executable, "-m", "vlfast.cli.main", "extract", str(source), out, "-m", str(model)]
    done = subprocess.run([*cmd, "--workers", "1", "--json"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)["seconds"]


def _summary(rows: dict[str, list[float]], ref: str) -> dict[str, dict[str, float]]:
    out = {}
    for key, values in rows.items():
        med = harness.median(values)
        out[key] = {
            "median_s": med,
            "spread": (max(values) - min(values)) / med if med else 0.0,
            "ratio_to_local": harness.median_ratio(values, rows[ref]),
        }
    return out


def run(
    samples_n: int = 100,
    rounds: int = 7,
    tokens: int = 600,
    dim: int = 2560,
    images: int = 16,
    folder: str | None = "/dev/shm" if os.path.isdir("/dev/shm") else None,
) -> dict:
    """Both measurements; returns the figures as a dict (see the module docstring). The local sides write
    under ``folder`` (default /dev/shm: the disk's writeback stalls would swamp a few-percent difference)."""
    from upath import UPath

    from vlfast.demo import make_images, make_tiny_qwen3_vl
    from vlfast.extraction import FeatureStore

    moto, endpoint = start_moto()
    tmp = Path(tempfile.mkdtemp(prefix="vlfast-storage-bench-", dir=folder))
    try:
        sides = {"local": (FeatureStore, tmp / "local")}
        try:
            sides[f"local@{BASE}"] = (old_store_module(BASE).FeatureStore, tmp / "local-base")
        except ImportError as e:  # the base's store imports modules this tree has moved: no such side
            print(f"local@{BASE} ({e}): not timed", file=sys.stderr)
        sides |= {
            "file://": (FeatureStore, f"file://{tmp / 'file-url'}"),
            "fsspec-local": (FeatureStore, UPath(f"file://{tmp / 'fsspec'}")),
            "s3": (FeatureStore, UPath(f"s3://{BUCKET}/store")),
        }
        from vlfast.extraction.store.format import resolve_out

        sides = {k: (cls, resolve_out(out)) for k, (cls, out) in sides.items()}
        store_round(FeatureStore, tmp / "warm", 4, tokens, dim)
        rounds_of = harness.alternate_measured(
            {
                k: lambda c=cls, o=out: store_round(c, o, samples_n, tokens, dim)
                for k, (cls, out) in sides.items()
            },
            rounds,
        )
        write = {k: [x["write"] for x in v] for k, v in rounds_of.items()}
        read = {k: [x["read"] for x in v] for k, v in rounds_of.items()}
        model = make_tiny_qwen3_vl(tmp / "ckpt")
        make_images(tmp / "images", [(160, 120)] * images)
        cli_sides = {"local": str(tmp / "cli-local"), "file://": f"file://{tmp / 'cli-url'}", "s3": ""}
        calls = itertools.count()

        def cli_side(key: str, out: str):  # a fresh OUT per run; the run's own seconds
            def run() -> dict:
                if key == "s3":
                    return {"s": cli_round(tmp / "images", f"s3://{BUCKET}/cli-{next(calls)}", model)}
                shutil.rmtree(out.removeprefix("file://"), ignore_errors=True)
                return {"s": cli_round(tmp / "images", out, model)}

            return run

        got = harness.alternate_measured({k: cli_side(k, out) for k, out in cli_sides.items()}, rounds)
        e2e = {k: [x["s"] for x in v] for k, v in got.items()}
    finally:
        moto.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    mib = samples_n * (tokens * dim * 2 + dim * 4) / 2**20
    return {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "torch": torch.__version__,
        "samples": samples_n,
        "folder": str(tmp.parent),
        "mib_written": round(mib, 1),
        "rounds": rounds,
        "store_write": _summary(write, "local"),
        "store_read": _summary(read, "local"),
        "extract_cli": _summary(e2e, "local"),
    }


def print_table(result: dict) -> None:
    print(
        f"{result['machine']}, torch {result['torch']}; {result['samples']} samples, {result['mib_written']} MiB "
        f"under {result['folder']},"
    )
    print(
        f"{result['rounds']} alternating rounds; ratio = median per-round time / local folder's (lower is faster)"
    )
    for section in ("store_write", "store_read", "extract_cli"):
        print(f"\n{section}")
        for key, row in result[section].items():
            print(
                f"  {key:<18} median {row['median_s']:8.3f} s   ratio {row['ratio_to_local']:6.3f}   "
                f"spread {row['spread']:.0%}{'  (noisy: > 25%)' if row['spread'] > 0.25 else ''}"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=100)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--tokens", type=int, default=600)
    p.add_argument("--dim", type=int, default=2560)
    p.add_argument("--images", type=int, default=16, help="images for the end-to-end `vlfast extract` rows")
    p.add_argument("--dir", default=None, help="where the local sides write (default /dev/shm if present)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    kw = {"folder": a.dir} if a.dir else {}
    result = run(a.samples, a.rounds, a.tokens, a.dim, a.images, **kw)
    record(result)
    if a.json:
        print(json.dumps(result, indent=1))
    else:
        print_table(result)


def record(result: dict) -> None:
    """The result into the run's result file (a no-op outside benchmarks/SCRIPT.py MODE)."""
    harness.record(result)


if __name__ == "__main__":
    main()
