"""FeatureCache: read an extraction folder (all ranks' committed shards) as one torch Dataset.

Only committed data is visible: the cache reads the index parts (the commit markers, see ``store.py``) and
never lists shards, so temp files and orphan shards left by a crash are invisible. Tensors are read
through safetensors' memory map: looking up one sample reads that sample's bytes, not the shard.
"""

from __future__ import annotations

import json
import operator
import os
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from vlfast.extraction.store import committed_parts, read_errors, read_index_part, read_run_file

_MAX_OPEN_SHARDS = 64  # open safetensors handles kept (each holds a file descriptor and a mapping)


class FeatureCache(torch.utils.data.Dataset):
    """``len``, ``cache[i]`` or ``cache["id"]`` -> dict of tensors, iteration, ``id in cache``, ``meta(id)``.

    Works as a map-style Dataset with a DataLoader (including worker processes: open shard handles are
    not carried across processes, each worker opens its own).
    """

    def __init__(self, out: str | os.PathLike, features: Sequence[str] | None = None):
        """``features`` limits what each lookup reads (e.g. ``["mean"]`` skips the token tensors)."""
        import pyarrow as pa

        self.out = Path(out)
        if isinstance(features, str):
            features = [features]
        self.features = None if features is None else frozenset(features)
        self._run = read_run_file(self.out)
        parts = committed_parts(self.out)
        tables = [read_index_part(p) for p in parts]
        if tables:
            table = pa.concat_tables(tables)
        else:
            from vlfast.extraction.store import index_schema

            table = index_schema().empty_table()
        ids = table.column("id").to_pylist()
        shards = table.column("shard").to_pylist()
        rows = table.column("row").to_pylist()
        # Keep the first copy of an id. Two copies only appear if two writers ran with the same rank at once.
        self._pos: dict[str, int] = {}
        keep: list[int] = []
        dups: list[str] = []
        for i, sid in enumerate(ids):
            if sid in self._pos:
                dups.append(sid)
                continue
            self._pos[sid] = len(keep)
            keep.append(i)
        if dups:
            warnings.warn(
                f"{self.out}: {len(dups)} ids committed more than once (kept the first), e.g. {dups[:3]}",
                stacklevel=2,
            )
        self._ids = [ids[i] for i in keep]
        shard_names = sorted(set(shards))
        shard_no = {s: k for k, s in enumerate(shard_names)}
        self._shard_paths = [self.out / s for s in shard_names]
        self._shard = [shard_no[shards[i]] for i in keep]
        self._row = [rows[i] for i in keep]
        take = pa.array(keep, type=pa.int64())
        self._features = table.column("features").take(take).combine_chunks() if keep else None
        self._meta = table.column("meta").take(take).combine_chunks() if keep else None
        self._handles: OrderedDict[int, Any] = OrderedDict()
        self._shard_ids: dict[int, list[str] | None] = {}  # shard -> ids from its header, read on first open

    # -- Dataset -------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._ids)

    def ids(self) -> list[str]:
        return list(self._ids)

    def __contains__(self, sample_id: object) -> bool:
        return sample_id in self._pos

    def _index(self, key: int | str) -> int:
        if isinstance(key, str):
            try:
                return self._pos[key]
            except KeyError:
                raise KeyError(
                    f"id {key!r} is not in {self.out} (not extracted, failed, or not committed)"
                ) from None
        i = operator.index(key)
        n = len(self._ids)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for {n} samples in {self.out}")
        return i % n

    def __getitem__(self, key: int | str) -> dict[str, torch.Tensor]:
        i = self._index(key)
        k = self._shard[i]
        handle = self._handle(k)
        row = self._row[i]
        # The shard header names its ids: a mismatch means the folder was tampered with or two writers
        # shared a rank; fail loudly rather than return another sample's features.
        if self._shard_ids[k] is not None and self._shard_ids[k][row] != self._ids[i]:
            raise RuntimeError(
                f"{self._shard_paths[k]} row {row} holds {self._shard_ids[k][row]!r}, but the index says "
                f"{self._ids[i]!r}: the folder is damaged. Re-run the extraction into a new OUT."
            )
        names = [f["name"] for f in self._features[i].as_py()]
        if self.features is not None:
            missing = self.features.difference(names)
            if missing:
                raise KeyError(
                    f"sample {self._ids[i]!r} in {self.out} has no feature {sorted(missing)}; it has {names}"
                )
            names = [n for n in names if n in self.features]
        return {n: handle.get_tensor(f"{row}/{n}") for n in names}

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for i in range(len(self)):
            yield self[i]

    def items(self) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        for i, sid in enumerate(self._ids):
            yield sid, self[i]

    # -- metadata ------------------------------------------------------------------------------------

    def meta(self, sample_id: int | str) -> dict:
        return json.loads(self._meta[self._index(sample_id)].as_py())

    def info(self, sample_id: int | str) -> dict:
        """The sample's index row: shard, row, and per feature dtype, shape, byte offset and size."""
        i = self._index(sample_id)
        return {
            "id": self._ids[i],
            "shard": str(self._shard_paths[self._shard[i]].relative_to(self.out)),
            "row": self._row[i],
            "features": self._features[i].as_py(),
        }

    @property
    def run_config(self) -> dict:
        return self._run.get("config", {})

    def errors(self) -> list[dict]:
        return read_errors(self.out)

    def __repr__(self) -> str:
        return f"FeatureCache({str(self.out)!r}, samples={len(self)}, shards={len(self._shard_paths)})"

    # -- shard handles -------------------------------------------------------------------------------

    def _handle(self, k: int):
        h = self._handles.get(k)
        if h is not None:
            self._handles.move_to_end(k)
            return h
        from safetensors import safe_open

        path = self._shard_paths[k]
        try:
            h = safe_open(path, framework="pt", device="cpu")
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{path} is listed in {self.out}/index but missing; the folder was modified after the run. "
                "Re-run the extraction into a new OUT."
            ) from None
        self._handles[k] = h
        if k not in self._shard_ids:
            ids = (h.metadata() or {}).get("ids")
            self._shard_ids[k] = json.loads(ids) if ids else None
        if len(self._handles) > _MAX_OPEN_SHARDS:
            self._handles.popitem(last=False)
        return h

    def __getstate__(self) -> dict:
        # DataLoader workers (spawn) receive a copy: drop open mappings, each process opens its own.
        state = self.__dict__.copy()
        state["_handles"] = OrderedDict()
        return state
