"""WebDataset shards at an fsspec URL, against moto's S3 server checking credentials: the same ids and
tensors as the same shards on disk, a truncated shard recorded as locally, resume per sample, the cost of a
listing, and inputs refused with exit 2 naming the URL, never the secret (wrong credentials too, for a
folder URL as well)."""

from __future__ import annotations

import json
import re
import tarfile

import pytest
from typer.testing import CliRunner

import test_extract_webdataset as wds
from _s3 import client, enforced_auth, options, refused_port
from _selftest import compare_caches
from test_extract_fsspec import _assert_same
from vlfast.cli.main import app
from vlfast.extraction import FeatureCache
from vlfast.extraction.api import extract
from vlfast.extraction.engines.base import Hooks
from vlfast.extraction.engines.local import LocalEngine
from vlfast.extraction.sources import load_inputs

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

runner = CliRunner()
BUCKET = "vlfast-wds"  # moto's buckets are per process: not the name another module's server uses
PATTERN = f"s3://{BUCKET}/shards/{{000..002}}.tar"
WRONG = "wrong-secret-never-shown"

# This module's own instances of the local shards and their local extraction (module-scoped fixtures).
shards = wds.shards
shard_run = wds.shard_run


@pytest.fixture(scope="module")
def s3(shards, moto_endpoint):
    """The session's moto server, refusing wrong credentials while this module runs, holding the shards under
    s3://BUCKET/shards/, one image under s3://BUCKET/media/ and a file that is not a tar; yields (endpoint,
    good storage options)."""
    endpoint = moto_endpoint
    with enforced_auth(endpoint) as (key, secret):
        s3 = client(endpoint, aws_access_key_id=key, aws_secret_access_key=secret)
        s3.create_bucket(Bucket=BUCKET)
        for shard in sorted((shards["root"] / "shards").iterdir()):
            s3.upload_file(str(shard), BUCKET, f"shards/{shard.name}")
        s3.put_object(Bucket=BUCKET, Key="media/a.png", Body=wds._png(0))
        s3.put_object(Bucket=BUCKET, Key="bad/000.tar", Body=b'{"not": "a tar"}\n' * 100)
        yield endpoint, options(endpoint, key=key, secret=secret)


@pytest.fixture(scope="module")
def url_run(s3, tiny_qwen3_vl, tmp_path_factory):
    """The pattern at the URL extracted with two decode workers reading members by ranged requests."""
    out = tmp_path_factory.mktemp("wds-url") / "out"
    summary = extract(PATTERN, out, model=str(tiny_qwen3_vl), num_workers=2, storage_options=s3[1], **wds.KW)
    return summary, out


def _local_path(text: str, shards) -> str:
    """A URL in a path or message as the same shards on disk would name it."""
    return text.replace(f"s3://{BUCKET}/shards", str(shards["root"] / "shards"))


def test_ids_and_prompts_equal_local(s3, shards):
    local, _ = load_inputs(shards["pattern"])
    remote, problems = load_inputs(PATTERN, s3[1])
    assert problems == []
    assert [s.id for s in remote] == [s.id for s in local] == shards["ids"]
    assert [(s.kind, s.prompt, s.member.offset, s.member.size) for s in remote] == [
        (s.kind, s.prompt, s.member.offset, s.member.size) for s in local
    ]
    assert [_local_path(s.paths[0], shards) for s in remote] == [s.paths[0] for s in local]
    assert "secret" not in repr(remote[0].member) and s3[1]["secret"] not in repr(remote[0])
    # a single shard URL: ids relative to its own folder, as for a local .tar
    one, _ = load_inputs(f"s3://{BUCKET}/shards/002.tar", s3[1])
    assert [s.id for s in one] == [i for i in shards["ids"] if i.startswith("002.tar/")]


