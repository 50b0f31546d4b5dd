"""What to extract: samples read from a folder or a manifest, with bad rows and duplicate ids reported.

A *sample* is one image, one video file, or one clip given as a list of frame images. Ids are what the
feature store keys on, so they must be unique and storable: a folder's ids are paths relative to it, a
manifest's are its ``id`` column (or the path when the id is absent), WebDataset shards' are
``{shard}/{__key__}`` (:mod:`vlfast.extraction.sources.webdataset`). Nothing is silently dropped:

* :func:`load_inputs` is what a run reads its input with. A manifest row or folder entry that cannot become
  a sample (bad JSON, no path, a path that is not text, bytes that are not UTF-8, an id the store cannot
  hold, a dangling symlink...) becomes an :class:`InputProblem` naming the file and line or row, and the
  run goes on. Only an input that is wholly unusable raises: an unknown suffix, a CSV or Parquet file
  without a ``path`` column, an unreadable Parquet file, zero samples (:class:`EmptyInput` when there
  were no problems either).
* :func:`read_inputs`, :func:`read_manifest` and :func:`scan_folder` are the strict forms: they return only
  samples and raise ValueError naming the first problems if there are any.
* :func:`dedupe` keeps the first sample of each id; the others are :class:`Duplicate` records.

Ids mean the same in all three manifest formats: a missing, empty, null or NaN id falls back to the path;
a number becomes its decimal text, with integral floats written as integers (``1.0`` -> ``"1"``, since
pandas stores an integer column holding one NaN as float64); a boolean is refused; text is kept exactly
(a CSV ``1.0`` stays ``"1.0"``: CSV holds text). A UTF-8 byte-order mark at the start of a CSV or JSONL
file (Excel's "CSV UTF-8") is skipped. A folder scan follows a symlink to a file but never enters a
symlinked folder (as ``Path.rglob`` does), so a link loop cannot trap it.
"""

from __future__ import annotations

import codecs
import csv
import errno
import json
import numbers
import os
import re
import stat
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from vlfast.errors import InputRefused
from vlfast.extraction.objstore import is_url
from vlfast.extraction.store.format import MAX_ID_BYTES

if TYPE_CHECKING:
    from vlfast.extraction.objstore import RemoteFile
    from vlfast.extraction.sources.webdataset import TarMember

__all__ = [
    "IMAGE_SUFFIXES",
    "MANIFEST_SUFFIXES",
    "MAX_ID_BYTES",
    "VIDEO_SUFFIXES",
    "Duplicate",
    "EmptyInput",
    "InputProblem",
    "Sample",
    "dedupe",
    "load_inputs",
    "read_inputs",
    "read_manifest",
    "scan_folder",
]

