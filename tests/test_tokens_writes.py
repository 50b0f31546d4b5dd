"""What `vlfast tokens` writes for a user, and the inputs it refuses before writing (issue 38).

`rewrite` and `fix` write beside their destination and rename into place when whole: a refused or failed
run leaves no output and no temp file. An output that is an input by identity (a hard link, a symlink,
another spelling) is refused before anything is opened for writing. A JSONL dataset with a bad line, a
non-UTF-8 byte or a lone surrogate is refused naming the line and byte; a UTF-8 BOM is read as manifests
read it. `--reference-ids` ranges are checked against the embedding's rows before any is expanded.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from test_tokens import make_model
from vlfast.errors import InputRefused
from vlfast.tokens import audit_tokens, fix_tokens, rewrite_tags

runner = CliRunner()
RECORDS = [{"id": i, "text": f"<think>step {i}</think> answer {i}"} for i in range(3)]
MAP = ["--map", "think=thinking"]


def _jsonl(path: Path, records=RECORDS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _rewrite(tokens_app, *args: str):
    return runner.invoke(tokens_app, ["tokens", "rewrite", *MAP, *args])


def _err(r) -> str:
    return " ".join(r.stderr.split())


def _listing(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


# -- rewrite: an output that is the input ---------------------------------------------------------


@pytest.mark.parametrize("how", ["hardlink", "symlink", "spelling"])
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_rewrite_refuses_an_out_that_is_the_dataset(tokens_app, tmp_path, how, suffix):
    """Before: --out a hard link to --dataset gave exit 0, '0 records', and an empty dataset."""
    src = tmp_path / f"data{suffix}"
    if suffix == ".jsonl":
        _jsonl(src)
    else:
        pq.write_table(pa.Table.from_pylist(RECORDS), src)
    original = src.read_bytes()
    if how == "hardlink":
        out = tmp_path / f"link{suffix}"
        os.link(src, out)
    elif how == "symlink":
        out = tmp_path / f"link{suffix}"
        out.symlink_to(src)
    else:
        (tmp_path / "sub").mkdir()
        out = tmp_path / "sub" / ".." / src.name
    r = _rewrite(tokens_app, "--dataset", str(src), "--field", "text", "--out", str(out))
    assert r.exit_code == 2, r.output
    assert "is the same file as --dataset" in _err(r) and str(out) in _err(r), r.stderr
    assert src.read_bytes() == original
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_rewrite_refuses_outputs_that_are_inputs_or_each_other(tokens_app, tmp_path):
    src = _jsonl(tmp_path / "d.jsonl")
    tmpl = tmp_path / "chat.jinja"
    tmpl.write_text("{{ '<think>' }}")
    os.link(tmpl, tmp_path / "tmpl-link.jinja")
    before = _listing(tmp_path)
    common = ["--dataset", str(src), "--field", "text", "--template", str(tmpl)]
    cases = [
        (
            ["--out", str(tmp_path / "o.jsonl"), "--template-out", str(tmp_path / "tmpl-link.jinja")],
            "--template-out",
            "--template",
        ),
        (["--out", str(tmpl), "--template-out", str(tmp_path / "t2.jinja")], "--out", "--template"),
        (["--out", str(tmp_path / "o.jsonl"), "--template-out", str(src)], "--template-out", "--dataset"),
        (
            ["--out", str(tmp_path / "same"), "--template-out", str(tmp_path / "same")],
            "--template-out",
            "--out",
        ),
    ]
    for extra, out_flag, in_flag in cases:
        r = _rewrite(tokens_app, *common, *extra)
        assert r.exit_code == 2, (extra, r.output)
        assert f"{out_flag} " in _err(r) and f"the same file as {in_flag} " in _err(r), (extra, r.stderr)
        assert _listing(tmp_path) == before, extra  # nothing written, not even the dataset


# -- rewrite: bad input anywhere leaves no output ---------------------------------------------------


def test_a_bad_last_line_writes_no_output_and_keeps_the_previous_one(tokens_app, tmp_path):
    """Before: --out held the records before the bad line, under its final name."""
    src = tmp_path / "d.jsonl"
    src.write_text(_jsonl(tmp_path / "good.jsonl").read_text() + '{"text": "<think>\n')
    out = tmp_path / "o.jsonl"
    r = _rewrite(tokens_app, "--dataset", str(src), "--field", "text", "--out", str(out))
    assert r.exit_code == 2, r.output
    assert f"{src} line 4 is not JSON" in _err(r), r.stderr
    assert not out.exists()
    out.write_text("the previous output\n")
    r = _rewrite(tokens_app, "--dataset", str(src), "--field", "text", "--out", str(out))
    assert r.exit_code == 2, r.output
    assert out.read_text() == "the previous output\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl", "good.jsonl", "o.jsonl"]  # no temp


@pytest.mark.parametrize(
    ("line", "needle", "what"),
    [
        (b'{"text": "caf\xe9 <think>"}\n', b"\xe9", "0xe9 is not UTF-8"),  # Latin-1, not UTF-8
        (b'{"text": "x \\ud800 <think>"}\n', b"\\ud800", "a lone surrogate \\ud800"),
        (b'{"text": "\\\\ud800", "other": "\\udc00"}\n', b"\\udc00", "a lone surrogate \\udc00"),
    ],
    ids=["latin-1", "lone-surrogate", "escaped-backslash-then-lone"],
)
def test_non_utf8_and_lone_surrogates_are_refused_naming_line_and_byte(
    tokens_app, tmp_path, line, needle, what
):
    """Before: exit 3 (UnicodeDecodeError / UnicodeEncodeError) with a partial --out."""
    src = tmp_path / "d.jsonl"
    first = (json.dumps(RECORDS[0]) + "\n").encode()
    src.write_bytes(first + line + (json.dumps(RECORDS[1]) + "\n").encode())
    out = tmp_path / "o.jsonl"
    r = _rewrite(tokens_app, "--dataset", str(src), "--field", "text", "--out", str(out))
    assert r.exit_code == 2, r.output
    err = _err(r)
    assert f"{src} line 2, byte {len(first) + line.rindex(needle)}: {what}" in err, err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]


def test_a_utf8_bom_is_read_as_manifests_read_it(tokens_app, tmp_path):
    """Before: the first line, starting with U+FEFF, was 'not JSON'."""
    src = tmp_path / "d.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + _jsonl(tmp_path / "plain.jsonl").read_bytes())
    out = tmp_path / "o.jsonl"
    r = _rewrite(tokens_app, "--dataset", str(src), "--field", "text", "--out", str(out), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["dataset"]["records"] == 3
    assert not out.read_bytes().startswith(b"\xef\xbb\xbf")
    assert [json.loads(x)["text"] for x in out.read_text().splitlines()] == [
        f"<thinking>step {i}</thinking> answer {i}" for i in range(3)
    ]


def test_an_empty_dataset_is_refused(tokens_app, tmp_path):
    """Before: exit 0, '0 records', an empty --out: what the hard-link case looked like afterwards."""
    for name, content in (("empty.jsonl", b""), ("blank.jsonl", b"\n \n"), ("bom.jsonl", b"\xef\xbb\xbf")):
        src = tmp_path / name
        src.write_bytes(content)
        r = _rewrite(tokens_app, "--dataset", str(src), "--field", "text", "--out", str(tmp_path / "o.jsonl"))
        assert r.exit_code == 2, (name, r.output)
        assert f"{src} holds no records" in _err(r), r.stderr
    assert not (tmp_path / "o.jsonl").exists()


def test_a_field_without_text_is_refused(tokens_app, tmp_path):
    """Before: --field naming numbers (an exported table's `embedding`, a JSONL `id`) 'rewrote' nothing,
    exit 0, and wrote a copy."""
    src = _jsonl(tmp_path / "d.jsonl", [{"id": 1, "text": None}, {"id": 2, "text": [{"n": 3}]}])
    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"embedding": [[0.5, 1.0], [2.0, 3.0]], "text": ["<think>", None]}), table)
    for dataset, field in ((src, "id"), (src, "text"), (table, "embedding")):
        out = tmp_path / f"o{dataset.suffix}"
        r = _rewrite(tokens_app, "--dataset", str(dataset), "--field", field, "--out", str(out))
        assert r.exit_code == 2, (field, r.output)
        assert f"field {field!r} of {dataset} holds no text in any record" in _err(r), r.stderr
        assert not out.exists()
    r = _rewrite(tokens_app, "--dataset", str(table), "--field", "text", "--out", str(tmp_path / "o.parquet"))
    assert r.exit_code == 0, r.output  # one string among nulls is text
    assert pq.read_table(tmp_path / "o.parquet").column("text").to_pylist() == ["<thinking>", None]


def test_a_parquet_that_is_not_parquet_is_refused(tokens_app, tmp_path):
    """Before: exit 3, pyarrow's ArrowInvalid."""
    src = tmp_path / "d.parquet"
    src.write_text("not a table")
    r = _rewrite(tokens_app, "--dataset", str(src), "--field", "text", "--out", str(tmp_path / "o.parquet"))
    assert r.exit_code == 2, r.output
    assert f"{src} is not a readable Parquet file" in _err(r), r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.parquet"]


def test_a_missing_template_writes_no_dataset(tmp_path):
    """Before: the dataset was written, then the template was found missing."""
    src = _jsonl(tmp_path / "d.jsonl")
    with pytest.raises(FileNotFoundError, match="template"):
        rewrite_tags(
            ["think=thinking"],
            dataset=src,
            field="text",
            dataset_out=tmp_path / "o.jsonl",
            template=tmp_path / "missing.jinja",
            template_out=tmp_path / "t.jinja",
        )
    with pytest.raises(InputRefused, match="not a valid"):
        rewrite_tags(
            ["think=thinking"],
            dataset=src,
            field="text",
            dataset_out=tmp_path / "o.jsonl",
            reward_regex="<think>(",
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]


def test_rewrite_twice_and_on_its_own_output(tokens_app, tmp_path):
    src = _jsonl(tmp_path / "d.jsonl")
    out, again = tmp_path / "o.jsonl", tmp_path / "o2.jsonl"
    args = ["--dataset", str(src), "--field", "text", "--out", str(out)]
    assert _rewrite(tokens_app, *args).exit_code == 0
    first = out.read_bytes()
    assert _rewrite(tokens_app, *args).exit_code == 0  # the same again: the same bytes
    assert out.read_bytes() == first
    r = _rewrite(tokens_app, "--dataset", str(out), "--field", "text", "--out", str(again), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["dataset"]["replacements"] == {}  # nothing left to map
    assert again.read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl", "o.jsonl", "o2.jsonl"]


def test_outputs_and_inputs_of_the_wrong_kind_are_refused_and_leave_no_folders(tokens_app, tmp_path):
    """Before: --out a folder was refused naming the temp file; --dataset a folder 'does not exist'; --out
    under a file was exit 3 (FileExistsError); a refused rewrite left the folders it made for --out; a JSONL
    dataset was written as JSON lines to an --out named .parquet (and Parquet to .jsonl), exit 0."""
    src = _jsonl(tmp_path / "d.jsonl")
    (tmp_path / "folder").mkdir()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    cases = [
        (
            ["--dataset", str(src), "--out", str(tmp_path / "folder")],
            f"--out {tmp_path / 'folder'} is a folder",
        ),
        (
            ["--dataset", str(tmp_path / "folder"), "--out", str(tmp_path / "o.jsonl")],
            "is a folder; pass a .jsonl",
        ),
        (["--dataset", str(src), "--out", str(src / "o.jsonl")], f"{src} is a file, not a folder"),
        (["--dataset", str(src), "--out", str(src / "a" / "o.jsonl")], f"{src} is a file, not a folder"),
        (
            ["--dataset", str(bad), "--out", str(tmp_path / "new" / "deeper" / "o.jsonl")],
            "line 1 is not JSON",
        ),
    ]
    pq.write_table(pa.Table.from_pylist(RECORDS), tmp_path / "d.parquet")
    cases += [  # the output would be named for the format it is not in
        (
            ["--dataset", str(src), "--out", str(tmp_path / "o.parquet")],
            "is written as the dataset is, JSON lines",
        ),
        (
            ["--dataset", str(tmp_path / "d.parquet"), "--out", str(tmp_path / "o.jsonl")],
            "dataset is, Parquet",
        ),
    ]
    before = sorted(p.name for p in tmp_path.rglob("*"))
    for argv, message in cases:
        r = _rewrite(tokens_app, *argv, "--field", "text")
        assert r.exit_code == 2, (argv, r.output)
        assert message in _err(r), (argv, r.stderr)
        assert sorted(p.name for p in tmp_path.rglob("*")) == before, argv


def test_templates_that_are_not_utf8_are_refused_and_a_bom_is_read(tokens_app, model, tmp_path):
    """Before: `audit --template` of a Latin-1 file was exit 3 (UnicodeDecodeError); a tokenizer_config.json
    with a byte-order mark was 'not valid JSON'."""
    latin = tmp_path / "chat.jinja"
    latin.write_bytes(b"caf\xe9 <think>")
    r = runner.invoke(tokens_app, ["tokens", "audit", "--model", str(model), "--template", str(tmp_path)])
    assert r.exit_code == 2 and f"template {tmp_path} is a folder" in _err(r), r.output
    r = runner.invoke(tokens_app, ["tokens", "audit", "--model", str(model), "--template", str(latin)])
    assert r.exit_code == 2, r.output
    assert f"template {latin} could not be read: byte 3 is 0xe9, not UTF-8" in _err(r), r.stderr
    r = _rewrite(tokens_app, "--template", str(latin), "--template-out", str(tmp_path / "o.jinja"))
    assert r.exit_code == 2 and f"template {latin} could not be read: byte 3 is 0xe9, not UTF-8" in _err(r), (
        r.output
    )
    assert not (tmp_path / "o.jinja").exists()
    config = tmp_path / "tokenizer_config.json"
    config.write_bytes(b"\xef\xbb\xbf" + json.dumps({"chat_template": "<think>{{ x }}</think>"}).encode())
    r = runner.invoke(
        tokens_app, ["tokens", "audit", "--model", str(model), "--template", str(config), "--json"]
    )
    assert r.exit_code == 1, r.output  # the tags are untrained in this checkpoint: read, audited
    assert [t["tag"] for t in json.loads(r.stdout)["tags"]] == ["<think>", "</think>"]


def test_a_template_keeps_its_line_endings(tmp_path):
    tmpl = tmp_path / "chat.jinja"
    tmpl.write_bytes(b"<think>\r\n{{ x }}\r\n</think>\r\n")
    rewrite_tags(["think=thinking"], template=tmpl, template_out=tmp_path / "o.jinja")
    assert (tmp_path / "o.jinja").read_bytes() == b"<thinking>\r\n{{ x }}\r\n</thinking>\r\n"


# -- fix ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("writes") / "m"
    make_model(folder)
    return folder


def test_fix_killed_mid_copy_leaves_no_out(tokens_app, model, tmp_path, monkeypatch):
    """Before: a copy that failed half-way left OUT with some of the checkpoint's files in it."""
    real, calls = shutil.copy2, []

    def failing_copy(src, dst, **kw):
        calls.append(src)
        if len(calls) == 2:
            raise OSError(28, "No space left on device", str(dst))
        return real(src, dst, **kw)

    monkeypatch.setattr(shutil, "copy2", failing_copy)
    out = tmp_path / "fixed"
    r = runner.invoke(tokens_app, ["tokens", "fix", str(out), "--model", str(model)])
    assert r.exit_code not in (0, 1), r.output
    assert len(calls) == 2 and list(tmp_path.iterdir()) == []  # no OUT, no temp beside it
    monkeypatch.undo()
    out.mkdir()  # an empty OUT the user made is filled, as before
    r = runner.invoke(tokens_app, ["tokens", "fix", str(out), "--model", str(model)])
    assert r.exit_code == 0, r.output
    assert {p.name for p in out.iterdir()} == {p.name for p in model.iterdir()}
    assert [p.name for p in tmp_path.iterdir()] == ["fixed"]


def test_fix_refuses_an_out_inside_or_the_checkpoint(tokens_app, model, tmp_path):
    """Before: OUT inside the checkpoint was written there (and copied into itself)."""
    m = tmp_path / "m"
    shutil.copytree(model, m)
    before = sorted(p.name for p in m.iterdir())
    (tmp_path / "link").symlink_to(m)
    for out, message in [
        (m / "fixed", "is inside the checkpoint --model"),
        (m / "sub" / "fixed", "is inside the checkpoint --model"),
        (tmp_path / "link", "is the checkpoint --model"),
        (tmp_path / "link" / "fixed", "is inside the checkpoint --model"),
        (m / ".." / "m", "is the checkpoint --model"),
    ]:
        r = runner.invoke(tokens_app, ["tokens", "fix", str(out), "--model", str(m)])
        assert r.exit_code == 2, (out, r.output)
        assert message in _err(r), (out, r.stderr)
        assert sorted(p.name for p in m.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "m"]


def test_fix_twice_and_on_its_own_output(tokens_app, model, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert runner.invoke(tokens_app, ["tokens", "fix", str(a), "--model", str(model)]).exit_code == 0
    listing = _listing(a)
    r = runner.invoke(tokens_app, ["tokens", "fix", str(a), "--model", str(model)])
    assert r.exit_code == 2 and "exists and is not empty" in _err(r)
    assert _listing(a) == listing
    r = runner.invoke(tokens_app, ["tokens", "fix", str(b), "--model", str(a), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["rows"] == []  # already fixed: copied unchanged
    assert _listing(b) == listing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


# -- --reference-ids --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0-1000000000000", "--reference-ids range '0-1000000000000' reaches past the embedding's"),
        ("5-1000000000000000000000000", "reaches past the embedding's"),
        ("1000000000000", "--reference-ids id '1000000000000' is past the embedding's"),
        ("9" * 5000, "is past the embedding's"),
        ("-1", "--reference-ids value '-1' is not an id"),
        ("-5-3", "is not an id"),
        ("nan", "--reference-ids value 'nan' is not an id"),
        ("inf", "is not an id"),
        ("1e3", "is not an id"),
        ("1.5", "is not an id"),
        ("3-5-7", "is not an id"),
    ],
)
def test_reference_ids_are_bounded_before_they_are_expanded(tokens_app, model, value, message):
    """Before: 0-1000000000000 was expanded into a list first (out of memory)."""
    start = time.monotonic()
    r = runner.invoke(tokens_app, ["tokens", "audit", "--model", str(model), "--reference-ids", value])
    assert r.exit_code == 2, r.output
    err = _err(r)
    assert message in err, err
    if "past" in message:
        rows = audit_tokens(model).shape[0]
        assert f"0-{rows - 1}" in err, err  # the bounds
    assert time.monotonic() - start < 30


def test_reference_ids_library_and_fix_refuse_the_same(model, tmp_path):
    with pytest.raises(InputRefused, match="reaches past"):
        audit_tokens(model, reference_ids=["0-1000000000000"])
    with pytest.raises(InputRefused, match="not an id"):
        audit_tokens(model, reference_ids=[float("nan")])
    with pytest.raises(InputRefused, match="not an id"):
        audit_tokens(model, reference_ids=[-1])
    with pytest.raises(InputRefused, match="reaches past"):
        fix_tokens(model, tmp_path / "x", reference_ids=["0-1000000000000"])
    assert list(tmp_path.iterdir()) == []
    # Ranges that overlap count each id once; the full range is accepted.
    rows = audit_tokens(model).shape[0]
    report = audit_tokens(
        model, reference_ids=[f"{rows - 10}-{rows - 1}", f"{rows - 5}-{rows - 1}", rows - 1]
    )
    assert report.reference_sources == {"user": 10}


def test_a_device_that_holds_no_data_is_refused(tokens_app, tiny_qwen3_vl):
    """Before: --device meta passed the device check (torch.empty works there) and ended in exit 3."""
    argv = ["tokens", "audit", "--model", str(tiny_qwen3_vl), "--verify-generation", "--device", "meta"]
    r = runner.invoke(tokens_app, argv)
    assert r.exit_code == 2, r.output
    assert "--device 'meta' holds no data" in _err(r), r.stderr


def test_an_out_that_is_a_symlink_is_written_where_it_points(tokens_app, tmp_path):
    src = _jsonl(tmp_path / "d.jsonl")
    (tmp_path / "store").mkdir()
    target = tmp_path / "store" / "o.jsonl"
    target.write_text("old\n")
    (tmp_path / "o.jsonl").symlink_to(target)
    r = _rewrite(tokens_app, "--dataset", str(src), "--field", "text", "--out", str(tmp_path / "o.jsonl"))
    assert r.exit_code == 0, r.output
    assert (tmp_path / "o.jsonl").is_symlink()
    assert json.loads(target.read_text().splitlines()[0])["text"] == "<thinking>step 0</thinking> answer 0"
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["o.jsonl"]
