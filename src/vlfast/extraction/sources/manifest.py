"""Manifests as extraction input: JSONL, CSV or Parquet rows with a ``path`` and optionally ``id``, ``prompt``,
``text`` and ``instruction`` (for ``embedding``: a row may be a ``text`` alone, given an ``id``).

``path`` is an image, a video, or a list of frame images forming one clip (in CSV and Parquet, a JSON list
written as text), relative to the manifest's folder (or URL's). A row that cannot become a sample is an
:class:`~vlfast.extraction.sources.sample.InputProblem` naming the file and line or row; only a wholly
unusable manifest raises (an unknown suffix, no ``path`` column, an unreadable Parquet file).

Ids mean the same in all three formats: a missing, empty, null or NaN id falls back to the path; a number
becomes its decimal text, integral floats as integers (``1.0`` -> ``"1"``: pandas stores an integer column
holding one NaN as float64); a boolean is refused; text is kept exactly (a CSV ``1.0`` stays ``"1.0"``).
A UTF-8 byte-order mark starting a CSV or JSONL file (Excel's "CSV UTF-8") is skipped.
"""

from __future__ import annotations

import codecs
import csv
import itertools
import json
import numbers
import re
from collections.abc import Iterator, Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any

from vlfast.errors import InputRefused
from vlfast.extraction.objstore import is_url
from vlfast.extraction.sources.sample import (
    MAX_ID_BYTES,
    VIDEO_SUFFIXES,
    InputProblem,
    Kind,
    Sample,
    display_path,
    is_posix_form,
    kind_of,
    posix_form,
    quoted,
    storable,
    suffix_of,
    unreadable_json,
)
from vlfast.extraction.sources.table import SampleTable, SampleTableBuilder

__all__ = ["load_manifest", "row_sample"]

# what surrogateescape (and os.fsdecode) make of a non-UTF-8 byte
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")


def _value(value: Any) -> str:
    """A wrong-typed value for a reason: its type and a short, escaped repr."""
    r = repr(value)
    return f"{type(value).__name__} {r if len(r) <= 60 else r[:56] + '...'}"


def _is_missing(value: Any) -> bool:
    """None, "", JSON null, or NaN (what Parquet and pandas write for a missing number)."""
    if value is None or (isinstance(value, str) and value == ""):
        return True
    if isinstance(value, numbers.Real):
        return value != value
    return isinstance(value, Decimal) and value.is_nan()


def _id_text(value: Any) -> tuple[str | None, str | None]:
    """(the id as text, None) for a present id, or (None, the reason it cannot be one)."""
    if isinstance(value, str):
        return value, None  # kept exactly: CSV holds text, so "1.0" there means "1.0"
    if isinstance(value, bool):  # before int: bool is an int subclass, and str(True) would be a surprise
        word = str(value).lower()
        return None, f"id is a boolean ({word}); give text or a number (in quotes if the word is the id)"
    if isinstance(value, numbers.Integral):  # numbers: numpy's int64 from a user's own rows too
        return str(int(value)), None
    if isinstance(value, (numbers.Real, Decimal)):
        if value in (float("inf"), float("-inf")):
            return str(value), None
        # pandas writes an integer column holding one NaN as float64: 1.0 means the id 1
        return (str(int(value)) if value == int(value) else str(value)), None
    return None, f"id must be text or a number, got {_value(value)}"


