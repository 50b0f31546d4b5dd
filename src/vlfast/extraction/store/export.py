"""Export one stored vector per sample from an extraction folder as ONE table that vector stores read.

``export(out, dest, format="parquet" | "lance")`` writes the columns ``id``, ``embedding`` (a fixed-size
list of float32, or float16), ``path``, ``text``, ``instruction`` and ``n_tokens`` (the last four from each
sample's meta, null where it has none). What is refused is refused before anything is written; a value
``dtype`` cannot hold (float16 overflows past 65504) is refused when the streaming write reaches it, and
the temp table is removed. The table is renamed into place once complete
(``vlfast._files.write_atomically``), so a killed export leaves DEST absent or as it was. Rows stream in
batches of ``batch_rows``. docs/extract.md, "Export", says the rest.
"""

from __future__ import annotations

import json
import numbers
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlfast._files import disk_full, is_inside, same_file, write_atomically
from vlfast.errors import InputRefused
from vlfast.extraction.objstore import is_url, url_scheme
from vlfast.extraction.store.format import OutputFull, is_local, read_run_file, resolve_out

if TYPE_CHECKING:  # pragma: no cover
    from vlfast.extraction.store.reader import FeatureCache

__all__ = ["FORMATS", "META_COLUMNS", "ExportResult", "export", "table_schema"]

FORMATS = ("parquet", "lance")
VECTOR_DTYPES = ("float32", "float16")
DEFAULT_FEATURE = "embedding"
META_COLUMNS = ("path", "text", "instruction", "n_tokens")  # read from each sample's meta
BATCH_ROWS = 4096
MAX_BATCH_ROWS = 1 << 20  # a batch of vectors is held in memory: past this, memory is the limit, not speed
LANCE_HINT = 'pip install "vlfast[export]"'
_FLOATS = ("float64", "float32", "float16", "bfloat16")


@dataclass
class ExportResult:
    dest: str
    format: str
    feature: str
    dtype: str
    dim: int
    rows: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def export(
    out: str | os.PathLike,
    dest: str | os.PathLike,
    *,
    format: str | None = None,
    feature: str | None = None,
    dtype: str = "float32",
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
    batch_rows: int = BATCH_ROWS,
) -> ExportResult:
    """Write one vector per sample of ``out`` (a local folder or an fsspec URL, opened with
    ``storage_options``) with its meta columns as one table at the local path ``dest``: a Parquet file or a
    Lance dataset folder (``format`` None: lance when ``dest`` ends in .lance). ``feature`` defaults to
    ``embedding``; ``dtype`` is the vectors' type in the table. Rows come in OUT's stored order."""
    start = time.monotonic()
    if format is None:
        format = "lance" if str(dest).rstrip("/").endswith(".lance") else "parquet"
    format = _choice(format, FORMATS, "format")
    dtype = _choice(dtype, VECTOR_DTYPES, "dtype")
    if (
        isinstance(batch_rows, bool)
        or not isinstance(batch_rows, numbers.Integral)
        or not 1 <= batch_rows <= MAX_BATCH_ROWS
    ):
        raise InputRefused(
            f"batch_rows must be a whole number from 1 to {MAX_BATCH_ROWS:,}, got {batch_rows!r}"
        )
    _refuse_dest_in_out(out, dest)
    target = _check_dest(dest, format, overwrite)
    lance = _import_lance() if format == "lance" else None
    cache = _open(out, storage_options, feature)
    feature, dim = pick_vector(cache, feature)
    cache.features = frozenset([feature])  # each lookup reads this one tensor, nothing else
    schema = table_schema(dim, dtype, _provenance(cache, feature))
    batches = _batches(cache, feature, dim, dtype, schema, int(batch_rows))
    if lance is None:
        write = _parquet_writer(schema, batches, len(cache))
    else:
        write = _lance_writer(lance, schema, batches, len(cache))
    try:
        write_atomically(target, write, overwrite=overwrite, tag="export")
    except OSError as e:
        if disk_full(e):
            raise OutputFull(f"cannot write {target}: no space left on its disk ({e.strerror})") from None
        raise
    return ExportResult(str(target), format, feature, dtype, dim, len(cache), time.monotonic() - start)


def table_schema(dim: int, dtype: str = "float32", metadata: dict[str, str] | None = None):
    """The exported table's Arrow schema: id, embedding (fixed-size list of ``dtype``), then the meta columns."""
    import pyarrow as pa

    value = pa.float16() if dtype == "float16" else pa.float32()
    fields = [
        pa.field("id", pa.string(), nullable=False),
        pa.field("embedding", pa.list_(value, dim), nullable=False),
        pa.field("path", pa.string()),
        pa.field("text", pa.string()),
        pa.field("instruction", pa.string()),
        pa.field("n_tokens", pa.int64()),
    ]
    return pa.schema(fields, metadata=metadata)


