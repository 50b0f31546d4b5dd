"""The extraction folder's format: names, schema, run file, index parts and error records, and how to read them.

Writer, reader and checks all go through these functions; the format itself is specified in docs/format.md
("On-disk layout", "Checksums: what covers what").
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import re
import struct
import sys
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

from vlfast.errors import InputRefused, VlfastError
from vlfast.extraction.ids import check_id as check_id  # re-exported: the writer imports it from here
from vlfast.extraction.objstore import TRANSIENT_PREFIX as TRANSIENT_PREFIX  # re-exported for the store
from vlfast.extraction.objstore import is_local_fs, is_url, read_whole, url_path

FORMAT_VERSION = 4  # the one format; an OUT of an earlier development format is refused (OldFormat)
RUN_FILE = "run.json"
SHARD_DIR = "shards"
INDEX_DIR = "index"
ERROR_DIR = "errors"
LOCK_DIR = "locks"
QUARANTINE_DIR = "quarantine"
LISTING_DIR = "listings"  # WebDataset shard listings kept for later runs (vlfast.extraction.sources.kept)
CHECK_FILE = "checked.json"  # parts whose shards passed a full check, with the shards' stamps then
FACTS_FILE = "facts.json"  # what transformers answered about the model, and under what (store.facts)
RESUME_CHECKS = ("full", "quick")  # what a resume checks of what OUT holds (--resume-check)

SHARD_RE = re.compile(r"^shard-r(\d{5})-(\d{6})\.safetensors$")
# The 16 hex digits are the xxh3-64 of the part file itself.
PART_RE = re.compile(r"^part-r(\d{5})-(\d{6})-([0-9a-f]{16})\.parquet$")
# A consolidated part (compaction): the rows of several parts of one rank, sequence numbers first..last.
COMPACT_RE = re.compile(r"^part-r(\d{5})-(\d{6})-(\d{6})-([0-9a-f]{16})\.parquet$")
TMP_RE = re.compile(r"^\.tmp-r(\d{5})-")
# errors-r{rank}.jsonl locally; errors-r{rank}-{session}.jsonl on object storage, which cannot append.
ERRORS_RE = re.compile(r"^errors-r(\d{5})(?:-[0-9A-Za-z]+)?\.jsonl$")

# Parquet key-value metadata of every index part.
META_FORMAT = b"vlfast.format_version"
META_CONFIG = b"vlfast.config"  # canonical JSON of the run configuration without its volatile keys
META_CONFIG_HASH = b"vlfast.config_hash"  # sha256 of META_CONFIG
META_SHARD_BYTES = b"vlfast.shard_bytes"  # size of the shard file
META_SHARD_HEADER = b"vlfast.shard_header_xxh3"  # xxh3-64 of the shard's 8-byte length + JSON header
# Consolidated parts instead of the two keys above: every shard their rows point at, and the parts
# they replace (a reader ignores those while both exist: a crash between the commit and the deletions).
META_SHARDS = b"vlfast.shards"  # canonical JSON {"shards/NAME": [size, header xxh3]}
META_SUPERSEDES = b"vlfast.supersedes"  # canonical JSON list of part names, sorted
# Every id of the part is owned (ids.owner_rank) by the rank its name carries when the job has this many
# ranks, so other ranks of such a job need not read it. Absent otherwise (a FeatureStore user's own split).
META_OWNED_UNDER = b"vlfast.owned_under_world_size"

# torch's dtype name (as the index stores it) -> safetensors' header code: what a shard can hold.
DTYPES: dict[str, str] = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
DTYPE_BY_CODE: dict[str, str] = {code: name for name, code in DTYPES.items()}
# What extraction may convert floating features to before storing them (``store_dtype``, ``--store-dtype``).
STORE_DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32")


DUPLICATE_KIND = "duplicate"
INPUT_KIND = "input"  # a manifest row or folder entry that is not a sample; never makes an id done
ERROR_KIND = "error"  # the sample itself cannot be extracted: its id is done
# Reading from storage failed after the client's retries (a reset, a 5xx, a timeout): says nothing about the
# sample, whose id is not done; the next run tries again.
TRANSIENT_KIND = "transient"
FAILURE_KINDS = (ERROR_KIND, TRANSIENT_KIND)  # what a sample's attempt can end as; the latest one counts


class DamagedFile(InputRefused):
    """A file of the extraction folder fails its integrity check; the message names it and what to do."""


class OutputInUse(VlfastError, RuntimeError):
    """Another live process holds the lock of the rank this store would write."""


class OutputNotWritable(VlfastError, PermissionError):
    """OUT cannot be written (read-only filesystem or permissions)."""


class OldFormat(InputRefused):
    """OUT was written by an earlier development format of vlfast (vlfast reads one, :data:`FORMAT_VERSION`)."""

    def __init__(self, out: Any, version: Any, wrote: Any = None) -> None:
        by = f" {wrote}" if isinstance(wrote, str) else ""
        super().__init__(
            f"{out} was written by development format {version} of vlfast{by}, and this vlfast reads format "
            f"{FORMAT_VERSION} only: re-run into a new folder, or read it with the vlfast that wrote it"
        )


def check_version(out: Any, version: Any, wrote: Any = None) -> None:
    """Refuse an OUT whose run.json or index part says another format than :data:`FORMAT_VERSION`."""
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise InputRefused(
            f"{out} was written by a newer vlfast (format {version} > {FORMAT_VERSION}); upgrade vlfast"
        )
    if version != FORMAT_VERSION:
        raise OldFormat(out, version, wrote)


class OutputFull(OSError):
    """OUT's disk (or, for object storage, the local staging folder) is full; what was committed is intact."""