def _paths_field(value: Any) -> list[str] | str:
    """The paths of a path, a list of frame paths, or a JSON list written as text; else why not."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("[") and text.endswith("]"):
            # CSV and Parquet have no lists, so a frame list is written as JSON text. A name that merely
            # starts with "[" ("[2020] trip.mp4") stays a file name.
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                return (
                    f"path looks like a JSON list but is not valid JSON ({e.msg}); "
                    'write frames as ["f0.png", "f1.png"]'
                )
            except (ValueError, RecursionError) as e:
                return f"path looks like a JSON list but is {unreadable_json(e)}"
            if not isinstance(value, list):
                return f"path looks like a JSON list but is {type(value).__name__}"
        else:
            return [value]
    if isinstance(value, (list, tuple)):
        if not value:
            return "path is an empty list; give at least one frame"
        for i, v in enumerate(value):
            if not isinstance(v, str) or not v:
                return f"path list must hold only non-empty text paths; item {i} is {_value(v)}"
        return list(value)
    return f"path must be a file path (text) or a list of frame paths, got {_value(value)}"


def row_sample(row: dict[str, Any], where: str, base: Path | str | None) -> Sample | InputProblem:
    """One manifest row (or dict passed by an API user) as a sample, or the problem that stops it; relative
    paths are joined to ``base`` (None: kept as given)."""
    raw_id = row.get("id")
    given_id: str | None = None
    if not _is_missing(raw_id):
        given_id, reason = _id_text(raw_id)
        reason = reason if given_id is None else storable(given_id, (), None)
        if reason:
            return InputProblem(where, reason)
    texts: dict[str, str | None] = {}
    for name in ("prompt", "text", "instruction"):
        value = row.get(name)
        if _is_missing(value):
            value = None
        elif not isinstance(value, str):
            return InputProblem(where, f"{name} must be text, got {_value(value)}", given_id)
        texts[name] = value
    raw = row.get("path")
    if _is_missing(raw):
        raw = row.get("paths")
    if _is_missing(raw):
        return _text_row(row, where, given_id, texts)
    paths = _paths_field(raw)
    if isinstance(paths, str):
        return InputProblem(where, paths, given_id)
    if len(paths) > 1:
        for i, p in enumerate(paths):
            if suffix_of(p).lower() in VIDEO_SUFFIXES:
                return InputProblem(
                    where,
                    f"frame lists hold images; item {i} ({quoted(p)}) is a video: "
                    "give a video as a plain path",
                    given_id,
                )
    prompt = texts.pop("prompt")
    # a URL's id is the URL itself (Path would fold its "//")
    sid = given_id if given_id is not None else (paths[0] if is_url(paths[0]) else posix_form(paths[0]))
    if reason := storable(sid, paths, prompt, id_from_path=given_id is None, texts=texts):
        return InputProblem(where, reason, given_id)
    kind: Kind = "frames" if len(paths) > 1 else kind_of(paths[0])  # a one-frame list is its file's kind
    if base is not None:
        paths = [_joined(base, p) for p in paths]
    try:
        return Sample(sid, kind, tuple(paths), prompt, **texts)
    except (TypeError, ValueError) as e:  # checked above; kept so a gap here is a row problem, not a crash
        return InputProblem(where, str(e), given_id)


def _text_row(
    row: dict[str, Any], where: str, given_id: str | None, texts: dict[str, str | None]
) -> Sample | InputProblem:
    """A row without a path: a text sample (``embedding`` embeds a text alone), or the problem that stops it."""
    if not texts["text"]:
        cols = ", ".join(quoted(str(k), 40) for k in list(row)[:8]) + (", ..." if len(row) > 8 else "")
        return InputProblem(
            where,
            f"no path and no text (the row has {cols or 'no values'}); give 'path' (a file, or a list of "
            "frame files) or, for --features embedding, a non-empty 'text'",
            given_id,
        )
    if given_id is None:
        return InputProblem(where, "a text row without a path needs an 'id' (nothing else names it)")
    reason = storable(given_id, (), texts["prompt"], texts={k: texts[k] for k in ("text", "instruction")})
    if reason:
        return InputProblem(where, reason, given_id)
    return Sample(given_id, "text", (), **texts)


_JSONL_BLOCK = 65_536  # lines of a JSONL manifest checked as columns at a time
_COLUMNS = ("id", "path", "paths", "prompt", "text", "instruction")  # what a row's sample is made of


def _jsonl_rows(
    path: Path, name: str, base: Path | str | None = None
) -> Iterator[tuple[str, dict[str, Any] | InputProblem | tuple]]:
    """Each line as a dict or its problem, or a plain sample's fields (:func:`_plain_batch`)."""
    lines = _jsonl_lines(path, name)
    while block := list(itertools.islice(lines, _JSONL_BLOCK)):
        plain = None
        if base is not None and all(isinstance(row, dict) for _, row in block):
            batch = _batch_of([row for _, row in block])  # type: ignore[misc]
            plain = None if batch is None else _plain_batch(batch, base)
        yield from block if plain is None else zip((where for where, _ in block), plain)


def _batch_of(rows: list[dict[str, Any]]) -> Any:
    """JSON rows as an Arrow batch of the sample's columns, or None unless each column holds only text (or
    for ``id``, integers never a boolean) and JSON nulls."""
    import pyarrow as pa

    columns: dict[str, Any] = {}
    for key in _COLUMNS:
        values = [row.get(key) for row in rows]
        kinds = {type(v) for v in values if v is not None}
        if not kinds:
            if any(key in row for row in rows):
                columns[key] = pa.nulls(len(rows), pa.string())
            continue
        if kinds == {str}:
            kind = pa.string()
        elif kinds == {int} and key == "id":
            kind = pa.int64()
        else:
            return None
        try:
            columns[key] = pa.array(values, kind)
        except (pa.ArrowException, OverflowError, UnicodeEncodeError):  # past int64; a lone surrogate
            return None
    return pa.RecordBatch.from_pydict(columns) if "path" in columns else None