# ------------------------------------------------------------------------------------------ checks


def _choice(value: str, allowed: tuple[str, ...], what: str) -> str:
    text = str(value).strip().lower()
    if text not in allowed:
        raise InputRefused(f"unknown {what} {value!r}: give one of {', '.join(allowed)}")
    return text


def _refuse_dest_in_out(out: str | os.PathLike, dest: str | os.PathLike) -> None:
    """DEST must lie outside OUT and OUT outside DEST, by identity (symlinks and other spellings count)."""
    if hasattr(out, "fs") or any(
        is_url(os.fspath(t)) and url_scheme(os.fspath(t)) != "file" for t in (out, dest)
    ):
        return  # an OUT on object storage is never a local DEST; a remote DEST is refused in _check_dest
    out_path, dest_path = resolve_out(out), resolve_out(dest)
    if not (is_local(out_path) and is_local(dest_path)):
        return
    if same_file(dest_path, out_path):
        raise InputRefused(
            f"DEST {dest_path} is OUT {out_path}, the extraction folder it reads: name a DEST outside OUT"
        )
    if is_inside(dest_path, out_path):
        raise InputRefused(
            f"DEST {dest_path} is inside OUT {out_path}, the extraction folder it reads: a table there would "
            "replace or sit among OUT's own files; name a DEST outside OUT"
        )
    if is_inside(out_path, dest_path):
        raise InputRefused(
            f"OUT {out_path} is inside DEST {dest_path}: replacing DEST would delete the folder being read; "
            "name a DEST outside OUT"
        )


def _check_dest(dest: str | os.PathLike, format: str, overwrite: bool) -> Path:
    """DEST as a local path, refused if it is on object storage, or exists (without ``overwrite``), or is
    not what ``overwrite`` may replace: a Parquet file, or a Lance dataset folder."""
    text = os.fspath(dest)
    if is_url(text) and url_scheme(text) != "file":
        raise InputRefused(
            f"DEST {text} is on object storage: export writes a local {'file' if format == 'parquet' else 'folder'} "
            "and renames it into place once complete, which object storage cannot do for a whole table. "
            "Export to a local DEST, then copy it up (e.g. `aws s3 cp` for a Parquet file, `aws s3 sync` "
            "for a Lance folder)."
        )
    path = resolve_out(text)  # file:// URLs are local paths
    if path.parent.exists() and not path.parent.is_dir():
        raise NotADirectoryError(f"DEST {path}: {path.parent} is not a folder")
    if not (path.exists() or path.is_symlink()):
        return path
    if not overwrite:
        raise InputRefused(
            f"DEST {path} exists: pass --overwrite (overwrite=True) to replace it, or name another DEST"
        )
    if format == "parquet" and not _is_parquet_file(path):
        raise InputRefused(
            f"DEST {path} is not a Parquet file ({'a folder' if path.is_dir() else 'other content'}); "
            "--overwrite only replaces a table: remove it yourself or name another DEST"
        )
    if format == "lance" and not (path.is_dir() and (path / "_versions").is_dir()):
        raise InputRefused(
            f"DEST {path} is not a Lance dataset (no _versions folder); --overwrite only replaces a table: "
            "remove it yourself or name another DEST"
        )
    return path


