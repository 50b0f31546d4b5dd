"""WebDataset tar shards as `vlfast extract` input: brace patterns, ids, features equal to the same media
as plain files, corrupt members, truncated shards, a killed run resumed per sample, refused patterns."""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from _selftest import compare_caches
from vlfast.cli.main import app
from vlfast.extraction import FeatureCache
from vlfast.extraction.api import extract
from vlfast.extraction.engines.base import Hooks
from vlfast.extraction.engines.local import LocalEngine
from vlfast.extraction.sources import load_inputs
from vlfast.extraction.sources.webdataset import MAX_SHARDS, TarMember, expand_braces

runner = CliRunner()
# One sample per forward and store shards of two samples: a kill lands between commits, mid tar shard.
KW = dict(features="vision,vision_mean", max_batch_samples=1, shard_max_samples=2)
CORRUPT = "001.tar/sample_0004"


def _png(seed: int, h: int = 48, w: int = 64) -> bytes:
    from PIL import Image

    from vlfast.demo import pattern

    buf = io.BytesIO()
    Image.fromarray(pattern(h, w, seed)).save(buf, "PNG")
    return buf.getvalue()


def _jpg(seed: int) -> bytes:
    from PIL import Image

    from vlfast.demo import pattern

    buf = io.BytesIO()
    Image.fromarray(pattern(56, 72, seed)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _write_tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict:
    """Three shards (`shards/{000..002}.tar`), the same media as plain files with a manifest giving them
    the shards' ids, and the expected ids."""
    from vlfast.demo import make_video

    root = tmp_path_factory.mktemp("wds")
    video = make_video(root / "clip.mp4", frames=10, fps=5, width=96, height=64).read_bytes()
    layout = {  # shard -> [(member, bytes)]; keys group consecutive members as webdataset does
        "000.tar": [
            ("sample_0000.jpg", _jpg(0)),
            ("sample_0000.json", json.dumps({"prompt": "What is this?", "url": "x"}).encode()),
            ("sample_0001.png", _png(1)),
            ("sample_0001.txt", b"Describe the colours.\n"),
            ("sample_0002.mp4", video),
            ("sub/sample_0003.png", _png(3)),  # a key in a folder inside the tar
        ],
        "001.tar": [
            ("__meta__/info.json", b"{}"),  # webdataset skips its __meta__ members
            ("README", b"no extension: not part of any sample"),
            ("sample_0004.jpg", b"this is not a JPEG\n" * 40),  # corrupt member: a decoding error
            ("sample_0005.png", _png(5)),
            ("sample_0005.cls", b"7"),
            ("labels_only.cls", b"3"),  # no media, no prompt: skipped like a caption in a folder
            ("sample_0006.jpg", _jpg(6)),
            ("sample_0007.png", _png(7)),
        ],
        "002.tar": [(f"sample_{k:04d}.png", _png(k)) for k in range(8, 12)],
    }
    plain, rows, ids = root / "plain", [], []
    for shard, members in layout.items():
        _write_tar(root / "shards" / shard, members)
        for name, data in members:
            key, _, ext = name.partition(".")
            if ext not in ("jpg", "png", "mp4"):
                continue
            file = plain / shard / name
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_bytes(data)
            ids.append(f"{shard}/{key}")
            rows.append({"id": ids[-1], "path": str(file)})
    (root / "plain.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"root": root, "pattern": str(root / "shards" / "{000..002}.tar"), "ids": ids}


@pytest.fixture(scope="module")
def shard_run(shards, tiny_qwen3_vl, tmp_path_factory):
    """The pattern extracted with two decode workers reading members in place."""
    out = tmp_path_factory.mktemp("wds-run") / "out"
    summary = extract(shards["pattern"], out, model=str(tiny_qwen3_vl), num_workers=2, **KW)
    return summary, out


# ------------------------------------------------------------------------------------------ patterns


def test_brace_expansion_follows_bash():
    assert expand_braces("s/{000..003}.tar") == ["s/000.tar", "s/001.tar", "s/002.tar", "s/003.tar"]
    assert expand_braces("s/{8..11}.tar") == ["s/8.tar", "s/9.tar", "s/10.tar", "s/11.tar"]
    assert expand_braces("{train,val}/{0..1}.tar") == ["train/0.tar", "train/1.tar", "val/0.tar", "val/1.tar"]
    assert expand_braces("{a,b{1,2}}") == ["a", "b1", "b2"]
    assert expand_braces("{00..10..5}") == ["00", "05", "10"]
    assert expand_braces("{3..1}") == ["3", "2", "1"]
    assert expand_braces("{a..c}") == ["a", "b", "c"]
    assert expand_braces("{a,}x") == ["ax", "x"]
    assert expand_braces("plain.tar") == ["plain.tar"]
    for bad, words in [
        ("s/{000..009.tar", "never closed"),
        ("s/}000.tar", "closes nothing"),
        ("s/{abc}.tar", "neither a range"),
        ("s/{0..99999999}.tar", f"more than {MAX_SHARDS:,}"),
    ]:
        with pytest.raises(ValueError, match=words):
            expand_braces(bad)


def test_ids_are_shard_qualified_keys_and_stable(shards, monkeypatch, tmp_path):
    samples, problems = load_inputs(shards["pattern"])
    assert [s.id for s in samples] == shards["ids"]
    assert problems == []
    by_id = {s.id: s for s in samples}
    assert by_id["000.tar/sub/sample_0003"].paths == (
        str(shards["root"] / "shards/000.tar/sub/sample_0003.png"),
    )
    assert by_id["000.tar/sample_0002"].kind == "video"
    assert by_id["000.tar/sample_0000"].member.name == "sample_0000.jpg"  # the media, not the json
    # prompts: the json's "prompt", the txt's text (stripped), else none
    assert by_id["000.tar/sample_0000"].prompt == "What is this?"
    assert by_id["000.tar/sample_0001"].prompt == "Describe the colours."
    assert by_id["001.tar/sample_0005"].prompt is None
    # the same ids from a relative pattern (the ids depend on the path from the braces' folder on)
    monkeypatch.chdir(shards["root"])
    assert [s.id for s in load_inputs("shards/{000..002}.tar")[0]] == shards["ids"]
    assert [s.id for s in load_inputs("./shards/002.tar")[0]] == [i for i in shards["ids"] if i[:3] == "002"]
    # shards in two folders: the folder stays in the id, so equal file names stay apart
    monkeypatch.chdir(tmp_path)
    for split in ("train", "val"):
        _write_tar(Path(f"two/{split}/0.tar"), [("k.png", _png(1))])
    assert [s.id for s in load_inputs("two/{train,val}/0.tar")[0]] == ["train/0.tar/k", "val/0.tar/k"]


def test_key_problems_are_recorded_not_fatal(tmp_path):
    _write_tar(
        tmp_path / "0.tar",
        [
            ("ok.png", _png(0)),
            ("two.png", _png(1)),
            ("two.jpg", _jpg(2)),  # two media members for one key
            ("badjson.png", _png(3)),
            ("badjson.json", b"{not json"),
            ("notext.png", _png(4)),
            ("notext.json", b'{"prompt": 5}'),
            ("both.png", _png(5)),
            ("both.txt", b"from txt"),
            ("both.json", b'{"prompt": "from json"}'),  # the json's prompt wins
            ("nomedia.json", b"{}"),
        ],
    )
    samples, problems = load_inputs(str(tmp_path / "0.tar"))
    assert {s.id: s.prompt for s in samples} == {"0.tar/ok": None, "0.tar/both": "from json"}
    reasons = {p.id: p.reason for p in problems}
    assert "2 media members (.png, .jpg)" in reasons["0.tar/two"]
    assert "not valid JSON" in reasons["0.tar/badjson"]
    assert '"prompt" must be text' in reasons["0.tar/notext"]
    assert "no image or video member" in reasons["0.tar/nomedia"]


# ------------------------------------------------------------------------------------- extraction


def test_features_equal_the_same_media_as_plain_files(shard_run, shards, tiny_qwen3_vl, tmp_path):
    summary, out = shard_run
    plain = extract(
        shards["root"] / "plain.jsonl", tmp_path / "plain", model=str(tiny_qwen3_vl), num_workers=0, **KW
    )
    a, b = FeatureCache(out), FeatureCache(tmp_path / "plain")
    good = [i for i in shards["ids"] if i != CORRUPT]
    assert sorted(a.ids()) == sorted(b.ids()) == sorted(good)
    assert summary.extracted == plain.extracted == len(good)
    for sid in good:
        fa, fb = a[sid], b[sid]
        assert fa.keys() == fb.keys()
        for name in fb:
            assert fa[name].dtype == fb[name].dtype and torch.equal(fa[name], fb[name]), (sid, name)
        ma, mb = a.meta(sid), b.meta(sid)
        shard = sid.split("/", 1)[0]
        member = Path(mb.pop("path")).relative_to(shards["root"] / "plain" / shard).as_posix()
        assert ma.pop("path") == f"{shards['root'] / 'shards' / shard}/{member}"
        assert ma == mb, sid


def test_corrupt_member_is_a_recorded_error(shard_run, shards):
    summary, out = shard_run
    errors = FeatureCache(out).errors()
    assert [(e["id"], e["kind"]) for e in errors] == [(CORRUPT, "error")]
    assert "not an image PIL can read" in errors[0]["reason"]
    assert errors[0]["source"] == str(shards["root"] / "shards/001.tar/sample_0004.jpg")
    assert summary.failed == 1 and summary.total == len(shards["ids"])


def _cut_copy(shards, tmp_path: Path, at) -> tuple[str, int]:
    """The shards copied to tmp_path with 001.tar cut at ``at(members)`` bytes; (pattern, cut)."""
    dst = tmp_path / "shards"
    shutil.copytree(shards["root"] / "shards", dst)
    with tarfile.open(dst / "001.tar") as tf:
        members = {m.name: m for m in tf.getmembers()}
    cut = at(members)
    data = (dst / "001.tar").read_bytes()
    (dst / "001.tar").write_bytes(data[:cut])
    return str(dst / "{000..002}.tar"), cut


def test_truncated_shard_records_what_was_lost_and_the_rest_is_extracted(shards, tiny_qwen3_vl, tmp_path):
    # cut in the middle of sample_0006.jpg's data: 0004 (corrupt) and 0005 are whole, 0006 is lost, 0007
    # and whatever followed cannot be listed
    pattern, cut = _cut_copy(shards, tmp_path, lambda m: m["sample_0006.jpg"].offset_data + 100)
    summary = extract(pattern, tmp_path / "out", model=str(tiny_qwen3_vl), num_workers=1, **KW)
    cache = FeatureCache(tmp_path / "out")
    lost = {"001.tar/sample_0006", "001.tar/sample_0007", CORRUPT}
    assert sorted(cache.ids()) == sorted(set(shards["ids"]) - lost)
    errors = {e["id"]: e for e in cache.errors()}
    assert set(errors) == {CORRUPT, "001.tar/sample_0006", "001.tar"}
    key, shard = errors["001.tar/sample_0006"], errors["001.tar"]
    assert key["kind"] == shard["kind"] == "input"
    assert f"ends at byte {cut:,}, 100 of the" in key["reason"] and "sample_0006.jpg" in key["reason"]
    assert key["source"].endswith("shards/001.tar/sample_0006.jpg")
    assert "truncated shard" in shard["reason"] and "cannot be listed" in shard["reason"]
    assert shard["source"].endswith("shards/001.tar")
    assert summary.failed == 3 and summary.extracted == len(shards["ids"]) - 3
    # the records never mark an id done: once the shard is whole again, its keys are extracted
    shutil.copy(shards["root"] / "shards/001.tar", tmp_path / "shards/001.tar")
    again = extract(pattern, tmp_path / "out", model=str(tiny_qwen3_vl), num_workers=0, **KW)
    assert again.extracted == 2 and sorted(FeatureCache(tmp_path / "out").ids()) == sorted(
        set(shards["ids"]) - {CORRUPT}
    )


@pytest.mark.parametrize(
    ("where", "words", "kept"),
    [
        (
            lambda m: m["sample_0006.jpg"].offset + 200,
            "inside the header of the member after 'labels_only.cls'",
            2,
        ),
        (
            lambda m: m["sample_0006.jpg"].offset,
            "right after member 'labels_only.cls', without the end-of-archive",
            2,
        ),
        (lambda m: 0, "it is empty (0 bytes)", 0),
    ],
    ids=["in-a-header", "at-a-boundary", "empty"],
)
def test_truncated_shard_kinds_are_named(shards, tmp_path, where, words, kept):
    pattern, _ = _cut_copy(shards, tmp_path, where)
    samples, problems = load_inputs(pattern)
    shard = [p for p in problems if p.id == "001.tar"]
    assert len(shard) == 1 and words in shard[0].reason, problems
    ids = [s.id for s in samples]
    assert [i for i in ids if i.startswith("001.tar/")] == ["001.tar/sample_0004", "001.tar/sample_0005"][
        :kept
    ]
    assert [i for i in ids if not i.startswith("001.tar/")] == [i for i in shards["ids"] if i[:3] != "001"]
    if kept:  # the key at the cut may have lost members (its media could have come next): recorded
        assert "001.tar/labels_only" in {p.id for p in problems}


def test_corrupt_header_mid_shard_is_named(shards, tmp_path):
    dst = tmp_path / "shards"
    shutil.copytree(shards["root"] / "shards", dst)
    with tarfile.open(dst / "001.tar") as tf:
        at = tf.getmember("sample_0006.jpg").offset
    data = bytearray((dst / "001.tar").read_bytes())
    data[at + 148 : at + 156] = b"garbage!"  # the header checksum field
    (dst / "001.tar").write_bytes(bytes(data))
    _, problems = load_inputs(str(dst / "{000..002}.tar"))
    shard = next(p for p in problems if p.id == "001.tar")
    assert f"member header at byte {at:,}" in shard.reason and "not valid tar" in shard.reason


def test_killed_run_resumes_only_the_missing_keys(shards, shard_run, tiny_qwen3_vl, tmp_path):
    out, kill_after = tmp_path / "crashed", 6
    script = textwrap.dedent(
        f"""
        import os
        from vlfast.extraction.api import extract
        from vlfast.extraction.engines.base import Hooks
        from vlfast.extraction.engines.local import LocalEngine
        calls = []
        def die(batch):
            calls.append(1)
            if len(calls) > {kill_after}:
                os._exit(9)
        extract({shards["pattern"]!r}, {str(out)!r}, model={str(tiny_qwen3_vl)!r}, num_workers=0,
                engine=LocalEngine(Hooks(forward=die)), **{KW!r})
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 9, proc.stderr[-2000:]
    committed = set(FeatureCache(out).ids())
    recorded = {e["id"] for e in FeatureCache(out).errors()}
    # killed half-way through a tar shard: some of its keys are committed, some are not
    by_shard = {s: {i for i in committed if i.startswith(s)} for s in ("000.tar", "001.tar", "002.tar")}
    assert 0 < len(committed) <= kill_after and any(0 < len(v) < 4 for v in by_shard.values()), committed

    decoded = []
    resumed = extract(
        shards["pattern"],
        out,
        model=str(tiny_qwen3_vl),
        num_workers=0,
        engine=LocalEngine(Hooks(decode=lambda s: decoded.append(s.id))),
        **KW,
    )
    assert sorted(decoded) == sorted(set(shards["ids"]) - committed - recorded)
    assert resumed.skipped == len(committed | recorded)
    _, reference = shard_run
    assert compare_caches(out, reference) == []


# ------------------------------------------------------------------------------- refused patterns


def test_bad_patterns_exit_2_before_any_work(shards, tiny_qwen3_vl, tmp_path):
    shard_dir = tmp_path / "shards"
    shutil.copytree(shards["root"] / "shards", shard_dir)
    out = tmp_path / "out"

    def run(pattern: str, *extra: str):
        r = runner.invoke(app, ["extract", pattern, *extra, str(out), "-m", str(tiny_qwen3_vl)])
        assert r.exit_code == 2, r.output
        assert not out.exists()  # nothing written: refused before the store or the model
        return " ".join(r.output.split())

    text = run(str(shard_dir / "{000..004}.tar"))
    assert "2 of the 5 shards" in text and f"{shard_dir / '003.tar'}, {shard_dir / '004.tar'}" in text
    (shard_dir / "003.tar").write_text('{"not": "a tar"}\n' * 100)
    text = run(str(shard_dir / "{000..003}.tar"))
    assert f"{shard_dir / '003.tar'} is not a tar archive" in text
    (shard_dir / "004.tar").write_bytes(gzip.compress((shard_dir / "000.tar").read_bytes()))
    text = run(str(shard_dir / "{000,004}.tar"))
    assert "gzip-compressed" in text and "decompress" in text
    text = run(str(shard_dir / "{000..002.tar"))
    assert "never closed" in text
    # the shell expanded an unquoted pattern: INPUT is many .tar files
    text = run(str(shard_dir / "000.tar"), str(shard_dir / "001.tar"))
    assert "quote a shard pattern" in text


def test_member_reads_in_place(shards):
    with tarfile.open(shards["root"] / "shards/000.tar") as tf:
        info = tf.getmember("sample_0002.mp4")
        data = tf.extractfile(info).read()
    member = TarMember(str(shards["root"] / "shards/000.tar"), info.name, info.offset_data, info.size)
    assert member.read_bytes() == data
    with member.open() as f:
        f.seek(-10, os.SEEK_END)
        assert f.read() == data[-10:] and f.tell() == len(data)
        f.seek(5)
        assert f.read(7) == data[5:12]
    # a shard cut after it was listed: the decoder is told, not fed a short file
    from vlfast.pixels.media import SampleError
    from vlfast.pixels.video import read_video

    beyond = TarMember(member.shard, member.name, member.offset, member.size + 10**6)
    with pytest.raises(SampleError, match="truncated shard: .* inside member 'sample_0002.mp4'"):
        read_video(beyond, None)