# ------------------------------------------------------------------------------------------ locations


def _forget_fsspec_loop_in_child() -> None:
    """fsspec before 2025 kept the parent's event loop in a forked child, where no thread runs it: every call
    there waited forever. Never imports fsspec: a run that has not used it has nothing to forget."""
    asyn = sys.modules.get("fsspec.asyn")
    if asyn is not None:
        asyn.reset_lock()  # the loop, its thread and its lock: created anew on the child's first call


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_fsspec_loop_in_child)


def is_local(out: Any) -> bool:
    """Whether ``out`` is local, decided by its filesystem, never by class: universal_pathlib 0.2's
    ``UPath("s3://...")`` is a ``pathlib.Path``."""
    fs = getattr(out, "fs", None)
    if fs is not None:
        return is_local_fs(fs)
    return isinstance(out, Path)


def resolve_out(out: Any, storage_options: dict[str, Any] | None = None) -> Path:
    """OUT as a path object: a ``pathlib.Path`` for a local folder (``file://`` URLs included), else a
    ``upath.UPath`` opened with ``storage_options``. A path object is returned as it is."""
    if isinstance(out, Path) or hasattr(out, "fs"):  # a local path, or already a UPath
        return out
    text = os.fspath(out)
    return url_path(text, storage_options) if is_url(text) else Path(text)


def list_names(folder: Path) -> list[str]:
    """Names of the entries in ``folder`` ([] if it does not exist), never from fsspec's listings cache:
    another rank may have committed since."""
    if is_local(folder):
        return [p.name for p in folder.iterdir()] if folder.is_dir() else []
    fs = folder.fs
    fs.invalidate_cache(folder.path)
    try:
        entries = fs.ls(folder.path, detail=False)
    except FileNotFoundError:
        return []
    return [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]


# ------------------------------------------------------------------------------------------ checksums


def xxh3(data: Any) -> str:
    """xxh3-64 of a bytes-like object, as 16 hex digits (~15 GB/s on this project's CPU)."""
    import xxhash

    return xxhash.xxh3_64_hexdigest(data)


def tensor_xxh3(t: Any) -> str:
    """xxh3-64 of a CPU tensor's bytes as safetensors stores them (row-major), the index's ``xxh3``."""
    import torch

    return xxh3(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))


