"""OUT on object storage, against a real S3 API server on localhost (moto's standalone server, s3fs as the
client): the commit protocol without renames or locks. A full run equals a local one bit for bit and reads
back through ``FeatureCache("s3://...")``; SIGKILLs at random points (of the store and of the real command) end, after resuming, byte-identical to
an uninterrupted run; a shard whose index part never came is invisible and redone; two writers of one rank
cannot overwrite each other's shards; damage on the server is found, quarantined and redone; an OUT whose
bucket is missing or whose endpoint is down exits 2 before any work."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from _crash import kill_at_random_points
from _s3 import client, enforced_auth, refused_port
from _selftest import RUN_CONFIG, compare_caches, fake_features, run
from vlfast.cli.main import app
from vlfast.extraction import FeatureCache
from vlfast.extraction.api import extract
from vlfast.extraction.store.format import DamagedFile, resolve_out
from vlfast.extraction.store.writer import FeatureStore

pytest.importorskip("s3fs")
pytest.importorskip("upath")
moto_server = pytest.importorskip("moto.server")

runner = CliRunner()
BUCKET = "vlfast-out"
KW = dict(features="vision,vision_mean", max_batch_samples=2, num_workers=2)


@pytest.fixture(scope="module")
def endpoint(moto_endpoint):
    """The session's moto S3 server with an empty bucket; the environment points boto at it, so
    subprocesses and plain ``s3://`` URLs reach it too."""
    mp = pytest.MonkeyPatch()
    url = moto_endpoint
    mp.setenv("AWS_ACCESS_KEY_ID", "testing-key-id")
    mp.setenv("AWS_SECRET_ACCESS_KEY", "testing-secret")
    mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
    mp.setenv("AWS_ENDPOINT_URL", url)
    client(url).create_bucket(Bucket=BUCKET)
    yield url
    mp.undo()
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # its instances hold this server's endpoint


def _client():
    return client(os.environ["AWS_ENDPOINT_URL"])


def _keys(prefix: str) -> list[str]:
    pages = _client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def _fresh(name: str) -> str:
    return f"s3://{BUCKET}/{name}-{time.monotonic_ns()}"


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    from vlfast.demo import make_images, make_video

    root = tmp_path_factory.mktemp("s3-out-media")
    make_images(root, [(64, 48), (40, 56), (48, 48), (56, 40), (32, 64), (64, 64)])
    make_video(root / "walk.mp4", frames=8, fps=4)
    (root / "broken.png").write_bytes(b"not a png")
    return root


