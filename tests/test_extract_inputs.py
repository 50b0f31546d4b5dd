"""Inputs: folder scans, manifests in three formats, frame lists, bad rows, ids, symlinks, duplicate ids."""

from __future__ import annotations

import json
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vlfast.extraction.ids import MAX_ID_BYTES
from vlfast.extraction.sources import EmptyInput, InputProblem, Sample, load_inputs
from vlfast.extraction.sources.manifest import load_manifest
from vlfast.extraction.sources.sample import IMAGE_SUFFIXES

needs_symlinks = pytest.mark.skipif(sys.platform == "win32", reason="symlinks need privileges on Windows")


def _touch(p, data=b"x"):
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return p


def strict(source):
    """The samples of ``source``; ValueError listing the problems if there are any, so nothing is dropped."""
    samples, problems = load_inputs(source)
    if problems:
        raise ValueError(
            f"{len(problems)} problem(s): " + "; ".join(f"{p.where}: {p.reason}" for p in problems)
        )
    return samples


def _jsonl(path, *lines: str | bytes):
    path.write_bytes(b"".join((ln if isinstance(ln, bytes) else ln.encode()) + b"\n" for ln in lines))
    return path


def test_scan_folder_recursive_sorted_media_only(tmp_path):
    for name in ["b.jpg", "a/c.PNG", "a/v.mp4", "notes.txt", ".hidden/x.jpg", "a/.y.jpg", "a-b.jpg"]:
        _touch(tmp_path / name)
    samples = strict(tmp_path)
    assert [s.id for s in samples] == ["a/c.PNG", "a/v.mp4", "a-b.jpg", "b.jpg"]  # by path components
    assert [s.kind for s in samples] == ["image", "video", "image", "image"]
    assert load_inputs(tmp_path) == (samples, [])


def test_manifests_jsonl_csv_parquet_agree(tmp_path):
    rows = [
        {"id": "one", "path": "img/1.jpg", "prompt": "What is this?"},
        {"id": "clip", "path": ["f/0.png", "f/1.png", "f/2.png"]},
        {"id": "vid", "path": "v.mp4"},
    ]
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    csv_rows = [
        "id,path,prompt",
        "one,img/1.jpg,What is this?",
        'clip,"[""f/0.png"", ""f/1.png"", ""f/2.png""]",',
        "vid,v.mp4,",
    ]
    (tmp_path / "m.csv").write_text("\n".join(csv_rows) + "\n")
    pq.write_table(
        pa.table(
            {
                "id": [r["id"] for r in rows],
                "path": [json.dumps(r["path"]) if isinstance(r["path"], list) else r["path"] for r in rows],
                "prompt": [r.get("prompt") for r in rows],
            }
        ),
        tmp_path / "m.parquet",
    )
    got = [strict(tmp_path / f"m.{ext}") for ext in ("jsonl", "csv", "parquet")]
    assert got[0] == got[1] == got[2]
    one, clip, vid = got[0]
    assert one == Sample("one", "image", (str(tmp_path / "img/1.jpg"),), "What is this?")
    assert clip.kind == "frames" and len(clip.paths) == 3
    assert vid.kind == "video" and vid.prompt is None


def test_manifest_id_defaults_to_path_and_strict_readers_name_the_row(tmp_path):
    m = _jsonl(tmp_path / "m.jsonl", '{"path": "a.jpg"}', '{"id": "x"}')
    with pytest.raises(ValueError, match=r"m\.jsonl line 2: no path"):
        strict(m)
    n = _jsonl(tmp_path / "n.jsonl", '{"path": "a.jpg"}', "not json")
    with pytest.raises(ValueError, match=r"n\.jsonl line 2: not valid JSON"):
        strict(n)
    o = _jsonl(tmp_path / "o.jsonl", '{"path": "/abs/a.jpg"}', '{"path": "a//b.jpg"}')
    assert [s.id for s in strict(o)] == ["/abs/a.jpg", "a/b.jpg"]


