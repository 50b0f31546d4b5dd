"""Transient storage errors are retried, never made permanent; ``--retry-errors`` redoes recorded failures.

Against a real S3 API (moto's server on 127.0.0.1) behind a fault-injecting HTTP proxy (tests/_flaky.py)
that answers 503 SlowDown or resets the connection: a store that fails a few requests per object still
gives every sample, bit for bit as a clean run; one that keeps failing leaves records of kind "transient",
which the next run retries; a plain HTTP store (no client retries) is retried by vlfast itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from _flaky import always, first, flaky_store
from _s3 import client as _client
from _s3 import options as _options
from vlfast.cli.main import app
from vlfast.extraction import FeatureCache
from vlfast.extraction.api import extract
from vlfast.extraction.objstore import is_transient
from vlfast.extraction.sources import load_inputs
from vlfast.extraction.store.format import read_errors

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

runner = CliRunner()
KW = dict(features="vision,vision_mean", max_batch_samples=2, num_workers=2)
BUCKET = "vlfast-transient"
IDS = ["clips/walk.mp4", "img/img0000.jpg", "img/img0001.jpg"]
VIDEO_KEY = f"/{BUCKET}/data/clips/walk.mp4"


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    from vlfast.demo import make_images, make_video

    root = tmp_path_factory.mktemp("transient-media") / "data"
    make_images(root / "img", [(64, 48), (40, 56)])
    make_video(root / "clips" / "walk.mp4", frames=8, fps=4)
    return root


@pytest.fixture(scope="module")
def s3(media, moto_endpoint):
    """The session's moto S3 server with ``media`` under s3://BUCKET/data/ (objects public-read, for plain
    HTTP too)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("AWS_ACCESS_KEY_ID", "testing-key-id")
    mp.setenv("AWS_SECRET_ACCESS_KEY", "testing-secret")
    mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
    try:
        client = _client(moto_endpoint)
        client.create_bucket(Bucket=BUCKET)
        for path in sorted(p for p in media.rglob("*") if p.is_file()):
            key = f"data/{path.relative_to(media).as_posix()}"
            client.put_object(Bucket=BUCKET, Key=key, Body=path.read_bytes(), ACL="public-read")
        yield moto_endpoint
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def clean(media, tiny_qwen3_vl, tmp_path_factory) -> FeatureCache:
    out = tmp_path_factory.mktemp("transient-clean") / "out"
    extract(media, out, model=str(tiny_qwen3_vl), **KW)
    return FeatureCache(out)


def _same(cache: FeatureCache, clean: FeatureCache, ids: dict[str, str]) -> None:
    """``cache[ids[i]]`` equals ``clean[i]`` bit for bit, for every id of the clean run."""
    assert sorted(cache.ids()) == sorted(ids.values())
    for sid, got in ids.items():
        a, b = cache[got], clean[sid]
        assert a.keys() == b.keys()
        for name in b:
            assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), (sid, name)


