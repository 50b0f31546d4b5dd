"""Memory and time of `vlfast export` against the number of samples (docs/benchmarks.md, "Export").

    python benchmarks/inputs.py export --samples 2000 40000 120000 --dim 1024

For each N: an OUT of N float32 `embedding` vectors (FeatureStore, 1,024 samples per shard), then one
fresh process per format that opens the FeatureCache, exports, and reports its anonymous resident memory
(RssAnon, sampled every 10 ms: the shards' memory-mapped pages are page cache, not counted) after opening
the cache and at its peak during the export. Linux only (/proc/self/status).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

CHILD = r"""
import json, sys, threading, time
from harness import Stopwatch  # benchmarks/, on the child's path
from vlfast.extraction import FeatureCache, export

def anon():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) / 1024 for l in f if l.startswith("RssAnon"))

out, dest, fmt = sys.argv[1:4]
cache = FeatureCache(out)
opened = anon()
del cache
peak, done = [0.0], threading.Event()

def watch():
    while not done.is_set():
        peak[0] = max(peak[0], anon())
        time.sleep(0.01)

threading.Thread(target=watch, daemon=True).start()
with Stopwatch() as sw:
    result = export(out, dest, format=fmt, overwrite=True)
seconds = sw.wall
done.set()
print(json.dumps({"format": fmt, "rows": result.rows, "seconds": round(seconds, 2),
                  "anon_mib_cache_open": round(opened), "anon_mib_peak": round(max(peak[0], anon()))}))
"""


def make_out(out: Path, n: int, dim: int) -> None:
    import torch

    from vlfast.extraction import FeatureStore

    g = torch.Generator().manual_seed(0)
    with FeatureStore(out, {"model": "export-bench"}, shard_max_samples=1024, commit_every=None) as store:
        for i in range(n):
            meta = {
                "path": f"media/{i:07d}.jpg",
                "n_tokens": 64,
                "text": "a caption of about fifty characters",
            }
            store.add(f"id{i:07d}", {"embedding": torch.randn(dim, generator=g)}, meta)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, nargs="+", default=[2000, 40000])
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--formats", nargs="+", default=["parquet", "lance"])
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.samples:
            out = Path(tmp, f"out-{n}")
            make_out(out, n, args.dim)
            for fmt in args.formats:
                dest = Path(tmp, f"t-{n}.{fmt}")
                proc = subprocess.run(
                    [sys.executable, "-c", CHILD, str(out), str(dest), fmt],
                    capture_output=True,
                    text=True,
                    check=True,
                    env=harness.child_env(),
                )
                results.append({"samples": n, "dim": args.dim, **json.loads(proc.stdout)})
                print(json.dumps(results[-1]), flush=True)
    record({"results": results})


def record(result: dict) -> None:
    """The result into the run's result file (a no-op outside benchmarks/SCRIPT.py MODE)."""
    harness.record(result)


if __name__ == "__main__":
    main()