def read_header(
    f: Any, size: int, *, strict: bool = True, parse: bool = True
) -> tuple[int, bytes, dict | None]:
    """(data start, raw header bytes incl. the 8-byte length prefix, parsed header) of a safetensors file
    ``f`` at its start, ``size`` bytes long. ``strict=False`` reads the raw bytes only and never raises for a
    damaged length (an I/O error still propagates), not trusting it for the read's size (for a caller that
    checksums them). ``parse=False`` leaves the JSON unparsed: ten seconds over the shards of ten million
    samples."""
    prefix = f.read(8)
    if len(prefix) < 8:
        if not strict:
            return 8, prefix, None
        raise InputRefused(f"file is {size} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", prefix)
    if not strict:
        return 8 + n, prefix + f.read(max(0, min(n, size - 8))), None
    if n > size - 8:
        raise InputRefused(f"header claims {n} bytes but the file has {size - 8} after the length")
    raw = f.read(n)
    return 8 + n, prefix + raw, json.loads(raw) if parse else None


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def installed_versions(dists: Collection[str]) -> dict[str, str | None]:
    """Python's version and each distribution's in ``dists`` (None: not installed), from package metadata."""
    import platform
    from importlib import metadata

    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in dists:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def stable_config(config: dict, volatile: Collection[str]) -> dict:
    """``config`` without its volatile keys (dotted names, e.g. "runtime" or "versions"): what a run means."""

    def strip(obj: Any, prefix: str) -> Any:
        if not isinstance(obj, dict):
            return obj
        names = {key: f"{prefix}.{key}" if prefix else str(key) for key in obj}
        return {key: strip(value, names[key]) for key, value in obj.items() if names[key] not in volatile}

    return strip(config, "")


def config_hash(stable: dict) -> str:
    return hashlib.sha256(canonical_json(stable).encode("utf-8", "surrogatepass")).hexdigest()


def run_hash(run: dict) -> str:
    """The configuration hash of a parsed run.json: its config without its volatile keys."""
    return config_hash(stable_config(run.get("config", {}), run.get("volatile_keys", [])))


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while bookkeeping builds millions of acyclic objects: on 300,000 ids a resume's
    check took 2.5 s with it on, 0.55 s paused. Usable as a decorator; nests.

    Leaving the outermost use gives back what Arrow's allocator (mimalloc) keeps freed: a FeatureCache of 1M
    samples held 611 MiB above its imports instead of 286 MiB."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
            release_arrow_memory()


def release_arrow_memory() -> None:
    """Give the memory Arrow's allocator holds freed back to the system."""
    arrow = sys.modules.get("pyarrow")
    if arrow is not None:
        arrow.default_memory_pool().release_unused()


# ------------------------------------------------------------------------------------- the run file


def read_run_file(out: Path) -> dict:
    """run.json, parsed and checked (:func:`check_version`). One not as vlfast writes it is
    :class:`DamagedFile`, a missing one FileNotFoundError; both messages say how to get it back from the index
    parts without losing a sample."""
    path = out / RUN_FILE
    try:
        if not is_local(path):
            path.fs.invalidate_cache(path.path)  # another rank may have written it since we last looked
        data = read_whole(path)
    except FileNotFoundError:
        if _has_parts(out):
            raise FileNotFoundError(
                f"{path} is missing, but {out} holds index parts: run the same `vlfast extract` command "
                "again, which writes it anew from the configuration they carry (nothing is extracted again)"
            ) from None
        raise FileNotFoundError(
            f"{path} not found: {out} is not a vlfast extraction folder (run `vlfast extract` first)"
        ) from None
    except IsADirectoryError:
        raise DamagedFile(_damaged_run_file(out, "is a folder, not a file")) from None
    try:
        doc = json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DamagedFile(_damaged_run_file(out, f"is not valid JSON ({e})")) from None
    if (
        isinstance(doc, dict)
        and doc.get("format") == "vlfast-features"
        and isinstance(doc.get("format_version"), int)
    ):
        check_version(out, doc["format_version"], (doc.get("created_with") or {}).get("vlfast"))
    problem = _run_file_problem(doc)
    if problem is not None:
        raise DamagedFile(_damaged_run_file(out, problem))
    return doc


def _has_parts(out: Path) -> bool:
    return any(is_part_name(n) for n in list_names(out / INDEX_DIR))


def _run_file_problem(doc: Any) -> str | None:
    """What in a parsed run.json is not as vlfast writes it, or None."""
    if not isinstance(doc, dict):
        return "is not a JSON object"
    if doc.get("format") != "vlfast-features":
        return 'does not say "format": "vlfast-features"'
    version = doc.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int):
        return f"gives format_version {version!r}, not a whole number"
    if not isinstance(doc.get("config"), dict):
        return "gives a config that is not a JSON object"
    volatile = doc.get("volatile_keys", [])
    if not isinstance(volatile, list) or not all(isinstance(k, str) for k in volatile):
        return "gives volatile_keys that are not a list of names"
    recorded = doc.get("config_hash")
    if not isinstance(recorded, str):
        return "gives a config_hash that is not text"
    if run_hash(doc) != recorded:
        return "no longer matches its config_hash: its configuration was edited since it was written"
    return None


