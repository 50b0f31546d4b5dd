"""Damage is quarantined whatever its shape: what in OUT is not where the format puts it.

A foreign Parquet file (valid, but not an index part) or garbage under a part's name, a wrong-schema part, a
folder where a file belongs, a file where a folder belongs, index/ deleted or emptied while shards remain, a
part deleted under its shard, a foreign file in index/. For each: ``FeatureCache`` names the problem or reads
every sample (never a silent 0, never a KeyError), ``check_folder`` (``vlfast out verify``) reports a finding, and a
store opening OUT moves it to quarantine (never deletes it) and the run completes; a second open moves
nothing. A file where a folder belongs (or a folder where a file does), which only a hand edit makes, is
refused instead, saying what to move out of OUT; moved, the run completes. The same shapes on object storage (moto's S3 server). Each OUT is copied from one built per module.
"""

from __future__ import annotations

import io
import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from _selftest import fake_features
from vlfast.cli.main import app
from vlfast.extraction import FeatureCache, FeatureStore
from vlfast.extraction.store.format import META_CONFIG, DamagedFile, read_index_part, xxh3
from vlfast.extraction.store.integrity import check_folder
from vlfast.extraction.store.layout import Misplaced, uncovered_shards
from vlfast.extraction.store.resume import read_state

CFG = {"model": "m", "dtype": "bfloat16", "processor": {"max_pixels": 1024}, "versions": {"torch": "2.13"}}
IDS = [f"s{i}" for i in range(9)]


def _fill(out) -> None:
    with FeatureStore(out, CFG, shard_max_samples=3, compact_min_parts=None) as s:
        for sid in IDS:
            s.add(sid, fake_features(sid), {"path": f"{sid}.mp4"})


def _resume(out) -> FeatureStore:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # each move aside warns; what was moved is checked instead
        with FeatureStore(out, CFG, shard_max_samples=3) as s:
            for sid in IDS:
                if sid not in s.done_ids():
                    s.add(sid, fake_features(sid), {"path": f"{sid}.mp4"})
    return s


def _foreign_parquet() -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.table({"a": [1, 2], "b": ["x", "y"]}), sink)
    return sink.getvalue()


def _hashed(data: bytes, seq: str = "000009") -> str:
    return f"part-r00000-{seq}-{xxh3(data)}.parquet"


def _part(out: Path, seq: int) -> Path:
    return next((out / "index").glob(f"part-r00000-{seq:06d}-*.parquet"))


def _rewritten_part(out: Path, change: Callable[[pa.Table], pa.Table]) -> None:
    """A copy of part 0 changed by ``change``, committed under a free number with its own checksum."""
    sink = io.BytesIO()
    pq.write_table(change(read_index_part(_part(out, 0))), sink)
    data = sink.getvalue()
    (out / "index" / _hashed(data)).write_bytes(data)


def _row_as_text(t: pa.Table) -> pa.Table:
    return t.set_column(t.schema.get_field_index("row"), "row", t.column("row").cast(pa.string()))


def _config_not_json(t: pa.Table) -> pa.Table:
    return t.replace_schema_metadata({**t.schema.metadata, META_CONFIG: b"{not json"})


def _file(path: Path, data: bytes = b"not a folder") -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.write_bytes(data)


def _folder(path: Path) -> None:
    path.unlink(missing_ok=True)
    (path / "inside").mkdir(parents=True)
    (path / "inside" / "kept.txt").write_text("a user's file")


