"""One JSON-lines record read for an edit in place: numbers kept as written (5,000 digits, ``1e400``), and
the string values under one top-level key located as spans of the line, so a rewrite replaces those spans
and leaves every other byte as it was.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from json.decoder import scanstring
from typing import Any

__all__ = ["Verbatim", "load_record", "string_spans", "strings_of"]

_WS = re.compile(r"[ \t\n\r]*")
# json.loads' other values; its non-standard constants first ("-Infinity" starts like a number).
_SCALAR = re.compile(r"NaN|-?Infinity|true|false|null|-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?")


class Verbatim:
    """A number (or ``NaN``/``Infinity``) as the text it was written as, never converted; not a ``str``."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Verbatim) and other.text == self.text

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Verbatim({self.text!r})"


def load_record(line: str) -> Any:
    """``json.loads(line)`` with every number and constant kept as :class:`Verbatim`; raises what json
    raises for text that is not JSON, and RecursionError past the parser's nesting limit."""
    return json.loads(line, parse_int=Verbatim, parse_float=Verbatim, parse_constant=Verbatim)


def strings_of(value: Any) -> Iterator[str]:
    """The strings ``value`` holds as values (a dict's keys are names, not text), depth first, in order."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            yield v
        elif isinstance(v, list):
            stack.extend(reversed(v))
        elif isinstance(v, dict):
            stack.extend(reversed(list(v.values())))


def _ws(s: str, i: int) -> int:
    return _WS.match(s, i).end()  # type: ignore[union-attr]  # matches the empty string at worst


def _after_key(s: str, i: int) -> tuple[str, int]:
    """The object key starting at ``s[i]`` (a quote) and where the value after its colon starts."""
    key, i = scanstring(s, i + 1)
    i = _ws(s, i)
    if s[i] != ":":
        raise ValueError(f"expected ':' at {i}")
    return key, _ws(s, i + 1)


def _value(s: str, i: int, spans: list[tuple[int, int, str]] | None) -> int:
    """Where the JSON value at ``s[i]`` ends; its string values (not keys) go into ``spans`` as (start, end,
    decoded text), ``s[start:end]`` the quoted literal. No recursion: as deep as json.loads reads."""
    stack: list[str] = []
    while True:
        c = s[i]
        if c == '"':
            text, end = scanstring(s, i + 1)
            if spans is not None:
                spans.append((i, end, text))
            i = end
        elif c in "[{":
            i = _ws(s, i + 1)
            if s[i] not in "]}":
                stack.append(c)
                if c == "{":
                    _, i = _after_key(s, i)
                continue
            i += 1  # an empty list or object: a whole value
        else:
            m = _SCALAR.match(s, i)
            if m is None:
                raise ValueError(f"no JSON value at {i}")
            i = m.end()
        while True:  # a value ended at i: the next item of its container, or the container's end
            if not stack:
                return i
            i = _ws(s, i)
            if s[i] == ",":
                i = _ws(s, i + 1)
                if stack[-1] == "{":
                    _, i = _after_key(s, i)
                break
            stack.pop()  # "]" or "}"
            i += 1


def string_spans(line: str, key: str) -> list[tuple[int, int, str]]:
    """The string values under top-level ``key`` of the JSON object ``line`` (one json.loads accepted), as
    (start, end, text) with ``line[start:end]`` the literal. Under a key written twice, the last one's: the
    value json.loads (and so every reader in Python) takes."""
    i = _ws(line, 0)
    if line[i] != "{":
        raise ValueError("not a JSON object")
    i = _ws(line, i + 1)
    found: list[tuple[int, int, str]] = []
    while line[i] != "}":
        name, i = _after_key(line, i)
        spans: list[tuple[int, int, str]] | None = [] if name == key else None
        i = _ws(line, _value(line, i, spans))
        if spans is not None:
            found = spans
        if line[i] == ",":
            i = _ws(line, i + 1)
    return found
