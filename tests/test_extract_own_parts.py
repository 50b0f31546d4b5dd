"""A rank reads only the index parts that may hold its ids (issue 22): a part whose ids are all its rank's
in a job of N ranks says so in its footer, and the other ranks of a job of N ranks leave it unread; every
other part (another job size, a FeatureStore user's own split, a part written before the mark) is read by
every rank, as before. Asked about other ranks' ids, a store reads everything."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

import vlfast.extraction.store.integrity as integrity
import vlfast.extraction.store.writer as writer_module
from _selftest import fake_features
from vlfast.extraction import FeatureCache, FeatureStore
from vlfast.extraction.ids import owner_rank
from vlfast.extraction.store.backend import LocalBackend, backend_for
from vlfast.extraction.store.compact import compact_rank
from vlfast.extraction.store.format import (
    DUPLICATE_KIND,
    META_OWNED_UNDER,
    committed_parts,
    read_errors,
    resolve_out,
)
from vlfast.extraction.store.resume import read_state

CFG = {"model": "m", "dtype": "bfloat16", "processor": {"max_pixels": 1024}, "versions": {"torch": "2.13"}}
IDS = [f"clip-{k:03d}" for k in range(40)]


def _owned(rank: int, world_size: int) -> list[str]:
    return [i for i in IDS if owner_rank(i, world_size) == rank]


def _write(out: Path, rank: int, world_size: int, ids: list[str], **kw) -> None:
    with FeatureStore(out, CFG, rank=rank, world_size=world_size, shard_max_samples=3, **kw) as s:
        for sid in ids:
            s.add(sid, fake_features(sid), {"path": f"{sid}.mp4"})


def _two_ranks(out: Path, **kw) -> None:
    for rank in (0, 1):
        _write(out, rank, 2, _owned(rank, 2), **kw)


def _mark(part: Path) -> bytes | None:
    return (pq.read_metadata(str(part)).metadata or {}).get(META_OWNED_UNDER)


@pytest.fixture
def parts_read(monkeypatch) -> list[str]:
    """The names of the parts a store or read_state checks (reads whole), in order."""
    read: list[str] = []
    real = integrity.check_part

    def spy(part, **kw):
        read.append(part.name)
        return real(part, **kw)

    monkeypatch.setattr(writer_module, "check_part", spy)
    monkeypatch.setattr("vlfast.extraction.store.resume.check_part", spy)
    return read


def _rank_of(name: str) -> int:
    return int(name.split("-")[1][1:])


def test_a_part_says_its_ids_are_its_ranks_only_when_they_all_are(tmp_path):
    _write(tmp_path / "own", 0, 2, _owned(0, 2), compact_min_parts=None)
    assert {_mark(p) for p in committed_parts(tmp_path / "own")} == {b"2"}
    stray = _owned(1, 2)[0]  # one id rank 1 owns, added by rank 0 (a FeatureStore user's own split)
    _write(tmp_path / "mixed", 0, 2, [stray, *_owned(0, 2)[:5]], compact_min_parts=None)
    first, *rest = committed_parts(tmp_path / "mixed")
    assert _mark(first) is None and {_mark(p) for p in rest} == {b"2"}
    _write(tmp_path / "one", 0, 1, IDS[:4], compact_min_parts=None)
    assert {_mark(p) for p in committed_parts(tmp_path / "one")} == {None}


def test_a_rank_reads_its_own_parts_and_those_every_rank_reads(tmp_path, parts_read):
    out = tmp_path / "out"
    _two_ranks(out)
    parts_read.clear()
    store = FeatureStore(out, CFG, rank=0, world_size=2)
    assert parts_read and {_rank_of(n) for n in parts_read} == {0}  # rank 1's parts left unread
    mine = store.done_ids(mine=True)
    assert set(_owned(0, 2)) <= mine and not set(_owned(1, 2)) & mine
    assert store.done_ids() == set(IDS)  # all of them when asked about every rank's
    assert {_rank_of(n) for n in parts_read} == {0}  # (read without a check: another rank's to check)
    store.close()
    parts_read.clear()
    state = read_state(out, CFG, rank=1, world_size=2)  # the preflight's read of a finished OUT
    assert {_rank_of(n) for n in parts_read} == {1} and state.done == set(_owned(1, 2))
    assert read_state(out, CFG).done == set(IDS)  # one rank: everything, as before


def test_another_job_size_reads_every_part(tmp_path, parts_read):
    out = tmp_path / "out"
    _two_ranks(out)
    parts_read.clear()
    with FeatureStore(out, CFG, rank=0, world_size=3) as store:
        assert {_rank_of(n) for n in parts_read} == {0, 1}
        assert store.done_ids(mine=True) == set(IDS)


def test_unmarked_parts_of_another_rank_are_read(tmp_path, parts_read):
    """A part written before the mark existed, or by a user's own split, may hold any id: every rank reads it,
    and an id of this rank's that another rank committed there is done."""
    out = tmp_path / "out"
    first, *rest = _owned(0, 2)
    _write(out, 0, 2, rest)
    _write(out, 1, 2, [first, *_owned(1, 2)], compact_min_parts=None)  # rank 0's id, committed by rank 1
    parts_read.clear()
    store = FeatureStore(out, CFG, rank=0, world_size=2)
    unmarked = [p.name for p in committed_parts(out) if _rank_of(p.name) == 1 and _mark(p) is None]
    assert len(unmarked) == 1 and set(unmarked) <= set(parts_read)
    marked = {p.name for p in committed_parts(out) if _rank_of(p.name) == 1 and _mark(p) is not None}
    assert marked and not marked & set(parts_read)
    assert first in store.done_ids(mine=True)
    store.close()
    assert first in read_state(out, CFG, rank=0, world_size=2).done


