"""The input list as columns (issue 22): SampleTable gives back exactly the samples it was given, and the
sources, the plan and the engines take it without making one object per sample."""

from __future__ import annotations

import dataclasses
import json
import pickle

import numpy as np
import pytest

from vlfast.extraction.sources import table as table_module
from vlfast.extraction.sources.listing import load_inputs
from vlfast.extraction.sources.remote import RemoteFile
from vlfast.extraction.sources.sample import Sample
from vlfast.extraction.sources.table import SampleTable, SampleTableBuilder
from vlfast.extraction.sources.webdataset import TarMember


def _every_kind() -> list[Sample]:
    return [
        Sample("a", "image", ("/data/x/a.jpg",)),
        Sample("b", "video", ("b.mp4",), "describe it"),
        Sample("c", "frames", ("f/0.png", "f/1.png", "f/2.png")),
        Sample("t", "text", (), text="a text alone", instruction="Find it."),
        Sample("u", "image", ("/data/\udcffbad-byte.jpg",)),  # a name the OS gave with a non-UTF-8 byte
        Sample("w", "image", ("s3://bucket/k/w.jpg",), member=RemoteFile("s3://bucket/k/w.jpg", "{}")),
        Sample("m", "image", ("s/000.tar/m.jpg",), "p", member=TarMember("s/000.tar", "m.jpg", 512, 9)),
        Sample("é", "image", ("/data/x/é.png",), "ünïcode", text="", instruction="\u2603"),
        Sample("r", "image", ("root.jpg",)),
        Sample("s", "image", ("/top.jpg",)),
    ]


@pytest.fixture(params=[1 << 16, 3], ids=["one-chunk", "chunks-of-3"])
def chunk(request, monkeypatch):
    monkeypatch.setattr(table_module, "_CHUNK", request.param)
    return request.param


def test_every_field_round_trips(chunk):
    samples = _every_kind()
    t = SampleTable.of(samples)
    assert len(t) == len(samples)
    assert list(t) == samples  # iteration, a chunk at a time
    assert [t[k] for k in range(len(t))] == samples  # indexing
    assert t == samples and samples == list(t)
    assert t[-1] == samples[-1] and t[-len(t)] == samples[0]
    assert t[2:7] == samples[2:7] and t[::-2] == samples[::-2]
    assert t.take([9, 0, 0, 4]) == [samples[9], samples[0], samples[0], samples[4]]
    assert pickle.loads(pickle.dumps(t)) == samples  # the local engine's workers and Ray get it pickled
    assert t.ids.to_pylist() == [s.id for s in samples]
    assert SampleTable.of(t) is t
    with pytest.raises(IndexError):
        t[len(t)]
    with pytest.raises(IndexError):
        t.take([len(t)])


def test_a_column_first_filled_in_a_later_chunk(chunk):
    """Columns that no sample of the first chunks has (a prompt in row 7 alone) come out null there."""
    samples = [Sample(f"s{i}", "image", (f"d/{i}.jpg",)) for i in range(9)]
    samples[7] = Sample("s7", "image", ("d/7.jpg",), "only here", text="and here")
    assert SampleTable.of(samples) == samples


def test_folders_past_the_kept_number_are_kept_whole(monkeypatch):
    monkeypatch.setattr(table_module, "_MAX_DIRS", 2)
    samples = [Sample(f"s{i}", "image", (f"dir{i}/x{i}.jpg",)) for i in range(6)]
    t = SampleTable.of(samples)
    assert t == samples and len(t._dirs) == 2


def test_any_path_sees_urls_wherever_a_path_is_kept(monkeypatch):
    local = [Sample("a", "image", ("/d/a.jpg",)), Sample("t", "text", (), text="x")]
    assert not SampleTable.of(local).any_path(lambda p: "://" in p)
    url = Sample("u", "image", ("s3://b/u.jpg",))
    assert SampleTable.of([*local, url]).any_path(lambda p: "://" in p)
    frames = Sample("f", "frames", ("s3://b/0.png", "s3://b/1.png"))
    assert SampleTable.of([*local, frames]).any_path(lambda p: "://" in p)
    monkeypatch.setattr(table_module, "_MAX_DIRS", 1)  # the URL's folder is not kept: its path is whole
    assert SampleTable.of([*local, url]).any_path(lambda p: "://" in p)
    # a table taken from another shares its folders: only the folders its own rows use count
    both = SampleTable.of([*local, url])
    assert not both.take([0, 1]).any_path(lambda p: "://" in p)


