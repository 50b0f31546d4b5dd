"""Peak memory of FeatureStore: writing 10x more samples must not need more memory (target < 1.2x).

Each size runs in a fresh subprocess (so ru_maxrss is that run's own peak) and writes K fake samples of a
realistic size (default 600 merged tokens x 2560 dims in bf16, ~3 MiB, plus a pooled fp32 vector and a
grid) through FeatureStore, resuming nothing. Reported: peak RSS of the process, the same minus the RSS
after imports (what the store itself costs), throughput, and the ratio large/small.

    python benchmarks/extract.py memory                        # K=50 and 500, 64 MiB shards
    python benchmarks/extract.py memory --samples 200 --shard-mb 256 --json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness

import harness  # noqa: E402


def child(out: str, samples: int, tokens: int, dim: int, shard_mb: int) -> dict:
    import torch

    from vlfast.extraction import FeatureStore

    torch.manual_seed(0)
    base = torch.randn(tokens, dim).to(torch.bfloat16)  # (L, D)
    cfg = {"model": "benchmark", "tokens": tokens, "dim": dim}
    after_imports = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sw, nbytes = harness.Stopwatch(), 0
    with FeatureStore(out, cfg, shard_max_bytes=shard_mb << 20) as store:
        for i in range(samples):
            tok = base + i  # a fresh tensor per sample, as a model would return
            feats = {"tokens": tok, "mean": tok.float().mean(0), "grid_thw": torch.tensor([[4, 30, 40]])}
            store.add(f"clip-{i:06d}", feats, {"path": f"videos/{i}.mp4", "n_tokens": tokens})
            nbytes += sum(t.nbytes for t in feats.values())
    seconds = sw.stop().wall
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {
        "samples": samples,
        "peak_rss": peak,
        "rss_after_imports": after_imports,
        "bytes": nbytes,
        "s": seconds,
    }


def measure(samples: int, tokens: int, dim: int, shard_mb: int) -> dict:
    out = tempfile.mkdtemp(prefix="vlfast-mem-")
    try:
        args = [str(samples), str(tokens), str(dim), str(shard_mb)]
        r = subprocess.run(
            [sys.executable, __file__, "--child", out, *args], capture_output=True, text=True, check=False
        )
        if r.returncode != 0:
            raise RuntimeError(f"benchmark child failed:\n{r.stderr}")
        return json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(out, ignore_errors=True)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    import torch

    return f"{cpu}, {os.cpu_count()} cores, Linux {platform.release()}, Python {platform.python_version()}, torch {torch.__version__}"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        out, samples, tokens, dim, shard_mb = sys.argv[2], *map(int, sys.argv[3:7])
        print(json.dumps(child(out, samples, tokens, dim, shard_mb)))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=50, help="K; the large run writes 10*K")
    p.add_argument("--tokens", type=int, default=600)
    p.add_argument("--dim", type=int, default=2560)
    p.add_argument("--shard-mb", type=int, default=64)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    small = measure(a.samples, a.tokens, a.dim, a.shard_mb)
    large = measure(10 * a.samples, a.tokens, a.dim, a.shard_mb)
    ratio = large["peak_rss"] / small["peak_rss"]
    own = (large["peak_rss"] - large["rss_after_imports"]) / max(
        1, small["peak_rss"] - small["rss_after_imports"]
    )
    result = {
        "machine": machine(),
        "shard_mb": a.shard_mb,
        "small": small,
        "large": large,
        "ratio": ratio,
        "ratio_store_only": own,
    }
    record(result)
    if a.json:
        print(json.dumps(result, indent=2))
        return
    mib = 2**20
    print(f"machine: {result['machine']}")
    print(f"sample: {a.tokens} x {a.dim} bf16 tokens + mean + grid; shards of {a.shard_mb} MiB")
    print(f"{'samples':>8} {'data MiB':>9} {'peak RSS MiB':>13} {'store MiB':>10} {'MiB/s':>7}")
    for r in (small, large):
        print(
            f"{r['samples']:>8} {r['bytes'] / mib:>9.0f} {r['peak_rss'] / mib:>13.0f} "
            f"{(r['peak_rss'] - r['rss_after_imports']) / mib:>10.0f} {r['bytes'] / mib / r['s']:>7.0f}"
        )
    print(f"peak RSS ratio 10x/1x: {ratio:.3f} (target < 1.2); store-only ratio: {own:.3f}")


def record(result: dict) -> None:
    """The result into the run's result file (a no-op outside benchmarks/SCRIPT.py MODE)."""
    harness.record(result)


if __name__ == "__main__":
    main()