def test_an_id_another_rank_committed_is_still_a_duplicate(tmp_path):
    out = tmp_path / "out"
    _two_ranks(out)
    theirs = _owned(1, 2)[0]
    with FeatureStore(out, CFG, rank=0, world_size=2) as store:
        store.add(theirs, fake_features(theirs))  # not its own: it reads every part before deciding
    dup = [e for e in read_errors(out) if e["id"] == theirs]
    assert [e["kind"] for e in dup] == [DUPLICATE_KIND]
    assert sorted(FeatureCache(out).ids()) == sorted(IDS)  # written once


def test_damage_in_another_ranks_part_is_that_ranks_to_move_aside(tmp_path):
    out = tmp_path / "out"
    _two_ranks(out, compact_min_parts=None)
    victim = next(p for p in committed_parts(out) if _rank_of(p.name) == 1)
    data = bytearray(victim.read_bytes())
    data[len(data) // 3] ^= 0x40
    victim.write_bytes(bytes(data))
    FeatureStore(out, CFG, rank=0, world_size=2).close()  # leaves it: not its part, not its ids
    assert victim.exists()
    with pytest.warns(UserWarning, match="moved to"):
        FeatureStore(out, CFG, rank=1, world_size=2).close()
    assert not victim.exists()


def test_compaction_keeps_the_mark_only_when_every_part_has_it(tmp_path):
    out = tmp_path / "out"
    _write(out, 0, 2, _owned(0, 2), compact_min_parts=None)
    compact_rank(out, 0, LocalBackend(out, "s"))
    (part,) = committed_parts(out)
    assert _mark(part) == b"2"
    _write(out, 0, 2, [_owned(1, 2)[0]], compact_min_parts=None)  # a part with another rank's id
    compact_rank(out, 0, LocalBackend(out, "s"))
    (part,) = committed_parts(out)
    assert _mark(part) is None


def test_on_object_storage_only_consolidated_parts_are_left_unread(moto_endpoint, monkeypatch, parts_read):
    """On S3 a small part's footer costs two requests, about what the part does: another rank's small parts
    are read whole as before; its consolidated part (one per rank after a clean end) is left unread."""
    pytest.importorskip("s3fs")
    from _s3 import client

    for key, value in {
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "s",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": moto_endpoint,
    }.items():
        monkeypatch.setenv(key, value)
    client(moto_endpoint).create_bucket(Bucket="vlfast-own-parts")
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    out = resolve_out("s3://vlfast-own-parts/out")
    _two_ranks(out, compact_min_parts=None)
    theirs = [p.name for p in committed_parts(out) if _rank_of(p.name) == 1]
    parts_read.clear()
    FeatureStore(out, CFG, rank=0, world_size=2).close()
    assert set(theirs) <= set(parts_read)  # small parts on S3: read, as before
    compact_rank(out, 1, backend_for(out, "s"))
    (consolidated,) = [p.name for p in committed_parts(out) if _rank_of(p.name) == 1]
    parts_read.clear()
    state = read_state(out, CFG, rank=0, world_size=2)
    assert consolidated not in parts_read and {_rank_of(n) for n in parts_read} == {0}
    assert state.done == set(_owned(0, 2))
    s3fs.S3FileSystem.clear_instance_cache()