def _jsonl_lines(path: Path, name: str) -> Iterator[tuple[str, dict[str, Any] | InputProblem]]:
    # Bytes, decoded line by line: one line in another encoding is that line's problem, not the file's.
    with path.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if lineno == 1 and line.startswith(codecs.BOM_UTF8):
                line = line[len(codecs.BOM_UTF8) :]
            if line.strip():
                where = f"{name} line {lineno}"
                row = _jsonl_row(line)
                yield where, InputProblem(where, row) if isinstance(row, str) else row


def _jsonl_row(line: bytes) -> dict[str, Any] | str:
    """One line's row, or why it is not one."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return (
            f"not valid UTF-8 (byte 0x{line[e.start]:02x} at byte {e.start + 1} of the line); "
            "save the manifest as UTF-8"
        )
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        return f"not valid JSON ({e.msg} at column {e.colno}); each line must be one JSON object"
    except (ValueError, RecursionError) as e:  # valid JSON all the same: that row's problem
        return unreadable_json(e)
    if not isinstance(row, dict):
        return (
            f'a JSON {type(row).__name__} is not a row; each line must be an object like {{"path": "a.jpg"}}'
        )
    return row


def _require_path_column(name: str, columns: Sequence[str]) -> None:
    if not {"path", "paths", "text"} & set(columns):
        raise ValueError(
            f"{name} has no 'path' column (columns: {', '.join(quoted(c, 40) for c in columns) or 'none'}); "
            "a manifest needs 'path' (a file, or a JSON list of frames) or 'text', and may have 'id', "
            "'prompt' and 'instruction'"
        )


def _csv_rows(path: Path, name: str) -> Iterator[tuple[str, dict[str, Any] | InputProblem]]:
    # utf-8-sig: Excel's "CSV UTF-8" starts with a byte-order mark that would otherwise rename the first
    # column "\ufeffid". surrogateescape: a row in another encoding is that row's problem, not the file's.
    with path.open(encoding="utf-8-sig", errors="surrogateescape", newline="") as f:
        reader = csv.reader(f)
        try:
            header = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            raise InputRefused(f"{name}: the header line is not valid CSV ({e})") from None
        _require_path_column(name, header)
        # data rows, 1-based, header excluded; a quoted newline does not start a new row
        for rowno in itertools.count(1):
            where = f"{name} row {rowno}"
            try:
                record = next(reader)
            except StopIteration:
                return
            except csv.Error as e:
                yield where, InputProblem(where, f"not valid CSV ({e}); check its quotes")
                continue
            if not any(record):
                continue  # a blank line, or a row of empty cells as spreadsheets export: nothing to read
            bad = next((m for c in record for m in [_ESCAPED_BYTE.search(c)] if m), None)
            if bad is not None:
                reason = (
                    f"not valid UTF-8 (byte 0x{ord(bad.group()) - 0xDC00:02x}); save the manifest as UTF-8"
                )
            elif len(record) > len(header) and any(record[len(header) :]):
                # an unquoted comma shifts every later value into the wrong column: refuse, never guess
                reason = (
                    f"the row has {len(record)} values but the header has {len(header)} columns; "
                    "quote values that contain a comma"
                )
            else:
                yield where, dict(zip(header, record))
                continue
            yield where, InputProblem(where, reason)


_PARQUET_BATCH = 65_536  # rows of a Parquet manifest read at a time
_PLAIN_BAD = ("[", "\x00", "://", "//", "/./")  # a frame list, a NUL, a URL, a path pathlib would fold


def _plain_batch(batch: Any, base: Path | str) -> list[tuple] | None:
    """The samples of a batch in which every row is plain, as
    :meth:`~vlfast.extraction.sources.table.SampleTableBuilder.append_plain`'s fields made from its columns;
    None when any row is not (the batch then takes the row path, which gives the same samples).

    Plain: a text ``path`` on every row, in posix form, not a URL, not a JSON frame list, without NUL;
    no ``paths`` column; an ``id`` column of text (none empty) or integers, or none; ``prompt``, ``text``
    and ``instruction`` of text or all null (``tests/test_sample_table.py`` compares it with
    :func:`row_sample`)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    def is_text(col: Any) -> bool:
        return pa.types.is_string(col.type) or pa.types.is_large_string(col.type)

    names = batch.schema.names
    if "path" not in names or "paths" in names or batch.num_rows == 0:
        return None
    try:
        batch.validate(full=True)  # text that is not UTF-8: the row path reports it
    except pa.ArrowInvalid:
        return None
    path = batch.column("path")
    if not is_text(path) or path.null_count:
        return None
    bad = pc.or_(pc.equal(path, ""), pc.equal(path, "."))
    for needle in _PLAIN_BAD:
        bad = pc.or_(bad, pc.match_substring(path, needle))
    bad = pc.or_(bad, pc.starts_with(path, "./"))
    bad = pc.or_(bad, pc.or_(pc.ends_with(path, "/"), pc.ends_with(path, "/.")))
    if pc.any(bad).as_py():
        return None
    ids = path
    if "id" in names:
        ids = batch.column("id")
        if ids.null_count:
            return None
        if is_text(ids):
            if pc.any(pc.equal(ids, "")).as_py():
                return None
        elif pa.types.is_integer(ids.type):
            ids = ids.cast(pa.string())  # decimal text, as str(int) gives
        else:
            return None
    if pc.max(pc.binary_length(ids)).as_py() > MAX_ID_BYTES:
        return None
    texts: dict[str, list[str | None]] = {}
    for key in ("prompt", "text", "instruction"):
        col = batch.column(key) if key in names else pa.nulls(batch.num_rows)
        if not (is_text(col) or pa.types.is_null(col.type)):
            return None
        texts[key] = [v or None for v in col.to_pylist()]  # "" is missing, as in a row
    paths = path.to_pylist()
    # Joined to the manifest's folder as a column: each path is in posix form and not a URL (what _joined
    # checks per row), so an absolute one stays as it is and the rest take the prefix.
    if not (isinstance(base, Path) and str(base) == "."):
        prefix = f"{str(base).rstrip('/')}/"
        path = pc.if_else(pc.starts_with(path, "/"), path, pc.binary_join_element_wise(prefix, path, ""))
    return list(zip(ids.to_pylist(), map(kind_of, paths), path.to_pylist(), *texts.values()))


