"""The token audit on broken or awkward input: rows holding NaN or inf, strict JSON, refused arguments,
truncated weights, piped output that must keep every name whole, and Qwen-VL placeholder tokens."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from test_tokens import VL_SPECIAL, make_model
from vlfast.cli._common import print_table
from vlfast.tokens import audit_tokens, audit_vocabulary, fix_tokens

runner = CliRunner()


def _no_constants(name: str):
    raise AssertionError(f"JSON holds the non-standard constant {name}")


def strict_loads(text: str):
    """json.loads that refuses NaN, Infinity and -Infinity, as strict parsers (jq, JavaScript) do."""
    return json.loads(text, parse_constant=_no_constants)


def _set_rows(folder: Path, name: str, rows: dict[int, float]) -> None:
    """Overwrite whole rows of tensor `name` in model.safetensors with one value each (nan, inf, ...)."""
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    t = tensors[name].clone()
    for i, value in rows.items():
        t[i] = value
    tensors[name] = t
    save_file(tensors, str(path), metadata={"format": "pt"})


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("tied")
    return folder, make_model(folder, tied=True)


@pytest.fixture(scope="module")
def untied_model(tmp_path_factory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("untied")
    return folder, make_model(folder)


# -- rows holding NaN or inf ------------------------------------------------------------------------


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_one_non_finite_row_in_a_tied_checkpoint(tied_model, tmp_path, value):
    """Before: one NaN row made both indicators NaN ('not informative'), the tags 'trained', exit 0."""
    src, info = tied_model
    folder = _copy(src, tmp_path / "m")
    _set_rows(folder, "model.embed_tokens.weight", {5: value})
    report = audit_tokens(folder)
    assert report.verdict == "untrained" and report.untrained_tags == ["<think>", "</think>"]
    assert all(i.informative and i.cut is not None for i in report.indicators), report.indicators
    assert [(b.matrix, b.count, b.ids) for b in report.non_finite] == [("model.embed_tokens.weight", 1, [5])]
    assert not report.ok
    # The statistics match the clean checkpoint's closely: row 5 is left out, nothing else changes.
    clean = audit_tokens(src)
    for a, b in zip(report.indicators, clean.indicators, strict=True):
        assert a.ordinary_median == pytest.approx(b.ordinary_median, rel=0.02)
        assert a.reference_median == pytest.approx(b.reference_median, rel=0.02)


def test_non_finite_rows_in_an_untied_lm_head_and_in_a_tag(untied_model, tmp_path):
    src, info = untied_model
    folder = _copy(src, tmp_path / "m")
    think, end = info["added"]
    _set_rows(folder, "lm_head.weight", {7: float("nan"), 300: float("inf")})
    _set_rows(folder, "model.embed_tokens.weight", {end: float("nan")})
    report = audit_tokens(folder)
    by_matrix = {b.matrix: b for b in report.non_finite}
    assert by_matrix["lm_head.weight"].ids == [7, 300] and by_matrix["lm_head.weight"].count == 2
    assert by_matrix["model.embed_tokens.weight"].ids == [end]
    tok = report.tags[1].tokens[0]
    assert tok.id == end and "non-finite" in tok.flags and tok.verdict == "untrained"
    assert tok.norm is None and tok.norm_ratio is None
    assert report.tags[0].tokens[0].verdict == "untrained"  # the other tag is still judged by its row
    va = audit_vocabulary(folder)
    assert set(va.flags["non-finite"]) == {7, 300, end}
    assert {7, 300, end} <= set(va.ids("untrained"))
    # fix rewrites the tags' rows (the NaN one too) and says that the other broken rows remain.
    fixed = fix_tokens(folder, tmp_path / "fixed", init="mean")
    assert sorted(r.id for r in fixed.rows) == sorted(info["added"])
    assert any("NaN or inf" in n and "7, 300" in n for n in fixed.notes), fixed.notes
    assert [b.matrix for b in fixed.after.non_finite] == ["lm_head.weight"] and not fixed.ok
    strict_loads(json.dumps(fixed.to_dict()))


def test_cli_non_finite_exit_1_and_strict_json(tokens_app, tied_model, tmp_path):
    src, _ = tied_model
    folder = _copy(src, tmp_path / "m")
    _set_rows(folder, "model.embed_tokens.weight", {5: float("nan")})
    r = runner.invoke(tokens_app, ["tokens", "audit", "--model", str(folder), "--json"])
    assert r.exit_code == 1, r.output
    data = strict_loads(r.stdout)  # before: bare NaN for medians, cuts, norm ratios
    assert data["non_finite"] == [{"matrix": "model.embed_tokens.weight", "count": 1, "ids": [5]}]
    assert data["ok"] is False and data["verdict"] == "untrained"
    # Non-finite rows alone (tags trained) still exit 1: the checkpoint is broken.
    r = runner.invoke(
        tokens_app, ["tokens", "audit", "--model", str(folder), "--tags", "<thinking>", "--json"]
    )
    assert r.exit_code == 1 and strict_loads(r.stdout)["verdict"] == "trained", r.output
    r = runner.invoke(tokens_app, ["tokens", "audit", "--model", str(folder)])
    assert "non-finite rows" in r.stdout and "NaN or inf" in r.stdout


def test_to_dict_is_strict_json_even_with_non_finite_values(tied_model):
    from vlfast.tokens.report import strict_json

    report = audit_tokens(tied_model[0])
    report.seconds = float("nan")
    report.indicators[0].cut = float("inf")
    text = json.dumps(report.to_dict(), allow_nan=False)
    assert strict_loads(text)["seconds"] is None
    assert strict_json({"a": [1.0, float("-inf"), {"b": float("nan")}], "c": "NaN"}) == {
        "a": [1.0, None, {"b": None}],
        "c": "NaN",
    }


# -- refused arguments -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tags", ""], "names no tag"),
        (["--tags", ","], "names no tag"),
        (["--tags", " "], "names no tag"),
        (["--tags", "<think>", "--tags", ""], "names no tag"),
        (["--reference-ids", "5-3"], "reversed; write 3-5"),
        (["--reference-ids", ""], "names no id"),
        (["--reference-ids", ","], "names no id"),
    ],
)
def test_cli_refuses_blank_tags_and_reversed_ranges(tokens_app, tied_model, args, message):
    """Before: blank --tags audited the defaults and 5-3 gave no reference rows, both with exit 0 or 1."""
    r = runner.invoke(tokens_app, ["tokens", "audit", "--model", str(tied_model[0]), *args])
    assert r.exit_code == 2, r.output
    assert message in " ".join(r.stderr.split()), r.stderr


def test_library_refuses_the_same(tied_model, tmp_path):
    folder = tied_model[0]
    for tags in ([""], [","], [" "], ""):
        with pytest.raises(ValueError, match="names no tag"):
            audit_tokens(folder, tags)
    with pytest.raises(ValueError, match="reversed"):
        audit_tokens(folder, reference_ids=["5-3"])
    with pytest.raises(ValueError, match="names no tag"):
        fix_tokens(folder, tmp_path / "x", [""])
    # A string is one tag list, not a list of characters.
    assert [t.tag for t in audit_tokens(folder, "<think>, </think>").tags] == ["<think>", "</think>"]


@pytest.mark.parametrize("sharded", [False, True])
def test_truncated_safetensors_is_named(tokens_app, tmp_path, sharded):
    """Before: numpy's 'mmap length is greater than file size', with no file name."""
    make_model(tmp_path / "m", sharded=sharded)
    victim = tmp_path / "m" / ("model-00002-of-00002.safetensors" if sharded else "model.safetensors")
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 1000])
    r = runner.invoke(tokens_app, ["tokens", "audit", "--model", str(tmp_path / "m")])
    assert r.exit_code == 2, r.output
    err = " ".join(r.stderr.split())
    assert str(victim) in err and "truncated" in err, err