BAD_JSONL_ROWS = [
    (b"{not json", "not valid JSON (Expecting property name enclosed in double quotes at column 2)", None),
    (b'["a.jpg"]', "a JSON list is not a row", None),
    (b'"a.jpg"', "a JSON str is not a row", None),
    (b'{"id": "r"}', "no path and no text (the row has 'id')", "r"),
    (b'{"id": "r", "path": ""}', "no path", "r"),
    (b'{"id": "r", "path": null}', "no path", "r"),
    (b'{"id": "r", "path": 5}', "path must be a file path (text) or a list of frame paths, got int 5", "r"),
    (b'{"path": {"a": 1}}', "got dict {'a': 1}", None),
    (b'{"path": ["a.png", 3]}', "path list must hold only non-empty text paths; item 1 is int 3", None),
    (b'{"path": []}', "path is an empty list", None),
    (b'{"path": "[\\"a.png\\", 3]"}', "item 1 is int 3", None),
    (b'{"path": "[a.png, b.png]"}', "path looks like a JSON list but is not valid JSON", None),
    (b'{"path": ["a.png", "b.mp4"]}', "frame lists hold images; item 1 ('b.mp4') is a video", None),
    (b'{"id": "r", "path": "\xff.jpg"}', "not valid UTF-8 (byte 0xff at byte 22 of the line)", None),
    (b'{"id": "\xed\xa0\x80", "path": "a.jpg"}', "not valid UTF-8 (byte 0xed", None),  # UTF-8 of a surrogate
    (b'{"id": "\\ud800", "path": "a.jpg"}', "id holds a lone surrogate (\\ud800)", None),
    (b'{"id": "r", "path": "a\\ud800.jpg"}', "holds a lone surrogate (\\ud800)", "r"),
    (b'{"path": "\\ud800.jpg"}', "id (taken from the path) holds a lone surrogate", None),
    (b'{"id": "r", "path": "a\\u0000.jpg"}', "path 'a\\x00.jpg' holds a NUL character", "r"),
    (b'{"id": "r", "path": ["a.png", "b\\u0000.png"]}', "holds a NUL character", "r"),
    (b'{"id": true, "path": "a.jpg"}', "id is a boolean (true); give text or a number", None),
    (b'{"id": [1], "path": "a.jpg"}', "id must be text or a number, got list [1]", None),
    (b'{"id": "r", "path": "a.jpg", "prompt": 7}', "prompt must be text, got int 7", "r"),
    (b'{"id": "r", "path": "a.jpg", "prompt": "\\udc00"}', "prompt holds a lone surrogate", "r"),
]


@pytest.mark.parametrize(("line", "reason", "row_id"), BAD_JSONL_ROWS)
def test_a_bad_jsonl_line_is_a_problem_and_the_rest_go_on(tmp_path, line, reason, row_id):
    m = _jsonl(tmp_path / "m.jsonl", '{"id": "good", "path": "a.jpg"}', b"", line, '{"path": "b.jpg"}')
    samples, problems = load_inputs(m)
    assert [s.id for s in samples] == ["good", "b.jpg"]
    assert len(problems) == 1, problems
    (p,) = problems
    assert p.where == f"{m} line 3"
    assert reason in p.reason
    assert p.id == row_id
    p.reason.encode("utf-8")  # the record itself can always be written
    with pytest.raises(ValueError, match=r"line 3: "):
        strict(m)