# name -> (fault, what a plain FeatureCache does: "refused" (DamagedFile) or the number of samples it reads)
FAULTS: dict[str, tuple[Callable[[Path], None], str | int]] = {
    "foreign parquet, name with another checksum": (
        lambda o: (o / "index/part-r00000-000009-0123456789abcdef.parquet").write_bytes(_foreign_parquet()),
        "refused",
    ),
    "foreign parquet, name with its checksum": (
        lambda o: (o / "index" / _hashed(_foreign_parquet())).write_bytes(_foreign_parquet()),
        "refused",
    ),
    # Named for shard 1, which part 1 covers: the foreign file goes, the sound shard stays.
    "foreign parquet named for a covered shard": (
        lambda o: (o / "index" / _hashed(_foreign_parquet(), "000001")).write_bytes(_foreign_parquet()),
        "refused",
    ),
    "a part whose row column is text": (lambda o: _rewritten_part(o, _row_as_text), "refused"),
    "a part whose vlfast.config is not JSON": (lambda o: _rewritten_part(o, _config_not_json), "refused"),
    "random bytes": (
        lambda o: (o / "index/part-r00000-000009-fedcba9876543210.parquet").write_bytes(b"\x00garbage" * 9),
        "refused",
    ),
    "a zero-byte part": (
        lambda o: (o / "index/part-r00000-000009-0123456789abcdef.parquet").write_bytes(b""),
        "refused",
    ),
    "garbage under a consolidated part's name": (
        lambda o: (o / "index" / f"part-r00000-000000-000009-{xxh3(b'junk')}.parquet").write_bytes(b"junk"),
        "refused",
    ),
    "a folder under a part's name": (
        lambda o: _folder(o / "index/part-r00000-000009-0123456789abcdef.parquet"),
        "refused",
    ),
    "index/ deleted": (lambda o: shutil.rmtree(o / "index"), "refused"),
    "index/ emptied": (lambda o: [p.unlink() for p in (o / "index").iterdir()], "refused"),
    "index is a file": (lambda o: _file(o / "index"), "refused"),
    "shards is a file": (lambda o: _file(o / "shards"), "refused"),
    "run.json is a folder": (lambda o: _folder(o / "run.json"), "refused"),
    # Plain reads follow index parts: what a deleted part leaves is found by out verify and set aside by a run.
    "a part deleted under its shard": (lambda o: _part(o, 1).unlink(), 6),
    "a folder under an uncovered shard's name": (
        lambda o: _folder(o / "shards/shard-r00000-000009.safetensors"),
        9,
    ),
    "errors is a file": (lambda o: _file(o / "errors"), 9),
    "an errors file is a folder": (lambda o: _folder(o / "errors/errors-r00000.jsonl"), 9),
    "locks is a file": (lambda o: _file(o / "locks"), 9),
    "quarantine is a file": (lambda o: _file(o / "quarantine"), 9),
    "checked.json is a folder": (lambda o: _folder(o / "checked.json"), 9),
}


# Hand-made states (a file where a folder belongs, a folder where a file does): a run refuses them, saying
# what to move, and moves or repairs nothing; moved out of OUT as it says, the run completes.
MISPLACED = {
    "index is a file": "index",
    "shards is a file": "shards",
    "run.json is a folder": "run.json",
    "errors is a file": "errors",
    "an errors file is a folder": "errors/errors-r00000.jsonl",
    "locks is a file": "locks",
    "quarantine is a file": "quarantine",
    "checked.json is a folder": "checked.json",
}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("strays") / "base"
    _fill(out)
    return out


