"""fsspec URLs as `vlfast extract` input, against a real S3 API server on localhost (moto's standalone
server): features equal the same files extracted locally, a missing object is a recorded error, an
unreachable endpoint or missing bucket exits 2 naming the URL and never the credentials; a manifest
at a URL; memory:// too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from _s3 import client as _client
from _s3 import options as _options
from _s3 import refused_port
from vlfast.cli.main import app
from vlfast.extraction import FeatureCache
from vlfast.extraction.api import extract
from vlfast.extraction.sources import load_inputs

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

runner = CliRunner()
KW = dict(features="vision,vision_mean", max_batch_samples=2, num_workers=2)
BUCKET = "vlfast-media"
SECRET = "s3cr3t-never-shown"


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    from vlfast.demo import make_images, make_video

    root = tmp_path_factory.mktemp("fsspec-media") / "data"
    make_images(root / "img", [(64, 48), (40, 56)])
    make_video(root / "clips" / "walk.mp4", frames=8, fps=4)
    (root / "notes.txt").write_text("not media")
    return root


def _files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def s3(media, monkeypatch_module, moto_endpoint):
    """The session's moto S3 server with ``media`` uploaded under s3://BUCKET/data/; yields its endpoint."""
    monkeypatch_module.setenv("AWS_ACCESS_KEY_ID", "testing-key-id")
    monkeypatch_module.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch_module.setenv("AWS_DEFAULT_REGION", "us-east-1")
    client = _client(moto_endpoint)
    client.create_bucket(Bucket=BUCKET)
    for rel in _files(media):
        client.upload_file(str(media / rel), BUCKET, f"data/{rel}")
    return moto_endpoint


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def local_run(media, tiny_qwen3_vl, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsspec-local") / "out"
    extract(media, out, model=str(tiny_qwen3_vl), **KW)
    return out


def _assert_same(a: FeatureCache, b: FeatureCache, ids_a: dict[str, str]) -> None:
    """Every sample of ``b`` (local) equals ``a``'s sample ``ids_a[id]`` bit for bit."""
    assert sorted(a.ids()) == sorted(ids_a.values())
    for sid, rid in ids_a.items():
        fa, fb = a[rid], b[sid]
        assert fa.keys() == fb.keys()
        for name in fb:
            assert fa[name].dtype == fb[name].dtype and torch.equal(fa[name], fb[name]), (sid, name)


def test_s3_folder_equals_local(s3, local_run, tiny_qwen3_vl, tmp_path):
    out = tmp_path / "out"
    r = runner.invoke(
        app,
        [
            "extract",
            f"s3://{BUCKET}/data",
            str(out),
            "-m",
            str(tiny_qwen3_vl),
            "--workers",
            "2",
            "--storage-options",
            json.dumps(_options(s3)),
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    assert SECRET not in r.output
    local = FeatureCache(local_run)
    ids = sorted(local.ids())
    assert ids == ["clips/walk.mp4", "img/img0000.jpg", "img/img0001.jpg"]
    # a folder URL is listed like a local folder: the same ids, the same features
    _assert_same(FeatureCache(out), local, {i: i for i in ids})
    assert FeatureCache(out).meta("clips/walk.mp4")["path"] == f"s3://{BUCKET}/data/clips/walk.mp4"


@pytest.mark.parametrize("where", ["local", "s3"])
def test_s3_manifest_with_a_missing_object(where, s3, local_run, tiny_qwen3_vl, tmp_path):
    rows = [{"path": f"s3://{BUCKET}/data/{rel}"} for rel in ("img/img0001.jpg", "clips/walk.mp4")]
    rows.append({"id": "gone", "path": f"s3://{BUCKET}/data/missing.jpg"})
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if where == "s3":  # the manifest itself read through fsspec
        _client(s3).upload_file(str(manifest), BUCKET, f"{tmp_path.name}/m.jsonl")
        manifest = f"s3://{BUCKET}/{tmp_path.name}/m.jsonl"
    out = tmp_path / "out"
    summary = extract(manifest, out, model=str(tiny_qwen3_vl), storage_options=_options(s3), **KW)
    assert summary.extracted == 2 and summary.failed == 1
    # without an id column a URL's id is the URL itself
    _assert_same(
        FeatureCache(out),
        FeatureCache(local_run),
        {rel: f"s3://{BUCKET}/data/{rel}" for rel in ("img/img0001.jpg", "clips/walk.mp4")},
    )
    (error,) = FeatureCache(out).errors()
    assert error["id"] == "gone" and f"file not found: s3://{BUCKET}/data/missing.jpg" in error["reason"]


def test_s3_manifest_paths_relative_to_its_url(s3):
    csv = 'id,path\n,img/img0000.jpg\nclip,clips/walk.mp4\nframes,"[""img/img0000.jpg"", ""img/img0001.jpg""]"\n'
    _client(s3).put_object(Bucket=BUCKET, Key="data/m.csv", Body=csv.encode())
    samples, problems = load_inputs(f"s3://{BUCKET}/data/m.csv", _options(s3))
    assert [(s.id, s.paths, str(s.member)) for s in samples] == [
        ("img/img0000.jpg", (f"s3://{BUCKET}/data/img/img0000.jpg",), f"s3://{BUCKET}/data/img/img0000.jpg"),
        ("clip", (f"s3://{BUCKET}/data/clips/walk.mp4",), f"s3://{BUCKET}/data/clips/walk.mp4"),
    ]
    assert [(p.id, p.reason) for p in problems] == [
        ("frames", "a frame list of URLs is not supported yet; give a video URL")
    ]
    assert "options_json" not in repr(samples[0].member)  # the storage options are never shown
    with pytest.raises(FileNotFoundError, match=f"s3://{BUCKET}/data/none.csv"):
        load_inputs(f"s3://{BUCKET}/data/none.csv", _options(s3))


@pytest.mark.parametrize("case", ["missing bucket", "unreachable endpoint"])
def test_bad_s3_input_exits_2_naming_the_url(case, s3, tiny_qwen3_vl, tmp_path):
    options = _options(s3)
    url = f"s3://{BUCKET}/data"
    if case == "missing bucket":
        url = "s3://no-such-bucket/data"
    else:
        options["client_kwargs"]["endpoint_url"] = f"http://127.0.0.1:{refused_port()}"
    options["key"], options["secret"] = "another-key-id", SECRET  # credentials in the options too
    out = tmp_path / "out"
    args = ["extract", url, str(out), "-m", str(tiny_qwen3_vl), "--storage-options", json.dumps(options)]
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    assert url in text and SECRET not in text and "another-key-id" not in text, text
    assert not out.exists()
    # a manifest naming the same URL is refused before any work too
    manifest = tmp_path / "m.csv"
    manifest.write_text(f"path\n{url}/img/img0000.jpg\n")
    r = runner.invoke(app, ["extract", str(manifest), *args[2:]])
    assert r.exit_code == 2 and SECRET not in r.output and not out.exists(), r.output


def test_memory_url_and_local_inputs_import_no_fsspec(media, local_run, tiny_qwen3_vl, tmp_path):
    import subprocess
    import sys

    code = (
        "import sys; from vlfast.extraction.sources import load_inputs; "
        f"load_inputs({str(media)!r}); print('fsspec' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout == "False\n"

    import fsspec

    fs = fsspec.filesystem("memory")
    for rel in _files(media):
        fs.pipe(f"/vlfast-test/{rel}", (media / rel).read_bytes())
    try:
        samples, problems = load_inputs("memory://vlfast-test/img")
        assert [s.id for s in samples] == ["img0000.jpg", "img0001.jpg"] and not problems
        out = tmp_path / "out"
        summary = extract("memory://vlfast-test", out, model=str(tiny_qwen3_vl), **KW)
        assert summary.extracted == 3 and summary.failed == 0
        ids = sorted(FeatureCache(local_run).ids())
        _assert_same(FeatureCache(out), FeatureCache(local_run), {i: i for i in ids})
    finally:
        fs.rm("/vlfast-test", recursive=True)


def test_local_or_remote_is_decided_by_the_filesystem_not_the_path_class(tmp_path):
    """universal_pathlib 0.2's UPath("s3://...") is a pathlib.Path: judged by class, an OUT in a bucket took
    the local route (flock on a path that is not on this disk: FileNotFoundError for locks/rank-00000.lock).
    A Path subclass carrying an fsspec filesystem stands in for it here, whatever universal_pathlib is
    installed; the floors venv of docs/internals.md runs the S3 tests on 0.2 itself."""
    import fsspec

    from vlfast.extraction.store.format import is_local, resolve_out
    from vlfast.extraction.store.writer import FeatureStore

    class BucketPath(type(Path())):  # a pathlib.Path whose filesystem is fsspec's memory store
        fs = fsspec.filesystem("memory")

        @property
        def path(self) -> str:
            return "/vlfast-floor-test" + str(self)

    assert not is_local(BucketPath("/out")) and is_local(tmp_path) and is_local(resolve_out(str(tmp_path)))
    assert not is_local(resolve_out("memory://vlfast-floor-test/out"))
    assert is_local(resolve_out(f"file://{tmp_path}"))
    with FeatureStore(BucketPath("/out"), {"model": "m"}) as store:  # the object-storage route: no flock
        store.add("a", {"x": torch.ones(2)})
    assert not (Path("/out") / "locks").exists()
    assert BucketPath.fs.exists("/vlfast-floor-test/out/run.json")
