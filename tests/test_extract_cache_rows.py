"""What FeatureCache keeps of its index (issue 22): rows taken in a row group at a time, feature entries kept
as names and checksums where every row names the same features, and made again from the shard's checked
header by ``info``. Everything it answers must equal the index rows themselves."""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from vlfast.extraction import FeatureCache, FeatureStore
from vlfast.extraction.store import reader
from vlfast.extraction.store.compact import compact_folder
from vlfast.extraction.store.format import DamagedFile
from vlfast.extraction.store.reader import _Given, _hex64, _PackedText, _Same

CFG = {"model": "m", "dtype": "bfloat16"}


def _index_rows(out: Path) -> dict[str, dict]:
    rows = {}
    for part in sorted((out / "index").glob("*.parquet")):
        for r in pq.read_table(part).to_pylist():
            rows.setdefault(r["id"], r)
    return rows


def _write(out: Path, n: int, per_shard: int, feats=None) -> None:
    with FeatureStore(out, CFG, shard_max_samples=per_shard) as s:
        for k in range(n):
            f = feats(k) if feats else {"tokens": torch.randn(1 + k % 5, 4).half(), "mean": torch.randn(4)}
            s.add(f"s{k:04d}", f, {"path": f"s{k}.jpg", "k": k})


def _check_against_index(out: Path) -> FeatureCache:
    cache = FeatureCache(out)
    rows = _index_rows(out)
    assert len(cache) == len(rows)
    for sid, row in rows.items():
        info = cache.info(sid)
        assert info == {"id": sid, "shard": row["shard"], "row": row["row"], "features": row["features"]}, sid
        assert cache.meta(sid) == json.loads(row["meta"])
        got = cache[sid]
        assert list(got) == [f["name"] for f in row["features"]]
    return cache


def test_info_and_meta_equal_the_index_rows_compact_or_not(tmp_path):
    """Every run's rows (the same features each): kept compact, and info made again from the shard headers
    equals the index row, field for field and in order, before and after compaction into one part."""
    _write(tmp_path / "a", 300, 7)
    cache = _check_against_index(tmp_path / "a")
    assert all(isinstance(layout, _Same) for layout in cache._rows._layouts)
    compact_folder(tmp_path / "a")
    assert len(list((tmp_path / "a" / "index").glob("*.parquet"))) == 1
    _check_against_index(tmp_path / "a")

    # rows that name other features: kept as Parquet gave them, answered the same
    def mixed(k):
        return {"mean": torch.randn(4)} if k % 3 else {"tokens": torch.randn(2, 4), "mean": torch.randn(4)}

    _write(tmp_path / "b", 40, 40, mixed)
    cache = _check_against_index(tmp_path / "b")
    assert all(isinstance(layout, _Given) for layout in cache._rows._layouts)


def test_checksums_kept_as_integers_still_catch_damage(tmp_path):
    _write(tmp_path, 20, 20)
    cache = FeatureCache(tmp_path, verify=True)
    info = cache.info("s0003")
    entry = info["features"][0]
    shard = tmp_path / info["shard"]
    data = bytearray(shard.read_bytes())
    data[entry["offset"]] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert isinstance(cache._rows._layouts[0], _Same)
    with pytest.raises(DamagedFile, match="s0003"):
        FeatureCache(tmp_path, verify=True)["s0003"]
    FeatureCache(tmp_path)["s0003"]  # without verify the read itself does not hash


def test_info_refuses_a_shard_whose_header_was_replaced(tmp_path):
    """info makes entries from the shard's header only once its bytes pass the checksum the index part
    recorded: a shard of the same name and size written by another run is named, not described."""
    _write(tmp_path / "a", 10, 10)
    _write(
        tmp_path / "b",
        10,
        10,
        lambda k: {"tokens": torch.randn(1 + (k + 1) % 5, 4).half(), "mean": torch.randn(4)},
    )
    shard_a = next((tmp_path / "a" / "shards").iterdir())
    shard_b = next((tmp_path / "b" / "shards").iterdir())
    cache = FeatureCache(tmp_path / "a")
    data = bytearray(shard_b.read_bytes())
    data = data[: shard_a.stat().st_size].ljust(shard_a.stat().st_size, b"\0")
    shard_a.write_bytes(bytes(data))
    with pytest.raises(DamagedFile, match="not the shard its index part was written with"):
        cache.info("s0001")