def test_builder_refuses_what_is_not_a_sample():
    with pytest.raises(TypeError, match="Sample"):
        SampleTableBuilder().append({"path": "a.jpg"})  # type: ignore[arg-type]


def test_an_empty_table():
    t = SampleTable.empty()
    assert len(t) == 0 and list(t) == [] and t == [] and not t
    assert t.take(np.empty(0, np.int64)) == []
    assert not t.has_kind("image")


def test_sources_give_tables(tmp_path, chunk):
    (tmp_path / "imgs").mkdir()
    for name in ("a.jpg", "b.png"):
        (tmp_path / "imgs" / name).write_bytes(b"x")
    rows = [{"id": f"r{i}", "path": f"imgs/{'a.jpg' if i % 2 else 'b.png'}"} for i in range(7)]
    rows.append({"id": "t", "text": "words", "instruction": "Say."})
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples, problems = load_inputs(manifest)
    assert isinstance(samples, SampleTable) and not problems
    assert [s.id for s in samples] == [r["id"] for r in rows]
    assert samples[0].paths == (str(tmp_path / "imgs" / "b.png"),)
    assert samples[7] == Sample("t", "text", (), text="words", instruction="Say.")
    folder, _ = load_inputs(tmp_path / "imgs")
    assert isinstance(folder, SampleTable) and [s.id for s in folder] == ["a.jpg", "b.png"]
    given = [Sample("x", "image", ("x.jpg",))]
    listed, _ = load_inputs(given)
    assert isinstance(listed, SampleTable) and listed == given


def test_a_plan_works_on_the_table(tmp_path):
    """RunPlan keeps the table and hands the engine another table: its ids column is the plan's."""
    from vlfast.extraction.plan import RunPlan

    samples = [Sample(f"id{i % 5}", "image", (f"d/{i}.jpg",)) for i in range(8)]  # ids 0-2 repeat
    plan = RunPlan(
        out=tmp_path,
        samples=samples,
        problems=[],
        rank=0,
        world_size=1,
        family="qwen3_vl",
        processor=None,
        run_config={},
        volatile_keys=(),
    )
    assert isinstance(plan.samples, SampleTable)
    todo, records = plan.work({"id1"})
    assert isinstance(todo, SampleTable)
    assert [s.id for s in todo] == ["id0", "id2", "id3", "id4"]
    assert [r[0] for r in records] == ["id0", "id1", "id2"]  # the repeats, each recorded once


def test_path_forms_match_pathlib_exhaustively():
    """posix_form, suffix_of and a manifest's join, which skip pathlib for paths already in posix form, give
    what pathlib gives for every string of up to 7 characters over the characters that matter."""
    import itertools
    from pathlib import Path, PurePosixPath

    from vlfast.extraction.sources.manifest import _joined
    from vlfast.extraction.sources.sample import posix_form, suffix_of

    bases = [Path("."), Path("/"), Path("/data/m"), Path("rel/dir")]
    for n in range(1, 8):
        for chars in itertools.product("a./", repeat=n):
            p = "".join(chars)
            assert posix_form(p) == PurePosixPath(p).as_posix(), p
            assert suffix_of(p) == PurePosixPath(p).suffix, p
            if not p.startswith("/"):
                for base in bases:
                    assert _joined(base, p) == str(base / p), (base, p)


def test_taking_all_in_order_is_the_table_itself():
    t = SampleTable.of([Sample(f"s{i}", "image", (f"{i}.jpg",)) for i in range(4)])
    assert t.take(np.arange(4)) is t  # a first run's work costs no copy
    assert t.take([0, 1, 3, 2]) is not t and t.take([0, 1, 3, 2])[2].id == "s3"


