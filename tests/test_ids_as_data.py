"""Ids held as data (issue 22): ``IdSet``, ``first_copies`` and ``plan_positions`` against plain Python sets,
lists and dicts, including the case that a hash never decides alone: ids whose hashes collide."""

from __future__ import annotations

import random

import numpy as np
import pyarrow as pa
import pytest

import vlfast.extraction.ids as ids_module
from vlfast.extraction.ids import ArrowStrings, IdSet, first_copies, hash_ids
from vlfast.extraction.store.resume import owned, owner_rank, plan_positions, unique_positions


@pytest.fixture(params=["xxh3", "colliding"])
def hashing(request, monkeypatch):
    """The real hash, and one under which most ids collide (a hash hit must be confirmed by the id)."""
    if request.param == "colliding":

        def column(col):
            return np.array([len(s) % 3 for s in col.to_pylist()], np.uint64)

        monkeypatch.setattr(ids_module, "_hash_one", lambda sid: len(sid) % 3)
        monkeypatch.setattr(ids_module, "_hash_column", column)
        monkeypatch.setattr(ids_module, "_SMALL", 0)  # every list through the column path too
    monkeypatch.setattr(IdSet, "_MIN_MERGE", 8)  # merges early and often
    monkeypatch.setattr(ids_module, "_CONFIRM", 3)  # hash hits confirmed a few at a time, as at scale
    monkeypatch.setattr(ids_module, "_MAX_CHUNKS", 3)  # ids appended in chunks, and combined, often
    monkeypatch.setattr(ids_module, "_FIND", 7)  # lookups a slice at a time, as at scale
    return request.param


def _pool(rnd: random.Random) -> list[str]:
    return [f"x{rnd.randrange(300)}" * rnd.randrange(1, 3) for _ in range(400)] + ["é", "a\U0001f600"]


@pytest.mark.parametrize("seed", range(6))
def test_an_idset_is_a_set_of_its_ids(hashing, seed):
    rnd = random.Random(seed)
    pool = _pool(rnd)
    ref: set[str] = set()
    s = IdSet()
    for step in range(150):
        op = rnd.random()
        if op < 0.5:
            x = rnd.choice(pool)
            s.add(x)
            ref.add(x)
        elif op < 0.7:
            xs = rnd.sample(pool, rnd.randrange(0, 50))
            s.update(pa.array(xs, pa.string()))  # an Arrow column, as an index part gives it
            ref.update(xs)
        elif op < 0.8:
            xs = rnd.sample(pool, rnd.randrange(0, 50))
            s = s.union(IdSet(xs), {"extra"})
            ref |= {*xs, "extra"}
        elif op < 0.9:
            xs = rnd.sample(pool, rnd.randrange(0, 30))
            cut = rnd.randrange(0, len(xs) + 1)  # a part's column in row groups, as check_part keeps it
            chunked = pa.chunked_array([pa.array(xs[:cut], pa.string()), pa.array(xs[cut:], pa.string())])
            s.update(ArrowStrings(pa.array(xs)) if rnd.random() < 0.5 else ArrowStrings.of_chunks(chunked))
            ref.update(xs)
        query = rnd.sample(pool, 60) + ["never-added"]
        assert s.isin(query).tolist() == [q in ref for q in query], step
        assert [q in s for q in query] == [q in ref for q in query]
        assert s == ref and len(s) == len(ref) and set(s) == ref
    assert 3 not in s and None not in s


def test_columns_given_one_by_one_are_merged_once(monkeypatch):
    """A store takes in each index part's ids as it reads the part: ten thousand parts must not sort the
    set ten thousand times (it did: 63 s for a million ids in 977 parts, quadratic). The columns wait until
    the set is read, and are then merged at once."""
    merges = []
    real = IdSet._merge
    monkeypatch.setattr(IdSet, "_merge", lambda self: merges.append(1) or real(self))
    s = IdSet()
    for k in range(0, 50_000, 100):
        s.update(pa.array([f"i{j}" for j in range(k, k + 100)], pa.string()))
    s.update(pa.array(["i7", "i7", "extra"]))  # repeats, within and across columns
    assert merges == []
    assert len(s) == 50_001 and "i49999" in s and "extra" in s and "i50000" not in s
    assert merges == [1]
    s.update(pa.array(["later"]))
    assert s.isin(["later", "i3", "no"]).tolist() == [True, True, False] and len(merges) == 2


def test_ids_taken_from_chunks_are_those_of_the_combined_column():
    rnd = random.Random(3)
    chunks = [[f"c{c}-{k}" for k in range(rnd.randrange(0, 40))] for c in range(9)]
    column = pa.chunked_array(chunks, pa.large_string())
    whole = column.combine_chunks()
    for _ in range(20):
        positions = np.array([rnd.randrange(len(whole)) for _ in range(rnd.randrange(0, 60))], np.int64)
        assert ids_module.take(column, positions).to_pylist() == whole.take(pa.array(positions)).to_pylist()