def _cli(*args: str) -> dict:
    r = runner.invoke(app, ["extract", *args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout[r.stdout.index("{") :])


def test_flaky_store_retries_to_the_clean_result(s3, clean, tiny_qwen3_vl, tmp_path):
    """The first two reads of every object fail (503 SlowDown for the images, a reset connection for the
    video): the S3 client's retries, as vlfast configures them when the user sets none, absorb them."""
    out = tmp_path / "out"
    fault = first(2, "503", only=lambda p: p != VIDEO_KEY)
    with flaky_store(
        s3, lambda m, p, n: fault(m, p, n) or (first(2, "reset")(m, p, n) if p == VIDEO_KEY else None)
    ) as store:
        options = {"client_kwargs": {"endpoint_url": store.endpoint}}  # no retries given: vlfast's default
        summary = extract(f"s3://{BUCKET}/data", out, model=str(tiny_qwen3_vl), storage_options=options, **KW)
    assert store.injected["503"] >= 4 and store.injected["reset"] >= 2, store.injected
    assert (summary.extracted, summary.failed) == (3, 0), summary
    _same(FeatureCache(out), clean, {i: i for i in IDS})
    assert read_errors(out) == []


def test_store_that_keeps_failing_records_transient_and_the_next_run_retries(
    s3, clean, tiny_qwen3_vl, tmp_path
):
    out = tmp_path / "out"
    with flaky_store(s3, always("503", only=lambda p: p == VIDEO_KEY)) as store:
        args = [f"s3://{BUCKET}/data", str(out), "-m", str(tiny_qwen3_vl), "--workers", "2"]
        # two attempts per request: the video never gets through
        args += [
            "--storage-options",
            json.dumps(_options(store.endpoint) | {"config_kwargs": {"retries": {"max_attempts": 2}}}),
        ]
        first_run = _cli(*args)
        assert (first_run["extracted"], first_run["failed"]) == (2, 1), first_run
        (rec,) = read_errors(out)
        assert rec["id"] == "clips/walk.mp4" and rec["kind"] == "transient", rec
        assert (
            rec["reason"].startswith("transient storage error: cannot read s3://")
            and "SlowDown" not in rec["id"]
        )
        assert "clips/walk.mp4" not in FeatureCache(out)
        # still failing: tried again (not "nothing to do"), recorded again, the counts add up
        again = _cli(*args)
        assert again["nothing_to_do"] is False
        assert (again["skipped"], again["extracted"], again["failed"]) == (2, 0, 1), again
        assert [r["kind"] for r in read_errors(out)] == ["transient"]
        human = runner.invoke(app, ["extract", *args])
        assert human.exit_code == 0 and "run the same command again to retry them" in human.output
        injected = store.injected["503"]
        store.fault = None  # the store recovers
        healed = _cli(*args)
        finished = _cli(*args)
    assert injected >= 4
    assert (healed["skipped"], healed["extracted"], healed["failed"]) == (2, 1, 0), healed
    cache = FeatureCache(out)
    _same(cache, clean, {i: i for i in IDS})
    assert cache.errors() == []  # the transient record is superseded by the extracted sample
    assert finished["nothing_to_do"] is True


def test_plain_http_store_is_retried_by_vlfast(s3, clean, tiny_qwen3_vl, tmp_path):
    """fsspec's HTTP client has no retries: vlfast's own bounded retry gets through 503s and resets."""
    pytest.importorskip("aiohttp")
    out = tmp_path / "out"
    with flaky_store(s3, first(2, "503", only=lambda p: p != VIDEO_KEY)) as store:
        base = f"{store.endpoint}/{BUCKET}/data"
        manifest = tmp_path / "m.jsonl"
        manifest.write_text("".join(json.dumps({"id": i, "path": f"{base}/{i}"}) + "\n" for i in IDS))
        summary = extract(manifest, out, model=str(tiny_qwen3_vl), **KW)
    assert store.injected["503"] >= 4, store.injected
    assert (summary.extracted, summary.failed) == (3, 0), read_errors(out)
    _same(FeatureCache(out), clean, {i: i for i in IDS})


def test_retry_errors_redoes_recorded_failures_by_kind(media, clean, tiny_qwen3_vl, tmp_path):
    import shutil

    src = tmp_path / "in"
    shutil.copytree(media, src)
    good = (src / "img" / "img0001.jpg").read_bytes()
    (src / "img" / "img0001.jpg").write_bytes(b"not a jpeg at all")
    out = tmp_path / "out"
    args = [str(src), str(out), "-m", str(tiny_qwen3_vl), "--workers", "2"]
    first_run = _cli(*args)
    assert (first_run["extracted"], first_run["failed"]) == (2, 1)
    (rec,) = read_errors(out)
    assert rec["kind"] == "error" and rec["reason"].startswith("not an image PIL can read")
    (src / "img" / "img0001.jpg").write_bytes(good)  # the user fixes the file
    assert _cli(*args)["nothing_to_do"] is True  # an "error" record makes its id done
    assert _cli(*args, "--retry-errors", "transient")["nothing_to_do"] is True  # not that kind
    # by reason class, as the summary counts it
    retried = _cli(*args, "--retry-errors", "not an image PIL can read")
    assert (retried["skipped"], retried["extracted"], retried["failed"]) == (2, 1, 0), retried
    cache = FeatureCache(out)
    _same(cache, clean, {i: i for i in IDS})
    assert cache.errors() == []
    assert _cli(*args, "--retry-errors", "all")["nothing_to_do"] is True  # nothing recorded is left


def test_a_retry_that_fails_again_supersedes_the_old_record(media, tiny_qwen3_vl, tmp_path):
    import shutil

    src = tmp_path / "in"
    shutil.copytree(media, src)
    bad = src / "img" / "img0001.jpg"
    data = bad.read_bytes()
    bad.write_bytes(b"not a jpeg at all")
    out = tmp_path / "out"
    args = [str(src), str(out), "-m", str(tiny_qwen3_vl), "--workers", "2"]
    _cli(*args)
    bad.write_bytes(data[: len(data) // 3])  # now a truncated JPEG: another reason
    retried = _cli(*args, "--retry-errors", "all")
    assert (retried["skipped"], retried["extracted"], retried["failed"]) == (2, 0, 1), retried
    (rec,) = FeatureCache(out).errors()  # one record per id: the latest attempt's
    assert rec["id"] == "img/img0001.jpg" and not rec["reason"].startswith("not an image PIL can read"), rec
    assert _cli(*args)["nothing_to_do"] is True


def test_what_is_transient():
    import errno

    from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

    def client_error(code: str, status: int) -> ClientError:
        return ClientError(
            {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject"
        )

    def raised_from(outer: BaseException, cause: BaseException) -> BaseException:
        outer.__cause__ = cause
        return outer

    for e in (
        client_error("SlowDown", 503),
        client_error("InternalError", 500),
        client_error("Whatever", 502),
        raised_from(OSError(errno.EBUSY, "Service Unavailable"), client_error("SlowDown", 503)),
        ConnectionResetError(errno.ECONNRESET, "reset"),
        TimeoutError("read timed out"),
        EndpointConnectionError(endpoint_url="http://x"),
        ReadTimeoutError(endpoint_url="http://x"),
    ):
        assert is_transient(e), repr(e)
    for e in (
        FileNotFoundError("gone"),
        raised_from(PermissionError("denied"), client_error("AccessDenied", 403)),
        client_error("NoSuchKey", 404),
        client_error("NotImplemented", 501),
        ValueError("bad data"),
        OSError(errno.EINVAL, "invalid"),
    ):
        assert not is_transient(e), repr(e)


def test_shard_members_that_keep_failing_are_transient_then_extracted(s3, media, tiny_qwen3_vl, tmp_path):
    """A WebDataset shard at the URL: once it is listed, every ranged read of its members fails (503), for
    the image read whole and for the video that PyAV streams: both are recorded "transient", and the
    next run, the store healed, gives what the same shard gives on disk."""
    import tarfile

    shard = tmp_path / "000.tar"
    with tarfile.open(shard, "w") as tf:
        tf.add(media / "img" / "img0000.jpg", "a.jpg")
        tf.add(media / "clips" / "walk.mp4", "b.mp4")
    _client(s3).upload_file(str(shard), BUCKET, "shards/000.tar")
    local = tmp_path / "local"
    extract(str(shard), local, model=str(tiny_qwen3_vl), **KW)

    url, key = f"s3://{BUCKET}/shards/000.tar", f"/{BUCKET}/shards/000.tar"
    out = tmp_path / "out"
    with flaky_store(s3) as store:
        options = _options(store.endpoint)  # one attempt per request
        samples, _ = load_inputs(url, options)
        assert [x.id for x in samples] == ["000.tar/a", "000.tar/b"]
        listed = store.reads[key]  # what listing the shard reads; members are read after that
        store.reads.clear()
        # every run lists the shard again first; what comes after the listing fails
        store.fault = lambda m, p, n: "503" if p == key and n > listed else None
        failing = extract(url, out, model=str(tiny_qwen3_vl), storage_options=options, **KW)
        assert (failing.extracted, failing.failed) == (0, 2), read_errors(out)
        assert {r["kind"] for r in read_errors(out)} == {"transient"}
        store.fault = None
        healed = extract(url, out, model=str(tiny_qwen3_vl), storage_options=options, **KW)
    assert (healed.extracted, healed.failed) == (2, 0)
    a, b = FeatureCache(out), FeatureCache(local)
    assert sorted(a.ids()) == ["000.tar/a", "000.tar/b"] == sorted(b.ids())
    for sid in b.ids():
        assert all(torch.equal(a[sid][k], v) for k, v in b[sid].items()), sid
    assert a.errors() == []


@pytest.mark.slow
def test_retry_errors_with_the_ray_engine(ray_cluster, media, clean, tiny_qwen3_vl, tmp_path):
    """The model actors' own stores must not take a retried id for done (they would record it as a
    duplicate of its error)."""
    import shutil

    from vlfast.extraction.api import extract_ray

    src = tmp_path / "in"
    shutil.copytree(media, src)
    good = (src / "img" / "img0001.jpg").read_bytes()
    (src / "img" / "img0001.jpg").write_bytes(b"not a jpeg at all")
    out = tmp_path / "out"
    assert extract(src, out, model=str(tiny_qwen3_vl), **KW).failed == 1
    (src / "img" / "img0001.jpg").write_bytes(good)
    summary = extract_ray(
        src, out, model=str(tiny_qwen3_vl), ray_workers=1, cpus_per_worker=0.5, retry_errors="error"
    )
    assert (summary.skipped, summary.extracted, summary.failed) == (2, 1, 0), summary
    cache = FeatureCache(out)
    _same(cache, clean, {i: i for i in IDS})
    assert cache.errors() == []