def _tar(i: int, shard: str = "shards/000.tar") -> Sample:
    name = f"key{i}.jpg" if i % 3 else f"k\udcff{i}.mp4"  # a member name with a non-UTF-8 byte
    return Sample(f"000/key{i}", "image", (f"{shard}/{name}",), member=TarMember(shard, name, 512 * i, i))


def test_tar_members_are_kept_as_columns(chunk):
    samples = [_tar(i, f"s/{i // 4:03d}.tar") for i in range(10)]
    samples.insert(0, Sample("plain", "image", ("a.jpg",)))  # rows without a member, before and among them
    samples.insert(6, Sample("text", "text", (), text="t"))
    t = SampleTable.of(samples)
    assert isinstance(t._members, table_module._Members)
    assert len(t._members.columns["shard"].dictionary) == 3  # each shard's path kept once
    assert list(t) == samples and t.take([11, 0, 6, 2]) == [samples[k] for k in (11, 0, 6, 2)]
    assert pickle.loads(pickle.dumps(t)) == samples


def test_members_of_mixed_classes_are_kept_as_objects(chunk):
    samples = [_tar(0), _tar(1), Sample("u", "image", ("s3://b/u.jpg",), member=RemoteFile("s3://b/u.jpg"))]
    samples += [_tar(i) for i in range(2, 6)]
    t = SampleTable.of(samples)
    assert isinstance(t._members, list)
    assert list(t) == samples and t[2:5] == samples[2:5]


def test_a_rank_keeps_only_its_share_and_records_name_the_whole_input(tmp_path):
    """With ranks, the plan keeps this rank's rows alone; counts and a repeat's record still name entries by
    their place in the whole input, as the plan over the whole input did."""
    from vlfast.extraction.ids import owner_rank
    from vlfast.extraction.plan import RunPlan
    from vlfast.extraction.store.format import DUPLICATE_KIND

    samples = [Sample(f"id{i % 40}", "image", (f"d/{i}.jpg",)) for i in range(50)]  # ids 0-9 repeat
    plans = [
        RunPlan(
            out=tmp_path,
            samples=samples,
            problems=[],
            rank=r,
            world_size=3,
            family="qwen3_vl",
            processor=None,
            run_config={},
            volatile_keys=(),
        )
        for r in range(3)
    ]
    assert sum(len(p.samples) for p in plans) == 50 and {p.total for p in plans} == {50}
    for r, plan in enumerate(plans):
        assert {owner_rank(s.id, 3) for s in plan.samples} <= {r}
        assert plan.assigned == len(plan.samples)
        todo, records = plan.work(set())
        expected = [s.id for k, s in enumerate(samples) if owner_rank(s.id, 3) == r and k < 40]
        assert [s.id for s in todo] == expected
        wanted = {
            (samples[k].id, f"duplicate id: input entry {k} repeats entry {k - 40}")
            for k in range(40, 50)
            if owner_rank(samples[k].id, 3) == r
        }
        assert {(rec[0], rec[2]) for rec in records if rec[3] == DUPLICATE_KIND} == wanted
    share = plans[0].samples
    assert share.listed == 50 and share.own(np.arange(len(share))).listed == 50
    assert share.own(np.array([1])).entry(0) == share.entry(1)  # a share of a share names the whole input