def test_a_sorted_table_holds_the_ids_once():
    """Sorting by hash moves the hashes and their positions, never the ids: the table's ids are the column
    it was given, and merged tables append to them (issue 22: a copy of ten million ids is 220 MB)."""
    column = pa.array([f"i{k}" for k in range(1000)], pa.large_string())
    table = ids_module.SortedIds(hash_ids(column), column)
    assert table.ids is column and table.source.dtype == np.int32
    more = pa.array([f"j{k}" for k in range(10)], pa.large_string())
    merged = table.with_ids(more, hash_ids(more))
    assert merged.ids.chunk(0).buffers()[2].address == column.buffers()[2].address
    assert [merged.find(f"j{k}") >= 0 for k in range(10)] == [True] * 10 and merged.find("zz") == -1
    assert np.all(merged.hash[1:] >= merged.hash[:-1]) and len(merged) == 1010


def test_union_and_copy_leave_the_original_alone():
    a = IdSet([f"i{k}" for k in range(5000)])  # past the bulk threshold: merged into arrays
    b = a.union(["new"])
    c = a.copy()
    c.add("other")
    assert "new" in b and "new" not in a and "other" not in a and len(a) == 5000


@pytest.mark.parametrize("seed", range(6))
def test_first_copies_names_each_ids_first_entry(hashing, seed):
    rnd = random.Random(seed)
    pool = _pool(rnd)
    entries = [rnd.choice(pool) for _ in range(500)]
    first = first_copies(pa.array(entries, pa.large_string()), hash_ids(entries))
    assert first.tolist() == [entries.index(x) for x in entries]


def _reference_plan(ids, rank, world_size, done):
    """plan_positions as it was written with a dict and a set of str (before issue 22)."""
    first: dict[str, int] = {}
    todo, repeats = [], []
    for k, sid in enumerate(ids):
        if world_size > 1 and owner_rank(sid, world_size) != rank:
            continue
        if sid in first:
            repeats.append((k, first[sid]))
            continue
        first[sid] = k
        if sid not in done:
            todo.append(k)
    return todo, repeats


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("world_size", [1, 3])
def test_plan_positions_matches_the_set_of_str_rule(hashing, seed, world_size):
    rnd = random.Random(seed)
    pool = _pool(rnd)
    ids = [rnd.choice(pool) for _ in range(700)]
    done_list = rnd.sample(pool, 150)
    for done in (set(done_list), IdSet(done_list)):
        for rank in range(world_size):
            todo, repeats = plan_positions(ids, rank, world_size, done)
            assert isinstance(todo, np.ndarray)
            assert (todo.tolist(), repeats) == _reference_plan(ids, rank, world_size, set(done_list))
    # what does not depend on done, made once and given back (as RunPlan does for every later plan)
    strings = pa.array(ids, pa.large_string())
    hashes = hash_ids(strings)
    for rank in range(world_size):
        unique = unique_positions(strings, hashes, owned(ids, rank, world_size))
        for done_now in (set(), set(done_list), set(pool)):
            todo, repeats = plan_positions(ids, rank, world_size, IdSet(list(done_now)), unique=unique)
            assert (todo.tolist(), repeats) == _reference_plan(ids, rank, world_size, done_now)


def test_arrow_strings_reads_like_a_list():
    values = [f"s{k}" for k in range(70_000)]  # more than one conversion chunk
    col = ArrowStrings(pa.chunked_array([values[:10], values[10:]]))
    assert len(col) == 70_000 and col[3] == "s3" and col[-1] == "s69999" and col[5:8] == ["s5", "s6", "s7"]
    assert list(col) == values and col == values and col != values[:-1]


def test_the_column_hash_is_the_one_by_one_hash():
    """hash_ids over an Arrow column (numpy, a byte position at a time) equals _hash_one per id, for ids of
    any length and script, in sliced and chunked columns, and for long lists of str."""
    rnd = random.Random(7)
    alphabet = "ab/é\u4e2d\U0001f600-_0"
    values = [
        "".join(rnd.choice(alphabet) for _ in range(rnd.choice([0, 1, 2, 13, 40, 300]))) for _ in range(5000)
    ]
    one = [ids_module._hash_one(v) for v in values]
    assert hash_ids(pa.array(values, pa.large_string())).tolist() == one
    assert hash_ids(pa.array(values, pa.string()).slice(17, 300)).tolist() == one[17:317]
    assert hash_ids(pa.chunked_array([values[:10], values[10:]])).tolist() == one
    assert hash_ids(values).tolist() == one  # past _SMALL: made a column first
    assert hash_ids(values[:5]).tolist() == one[:5]


