"""Inputs that change are noticed (issue 38 item 3): each sample records what identified its input (the row's
path resolved, size, mtime, stamp, the xxh3 of its bytes), and a resume extracts again a sample whose input
changed, counting it in the summary. What each check sees (docs/extract.md, "Inputs that change"): a row
that names another file or text, by every check; the same path with other bytes, by the full check (its
stamp moved); an input missing now, by none (never "changed" for lack of a read)."""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from vlfast.extraction import FeatureCache
from vlfast.extraction.api import extract


def _bmp(path: Path, seed: int) -> Path:
    """A 64x64 BMP: uncompressed, so every one of them has the same size (a replacement keeps it)."""
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(64, 64, 3) * 255).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, format="BMP")
    return path


def _run(inputs, out, model, **kw):
    return extract(str(inputs), str(out), model=str(model), num_workers=0, **kw)


def _replace_keeping_size_and_mtime(path: Path, seed: int) -> None:
    """New bytes under the same path, size and mtime: what `cp -p other path` leaves."""
    st = os.stat(path)
    _bmp(path, seed)
    assert os.stat(path).st_size == st.st_size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _vision_mean(out: Path, sid: str) -> torch.Tensor:
    return FeatureCache(out)[sid]["vision_mean"].float()


@pytest.fixture
def folder(tmp_path) -> Path:
    for k in range(3):
        _bmp(tmp_path / "in" / f"img{k}.bmp", k)
    return tmp_path / "in"


def test_the_same_path_with_other_bytes_is_extracted_again(folder, tiny_qwen3_vl, tmp_path):
    out = tmp_path / "out"
    _run(folder, out, tiny_qwen3_vl)
    before = _vision_mean(out, "img1.bmp")
    _replace_keeping_size_and_mtime(folder / "img1.bmp", seed=99)

    quick = _run(folder, out, tiny_qwen3_vl, resume_check="quick")  # path, size, mtime: all the same
    assert quick.nothing_to_do and quick.changed == 0

    full = _run(folder, out, tiny_qwen3_vl)  # the stamp moved (ctime): hashed, and the bytes differ
    assert full.changed == 1 and not full.nothing_to_do
    assert full.extracted == 3 and full.skipped == 0  # its shard-mates with it
    fresh = tmp_path / "fresh"
    _run(folder, fresh, tiny_qwen3_vl)
    torch.testing.assert_close(_vision_mean(out, "img1.bmp"), _vision_mean(fresh, "img1.bmp"))
    assert not torch.allclose(_vision_mean(out, "img1.bmp"), before, atol=1e-3)
    moved = list((out / "quarantine").iterdir())
    reason = json.loads((moved[0] / "reason.json").read_text())
    assert "input of 1 of its samples changed" in reason["reason"] and "img1.bmp" in reason["reason"]

    again = _run(folder, out, tiny_qwen3_vl)
    assert again.nothing_to_do and again.changed == 0
    os.utime(folder / "img0.bmp")  # touched: the stamp moves, the bytes do not
    assert _run(folder, out, tiny_qwen3_vl).nothing_to_do


