"""`tokens rewrite` on JSON lines changes the tags and nothing else: what the mapping does not touch comes
out byte for byte as it came in (numbers of any size, ``1e400``, key order, spacing, escapes, blank lines),
and a touched string keeps the escapes it had."""

from __future__ import annotations

import json
import random

import pytest
from typer.testing import CliRunner

from vlfast.tokens.jsonline import load_record, string_spans, strings_of

runner = CliRunner()
MAP = ["--map", "think=thinking"]
BIG = "9" * 5000


def _rewrite(tokens_app, src, out, *extra: str):
    args = ["tokens", "rewrite", *MAP, "--dataset", str(src), "--field", "text", "--out", str(out), *extra]
    return runner.invoke(tokens_app, args)


def test_numbers_the_mapping_never_touches_come_out_as_they_came(tokens_app, tmp_path):
    """Before: the 5,000-digit integer was exit 3, and ``1e400`` came out as ``Infinity`` (not JSON)."""
    src = tmp_path / "d.jsonl"
    src.write_bytes(
        f'{{"id": 1, "score": {BIG}, "text": "<think>a</think> b"}}\n'.encode()
        + b'{"id": 2, "score": 1e400, "p": 0.10000000000000001, "n": -0.0, "text": "<think>c</think>"}\n'
    )
    out = tmp_path / "o.jsonl"
    r = _rewrite(tokens_app, src, out, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["dataset"]["records"] == 2
    assert out.read_bytes() == src.read_bytes().replace(b"think>", b"thinking>")


def test_untouched_lines_and_fields_are_byte_identical(tokens_app, tmp_path):
    lines = [
        b'{"text":"<think>x</think>","z":1,"a":[1 , 2],  "u":"caf\\u00e9 \\ud83d\\ude00"}\r\n',
        b"\n",  # a blank line stays
        b'{ "b" : "no tag here", "text" : "plain \\u00e9", "a" : NaN }\n',
        b'{"text": [{"role": "user", "content": "\\u00e9 <think>q</think>"}, {"role": "x", "content": 3}],'
        b' "id": "\xc3\xa9"}\n',
        b'{"other": "<think>not the field</think>", "text": "\xc3\xa9t\xc3\xa9 <think>"}',  # no last newline
    ]
    src = tmp_path / "d.jsonl"
    src.write_bytes(b"".join(lines))
    out = tmp_path / "o.jsonl"
    r = _rewrite(tokens_app, src, out, "--json")
    assert r.exit_code == 0, r.output
    got = out.read_bytes().split(b"\n")
    want = [
        b'{"text":"<thinking>x</thinking>","z":1,"a":[1 , 2],  "u":"caf\\u00e9 \\ud83d\\ude00"}\r',
        b"",
        lines[2].rstrip(b"\n"),
        # the touched string keeps its escape; the other fields are as they were
        b'{"text": [{"role": "user", "content": "\\u00e9 <thinking>q</thinking>"}, {"role": "x", "content": 3}],'
        b' "id": "\xc3\xa9"}',
        b'{"other": "<think>not the field</think>", "text": "\xc3\xa9t\xc3\xa9 <thinking>"}',
    ]
    assert got == want
    assert json.loads(r.stdout)["dataset"]["replacements"] == {"<think>": 3, "</think>": 2}


def test_a_tag_written_with_escapes_is_found_and_the_string_stays_ascii(tokens_app, tmp_path):
    """Go's encoding/json writes ``<`` as ``\\u003c``: the tag is still the tag."""
    src = tmp_path / "d.jsonl"
    src.write_bytes(b'{"text": "\\u003cthink\\u003e caf\\u00e9", "k": 1}\n')
    out = tmp_path / "o.jsonl"
    r = _rewrite(tokens_app, src, out)
    assert r.exit_code == 0, r.output
    assert out.read_bytes() == b'{"text": "<thinking> caf\\u00e9", "k": 1}\n'


def test_a_key_written_twice_has_the_value_json_readers_take_rewritten(tokens_app, tmp_path):
    src = tmp_path / "d.jsonl"
    src.write_bytes(b'{"text": "<think>first", "text": "<think>last"}\n')
    out = tmp_path / "o.jsonl"
    assert _rewrite(tokens_app, src, out).exit_code == 0
    assert out.read_bytes() == b'{"text": "<think>first", "text": "<thinking>last"}\n'
    assert json.loads(out.read_bytes()) == {"text": "<thinking>last"}


def test_nesting_past_the_parsers_limit_is_refused_with_exit_2(tokens_app, tmp_path):
    src = tmp_path / "d.jsonl"
    src.write_text('{"text": "<think>", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    out = tmp_path / "o.jsonl"
    r = _rewrite(tokens_app, src, out)
    assert r.exit_code == 2, r.output
    assert "line 1 nests lists or objects too deeply" in " ".join(r.output.split())
    assert not out.exists()


def _random_json(rng: random.Random, depth: int = 0):
    pick = rng.randrange(8 if depth < 4 else 5)
    if pick == 0:
        return rng.choice([0, -1, 12.5, 1e-7, True, False, None])
    if pick in (1, 2, 3, 4):
        return "".join(
            rng.choice(["a", "<think>", "é", '"', "\\", "\n", "😀", " ", "\u2028"]) for _ in range(4)
        )
    if pick in (5, 6):
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["k", 'k"', "ké"]
    return {f"{rng.choice(keys)}{i}": _random_json(rng, depth + 1) for i in range(rng.randrange(4))}


@pytest.mark.parametrize("seed", range(40))
def test_the_spans_are_the_strings_json_loads_gives(seed):
    """The span walker against json.loads itself, over random records written in several styles."""
    rng = random.Random(seed)
    rec = {"a": _random_json(rng), "text": _random_json(rng), "b": _random_json(rng)}
    for kw in ({}, {"ensure_ascii": False}, {"indent": None, "separators": (",", ":")}):
        line = json.dumps(rec, **kw)
        spans = string_spans(line, "text")
        assert [text for _, _, text in spans] == list(strings_of(load_record(line)["text"]))
        assert all(json.loads(line[start:end]) == text for start, end, text in spans)
