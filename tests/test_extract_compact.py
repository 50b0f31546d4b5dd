"""Compaction of index parts (store/compact.py): one consolidated part per rank, committed before the parts it
replaces are deleted; a damaged consolidated part is moved aside and rebuilt from them while they exist; a
full disk while compacting leaves the folder as it was; on object storage the same order of writes."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from _selftest import RUN_CONFIG, compare_caches, run
from vlfast.cli.main import app
from vlfast.extraction import FeatureCache
from vlfast.extraction.store import integrity
from vlfast.extraction.store.backend import LocalBackend
from vlfast.extraction.store.compact import compact_rank
from vlfast.extraction.store.format import (
    COMPACT_RE,
    FORMAT_VERSION,
    PART_RE,
    DamagedFile,
    OutputFull,
    committed_parts,
    read_run_file,
)
from vlfast.extraction.store.writer import FeatureStore

N = 120  # with shards of 6: about 20 parts


def _out(tmp_path: Path, name: str = "out", **kw) -> Path:
    out = tmp_path / name
    run(str(out), N, shard_max_samples=6, **kw)
    return out


def _uncompacted(tmp_path: Path, name: str = "raw") -> Path:
    """An OUT of many small parts (the store told not to compact)."""
    out = tmp_path / name
    run(str(out), N, shard_max_samples=6, compact_min_parts=None)
    return out


def _names(out: Path, rx) -> list[str]:
    return sorted(p.name for p in (out / "index").iterdir() if rx.match(p.name))


def test_close_compacts_and_reads_the_same(tmp_path):
    raw = _uncompacted(tmp_path)
    assert len(_names(raw, PART_RE)) > 15 and not _names(raw, COMPACT_RE)
    out = _out(tmp_path)  # the same samples, compacted by the store's close
    assert _names(out, PART_RE) == [] and len(_names(out, COMPACT_RE)) == 1
    assert compare_caches(raw, out) == []
    assert read_run_file(out)["format_version"] == FORMAT_VERSION
    report = FeatureCache(out).check()
    assert report.ok and report.parts == 1 and report.shards == len(_names(raw, PART_RE)), report
    r = CliRunner().invoke(app, ["out", "verify", str(out)])
    assert f"{report.shards} shards in 1 index part," in r.output, r.output
    # a resume over it: nothing to redo, nothing duplicated
    assert run(str(out), N, shard_max_samples=6) == 0
    assert compare_caches(raw, out) == []


def test_a_consolidated_part_is_compacted_again_a_row_group_at_a_time(tmp_path, monkeypatch):
    """A resumed run's close compacts the earlier run's consolidated part with its own new parts: that part
    is read a row group at a time (at ten million samples, decoding it whole was the writer's peak), and
    the result holds every row once, in row groups of at most the bound."""
    import pyarrow.parquet as pq

    import vlfast.extraction.store.compact as compact

    monkeypatch.setattr(compact, "_ROW_GROUP", 7)
    out = tmp_path / "out"
    run(str(out), 50, shard_max_samples=3)  # 17 parts -> one consolidated part of 8 row groups
    first = _names(out, COMPACT_RE)
    assert len(first) == 1 and pq.ParquetFile(out / "index" / first[0]).num_row_groups > 1
    read = []
    real = compact.read_part_groups
    monkeypatch.setattr(
        compact, "read_part_groups", lambda f, p, g, c=None: read.append(g) or real(f, p, g, c)
    )
    run(str(out), N, shard_max_samples=3)  # the rest, then its close compacts everything again
    assert all(len(g) == 1 for g in read) and len(read) > 20
    (part,) = _names(out, COMPACT_RE)
    meta = pq.ParquetFile(out / "index" / part).metadata
    raw = tmp_path / "raw"  # the same two runs, never compacted
    for n in (50, N):
        run(str(raw), n, shard_max_samples=3, compact_min_parts=None)
    assert (
        meta.num_rows == len(FeatureCache(raw))
        and max(meta.row_group(k).num_rows for k in range(meta.num_row_groups)) <= 9
    )
    assert compare_caches(raw, out) == []


def test_compaction_decodes_each_row_once(tmp_path, monkeypatch):
    """Compacting a consolidated part with new parts decodes each of their row groups once, in the streaming
    write; choosing the parts reads their footers only (it decoded each part's ids first: 220 MB at a
    writer's close over ten million samples, dropped unused)."""
    import vlfast.extraction.store.compact as compact
    import vlfast.extraction.store.format as fmt

    monkeypatch.setattr(compact, "_ROW_GROUP", 7)
    out = tmp_path / "out"
    run(str(out), 50, shard_max_samples=3)  # one consolidated part of several row groups
    run(str(out), N, shard_max_samples=3, compact_min_parts=None)  # the rest, in small parts
    parts = sorted((out / "index").iterdir())
    groups = {p.name: fmt.open_index_part(p).num_row_groups for p in parts}
    decoded = []
    real_compact, real_format = compact.read_part_groups, fmt.read_part_groups
    monkeypatch.setattr(
        compact,
        "read_part_groups",
        lambda f, p, g, c=None: decoded.append((p.name, g)) or real_compact(f, p, g, c),
    )
    monkeypatch.setattr(
        fmt,
        "read_part_groups",
        lambda f, p, g, c=None: decoded.append((p.name, g)) or real_format(f, p, g, c),
    )
    result = compact_rank(out, 0, LocalBackend(out, "s"))
    assert result.replaced == len(parts)
    assert sorted(decoded) == sorted((name, [g]) for name, n in groups.items() for g in range(n))


def test_cli_compacts_an_old_folder(tmp_path):
    raw = _uncompacted(tmp_path)
    ref = _uncompacted(tmp_path, "ref")
    r = CliRunner().invoke(app, ["out", "compact", str(raw), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["ranks"][0]["replaced"] > 15 and doc["ranks"][0]["part"]
    assert _names(raw, PART_RE) == []
    assert compare_caches(ref, raw) == []
    r = CliRunner().invoke(app, ["out", "compact", str(raw)])
    assert r.exit_code == 0 and "nothing to compact" in r.output, r.output


def test_kill_between_commit_and_deletions_reads_each_sample_once(tmp_path, monkeypatch):
    raw, ref = _uncompacted(tmp_path), _uncompacted(tmp_path, "ref")
    small = _names(raw, PART_RE)
    monkeypatch.setattr(LocalBackend, "remove", lambda self, paths: None)  # "killed" before any deletion
    compact_rank(raw, 0, LocalBackend(raw, "s"))
    monkeypatch.undo()
    assert _names(raw, PART_RE) == small and len(_names(raw, COMPACT_RE)) == 1  # both are there
    assert [p.name for p in committed_parts(raw)] == _names(raw, COMPACT_RE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FeatureCache warns on an id indexed twice
        assert compare_caches(ref, raw) == []
    assert FeatureCache(raw).check().ok
    # the next compaction (or a run's close) finishes the deletions
    assert compact_rank(raw, 0, LocalBackend(raw, "s")).deleted == len(small)
    assert _names(raw, PART_RE) == [] and compare_caches(ref, raw) == []


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


def test_damaged_consolidated_part_is_rebuilt_from_the_parts_it_replaced(tmp_path, monkeypatch):
    raw, ref = _uncompacted(tmp_path), _uncompacted(tmp_path, "ref")
    monkeypatch.setattr(LocalBackend, "remove", lambda self, paths: None)
    compact_rank(raw, 0, LocalBackend(raw, "s"))
    monkeypatch.undo()
    (part,) = [raw / "index" / n for n in _names(raw, COMPACT_RE)]
    _flip(part, part.stat().st_size // 3)  # a data page: the footer (its list of replaced parts) still reads
    with pytest.warns(UserWarning, match="moved to"):
        assert run(str(raw), N, shard_max_samples=6) == 0  # nothing redone: the small parts are read again
    (moved,) = (raw / "quarantine").iterdir()
    reason = json.loads((moved / "reason.json").read_text())
    assert reason["part"] == part.name and reason["rebuilt_from"] and reason["shards"] == []
    assert [n for n in _names(raw, COMPACT_RE)] and _names(raw, PART_RE) == []  # rebuilt by the close
    assert compare_caches(ref, raw) == []


def test_a_consolidated_part_is_checked_against_the_checksum_in_its_name(tmp_path):
    """Its name carries the xxh3 of its bytes, as a small part's does; it was never compared. A flip in its
    footer (Parquet keeps no checksum there), here in the list of parts it supersedes, left the part
    readable and wrong; now every reader names it damaged, and a resume rebuilds it."""
    out, ref = _out(tmp_path), _out(tmp_path, "ref")
    (part,) = [out / "index" / n for n in _names(out, COMPACT_RE)]
    data = bytearray(part.read_bytes())
    at = data.rindex(b"part-r00000-000001") + len("part-r00000-00000")
    data[at : at + 1] = b"9"  # still valid JSON, still a part name
    part.write_bytes(bytes(data))
    with pytest.raises(DamagedFile, match="do not match the checksum in its name"):
        FeatureCache(out)
    assert not integrity.check_part(part, data=False).ok
    with pytest.warns(UserWarning, match="moved to"):
        run(str(out), N, shard_max_samples=6)
    assert compare_caches(ref, out) == [] and FeatureCache(out).check().ok


def test_damaged_consolidated_part_after_the_deletions_redoes_its_samples(tmp_path):
    out, ref = _out(tmp_path), _out(tmp_path, "ref")
    (part,) = [out / "index" / n for n in _names(out, COMPACT_RE)]
    _flip(part, 100)
    with pytest.raises(Exception, match="damaged"):
        FeatureCache(out)
    with pytest.warns(UserWarning, match="moved to"):
        assert run(str(out), N, shard_max_samples=6) > 100
    (moved,) = (out / "quarantine").iterdir()
    assert len(json.loads((moved / "reason.json").read_text())["shards"]) > 15  # its shards went with it
    assert compare_caches(ref, out) == []


def test_damaged_shard_under_a_consolidated_part_costs_that_shard_only(tmp_path):
    out, ref = _out(tmp_path), _out(tmp_path, "ref")
    shard = sorted((out / "shards").iterdir())[3]
    _flip(shard, shard.stat().st_size - 5)  # in a tensor
    report = FeatureCache(out).check()
    assert not report.ok and {b["shard"] for b in report.bad_samples} == {f"shards/{shard.name}"}
    with pytest.warns(UserWarning, match="moved to"):
        redone = run(str(out), N, shard_max_samples=6)
    assert 0 < redone <= 6
    assert compare_caches(ref, out) == [] and FeatureCache(out).check().ok


def test_a_full_check_decodes_a_consolidated_part_a_row_group_at_a_time(tmp_path, monkeypatch):
    """A full check (and a resume's --resume-check full) hashes every tensor against the entries of its
    index row: those are decoded a row group at a time as each shard's check asks for them, never the whole
    part (at ten million samples that was 1-3 GiB). Shards whose rows straddle row groups are judged right:
    a flipped byte in one of them is named, with its sample, and the others pass."""
    import vlfast.extraction.store.compact as compact

    monkeypatch.setattr(compact, "_ROW_GROUP", 7)
    out = tmp_path / "out"
    run(str(out), N, shard_max_samples=5)
    (part,) = _names(out, COMPACT_RE)
    decoded = []
    real = integrity.read_part_groups
    monkeypatch.setattr(
        integrity, "read_part_groups", lambda f, p, g, c=None: decoded.append((g, c)) or real(f, p, g, c)
    )
    check = integrity.check_part(out / "index" / part, data=True)
    assert check.ok and check.checked_bytes > 0
    groups = [g[0] for g, c in decoded if c == ["features"]]
    assert groups == sorted(set(groups)) and len(groups) > 10  # each row group once, one at a time
    assert (None, ["id", "shard"]) in decoded

    cache = FeatureCache(out)
    sample = cache.ids()[len(cache) // 2]
    entry = cache.info(sample)["features"][0]
    _flip(out / cache.info(sample)["shard"], entry["offset"])
    check = integrity.check_part(out / "index" / part, data=True)
    assert (sample, entry["name"]) in check.bad and list(check.bad_shards) == [cache.info(sample)["shard"]]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="writes to /dev/full to fill the disk")
def test_a_consolidated_part_damaged_as_it_is_committed_deletes_nothing(tmp_path, monkeypatch):
    """The committed part is read back, every byte against the checksum in its name, before the parts it
    replaces go: a byte changed on its way to the disk raises DamagedFile, and every small part stays."""
    raw, ref = _uncompacted(tmp_path), _uncompacted(tmp_path, "ref")
    small = _names(raw, PART_RE)
    real = LocalBackend.commit_file

    def damaging(self, staged, dest):
        real(self, staged, dest)
        _flip(Path(dest), 100)

    monkeypatch.setattr(LocalBackend, "commit_file", damaging)
    with pytest.raises(DamagedFile, match="do not match the checksum in its name"):
        compact_rank(raw, 0, LocalBackend(raw, "s"))
    monkeypatch.undo()
    assert _names(raw, PART_RE) == small  # nothing it replaces was deleted
    with pytest.warns(UserWarning, match="moved to"):
        assert run(str(raw), N, shard_max_samples=6) == 0  # nothing redone: the small parts are read again
    assert compare_caches(ref, raw) == [] and FeatureCache(raw).check().ok


def test_full_disk_while_compacting_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    """The consolidated part is written to a staged file first: a disk full there (its writes go to
    /dev/full, which answers ENOSPC as a full disk does) is OutputFull, exit 4 from the command, and the
    folder is left as it was, its staging folder gone."""
    raw, ref = _uncompacted(tmp_path), _uncompacted(tmp_path, "ref")
    before = sorted(p.name for p in (raw / "index").iterdir())
    real = LocalBackend.stage

    def full(self, path, tag):
        staged = real(self, path, tag)
        if path.parent.name == "index":
            staged.symlink_to("/dev/full")
        return staged

    monkeypatch.setattr(LocalBackend, "stage", full)
    with pytest.raises(OutputFull, match="compacting the index of rank 0"):
        compact_rank(raw, 0, LocalBackend(raw, "s"))
    r = CliRunner().invoke(app, ["out", "compact", str(raw)])
    assert r.exit_code == 4, r.output
    monkeypatch.undo()
    assert sorted(p.name for p in (raw / "index").iterdir()) == before
    assert compare_caches(ref, raw) == [] and FeatureCache(raw).check().ok
    assert compact_rank(raw, 0, LocalBackend(raw, "s")).part  # with room, it compacts


def test_object_storage_commits_before_it_deletes(tmp_path, monkeypatch):
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from _s3 import client, moto_s3, options
    from vlfast.extraction.store.backend import ObjectBackend

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing-key-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    ref = _uncompacted(tmp_path, "ref")
    with moto_s3() as endpoint:
        client(endpoint).create_bucket(Bucket="vlfast-compact")
        url, opts = "s3://vlfast-compact/out", options(endpoint)
        from vlfast.extraction.store.format import resolve_out

        out = resolve_out(url, opts)
        with FeatureStore(
            out, RUN_CONFIG | {"dim": 64}, shard_max_samples=6, compact_min_parts=None
        ) as store:
            from _selftest import fails, fake_features, sample_ids

            for sid in dict.fromkeys(sample_ids(N)):
                if fails(sid):
                    store.add_error(sid, f"videos/{sid}.mp4", "decode failed: simulated corrupt file")
                else:
                    feats = fake_features(sid)
                    store.add(sid, feats, {"path": f"videos/{sid}.mp4", "n_tokens": feats["tokens"].shape[0]})
        events: list[str] = []
        real_write, real_commit, real_remove = (
            ObjectBackend.write,
            ObjectBackend.commit_file,
            ObjectBackend.remove,
        )
        monkeypatch.setattr(
            ObjectBackend,
            "write",
            lambda self, p, *a, **k: (events.append(f"put {p.name}"), real_write(self, p, *a, **k))[1],
        )
        monkeypatch.setattr(  # a consolidated part is streamed up from its staged file
            ObjectBackend,
            "commit_file",
            lambda self, staged, p: (events.append(f"put {p.name}"), real_commit(self, staged, p))[1],
        )
        monkeypatch.setattr(
            ObjectBackend,
            "remove",
            lambda self, ps: (events.extend(f"rm {p.name}" for p in ps), real_remove(self, ps))[1],
        )
        result = compact_rank(out, 0, ObjectBackend(out, "s"))
        puts = [e for e in events if e.startswith("put part-")]
        assert puts == [f"put {result.part}"]
        assert events.index(puts[0]) < min(k for k, e in enumerate(events) if e.startswith("rm "))
        assert sum(e.startswith("rm ") for e in events) == result.replaced
        cache = FeatureCache(url, storage_options=opts)
        assert sorted(cache.ids()) == sorted(FeatureCache(ref).ids())
        assert cache.check().ok
