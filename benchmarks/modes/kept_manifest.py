"""What a resume spends reading its manifest: every row parsed again, or the table kept in OUT (issue 22).

Writes a JSONL manifest of N rows (``{"id", "path"}``), keeps its table in a folder as a run does once OUT is
claimed (``OUT/listings/manifest-*.arrow``), then reads the manifest in fresh processes, alternating: with
vlfast's ``load_inputs`` parsing every row, and with the kept table (``KeptListings``, a memory map). Each
read reports its seconds and the memory it adds above the imports: anonymous (the process's own) and file
pages (the memory map's, shared by every process that maps the file and given back under pressure), and
the peak. Medians over ``--rounds``, the spread in brackets.

    python benchmarks/inputs.py kept --entries 1000000
    python benchmarks/inputs.py kept --entries 10000000 --rounds 2 --json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

STEP = r"""
import json, resource, sys, time
import torch, pyarrow  # imported before the baseline, as every run has them
from harness import Stopwatch  # benchmarks/, on the child's path
pyarrow.array([0])  # and Arrow's allocator started, which every run's store does anyway
def mem():
    with open("/proc/self/status") as f:
        v = {l.split(":")[0]: int(l.split()[1]) / 1024 for l in f if l.startswith(("RssAnon", "RssFile"))}
    return v["RssAnon"], v["RssFile"]
anon0, file0 = mem()
peak0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
from pathlib import Path
from vlfast.extraction.sources.kept import KeptListings
from vlfast.extraction.sources.listing import load_inputs
manifest, listings, mode = sys.argv[1:4]
kept = KeptListings.of_folder(Path(listings)) if mode != "parse" else None
with Stopwatch() as sw:
    samples, problems = load_inputs(manifest, None, kept)
seconds = sw.wall
if mode == "keep":
    from vlfast.extraction.store.backend import keep_listings
    assert keep_listings(Path(listings).parent, kept.fresh, "r00000-bench") == 1, "the table was not kept"
anon, file = mem()
print(json.dumps({
    "entries": len(samples), "problems": len(problems), "seconds": seconds,
    "kept_used": bool(kept and kept.used), "anon_added_mib": anon - anon0, "file_added_mib": file - file0,
    "peak_added_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - peak0,
}))
"""


def write_manifest(path: Path, n: int) -> None:
    with open(path, "w") as f:
        for start in range(0, n, 100_000):
            rows = (
                f'{{"id": "img-{i:010d}", "path": "images/img-{i:010d}.jpg"}}\n'
                for i in range(start, min(n, start + 100_000))
            )
            f.write("".join(rows))


def run_step(manifest: Path, listings: Path, mode: str) -> dict:
    env = harness.child_env(str(ROOT / "src"), OMP_WAIT_POLICY="PASSIVE")
    cmd = [sys.executable, "-c", STEP, str(manifest), str(listings), mode]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def spread(values: list[float], unit: str, digits: int) -> str:
    med = harness.median(values)
    if len(values) == 1:
        return f"{med:,.{digits}f} {unit}"
    return f"{med:,.{digits}f} {unit} ({min(values):,.{digits}f}-{max(values):,.{digits}f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--entries", type=int, default=1_000_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.entries < 1 or a.rounds < 1:
        p.error("--entries and --rounds must be >= 1")
    with tempfile.TemporaryDirectory(prefix="vlfast-kept-manifest-") as tmp:
        folder = Path(tmp)
        manifest, listings = folder / "inputs.jsonl", folder / "out" / "listings"
        listings.parent.mkdir()
        write_manifest(manifest, a.entries)
        time.sleep(max(0.0, 2.1 - (time.time() - manifest.stat().st_ctime)))  # settled: see sources.kept
        load = os.getloadavg()
        kept_first = run_step(manifest, listings, "keep")
        assert not kept_first["kept_used"] and kept_first["entries"] == a.entries, kept_first
        size = sum(f.stat().st_size for f in listings.iterdir())
        steps = {mode: lambda m=mode: run_step(manifest, listings, m) for mode in ("parse", "kept")}
        rounds = harness.alternate_measured(steps, a.rounds)  # each step a child process timing itself
        for mode, got in ((m, g) for m, gs in rounds.items() for g in gs):
            assert got["entries"] == a.entries and got["kept_used"] == (mode == "kept"), got
        report = {
            "command": " ".join(["python", "benchmarks/inputs.py kept", *(argv or sys.argv[1:])]),
            "entries": a.entries,
            "manifest_bytes": manifest.stat().st_size,
            "kept_bytes": size,
            "load_average": [load, os.getloadavg()],
            "rounds": rounds,
        }
    record(report)
    if a.json:
        print(json.dumps(report, indent=1))
        return 0
    print(
        f"{a.entries:,} rows; manifest {report['manifest_bytes'] / 2**20:,.0f} MiB, kept table {size / 2**20:,.0f} MiB"
    )
    print("| read | seconds | anonymous memory added | file pages (shared) | peak added |")
    print("|---|---:|---:|---:|---:|")
    for mode, label in (("parse", "every row parsed"), ("kept", "kept table (memory map)")):
        r = rounds[mode]
        print(
            f"| {label} | {spread([x['seconds'] for x in r], 's', 2)} "
            f"| {spread([x['anon_added_mib'] for x in r], 'MiB', 0)} "
            f"| {spread([x['file_added_mib'] for x in r], 'MiB', 0)} "
            f"| {spread([x['peak_added_mib'] for x in r], 'MiB', 0)} |"
        )
    print(f"load average {report['load_average'][0]} -> {report['load_average'][1]}")
    return 0


def record(result: dict) -> None:
    """The result into the run's result file (a no-op outside benchmarks/SCRIPT.py MODE)."""
    harness.record(result)


if __name__ == "__main__":
    raise SystemExit(main())
