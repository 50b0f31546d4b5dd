"""`benchmarks/extract.py scale` (issue 22) runs end to end at a tiny N and reports every figure of its result.

A smoke test of the instrument, not a timing: ``--inline`` keeps every step in one process (the real run
gives each step a fresh one for its peak RSS), so it takes a few seconds. The figures are not checked,
only that every one the full run's result is made of is there and that the counts add up (its last figures:
`git show 925c8ac:docs/benchmarks.md`; docs/benchmarks.md names the command).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = [str(REPO / "benchmarks" / "extract.py"), "scale"]  # the mode: benchmarks/modes/extract_scale.py

STEP_KEYS = {"planning_s", "preflight_s", "nothing_to_do", "peak_rss_mib", "bookkeeping_mib", "todo"}


def test_extract_scale_smoke(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    env["VLFAST_BENCH_NO_SAVE"] = "1"  # a smoke run writes no result file into benchmarks/results/
    cmd = [sys.executable, *SCRIPT, "--samples", "300", "--per-part", "64", "--storage", "local"]
    cmd += ["--inline", "--json", "--keep", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert {"command", "machine", "samples", "per_part", "ranks", "load_average_end", "results"} <= set(
        report
    )
    local = report["results"]["local"]
    assert {"half", "finished", "cache_open", "write", "index_parts", "shards", "index_bytes"} <= set(local)
    for mode in ("quick", "full"):
        assert set(local["half"][mode]) >= STEP_KEYS
        assert not local["half"][mode]["nothing_to_do"] and local["half"][mode]["todo"] == 150
    for mode in ("quick", "full", "full_vouched"):
        assert set(local["finished"][mode]) >= STEP_KEYS and local["finished"][mode]["nothing_to_do"]
    assert local["cache_open"]["samples"] == 300 and local["cache_open"]["open_s"] > 0
    # 150 samples per half in parts of 64: 3 parts each (64 + 64 + 22)
    assert local["index_parts"] == local["shards"] == 6
    assert local["write"]["samples_per_s"] > 0 and {"seconds", "peak_rss_mib"} <= set(local["write"])
    assert sum(s["written"] for s in local["write"]["steps"]) == 300
    assert (tmp_path / "out-300-64-r1" / "run.json").is_file()  # --keep kept the OUT


def test_input_memory_smoke() -> None:
    """`benchmarks/inputs.py memory` lists both inputs at a tiny N and reports every figure of its result."""
    script = [str(REPO / "benchmarks" / "inputs.py"), "memory"]
    proc = subprocess.run(
        [sys.executable, *script, "--entries", "30", "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "VLFAST_BENCH_NO_SAVE": "1"},
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert set(report["results"]) == {"manifest after", "webdataset after"}
    for got in report["results"].values():
        assert got["entries"] == 30 and got["held"] == "SampleTable"
        assert {"seconds", "rss_added_mib", "peak_added_mib"} <= set(got)


def test_kept_manifest_smoke() -> None:
    """`benchmarks/inputs.py kept` keeps a manifest's table, reads it both ways and reports every figure
    of its result; the kept read is the kept table's (the step asserts it)."""
    script = [str(REPO / "benchmarks" / "inputs.py"), "kept"]
    proc = subprocess.run(
        [sys.executable, *script, "--entries", "50", "--rounds", "1", "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "VLFAST_BENCH_NO_SAVE": "1"},
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["entries"] == 50 and report["kept_bytes"] > 0
    for mode in ("parse", "kept"):
        (got,) = report["rounds"][mode]
        assert got["entries"] == 50 and got["kept_used"] == (mode == "kept")
        assert {"seconds", "anon_added_mib", "file_added_mib", "peak_added_mib"} <= set(got)