def _damaged_run_file(out: Path, problem: str) -> str:
    """A damaged run.json's message: what is wrong, and how to recover without deleting sound parts."""
    path = out / RUN_FILE
    if _has_parts(out):
        return (
            f"{path} {problem}. Its index parts carry the configuration: move it aside (mv {path} "
            f"{path}.damaged) and run the same `vlfast extract` command again, which writes run.json anew from "
            "them; nothing is extracted again."
        )
    return f"{path} {problem}, and {out} holds no committed sample: delete it, then run again."


# ------------------------------------------------------------------------------------ index parts


def part_name(rank: int, seq: int, digest: str) -> str:
    return f"part-r{rank:05d}-{seq:06d}-{digest}.parquet"


def shard_of_part(part: Path) -> Path:
    """The shard a part indexes: same rank and sequence number."""
    m = PART_RE.match(part.name)
    if m is None:
        raise ValueError(f"{part} is not an index part name")
    return part.parent.parent / SHARD_DIR / f"shard-r{m.group(1)}-{m.group(2)}.safetensors"


def compact_part_name(rank: int, first: int, last: int, digest: str) -> str:
    return f"part-r{rank:05d}-{first:06d}-{last:06d}-{digest}.parquet"


def is_part_name(name: str) -> bool:
    """Whether ``name`` is an index part's: one shard's, or a consolidated one."""
    return bool(PART_RE.match(name) or COMPACT_RE.match(name))


def is_consolidated(part: Path) -> bool:
    return COMPACT_RE.match(part.name) is not None


def part_span(name: str) -> tuple[int, int, int] | None:
    """(rank, first seq, last seq) of a part's name: first == last for one shard's part."""
    m = PART_RE.match(name)
    if m is not None:
        return int(m.group(1)), int(m.group(2)), int(m.group(2))
    m = COMPACT_RE.match(name)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m is not None else None


def read_part_footer(part: Path) -> dict[bytes, bytes] | None:
    """A part's key-value metadata from its Parquet footer alone (on object storage two small ranged reads),
    or None if unreadable. Not checked against the part's checksum: whoever reads its rows does."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if is_local(part):
            meta = pq.read_metadata(str(part))
        else:
            with part.fs.open(part.path, "rb") as f:
                meta = pq.read_metadata(f)
        return dict(meta.metadata or {})
    except (OSError, ValueError, pa.ArrowException):
        return None


def consolidated_info(part: Path) -> tuple[dict[str, list], list[str]] | None:
    """({"shards/NAME": [size, header xxh3]}, names it supersedes) of a consolidated part; None if unreadable."""
    raw = read_part_footer(part)
    try:
        return _shard_map(json.loads(raw[META_SHARDS])), _names(json.loads(raw[META_SUPERSEDES]))
    except (TypeError, KeyError, ValueError):
        return None


def committed_parts(out: Path) -> list[Path]:
    """The parts a reader follows, sorted by (rank, seq): every part but those a consolidated part present
    supersedes. One whose footer is unreadable supersedes nothing: the parts it replaced, while they exist,
    are read instead, and it is reported as damaged."""
    index = out / INDEX_DIR
    parts = sorted(n for n in list_names(index) if is_part_name(n))
    superseded: set[str] = set()
    for name in parts:
        if COMPACT_RE.match(name):
            info = consolidated_info(index / name)
            if info is not None:
                superseded.update(info[1])
    return [index / n for n in parts if n not in superseded]


def owned_under(raw: dict[bytes, bytes] | None) -> int | None:
    """The world size under which every id of a part is its rank's (:data:`META_OWNED_UNDER`), or None."""
    value = (raw or {}).get(META_OWNED_UNDER)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def others_only(part: Path, rank: int, world_size: int) -> bool:
    """Whether ``part`` is another rank's, marked as holding only ids its rank owns under ``world_size``:
    it tells this rank nothing, and is that rank's to check. A footer that cannot be read says no."""
    span = part_span(part.name)
    if span is None or span[0] == rank:
        return False
    return _marked(part, world_size)


