"""Scale-out: 2 CPU ranks under torchrun (gloo) divide the work with no gaps or duplicates, each writes its
own shards, the result reads as one dataset, and a resume with a different world size stays correct."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from _selftest import compare_caches, run, sample_ids
from vlfast.extraction import FeatureCache

N = 90


def _env() -> dict[str, str]:
    return os.environ | {"PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}


def _driver(out: Path, *extra: str) -> list[str]:
    return [
        str(Path(__file__).with_name("_selftest.py")),
        str(out),
        "--samples",
        str(N),
        "--shard-samples",
        "5",
        *extra,
    ]


def _torchrun(out: Path, *extra: str, nproc: int = 2) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return subprocess.run(
        cmd + _driver(out, "--dist", *extra), env=_env(), capture_output=True, text=True, timeout=180
    )


def _single(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *_driver(out, *extra)], env=_env(), capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ref")
    run(str(out), N, shard_max_samples=5)
    return out


def _ranks(out: Path) -> set[int]:
    import pyarrow.dataset as ds

    table = ds.dataset(out / "index", format="parquet").to_table(columns=["id", "rank"])
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids)), "an id was written twice"
    return set(table.column("rank").to_pylist())


def test_two_ranks_divide_the_work(ref: Path, tmp_path: Path) -> None:
    r = _torchrun(tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert compare_caches(ref, tmp_path) == []  # no gaps, no duplicates, same bytes per sample
    assert _ranks(tmp_path) == {0, 1}  # both ranks did work, each in its own shards
    assert {p.name[:12] for p in (tmp_path / "shards").iterdir()} == {"shard-r00000", "shard-r00001"}
    c = FeatureCache(tmp_path)
    assert len(c) + sum(e["kind"] == "error" for e in c.errors()) == len(set(sample_ids(N)))


def test_resume_with_fewer_ranks(ref: Path, tmp_path: Path) -> None:
    r = _torchrun(tmp_path, "--crash-after", "12")  # both ranks die hard mid-run
    assert r.returncode != 0
    partial = len(FeatureCache(tmp_path))
    assert 0 < partial < len(FeatureCache(ref))
    run(str(tmp_path), N, shard_max_samples=5)  # resume on one process
    assert compare_caches(ref, tmp_path) == []


def test_resume_with_more_ranks(ref: Path, tmp_path: Path) -> None:
    r = _single(tmp_path, "--crash-after", "30")
    assert r.returncode == 3
    assert 0 < len(FeatureCache(tmp_path)) < len(FeatureCache(ref))
    r = _torchrun(tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert compare_caches(ref, tmp_path) == []
    assert _ranks(tmp_path) == {0, 1}


def test_two_ranks_agree_on_damaged_shards(ref: Path, tmp_path: Path) -> None:
    """A resume under torchrun splits the checks between the ranks and agrees on the verdicts (all_reduce):
    each damaged shard is moved aside once and its samples, whichever rank owns them, are redone."""
    r = _torchrun(tmp_path, "--crash-after", "30")
    assert r.returncode != 0
    shards = sorted((tmp_path / "shards").glob("shard-r*.safetensors"))
    assert {s.name[:12] for s in shards} == {"shard-r00000", "shard-r00001"}
    damaged = [next(s for s in shards if s.name.startswith(f"shard-r0000{k}")) for k in (0, 1)]
    for shard in damaged:  # a flipped bit in each rank's first shard
        data = bytearray(shard.read_bytes())
        data[-3] ^= 0x10
        shard.write_bytes(bytes(data))
    r = _torchrun(tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert compare_caches(ref, tmp_path) == []
    moved = sorted(p.name for p in (tmp_path / "quarantine").rglob("shard-*.safetensors"))
    assert moved == sorted(s.name for s in damaged)  # once each, although both ranks saw them
