"""What a run's input list costs in memory and time as the number of entries grows (issue 22).

Writes a JSONL manifest of N rows (``{"id", "path"}``) and N WebDataset keys (shards of 2,000 keys, each a
10-byte ``.jpg`` and a ``.txt`` caption, as img2dataset lays them out), then lists each with vlfast's own
``load_inputs`` in a fresh process: the seconds, the RSS it adds above the imports once listed, and the
peak (both above the imports and Arrow's started allocator, which every run has). With ``--before DIR`` (the ``src`` folder of another checkout) the same steps run with that code
too, alternating, so both sides share the machine's load.

    python benchmarks/inputs.py memory --entries 1000000
    python benchmarks/inputs.py memory --entries 1000000 --before /path/to/old/checkout/src --json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

KEYS_PER_SHARD = 2000

STEP = r"""
import json, resource, sys, time
import torch, pyarrow  # imported before the baseline, as every run has them
from harness import Stopwatch  # benchmarks/, on the child's path
pyarrow.array([0])  # and Arrow's allocator started (about 38 MiB here), which every run's store does anyway
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
base = rss()
from vlfast.extraction.sources.listing import load_inputs
with Stopwatch() as sw:
    samples, problems = load_inputs(sys.argv[1])
seconds = sw.wall
print(json.dumps({
    "entries": len(samples), "problems": len(problems), "seconds": seconds, "held": type(samples).__name__,
    "rss_added_mib": rss() - base, "peak_added_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base,
}))
"""


def write_inputs(folder: Path, n: int) -> dict[str, str]:
    manifest = folder / "inputs.jsonl"
    with open(manifest, "w") as f:
        for start in range(0, n, 100_000):
            rows = (
                f'{{"id": "img-{i:010d}", "path": "images/img-{i:010d}.jpg"}}\n'
                for i in range(start, min(n, start + 100_000))
            )
            f.write("".join(rows))
    shards = folder / "shards"
    shards.mkdir()
    count = -(-n // KEYS_PER_SHARD)
    for s in range(count):
        with tarfile.open(shards / f"{s:06d}.tar", "w") as tf:
            for k in range(min(KEYS_PER_SHARD, n - s * KEYS_PER_SHARD)):
                for ext, data in ((".jpg", b"0123456789"), (".txt", f"caption {s} {k}".encode())):
                    info = tarfile.TarInfo(f"{s:06d}{k:06d}{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
    return {"manifest": str(manifest), "webdataset": f"{shards}/{{000000..{count - 1:06d}}}.tar"}


def run_step(src: str, source: str) -> dict:
    env = harness.child_env(src, OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.run([sys.executable, "-c", STEP, source], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--entries", type=int, default=1_000_000)
    p.add_argument("--before", default=None, help="the src folder of another checkout, measured alongside")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    trees = {"after": str(ROOT / "src")}
    if a.before:
        trees = {"before": a.before, **trees}
    report: dict = {"entries": a.entries, "load_average_start": os.getloadavg(), "results": {}}
    with tempfile.TemporaryDirectory(prefix="vlfast-inputs-") as tmp:
        with harness.Stopwatch() as sw:
            inputs = write_inputs(Path(tmp), a.entries)
        report["write_inputs_s"] = sw.wall
        for kind, source in inputs.items():
            steps = {name: lambda s=src, i=source: run_step(s, i) for name, src in trees.items()}
            for name, (got,) in harness.alternate_measured(steps, 1).items():  # one kind at a time
                assert got["entries"] == a.entries and not got["problems"], got
                report["results"][f"{kind} {name}"] = got
                if not a.json:
                    print(
                        f"{kind:10} {name:6} {got['held']:12} {got['seconds']:7.1f} s  "
                        f"+{got['rss_added_mib']:,.0f} MiB held, peak +{got['peak_added_mib']:,.0f} MiB",
                        flush=True,
                    )
    report["load_average_end"] = os.getloadavg()
    record(report)
    if a.json:
        print(json.dumps(report, indent=2))
    return 0


def record(result: dict) -> None:
    """The result into the run's result file (a no-op outside benchmarks/SCRIPT.py MODE)."""
    harness.record(result)


if __name__ == "__main__":
    sys.exit(main())