def test_an_id_arrow_cannot_hold_stays_a_member():
    """A lone surrogate (only the Python API can make one; the store refuses to write it) survives merges
    and bulk updates as a plain str member instead of crashing the set."""
    odd = "bad\ud800id"
    s = IdSet([odd])
    s.update([f"i{k}" for k in range(IdSet._MIN_MERGE + 10)])  # a bulk update, then a merge by add
    for k in range(10):
        s.add(f"j{k}")
    big = [f"k{k}" for k in range(5000)] + ["bad\udc80"]
    s.update(big)
    assert odd in s and "bad\udc80" in s and "i5" in s and "k4999" in s
    assert len(s) == 1 + IdSet._MIN_MERGE + 10 + 10 + 5001


def test_owned_from_an_arrow_column_gives_each_ids_owner():
    """The column's path (blake2b of the UTF-8 bytes, a chunk at a time) names the same owner as
    owner_rank for every id: plain, non-ASCII, long, past a chunk's end; and a dictionary column too."""
    ids = [f"img-{i:06d}" for i in range(70_000)] + ["café/é.jpg", "☃" * 300, "a b", "x"]
    for world_size in (2, 3, 8):
        for rank in (0, world_size - 1):
            want = [owner_rank(i, world_size) == rank for i in ids]
            assert owned(ArrowStrings(pa.array(ids, pa.large_string())), rank, world_size).tolist() == want
            assert owned(ids, rank, world_size).tolist() == want
            encoded = ArrowStrings(pa.array(ids).dictionary_encode())
            assert owned(encoded, rank, world_size).tolist() == want


def test_ids_added_one_by_one_stay_a_64th_of_the_set(monkeypatch):
    """A writer adds each committed id on its own: they wait in a ``set`` of ``str`` (about 90 bytes an id)
    only until they are a 64th of the set (at least ``_MIN_MERGE``), then are merged into the arrays."""
    monkeypatch.setattr(IdSet, "_MIN_MERGE", 16)
    s = IdSet(pa.array([f"old-{k:05d}" for k in range(6400)]))
    largest = 0
    for k in range(2000):
        s.update(f"new-{k:05d}-{j}" for j in range(2))  # a generator: the ids go through add, one by one
        largest = max(largest, len(s._recent))
        assert len(s._recent) < max(16, (len(s) - len(s._recent)) // 64) + 2
    assert largest >= 100  # the bound grew with the set (6400 / 64), not stuck at the minimum
    assert len(s) == 6400 + 4000 and "new-01999-1" in s and "old-00000" in s and "new-2000-0" not in s


def test_chunks_are_combined_only_when_many_and_small(monkeypatch):
    """A consolidated part's ids come in row groups of 131,072: kept as chunks (combining them copied every
    id); thousands of small parts' columns are combined once, so lookups do not walk thousands of chunks."""
    monkeypatch.setattr(ids_module, "_MAX_CHUNKS", 4)
    monkeypatch.setattr(ids_module, "_MIN_CHUNK", 10)
    big = [pa.array([f"b{k}-{i}" for i in range(12)], pa.large_string()) for k in range(6)]
    small = [pa.array([f"s{k}-{i}" for i in range(3)], pa.large_string()) for k in range(6)]
    assert ids_module._appended(*big).num_chunks == 6
    assert ids_module._appended(*small).num_chunks == 1
    assert ids_module._appended(*big[:2]).to_pylist() == big[0].to_pylist() + big[1].to_pylist()
    s = IdSet()
    s.update(ArrowStrings.of_chunks(pa.chunked_array([c.cast(pa.string()) for c in big])))
    s.update(ArrowStrings(pa.array(["late"])))
    ref = {x for c in big for x in c.to_pylist()} | {"late"}
    assert s == ref
    assert s.isin([*sorted(ref), "b9-0"]).tolist() == [True] * len(ref) + [False]


def test_of_chunks_keeps_the_bytes_and_reads_like_a_list():
    chunked = pa.chunked_array([pa.array(["a", "bé"], pa.string()), pa.array(["c"], pa.string())])
    strings = ArrowStrings.of_chunks(chunked)
    assert strings.array.type == pa.large_string() and strings.array.num_chunks == 2
    assert strings.array.chunk(0).buffers()[2].address == chunked.chunk(0).buffers()[2].address
    assert list(strings) == ["a", "bé", "c"] and strings[1] == "bé" and strings[1:3] == ["bé", "c"]


def test_a_sorted_table_sorts_the_callers_hashes_only_when_given_them():
    ids = pa.array(["c", "a", "b", "a2"], pa.large_string())
    hashes = hash_ids(ids)
    kept = hashes.copy()
    table = ids_module.SortedIds(hashes, ids)
    assert np.array_equal(hashes, kept)  # FeatureCache takes subsets of its hashes afterwards
    consumed = ids_module.SortedIds(hashes, ids, consume=True)
    assert consumed.hash is hashes and np.array_equal(consumed.hash, table.hash)
    assert np.array_equal(consumed.source, table.source) or len(set(kept.tolist())) < len(kept)
    assert [consumed.id_at(i) for i in range(4)] == [table.id_at(i) for i in range(4)]