def _marked(part: Path, world_size: int) -> bool:
    """Whether ``part``'s footer marks it as owned under ``world_size``. Read only for a local or a
    consolidated part: on object storage a small part's footer costs about what the part does (a Ray job
    commits 156,000 of them at ten million samples, and marks none)."""
    if world_size < 2 or not (is_local(part) or COMPACT_RE.match(part.name)):
        return False
    return owned_under(read_part_footer(part)) == world_size


def split_parts(out: Any, parts: Sequence[Path], rank: int, world_size: int) -> tuple[list, list, list]:
    """``parts`` as (this rank's own, marked as owned under ``world_size``; the parts every rank reads, the
    same list on every rank; other ranks' own)."""
    own, common, others = [], [], []
    for part, marked in zip(parts, map_parts(out, lambda p: _marked(p, world_size), parts)):
        span = part_span(part.name)
        if not marked or span is None:
            common.append(part)
        else:
            (own if span[0] == rank else others).append(part)
    return own, common, others


def part_shards(part: Path, meta: dict[str, Any]) -> dict[str, tuple[int | None, str | None]]:
    """Shard (path relative to OUT) -> (size, header xxh3) as written, for every shard ``part`` points at."""
    if meta.get("shards") is not None:
        return {s: (v[0], v[1]) for s, v in meta["shards"].items()}
    shard = shard_of_part(part)
    return {f"{SHARD_DIR}/{shard.name}": (meta["shard_bytes"], meta["shard_header_xxh3"])}


def referenced_shards(out: Path, exclude: str | None = None) -> Any:
    """A test ``(shard name) -> bool``: does a part in index/ (live or not, but ``exclude``) point at it?
    Garbage cleaning deletes the others. A consolidated part whose footer cannot be read protects every
    shard of its rank in its sequence range."""
    index = out / INDEX_DIR
    names: set[str] = set()
    ranges: list[tuple[int, int, int]] = []
    for name in list_names(index):
        if name == exclude:
            continue
        if PART_RE.match(name):
            names.add(shard_of_part(index / name).name)
        elif COMPACT_RE.match(name):
            info = consolidated_info(index / name)
            if info is None:
                ranges.append(part_span(name))
            else:
                names.update(s.rsplit("/", 1)[-1] for s in info[0])

    def referenced(shard: str) -> bool:
        if shard in names:
            return True
        m = SHARD_RE.match(shard)
        return m is not None and any(r == int(m.group(1)) and a <= int(m.group(2)) <= b for r, a, b in ranges)

    return referenced


_READ_THREADS = 16  # index parts read at once from object storage
_READ_AHEAD = 256  # parts read ahead of the consumer at most (a Ray job on S3 commits 156,000 at 10M)


def map_parts(out: Any, fn: Callable[[Any], Any], parts: Sequence[Any]) -> Iterator[Any]:
    """``fn(part)`` of each part, in order: locally one by one as consumed; on object storage up to 16 at
    once, at most :data:`_READ_AHEAD` ahead of the consumer."""
    if is_local(out) or len(parts) < 2:
        yield from map(fn, parts)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(_READ_THREADS, len(parts)), thread_name_prefix="vlfast-parts") as pool:
        for k in range(0, len(parts), _READ_AHEAD):
            yield from pool.map(fn, parts[k : k + _READ_AHEAD])


def read_index_part(part: Path, columns: Sequence[str] | None = None):
    """One index part as an Arrow table, after checking the hash its name carries; damage is named."""
    table = read_part_groups(open_index_part(part), part, None, columns)
    return table.select(list(columns)) if columns is not None else table