def _everything_under(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", list(FAULTS))
def test_each_shape_is_named_then_moved_aside_and_the_run_completes(
    base: Path, tmp_path: Path, name: str
) -> None:
    out = tmp_path / "out"
    shutil.copytree(base, out)
    shards_before = _everything_under(base / "shards")
    fault, reader = FAULTS[name]
    fault(out)
    planted = _everything_under(out)

    # A reader names it, or reads what the parts hold: never a KeyError, never a silent 0.
    if reader == "refused":
        with pytest.raises(DamagedFile):
            FeatureCache(out)
    else:
        assert len(FeatureCache(out)) == reader
    # vlfast out verify reports a finding (run.json as a folder is refused outright: nothing to check against).
    if name == "run.json is a folder":
        with pytest.raises(DamagedFile, match="is a folder"):
            check_folder(out)
    else:
        report = check_folder(out)
        assert not report.ok, report
        assert report.bad_parts or report.strays

    if name in MISPLACED:  # refused, naming it and the move; OUT as it was; moved out, the run completes
        as_it_was = _everything_under(out)  # (the check above may have recorded what it hashed)
        with pytest.raises(Misplaced, match="Nothing is moved for you: move it out of OUT") as e:
            _resume(out)
        assert f"{MISPLACED[name]} is a " in str(e.value) and f"mv {out / MISPLACED[name]} " in str(e.value)
        assert _everything_under(out) == as_it_was
        shutil.move(out / MISPLACED[name], tmp_path / "moved-out")
        _resume(out)
        assert sorted(FeatureCache(out).ids()) == IDS and check_folder(out).ok
        return
    # A run moves it aside, never deletes it, redoes what is missing; a second run moves nothing.
    first = _resume(out)
    assert first.quarantined, "nothing was moved aside"
    assert sorted(FeatureCache(out).ids()) == IDS
    assert check_folder(out).ok
    assert _resume(out).quarantined == []
    # What was planted, and every shard there was, is still in OUT: in place or in quarantine, never deleted.
    # (Sound index parts are left out: compaction replaces them, as at the end of every run.)
    before = _everything_under(base)
    kept = set(_everything_under(out).values())
    for rel, data in planted.items():
        if before.get(rel) != data or rel.startswith("shards/"):
            assert data in kept, f"{rel} was deleted"
    if name == "foreign parquet named for a covered shard":  # the sound shard stayed and nothing was redone
        assert _everything_under(out / "shards") == shards_before


def test_a_shard_a_kill_left_is_still_removed_and_reported_until_then(base: Path, tmp_path: Path) -> None:
    """The one uncovered shard a kill explains (its rank's last, above every part) is garbage, as before."""
    out = tmp_path / "out"
    shutil.copytree(base, out)
    leftover = out / "shards/shard-r00000-000003.safetensors"
    shutil.copy(out / "shards/shard-r00000-000002.safetensors", leftover)
    (out / "shards/shard-r00000-000005.safetensors").write_bytes(b"x")  # a second one above: not a kill's
    assert uncovered_shards(out) == {leftover.name: False, "shard-r00000-000005.safetensors": False}
    (out / "shards/shard-r00000-000005.safetensors").unlink()
    assert uncovered_shards(out) == {leftover.name: True}
    assert len(FeatureCache(out)) == 9
    assert [s["path"] for s in check_folder(out).strays] == [f"shards/{leftover.name}"]
    assert read_state(out, CFG).damaged == [f"shards/{leftover.name}"]  # a finished OUT: not "nothing to do"
    assert _resume(out).quarantined == [] and not leftover.exists()
    assert check_folder(out).ok and read_state(out, CFG).damaged == []


def test_one_shard_and_no_part_is_named_and_kept(tmp_path: Path) -> None:
    """A rank with no part and one shard: a run killed before its first commit, or an OUT of one shard whose
    index was lost (the demo's size). Not told apart, so never deleted, and never read as 0 samples."""
    out = tmp_path / "out"
    with FeatureStore(out, CFG, compact_min_parts=None) as s:
        s.add("a", fake_features("a"))
    (part,) = (out / "index").iterdir()
    part.unlink()
    with pytest.raises(DamagedFile, match="no index part, but 1 shard that"):
        FeatureCache(out)
    assert [s["path"] for s in check_folder(out).strays] == ["shards/shard-r00000-000000.safetensors"]
    assert [q["part"] for q in _resume(out).quarantined] == ["shards/shard-r00000-000000.safetensors"]
    assert list((out / "quarantine").glob("*/shard-r00000-000000.safetensors"))


def test_the_commands_exit_1_or_2_never_3(base: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "out"
    shutil.copytree(base, out)
    (out / "index" / _hashed(_foreign_parquet())).write_bytes(_foreign_parquet())
    r = runner.invoke(app, ["out", "verify", str(out)])
    assert r.exit_code == 1, r.output
    assert "not a vlfast index part" in r.output and "moves" in r.output
    r = runner.invoke(app, ["export", str(out), str(tmp_path / "t.parquet"), "--feature", "mean"])
    assert r.exit_code == 2 and "not a vlfast index part" in r.output, r.output

    shutil.rmtree(out)
    shutil.copytree(base, out)
    shutil.rmtree(out / "index")
    r = runner.invoke(app, ["out", "verify", str(out), "--json"])
    assert r.exit_code == 1, r.output
    report = json.loads(r.output)
    assert report["ok"] is False and len(report["strays"]) == 3
    r = runner.invoke(app, ["export", str(out), str(tmp_path / "t.parquet"), "--feature", "mean"])
    assert r.exit_code == 2 and "index was deleted or lost" in r.output, r.output


def test_out_verify_advises_per_kind_of_stray(base: Path, tmp_path: Path) -> None:
    """`vlfast out verify`'s advice follows what a run does with each stray: a shard no part covers is moved
    aside by the same `vlfast extract`; a file where a folder belongs is refused by it, so only the user can
    move it (the advice once said a run would move both)."""
    runner = CliRunner()
    out = tmp_path / "out"
    shutil.copytree(base, out)
    _file(out / "locks")
    r = runner.invoke(app, ["out", "verify", str(out)])
    assert r.exit_code == 1 and "locks is a file" in r.output, r.output
    assert "nothing is moved for you" in r.output and "moves them aside" not in r.output, r.output
    with pytest.raises(Misplaced):  # what the advice says a run does
        _resume(out)
    (out / "locks").unlink()
    _part(out, 1).unlink()
    r = runner.invoke(app, ["out", "verify", str(out)])
    assert r.exit_code == 1 and "moves them aside" in r.output, r.output
    assert "nothing is moved for you" not in r.output, r.output


# ------------------------------------------------------------------------------------- object storage


@pytest.fixture(scope="module")
def s3(moto_endpoint):
    pytest.importorskip("s3fs")
    pytest.importorskip("upath")
    from _s3 import client

    mp = pytest.MonkeyPatch()
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing-key-id",
        "AWS_SECRET_ACCESS_KEY": "testing-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": moto_endpoint,
    }.items():
        mp.setenv(key, value)
    c = client(moto_endpoint)
    c.create_bucket(Bucket="vlfast-strays")
    yield c
    mp.undo()
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


S3_FAULTS: dict[str, Callable[[object, str], None]] = {
    "foreign parquet": lambda c, p: c.put_object(
        Bucket="vlfast-strays",
        Key=f"{p}/index/part-r00000-000009-0123456789abcdef.parquet",
        Body=_foreign_parquet(),
    ),
    "a zero-byte part": lambda c, p: c.put_object(
        Bucket="vlfast-strays", Key=f"{p}/index/part-r00000-000009-0123456789abcdef.parquet", Body=b""
    ),
    "a prefix under a part's name": lambda c, p: c.put_object(
        Bucket="vlfast-strays", Key=f"{p}/index/part-r00000-000009-0123456789abcdef.parquet/x", Body=b"x"
    ),
    "index/ deleted": lambda c, p: [
        c.delete_object(Bucket="vlfast-strays", Key=o["Key"])
        for o in c.list_objects_v2(Bucket="vlfast-strays", Prefix=f"{p}/index/")["Contents"]
    ],
}


@pytest.mark.parametrize("name", list(S3_FAULTS))
def test_the_same_shapes_on_object_storage(s3, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = "case-" + name.replace(" ", "-").replace("/", "").replace("'", "")
    out = f"s3://vlfast-strays/{prefix}"
    _fill(out)
    S3_FAULTS[name](s3, prefix)
    with pytest.raises(DamagedFile):
        FeatureCache(out)
    assert not check_folder(out).ok
    monkeypatch.setattr("vlfast.extraction.store.backend.ORPHAN_AGE", 0.0)  # the uncovered shards are old
    assert _resume(out).quarantined
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="vlfast-strays", Prefix=f"{prefix}/")["Contents"]]
    assert sorted(FeatureCache(out).ids()) == IDS and check_folder(out).ok
    assert _resume(out).quarantined == []
    moved = [k for k in keys if "/quarantine/" in k and not k.endswith("reason.json")]
    assert moved, "nothing kept in quarantine"
    if name == "index/ deleted":  # the three shards moved aside, not deleted
        assert len([k for k in moved if "/shard-" in k]) == 3