def test_ids_and_paths_must_be_storable(tmp_path):
    ok, too_long = "é" * (MAX_ID_BYTES // 2), "a" * (MAX_ID_BYTES + 1)
    m = _jsonl(
        tmp_path / "m.jsonl",
        json.dumps({"id": ok, "path": "a.jpg"}),
        json.dumps({"id": too_long, "path": "b.jpg"}),
        json.dumps({"path": "d/" * (MAX_ID_BYTES // 2) + "c.jpg"}),
    )
    samples, problems = load_inputs(m)
    assert [s.id for s in samples] == [ok]
    assert [(p.where.rsplit(" ", 1)[1], p.id) for p in problems] == [("2", None), ("3", None)]
    limit = f"longer than the {MAX_ID_BYTES}-byte limit; give a shorter id"
    assert problems[0].reason == f"id is {MAX_ID_BYTES + 1} bytes in UTF-8, {limit}"
    assert problems[1].reason.startswith("id (taken from the path) is 4101 bytes")
    # Samples built by an API user go through the same check: a problem each.
    given = [Sample("a", "image", ("a.jpg",)), Sample("\ud800", "image", ("b.jpg",))]
    given += [Sample("c", "image", ("c\x00.jpg",)), {"id": True, "path": "d.jpg"}, {"path": "e.mp4"}]
    samples, problems = load_inputs(given)
    assert [s.id for s in samples] == ["a", "e.mp4"] and samples[1].kind == "video"
    assert [(p.where, p.id) for p in problems] == [
        ("inputs[1]", None),
        ("inputs[2]", "c"),
        ("inputs[3]", None),
    ]
    with pytest.raises(ValueError, match=r"inputs\[1\]: id holds a lone surrogate"):
        strict(given)
    assert load_inputs([]) == ([], [])  # an API caller may pass nothing


def test_csv_bad_rows_use_data_row_numbers(tmp_path):
    m = tmp_path / "m.csv"
    m.write_bytes(
        b"id,path,prompt\n"
        b'a,a.jpg,"two\nlines"\n'  # row 1 spans two lines
        b"\n"  # row 2: blank, skipped
        b"b,\xff.jpg,\n"  # row 3: not UTF-8
        b"c,c.jpg,x,y\n"  # row 4: an unquoted comma
        b"d,,\n"  # row 5: no path
        b',"[""f0.png"",""f1.png""]",\n'  # row 6: a frame list, id from its first frame
        b",,\n"  # row 7: empty cells, skipped
        b'e,"[f0.png]",\n'  # row 8: broken list
        b"f,f.jpg,,\n"  # row 9: a trailing empty value is fine
    )
    samples, problems = load_inputs(m)
    assert [s.id for s in samples] == ["a", "f0.png", "f"]
    assert samples[0].prompt == "two\nlines" and samples[1].kind == "frames"
    assert [(p.where, p.id) for p in problems] == [
        (f"{m} row 3", None),
        (f"{m} row 4", None),
        (f"{m} row 5", "d"),
        (f"{m} row 8", "e"),
    ]
    assert problems[0].reason == "not valid UTF-8 (byte 0xff); save the manifest as UTF-8"
    assert problems[1].reason == (
        "the row has 4 values but the header has 3 columns; quote values that contain a comma"
    )
    assert problems[2].reason.startswith("no path and no text (the row has 'id', 'path', 'prompt')")
    assert problems[3].reason.startswith("path looks like a JSON list but is not valid JSON")


def test_a_utf8_bom_is_not_part_of_the_first_column(tmp_path):
    bom = b"\xef\xbb\xbf"
    (tmp_path / "m.csv").write_bytes(bom + b"id,path\nx,a.jpg\n")
    _jsonl(tmp_path / "m.jsonl", bom + b'{"id": "x", "path": "a.jpg"}')
    want = [Sample("x", "image", (str(tmp_path / "a.jpg"),))]
    assert strict(tmp_path / "m.csv") == strict(tmp_path / "m.jsonl") == want
    # Only at the very start: a BOM elsewhere is data.
    (tmp_path / "n.csv").write_bytes(b"id,path\n" + bom + b"x,a.jpg\n")
    assert strict(tmp_path / "n.csv")[0].id == "\ufeffx"


def test_ids_mean_the_same_in_jsonl_csv_and_parquet(tmp_path):
    # One logical manifest; Parquet's id column is what pandas writes for ints with a gap: float64 + NaN.
    jsonl = [
        '{"id": 1, "path": "a.jpg", "prompt": "p"}',
        '{"id": null, "path": "b.jpg"}',
        '{"path": "c.mp4", "prompt": null}',
        '{"id": 3.0, "path": ["f0.png", "f1.png"]}',
        '{"id": 2.5, "path": "d.jpg", "prompt": ""}',
        '{"id": "", "path": "e.jpg"}',
        '{"id": NaN, "path": "g.jpg"}',
    ]
    _jsonl(tmp_path / "m.jsonl", *jsonl)
    (tmp_path / "m.csv").write_bytes(
        b"\xef\xbb\xbfid,path,prompt\n1,a.jpg,p\n,b.jpg,\n,c.mp4,\n"
        b'3,"[""f0.png"", ""f1.png""]",\n2.5,d.jpg,\n,e.jpg,\n,g.jpg,\n'
    )
    nan = float("nan")
    table = pa.table(
        {
            "id": pa.array([1.0, nan, None, 3.0, 2.5, nan, nan], pa.float64()),
            "path": ["a.jpg", "b.jpg", "c.mp4", '["f0.png", "f1.png"]', "d.jpg", "e.jpg", "g.jpg"],
            "prompt": ["p", None, None, None, "", None, None],
        }
    )
    pq.write_table(table, tmp_path / "m.parquet")
    got = {ext: load_inputs(tmp_path / f"m.{ext}") for ext in ("jsonl", "csv", "parquet")}
    assert got["jsonl"] == got["csv"] == got["parquet"]
    samples, problems = got["jsonl"]
    assert problems == []
    assert [s.id for s in samples] == ["1", "b.jpg", "c.mp4", "3", "2.5", "e.jpg", "g.jpg"]
    assert [s.kind for s in samples] == ["image", "image", "video", "frames", "image", "image", "image"]
    assert [s.prompt for s in samples] == ["p"] + [None] * 6
    # A list column is a frame list as well; a one-frame list is its file's kind.
    pq.write_table(pa.table({"path": pa.array([["f0.png", "f1.png"], ["v.mp4"]])}), tmp_path / "l.parquet")
    assert [(s.id, s.kind) for s in strict(tmp_path / "l.parquet")] == [
        ("f0.png", "frames"),
        ("v.mp4", "video"),
    ]


def test_text_ids_are_kept_exactly_and_bools_refused(tmp_path):
    (tmp_path / "m.csv").write_text("id,path\n1.0,a.jpg\n007,b.jpg\n true,c.jpg\n")
    assert [s.id for s in strict(tmp_path / "m.csv")] == ["1.0", "007", " true"]
    m = _jsonl(tmp_path / "m.jsonl", '{"id": "1.0", "path": "a.jpg"}', '{"id": false, "path": "b.jpg"}')
    samples, problems = load_inputs(m)
    assert [s.id for s in samples] == ["1.0"]
    assert problems == [
        InputProblem(
            f"{m} line 2", "id is a boolean (false); give text or a number (in quotes if the word is the id)"
        )
    ]
    pq.write_table(pa.table({"id": [True, False], "path": ["a.jpg", "b.jpg"]}), tmp_path / "b.parquet")
    with pytest.raises(ValueError, match=r"b\.parquet row 1: id is a boolean \(true\)"):
        load_inputs(tmp_path / "b.parquet")  # no usable row at all: the input is refused whole
    big = pa.array([2**62, None], pa.int64())
    pq.write_table(pa.table({"id": big, "path": ["a.jpg", "b.jpg"]}), tmp_path / "i.parquet")
    assert [s.id for s in strict(tmp_path / "i.parquet")] == [str(2**62), "b.jpg"]


def test_wholly_unusable_manifests_raise_at_once(tmp_path):
    (tmp_path / "m.txt").write_text("a.jpg\n")
    with pytest.raises(ValueError, match=r"must end in \.jsonl, \.csv or \.parquet"):
        load_manifest(tmp_path / "m.txt")
    (tmp_path / "cols.csv").write_text("id,file\nx,a.jpg\n")
    with pytest.raises(ValueError, match=r"has no 'path' column \(columns: 'id', 'file'\)"):
        load_inputs(tmp_path / "cols.csv")
    pq.write_table(pa.table({"file": ["a.jpg"]}), tmp_path / "cols.parquet")
    with pytest.raises(ValueError, match=r"has no 'path' column \(columns: 'file'\)"):
        load_inputs(tmp_path / "cols.parquet")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match=r"junk\.parquet cannot be read as Parquet"):
        load_inputs(tmp_path / "junk.parquet")
    _jsonl(tmp_path / "bad.jsonl", "nope", "[1]", '{"id": "x"}')
    with pytest.raises(
        ValueError, match=r"has no usable sample: 3 problem\(s\): .*bad\.jsonl line 1: not valid JSON"
    ):
        load_inputs(tmp_path / "bad.jsonl")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_inputs(tmp_path / "missing.csv")


def test_empty_inputs_raise_empty_input(tmp_path):
    (tmp_path / "empty").mkdir()
    _touch(tmp_path / "other" / "notes.txt")
    _touch(tmp_path / "other" / ".hidden.jpg")
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    (tmp_path / "header.csv").write_text("id,path,prompt\n")
    (tmp_path / "nothing.csv").write_bytes(b"")
    pq.write_table(pa.table({"path": pa.array([], pa.string())}), tmp_path / "zero.parquet")
    for name in ["empty", "other", "blank.jsonl", "header.csv", "nothing.csv", "zero.parquet"]:
        with pytest.raises(EmptyInput) as e:
            load_inputs(tmp_path / name)
        msg = str(e.value)
        assert str(tmp_path / name) in msg and ".jpg" in msg and ".mp4" in msg and ".parquet" in msg
    assert issubclass(EmptyInput, ValueError)


@needs_symlinks
def test_folder_dangling_symlinks_and_loops_are_problems(tmp_path):
    _touch(tmp_path / "real.jpg")
    os.symlink("real.jpg", tmp_path / "link.jpg")  # a link to a file is that file
    (tmp_path / "sub").mkdir()
    os.symlink("gone.mp4", tmp_path / "sub" / "dangling.mp4")
    os.symlink("loop.png", tmp_path / "loop.png")
    os.symlink("b.png", tmp_path / "a.png")
    os.symlink("a.png", tmp_path / "b.png")
    os.symlink("gone.txt", tmp_path / "dangling.txt")  # not media: ignored as before
    os.symlink("gone.jpg", tmp_path / ".hidden.jpg")  # hidden: skipped as before
    samples, problems = load_inputs(tmp_path)
    assert [(s.id, s.paths) for s in samples] == [
        ("link.jpg", (str(tmp_path / "link.jpg"),)),
        ("real.jpg", (str(tmp_path / "real.jpg"),)),
    ]
    loop = "symlink loop: the link never reaches a file; fix or remove it"
    assert problems == [
        InputProblem(str(tmp_path / "a.png"), loop, "a.png"),
        InputProblem(str(tmp_path / "b.png"), loop, "b.png"),
        InputProblem(str(tmp_path / "loop.png"), loop, "loop.png"),
        InputProblem(
            str(tmp_path / "sub" / "dangling.mp4"),
            "dangling symlink -> gone.mp4: the target does not exist; fix or remove the link",
            "sub/dangling.mp4",
        ),
    ]
    with pytest.raises(ValueError, match=r"4 problem\(s\): .*a\.png: symlink loop"):
        strict(tmp_path)


@needs_symlinks
def test_folder_scan_does_not_enter_symlinked_folders(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    _touch(root / "sub" / "a.jpg")
    _touch(outside / "o.jpg")
    os.symlink(outside, root / "linked")  # a symlinked folder: listed by the OS, never entered
    os.symlink(".", root / "sub" / "self")  # loops that would never end if followed
    os.symlink("..", root / "sub" / "up")
    os.symlink("sub", root / "dir.mp4")  # a folder with a media name is still a folder
    assert [s.id for s in strict(root)] == ["sub/a.jpg"]
    os.remove(root / "sub" / "a.jpg")
    with pytest.raises(EmptyInput, match="symlinked folders are not entered"):
        load_inputs(root)


@pytest.mark.skipif(sys.platform != "linux", reason="needs a file system taking any bytes in names")
def test_folder_entry_with_a_non_utf8_name_is_a_problem(tmp_path):
    _touch(tmp_path / "ok.jpg")
    bad = os.path.join(os.fsencode(tmp_path), b"caf\xe9.jpg")
    with open(bad, "wb") as f:
        f.write(b"x")
    samples, problems = load_inputs(tmp_path)
    assert [s.id for s in samples] == ["ok.jpg"]
    (p,) = problems
    assert p.id is None and p.where == f"{tmp_path}/caf\\xe9.jpg"
    assert p.reason == "id holds bytes that are not valid UTF-8 (0xe9); rename it or save it as UTF-8"
    p.where.encode("utf-8")


def test_unknown_inputs_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a folder") as e:
        load_inputs(tmp_path / "missing")
    assert all(s in str(e.value) for s in IMAGE_SUFFIXES)
    with pytest.raises(ValueError, match="kind"):
        Sample("x", "audio", ("a.wav",))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="list of Sample or dict rows"):
        load_inputs([3])  # type: ignore[list-item]


def test_folder_that_cannot_be_read_is_a_problem(tmp_path, monkeypatch):
    _touch(tmp_path / "a.jpg")
    _touch(tmp_path / "locked" / "b.jpg")
    real_scandir = os.scandir

    def scandir(path):  # chmod 000 does not stop root, so refuse the folder as the OS would
        if os.fspath(path).endswith("locked"):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    samples, problems = load_inputs(tmp_path)
    assert [s.id for s in samples] == ["a.jpg"]
    assert problems == [
        InputProblem(
            str(tmp_path / "locked"), "folder cannot be read (Permission denied); its files are skipped"
        )
    ]