def open_index_part(part: Path):
    """One index part as a ``pyarrow.parquet.ParquetFile`` over its bytes, read whole and checked against
    the hash its name carries."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        data = read_whole(part)
    except OSError as e:
        raise DamagedFile(f"index part {part} is unreadable ({e}). {_redo_hint(part)}") from None
    _check_named_digest(part, xxh3(data))
    try:
        # The shard column as a dictionary: 0.4 GB of repeated strings at 10M samples against 40 MB of codes.
        file = pq.ParquetFile(
            pa.BufferReader(data), page_checksum_verification=True, read_dictionary=["shard"]
        )
    except KeyError:  # read_dictionary names a column the file does not have
        raise DamagedFile(
            f"index part {part} is not a vlfast index part: it has no column 'shard'. {FOREIGN_HINT}"
        ) from None
    except (OSError, pa.ArrowException) as e:
        raise DamagedFile(f"index part {part} is unreadable ({e}). {_redo_hint(part)}") from None
    problem = _not_an_index(file.schema_arrow)
    if problem is not None:
        raise DamagedFile(f"index part {part} is not a vlfast index part: {problem}. {FOREIGN_HINT}")
    return file


def _not_an_index(schema: Any) -> str | None:
    """What makes ``schema`` (an opened part's) not an index part's, or None: checked where a part is opened,
    so no reader meets a foreign Parquet file under a part's name as a KeyError deep inside."""
    import pyarrow as pa

    def text(t: Any) -> bool:
        return pa.types.is_string(t) or pa.types.is_large_string(t)

    try:
        meta = part_meta(schema)
    except (ValueError, TypeError, AttributeError, KeyError) as e:
        return f"its vlfast metadata does not parse ({e})"
    if meta["config"] is None or meta["config_hash"] is None:
        return "it records no run configuration"
    for name in ("id", "shard", "row", "features"):
        if schema.get_field_index(name) < 0:
            return f"it has no column {name!r}"
    shard = schema.field("shard").type
    if not text(schema.field("id").type) or not (
        text(shard) or (pa.types.is_dictionary(shard) and text(shard.value_type))
    ):
        return "its id and shard columns are not text"
    if not pa.types.is_integer(schema.field("row").type):
        return "its row column is not an integer"
    features = schema.field("features").type
    if not (pa.types.is_list(features) or pa.types.is_large_list(features)) or not pa.types.is_struct(
        features.value_type
    ):
        return "its features column is not a list of structs"
    want = index_schema().field("features").type.value_type
    entry = features.value_type
    for field in want:
        k = entry.get_field_index(field.name)
        if k < 0 or not entry.field(k).type.equals(field.type):
            return f"its feature entries have no {field.name!r} of type {field.type}"
    return None


def _check_named_digest(part: Path, digest: str) -> None:
    """``digest`` against the xxh3 the part's name carries; a consolidated part's too (Parquet's footer has
    no checksum of its own)."""
    m = PART_RE.match(part.name) or COMPACT_RE.match(part.name)
    expected = m.group(m.re.groups) if m is not None else None
    if expected is not None and digest != expected:
        raise DamagedFile(
            f"index part {part} is damaged: its bytes do not match the checksum in its name. {_redo_hint(part)}"
        )


def check_part_bytes(part: Path) -> None:
    """Every byte of a committed index part against the checksum in its name, nothing decoded. A local part
    is hashed as it is read; on object storage it is read in one request, as :func:`open_index_part` does."""
    if not is_local(part):
        open_index_part(part)
        return
    try:
        digest = file_xxh3(part)
    except OSError as e:
        raise DamagedFile(f"index part {part} is unreadable ({e}). {_redo_hint(part)}") from None
    _check_named_digest(part, digest)


def file_xxh3(path: Path) -> str:
    """xxh3-64 of a local file's bytes, read 8 MiB at a time."""
    import xxhash

    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 23):
            h.update(chunk)
    return h.hexdigest()


def read_part_groups(
    file: Any, part: Path, groups: Sequence[int] | None = None, columns: Sequence[str] | None = None
):
    """Row groups ``groups`` (all when None) of an opened index part, as one Arrow table; damage is named."""
    import pyarrow as pa

    try:
        # On the calling thread: pq.read_table starts Arrow's thread pools, whose threads dying at exit with
        # torch loaded aborted reader scripts now and then (SIGABRT). Only the columns asked for are decoded.
        columns = None if columns is None else list(columns)
        if groups is None:
            return file.read(columns=columns, use_threads=False)
        return file.read_row_groups(list(groups), columns=columns, use_threads=False)
    except (OSError, pa.ArrowException) as e:
        raise DamagedFile(f"index part {part} is unreadable ({e}). {_redo_hint(part)}") from None


