"""Shard listings kept in OUT (vlfast.extraction.sources.kept): a resume lists a WebDataset shard without
reading it, on disk and on S3; a changed shard, a damaged, truncated or swapped listing is never used (the
shard is listed again and the file replaced); a refused run writes none; each rank keeps its own shards'."""

from __future__ import annotations

import gzip
import json
import shutil
import time
from pathlib import Path

import pytest

import test_extract_webdataset as wds
from _selftest import compare_caches
from vlfast.extraction import FeatureCache
from vlfast.extraction.api import extract
from vlfast.extraction.sources import kept as kept_mod
from vlfast.extraction.sources import load_inputs
from vlfast.extraction.sources import webdataset as wd
from vlfast.extraction.sources.kept import KeptListings, ListedMember, decode, encode

shards = wds.shards  # this module's own instance of the three local shards
KW = dict(features="vision_mean", num_workers=0)


@pytest.fixture
def settled(monkeypatch):
    """Shards written a moment ago count as settled (the rule waits 2 s: see test_a_shard_just_written...)."""
    monkeypatch.setattr(kept_mod, "SETTLE_S", 0.0)


@pytest.fixture
def pattern(shards, tmp_path) -> str:
    """A copy of the shards this test may change."""
    shutil.copytree(shards["root"] / "shards", tmp_path / "shards")
    return str(tmp_path / "shards" / "{000..002}.tar")


def _folder_reader(folder: Path):
    return lambda name: (folder / name).read_bytes() if (folder / name).exists() else None


def _scans(monkeypatch) -> list[int]:
    """Counts the shards actually read to be listed."""
    calls: list[int] = []
    scan = wd._scan

    def counted(f, size, where):
        calls.append(size)
        return scan(f, size, where)

    monkeypatch.setattr(wd, "_scan", counted)
    return calls


def _no_scans(monkeypatch) -> None:
    def refuse(*_):
        raise AssertionError("a shard was read to be listed")

    monkeypatch.setattr(wd, "_scan", refuse)


def test_a_resume_reads_no_shard_to_list_it(pattern, tiny_qwen3_vl, tmp_path, settled, monkeypatch):
    out = tmp_path / "out"
    first = extract(pattern, out, model=str(tiny_qwen3_vl), **KW)
    assert first.failed == 1  # the corrupt member, recorded
    assert len(list((out / "listings").glob("*.json.gz"))) == 3  # one per shard, written by the run
    fresh = load_inputs(pattern)
    _no_scans(monkeypatch)
    again = extract(pattern, out, model=str(tiny_qwen3_vl), **KW)
    assert again.nothing_to_do
    kept = KeptListings(_folder_reader(out / "listings"))
    assert load_inputs(pattern, kept=kept) == fresh  # the same samples, members, prompts and problems
    assert (kept.used, kept.damaged, kept.fresh) == (3, [], {})


def test_a_changed_shard_is_listed_again(pattern, tiny_qwen3_vl, tmp_path, settled, monkeypatch):
    out = tmp_path / "out"
    extract(pattern, out, model=str(tiny_qwen3_vl), **KW)
    shard = Path(pattern.replace("{000..002}", "002"))
    wds._write_tar(shard, [(f"sample_{k:04d}.png", wds._png(k)) for k in range(8, 14)])  # two keys more
    scans = _scans(monkeypatch)
    summary = extract(pattern, out, model=str(tiny_qwen3_vl), **KW)
    assert scans == [shard.stat().st_size]  # that shard alone was read
    assert summary.extracted == 2
    assert len(list((out / "listings").glob("*.json.gz"))) == 3  # the new listing replaced the old one
    reference = tmp_path / "reference"
    extract(pattern, reference, model=str(tiny_qwen3_vl), **KW)
    assert compare_caches(reference, out) == []