IMAGE_SUFFIXES = frozenset(
    {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm", ".pgm", ".jfif"}
)
VIDEO_SUFFIXES = frozenset({".mp4", ".mkv", ".webm", ".avi", ".mov", ".m4v", ".mpg", ".mpeg", ".ts", ".flv"})
MANIFEST_SUFFIXES = frozenset({".jsonl", ".csv", ".parquet"})

Kind = Literal["image", "video", "frames"]

_SHOWN_PROBLEMS = 5  # how many problems a strict reader's error message lists
_ESCAPED_BYTE = re.compile(
    "[\udc80-\udcff]"
)  # what surrogateescape (and os.fsdecode) make of a non-UTF-8 byte
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Sample:
    """One unit of extraction. ``paths`` holds one file, or the frames of a clip in order.

    For a member of a WebDataset tar shard, ``member`` says where its bytes are and ``paths`` holds its
    display name ``{shard}/{member name}`` (see :mod:`vlfast.extraction.sources.webdataset`). For a URL,
    ``member`` is a :class:`~vlfast.extraction.objstore.RemoteFile` and ``paths`` holds the URL."""

    id: str
    kind: Kind
    paths: tuple[str, ...]
    prompt: str | None = None
    member: TarMember | RemoteFile | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise InputRefused(f"sample id must be a non-empty string, got {self.id!r}")
        if self.kind not in ("image", "video", "frames"):
            raise InputRefused(f"sample {self.id!r}: kind must be image, video or frames, got {self.kind!r}")
        if not self.paths or not all(isinstance(p, str) and p for p in self.paths):
            raise InputRefused(f"sample {self.id!r}: paths must be non-empty strings, got {self.paths!r}")
        if self.kind != "frames" and len(self.paths) != 1:
            raise InputRefused(
                f"sample {self.id!r}: a {self.kind} has exactly one path, got {len(self.paths)}"
            )
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise InputRefused(f"sample {self.id!r}: prompt must be a string or None")
        if self.member is not None and self.kind == "frames":
            raise InputRefused(
                f"sample {self.id!r}: a tar member or URL is one image or video, not a frame list"
            )

    @property
    def source(self) -> str:
        """The input as a user would name it in an error report."""
        return self.paths[0] if len(self.paths) == 1 else f"{self.paths[0]} (+{len(self.paths) - 1} frames)"


@dataclass(frozen=True)
class InputProblem:
    """An input row or folder entry that cannot become a sample; recorded in OUT/errors, the run goes on."""

    where: str  # the file and line/row ("clips.jsonl line 7", "clips.csv row 3"), or a folder entry's path
    reason: str  # plain words saying what is wrong and what to do
    id: str | None = None  # the row's id when it is valid text, else None


@dataclass(frozen=True)
class Duplicate:
    """A row whose id was already taken by an earlier row (which is the one extracted)."""

    id: str
    source: str
    first_source: str

    @property
    def reason(self) -> str:
        return f"duplicate id: already given to {self.first_source}; this row is skipped"


class EmptyInput(InputRefused):
    """A folder or manifest that holds no sample and no bad row: most likely the wrong input was named."""


def _suffix_list(suffixes: Iterable[str]) -> str:
    return " ".join(sorted(suffixes))


_SUPPORTED = (
    f"images: {_suffix_list(IMAGE_SUFFIXES)}; videos: {_suffix_list(VIDEO_SUFFIXES)}; "
    f"manifests: {_suffix_list(MANIFEST_SUFFIXES)} with a 'path' column; "
    "WebDataset: .tar shards or a quoted pattern like 'shards/{000000..000099}.tar'"
)


def _kind_of(path: str) -> Kind:
    return "video" if Path(path).suffix.lower() in VIDEO_SUFFIXES else "image"


def _shown(text: str, limit: int = 80) -> str:
    """``text`` safe to print and store: escapes (a non-UTF-8 byte shows as \\udcff), cut to ``limit``."""
    r = repr(text)
    return r if len(r) <= limit else r[: limit - 4] + "...'"


def _value(value: Any) -> str:
    """A wrong-typed value for a reason: its type and a short, escaped repr."""
    r = repr(value)
    return f"{type(value).__name__} {r if len(r) <= 60 else r[:56] + '...'}"


def _where(path: str | os.PathLike) -> str:
    # A path from the file system may hold non-UTF-8 bytes (as surrogates): show them as \xff so the
    # record itself can always be written.
    text = os.fsdecode(path)
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate that no byte made: show it escaped
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return raw.decode("utf-8", "backslashreplace")


def _text_problem(what: str, text: str) -> str | None:
    """Why ``text`` cannot be stored as UTF-8, or None."""
    m = _SURROGATE.search(text)
    if m is None:
        return None
    ch = ord(m.group())
    if 0xDC80 <= ch <= 0xDCFF:  # a byte that did not decode, escaped by surrogateescape or os.fsdecode
        byte = ch - 0xDC00
        return f"{what} holds bytes that are not valid UTF-8 (0x{byte:02x}); rename it or save it as UTF-8"
    return (
        f"{what} holds a lone surrogate (\\u{ch:04x}), which is not valid Unicode text and cannot be stored"
    )


def _storable(
    sample_id: str, paths: Sequence[str], prompt: str | None, *, id_from_path: bool = False
) -> str | None:
    """Why a sample with these fields could not be stored or loaded, or None. Every input kind uses this.

    The store writes ids as UTF-8 into Parquet, JSON and shard headers, and the loaders hand paths to the OS,
    so a lone surrogate (valid JSON ``"\\ud800"``, or a non-UTF-8 byte) or a NUL would crash far from the row.
    """
    what = "id (taken from the path)" if id_from_path else "id"
    reason = _text_problem(what, sample_id)
    if reason:
        return reason
    n = len(sample_id.encode("utf-8"))
    if n > MAX_ID_BYTES:
        return f"{what} is {n} bytes in UTF-8, longer than the {MAX_ID_BYTES}-byte limit; give a shorter id"
    for p in paths:
        reason = _text_problem(f"path {_shown(p)}", p)
        if reason:
            return reason
        if "\x00" in p:
            return f"path {_shown(p)} holds a NUL character, which no file name can hold"
    if prompt is not None:
        return _text_problem("prompt", prompt)
    return None


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
    """The paths of a path, a list of frame paths, or a JSON list written as text; else the reason why not."""
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


def _row_sample(row: dict[str, Any], where: str, base: Path | str | None) -> Sample | InputProblem:
    """One manifest row (or dict passed by an API user) as a sample, or the problem that stops it."""
    raw_id = row.get("id")
    given_id: str | None = None
    if not _is_missing(raw_id):
        got, reason = _id_text(raw_id)
        if got is None:
            return InputProblem(where, reason or "")
        reason = _storable(got, (), None)
        if reason:
            return InputProblem(where, reason)
        given_id = got
    raw = row.get("path")
    if _is_missing(raw):
        raw = row.get("paths")
    if _is_missing(raw):
        cols = ", ".join(_shown(str(k), 40) for k in list(row)[:8]) + (", ..." if len(row) > 8 else "")
        return InputProblem(
            where,
            f"no path (the row has {cols or 'no values'}); give 'path': a file, or a list of frame files",
            given_id,
        )
    got_paths = _paths_field(raw)
    if isinstance(got_paths, str):
        return InputProblem(where, got_paths, given_id)
    paths = got_paths
    if len(paths) > 1:
        for i, p in enumerate(paths):
            if Path(p).suffix.lower() in VIDEO_SUFFIXES:
                return InputProblem(
                    where,
                    f"frame lists hold images; item {i} ({_shown(p)}) is a video: "
                    "give a video as a plain path",
                    given_id,
                )
    prompt = row.get("prompt")
    if _is_missing(prompt):
        prompt = None
    elif not isinstance(prompt, str):
        return InputProblem(where, f"prompt must be text, got {_value(prompt)}", given_id)
    # a URL's id is the URL itself (Path would fold its "//")
    sid = given_id if given_id is not None else (paths[0] if is_url(paths[0]) else Path(paths[0]).as_posix())
    reason = _storable(sid, paths, prompt, id_from_path=given_id is None)
    if reason:
        return InputProblem(where, reason, given_id)
    kind: Kind = "frames" if len(paths) > 1 else _kind_of(paths[0])  # a one-frame list is its file's kind
    if base is not None:
        paths = [p if is_url(p) or Path(p).is_absolute() else _joined(base, p) for p in paths]
    try:
        return Sample(sid, kind, tuple(paths), prompt)
    except (TypeError, ValueError) as e:  # checked above; kept so a gap here is a row problem, not a crash
        return InputProblem(where, str(e), given_id)


def _jsonl_rows(path: Path, name: str) -> Iterator[tuple[str, dict[str, Any] | InputProblem]]:
    # Bytes, decoded line by line: one line in another encoding is that line's problem, not the file's.
    with path.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            where = f"{name} line {lineno}"
            if lineno == 1 and line.startswith(codecs.BOM_UTF8):
                line = line[len(codecs.BOM_UTF8) :]
            if not line.strip():
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                reason = (
                    f"not valid UTF-8 (byte 0x{line[e.start]:02x} at byte {e.start + 1} of the line); "
                    "save the manifest as UTF-8"
                )
                yield where, InputProblem(where, reason)
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                reason = f"not valid JSON ({e.msg} at column {e.colno}); each line must be one JSON object"
                yield where, InputProblem(where, reason)
                continue
            if not isinstance(row, dict):
                kind = type(row).__name__
                reason = f'a JSON {kind} is not a row; each line must be an object like {{"path": "a.jpg"}}'
                yield where, InputProblem(where, reason)
                continue
            yield where, row


def _no_path_column(name: str, columns: Sequence[str]) -> ValueError:
    return ValueError(
        f"{name} has no 'path' column (columns: {', '.join(_shown(c, 40) for c in columns) or 'none'}); "
        "a manifest needs 'path' (a file, or a JSON list of frames) and may have 'id' and 'prompt'"
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
        if "path" not in header and "paths" not in header:
            raise _no_path_column(name, header)
        rowno = 0  # data rows, 1-based, header excluded; a quoted newline does not start a new row
        while True:
            try:
                record = next(reader)
            except StopIteration:
                return
            except csv.Error as e:
                rowno += 1
                where = f"{name} row {rowno}"
                yield where, InputProblem(where, f"not valid CSV ({e}); check its quotes")
                continue
            rowno += 1
            where = f"{name} row {rowno}"
            if not any(record):
                continue  # a blank line, or a row of empty cells as spreadsheets export: nothing to read
            bad = next((m for c in record for m in [_ESCAPED_BYTE.search(c)] if m), None)
            if bad is not None:
                reason = (
                    f"not valid UTF-8 (byte 0x{ord(bad.group()) - 0xDC00:02x}); save the manifest as UTF-8"
                )
                yield where, InputProblem(where, reason)
                continue
            if len(record) > len(header) and any(record[len(header) :]):
                # an unquoted comma shifts every later value into the wrong column: refuse, never guess
                reason = (
                    f"the row has {len(record)} values but the header has {len(header)} columns; "
                    "quote values that contain a comma"
                )
                yield where, InputProblem(where, reason)
                continue
            yield where, dict(zip(header, record))


def _parquet_rows(path: Path, name: str) -> Iterator[tuple[str, dict[str, Any] | InputProblem]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        columns = list(pf.schema_arrow.names)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError and others for a file it cannot read
        raise InputRefused(f"{name} cannot be read as Parquet ({e})") from None
    if "path" not in columns and "paths" not in columns:
        raise _no_path_column(name, columns)
    wanted = [c for c in ("id", "path", "paths", "prompt") if c in columns]
    rowno = 0
    try:
        for batch in pf.iter_batches(columns=wanted):  # batches: a large manifest is not read whole
            for row in batch.to_pylist():
                rowno += 1
                yield f"{name} row {rowno}", row
    except Exception as e:
        raise InputRefused(f"{name} cannot be read as Parquet after row {rowno} ({e})") from None


def _joined(base: Path | str, path: str) -> str:
    """``path`` relative to a manifest's folder: a local folder, or a URL (a manifest read through fsspec)."""
    return f"{base.rstrip('/')}/{path}" if isinstance(base, str) else str(base / path)


def _read_manifest(
    path: Path, name: str | None = None, base: str | None = None
) -> tuple[list[Sample], list[InputProblem]]:
    """``name`` and ``base`` stand in for a local copy of a manifest read from a URL."""
    name = name or _where(path)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = _jsonl_rows(path, name)
    elif suffix == ".csv":
        rows = _csv_rows(path, name)
    elif suffix == ".parquet":
        rows = _parquet_rows(path, name)
    else:
        raise InputRefused(f"{name}: a manifest must end in .jsonl, .csv or .parquet")
    if not path.is_file():
        raise FileNotFoundError(f"manifest {name} does not exist")
    samples: list[Sample] = []
    problems: list[InputProblem] = []
    for where, row in rows:
        got = row if isinstance(row, InputProblem) else _row_sample(row, where, base or path.parent)
        (problems if isinstance(got, InputProblem) else samples).append(got)  # type: ignore[arg-type]
    return samples, problems


def _scan_folder(root: Path) -> tuple[list[Sample], list[InputProblem]]:
    if not root.is_dir():
        raise FileNotFoundError(f"input folder {_where(root)} does not exist")
    found: list[tuple[tuple[str, ...], Sample | InputProblem]] = []

    def unreadable(e: OSError) -> None:
        found.append(
            (
                Path(e.filename).relative_to(root).parts if e.filename else (),
                InputProblem(
                    _where(e.filename or root), f"folder cannot be read ({e.strerror}); its files are skipped"
                ),
            )
        )

    # os.walk without followlinks lists a symlinked folder but never enters it, as Path.rglob does: a link
    # loop cannot trap the scan, and a folder linked twice is not extracted twice.
    for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]  # hidden folders are skipped whole
        for fname in filenames:
            suffix = os.path.splitext(fname)[1].lower()
            if fname.startswith(".") or (suffix not in IMAGE_SUFFIXES and suffix not in VIDEO_SUFFIXES):
                continue  # a folder often holds captions or metadata beside the media
            path = Path(dirpath, fname)
            rel = path.relative_to(root)
            sid = rel.as_posix()
            key = rel.parts
            reason: str | None = None
            try:
                mode = os.stat(path).st_mode  # follows a symlink: a link to a file is that file
                if not stat.S_ISREG(mode):
                    reason = "not a regular file (a pipe, socket or device); give the media file itself"
            except OSError as e:
                if e.errno == errno.ELOOP:
                    reason = "symlink loop: the link never reaches a file; fix or remove it"
                elif isinstance(e, FileNotFoundError) and path.is_symlink():
                    target = _where(os.readlink(path))
                    reason = (
                        f"dangling symlink -> {target}: the target does not exist; fix or remove the link"
                    )
                else:
                    reason = f"cannot be read ({e.strerror})"
            # Only the id is checked: a path from the OS opens as it is, even with non-UTF-8 bytes in it,
            # but the id (a name under root holding such bytes) must be stored as UTF-8.
            id_reason = _storable(sid, (), None)
            reason = reason or id_reason
            if reason is not None:
                shown_id = sid if id_reason is None else None
                found.append((key, InputProblem(_where(path), reason, shown_id)))
            else:
                found.append((key, Sample(sid, _kind_of(fname), (str(path),))))
    found.sort(key=lambda kv: kv[0])  # the order Path sorting gives: by path components
    samples = [x for _, x in found if isinstance(x, Sample)]
    problems = [x for _, x in found if isinstance(x, InputProblem)]
    return samples, problems


def _required(kind: str, name: str, samples: list[Sample], problems: list[InputProblem]) -> None:
    """Raise when a folder or manifest gave nothing to extract: the wrong input, not a run with gaps."""
    if samples:
        return
    if not problems:
        if kind == "folder":
            raise EmptyInput(
                f"input folder {name} holds no image or video file (hidden files are skipped and symlinked "
                f"folders are not entered); supported: {_SUPPORTED}"
            )
        if kind == "WebDataset shards":
            raise EmptyInput(
                f"WebDataset shards {name} hold no image or video member; supported: {_SUPPORTED}"
            )
        raise EmptyInput(f"manifest {name} has no rows; supported: {_SUPPORTED}")
    raise InputRefused(f"{kind} {name} has no usable sample: {_problem_list(problems)}")


def _problem_list(problems: Sequence[InputProblem]) -> str:
    shown = "; ".join(f"{p.where}: {p.reason}" for p in problems[:_SHOWN_PROBLEMS])
    more = len(problems) - _SHOWN_PROBLEMS
    return f"{len(problems)} problem(s): {shown}" + (f"; and {more} more" if more > 0 else "")


def _strict(name: str, samples: list[Sample], problems: list[InputProblem]) -> list[Sample]:
    if problems:
        raise InputRefused(f"{name}: {_problem_list(problems)} (load_inputs records these and goes on)")
    return samples


def _load_list(items: Sequence[Any]) -> tuple[list[Sample], list[InputProblem]]:
    samples: list[Sample] = []
    problems: list[InputProblem] = []
    for i, item in enumerate(items):
        where = f"inputs[{i}]"
        if isinstance(item, Sample):
            reason = _storable(item.id, item.paths, item.prompt)
            if reason:
                ok_id = item.id if _storable(item.id, (), None) is None else None
                problems.append(InputProblem(where, reason, ok_id))
            else:
                samples.append(item)
        elif isinstance(item, dict):
            got = _row_sample(item, where, None)  # paths as given: there is no manifest folder
            (problems if isinstance(got, InputProblem) else samples).append(got)  # type: ignore[arg-type]
        else:
            raise InputRefused(
                f"inputs must be a path, or a list of Sample or dict rows; got {type(item).__name__}"
            )
    return samples, problems


def _with_remote(
    got: tuple[list[Sample], list[InputProblem]], storage_options: dict[str, Any] | None
) -> tuple[list[Sample], list[InputProblem]]:
    """Samples whose path is a URL get the :class:`RemoteFile` the workers open (fsspec only then)."""
    samples, problems = got
    if not any(is_url(p) for s in samples for p in s.paths):
        return samples, problems
    from vlfast.extraction.objstore import attach

    samples, more = attach(samples, storage_options)
    return samples, problems + more


def load_inputs(
    source: str | os.PathLike | Sequence[Sample | dict],
    storage_options: dict[str, Any] | None = None,
) -> tuple[list[Sample], list[InputProblem]]:
    """The samples of a folder, a manifest, a media file, WebDataset tar shards (a ``.tar`` path or a brace
    pattern, see :mod:`vlfast.extraction.sources.webdataset`), or a list of samples or dict rows, and the problems.

    A row or entry that cannot become a sample is an :class:`InputProblem` (where, reason, id) and the rest
    go on. A list passed by an API user is treated alike: a :class:`Sample` whose id or paths cannot be
    stored (lone surrogate, NUL in a path, id over :data:`MAX_ID_BYTES`) or a bad dict row is a problem at
    ``inputs[i]``; an empty list is allowed and gives nothing. A folder or manifest giving no sample raises
    :class:`EmptyInput` if it had no problems either, else ValueError listing the first problems.
    Relative manifest paths resolve against the manifest's folder; missing files are not checked here (they
    fail at load time and are recorded). ``source`` and manifest paths may be fsspec URLs, opened with
    ``storage_options`` (see :mod:`vlfast.extraction.objstore`).
    """
    if not isinstance(source, (str, os.PathLike)):
        if isinstance(source, (bytes, bytearray)) or not isinstance(source, Sequence):
            raise InputRefused(
                f"inputs must be a path, or a list of Sample or dict rows; got {type(source).__name__}"
            )
        return _with_remote(_load_list(source), storage_options)
    if is_url(source):
        from vlfast.extraction.objstore import load_url

        return load_url(source, storage_options)  # type: ignore[arg-type]
    path = Path(source)
    name = _where(path)
    if path.is_dir():
        samples, problems = _scan_folder(path)
        _required("folder", name, samples, problems)
        return samples, problems
    from vlfast.extraction.sources.webdataset import is_shard_input, load_shards

    if is_shard_input(source):
        samples, problems = load_shards(source)
        _required("WebDataset shards", name, samples, problems)
        return samples, problems
    if path.suffix.lower() in MANIFEST_SUFFIXES:
        samples, problems = _with_remote(_read_manifest(path), storage_options)
        _required("manifest", name, samples, problems)
        return samples, problems
    if path.is_file() and (path.suffix.lower() in IMAGE_SUFFIXES | VIDEO_SUFFIXES):
        reason = _storable(path.name, (), None)  # as in a folder scan: the path opens as the OS gave it
        if reason:
            raise InputRefused(f"input {name}: {reason}")
        return [Sample(path.name, _kind_of(path.name), (str(path),))], []
    raise FileNotFoundError(
        f"input {name} is neither a folder, a manifest nor an image or video file; {_SUPPORTED}"
    )


def scan_folder(root: str | Path) -> list[Sample]:
    """Every image and video under ``root`` (recursive, sorted by path, hidden files and folders skipped).

    Ids are paths relative to ``root``. Files with other suffixes are ignored: a folder often holds captions
    or metadata beside the media. A symlink to a file is that file (its id is the link's name). A symlinked
    folder is not entered (as :meth:`Path.rglob` does), so a link loop cannot trap the scan and nothing is
    extracted twice; link files, or list them in a manifest. A media-named dangling symlink, symlink loop,
    unreadable folder or non-UTF-8 name is a problem. Strict: raises ValueError naming the first problems,
    and :class:`EmptyInput` when there is nothing; :func:`load_inputs` returns the problems instead.
    """
    root = Path(root)
    samples, problems = _scan_folder(root)
    _required("folder", _where(root), samples, problems)
    return _strict(f"input folder {_where(root)}", samples, problems)


def read_manifest(path: str | Path) -> list[Sample]:
    """Samples from a JSONL, CSV or Parquet manifest with columns ``path`` and optionally ``id``, ``prompt``.

    ``path`` is an image, a video, or a list of frame images forming one clip (in CSV and Parquet, a JSON
    list written as text). Relative paths are resolved against the manifest's folder. Strict: raises
    ValueError naming the first bad rows; :func:`load_inputs` returns them as problems instead.
    """
    path = Path(path)
    samples, problems = _read_manifest(path)
    _required("manifest", _where(path), samples, problems)
    return _strict(f"manifest {_where(path)}", samples, problems)


def read_inputs(source: str | os.PathLike | Sequence[Sample | dict]) -> list[Sample]:
    """A folder, a manifest file, a single media file, or samples already built; raises if any row is bad.

    The strict form of :func:`load_inputs`: a ValueError names the first problems, so nothing is dropped.
    """
    samples, problems = load_inputs(source)
    name = "inputs" if not isinstance(source, (str, os.PathLike)) else f"input {_where(source)}"
    return _strict(name, samples, problems)


def dedupe(samples: Iterable[Sample]) -> tuple[list[Sample], list[Duplicate]]:
    """Keep the first sample of each id; the rest become :class:`Duplicate` records (in input order)."""
    first: dict[str, Sample] = {}
    dups: list[Duplicate] = []
    for s in samples:
        if s.id in first:
            dups.append(Duplicate(s.id, s.source, first[s.id].source))
        else:
            first[s.id] = s
    return list(first.values()), dups