def part_meta(table) -> dict[str, Any]:
    """The vlfast key-value metadata of an index part (a table of it, or its schema). Raises ValueError or
    TypeError for metadata that does not parse (a foreign file: :func:`open_index_part` refuses those first)."""
    raw = getattr(table, "schema", table).metadata or {}

    def get(key: bytes) -> str | None:
        value = raw.get(key)
        return value.decode("utf-8", "surrogatepass") if value is not None else None

    shard_bytes = get(META_SHARD_BYTES)
    config = get(META_CONFIG)
    shards, supersedes = get(META_SHARDS), get(META_SUPERSEDES)
    meta = {
        "shards": _shard_map(json.loads(shards)) if shards is not None else None,  # consolidated parts only
        "supersedes": _names(json.loads(supersedes)) if supersedes is not None else [],
        "format_version": int(get(META_FORMAT) or 0),  # 0: none recorded (not a part vlfast writes)
        "config": json.loads(config) if config is not None else None,
        "config_hash": get(META_CONFIG_HASH),
        "shard_bytes": int(shard_bytes) if shard_bytes is not None else None,
        "shard_header_xxh3": get(META_SHARD_HEADER),
        "owned_under": owned_under(raw),
    }
    if meta["config"] is not None and not isinstance(meta["config"], dict):
        raise TypeError("vlfast.config is not a JSON object")
    return meta


def _shard_map(value: Any) -> dict[str, list]:
    """A consolidated part's ``vlfast.shards``, checked: {"shards/NAME": [size, header xxh3]}."""
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, list) and len(v) == 2 for k, v in value.items()
    ):
        raise TypeError("vlfast.shards is not a map of shard names to [size, header checksum]")
    return value


def _names(value: Any) -> list[str]:
    """A consolidated part's ``vlfast.supersedes``, checked: a list of part names."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TypeError("vlfast.supersedes is not a list of part names")
    return value


# What to do about damage, wherever it is reported: the resume moves it aside and redoes its samples.
REDO_HINT = (
    "Run the same `vlfast extract` again: it moves damaged shards aside to OUT/quarantine and extracts "
    "their samples again."
)

# A file where the format keeps a folder, or the reverse: only a hand edit makes one (layout.refuse_misplaced).
MOVE_HINT = "Nothing in OUT is moved for you: move it out of OUT, then run again."
# A file in OUT that is not the format's (a foreign Parquet file under a part's name): never deleted.
FOREIGN_HINT = (
    "Run the same `vlfast extract` again: it moves it aside to OUT/quarantine and extracts again what is "
    "missing (or move it out of OUT yourself)."
)


def _redo_hint(part: Path) -> str:
    shard = shard_of_part(part).name if PART_RE.match(part.name) else "the shards it points at"
    return f"{REDO_HINT[:-1]} (or delete it and {shard})."


def feature_entry(name: str, entry: dict, data_start: int, checksum: str | None) -> dict:
    """A feature's index entry, from its safetensors header ``entry`` in a shard whose data starts at
    ``data_start``."""
    start, end = entry["data_offsets"]
    return {
        "name": name,
        "dtype": DTYPE_BY_CODE[entry["dtype"]],
        "shape": list(entry["shape"]),
        "offset": data_start + start,
        "nbytes": end - start,
        "xxh3": checksum,
    }


def index_schema():
    """Arrow schema of every index part."""
    import pyarrow as pa

    feature = pa.struct(
        [
            ("name", pa.string()),
            ("dtype", pa.string()),
            ("shape", pa.list_(pa.int64())),
            ("offset", pa.int64()),
            ("nbytes", pa.int64()),
            ("xxh3", pa.string()),
        ]
    )
    return pa.schema(
        [
            ("id", pa.string()),
            ("shard", pa.string()),
            ("row", pa.int32()),
            ("rank", pa.int32()),
            ("features", pa.list_(feature)),
            ("grid_thw", pa.list_(pa.list_(pa.int64()))),
            ("meta", pa.string()),
        ]
    )


def parquet_bytes(columns: dict[str, list], schema: Any) -> bytes:
    """The Parquet file of ``columns`` (name -> values) under ``schema``, page checksums written, as bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(pa.table(columns, schema=schema), sink, write_page_checksum=True)
    return sink.getvalue().to_pybytes()


# ------------------------------------------------------------------------------------ error records


