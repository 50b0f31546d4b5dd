"""`vlfast export` / ``vlfast.extraction.export``: one vector per sample of an OUT as one table, read back
with the real readers (pyarrow.parquet, Hugging Face datasets, lance with a vector search), bit for bit;
refusals before anything is written; a SIGKILL mid-write leaves DEST absent or the previous whole table;
an OUT on object storage (moto's S3 server on localhost)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from _selftest import fake_features
from vlfast.cli.main import app
from vlfast.errors import InputRefused
from vlfast.extraction import FeatureCache, FeatureStore, export

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]
CFG = {"model": "export-test", "features": ["embedding", "vision", "vision_mean"]}
IDS = [f"s{i:02d}" for i in range(23)]
DIM = 24
COLUMNS = ["id", "embedding", "path", "text", "instruction", "n_tokens"]


def features(sid: str) -> dict[str, torch.Tensor]:
    """A unit-length float32 `embedding` (distinct per id), a bfloat16 `vision` (n_tokens, 8) and its
    float32 mean `vision_mean`, as extraction stores them."""
    fake = fake_features(sid, dim=8)
    g = torch.Generator().manual_seed(int(sid[1:]) + 1)
    emb = torch.randn(DIM, generator=g)
    return {
        "embedding": emb / emb.norm(),
        "vision": fake["tokens"],
        "vision_mean": fake["mean"],
        "grid_thw": fake["grid_thw"],
    }


def meta(sid: str) -> dict:
    """path and n_tokens always; text on even samples, instruction on every third: the rest have none."""
    i = int(sid[1:])
    m = {"path": f"media/{sid}.jpg", "kind": "image", "n_tokens": features(sid)["vision"].shape[0]}
    if i % 2 == 0:
        m["text"] = f"caption of {sid}: ünïcode [ok]"
    if i % 3 == 0:
        m["instruction"] = "Represent the image for retrieval."
    return m


def fill(out, ids=IDS, feats=features, **kw) -> None:
    with FeatureStore(out, CFG, shard_max_samples=5, **kw) as store:
        for sid in ids:
            store.add(sid, feats(sid), meta(sid))


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("export") / "out"
    fill(path)
    return path


def stored(out, feature: str = "embedding") -> dict[str, torch.Tensor]:
    cache = FeatureCache(out, features=[feature])
    return {sid: f[feature] for sid, f in cache.items()}


def expected_rows(out) -> list[dict]:
    cache = FeatureCache(out)
    rows = []
    for sid in cache.ids():
        m = cache.meta(sid)
        rows.append({k: m.get(k) for k in ("path", "text", "instruction", "n_tokens")} | {"id": sid})
    return rows


def check_table(table: pa.Table, out, feature: str = "embedding", dtype: str = "float32") -> None:
    """Columns, types, order (the cache's), meta, and each vector as stored: bit for bit in float32,
    the float16 rounding of the stored value in float16."""
    assert table.column_names == COLUMNS
    value = pa.float16() if dtype == "float16" else pa.float32()
    want = stored(out, feature)
    dim = next(iter(want.values())).shape[0]
    assert table.schema.field("embedding").type == pa.list_(value, dim)
    assert table.schema.field("n_tokens").type == pa.int64()
    assert [r for r in table.select(["id", "path", "text", "instruction", "n_tokens"]).to_pylist()] == [
        {"id": r["id"], **{k: r[k] for k in ("path", "text", "instruction", "n_tokens")}}
        for r in expected_rows(out)
    ]
    vectors = table.column("embedding").combine_chunks().values.to_numpy(zero_copy_only=False)
    vectors = vectors.reshape(table.num_rows, dim)
    for sid, got in zip(table.column("id").to_pylist(), vectors):
        ref = want[sid].float().numpy()
        if dtype == "float32":
            assert got.dtype == np.float32 and got.tobytes() == ref.tobytes(), sid
        else:
            assert got.dtype == np.float16 and got.tobytes() == ref.astype(np.float16).tobytes(), sid
            np.testing.assert_allclose(got.astype(np.float32), ref, rtol=2**-11, atol=2**-24)


# ------------------------------------------------------------------------------------------ parquet


def test_parquet_reads_back_with_pyarrow_and_hf_datasets(out, tmp_path, monkeypatch):
    dest = tmp_path / "t.parquet"
    result = export(out, dest, batch_rows=4)  # several row groups: the writer streams
    assert (result.rows, result.dim, result.feature, result.format) == (len(IDS), DIM, "embedding", "parquet")
    table = pq.read_table(dest)
    check_table(table, out)
    assert pq.ParquetFile(dest).metadata.num_row_groups == 6  # 23 rows in batches of 4
    about = json.loads(table.schema.metadata[b"vlfast.export"])
    assert about["feature"] == "embedding" and about["model"] == "export-test"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.parquet"]  # no temp left beside it

    # offline, and every cache in tmp_path (set before datasets reads its configuration at import)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    datasets = pytest.importorskip("datasets")
    ds = datasets.load_dataset(
        "parquet", data_files=str(dest), split="train", cache_dir=str(tmp_path / "hf" / "datasets")
    )
    assert ds.column_names == COLUMNS and len(ds) == len(IDS)
    check_table(ds.with_format("arrow")[:], out)  # the same Arrow data through datasets


def test_float16_and_vision_mean(out, tmp_path):
    dest = tmp_path / "new" / "folder" / "half.parquet"  # DEST's folders are made (after every check)
    export(out, dest, dtype="float16")
    check_table(pq.read_table(dest), out, dtype="float16")

    dest = tmp_path / "vm.parquet"
    result = export(out, dest, feature="vision_mean")
    assert result.dim == 8
    check_table(pq.read_table(dest), out, feature="vision_mean")


def test_a_bfloat16_vector_is_exported_exactly(tmp_path):
    """A pooled vector stored in bfloat16 (--store-dtype bfloat16) becomes float32 without rounding."""
    out = tmp_path / "bf16"
    fill(out, ids=IDS[:6], feats=lambda sid: {"embedding": features(sid)["embedding"].to(torch.bfloat16)})
    export(out, tmp_path / "t.parquet")
    got = pq.read_table(tmp_path / "t.parquet").column("embedding").to_pylist()
    assert got == [v.float().tolist() for v in stored(out).values()]


def _big(sid: str) -> dict[str, torch.Tensor]:
    """`embedding` past float16's range on sample s03 only (1e6 and -7e4), the others unit vectors."""
    emb = features(sid)["embedding"]
    if sid == "s03":
        emb = emb.clone()
        emb[2], emb[5] = 1e6, -7e4
    return {"embedding": emb}


def test_float16_refuses_values_it_cannot_hold_naming_the_sample(tmp_path):
    """Before: exit 0 and inf stored for every value of s03 beyond 65504."""
    out = tmp_path / "big"
    fill(out, ids=IDS[:6], feats=_big)
    for fmt in ("parquet", "lance"):
        if fmt == "lance":
            pytest.importorskip("lance")
        dest = tmp_path / f"t.{fmt}"
        r = runner.invoke(app, ["export", str(out), str(dest), "--dtype", "float16", "--format", fmt])
        assert r.exit_code == 2, r.output
        err = " ".join(r.stderr.split())
        assert "sample 's03': 'embedding' holds values up to 1e+06 in magnitude" in err, err
        assert "float16 holds at most 65504" in err and "--dtype float32" in err, err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["big"]  # no table, no temp
    export(out, tmp_path / "t.parquet")  # float32 holds them: stored as computed
    got = pq.read_table(tmp_path / "t.parquet").column("embedding").to_pylist()
    assert got == [v.float().tolist() for v in stored(out).values()]
    # Stored non-finite values are not the cast's doing: exported as they are, in either dtype.
    nan = tmp_path / "nan"
    fill(
        nan,
        ids=IDS[:3],
        feats=lambda sid: {"embedding": torch.full((4,), float("nan") if sid == "s01" else 1.0)},
    )
    export(nan, tmp_path / "n.parquet", dtype="float16")
    assert np.isnan(pq.read_table(tmp_path / "n.parquet").column("embedding").to_pylist()[1]).all()


def test_dest_inside_or_at_out_is_refused(out, tmp_path):
    """Before: DEST an index part of OUT with --overwrite replaced it with the table: OUT was damaged."""
    work = tmp_path / "out"
    shutil.copytree(out, work)
    part = sorted((work / "index").iterdir())[0]
    before = {p: p.read_bytes() for p in work.rglob("*") if p.is_file()}
    (tmp_path / "link").symlink_to(work)
    cases = [
        ([str(part), "--overwrite"], "is inside OUT"),
        ([str(work / "t.parquet")], "is inside OUT"),
        ([str(tmp_path / "link" / "t.lance")], "is inside OUT"),
        ([str(work), "--overwrite", "--format", "lance"], "is OUT"),
        ([str(tmp_path / "link"), "--overwrite"], "is OUT"),
    ]
    for argv, message in cases:
        r = runner.invoke(app, ["export", str(work), *argv])
        assert r.exit_code == 2, (argv, r.output)
        assert message in " ".join(r.stderr.split()), (argv, r.stderr)
        assert {p: p.read_bytes() for p in work.rglob("*") if p.is_file()} == before, argv
    export(work, tmp_path / "t.parquet")  # OUT is whole
    check_table(pq.read_table(tmp_path / "t.parquet"), out)

    # OUT inside a folder that --overwrite may replace (it has the _versions of a Lance dataset): replacing
    # it would delete OUT.
    pytest.importorskip("lance")
    ds = tmp_path / "ds.lance"
    (ds / "_versions").mkdir(parents=True)
    shutil.copytree(out, ds / "out")
    r = runner.invoke(app, ["export", str(ds / "out"), str(ds), "--overwrite"])
    assert r.exit_code == 2 and "is inside DEST" in " ".join(r.stderr.split()), r.output
    export(ds / "out", tmp_path / "t2.parquet")
    check_table(pq.read_table(tmp_path / "t2.parquet"), out)


@pytest.mark.parametrize("rows", [0, -1, float("nan"), float("inf"), 1.5, True, "4", 10**30])
def test_batch_rows_is_refused_unless_a_sane_count(out, tmp_path, rows):
    """Before: nan and inf raised ValueError and OverflowError from int() (a bug's exit 3)."""
    with pytest.raises(InputRefused, match="batch_rows must be a whole number from 1 to"):
        export(out, tmp_path / "t.parquet", batch_rows=rows)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------ lance


def test_lance_reads_back_and_every_sample_is_its_own_nearest_neighbour(out, tmp_path):
    lance = pytest.importorskip("lance")
    for dtype in ("float32", "float16"):
        dest = tmp_path / f"t-{dtype}.lance"
        result = export(out, dest, format="lance", dtype=dtype, batch_rows=4)
        assert result.rows == len(IDS)
        ds = lance.dataset(str(dest))
        table = ds.to_table()
        check_table(table, out, dtype=dtype)
        for sid, vec in zip(table.column("id").to_pylist(), table.column("embedding").to_pylist()):
            q = np.asarray(vec, dtype=np.float32)
            hit = ds.to_table(nearest={"column": "embedding", "q": q, "k": 1}).to_pylist()
            assert [h["id"] for h in hit] == [sid] and hit[0]["_distance"] == pytest.approx(0, abs=1e-6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t-float16.lance", "t-float32.lance"]


def test_cli_exports_lance_by_suffix_and_parquet_with_json(out, tmp_path):
    pytest.importorskip("lance")
    r = runner.invoke(app, ["export", str(out), str(tmp_path / "a.lance"), "--feature", "vision_mean"])
    assert r.exit_code == 0, r.output
    assert "exported 23 samples of 'vision_mean' (8 x float32)" in " ".join(r.stdout.split())
    assert (tmp_path / "a.lance" / "_versions").is_dir()
    r = runner.invoke(app, ["export", str(out), str(tmp_path / "b.parquet"), "--dtype", "float16", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc | {"seconds": 0} == {
        "dest": str(tmp_path / "b.parquet"),
        "format": "parquet",
        "feature": "embedding",
        "dtype": "float16",
        "dim": DIM,
        "rows": len(IDS),
        "seconds": 0,
    }


# ------------------------------------------------------------------------------------------ refusals


def test_a_feature_that_is_not_one_vector_is_refused_naming_its_shape(out, tmp_path):
    dest = tmp_path / "v.parquet"
    with pytest.raises(
        InputRefused, match=r"'vision' .* not one vector per sample: sample 's00' holds shape \(\d+, 8\)"
    ):
        export(out, dest, feature="vision")
    r = runner.invoke(app, ["export", str(out), str(dest), "--feature", "vision"])
    assert r.exit_code == 2 and "not one vector per sample" in r.stderr
    assert "embedding, vision_mean" in r.stderr  # what can be exported instead
    assert list(tmp_path.iterdir()) == []


def test_without_embedding_the_default_is_refused_listing_the_vectors(tmp_path):
    out = tmp_path / "out"
    fill(out, ids=IDS[:3], feats=lambda sid: {k: v for k, v in features(sid).items() if k != "embedding"})
    r = runner.invoke(app, ["export", str(out), str(tmp_path / "t.parquet")])
    assert r.exit_code == 2, r.output
    text = " ".join(r.stderr.split())
    assert "has no feature 'embedding'" in text and "--feature NAME" in text
    assert "one vector per sample: vision_mean" in text and "vision," not in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_vectors_of_different_lengths_are_refused_naming_the_sample(tmp_path):
    out = tmp_path / "out"

    def feats(sid):
        f = features(sid)
        return f | {"embedding": f["embedding"][:-1]} if sid == "s04" else f

    fill(out, ids=IDS[:8], feats=feats)
    for fmt in ("parquet", "lance"):
        with pytest.raises(InputRefused, match=r"sample 's04' holds shape \(23,\), but sample 's00'"):
            export(out, tmp_path / f"t.{fmt}", format=fmt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_sample_without_the_feature_is_refused_naming_it(tmp_path):
    out = tmp_path / "out"
    fill(
        out,
        ids=IDS[:5],
        feats=lambda sid: features(sid) if sid != "s03" else {"vision": features(sid)["vision"]},
    )
    with pytest.raises(InputRefused, match=r"sample 's03' .* has no feature 'embedding' \(1 of 5"):
        export(out, tmp_path / "t.parquet")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def _bad_inputs(out: Path, tmp: Path) -> list[tuple[list[str], str]]:
    (tmp / "not-vlfast").mkdir()
    (tmp / "not-vlfast" / "x.txt").write_text("x")
    (tmp / "file").write_text("x")
    (tmp / "taken.parquet").write_bytes(b"mine, not a table")
    return [
        ([str(tmp / "missing"), "t.parquet"], "missing does not exist: name the folder `vlfast extract`"),
        ([str(tmp / "file"), "t.parquet"], "is a file, not a vlfast extraction folder"),
        (
            [str(tmp / "not-vlfast"), "t.parquet"],
            "is not a vlfast extraction folder (run `vlfast extract` first)",
        ),
        (
            [str(out), "t.parquet", "--feature", "nope"],
            "has no feature 'nope': it was extracted with --features",
        ),
        ([str(out), "t.parquet", "--format", "csv"], "unknown format 'csv': give one of parquet, lance"),
        (
            [str(out), "t.parquet", "--dtype", "bfloat16"],
            "unknown dtype 'bfloat16': give one of float32, float16",
        ),
        ([str(out), str(tmp / "taken.parquet")], "taken.parquet exists: pass --overwrite"),
        ([str(out), str(tmp / "taken.parquet"), "--overwrite"], "is not a Parquet file (other content)"),
        ([str(out), str(tmp / "not-vlfast"), "--overwrite", "--format", "lance"], "is not a Lance dataset"),
        ([str(out), "s3://bucket/t.parquet"], "is on object storage: export writes a local file"),
        ([str(out), "t.parquet", "--storage-options", "[1]"], "--storage-options must be a JSON object"),
    ]


def test_bad_input_is_exit_2_naming_it_and_writes_nothing(out, tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    cases = _bad_inputs(out, tmp_path)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    for argv, message in cases:
        r = runner.invoke(app, ["export", *argv])
        assert r.exit_code == 2, (argv, r.output)
        assert message in " ".join(r.stderr.split()), (argv, r.stderr)
        assert "VLFAST_DEBUG" not in r.output and "Traceback" not in r.output
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before  # nothing written or touched
    assert (tmp_path / "taken.parquet").read_bytes() == b"mine, not a table"


def test_lance_missing_says_what_to_install(out, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "lance", None)  # `import lance` raises ImportError
    r = runner.invoke(app, ["export", str(out), str(tmp_path / "t.lance")])
    assert r.exit_code == 2 and 'pip install "vlfast[export]"' in r.stderr, r.output
    assert list(tmp_path.iterdir()) == []
    export(out, tmp_path / "t.parquet")  # parquet never needs it


# ------------------------------------------------------------------------------------------ twice


def test_same_export_twice_refused_then_replaced_with_overwrite(out, tmp_path):
    pytest.importorskip("lance")
    import lance

    for fmt, dest in (("parquet", tmp_path / "t.parquet"), ("lance", tmp_path / "t.lance")):
        export(out, dest, format=fmt, feature="vision_mean")
        with pytest.raises(InputRefused, match="exists: pass --overwrite"):
            export(out, dest, format=fmt)
        read = (
            (lambda d: pq.read_table(d)) if fmt == "parquet" else (lambda d: lance.dataset(str(d)).to_table())
        )
        check_table(read(dest), out, feature="vision_mean")  # the refused export changed nothing
        export(out, dest, format=fmt, overwrite=True)
        check_table(read(dest), out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.lance", "t.parquet"]  # no temp, no old copy


# ------------------------------------------------------------------------------------------ the kill

# A child that exports with batches of 4 rows and stops for good once STOP vectors have been read: by
# then several batches are in the temp table. The test SIGKILLs it there.
CHILD = textwrap.dedent(
    """
    import sys, time
    from vlfast.extraction import export
    from vlfast.extraction.store import reader

    out, dest, fmt, feature, stop = sys.argv[1:6]
    real, seen = reader.FeatureCache.__getitem__, [0]

    def getitem(self, key):
        seen[0] += 1
        if seen[0] == int(stop):
            print("stopped", flush=True)
            time.sleep(600)
        return real(self, key)

    reader.FeatureCache.__getitem__ = getitem
    export(out, dest, format=fmt, feature=feature, overwrite=True, batch_rows=4)
    print("finished", flush=True)
    """
)


def _kill_mid_write(out: Path, dest: Path, fmt: str, feature: str, stop: int = 18) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(out), str(dest), fmt, feature, str(stop)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline()
        assert line.strip() == "stopped", (line, proc.stderr.read() if proc.poll() is not None else "")
        time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["parquet", "lance"])
def test_sigkill_mid_write_leaves_no_table_or_the_previous_one(out, tmp_path, fmt):
    if fmt == "lance":
        pytest.importorskip("lance")
        import lance

        read = lambda d: lance.dataset(str(d)).to_table()  # noqa: E731
    else:
        read = pq.read_table
    dest = tmp_path / f"t.{fmt}"

    _kill_mid_write(out, dest, fmt, "embedding")
    assert not dest.exists()
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(f".t.{fmt}.vlfast-export-")]
    if fmt == "parquet":  # the temp file holds the batches written so far: the kill was mid-write
        assert len(leftovers) == 1 and leftovers[0].stat().st_size > 0
    else:
        assert len(leftovers) <= 1

    export(out, dest, format=fmt, feature="vision_mean")  # a later export is not disturbed by the leftover
    _kill_mid_write(out, dest, fmt, "embedding")  # --overwrite, killed before its rename
    check_table(read(dest), out, feature="vision_mean")  # the previous table, whole
    export(out, dest, format=fmt, overwrite=True)
    check_table(read(dest), out)


# ------------------------------------------------------------------------------------------ S3


@pytest.fixture(scope="module")
def s3_out(moto_endpoint, out):
    """OUT written by FeatureStore straight into a bucket of the session's moto server."""
    pytest.importorskip("s3fs")
    pytest.importorskip("upath")
    from _s3 import client

    mp = pytest.MonkeyPatch()
    mp.setenv("AWS_ACCESS_KEY_ID", "testing-key-id")
    mp.setenv("AWS_SECRET_ACCESS_KEY", "testing-secret")
    mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
    mp.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    client(moto_endpoint).create_bucket(Bucket="vlfast-export")
    url = "s3://vlfast-export/features"
    fill(url)
    yield url
    mp.undo()
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


def test_out_on_object_storage(s3_out, out, moto_endpoint, tmp_path):
    from _s3 import options

    dest = tmp_path / "t.parquet"
    export(s3_out, dest, storage_options=options(moto_endpoint))
    table = pq.read_table(dest)
    check_table(table, s3_out)
    assert table.equals(pq.read_table(export(out, tmp_path / "local.parquet").dest))  # same bytes as local

    r = runner.invoke(
        app,
        [
            "export",
            s3_out,
            str(tmp_path / "t2.parquet"),
            "--storage-options",
            json.dumps(options(moto_endpoint)),
        ],
    )
    assert r.exit_code == 0, r.output
    assert pq.read_table(tmp_path / "t2.parquet").equals(table)
    r = runner.invoke(app, ["export", "s3://vlfast-export/nothing-here", str(tmp_path / "t3.parquet")])
    assert r.exit_code == 2 and "is not a vlfast extraction folder" in r.stderr, r.output
    assert not (tmp_path / "t3.parquet").exists()