# -- piped output keeps names, ids and verdicts whole ------------------------------------------------

LONG_TAGS = ["<think>", "</think>", "<reasoning_trace_block>", "<|im_start|>"]


def _rows(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("│")]


def test_piped_audit_table_prints_every_tag_id_and_verdict_whole(tokens_app, untied_model):
    """CliRunner's stdout is not a terminal, like a CI log or `| tee`: Rich would assume 80 columns
    and cut the table to `<thin…`, `suspe…`."""
    folder, info = untied_model
    r = runner.invoke(tokens_app, ["tokens", "audit", "--model", str(folder), "--tags", ",".join(LONG_TAGS)])
    assert r.exit_code == 1, r.output
    assert "…" not in r.stdout, r.stdout
    report = audit_tokens(folder, LONG_TAGS)
    rows = _rows(r.stdout)
    for tag in report.tags:
        # One line per token, holding the whole tag (on its first token), id, piece and verdict.
        for k, tok in enumerate(tag.tokens):
            want = [str(tok.id), repr(tok.piece), tok.verdict] + ([tag.tag] if k == 0 else [])
            assert any(all(w in line for w in want) for line in rows), (want, r.stdout)
    assert "vlfast tokens rewrite --map '<think>=<thinking>' --map '</think>=</thinking>' ..." in r.stdout


def test_piped_fix_and_rewrite_tables_print_whole(tokens_app, tmp_path):
    make_model(tmp_path / "src", sharded=True)
    out = tmp_path / "a-fairly-long-output-folder-name-for-the-fixed-checkpoint"
    r = runner.invoke(tokens_app, ["tokens", "fix", str(out), "--model", str(tmp_path / "src")])
    assert r.exit_code == 0, r.output
    assert "…" not in r.stdout and str(out) in r.stdout
    assert any("model.language_model.embed_tokens.weight, lm_head.weight" in line for line in _rows(r.stdout))

    src = tmp_path / "data-with-a-long-name-so-the-table-is-wide.jsonl"
    src.write_text(json.dumps({"text": "<think>x</think>"}) + "\n")
    regex = r"^<think>[a-z ]+</think>\s*<answer>.*?</answer>$"
    dst = tmp_path / "data-with-a-long-name-so-the-table-is-wide.thinking.jsonl"
    args = ["--map", "think=thinking", "--dataset", str(src), "--field", "text", "--out", str(dst)]
    r = runner.invoke(tokens_app, ["tokens", "rewrite", *args, "--reward-regex", regex])
    assert r.exit_code == 0, r.output
    assert "…" not in r.stdout
    rows = _rows(r.stdout)
    assert any(str(src) in line and str(dst) in line for line in rows), r.stdout
    # [a-z ] is a character class, not Rich markup: it must survive.
    assert any(regex in line and regex.replace("think>", "thinking>") in line for line in rows), r.stdout


