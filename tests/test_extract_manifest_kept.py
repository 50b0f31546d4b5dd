"""A manifest's table kept in OUT (vlfast.extraction.sources.kept.KeptTable): a resume and every rank read
it instead of parsing every row again, on disk and on S3; it gives exactly what parsing gives (samples of
every kind, bad rows); a changed manifest is parsed again and its old table deleted; a damaged, truncated or
swapped table is never used; a refused run writes none."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pyarrow as pa
import pytest

from _selftest import compare_caches
from vlfast.demo import make_images
from vlfast.extraction import FeatureCache
from vlfast.extraction.api import extract
from vlfast.extraction.sources import kept as kept_mod
from vlfast.extraction.sources import load_inputs
from vlfast.extraction.sources import manifest as manifest_mod
from vlfast.extraction.sources.kept import KeptListings, KeptTable, decode_table, manifest_identity
from vlfast.extraction.sources.manifest import load_manifest

KW = dict(features="vision_mean", num_workers=0)


@pytest.fixture
def settled(monkeypatch):
    """A manifest written a moment ago counts as settled (the rule waits 2 s: see the test below)."""
    monkeypatch.setattr(kept_mod, "SETTLE_S", 0.0)


def _rows(folder: Path) -> list[dict | str]:
    """Good images by relative and absolute path, a frame list, a text row, a prompt with non-ASCII text,
    a repeated id, a missing file, and bad rows (no path, a lone surrogate in a prompt, not JSON)."""
    images = make_images(folder / "img", [(32 + 8 * (k % 3), 32) for k in range(5)])
    return [
        {"id": "a", "path": "img/img0000.jpg"},
        {"id": "b", "path": str(images[1])},
        {"id": "c", "path": "img/img0002.jpg", "prompt": "décris l'image \u2603"},
        {"id": "frames", "path": ["img/img0000.jpg", "img/img0003.jpg"]},
        {"id": "a", "path": "img/img0001.jpg"},  # a repeated id
        {"id": "missing", "path": "img/none.jpg"},
        {"path": ""},
        {"id": "lone", "path": "img/img0000.jpg", "prompt": "\udc80"},
        "{not json",
        {"id": 7, "path": "img/img0001.jpg"},
    ]


def _write(path: Path, rows: list[dict | str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def manifest(tmp_path) -> Path:
    return _write(tmp_path / "clips.jsonl", _rows(tmp_path))


def _kept(out: Path) -> list[Path]:
    return sorted((out / "listings").glob("manifest-*.arrow"))


def _no_parsing(monkeypatch) -> None:
    def refuse(*_a, **_k):
        raise AssertionError("the manifest was parsed")

    monkeypatch.setattr(manifest_mod, "_jsonl_rows", refuse)


def test_a_resume_parses_no_row(manifest, tiny_qwen3_vl, tmp_path, settled, monkeypatch):
    out = tmp_path / "out"
    first = extract(manifest, out, model=str(tiny_qwen3_vl), **KW)
    assert (first.extracted, first.total) == (5, 10)
    assert len(_kept(out)) == 1  # written once OUT was this run's
    fresh = load_inputs(manifest)
    _no_parsing(monkeypatch)
    kept = KeptListings.of_folder(out / "listings")
    assert load_inputs(manifest, kept=kept) == fresh  # the same samples and bad rows, in order
    assert (kept.used, kept.damaged, kept.fresh) == (1, [], {})
    again = extract(manifest, out, model=str(tiny_qwen3_vl), **KW)
    assert again.nothing_to_do and again.total == 10


def test_the_kept_table_is_exactly_what_parsing_gives(manifest, settled):
    """Every field of every kind of row, read back from a memory map; the columns stay in the map."""
    samples, problems = load_manifest(manifest)
    identity = manifest_identity(manifest, manifest.parent)
    path = manifest.parent / "kept.arrow"
    KeptTable(identity, samples, problems).write_file(path)
    with pa.memory_map(str(path)) as m:
        buffer = m.read_buffer()
    got = decode_table(buffer, identity)
    assert got is not None
    table, kept_problems = got
    assert list(table) == list(samples) and kept_problems == problems
    assert [s.kind for s in table] == ["image", "image", "image", "frames", "image", "image", "image"]
    assert table[2].prompt == "décris l'image \u2603" and table[3].paths == samples[3].paths
    ids = table.ids.buffers()[2]  # the ids' bytes: in the map, not copied out of it
    assert buffer.address <= ids.address < buffer.address + buffer.size


def test_damaged_truncated_or_swapped_tables_are_never_used(manifest, tmp_path, settled):
    other = _write(tmp_path / "other.jsonl", [{"id": "x", "path": "img/img0000.jpg"}])
    fresh = load_inputs(manifest)
    folder = tmp_path / "listings"
    folder.mkdir()

    def keep(source: Path) -> Path:
        kept = KeptListings.of_folder(folder)
        load_inputs(source, kept=kept)
        ((name, table),) = kept.fresh.items()
        table.write_file(folder / name)
        return folder / name

    mine, theirs = keep(manifest), keep(other)
    good = mine.read_bytes()
    flipped = bytearray(good)
    flipped[len(flipped) // 3] ^= 0x01  # in the columns: the checksum catches it
    trailer = bytearray(good)
    trailer[-40] ^= 0x01  # in the JSON trailer
    for damage in (bytes(flipped), bytes(trailer), good[:-9], good[:100], b"", theirs.read_bytes()):
        mine.write_bytes(damage)
        kept = KeptListings.of_folder(folder)
        assert load_inputs(manifest, kept=kept) == fresh
        assert (kept.used, kept.damaged, list(kept.fresh)) == (0, [mine.name], [mine.name])


def test_a_changed_manifest_is_parsed_again_and_its_old_table_deleted(
    manifest, tiny_qwen3_vl, tmp_path, settled
):
    out = tmp_path / "out"
    extract(manifest, out, model=str(tiny_qwen3_vl), **KW)
    (old,) = _kept(out)
    _write(manifest, [*_rows(tmp_path), {"id": "new", "path": "img/img0003.jpg"}])  # a row more
    summary = extract(manifest, out, model=str(tiny_qwen3_vl), **KW)
    assert summary.extracted == 1
    (new,) = _kept(out)
    assert new.name != old.name and new.name[:26] == old.name[:26]  # the same manifest's, replaced
    other = _write(tmp_path / "second.jsonl", [{"id": "z", "path": str(tmp_path / "img/img0000.jpg")}])
    extract(other, out, model=str(tiny_qwen3_vl), **KW)  # another manifest into the same OUT: both kept
    assert len(_kept(out)) == 2 and new in _kept(out)
    reference = tmp_path / "reference"
    extract(manifest, reference, model=str(tiny_qwen3_vl), **KW)
    extract(other, reference, model=str(tiny_qwen3_vl), **KW)
    assert compare_caches(reference, out) == []


def test_the_same_file_under_another_folder_is_another_table(manifest, tmp_path, settled):
    """Relative paths resolve against the manifest's folder as named: a symlink elsewhere is another table."""
    link = tmp_path / "elsewhere" / "clips.jsonl"
    link.parent.mkdir()
    os.symlink(manifest, link)
    assert manifest_identity(link, link.parent) != manifest_identity(manifest, manifest.parent)