# ------------------------------------------------------------------------------------- the real run


def test_a_finished_extraction_sets_strays_right_then_has_nothing_to_do(media_dir, tiny_qwen3_vl, tmp_path):
    """A foreign Parquet file under a part's name (found by the checks): the run moves it aside, redoes
    nothing, and the next answers "nothing to do". A file where errors/ belongs is refused (exit 2) saying
    what to move; moved, the next run answers "nothing to do"."""
    from vlfast.extraction.api import extract

    inputs = tmp_path / "in"
    inputs.mkdir()
    shutil.copy(media_dir / "good" / "rgb.jpg", inputs / "rgb.jpg")
    out = tmp_path / "out"
    kw = dict(model=str(tiny_qwen3_vl), num_workers=0, features="vision_mean")
    extract(inputs, out, **kw)
    (out / "index" / _hashed(_foreign_parquet())).write_bytes(_foreign_parquet())
    with pytest.warns(UserWarning, match="moved to"):
        again = extract(inputs, out, **kw)
    assert not again.nothing_to_do and again.extracted == 0 and len(again.quarantined) == 1
    assert FeatureCache(out).ids() == ["rgb.jpg"] and check_folder(out).ok
    assert extract(inputs, out, **kw).nothing_to_do
    _file(out / "errors")
    with pytest.raises(Misplaced, match="errors is a file where vlfast keeps a folder"):
        extract(inputs, out, **kw)
    (out / "errors").unlink()
    assert extract(inputs, out, **kw).nothing_to_do
