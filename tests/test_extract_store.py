"""FeatureStore / FeatureCache: format, atomic commits, resume, config checks, duplicates, errors, reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from _selftest import compare_caches, fake_features
from vlfast.extraction import FeatureCache, FeatureStore, RunConfigMismatch, dist_info, partition
from vlfast.extraction.store.format import DUPLICATE_KIND, DamagedFile
from vlfast.extraction.store.resume import duplicate_reason, plan_positions

CFG = {"model": "m", "dtype": "bfloat16", "processor": {"max_pixels": 1024}, "versions": {"torch": "2.13"}}


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _plan(store: FeatureStore, ids: list[str], sources: list[str] | None = None) -> list[int]:
    """How extract plans a rank's work (FeatureStore.plan did this before issue 21): its positions still to
    do, and every repeat of an id recorded as a "duplicate" error."""
    todo, repeats = plan_positions(ids, store.rank, store.world_size, store.done_ids())
    for k, first in repeats:
        source = sources[k] if sources is not None else ""
        store.add_error(ids[k], source, duplicate_reason(k, first), kind=DUPLICATE_KIND)
    return todo.tolist()


def _fill(out: Path, ids, **kw) -> None:
    with FeatureStore(out, CFG, **kw) as s:
        for sid in ids:
            s.add(sid, fake_features(sid), {"path": f"{sid}.mp4"})


def test_roundtrip_dtypes_shapes_and_index(tmp_path: Path) -> None:
    import pyarrow.dataset as ds

    feats = {
        "bf16": torch.randn(5, 7).to(torch.bfloat16),
        "f16": torch.randn(3).half(),
        "f32": torch.randn(2, 3, 4),
        "i64": torch.arange(6).reshape(2, 3),
        "grid_thw": torch.tensor([[1, 4, 6], [2, 2, 2]]),
        "mask": torch.tensor([True, False, True]),
        "u8": torch.arange(4, dtype=torch.uint8),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 16, dtype=torch.bfloat16),
    }
    with FeatureStore(tmp_path, CFG, shard_max_samples=2) as s:
        s.add("a", feats, {"path": "a.jpg", "n_tokens": 5})
        s.add("b", {"bf16": torch.randn(9, 7).to(torch.bfloat16)})
        s.add("c", {"f32": torch.ones(1)})
    c = FeatureCache(tmp_path)
    assert len(c) == 3 and c.ids() == ["a", "b", "c"] and "b" in c and "z" not in c
    got = c["a"]
    assert got.keys() == feats.keys()
    for k, v in feats.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and _bytes(got[k]) == _bytes(v), k
    assert c[1]["bf16"].shape == (9, 7) and c[-1]["f32"].tolist() == [1.0]
    assert c.meta("a") == {"path": "a.jpg", "n_tokens": 5} and c.meta("b") == {}
    assert [sorted(x) for x in c] == [sorted(feats), ["bf16"], ["f32"]]
    assert [sid for sid, _ in c.items()] == ["a", "b", "c"]
    only = FeatureCache(tmp_path, features=["bf16"])
    assert list(only["a"]) == ["bf16"] and list(only["b"]) == ["bf16"]
    with pytest.raises(KeyError, match="no feature"):
        only["c"]
    assert c.run_config == CFG
    with pytest.raises(KeyError, match="not in"):
        c["zz"]
    with pytest.raises(IndexError):
        c[3]

    # The index's byte offsets point straight at the data (for non-Python readers).
    info = c.info("a")
    raw = (tmp_path / info["shard"]).read_bytes()
    for f in info["features"]:
        assert raw[f["offset"] : f["offset"] + f["nbytes"]] == _bytes(feats[f["name"]]), f["name"]

    # All index parts read as one dataset, grid included.
    table = ds.dataset(tmp_path / "index", format="parquet").to_table()
    assert table.num_rows == 3 and len(list((tmp_path / "index").iterdir())) == 2
    assert table.column_names == ["id", "shard", "row", "rank", "features", "grid_thw", "meta"]
    feature_struct = table.schema.field("features").type.value_type
    assert [f.name for f in feature_struct] == ["name", "dtype", "shape", "offset", "nbytes", "xxh3"]
    rows = {r["id"]: r for r in table.to_pylist()}
    assert rows["a"]["grid_thw"] == [[1, 4, 6], [2, 2, 2]] and rows["b"]["grid_thw"] is None


def test_shard_limits_and_views_copied(tmp_path: Path) -> None:
    big = torch.randn(1000, 64)
    with FeatureStore(tmp_path, CFG, shard_max_bytes=3 * 64 * 4, shard_max_samples=100) as s:
        for i in range(7):
            s.add(f"s{i}", {"x": big[i]})  # a view: must not keep `big` alive in the buffer
            assert all(t.untyped_storage().nbytes() == t.nbytes for _, f, _ in s._buffer for t in f.values())
    assert len(list((tmp_path / "shards").iterdir())) == 3  # 3 + 3 + 1 samples of 256 bytes
    c = FeatureCache(tmp_path)
    assert all(torch.equal(c[f"s{i}"]["x"], big[i]) for i in range(7))


def test_add_takes_a_snapshot(tmp_path: Path) -> None:
    t = torch.randn(4, 4)
    with FeatureStore(tmp_path, CFG) as s:
        s.add("a", {"x": t, "y": t})  # one tensor under two names and in two samples: safetensors
        s.add("b", {"x": t})  # refuses shared memory, so the store must copy
        expected = t.clone()
        t.zero_()  # the caller reuses its buffer before the shard is written
        for sid in ("e1", "e2"):  # empty tensors (zero tokens) in several samples
            s.add(sid, {"x": torch.zeros(0, 5, dtype=torch.bfloat16), "s": torch.zeros(())})
    c = FeatureCache(tmp_path)
    assert all(torch.equal(c[i][k], expected) for i in ("a", "b") for k in c[i])
    assert c["e2"]["x"].shape == (0, 5) and c["e2"]["s"].shape == ()


def test_add_validates_inputs(tmp_path: Path) -> None:
    s = FeatureStore(tmp_path, CFG)
    with pytest.raises(TypeError, match="dtype"):
        s.add("a", {"x": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(TypeError, match="not a torch.Tensor"):
        s.add("a", {"x": [1, 2]})
    with pytest.raises(TypeError, match="non-empty"):
        s.add("a", {})
    with pytest.raises(TypeError, match="JSON"):
        s.add("a", {"x": torch.zeros(1)}, {"p": object()})
    with pytest.raises(TypeError, match="sample_id"):
        s.add("", {"x": torch.zeros(1)})
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.add("a", {"x": torch.zeros(1)})
    with pytest.raises(ValueError, match="rank"):
        FeatureStore(tmp_path, CFG, rank=2, world_size=2)


def test_crash_between_shard_and_index_part(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = [f"id{i}" for i in range(10)]

    class Crash(BaseException):
        pass

    calls = {"n": 0}
    real = FeatureStore._write_index_part

    def crash_on_second(self, shard, *rest):
        calls["n"] += 1
        if calls["n"] == 2:
            raise Crash  # the process dies after the shard's rename, before its index part
        real(self, shard, *rest)

    monkeypatch.setattr(FeatureStore, "_write_index_part", crash_on_second)
    s = FeatureStore(tmp_path, CFG, shard_max_samples=4)
    with pytest.raises(Crash):
        for sid in ids:
            s.add(sid, fake_features(sid), {"path": f"{sid}.mp4"})
    monkeypatch.setattr(FeatureStore, "_write_index_part", real)
    s._release()  # the process died: its rank lock died with it

    orphan = tmp_path / "shards" / "shard-r00000-000001.safetensors"
    assert orphan.exists() and not list((tmp_path / "index").glob("part-r00000-000001*"))
    (tmp_path / "shards" / ".tmp-r00000-999-shard-r00000-000002.safetensors").write_bytes(b"half a shard")
    (tmp_path / "index" / ".tmp-r00000-999-part-r00000-000002.parquet").write_bytes(b"half a part")
    # A SIGKILL inside safetensors' save_file: its own temp file (.tmpXXXXXX) in the rank's staging folder.
    staging = tmp_path / "shards" / ".tmp-r00000-999.d"
    staging.mkdir()
    (staging / ".tmpAbC123").write_bytes(b"half of safetensors' own temp")
    # Readers see only the committed shard; the orphan's and temp files' samples do not exist.
    c = FeatureCache(tmp_path)
    assert c.ids() == ids[:4]

    # Resume: garbage is removed, the lost samples are redone, the result equals an uninterrupted run.
    s2 = FeatureStore(tmp_path, CFG, shard_max_samples=4)
    assert not orphan.exists() and not any(p.name.startswith(".tmp") for p in tmp_path.rglob("*"))
    assert s2.done_ids() == set(ids[:4])
    with s2:
        for sid in ids:
            if sid not in s2.done_ids():
                s2.add(sid, fake_features(sid), {"path": f"{sid}.mp4"})
    _fill(tmp_path / "ref", ids, shard_max_samples=4)
    assert compare_caches(tmp_path, tmp_path / "ref") == []


def test_cleanup_respects_live_ranks(tmp_path: Path) -> None:
    _fill(tmp_path, ["a"])
    shards = tmp_path / "shards"
    rank1_tmp = shards / ".tmp-r00001-5-shard-r00001-000000.safetensors"  # rank 1 may be writing it now
    rank3_orphan = shards / "shard-r00003-000004.safetensors"  # left by rank 3 of an earlier, larger run
    rank1_tmp.write_bytes(b"x")
    rank3_orphan.write_bytes(b"x")
    FeatureStore(tmp_path, CFG, rank=0, world_size=2)
    rank1_staging = shards / ".tmp-r00001-5.d"  # and its staging folder, with safetensors' own temp
    rank1_staging.mkdir()
    (rank1_staging / ".tmpXyZ789").write_bytes(b"x")
    FeatureStore(tmp_path, CFG, rank=0, world_size=2)
    assert rank1_tmp.exists() and rank3_orphan.exists() and rank1_staging.exists()
    FeatureStore(tmp_path, CFG, rank=1, world_size=2)
    assert not rank1_tmp.exists() and not rank3_orphan.exists() and not rank1_staging.exists()
    assert FeatureCache(tmp_path).ids() == ["a"]


def test_resume_continues_numbering_and_skips_done(tmp_path: Path) -> None:
    _fill(tmp_path, ["a", "b", "c"], shard_max_samples=2)
    s = FeatureStore(tmp_path, CFG, shard_max_samples=2)
    assert s.done_ids() == {"a", "b", "c"}
    assert _plan(s, ["a", "b", "c", "d"]) == [3]
    s.add("d", fake_features("d"))
    s.close()
    names = sorted(p.name[:18] for p in (tmp_path / "index").iterdir())
    assert names == [f"part-r00000-00000{k}" for k in range(3)]
    assert FeatureCache(tmp_path).ids() == ["a", "b", "c", "d"]


def test_config_mismatch_refused_volatile_allowed(tmp_path: Path) -> None:
    _fill(tmp_path, ["a"])
    FeatureStore(tmp_path, CFG | {"versions": {"torch": "9.9"}}).close()  # versions are volatile
    changed = CFG | {"model": "other", "processor": {"max_pixels": 2048}}
    with pytest.raises(RunConfigMismatch) as e:
        FeatureStore(tmp_path, changed)
    msg = str(e.value)
    assert "model: 'm'" in msg and "'other'" in msg and "processor.max_pixels: 1024" in msg and "2048" in msg
    assert "new OUT" in msg and "--overwrite" in msg and "versions" not in msg
    assert isinstance(e.value, ValueError)
    # overwrite starts again with the new config
    FeatureStore(tmp_path, changed, overwrite=True).close()
    c = FeatureCache(tmp_path)
    assert len(c) == 0 and c.run_config["model"] == "other"


def test_duplicates_and_errors(tmp_path: Path) -> None:
    ids = ["a", "b", "a", "c", "b", "a"]
    with FeatureStore(tmp_path, CFG, shard_max_samples=100) as s:
        todo = _plan(s, ids, [f"{i}.mp4" for i in ids])
        assert todo == [0, 1, 3]
        s.add("a", {"x": torch.ones(1)})
        s.add("a", {"x": torch.zeros(1)})  # a repeat reaching add is caught too, first one wins
        s.add_error("c", "c.mp4", "decode failed: moov atom not found")
        assert s.num_errors == 5  # 3 repeats from plan, 1 from add, 1 failure
        # A "duplicate" record does not make an id done (its first copy is still only buffered).
        assert s.done_ids() == {"a", "c"}
        s.add("b", {"x": torch.ones(1)})
    c = FeatureCache(tmp_path)
    assert c.ids() == ["a", "b"] and c["a"]["x"].item() == 1.0
    errs = c.errors()
    assert sorted((e["id"], e["kind"]) for e in errs) == [
        ("a", "duplicate"),
        ("a", "duplicate"),
        ("a", "duplicate"),
        ("b", "duplicate"),
        ("c", "error"),
    ]
    assert {"id", "source", "reason", "kind", "rank", "time"} <= errs[0].keys()

    # A resumed run re-plans the same input: nothing new is recorded, failed ids are not retried.
    err_file = tmp_path / "errors" / "errors-r00000.jsonl"
    with err_file.open("a") as f:
        f.write('{"id": "torn')  # a crash mid-append
    s2 = FeatureStore(tmp_path, CFG)
    assert _plan(s2, ids, [f"{i}.mp4" for i in ids]) == []
    assert s2.num_errors == 0
    s2.add_error("d", "d.mp4", "too long")  # lands on its own line after the torn one
    assert len(FeatureCache(tmp_path).errors()) == 6
    lines = err_file.read_text().splitlines()
    assert json.loads(lines[-1])["id"] == "d" and lines[-2] == '{"id": "torn'


def test_cache_keeps_the_first_copy_of_an_id_two_writers_committed(tmp_path: Path) -> None:
    """Two writers that shared a rank can each commit an id (here: another folder's rank-1 files copied in).
    The cache warns, keeps the first copy, and every other sample is still found by position and id."""
    import shutil

    first, second = tmp_path / "out", tmp_path / "other"
    for out, rank, value in ((first, 0, 1.0), (second, 1, 2.0)):
        with FeatureStore(out, CFG, rank=rank, world_size=2) as s:
            s.add("a", {"x": torch.full((2,), value)})
            s.add(f"only{rank}", {"x": torch.full((2,), value)})
    for sub in ("shards", "index"):
        for f in (second / sub).iterdir():
            shutil.copy(f, first / sub / f.name)
    with pytest.warns(UserWarning, match=r"1 ids committed more than once \(kept the first\), e.g. \['a'\]"):
        c = FeatureCache(first)
    assert len(c) == 3 and c.ids() == ["a", "only0", "only1"]
    assert c["a"]["x"].tolist() == [1.0, 1.0] and c["only1"]["x"].tolist() == [2.0, 2.0]
    assert [c[i]["x"][0].item() for i in range(3)] == [1.0, 1.0, 2.0]
    assert c.meta("only1") is not None and "b" not in c


def test_dataloader(tmp_path: Path) -> None:
    ids = [f"s{i}" for i in range(12)]
    _fill(tmp_path, ids, shard_max_samples=5)
    c = FeatureCache(tmp_path)
    assert isinstance(c, torch.utils.data.Dataset)
    dl = torch.utils.data.DataLoader(
        c, batch_size=4, num_workers=2, collate_fn=lambda b: [x["mean"] for x in b]
    )
    means = [m for batch in dl for m in batch]
    assert len(means) == 12
    assert all(torch.equal(m, fake_features(sid)["mean"]) for m, sid in zip(means, c.ids()))


def test_partition_no_gaps_no_dups() -> None:
    ids = [f"x{i}" for i in range(1000)] + ["x5", "x7"]
    for world in (1, 2, 3, 8):
        parts = [partition(ids, r, world) for r in range(world)]
        assert sorted(i for p in parts for i in p) == sorted(ids)  # every id once, repeats kept for reporting
        for p in parts:
            assert p == [i for i in ids if i in set(p)]  # input order kept
        # a hash split: balanced within a few standard deviations, not exactly
        assert all(abs(len(p) - 1000 / world) < 4 * (1000 / world) ** 0.5 for p in parts)
        # the owner of an id does not depend on the list it is in
        assert partition(list(reversed(ids)), 0, world) == list(reversed(parts[0]))
    assert sum("x5" in p for p in (partition(ids, r, 3) for r in range(3))) == 1
    with pytest.raises(ValueError):
        partition(ids, 2, 2)
    with pytest.raises(ValueError):
        partition(ids, 0, 0)


def test_dist_info_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert dist_info() == (0, 1)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert dist_info() == (3, 4)
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(ValueError, match="RANK"):
        dist_info()


def test_reads_are_memory_mapped_and_imports_light(tmp_path: Path) -> None:
    # 32 samples x 1 MiB in one shard; reading one sample must not pull the 32 MiB shard into memory.
    with FeatureStore(tmp_path, CFG, shard_max_bytes=1 << 30) as s:
        for i in range(32):
            s.add(f"s{i}", {"x": torch.full((256, 1024), float(i))})
    assert len(list((tmp_path / "shards").iterdir())) == 1
    code = textwrap.dedent(
        f"""
        import sys, psutil
        import vlfast.extraction.store.writer
        assert "pyarrow" not in sys.modules, "store must import pyarrow lazily"
        from vlfast.extraction import FeatureCache
        assert "vlfast.extraction.api" not in sys.modules and "vlfast.extraction.engines.local" not in sys.modules
        c = FeatureCache({str(tmp_path)!r})
        p = psutil.Process()
        before = p.memory_info().rss
        x = c["s17"]["x"]
        assert x[0, 0].item() == 17.0
        print((p.memory_info().rss - before) / 2**20)
        """
    )
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    grown_mib = float(r.stdout.strip().splitlines()[-1])
    print(f"RSS growth reading one sample: {grown_mib:.1f} MiB")
    assert grown_mib < 12, f"reading one 1 MiB sample grew RSS by {grown_mib:.1f} MiB (shard is 32 MiB)"


def test_one_writer_per_rank(tmp_path: Path) -> None:
    s = FeatureStore(tmp_path, CFG)
    with pytest.raises(RuntimeError, match="already writing rank 0.*torchrun"):
        FeatureStore(tmp_path, CFG)
    FeatureStore(tmp_path, CFG, rank=1, world_size=2).close()  # another rank is fine
    s.close()
    FeatureStore(tmp_path, CFG).close()  # the lock goes with close (and with the process, on a kill)
    with pytest.raises(ValueError, match="torch.distributed"):
        FeatureStore(tmp_path, CFG, rank=0, world_size=2, overwrite=True)
    FeatureStore(tmp_path, CFG).close()  # a refused store released its lock


def test_grid_in_index_and_provenance(tmp_path: Path) -> None:
    import pyarrow.dataset as ds
    from safetensors import safe_open

    with FeatureStore(tmp_path, CFG) as s:
        s.add("v", {"x": torch.zeros(1), "video_grid_thw": torch.tensor([[8, 20, 30]])})
        s.add("m", {"x": torch.zeros(1)}, {"grid_thw": [[1, 4, 4]]})
    rows = {r["id"]: r["grid_thw"] for r in ds.dataset(tmp_path / "index").to_table().to_pylist()}
    assert rows == {"v": [[8, 20, 30]], "m": [[1, 4, 4]]}
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["config"] == CFG and run["created_with"]["torch"] and run["created_with"]["safetensors"]
    shard = next((tmp_path / "shards").iterdir())
    meta = safe_open(shard, framework="pt").metadata()
    assert json.loads(meta["ids"]) == ["v", "m"] and "safetensors" in json.loads(meta["versions"])


def test_cache_detects_index_shard_mismatch(tmp_path: Path) -> None:
    _fill(tmp_path, ["a", "b", "c", "d"], shard_max_samples=2)
    shards = sorted((tmp_path / "shards").iterdir())
    os.replace(shards[1], shards[0])  # the index now points at the wrong shard's bytes
    with pytest.raises(DamagedFile, match="shard-r00000-000000.*'a'"):
        FeatureCache(tmp_path)["a"]


def test_kill_during_overwrite_leaves_a_consistent_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    import vlfast.extraction.store.backend as store_mod

    _fill(tmp_path, ["a", "b", "c"], shard_max_samples=2)
    real_rmtree = shutil.rmtree

    class Killed(BaseException):
        pass

    def rmtree_then_die(path, **kw):
        real_rmtree(path, **kw)
        raise Killed  # the process dies right after the first folder is gone

    monkeypatch.setattr(store_mod.shutil, "rmtree", rmtree_then_die)
    new = CFG | {"model": "other"}
    with pytest.raises(Killed):
        FeatureStore(tmp_path, new, overwrite=True)
    monkeypatch.setattr(store_mod.shutil, "rmtree", real_rmtree)
    # The index went first: no part points at a deleted shard. The shards left without their index cannot
    # be told from an OUT whose index was lost, so a reader names them (never a silent 0 samples).
    with pytest.raises(DamagedFile, match="no index part, but 2 shards"):
        FeatureCache(tmp_path)
    # Nothing committed and nothing recorded is left: no run depends on the old run.json any more, so the
    # new configuration takes the folder over, as the overwrite would have, and moves the old shards aside.
    with pytest.warns(UserWarning, match="moved to"):
        FeatureStore(tmp_path, new).close()
    assert FeatureCache(tmp_path).run_config["model"] == "other"
    assert not list((tmp_path / "shards").iterdir())
    assert len(list((tmp_path / "quarantine").glob("shard-*/shard-*.safetensors"))) == 2


def test_damaged_index_part_is_named_then_moved_aside_on_resume(tmp_path: Path) -> None:
    _fill(tmp_path, ["a", "b", "c"], shard_max_samples=2)
    part = next((tmp_path / "index").glob("part-r00000-000001-*.parquet"))
    part.write_bytes(b"not parquet")
    with pytest.raises(DamagedFile, match="part-r00000-000001-.*damaged.*shard-r00000-000001"):
        FeatureCache(tmp_path)
    # A resume moves the damaged part and its shard aside (never deletes them) and redoes its sample.
    with pytest.warns(UserWarning, match="moved to"), FeatureStore(tmp_path, CFG) as s:
        assert s.done_ids() == {"a", "b"}
        assert [q["ids"] for q in s.quarantined] == [["c"]]  # named from the shard's own header
        s.add("c", fake_features("c"), {"path": "c.mp4"})
    kept = sorted(p.name for p in (tmp_path / "quarantine").rglob("*") if p.is_file())
    assert kept == sorted([part.name, "reason.json", "shard-r00000-000001.safetensors"])
    _fill(tmp_path / "ref", ["a", "b", "c"], shard_max_samples=2)
    assert compare_caches(tmp_path, tmp_path / "ref") == []


def test_gc_paused_restores_the_collector_however_it_ends():
    import gc

    from vlfast.extraction.store.format import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner one found it paused and leaves it paused
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # a caller's own pause is kept
    finally:
        gc.enable()


def test_done_ids_after_close_reads_the_folder_again(tmp_path: Path) -> None:
    """``close`` drops the committed ids before it compacts (323 MB at ten million ids); ``done_ids`` asked
    afterwards reads every part again, the consolidated one included, and misses nothing."""
    _fill(tmp_path, ["a", "b", "c"], shard_max_samples=1)
    s = FeatureStore(tmp_path, CFG, shard_max_samples=1, compact_min_parts=2)
    s.add("d", fake_features("d"))
    s.add("e", fake_features("e"))
    s.close()
    assert s.compaction is not None and s.compaction.part is not None  # its parts are one now
    assert len(s._committed) == 0
    assert s.done_ids() == {"a", "b", "c", "d", "e"}
    assert s.done_ids() == {"a", "b", "c", "d", "e"}  # asked twice: each part taken in once
