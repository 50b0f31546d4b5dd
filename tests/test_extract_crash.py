"""Crash safety: SIGKILL an extraction at random points five times, resume each time, and the final output
equals an uninterrupted run's, sample for sample and byte for byte."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from vlfast.extraction import FeatureCache
from vlfast.extraction._selftest import compare_caches, sample_ids

# The default keeps the test near 10 s. VLFAST_CRASH_SAMPLES=30000 runs the 30k-clip scenario
# (about a minute and a half on 2 cores): bigger shards, no per-sample sleep.
N = int(os.environ.get("VLFAST_CRASH_SAMPLES", "240"))
SMALL = N <= 1000


def _cmd(out: Path, *extra: str) -> list[str]:
    shard = "6" if SMALL else "256"
    return [
        sys.executable,
        "-m",
        "vlfast.extraction._selftest",
        str(out),
        "--samples",
        str(N),
        "--shard-samples",
        shard,
        *extra,
    ]


def _env() -> dict[str, str]:
    return os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}


def test_sigkill_five_times_then_resume_is_bit_identical(tmp_path: Path) -> None:
    ref, out = tmp_path / "ref", tmp_path / "out"
    r = subprocess.run(_cmd(ref), env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr

    rng = random.Random(int(os.environ.get("VLFAST_CRASH_SEED", "20261121")))  # override to stress
    progress = []  # (samples pending at start, samples added when killed)
    for _ in range(5):
        p = subprocess.Popen(
            _cmd(out, "-v", "--sleep", "0.004" if SMALL else "0"),
            env=_env(),
            stdout=subprocess.PIPE,
            text=True,
        )
        first = p.stdout.readline()
        assert first.startswith("pending "), first
        pending = int(first.split()[1])
        # Kill after a random number of samples plus a random sub-sample delay, so kills land anywhere:
        # mid-add, mid-shard-write, between a shard's rename and its index part, mid error append.
        target = rng.randint(1, max(1, pending // 3))
        added = 0
        while added < target:
            line = p.stdout.readline()
            assert line.startswith("added "), f"driver ended early: {line!r}"
            added = int(line.split()[1])
        time.sleep(rng.uniform(0, 0.006))
        assert p.poll() is None, "the run finished before the kill: the kill must land mid-run"
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        p.stdout.close()
        assert p.returncode == -signal.SIGKILL
        progress.append((pending, added))

    # Each resume started with no more to do than the one before: committed work survived every kill
    # (a kill before the first shard of a session commits makes no progress, which is fine).
    assert all(b[0] <= a[0] for a, b in zip(progress, progress[1:])), progress
    assert progress[-1][0] < progress[0][0], progress
    print(f"(pending at start, added when killed) for the 5 kills: {progress}")
    partial = len(FeatureCache(out))
    assert 0 < partial < len(FeatureCache(ref))

    r = subprocess.run(_cmd(out, "-v"), env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.split()[1]) < progress[-1][0]

    assert compare_caches(ref, out) == []
    c = FeatureCache(out)
    assert len(c) + sum(e["kind"] == "error" for e in c.errors()) == len(set(sample_ids(N)))
    # Nothing left over: no temp files, no shard without its index part.
    assert not [p for p in out.rglob(".tmp*")]
    assert len(list((out / "shards").iterdir())) == len(list((out / "index").iterdir()))