def test_a_manifest_row_that_names_another_file(folder, tiny_qwen3_vl, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    manifest, out = tmp_path / "rows.jsonl", tmp_path / "out"
    rows = [{"id": "x", "path": "in/img0.bmp"}, {"id": "y", "path": "in/img1.bmp"}]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _run(manifest, out, tiny_qwen3_vl)
    import pyarrow.dataset as ds

    recorded = ds.dataset(out / "inputs").to_table(columns=["id", "path", "size", "xxh3"]).to_pylist()
    rec = {r["id"]: r for r in recorded}["x"]
    assert rec["path"] == str((folder / "img0.bmp").resolve())  # recorded resolved
    assert rec["size"] == (folder / "img0.bmp").stat().st_size and len(rec["xxh3"]) == 16

    # The same file spelled another way (absolute, through a symlinked folder) is the same input.
    (tmp_path / "link").symlink_to(folder, target_is_directory=True)
    rows = [{"id": "x", "path": str(folder / "img0.bmp")}, {"id": "y", "path": "link/img1.bmp"}]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _run(manifest, out, tiny_qwen3_vl, resume_check="quick").nothing_to_do

    # A byte-identical copy elsewhere is the same input too (hashed to tell)...
    shutil.copy(folder / "img0.bmp", tmp_path / "copy.bmp")
    rows[0]["path"] = "copy.bmp"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _run(manifest, out, tiny_qwen3_vl, resume_check="quick").nothing_to_do

    # ...another file is not: extracted again, by the quick check as well.
    rows[0]["path"] = "in/img2.bmp"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = _run(manifest, out, tiny_qwen3_vl, resume_check="quick")
    assert summary.changed == 1 and summary.extracted == 2, summary
    assert FeatureCache(out).meta("x")["path"].endswith("in/img2.bmp")
    assert _run(manifest, out, tiny_qwen3_vl).nothing_to_do
    # Back to the first file: the record of the shard moved aside names it, but no longer counts.
    rows[0]["path"] = "in/img0.bmp"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _run(manifest, out, tiny_qwen3_vl, resume_check="quick").changed == 1


def test_a_missing_input_is_not_a_changed_one(folder, tiny_qwen3_vl, tmp_path):
    manifest, out = tmp_path / "rows.jsonl", tmp_path / "out"
    manifest.write_text("".join(json.dumps({"path": str(p)}) + "\n" for p in sorted(folder.iterdir())))
    _run(manifest, out, tiny_qwen3_vl)
    (folder / "img2.bmp").rename(tmp_path / "away.bmp")  # unmounted, or deleted: nothing seen to differ
    os.chmod(folder / "img1.bmp", 0)  # unreadable (root reads it anyway; then its bytes are the same)
    try:
        summary = _run(manifest, out, tiny_qwen3_vl)
    finally:
        os.chmod(folder / "img1.bmp", 0o644)
    assert summary.nothing_to_do and summary.changed == 0


def test_a_consolidated_part_loses_only_the_changed_shard(folder, tiny_qwen3_vl, tmp_path):
    for k in range(3, 9):
        _bmp(folder / f"img{k}.bmp", k)
    out = tmp_path / "out"
    _run(folder, out, tiny_qwen3_vl, shard_max_samples=1)  # nine parts: compacted into one at the end
    assert len(list((out / "index").iterdir())) == 1
    _bmp(folder / "img4.bmp", 40)
    (folder / "img4.bmp").write_bytes((folder / "img4.bmp").read_bytes() + b"\0" * 8)  # another size

    summary = _run(folder, out, tiny_qwen3_vl, shard_max_samples=1, resume_check="quick")
    assert summary.nothing_to_do  # the quick check does not look at the file itself
    summary = _run(folder, out, tiny_qwen3_vl, shard_max_samples=1)
    assert (summary.changed, summary.extracted, summary.quarantined) == (1, 1, []), summary
    assert len(FeatureCache(out)) == 9
    assert len(list((out / "inputs").iterdir())) == 2  # the first run's nine merged at its close, and one
    _run(folder, out, tiny_qwen3_vl, shard_max_samples=1, overwrite=True)
    assert [p.name for p in (out / "inputs").iterdir()] == ["inputs-r00000-000000-000008.parquet"]


def test_a_tar_member_rewritten_in_place(tiny_qwen3_vl, tmp_path):
    from PIL import Image

    def shard(seeds: list[int]) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for key, seed in zip(("a", "b"), seeds):
                img = io.BytesIO()
                pixels = (np.random.RandomState(seed).rand(64, 64, 3) * 255).astype(np.uint8)
                Image.fromarray(pixels).save(img, format="BMP")
                info = tarfile.TarInfo(f"{key}.bmp")
                info.size, info.mtime = len(img.getvalue()), 0
                tar.addfile(info, io.BytesIO(img.getvalue()))
        return buf.getvalue()

    path, out = tmp_path / "s-000000.tar", tmp_path / "out"
    path.write_bytes(shard([1, 2]))
    _run(path, out, tiny_qwen3_vl)
    st = os.stat(path)
    path.write_bytes(shard([1, 3]))  # the same members at the same offsets, b's bytes another image
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    summary = _run(path, out, tiny_qwen3_vl)
    assert summary.changed == 1 and summary.extracted == 2


def test_one_sample_and_a_table_give_the_same_keys(tmp_path, monkeypatch):
    """The decode stage keys one sample at a time, a resume keys the input's columns: the same keys for every
    kind of entry (folders, paths kept whole past the folders kept once, frames, texts, members, URLs)."""
    from vlfast.extraction.sources.identity import entry_keys, sample_key
    from vlfast.extraction.sources.remote import RemoteFile
    from vlfast.extraction.sources.sample import Sample
    from vlfast.extraction.sources.table import SampleTable
    from vlfast.extraction.sources.webdataset import TarMember

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        "vlfast.extraction.sources.table._MAX_DIRS", 2
    )  # the third folder on: paths kept whole
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    samples = [
        Sample("a", "image", ("x/y.png",), "a prompt"),
        Sample("b", "frames", ("f/1.png", "f/2.png")),
        Sample("c", "text", (), text="hello", instruction="find it"),
        Sample("d", "video", ("s3://bucket/k/v.mp4",)),
        Sample("e", "image", ("noslash.png",), "p"),
        Sample("f", "image", ("/abs.png",)),
        Sample("g", "image", ("a/../b//c.png",)),
        Sample("h", "image", ("link/z.png",)),
        *[
            Sample(
                f"k{i}",
                "image",
                (f"s/x{i % 3}.tar/k{i}.jpg",),
                member=TarMember(f"s/x{i % 3}.tar", f"k{i}.jpg", 512 * i, 99),
            )
            for i in range(4)
        ],
        Sample("u", "image", ("s3://bucket/u.jpg",), member=RemoteFile("s3://bucket/u.jpg")),
    ]
    for group in (samples[:8], samples[8:12], samples[12:]):
        for texts in ((), ("prompt",), ("text", "instruction")):
            table = entry_keys(SampleTable.of(group), texts)
            one = np.array([sample_key(s, texts) for s in group], np.uint64)
            assert (table == one).all(), (group, texts)
    keys = entry_keys(SampleTable.of(samples[:8]), ("prompt",))
    assert len(set(keys.tolist())) == 8
    assert sample_key(Sample("h", "image", ("real/z.png",)), ()) == sample_key(samples[7], ())  # resolved
    assert sample_key(Sample("a", "image", ("x/y.png",), "another"), ("prompt",)) != keys[0]