def test_listings_named_as_before_are_deleted_when_new_ones_are_written(
    pattern, tiny_qwen3_vl, tmp_path, settled
):
    """A listing named the way an earlier vlfast named them (``<sha256[:32]>.json.gz``) is read by no version
    now: the next run that keeps listings deletes it; other files in the folder are left alone."""
    out = tmp_path / "out"
    listings = out / "listings"
    listings.mkdir(parents=True)
    before = listings / f"{'0123abcd' * 4}.json.gz"
    before.write_bytes(b"a listing of before")
    other = listings / "notes.txt"
    other.write_text("the user's")
    extract(pattern, out, model=str(tiny_qwen3_vl), **KW)
    assert not before.exists() and other.exists()
    assert len(list(listings.glob("*.json.gz"))) == 3


def test_damaged_truncated_or_swapped_listings_are_never_used(
    pattern, tiny_qwen3_vl, tmp_path, settled, monkeypatch
):
    out = tmp_path / "out"
    extract(pattern, out, model=str(tiny_qwen3_vl), **KW)
    fresh = load_inputs(pattern)
    files = sorted((out / "listings").glob("*.json.gz"))
    by_shard = {}
    for f in files:
        name = json.loads(gzip.decompress(f.read_bytes()))["identity"][1]
        by_shard[Path(name).name] = f
    flipped, cut, swapped = by_shard["000.tar"], by_shard["001.tar"], by_shard["002.tar"]
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01
    flipped.write_bytes(bytes(data))
    cut.write_bytes(cut.read_bytes()[:-9])
    swapped.write_bytes(by_shard["000.tar"].read_bytes())  # another shard's listing under this name
    scans = _scans(monkeypatch)
    kept = KeptListings(_folder_reader(out / "listings"))
    assert load_inputs(pattern, kept=kept) == fresh
    assert len(scans) == 3 and sorted(kept.damaged) == sorted(f.name for f in files)
    assert sorted(kept.fresh) == sorted(f.name for f in files)  # offered again, to replace them
    extract(pattern, out, model=str(tiny_qwen3_vl), **KW)  # the next run writes them whole
    kept = KeptListings(_folder_reader(out / "listings"))
    assert load_inputs(pattern, kept=kept) == fresh and kept.used == 3


def test_a_refused_run_writes_no_listing(pattern, tiny_qwen3_vl, tmp_path, settled):
    out = tmp_path / "out"
    extract(pattern, out, model=str(tiny_qwen3_vl), **KW)
    shutil.rmtree(out / "listings")
    with pytest.raises(ValueError, match="configuration"):
        extract(pattern, out, model=str(tiny_qwen3_vl), features="vision", num_workers=0)
    assert not (out / "listings").exists()


def test_a_listing_that_cannot_be_written_costs_the_run_nothing(
    pattern, tiny_qwen3_vl, tmp_path, settled, monkeypatch
):
    """A full disk or a refused upload while keeping listings: the run goes on (its own commits report such
    failures); a killed writer's temp file is the next run's garbage."""
    import errno

    from vlfast.extraction.store import backend

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as mp:
        mp.setattr(backend.LocalBackend, "write_cache", full)
        summary = extract(pattern, tmp_path / "out", model=str(tiny_qwen3_vl), **KW)
    assert summary.extracted == 11 and not (tmp_path / "out" / "listings").exists()
    garbage = tmp_path / "out" / "listings" / ".tmp-r00000-123-0123abcd.json.gz"
    garbage.parent.mkdir()
    garbage.write_bytes(b"half a listing")
    extract(pattern, tmp_path / "out", model=str(tiny_qwen3_vl), **KW)  # nothing to do: keeps them
    assert len(list(garbage.parent.glob("*.json.gz"))) == 4  # three listings and the garbage
    extract(pattern, tmp_path / "out", model=str(tiny_qwen3_vl), overwrite=True, **KW)  # a writer's run
    assert not garbage.exists() and len(list(garbage.parent.glob("*.json.gz"))) == 3