@pytest.fixture(scope="module")
def local_run(media, tiny_qwen3_vl, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("s3-out-local") / "out"
    extract(media, out, model=str(tiny_qwen3_vl), **KW)
    return out


def _index_rows(cache: FeatureCache) -> list[dict]:
    """Every row of the index parts of ``cache``'s OUT on S3, read with pyarrow alone."""
    import pyarrow.parquet as pq

    fs, root = cache.out.fs, cache.out.path
    rows = []
    for key in fs.ls(f"{root}/index", detail=False):
        with fs.open(key, "rb") as f:
            rows += pq.read_table(f).to_pylist()
    return rows


# ---------------------------------------------------------------------------------------------- runs


def test_cli_to_s3_equals_local_and_reads_back(endpoint, media, local_run, tiny_qwen3_vl):
    out = _fresh("cli")
    options = json.dumps({"client_kwargs": {"endpoint_url": endpoint}})
    args = ["extract", str(media), out, "-m", str(tiny_qwen3_vl), "-f", "vision,vision_mean"]
    r = runner.invoke(app, [*args, "--workers", "2", "--storage-options", options, "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert summary["extracted"] == 7 and summary["failed"] == 1, summary
    assert compare_caches(out, local_run) == []
    cache = FeatureCache(out, storage_options={"client_kwargs": {"endpoint_url": endpoint}})
    assert len(cache) == 7 and cache.run_config == FeatureCache(local_run).run_config
    assert [e["reason"] for e in cache.errors()] == [e["reason"] for e in FeatureCache(local_run).errors()]
    assert cache.info(cache.ids()[0])["shard"].startswith("shards/shard-r00000-")
    # entries made from each shard's header, read by range: the index rows themselves, as locally
    local = FeatureCache(local_run)
    for sid in cache.ids():
        assert [(f["name"], f["shape"], f["dtype"], f["xxh3"]) for f in cache.info(sid)["features"]] == [
            (f["name"], f["shape"], f["dtype"], f["xxh3"]) for f in local.info(sid)["features"]
        ]
    index = {r["id"]: r for r in _index_rows(cache)}
    assert all(cache.info(sid)["features"] == index[sid]["features"] for sid in cache.ids())
    # the bucket holds the format's objects only: no temp files, no locks, errors in a session object
    prefix = out.removeprefix(f"s3://{BUCKET}/")
    names = [k.removeprefix(prefix + "/") for k in _keys(prefix)]
    assert "run.json" in names and not any(n.startswith(("locks/", ".tmp")) or "/.tmp" in n for n in names)
    assert [n for n in names if n.startswith("errors/")][0].startswith("errors/errors-r00000-")

    r = runner.invoke(app, ["out", "verify", out, "--storage-options", options])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, [*args, "--storage-options", options])  # resume: nothing left
    assert r.exit_code == 0 and "nothing to do" in r.output, r.output


@pytest.mark.filterwarnings("ignore:.*fail their checksum.*:UserWarning")  # the repair warns, as promised
def test_a_finished_out_on_s3_is_checked_and_repaired(endpoint, media, tiny_qwen3_vl):
    """A flipped byte inside a tensor of a finished OUT on S3: the same command does not say "nothing to
    do" but moves the shard aside and redoes it; an untouched OUT is then not hashed again (checked.json,
    keyed on each shard's ETag), and any new upload of a shard (a new ETag) is hashed again."""
    from vlfast.extraction.store import integrity

    out = _fresh("finished")
    one = media / "img0000.jpg"
    args = ["extract", str(one), out, "-m", str(tiny_qwen3_vl), "-f", "vision,vision_mean", "--workers", "0"]
    assert runner.invoke(app, args).exit_code == 0
    (sid,) = FeatureCache(out).ids()
    before = {k: v.clone() for k, v in FeatureCache(out)[sid].items()}
    prefix = out.removeprefix(f"s3://{BUCKET}/")

    def flip() -> None:
        (key,) = [k for k in _keys(prefix) if "/shards/" in k]
        raw = bytearray(_client().get_object(Bucket=BUCKET, Key=key)["Body"].read())
        raw[-3] ^= 0x20  # inside the last tensor
        _client().put_object(Bucket=BUCKET, Key=key, Body=bytes(raw))

    flip()
    r = runner.invoke(app, ["out", "verify", out])
    assert r.exit_code == 1 and "Run the same `vlfast extract` again" in r.output, r.output
    r = runner.invoke(app, args)
    assert r.exit_code == 0 and "nothing to do" not in r.output, r.output
    assert sum("/quarantine/" in k for k in _keys(prefix)) == 3
    cache = FeatureCache(out, verify=True)
    assert all(torch.equal(cache[sid][k], v) for k, v in before.items())

    hashed = []
    real = integrity.check_part

    def counting(part, *, data=True):
        hashed.append(data)
        return real(part, data=data)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("vlfast.extraction.store.resume.check_part", counting)
        assert "nothing to do" in runner.invoke(app, args).output and hashed == [False, True]
        hashed.clear()
        assert "nothing to do" in runner.invoke(app, args).output and hashed == [False]  # recorded
    flip()  # a new upload: a new ETag, so the record no longer vouches for it
    r = runner.invoke(app, args)
    assert r.exit_code == 0 and "nothing to do" not in r.output, r.output
    assert runner.invoke(app, ["out", "verify", out]).exit_code == 0


def _selftest(out: str, n: int, *extra: str) -> list[str]:
    return [sys.executable, str(Path(__file__).with_name("_selftest.py")), out, "--samples", str(n), *extra]


def test_sigkill_three_times_then_resume_is_bit_identical_on_s3(endpoint, tmp_path):
    """The store's crash test, on S3: kills land mid-add, mid-upload, between a shard and its index part
    and between error commits; the resumed output equals an uninterrupted local run byte for byte."""
    n, ref, out = 90, tmp_path / "ref", _fresh("crash")
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    run(str(ref), n, shard_max_samples=6)  # uninterrupted, local, in this process: the kills need processes
    # three kills here; five on a local OUT in tests/test_extract_crash.py
    progress = kill_at_random_points(
        _selftest(out, n, "--shard-samples", "6", "-v", "--sleep", "0.01"), 3, random.Random(20261123), 0.02
    )
    assert progress[-1][0] < progress[0][0], progress
    r = subprocess.run(_selftest(out, n, "--shard-samples", "6"), env=env, capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert compare_caches(out, ref) == []
    assert compare_caches(ref, out) == []


def test_real_command_killed_after_a_commit_resumes_on_s3(endpoint, media, local_run, tiny_qwen3_vl):
    """`vlfast extract` itself, SIGKILLed once its first index part is on the server, then run again.

    The kill races the run: on a quick host the command can commit all 7 samples between two polls of the
    server. Such an attempt proves nothing about a resume, so it is made again on a fresh OUT (3 at most)."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    for attempt in range(3):
        out = _fresh(f"killed{attempt}")
        prefix = out.removeprefix(f"s3://{BUCKET}/")
        cmd = [sys.executable, "-m", "vlfast.cli.main", "extract", str(media), out, "-m", str(tiny_qwen3_vl)]
        cmd += [
            "-f",
            "vision,vision_mean",
            "--workers",
            "1",
            "--commit-every",
            "0.01",
            "--batch-tokens",
            "64",
        ]
        p = subprocess.Popen(
            cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )
        deadline = time.monotonic() + 120
        while not any("/index/part-" in k for k in _keys(prefix)):
            assert p.poll() is None, p.stderr.read().decode()
            assert time.monotonic() < deadline, "no commit within 120 s"
            time.sleep(0.05)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        p.stderr.close()
        partial = len(FeatureCache(out))
        if partial < 7:
            break
    assert 0 < partial < 7, f"the command finished before each of {attempt + 1} kills"
    r = subprocess.run([*cmd, "--json"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["skipped"] >= partial and summary["extracted"] == 7 - partial, summary
    assert compare_caches(out, local_run) == []


# ------------------------------------------------------------------------------------------ protocol


def _store(out, **kw) -> FeatureStore:
    return FeatureStore(out, RUN_CONFIG, shard_max_samples=100, **kw)


def test_a_shard_without_its_index_part_is_invisible_then_cleaned_when_old(endpoint, monkeypatch):
    out = _fresh("orphan")
    with _store(out) as store:
        store.add("a", fake_features("a"))
    store = _store(out)
    store.add("b", fake_features("b"))

    def killed(*a, **k):  # the process dies between the shard's upload and its index part's
        raise KeyboardInterrupt

    monkeypatch.setattr(FeatureStore, "_write_index_part", killed)
    with pytest.raises(KeyboardInterrupt):
        store.flush()
    monkeypatch.undo()
    prefix = out.removeprefix(f"s3://{BUCKET}/")
    assert len([k for k in _keys(prefix) if "/shards/" in k]) == 2
    assert FeatureCache(out).ids() == ["a"]  # readers follow index parts only

    with _store(out) as again:  # young: may be a live writer's upload, so it stays
        assert again.done_ids() == {"a"}
    assert len([k for k in _keys(prefix) if "/shards/" in k]) == 2
    monkeypatch.setattr("vlfast.extraction.store.backend.ORPHAN_AGE", 0.0)
    with _store(out) as again:  # old: garbage, deleted; its sample is redone
        assert again.done_ids() == {"a"}
        again.add("b", fake_features("b"))
    assert len([k for k in _keys(prefix) if "/shards/" in k]) == 2
    assert sorted(FeatureCache(out).ids()) == ["a", "b"]


def test_two_writers_of_one_rank_never_overwrite_each_other(endpoint):
    """No locks on S3: names are created exclusively (If-None-Match), so the second writer of a sequence
    number takes the next one instead of replacing the first writer's shard."""
    out = _fresh("race")
    first, second = _store(out), _store(out)
    first.add("x", fake_features("x"))
    second.add("y", fake_features("y"))
    first.flush()
    second.flush()  # its shard-r00000-000000 is taken: it becomes 000001
    first.close()
    second.close()
    cache = FeatureCache(out, verify=True)
    assert sorted(cache.ids()) == ["x", "y"]
    for sid in ("x", "y"):
        assert torch.equal(cache[sid]["tokens"], fake_features(sid)["tokens"])
    prefix = out.removeprefix(f"s3://{BUCKET}/")
    assert [k.rsplit("/", 1)[-1] for k in _keys(prefix) if "/shards/" in k] == [
        "shard-r00000-000000.safetensors",
        "shard-r00000-000001.safetensors",
    ]


def test_exclusive_create_is_enforced_by_the_server(endpoint):
    from vlfast.extraction.store.backend import put_object

    path = resolve_out(_fresh("exclusive")) / "object"
    put_object(path, b"first", exclusive=True)
    with pytest.raises(FileExistsError):
        put_object(path, b"second", exclusive=True)
    assert path.read_bytes() == b"first"


def test_damage_on_the_server_is_found_quarantined_and_redone(endpoint):
    out = _fresh("damage")
    with _store(out) as store:
        for sid in ("p", "q"):
            store.add(sid, fake_features(sid))
    prefix = out.removeprefix(f"s3://{BUCKET}/")
    (key,) = [k for k in _keys(prefix) if "/shards/" in k]
    raw = bytearray(_client().get_object(Bucket=BUCKET, Key=key)["Body"].read())
    raw[-3] ^= 0x20  # a flipped bit inside the last tensor
    _client().put_object(Bucket=BUCKET, Key=key, Body=bytes(raw))

    cache = FeatureCache(out, verify=True)
    with pytest.raises(DamagedFile, match="do not match their checksum"):
        [cache[sid] for sid in cache.ids()]
    report = cache.verify()
    assert not report.ok and {b["id"] for b in report.bad_samples} <= {"p", "q"}

    with pytest.warns(UserWarning, match="moved to"), _store(out) as again:
        assert again.done_ids() == set()  # its samples will be extracted again
        assert len(again.quarantined) == 1
    keys = _keys(prefix)
    assert not any("/shards/" in k or "/index/" in k for k in keys)
    assert sum("/quarantine/" in k for k in keys) == 3  # the shard, its part and reason.json


def test_a_swapped_shard_is_refused_by_plain_reads_on_s3(endpoint):
    """A same-named shard of another run (other weights: same size, same ids) uploaded over a committed one:
    plain reads refuse it, in the parent and in forked DataLoader workers, naming the shard and the fix."""
    out, other = _fresh("swapped"), _fresh("swapped-other")
    ids = [f"s{k}" for k in range(4)]
    with _store(out) as store:
        for sid in ids:
            store.add(sid, fake_features(sid))
    with FeatureStore(other, RUN_CONFIG | {"weights": "fine-tuned"}, shard_max_samples=100) as store:
        for sid in ids:
            store.add(sid, {k: -v if v.is_floating_point() else v for k, v in fake_features(sid).items()})
    (key,) = [k for k in _keys(out.removeprefix(f"s3://{BUCKET}/")) if "/shards/" in k]
    (theirs,) = [k for k in _keys(other.removeprefix(f"s3://{BUCKET}/")) if "/shards/" in k]
    body = _client().get_object(Bucket=BUCKET, Key=theirs)["Body"].read()
    assert len(body) == _client().head_object(Bucket=BUCKET, Key=key)["ContentLength"]
    _client().put_object(Bucket=BUCKET, Key=key, Body=body)

    remedy = "Run the same `vlfast extract` again"
    with pytest.raises(DamagedFile, match=rf"shard-r00000-000000.*another configuration.*'s0'.*{remedy}"):
        FeatureCache(out)["s0"]
    loader = torch.utils.data.DataLoader(
        FeatureCache(out), batch_size=2, num_workers=2, collate_fn=list, multiprocessing_context="fork"
    )
    with pytest.raises(DamagedFile, match="shard-r00000-000000.*another configuration"):
        list(loader)


def test_error_records_are_committed_with_the_work(endpoint):
    """S3 cannot append: each session's records are one object, uploaded again on every commit. Records a
    kill loses only make their samples be tried again."""
    out = _fresh("errors")
    store = _store(out, commit_every=None)
    store.add_error("bad-1", "videos/bad-1.mp4", "decode failed")
    with _store(out) as other:
        assert other.done_ids() == set()  # not committed yet: a kill now would lose it
    store.flush()
    store.add_error("bad-2", "videos/bad-2.mp4", "decode failed")
    store.close()
    with _store(out) as again:
        assert again.done_ids() == {"bad-1", "bad-2"}
        again.add_error("bad-3", "videos/bad-3.mp4", "decode failed")
    reasons = sorted(e["id"] for e in FeatureCache(out).errors())
    assert reasons == ["bad-1", "bad-2", "bad-3"]


# ------------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("case", ["missing-bucket", "unreachable"])
def test_bad_out_url_exits_2_naming_it_before_any_work(case, endpoint, media, tiny_qwen3_vl):
    if case == "missing-bucket":
        out, options = "s3://no-such-bucket-vlfast/out", {}
        expected = "bucket 'no-such-bucket-vlfast' does not exist"
    else:
        out = f"s3://{BUCKET}/unreachable"
        options = {
            "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{refused_port()}"},
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2},
        }
        expected = "cannot be reached"
    args = ["extract", str(media), out, "-m", str(tiny_qwen3_vl), "--storage-options", json.dumps(options)]
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    assert out in r.output and expected in " ".join(r.output.split()), r.output
    assert not _keys("unreachable")


def test_overwrite_on_s3_deletes_only_what_the_format_owns(endpoint):
    out = _fresh("overwrite")
    prefix = out.removeprefix(f"s3://{BUCKET}/")
    with _store(out) as store:
        store.add("old", fake_features("old"))
        store.add_error("old-bad", "videos/old-bad.mp4", "decode failed")
    _client().put_object(Bucket=BUCKET, Key=f"{prefix}/notes.txt", Body=b"the user's own file")
    with FeatureStore(out, RUN_CONFIG | {"dim": 32}, overwrite=True) as store:  # another configuration
        assert store.done_ids() == set()
        store.add("new", fake_features("new", 32))
    cache = FeatureCache(out)
    assert cache.ids() == ["new"] and cache.errors() == [] and cache.run_config["dim"] == 32
    assert f"{prefix}/notes.txt" in _keys(prefix)


def test_a_local_out_imports_neither_fsspec_nor_upath(tmp_path):
    code = (
        "import sys; import _selftest; from vlfast.extraction import FeatureCache; "
        f"_selftest.run({str(tmp_path / 'out')!r}, 10); FeatureCache({str(tmp_path / 'out')!r}).verify(); "
        "print(sorted(m for m in ('fsspec', 'upath', 's3fs') if m in sys.modules))"
    )
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.stdout == "[]\n", r.stderr


def test_a_shard_committed_after_a_cached_listing_is_not_taken_for_missing(endpoint):
    """fsspec caches listings per filesystem instance: a resume that listed shards/ before another rank
    committed must still find that rank's new shard (else it would quarantine good work)."""
    from vlfast.extraction.store.format import committed_parts, list_names
    from vlfast.extraction.store.integrity import check_part

    out = _fresh("listing")
    with _store(out) as store:
        store.add("early", fake_features("early"))
    mine = resolve_out(out, {"skip_instance_cache": True})  # another process's view of the bucket
    assert len(list_names(mine / "shards")) == 1
    mine.fs.ls((mine / "shards").path)  # now cached in that instance
    with _store(out) as other:  # another rank commits a second shard
        other.add("late", fake_features("late"))
    checks = [check_part(p) for p in committed_parts(mine)]
    assert len(checks) == 2 and all(c.ok for c in checks), [c.problem for c in checks]
    assert sorted(FeatureCache(mine).ids()) == ["early", "late"]


def test_wrong_credentials_for_out_exit_2_never_showing_the_secret(endpoint, media, tiny_qwen3_vl):
    wrong = "wrong-secret-never-shown"
    out = _fresh("creds")
    with enforced_auth(endpoint) as (key, secret):
        for creds in ({"key": key, "secret": wrong}, {"key": "AKIAUNKNOWNKEY000000", "secret": secret}):
            options = json.dumps({"client_kwargs": {"endpoint_url": endpoint}, **creds})
            args = ["extract", str(media), out, "-m", str(tiny_qwen3_vl), "--storage-options", options]
            r = runner.invoke(app, args)
            assert r.exit_code == 2, r.output
            text = " ".join(r.output.split())
            assert out in text and "access refused" in text, text
            assert wrong not in r.output and secret not in r.output
        good = resolve_out(
            f"{out}-good", {"client_kwargs": {"endpoint_url": endpoint}, "key": key, "secret": secret}
        )
        with _store(good) as store:  # the right key, checked, gets through
            store.add("ok", fake_features("ok"))
        assert FeatureCache(good).ids() == ["ok"]
    assert not _keys(out.removeprefix(f"s3://{BUCKET}/") + "/")  # the refused runs wrote nothing


def test_dataloader_workers_read_s3_when_forked(endpoint):
    """fsspec's async clients are not fork-safe: a forked DataLoader worker (Linux's default) gets a client
    of its own (it used to fail every read, reported as a damaged shard). Spawned workers get theirs by
    unpickling; not run here, as the spawn context leaves multiprocessing's resource tracker running, a
    child process that tests/test_extract_workers.py rightly refuses to find."""
    out = _fresh("loader")
    with _store(out) as store:
        for k in range(6):
            store.add(f"s{k}", fake_features(f"s{k}"))
    cache = FeatureCache(out, verify=True)
    expected = {sid: cache[sid]["tokens"] for sid in cache.ids()}  # the parent's client is in use
    loader = torch.utils.data.DataLoader(
        cache, batch_size=2, num_workers=2, collate_fn=list, multiprocessing_context="fork"
    )
    got = [f["tokens"] for batch in loader for f in batch]
    assert len(got) == 6 and all(torch.equal(g, expected[s]) for g, s in zip(got, cache.ids()))


def test_a_store_that_does_not_answer_is_not_called_damage(endpoint, monkeypatch):
    from vlfast.extraction.store.reader import ShardReadError

    out = _fresh("unanswered")
    with _store(out) as store:
        store.add("a", fake_features("a"))
    cache = FeatureCache(out)
    cache[0]  # the shard's handle is open; now the network goes

    def refused(*a, **k):
        raise ConnectionError("connection refused")

    monkeypatch.setattr(cache._handles[0]._fs, "cat_file", refused)
    with pytest.raises(ShardReadError, match="cannot read .* connection refused") as e:
        cache["a"]
    assert not isinstance(e.value, DamagedFile)


def test_an_s3fs_without_exclusive_create_is_refused_before_any_work(
    endpoint, media, tiny_qwen3_vl, monkeypatch
):
    """Before 2024.12 s3fs did not send If-None-Match: two writers of one name could both win, so the
    commit would not be atomic. Such an s3fs is refused (exit 2, with the pip line), not used silently."""
    import s3fs

    monkeypatch.setattr(s3fs, "__version__", "2024.10.0")
    out = f"s3://{BUCKET}/old-s3fs"
    r = runner.invoke(app, ["extract", str(media), out, "-m", str(tiny_qwen3_vl)])
    assert r.exit_code == 2, r.output
    assert "s3fs 2024.10.0" in r.output and "pip install 's3fs>=2024.12'" in " ".join(r.output.split())
    assert not _keys("old-s3fs")


def test_a_consolidated_part_on_s3_checks_its_shards_at_once_and_names_each_damaged_one(endpoint):
    """A rank's consolidated part over 12 shards: the quick check takes the shards' sizes from one listing
    and reads their headers in threads (issue 22); a truncated shard and one with a flipped header byte are
    each found, in their own place, and only their samples are redone."""
    from vlfast.extraction.store.integrity import check_part
    from vlfast.extraction.store.resume import read_state

    out = _fresh("concurrent-check")
    ids = [f"c{k:02d}" for k in range(24)]
    with FeatureStore(out, RUN_CONFIG, shard_max_samples=2, commit_every=None) as store:
        for sid in ids:
            store.add(sid, fake_features(sid))
    assert store.compaction is not None and store.compaction.replaced == 12
    prefix = out.removeprefix(f"s3://{BUCKET}/")
    shards = sorted(k for k in _keys(prefix) if "/shards/" in k)
    assert len(shards) == 12
    truncated, flipped = shards[4], shards[9]
    raw = _client().get_object(Bucket=BUCKET, Key=truncated)["Body"].read()
    _client().put_object(Bucket=BUCKET, Key=truncated, Body=raw[:-5])
    raw = bytearray(_client().get_object(Bucket=BUCKET, Key=flipped)["Body"].read())
    raw[20] ^= 0x01  # inside the header's JSON
    _client().put_object(Bucket=BUCKET, Key=flipped, Body=bytes(raw))

    state = read_state(out, RUN_CONFIG)
    (part,) = state.damaged  # the preflight leaves the repair to the store
    from vlfast.extraction.objstore import ObjectRange

    asked, threads = [], set()
    size, read = ObjectRange.size, ObjectRange.read

    def counted_size(self):
        asked.append(self.path)
        return size(self)

    def noted_read(self, *a, **k):
        threads.add(threading.current_thread().name)
        return read(self, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ObjectRange, "size", counted_size)
        mp.setattr(ObjectRange, "read", noted_read)
        check = check_part(resolve_out(out) / "index" / part, data=False)
    assert asked == []  # the sizes came from one listing of the shard folder
    assert len(threads) > 1 and all(t.startswith("vlfast-check") for t in threads)
    bad = {rel.rsplit("/", 1)[-1] for rel in check.bad_shards}
    assert bad == {truncated.rsplit("/", 1)[-1], flipped.rsplit("/", 1)[-1]}
    lost = {ids[8], ids[9], ids[18], ids[19]}  # the two samples of each damaged shard
    with pytest.warns(UserWarning, match="moved to"), _store(out) as again:
        assert again.done_ids() == set(ids) - lost
        reason = again.quarantined[0]["reason"]
    assert "truncated or replaced" in reason and "damaged header" in reason