def test_print_table_folds_instead_of_cutting_in_a_narrow_terminal():
    table = Table()
    for col in ("tag", "verdict"):
        table.add_column(col)
    table.add_row("<|object_ref_start|>", "untrained")
    buf = io.StringIO()
    print_table(table, Console(file=buf, force_terminal=True, width=16, color_system=None))
    text = buf.getvalue()
    assert "…" not in text, text
    cells = [line.split("│")[1:-1] for line in text.splitlines() if line.startswith("│")]
    assert len(cells) > 1  # folded onto several lines, not cut
    assert "".join(c[0].strip() for c in cells) == "<|object_ref_start|>", text
    assert "".join(c[1].strip() for c in cells) == "untrained", text


# -- Qwen-VL placeholder tokens ----------------------------------------------------------------------

VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n<think>\n"
)


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory) -> tuple[Path, dict, Path]:
    folder = tmp_path_factory.mktemp("vl")
    info = make_model(folder, vl_tokens=True)
    template = folder.parent / "vl_chat.jinja"
    template.write_text(VL_TEMPLATE)
    return folder, info, template


def test_placeholders_are_skipped_with_the_reason(vl_model):
    folder, info, template = vl_model
    every_special = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", *VL_SPECIAL]
    report = audit_tokens(folder, every_special)
    skipped = {s.tag: s for s in report.skipped}
    assert set(skipped) == set(VL_SPECIAL)
    assert "vision features" in skipped["<|image_pad|>"].reason and skipped["<|image_pad|>"].sources == [
        "tags"
    ]
    assert "never predicted" in skipped["<|vision_start|>"].reason
    assert "Qwen2-VL grounding" in skipped["<|box_start|>"].reason
    assert [t.tag for t in report.tags] == ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    assert report.untrained_tags == ["<think>", "</think>"]  # the expected hits, and only those
    # On request they are audited like any tag: their rows are as untrained as <think>'s.
    full = audit_tokens(folder, every_special, include_placeholders=True)
    assert full.skipped == [] and set(full.untrained_tags) == {"<think>", "</think>", *VL_SPECIAL}


def test_template_audit_skips_placeholders(tokens_app, vl_model):
    folder, info, template = vl_model
    report = audit_tokens(folder, template=template)
    assert {s.tag for s in report.skipped} == {
        "<|vision_start|>",
        "<|image_pad|>",
        "<|vision_end|>",
        "<|video_pad|>",
    }
    assert all(s.sources == ["template"] for s in report.skipped)
    assert {t.tag for t in report.tags} == {"<|im_start|>", "<|im_end|>", "<think>"}
    r = runner.invoke(tokens_app, ["tokens", "audit", "--model", str(folder), "--template", str(template)])
    assert r.exit_code == 1
    assert any(
        line.startswith("│ skipped") and "<|image_pad|> (template): image placeholder" in line
        for line in r.stdout.splitlines()
    ), r.stdout
    assert "--include-placeholders audits them too" in r.stdout
    r = runner.invoke(
        tokens_app,
        [
            "tokens",
            "audit",
            "--model",
            str(folder),
            "--template",
            str(template),
            "--include-placeholders",
            "--json",
        ],
    )
    data = strict_loads(r.stdout)
    assert data["skipped"] == [] and "<|image_pad|>" in data["untrained_tags"]


def test_fix_leaves_placeholders_alone(vl_model, tmp_path):
    folder, info, template = vl_model
    report = fix_tokens(folder, tmp_path / "out", template=template)
    assert sorted(r.id for r in report.rows) == [info["added"][0]]  # <think> only; </think> is not in it
    assert any(n.startswith("<|image_pad|> left alone") for n in report.notes), report.notes


def test_tiny_qwen3_vl_template_skips_its_vision_tokens(tiny_qwen3_vl):
    """The real layout: a Qwen3-VL checkpoint saved by transformers, its chat_template.jinja audited."""
    report = audit_tokens(tiny_qwen3_vl, template=tiny_qwen3_vl / "chat_template.jinja")
    assert {s.tag for s in report.skipped} == {
        "<|vision_start|>",
        "<|image_pad|>",
        "<|vision_end|>",
        "<|video_pad|>",
    }
    assert {t.tag for t in report.tags} == {"<|im_start|>", "<|im_end|>"}