def test_plain_parquet_batches_give_what_the_row_path_gives(tmp_path, monkeypatch):
    """A Parquet manifest's batches of plain rows are made from their columns (issue 22); every batch, plain
    or not, gives exactly the samples and problems that reading each row as a dict gives."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlfast.extraction.sources import manifest

    plain = [
        {"id": "a", "path": "imgs/a.jpg", "prompt": None, "text": "cat", "instruction": ""},
        {"id": "b", "path": "/abs/b.MP4", "prompt": "p", "text": None, "instruction": "Find."},
        {"id": "c", "path": "c.mkv", "prompt": "", "text": "", "instruction": None},
        {"id": "d", "path": "x/.mp4", "prompt": None, "text": None, "instruction": None},  # a hidden name
        {"id": "é", "path": "ünï/é.webm", "prompt": None, "text": None, "instruction": None},
        {"id": "f", "path": "a.b.mov", "prompt": None, "text": None, "instruction": None},
        {"id": "g", "path": "x/..", "prompt": None, "text": None, "instruction": None},
        {"id": "h", "path": "y.", "prompt": None, "text": None, "instruction": None},
    ]
    unusual = [
        {"id": "", "path": "imgs/e.jpg", "prompt": None, "text": None, "instruction": None},  # id from path
        {"id": "u", "path": "s3://bucket/u.jpg", "prompt": None, "text": None, "instruction": None},
        {"id": "fr", "path": '["f0.png", "f1.png"]', "prompt": None, "text": None, "instruction": None},
        {"id": "n", "path": "nul\x00.jpg", "prompt": None, "text": None, "instruction": None},
        {"id": "l" * 2000, "path": "long.jpg", "prompt": None, "text": None, "instruction": None},
        {"id": "dot", "path": "./here.jpg", "prompt": None, "text": None, "instruction": None},
        {"id": "dbl", "path": "a//b.jpg", "prompt": None, "text": None, "instruction": None},
        {"id": "t", "path": None, "prompt": None, "text": "a text alone", "instruction": None},
        {"id": None, "path": "", "prompt": None, "text": None, "instruction": None},
        {"id": "tr", "path": "dir/", "prompt": None, "text": None, "instruction": None},
    ]
    rows = plain[:4] + unusual[:3] + plain[4:] + unusual[3:] + plain  # plain batches and mixed ones
    table = pa.Table.from_pylist(rows)
    path = tmp_path / "m.parquet"
    pq.write_table(table, path, row_group_size=4)
    intable = pa.Table.from_pylist(
        [{**r, "id": k} for k, r in enumerate(plain)],
        schema=pa.schema(
            [
                ("id", pa.int64()),
                ("path", pa.string()),
                ("prompt", pa.string()),
                ("text", pa.string()),
                ("instruction", pa.string()),
            ]
        ),
    )
    pq.write_table(intable, tmp_path / "ints.parquet", row_group_size=3)
    pq.write_table(table.drop_columns(["id"]).slice(0, 4), tmp_path / "noid.parquet")

    monkeypatch.setattr(manifest, "_PARQUET_BATCH", 4)
    made = []
    real = manifest._plain_batch
    monkeypatch.setattr(manifest, "_plain_batch", lambda b, base: made.append(real(b, base)) or made[-1])
    for name in ("m.parquet", "ints.parquet", "noid.parquet"):
        made.clear()
        got, got_problems = manifest.load_manifest(tmp_path / name)
        assert any(m is not None for m in made) and (name != "m.parquet" or None in made)
        want, want_problems = [], []
        for k, row in enumerate(pq.read_table(tmp_path / name).to_pylist(), 1):
            one = manifest.row_sample(row, f"{tmp_path / name} row {k}", tmp_path)
            (want_problems if isinstance(one, manifest.InputProblem) else want).append(one)
        assert list(got) == want and got_problems == want_problems, name


def test_plain_jsonl_blocks_give_what_the_row_path_gives(tmp_path, monkeypatch):
    """A JSONL manifest's blocks of plain rows go into the table from columns (issue 22): each line is still
    parsed on its own, and every block, plain or not, gives exactly what reading each line as a row gives;
    blocks of 4 lines here, so every odd line below lands in a block of its own kind or in a mixed one."""
    import json

    from vlfast.extraction.sources import manifest

    plain = [
        '{"id": "a", "path": "imgs/a.jpg", "text": "cat", "instruction": ""}',
        '{"id": "b", "path": "/abs/b.MP4", "prompt": "p", "instruction": "Find.", "label": [1, 2]}',
        '{"id": "c", "path": "c.mkv", "prompt": null, "text": null}',
        '{"id": "é", "path": "ünï/é.webm"}',
    ]
    ints = ['{"id": 7, "path": "x/7.jpg"}', '{"id": -3, "path": "y.png"}', '{"id": 0, "path": "z.mp4"}']
    no_id = ['{"path": "n/a.jpg"}', '{"path": "n/b.jpg", "text": "t"}']
    unusual = [
        '{"id": true, "path": "bool.jpg"}',
        '{"id": 1.0, "path": "float.jpg"}',
        '{"id": 99999999999999999999999, "path": "big.jpg"}',
        '{"id": null, "path": "null-id.jpg"}',
        '{"id": "s", "path": "\\ud800.jpg"}',
        '{"id": "\\ud800", "path": "sur.jpg"}',
        '{"id": "l", "path": ["f0.png", "f1.png"]}',
        '{"id": "ps", "paths": ["f0.png", "f1.png"]}',
        '{"id": "dup", "path": "first.jpg", "path": "second.jpg"}',
        '{"id": "u", "path": "s3://bucket/u.jpg"}',
        '{"id": "t", "text": "a text alone"}',
        '{"id": "pr", "path": "p.jpg", "prompt": 3}',
        '{"id": "nul", "path": "nul\\u0000.jpg"}',
        '{"id": "dot", "path": "./here.jpg"}',
        "",
        "   ",
        "{not json",
        "[1, 2]",
        '"just text"',
    ]
    lines = plain + ints + unusual[:5] + plain + no_id + unusual[5:] + plain + ints[:1] + plain
    monkeypatch.setattr(manifest, "_JSONL_BLOCK", 4)
    made: list = []
    real = manifest._plain_batch
    monkeypatch.setattr(manifest, "_plain_batch", lambda b, base: made.append(real(b, base)) or made[-1])
    for case, text in {
        "mixed": "\n".join(lines) + "\n",
        "bom": "\ufeff" + "\n".join(plain + plain) + "\n",
        "int-and-text-ids": "\n".join(plain[:2] + ints[:2]) + "\n",
        "a-boolean-among-int-ids": "\n".join(ints[:2] + unusual[:1] + ints[2:] + ints) + "\n",
        "no-id": "\n".join(no_id * 2),  # no newline at the end
    }.items():
        path = tmp_path / f"{case}.jsonl"
        path.write_bytes(text.encode("utf-8", "surrogatepass"))
        made.clear()
        got, got_problems = manifest.load_manifest(path)
        want, want_problems = [], []
        for where, row in manifest._jsonl_lines(path, str(path)):
            one = row if isinstance(row, manifest.InputProblem) else manifest.row_sample(row, where, tmp_path)
            (want_problems if isinstance(one, manifest.InputProblem) else want).append(one)
        assert list(got) == want and got_problems == want_problems, case
        by_columns = sum(len(m) for m in made if m)
        # some blocks took the columns' path; a block of ids both numbers and text never does
        assert (by_columns == 0) == (case == "int-and-text-ids"), case
        if case == "mixed":
            assert len(got_problems) == 8 and by_columns < len(got)  # and some the row path
    assert json.loads(plain[1])["label"] == [1, 2]  # a key no sample field reads is ignored, as by rows


class _OwnMember:
    """A member an API user wrote: the Member protocol, not a dataclass."""

    def __init__(self, data: bytes):
        self.data = data

    def open(self):
        import io

        return io.BytesIO(self.data)

    def read_bytes(self) -> bytes:
        return self.data

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _OwnMember) and other.data == self.data


@dataclasses.dataclass(frozen=True)
class _DerivedMember:
    """A dataclass member with a field its __init__ does not take: it cannot be made again from columns."""

    url: str
    scheme: str = dataclasses.field(init=False, default="s3")

    def open(self): ...

    def read_bytes(self) -> bytes:
        return b""


@pytest.mark.parametrize(
    "member", [_OwnMember(b"x"), _DerivedMember("s3://b/k.jpg")], ids=["not-a-dataclass", "init-false-field"]
)
def test_members_that_are_not_plain_dataclasses_are_kept_as_objects(chunk, member):
    """Such a member, first seen after rows without one (or first of all), is kept as the object itself."""
    plain = [Sample(f"p{i}", "image", (f"{i}.jpg",)) for i in range(4)]
    with_member = Sample("m", "image", ("m.jpg",), member=member)
    for samples in ([*plain, with_member, *plain[:2]], [with_member, *plain]):
        t = SampleTable.of(samples)
        assert isinstance(t._members, list)
        assert list(t) == samples and t.take([len(samples) - 1, 0]) == [samples[-1], samples[0]]