def error_line(record: dict) -> str:
    """One error record as a JSON line carrying the xxh3 of its own canonical form."""
    rec = dict(record)
    rec["xxh3"] = xxh3(canonical_json(rec).encode("utf-8", "surrogatepass"))
    try:
        line = json.dumps(rec, ensure_ascii=False)
        line.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: JSON's \\u escape keeps it exactly
        line = json.dumps(rec, ensure_ascii=True)
    return line + "\n"


def read_error_file(path: Path) -> tuple[list[dict], int]:
    """(records, damaged lines) of one errors file. A torn last line (a crash mid-append) is not a record; a
    line whose checksum fails is not either, and is counted so a verification can report it."""
    records, damaged = [], 0
    lines = read_whole(path).split(b"\n")
    for k, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw.decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            damaged += k < len(lines) - 1  # the last line may be torn by a kill: not damage
            continue
        if not isinstance(rec, dict) or "id" not in rec:
            damaged += 1
            continue
        check = rec.pop("xxh3", None)
        if check is not None and check != xxh3(canonical_json(rec).encode("utf-8", "surrogatepass")):
            damaged += 1
            continue
        records.append(rec)
    return records, damaged


def read_errors(out: Path) -> list[dict]:
    """All ranks' error records as they stand: torn and damaged lines skipped (their samples are extracted
    again), exact repeats of a duplicate or input record dropped, and of each id's failure records only the
    latest, by ``time``, then file name (sessions are named in time order) and line. FeatureCache also drops
    the failures of an id a part has committed since (this function does not read the index)."""
    records: list[dict] = []
    seen: set[tuple] = set()
    latest: dict[str, tuple[tuple, dict]] = {}
    for k, path in enumerate(error_files(out)):
        try:
            found = read_error_file(path)[0]
        except (IsADirectoryError, FileNotFoundError):  # a folder under its name: verify names it
            continue
        for line, rec in enumerate(found):
            if rec.get("kind") in FAILURE_KINDS:
                order = (str(rec.get("time", "")), k, line)
                sid = rec["id"]
                if sid not in latest or order >= latest[sid][0]:
                    latest[sid] = (order, rec)
                continue
            key = error_key(rec)
            if key in seen:
                continue
            seen.add(key)
            records.append(rec)
    failures = sorted(latest.values(), key=lambda x: x[0])
    return records + [rec for _, rec in failures]


def error_files(out: Path) -> list[Path]:
    """Every rank's (and, on object storage, every session's) errors file, sorted by name."""
    folder = out / ERROR_DIR
    return [folder / n for n in sorted(list_names(folder)) if ERRORS_RE.match(n)]


def error_key(rec: dict) -> tuple:
    return (rec.get("id"), rec.get("source"), rec.get("reason"), rec.get("kind"))


def reason_kind(reason: str) -> str:
    """A short class of an error reason, as the summary counts and ``--retry-errors`` selects them: the text
    before the first ": ", cut to whole words within 40 characters (and before a parenthesis left open)."""
    kind = str(reason).split(": ", 1)[0].strip()
    if len(kind) > 40:
        kind = kind[:41].rsplit(" ", 1)[0]
        if kind.count("(") > kind.count(")"):
            kind = kind[: kind.rindex("(")].rstrip()
    return kind or "error"


def parse_retry(kinds: str | Collection[str] | None) -> frozenset[str] | None:
    """What ``--retry-errors`` selects: None (nothing), ``{"all"}``, or the kinds given ("transient",
    "error", or a reason class as the summary counts it, e.g. "unreadable or truncated image")."""
    if kinds is None:
        return None
    items = kinds.split(",") if isinstance(kinds, str) else list(kinds)
    out = frozenset(str(k).strip() for k in items if str(k).strip())
    if not out:
        raise InputRefused("retry_errors: give 'all' or comma-separated kinds, e.g. transient,error")
    return out


def done_by_error(rec: dict, retry: Collection[str] | None = None) -> bool:
    """Whether an error record makes its id done: a failed sample yes, unless ``retry`` (:func:`parse_retry`)
    selects it; a transient failure, a duplicate or a bad input row never."""
    if rec.get("kind") in (TRANSIENT_KIND, DUPLICATE_KIND, INPUT_KIND):
        return False
    if not retry:
        return True
    return not ("all" in retry or rec.get("kind") in retry or reason_kind(rec.get("reason", "")) in retry)