def test_hex_checksums_become_integers_and_back_only_when_exact():
    values = ["0123456789abcdef", "ffffffffffffffff", "0000000000000000"]
    got = _hex64(pa.array(values))
    assert [f"{int(v):016x}" for v in got] == values
    assert _hex64(pa.array(values).slice(1)).tolist() == [2**64 - 1, 0]
    for bad in (["0123456789ABCDEF"], ["0123"], ["0123456789abcdeg"], [None], ["0123456789abcdef0"]):
        assert _hex64(pa.array(bad, pa.string())) is None, bad


def test_rows_of_other_shapes_are_kept_as_given():
    entry = {
        "name": "a",
        "dtype": "float16",
        "shape": [2],
        "offset": 8,
        "nbytes": 4,
        "xxh3": "00000000000000aa",
    }
    schema = pa.list_(
        pa.struct(
            [("name", pa.string()), ("dtype", pa.string()), ("shape", pa.list_(pa.int64())),
             ("offset", pa.int64()), ("nbytes", pa.int64()), ("xxh3", pa.string())]
        )
    )  # fmt: skip
    same = pa.array([[entry], [entry | {"offset": 12}]], schema)
    assert _Same.of(same).entries(1) == {"a": "00000000000000aa"}
    assert _Same.of(same.slice(1)).names == ("a",)
    for rows in (
        [[entry], [entry, entry | {"name": "b"}]],  # another count
        [[entry], [entry | {"name": "b"}]],  # another name
        [[entry, entry | {"name": "b"}], [entry | {"name": "b"}, entry]],  # another order
        [[entry], [entry | {"xxh3": None}]],  # a checksum missing
        [[entry], None],  # a null row
    ):
        assert _Same.of(pa.array(rows, schema)) is None, rows


def test_packed_text_answers_every_row_as_given(monkeypatch):
    """The compressed meta (blocks of 7 rows here) against the strings themselves: chunks of any size,
    sliced and chunked columns, nulls, empty and non-ASCII text, read in any order and after pickling (a
    DataLoader worker's copy)."""
    monkeypatch.setattr(reader, "_TEXT_BLOCK", 7)
    rng = random.Random(0)
    alphabet = 'ab{}"é\\\u2603'
    values = [
        None if rng.random() < 0.1 else "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 9)))
        for _ in range(300)
    ]
    text, i = _PackedText(), 0
    while i < len(values):
        k = rng.randrange(0, 20)
        column = pa.array(values[i : i + k], pa.string())
        i += k
        if k > 2 and rng.random() < 0.5:
            column = pa.chunked_array([column.slice(0, 1), column.slice(1)])
        elif k > 2 and rng.random() < 0.5:
            column = pa.array(["x", *values[i - k : i]], pa.large_string()).slice(
                1
            )  # another type, an offset
        text.append(column)
    text.finish()
    assert len(text) == len(values) and len(text._blocks) == -(-len(values) // 7)
    order = list(range(len(values)))
    rng.shuffle(order)
    assert [text[j] for j in order] == [values[j] for j in order]
    assert [pickle.loads(pickle.dumps(text))[j] for j in range(len(values))] == values


def test_meta_read_across_compressed_blocks_equals_the_index(tmp_path, monkeypatch):
    """A FeatureCache whose meta spans many compressed blocks (13 rows each) and parts answers every
    sample's meta as its index row has it, in index order and by id, before and after compaction."""
    monkeypatch.setattr(reader, "_TEXT_BLOCK", 13)
    _write(tmp_path / "a", 200, 9)
    cache = _check_against_index(tmp_path / "a")
    assert len(cache._rows.meta._blocks) == -(-200 // 13)
    assert [cache.meta(i)["k"] for i in range(len(cache))] == [int(sid[1:]) for sid in cache.ids()]
    compact_folder(tmp_path / "a")
    cache = _check_against_index(tmp_path / "a")
    # an index part without a meta column (read as nulls): no meta is an empty dict, not an error
    cache._rows.meta = _PackedText()
    cache._rows.meta.append(pa.nulls(len(cache), pa.string()))
    assert cache._rows.meta.finish() is cache._rows.meta and cache.meta(5) == {}