def test_a_manifest_just_written_is_parsed_but_not_kept(manifest):
    kept = KeptListings(lambda name: None)
    load_inputs(manifest, kept=kept)  # written a moment ago: within the 2 s a tick could hide
    assert kept.fresh == {}
    time.sleep(kept_mod.SETTLE_S + 0.1)
    kept = KeptListings(lambda name: None)
    load_inputs(manifest, kept=kept)
    assert len(kept.fresh) == 1


def test_each_ranks_share_of_the_kept_table_is_its_share_of_the_parsed_rows(manifest, tmp_path, settled):
    """Every rank plans from the kept table (a memory map) what it plans from the rows: the same samples,
    the same positions in the whole input (which error records name), the same counts."""
    from vlfast.extraction.plan import RunPlan

    folder = tmp_path / "listings"
    folder.mkdir()
    kept = KeptListings.of_folder(folder)
    load_inputs(manifest, kept=kept)
    for name, table in kept.fresh.items():
        table.write_file(folder / name)

    def share(rank: int, from_kept: bool) -> RunPlan:
        source = KeptListings.of_folder(folder, rank, 2) if from_kept else None
        samples, problems = load_inputs(manifest, kept=source)
        assert source is None or source.used == 1
        return RunPlan(tmp_path / "out", samples, problems, rank, 2, "qwen3_vl", None, {}, ())

    for rank in range(2):
        parsed, mapped = share(rank, False), share(rank, True)
        assert 0 < len(parsed.samples) < 7  # a share, not all or nothing
        assert list(mapped.samples) == list(parsed.samples)
        assert [mapped.samples.entry(k) for k in range(len(mapped.samples))] == [
            parsed.samples.entry(k) for k in range(len(parsed.samples))
        ]
        assert (mapped.total, mapped.assigned, mapped.mine_problems) == (
            parsed.total,
            parsed.assigned,
            parsed.mine_problems,
        )


