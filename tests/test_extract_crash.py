"""Crash safety: SIGKILL an extraction at random points five times, resume each time, and the final output
equals an uninterrupted run's, sample for sample and byte for byte."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

from _crash import env, kill_at_random_points
from _selftest import compare_caches, run, sample_ids
from vlfast.extraction import FeatureCache

# The default keeps the test near 10 s. VLFAST_CRASH_SAMPLES=30000 runs the 30k-clip scenario
# (about a minute and a half on 2 cores): bigger shards, no per-sample sleep.
N = int(os.environ.get("VLFAST_CRASH_SAMPLES", "240"))
SMALL = N <= 1000
SHARD = 6 if SMALL else 256


def _cmd(out: Path, *extra: str, n: int = N) -> list[str]:
    return [
        sys.executable,
        str(Path(__file__).with_name("_selftest.py")),
        str(out),
        "--samples",
        str(n),
        "--shard-samples",
        str(SHARD),
        *extra,
    ]


def test_sigkill_five_times_then_resume_is_bit_identical(tmp_path: Path) -> None:
    ref, out = tmp_path / "ref", tmp_path / "out"
    # The uninterrupted run, in this process with _cmd's options (the kills are what need processes of their
    # own), as tests/test_extract_dist.py's reference: a fresh interpreter cost ~3 s of CPU importing torch.
    run(str(ref), N, shard_max_samples=SHARD)

    rng = random.Random(int(os.environ.get("VLFAST_CRASH_SEED", "20261121")))  # override to stress
    progress = kill_at_random_points(_cmd(out, "-v", "--sleep", "0.004" if SMALL else "0"), 5, rng, 0.006)

    # Each resume started with no more to do than the one before: committed work survived every kill
    # (a kill before the first shard of a session commits makes no progress, which is fine).
    assert all(b[0] <= a[0] for a, b in zip(progress, progress[1:])), progress
    assert progress[-1][0] < progress[0][0], progress
    print(f"(pending at start, added when killed) for the 5 kills: {progress}")
    partial = len(FeatureCache(out))
    assert 0 < partial < len(FeatureCache(ref))

    r = subprocess.run(_cmd(out, "-v"), env=env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.split()[1]) < progress[-1][0]

    assert compare_caches(ref, out) == []
    c = FeatureCache(out)
    assert len(c) + sum(e["kind"] == "error" for e in c.errors()) == len(set(sample_ids(N)))
    _nothing_left_over(out)


def _nothing_left_over(out: Path) -> None:
    """No temp file, no shard without a part pointing at it, no superseded part, no id indexed twice."""
    import pyarrow.dataset as ds

    from vlfast.extraction.store.format import committed_parts, list_names

    assert not [p for p in out.rglob(".tmp*")]
    live = committed_parts(out)
    assert sorted(p.name for p in live) == sorted(list_names(out / "index"))  # nothing superseded left
    table = ds.dataset(out / "index", format="parquet").to_table(columns=["id", "shard"])
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids))  # pyarrow.dataset over index/ reads each sample once
    assert set(table.column("shard").to_pylist()) == {f"shards/{p.name}" for p in (out / "shards").iterdir()}


def test_sigkill_during_compaction_then_resume_is_bit_identical(tmp_path: Path) -> None:
    """The driver compacts its index every 30 samples; five kills each land within 30 ms after a compaction
    starts (while it reads the parts, writes the consolidated one, or deletes what it replaces).

    Each run is killed at the first compaction past up to a third of what it had pending, so a run may take
    pending / 3 + 30 samples: with 240 the fourth run could start with fewer than 30 pending and end without
    compacting. 600 leave at least 47 for the fifth."""
    n = max(N, 600)
    ref, out = tmp_path / "ref", tmp_path / "out"
    run(str(ref), n, shard_max_samples=SHARD)  # uninterrupted, in this process (see above)
    rng = random.Random(int(os.environ.get("VLFAST_CRASH_SEED", "20261122")))
    cmd = _cmd(out, "-v", "--compact-every", "30", n=n)
    progress = kill_at_random_points(cmd, 5, rng, 0.03, during="compacting")
    print(f"(pending at start, added when killed) for the 5 kills: {progress}")
    assert progress[-1][0] < progress[0][0], progress
    r = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert compare_caches(ref, out) == []
    c = FeatureCache(out)
    assert len(c) + sum(e["kind"] == "error" for e in c.errors()) == len(set(sample_ids(n)))
    _nothing_left_over(out)
    from vlfast.extraction.store.format import COMPACT_RE

    names = [p.name for p in (out / "index").iterdir()]
    consolidated = [name for name in names if COMPACT_RE.match(name)]
    # one consolidated part holds what the killed runs compacted; the last run's close compacts only from
    # 8 parts on (compact_min_parts), and no part a consolidated one superseded is left behind
    assert len(consolidated) == 1 and len(names) - 1 < 8, names