def test_memory_and_file_urls_give_the_same_ids(shards):
    import fsspec

    assert [s.id for s in load_inputs(f"file://{shards['root']}/shards/{{000..002}}.tar")[0]] == shards["ids"]
    fs = fsspec.filesystem("memory")
    for shard in (shards["root"] / "shards").iterdir():
        fs.pipe(f"/vlfast-wds/shards/{shard.name}", shard.read_bytes())
    try:
        samples, _ = load_inputs("memory://vlfast-wds/shards/{000..002}.tar")
        assert [s.id for s in samples] == shards["ids"]
        assert (
            samples[2].member.read_bytes()
            == (shards["root"] / "plain" / "000.tar/sample_0002.mp4").read_bytes()
        )
    finally:
        fs.rm("/vlfast-wds", recursive=True)


def test_a_store_that_cannot_list_folders_or_ignores_ranges(shards, monkeypatch):
    """A plain HTTP server may list no folder (each shard is then asked for) and may answer a ranged request
    with the whole file (refused: its first bytes would pass for the member's)."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    fs = fsspec.filesystem("memory")
    for shard in (shards["root"] / "shards").iterdir():
        fs.pipe(f"/vlfast-nolist/shards/{shard.name}", shard.read_bytes())
    try:
        with monkeypatch.context() as m:
            m.setattr(MemoryFileSystem, "ls", lambda self, path, detail=True, **kw: [])
            samples, _ = load_inputs("memory://vlfast-nolist/shards/{000..002}.tar")
            assert [s.id for s in samples] == shards["ids"]
            with pytest.raises(FileNotFoundError, match=r"2 of the 5 shards .*/003\.tar, .*/004\.tar"):
                load_inputs("memory://vlfast-nolist/shards/{000..004}.tar")
        whole = MemoryFileSystem.cat_file
        monkeypatch.setattr(
            MemoryFileSystem, "cat_file", lambda self, path, start=None, end=None: whole(self, path)
        )
        with pytest.raises(OSError, match="this server does not serve"):
            samples[1].member.read_bytes()
    finally:
        fs.rm("/vlfast-nolist", recursive=True)


def test_braces_expand_in_the_path_only_and_local_shards_import_no_fsspec(shards):
    import subprocess
    import sys

    with pytest.raises(ValueError, match="braces are expanded in the path only"):
        load_inputs("s3://vlfast-{a,b}/shards/000.tar")
    with pytest.raises(ValueError, match=re.escape("'memory://s/{0..1.tar': the brace at character 12")):
        load_inputs("memory://s/{0..1.tar")
    code = (
        "import sys; from vlfast.extraction.sources import load_inputs; "
        f"load_inputs({shards['pattern']!r}); print('fsspec' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout == "False\n"


def test_listing_and_member_reads_cost_few_ranged_requests(s3, shards, monkeypatch):
    from vlfast.extraction import objstore as remote

    fetched: list[tuple[str, int, int]] = []
    fetch = remote._fetch

    def counted(fs, path, url, options_json, start, end):
        fetched.append((path, start, end))
        return fetch(fs, path, url, options_json, start, end)

    monkeypatch.setattr(remote, "_fetch", counted)
    samples, _ = load_inputs(PATTERN, s3[1])
    sizes = {p.name: p.stat().st_size for p in (shards["root"] / "shards").iterdir()}
    # a shard is read front to back in blocks growing from 64 KiB, never a byte twice nor past its end
    per_shard = {name: [f for f in fetched if f[0].endswith(name)] for name in sizes}
    for name, calls in per_shard.items():
        assert 1 <= len(calls) <= 4 and sum(e - s for _, s, e in calls) <= sizes[name], (name, calls)
    fetched.clear()
    image = next(s for s in samples if s.id == "002.tar/sample_0008")
    data = image.member.read_bytes()  # an image member: one ranged request for exactly its bytes
    assert data == (shards["root"] / "plain/002.tar/sample_0008.png").read_bytes()
    assert fetched == [(f"{BUCKET}/shards/002.tar", image.member.offset, image.member.offset + len(data))]


def test_features_equal_the_same_shards_extracted_locally(url_run, shard_run, shards):
    (summary, out), (local_summary, local_out) = url_run, shard_run
    a, b = FeatureCache(out), FeatureCache(local_out)
    good = sorted(b.ids())
    assert summary.extracted == local_summary.extracted == len(good) and summary.failed == 1
    _assert_same(a, b, {i: i for i in good})  # bit for bit
    for sid in good:
        ma, mb = a.meta(sid), b.meta(sid)
        assert _local_path(ma.pop("path"), shards) == mb.pop("path") and ma == mb, sid
    # the corrupt member is recorded as locally, naming its URL
    (error,) = a.errors()
    (local_error,) = b.errors()
    assert error["id"] == wds.CORRUPT and error["source"] == f"s3://{BUCKET}/shards/001.tar/sample_0004.jpg"
    assert _local_path(error["reason"], shards) == local_error["reason"]


def test_truncated_shard_at_a_url_is_recorded_as_locally(s3, shards, tmp_path):
    pattern, _ = wds._cut_copy(shards, tmp_path, lambda m: m["sample_0006.jpg"].offset_data + 100)
    s3_client = client(s3[0], aws_access_key_id=s3[1]["key"], aws_secret_access_key=s3[1]["secret"])
    for shard in sorted((tmp_path / "shards").iterdir()):
        s3_client.upload_file(str(shard), BUCKET, f"cut/{shard.name}")
    local = load_inputs(pattern)
    remote = load_inputs(f"s3://{BUCKET}/cut/{{000..002}}.tar", s3[1])
    assert [s.id for s in remote[0]] == [s.id for s in local[0]]

    def named(problems, root):
        return [(p.id, p.where.replace(root, "ROOT"), p.reason.replace(root, "ROOT")) for p in problems]

    assert named(remote[1], f"s3://{BUCKET}/cut") == named(local[1], str(tmp_path / "shards"))
    assert {p.id for p in remote[1]} == {"001.tar/sample_0006", "001.tar"}


def test_interrupted_run_resumes_only_the_missing_keys(s3, url_run, tiny_qwen3_vl, tmp_path):
    out, stop_after = tmp_path / "out", 5

    class Interrupted(Exception):
        pass

    def interrupt(batch, calls=[]):  # noqa: B006 - counts the forwards of this one run
        calls.append(1)
        if len(calls) > stop_after:
            raise Interrupted

    run = dict(model=str(tiny_qwen3_vl), num_workers=0, storage_options=s3[1], **wds.KW)
    with pytest.raises(Interrupted):
        extract(PATTERN, out, engine=LocalEngine(Hooks(forward=interrupt)), **run)
    committed = set(FeatureCache(out).ids())
    recorded = {e["id"] for e in FeatureCache(out).errors()}
    # stopped half-way through a tar shard: some of its keys are committed, some are not
    by_shard = {s: {i for i in committed if i.startswith(s)} for s in ("000.tar", "001.tar", "002.tar")}
    assert 0 < len(committed) <= stop_after and any(0 < len(v) < 4 for v in by_shard.values()), committed

    decoded: list[str] = []
    resumed = extract(PATTERN, out, engine=LocalEngine(Hooks(decode=lambda s: decoded.append(s.id))), **run)
    all_ids = {s.id for s in load_inputs(PATTERN, s3[1])[0]}
    assert sorted(decoded) == sorted(all_ids - committed - recorded)
    assert resumed.skipped == len(committed | recorded)
    assert compare_caches(out, url_run[1]) == []


# ------------------------------------------------------------------------------------- refused inputs


def _case(name: str, s3) -> tuple[str, dict, str]:
    """(INPUT, storage options, words the message must hold) for one bad input."""
    endpoint, good = s3
    wrong = {**good, "secret": WRONG}
    return {
        "missing shards": (
            f"s3://{BUCKET}/shards/{{000..004}}.tar",
            good,
            f"2 of the 5 shards named by 's3://{BUCKET}/shards/{{000..004}}.tar' do not exist: "
            f"s3://{BUCKET}/shards/003.tar, s3://{BUCKET}/shards/004.tar",
        ),
        "not a tar": (
            f"s3://{BUCKET}/{{shards/000,bad/000}}.tar",
            good,
            f"s3://{BUCKET}/bad/000.tar is not a tar archive",
        ),
        "unreachable endpoint": (
            PATTERN,
            options(f"http://127.0.0.1:{refused_port()}", key=good["key"], secret=good["secret"]),
            f"bucket s3://{BUCKET} of input {PATTERN} cannot be reached",
        ),
        "missing bucket": (
            "s3://no-such-vlfast-bucket/shards/{000..002}.tar",
            good,
            "bucket s3://no-such-vlfast-bucket of input s3://no-such-vlfast-bucket/shards/{000..002}.tar "
            "does not exist",
        ),
        "wrong secret": (PATTERN, wrong, f"bucket s3://{BUCKET} of input {PATTERN}: access refused"),
        "wrong secret, folder URL": (
            f"s3://{BUCKET}/media",
            wrong,
            f"input s3://{BUCKET}/media: access refused",
        ),
        "unknown key id": (
            PATTERN,
            {**wrong, "key": "AKIAVLFASTUNKNOWN"},
            f"bucket s3://{BUCKET} of input {PATTERN}: access refused",
        ),
    }[name]


@pytest.mark.parametrize(
    "name",
    [
        "missing shards",
        "not a tar",
        "unreachable endpoint",
        "missing bucket",
        "wrong secret",
        "wrong secret, folder URL",
        "unknown key id",
    ],
)
def test_bad_url_inputs_exit_2_naming_the_url(name, s3, tiny_qwen3_vl, tmp_path):
    source, storage, words = _case(name, s3)
    out = tmp_path / "out"
    args = ["extract", source, str(out), "-m", str(tiny_qwen3_vl), "--storage-options", json.dumps(storage)]
    r = runner.invoke(app, args)
    text = " ".join(r.output.split())
    assert r.exit_code == 2, r.output
    assert words in text, text
    assert WRONG not in text and s3[1]["secret"] not in text and s3[1]["key"] not in text, text
    assert not out.exists()  # refused before the store or the model


def test_wrong_secret_from_the_environment_is_refused_unshown(s3, tiny_qwen3_vl, tmp_path, monkeypatch):
    endpoint, good = s3
    # the good credentials list the folder; the same key with a wrong secret in the environment does not
    assert [s.id for s in load_inputs(f"s3://{BUCKET}/media", good)[0]] == ["a.png"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", good["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", WRONG)
    out = tmp_path / "out"
    for source in (PATTERN, f"s3://{BUCKET}/media"):
        args = ["extract", source, str(out), "-m", str(tiny_qwen3_vl)]
        r = runner.invoke(app, [*args, "--storage-options", json.dumps(options(endpoint))])
        text = " ".join(r.output.split())
        assert r.exit_code == 2 and "access refused" in text and source in text, text
        assert WRONG not in text and not out.exists()


def test_a_shard_cut_after_listing_is_named_when_read(s3, shards):
    samples, _ = load_inputs(PATTERN, s3[1])
    member = next(s for s in samples if s.id == "000.tar/sample_0002").member
    beyond = type(member)(member.shard, member.name, member.offset, member.size + 10**6, member.options_json)
    with pytest.raises(OSError, match=re.escape(f"truncated shard: {member.shard} ends at byte")):
        beyond.read_bytes()
    # a video's reader: the same message once a read reaches the cut
    with beyond.open() as f, pytest.raises(OSError, match="truncated shard"):
        f.seek(member.size - 10)
        f.read(100)
    with member.open() as f, tarfile.open(shards["root"] / "shards/000.tar") as tf:
        assert f.read() == tf.extractfile("sample_0002.mp4").read()