def _is_parquet_file(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return path.is_file() and f.read(4) == b"PAR1"
    except OSError:
        return False


def _import_lance():
    try:
        import lance
    except ImportError:
        raise ImportError(f"--format lance needs the pylance package: {LANCE_HINT}") from None
    return lance


def _open(
    out: str | os.PathLike, storage_options: dict[str, Any] | None, feature: str | None = None
) -> FeatureCache:
    path = resolve_out(out, storage_options)
    if is_local(path):
        if not path.exists():
            raise FileNotFoundError(
                f"OUT {path} does not exist: name the folder `vlfast extract` wrote its features into"
            )
        if not path.is_dir():
            raise NotADirectoryError(
                f"OUT {path} is a file, not a vlfast extraction folder: name the folder `vlfast extract` wrote"
            )
    run = read_run_file(path)  # not a vlfast folder: refused here, before the reader imports torch (seconds)
    _refuse_a_feature_never_extracted(path, run, feature)
    from vlfast.extraction.store.reader import FeatureCache

    return FeatureCache(path)


def _refuse_a_feature_never_extracted(out: Any, run: dict, feature: str | None) -> None:
    """Refuse a feature no sample of OUT can hold, by the features run.json says were extracted, before the
    reader imports torch (seconds)."""
    config = run.get("config") if isinstance(run, dict) else None
    features = config.get("features") if isinstance(config, dict) else None
    names = features.get("names") if isinstance(features, dict) else features  # a list: a FeatureStore user's
    if feature is None or not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return
    if feature.split(".")[0] in names or (feature == "grid_thw" and {"vision", "deepstack"} & set(names)):
        return
    raise InputRefused(
        f"OUT {out} has no feature {feature!r}: it was extracted with --features {','.join(names)}; export one "
        f"of those (llm as llm.POOL.layerN, deepstack as deepstack.K), or extract {feature!r} into another OUT"
    )


class _Feature:
    """What the index says of one feature name over all samples: the first shape, the first sample whose
    shape or dtype differs, how many samples hold it."""

    def __init__(self, sample_id: str, shape: list[int], dtype: str):
        self.first = (sample_id, tuple(shape), dtype)
        self.odd: tuple[str, tuple[int, ...], str] | None = None
        self.count = 0

    def add(self, sample_id: str, shape: list[int], dtype: str) -> None:
        self.count += 1
        if self.odd is None and (tuple(shape), dtype in _FLOATS) != (self.first[1], self.first[2] in _FLOATS):
            self.odd = (sample_id, tuple(shape), dtype)

    def is_vector(self, n: int) -> bool:
        return self.count == n and len(self.first[1]) == 1 and self.first[2] in _FLOATS and self.odd is None


def pick_vector(cache: FeatureCache, feature: str | None) -> tuple[str, int]:
    """(feature, vector length) to export, from the index alone: refused, naming it, unless every sample
    holds the feature as one floating vector of one length."""
    n = len(cache)
    if n == 0:
        raise InputRefused(f"OUT {cache.out} holds no samples: nothing to export")
    seen: dict[str, _Feature] = {}
    for i in range(n):
        info = cache.info(i)
        for f in info["features"]:
            entry = seen.get(f["name"])
            if entry is None:
                entry = seen[f["name"]] = _Feature(info["id"], f["shape"], f["dtype"])
            entry.add(info["id"], f["shape"], f["dtype"])
    vectors = sorted(name for name, entry in seen.items() if entry.is_vector(n))
    listed = ", ".join(vectors) if vectors else "none"
    if feature is None:
        if DEFAULT_FEATURE not in seen:
            raise InputRefused(
                f"OUT {cache.out} has no feature {DEFAULT_FEATURE!r}: pick one with --feature NAME; its features "
                f"with one vector per sample: {listed}"
            )
        feature = DEFAULT_FEATURE
    entry = seen.get(feature)
    if entry is None:
        raise InputRefused(
            f"OUT {cache.out} has no feature {feature!r}; its features with one vector per sample: {listed} "
            f"(all its features: {', '.join(sorted(seen))})"
        )
    _check_vector(cache, feature, entry, listed)
    return feature, entry.first[1][0]


def _check_vector(cache: FeatureCache, feature: str, entry: _Feature, listed: str) -> None:
    sample, shape, dtype = entry.first
    if len(shape) != 1:
        raise InputRefused(
            f"feature {feature!r} of OUT {cache.out} is not one vector per sample: sample {sample!r} holds "
            f"shape {shape}. Export a pooled feature (one vector per sample): {listed}"
        )
    if dtype not in _FLOATS:
        raise InputRefused(
            f"feature {feature!r} of OUT {cache.out} is {dtype}, not floating: not an embedding"
        )
    if entry.odd is not None:
        odd, odd_shape, odd_dtype = entry.odd
        what = f"{odd_dtype}" if odd_shape == shape else f"shape {odd_shape}"
        raise InputRefused(
            f"feature {feature!r} of OUT {cache.out}: sample {odd!r} holds {what}, but sample {sample!r} "
            f"(the first) holds {dtype} shape {shape}; one table needs one vector length. Leave the sample "
            "out of OUT or export another feature."
        )
    if entry.count != len(cache):
        missing = next(
            cache.info(i)["id"]
            for i in range(len(cache))
            if not any(f["name"] == feature for f in cache.info(i)["features"])
        )
        raise InputRefused(
            f"sample {missing!r} of OUT {cache.out} has no feature {feature!r} ({len(cache) - entry.count} of "
            f"{len(cache)} samples lack it); export a feature every sample holds: {listed}"
        )


def _provenance(cache: FeatureCache, feature: str) -> dict[str, str]:
    from vlfast import __version__

    config = cache.run_config
    about = {"out": str(cache.out), "feature": feature, "model": config.get("model"), "vlfast": __version__}
    return {"vlfast.export": json.dumps(about, sort_keys=True, default=str)}


# ------------------------------------------------------------------------------------------ rows


def _meta_columns(
    meta: dict, instruction: str | None = None
) -> tuple[str | None, str | None, str | None, int | None]:
    """The meta columns of one sample; ``instruction`` stands for the run's (run.json holds it once)."""

    def text(key: str) -> str | None:
        value = meta.get(key, instruction if key == "instruction" else None)
        return value if isinstance(value, str) or value is None else json.dumps(value, ensure_ascii=False)

    n = meta.get("n_tokens")
    n_tokens = n if isinstance(n, int) and not isinstance(n, bool) else None
    return text("path"), text("text"), text("instruction"), n_tokens


def _batches(cache: FeatureCache, feature: str, dim: int, dtype: str, schema, rows: int) -> Iterator[Any]:
    """Record batches of ``rows`` samples each, in the cache's order."""
    import numpy as np
    import pyarrow as pa
    import torch

    to = torch.float16 if dtype == "float16" else torch.float32
    vector_type = schema.field("embedding").type
    features = cache.run_config.get("features")
    instruction = None
    if feature == "embedding" and isinstance(features, dict):
        instruction = features.get("instruction")
    ids: list[str] = []
    vectors: list[Any] = []
    metas: list[tuple] = []

    def batch():
        values = pa.array(np.stack(vectors).reshape(-1))  # a fresh array: a writer may hold the batch
        columns = [pa.array(ids, pa.string()), pa.FixedSizeListArray.from_arrays(values, type=vector_type)]
        columns += [pa.array(list(c), schema.field(k).type) for k, c in zip(META_COLUMNS, zip(*metas))]
        return pa.RecordBatch.from_arrays(columns, schema=schema)

    for i, (sample_id, feats) in enumerate(cache.items()):
        vector = feats[feature]
        if tuple(vector.shape) != (dim,):  # the index said otherwise: the shard header was checked against it
            raise InputRefused(
                f"sample {sample_id!r}: {feature!r} has shape {tuple(vector.shape)}, not ({dim},)"
            )
        cast = vector.to(to)
        _refuse_overflow(sample_id, feature, vector, cast, dtype)
        ids.append(sample_id)
        vectors.append(cast.numpy())
        metas.append(_meta_columns(cache.meta(i), instruction))
        if len(ids) == rows:
            yield batch()
            ids, vectors, metas = [], [], []
    if ids:
        yield batch()


def _refuse_overflow(sample_id: str, feature: str, stored, cast, dtype: str) -> None:
    """Refuse a vector that ``dtype`` cannot hold (finite values the cast made inf); non-finite stored
    values are exported as they are."""
    import torch

    if bool(torch.isfinite(cast).all()):
        return
    finite = torch.isfinite(stored)
    if not bool((finite & ~torch.isfinite(cast)).any()):
        return
    peak = float(stored[finite].double().abs().max())
    limit = float(torch.finfo(cast.dtype).max)
    instead = "export with --dtype float32, or scale" if dtype != "float32" else "scale"
    raise InputRefused(
        f"sample {sample_id!r}: {feature!r} holds values up to {peak:.6g} in magnitude, and {dtype} holds at "
        f"most {limit:g}: the table would store inf in their place. Nothing was written; {instead} the "
        "vectors first"
    )


# ------------------------------------------------------------------------------------------ writing


def _parquet_writer(schema, batches: Iterator[Any], rows: int) -> Callable[[Path], None]:
    def write(tmp: Path) -> None:
        import pyarrow.parquet as pq

        with pq.ParquetWriter(str(tmp), schema) as writer:
            for b in batches:
                writer.write_batch(b)
        written = pq.read_metadata(tmp).num_rows
        if written != rows:
            raise AssertionError(f"{tmp}: wrote {written} rows of {rows}")  # a bug, never committed

    return write


def _lance_writer(lance: Any, schema, batches: Iterator[Any], rows: int) -> Callable[[Path], None]:
    def write(tmp: Path) -> None:
        import pyarrow as pa

        source = _Source(batches)
        reader = pa.RecordBatchReader.from_batches(schema, iter(source))
        try:
            written = lance.write_dataset(reader, str(tmp), schema=schema, mode="create").count_rows()
        except Exception:
            # lance wraps an error of the batches in its own OSError: the original says what to do
            if source.error is not None:
                raise source.error from None
            raise
        if written != rows:
            raise AssertionError(f"{tmp}: wrote {written} rows of {rows}")

    return write


class _Source:
    """The batches, keeping the exception that ended them (if any) for the caller to raise as it is."""

    def __init__(self, batches: Iterator[Any]):
        self.batches, self.error = batches, None

    def __iter__(self) -> Iterator[Any]:
        try:
            yield from self.batches
        except Exception as e:
            self.error = e
            raise
