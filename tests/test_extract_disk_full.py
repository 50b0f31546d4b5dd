"""A full disk under OUT, for real: a small tmpfs (mounting one needs root; skipped otherwise) filled to
the last byte. `vlfast extract` exits 4 naming OUT and its free space, what was committed before stays
intact and readable, no partial file is left, and once there is room the same command resumes to the
result of a run that never met a full disk."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from _selftest import compare_caches
from vlfast.cli.main import app
from vlfast.extraction import FeatureCache

runner = CliRunner()


@pytest.fixture
def small_disk(tmp_path) -> Path:
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(disk: Path) -> Path:
    """A file taking every free byte of ``disk``."""
    ballast = disk / "ballast"
    with open(ballast, "wb", buffering=0) as f:  # unbuffered: every write meets the disk at once
        for size in (64 << 10, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                pass
    assert shutil.disk_usage(disk).free < 4096
    return ballast


@pytest.mark.parametrize("first_write", ["shard", "error record"])
def test_full_disk_exits_4_naming_out_and_resumes(first_write, small_disk, tiny_qwen3_vl, tmp_path):
    from vlfast.demo import make_images

    sizes = [(40 + 8 * (k % 4), 48 + 8 * (k // 4)) for k in range(10)]
    media = tmp_path / "media"
    make_images(media, sizes)
    # a first run commits part of the input; then the disk fills up and more input arrives
    src = tmp_path / "in"
    src.mkdir()
    names = sorted(p.name for p in media.iterdir())
    for name in names[:4]:
        shutil.copy(media / name, src / name)
    out = small_disk / "out"
    args = ["extract", str(src), str(out), "-m", str(tiny_qwen3_vl), "--workers", "0"]
    assert runner.invoke(app, args).exit_code == 0
    before = {sid: FeatureCache(out)[sid] for sid in FeatureCache(out).ids()}
    assert len(before) == 4
    for name in names[4:]:
        shutil.copy(media / name, src / name)
    if first_write == "error record":  # a bad file: its record is the first thing written
        (src / "broken.jpg").write_bytes(b"not an image")
    ballast = _fill(small_disk)

    r = runner.invoke(app, args)
    text = " ".join(r.output.split())
    assert r.exit_code == 4, r.output
    assert f"{out} is full" in text and "MiB free of 4.0 MiB" in text, text
    assert "run the same command again" in text and "SafetensorError" not in text, text
    assert ("committing a shard" if first_write == "shard" else "recording an error in") in text, text
    # what was committed is intact, and nothing partial holds the space
    cache = FeatureCache(out)
    assert sorted(cache.ids()) == sorted(before) and cache.verify().ok
    for sid, feats in before.items():
        assert all(feats[k].equal(v) for k, v in cache[sid].items()), sid
    assert not [p.name for p in (out / "shards").iterdir() if p.name.startswith(".tmp")]

    ballast.unlink()
    r = runner.invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    clean = tmp_path / "clean"
    assert runner.invoke(app, [*args[:2], str(clean), *args[3:]]).exit_code == 0
    assert compare_caches(clean, out) == []  # the same result as a run that never met a full disk


def test_full_temp_folder_under_an_s3_out_names_it(
    small_disk, moto_endpoint, tiny_qwen3_vl, tmp_path, monkeypatch
):
    """Shards of an OUT on object storage are staged in the local temp folder: when that is full, the
    message names it (and TMPDIR), not OUT; the same command resumes once there is room."""
    import tempfile

    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from _s3 import client, options
    from vlfast.demo import make_images
    from vlfast.extraction.api import extract
    from vlfast.extraction.store.format import OutputFull

    media = tmp_path / "media"
    make_images(media, [(40, 48), (48, 56)])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing-key-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    kw = dict(model=str(tiny_qwen3_vl), features="vision,vision_mean", num_workers=0)
    endpoint = moto_endpoint  # the session's server (conftest)
    client(endpoint).create_bucket(Bucket="vlfast-full")
    out, opts = "s3://vlfast-full/out", options(endpoint)
    ballast = _fill(small_disk)
    monkeypatch.setattr(tempfile, "tempdir", str(small_disk))
    with pytest.raises(OutputFull) as e:
        extract(media, out, storage_options=opts, **kw)
    text = str(e.value)
    assert f"the local temp folder {small_disk} is full" in text and "TMPDIR" in text and out in text
    assert "MiB free of 4.0 MiB" in text
    assert [p.name for p in small_disk.iterdir()] == ["ballast"]  # the staged file was removed
    ballast.unlink()
    summary = extract(media, out, storage_options=opts, **kw)
    assert (summary.extracted, summary.failed) == (2, 0)