def _parquet_rows(
    path: Path, name: str, base: Path | str | None = None
) -> Iterator[tuple[str, dict[str, Any] | InputProblem | tuple]]:
    """Each row as a dict, or a plain sample's fields where its whole batch is plain (:func:`_plain_batch`)."""
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        columns = list(pf.schema_arrow.names)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError and others for a file it cannot read
        raise InputRefused(f"{name} cannot be read as Parquet ({e})") from None
    _require_path_column(name, columns)
    wanted = [c for c in _COLUMNS if c in columns]
    rowno = 0
    try:
        for batch in pf.iter_batches(batch_size=_PARQUET_BATCH, columns=wanted):
            plain = None if base is None else _plain_batch(batch, base)
            for row in batch.to_pylist() if plain is None else plain:
                rowno += 1
                yield f"{name} row {rowno}", row
    except Exception as e:
        raise InputRefused(f"{name} cannot be read as Parquet after row {rowno} ({e})") from None


def _joined(base: Path | str, path: str) -> str:
    """A manifest's path as a sample holds it: an absolute path or a URL as it is, else joined to ``base``,
    the manifest's folder (a local one, as ``str(base / path)``, or a URL)."""
    if path.startswith("/") or is_url(path):
        return path
    if isinstance(base, str):
        return f"{base.rstrip('/')}/{path}"
    if not is_posix_form(path):
        return str(base / path)
    folder = str(base)  # a Path's string is already in posix form
    return path if folder == "." else f"{folder.rstrip('/')}/{path}"


def load_manifest(
    path: Path, name: str | None = None, base: str | None = None
) -> tuple[SampleTable, list[InputProblem]]:
    """The samples and problems of the manifest at ``path``; ``name`` and ``base``: a URL and its folder."""
    name = name or display_path(path)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = _jsonl_rows(path, name, base or path.parent)
    elif suffix == ".csv":
        rows = _csv_rows(path, name)
    elif suffix == ".parquet":
        rows = _parquet_rows(path, name, base or path.parent)
    else:
        raise InputRefused(f"{name}: a manifest must end in .jsonl, .csv or .parquet")
    if not path.is_file():
        raise FileNotFoundError(f"manifest {name} does not exist")
    samples = SampleTableBuilder()  # columns: a manifest of millions of rows is not millions of objects
    problems: list[InputProblem] = []
    for where, row in rows:
        if isinstance(row, tuple):  # a plain row, checked with its batch (Parquet) or block (JSONL)
            samples.append_plain(*row)
            continue
        got = row if isinstance(row, InputProblem) else row_sample(row, where, base or path.parent)
        (problems if isinstance(got, InputProblem) else samples).append(got)  # type: ignore[arg-type]
    return samples.build(), problems