def test_a_shard_just_written_is_listed_but_not_kept(pattern):
    kept = KeptListings(lambda name: None)
    load_inputs(pattern, kept=kept)  # the copy was made a moment ago: within the 2 s a tick could hide
    assert kept.fresh == {}
    time.sleep(kept_mod.SETTLE_S + 0.1)
    kept = KeptListings(lambda name: None)
    load_inputs(pattern, kept=kept)
    assert len(kept.fresh) == 3


def test_each_rank_keeps_the_listings_of_its_own_shards(pattern, settled):
    names = []
    for rank in range(2):
        kept = KeptListings(lambda name: None, rank, 2)
        load_inputs(pattern, kept=kept)
        names.append(set(kept.fresh))
    assert [len(n) for n in names] == [2, 1] and not names[0] & names[1]  # shards 0, 2 and shard 1


def test_a_listing_round_trips_every_field_and_refuses_what_does_not_fit():
    members = [
        ListedMember("a/b.seg.png", 512, 1000, b"0"),
        ListedMember("caf\udce9/n\u00e9.jpg", 1536, 5, b"0"),  # a non-UTF-8 byte, as tarfile escapes it
        ListedMember("a/b.txt", 2048, 3, b"0"),
        ListedMember("dir", 2560, 0, b"5"),
        ListedMember("holes.bin", 3072, 10, b"S", sparse=True),
    ]
    texts = {2048: b"\xff\xfe not UTF-8"}
    identity = ["file", "/x/000.tar", 4096, 1, 2, 3]
    got = decode(encode(identity, (members, "it ends at byte 4,096", texts)), identity, 4096)
    assert got is not None
    assert [(m.name, m.offset_data, m.size, m.type, m.sparse) for m in got[0]] == [
        (m.name, m.offset_data, m.size, m.type, m.sparse) for m in members
    ]
    assert got[1:] == ("it ends at byte 4,096", texts)
    assert [m.isreg() for m in got[0]] == [True, True, True, False, True] and got[0][4].issparse()
    data = encode(identity, (members, None, texts))
    assert decode(data, identity, 4096) is not None
    assert decode(data, identity, 3000) is None  # a whole shard's members must fit its size
    assert decode(data, [*identity[:-1], 4], 4096) is None  # another file's identity
    assert decode(data[:-1], identity, 4096) is None and decode(b"", identity, 4096) is None


# ------------------------------------------------------------------------------------------- S3


@pytest.fixture
def s3_shards(shards, moto_endpoint, monkeypatch):
    pytest.importorskip("s3fs")
    from _s3 import client, options

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing-key-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing-secret")
    s3 = client(moto_endpoint)
    bucket = "vlfast-kept"
    s3.create_bucket(Bucket=bucket)
    for shard in sorted((shards["root"] / "shards").iterdir()):
        s3.upload_file(str(shard), bucket, f"shards/{shard.name}")
    return f"s3://{bucket}/shards/{{000..002}}.tar", f"s3://{bucket}/out", options(moto_endpoint)


def test_on_s3_a_resume_reads_no_shard_to_list_it(s3_shards, tiny_qwen3_vl, monkeypatch):
    from vlfast.extraction.store.format import resolve_out

    pattern, out, opts = s3_shards
    first = extract(pattern, out, model=str(tiny_qwen3_vl), storage_options=opts, **KW)
    assert first.extracted == 11 and first.failed == 1
    fresh = load_inputs(pattern, opts)
    listings = resolve_out(out, opts) / "listings"
    assert len(list(listings.iterdir())) == 3  # keyed by each shard's ETag
    _no_scans(monkeypatch)
    again = extract(pattern, out, model=str(tiny_qwen3_vl), storage_options=opts, **KW)
    assert again.nothing_to_do
    kept = KeptListings(lambda name: (listings / name).read_bytes())
    assert load_inputs(pattern, opts, kept) == fresh and kept.used == 3
    assert len(FeatureCache(out, storage_options=opts)) == 11