def test_only_rank_0_keeps_it(manifest, settled):
    offered = []
    for rank in range(2):
        kept = KeptListings(lambda name: None, rank, 2)
        load_inputs(manifest, kept=kept)
        offered.append(len(kept.fresh))
    assert offered == [1, 0]


def test_a_refused_run_writes_no_table(manifest, tiny_qwen3_vl, tmp_path, settled):
    out = tmp_path / "out"
    extract(manifest, out, model=str(tiny_qwen3_vl), **KW)
    shutil.rmtree(out / "listings")
    with pytest.raises(ValueError, match="configuration"):
        extract(manifest, out, model=str(tiny_qwen3_vl), features="vision", num_workers=0)
    assert not (out / "listings").exists()


def test_a_table_that_cannot_be_written_costs_the_run_nothing(
    manifest, tiny_qwen3_vl, tmp_path, settled, monkeypatch
):
    """A full disk while keeping the table: the run goes on, and the temp file is not left behind."""
    import errno

    def full(self, path):
        Path(path).write_bytes(b"half a table")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(KeptTable, "write_file", full)
    summary = extract(manifest, tmp_path / "out", model=str(tiny_qwen3_vl), **KW)
    assert summary.extracted == 5
    assert list((tmp_path / "out" / "listings").iterdir()) == []


# ------------------------------------------------------------------------------------------- S3


def test_on_s3_a_resume_parses_no_row(manifest, tiny_qwen3_vl, moto_endpoint, tmp_path, monkeypatch):
    """The manifest and OUT on S3: the table is kept under the manifest's ETag, read back in one GET."""
    pytest.importorskip("s3fs")
    from _s3 import client, options
    from vlfast.extraction.store.format import resolve_out

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing-key-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing-secret")
    s3 = client(moto_endpoint)
    s3.create_bucket(Bucket="vlfast-kept-manifest")
    # absolute local paths: the manifest's rows name files on this disk, the manifest itself is on S3
    rows = [dict(r, path=str(tmp_path / r["path"])) for r in _rows(tmp_path)[:3] if isinstance(r, dict)]
    s3.put_object(
        Bucket="vlfast-kept-manifest", Key="clips.jsonl", Body="".join(json.dumps(r) + "\n" for r in rows)
    )
    url, out, opts = (
        "s3://vlfast-kept-manifest/clips.jsonl",
        "s3://vlfast-kept-manifest/out",
        options(moto_endpoint),
    )
    first = extract(url, out, model=str(tiny_qwen3_vl), storage_options=opts, **KW)
    assert first.extracted == 3
    listings = resolve_out(out, opts) / "listings"
    assert [p.name[:9] for p in listings.iterdir()] == ["manifest-"]
    fresh = load_inputs(url, opts)
    _no_parsing(monkeypatch)
    kept = KeptListings.of_folder(listings)
    assert load_inputs(url, opts, kept) == fresh and kept.used == 1
    assert extract(url, out, model=str(tiny_qwen3_vl), storage_options=opts, **KW).nothing_to_do
    assert len(FeatureCache(out, storage_options=opts)) == 3
