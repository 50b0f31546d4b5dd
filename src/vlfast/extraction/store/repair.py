"""Moving a damaged consolidated part aside (compact.py), costing as few samples as the damage allows.

- The part itself fails: if every part it superseded is still in index/ (a kill between its commit and the
  deletions), only it is moved to quarantine, those parts are read again and the next compaction rebuilds
  it. Otherwise it is moved with the shards it points at, whose samples are extracted again: their headers
  lack the samples' meta and the tensors' checksums, so no index is rebuilt from unchecked bytes.
- Some of its shards fail: those are moved aside, a new consolidated part with the other rows is committed,
  superseding it, and then it is moved aside too. Only the damaged shards' samples are redone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vlfast.extraction.store.compact import write_consolidated
from vlfast.extraction.store.format import (
    INDEX_DIR,
    META_SHARDS,
    META_SUPERSEDES,
    SHARD_DIR,
    SHARD_RE,
    canonical_json,
    consolidated_info,
    list_names,
    part_span,
    read_index_part,
    referenced_shards,
)
from vlfast.extraction.store.integrity import PartCheck

__all__ = ["quarantine_consolidated"]


def _shards_of_unreadable(out: Path, part: Path) -> list[Path]:
    """The shards an unreadable consolidated part points at: those of its rank and sequence range that no
    other part points at."""
    rank, first, last = part_span(part.name)
    referenced = referenced_shards(out, exclude=part.name)
    found = []
    for name in sorted(list_names(out / SHARD_DIR)):
        m = SHARD_RE.match(name)
        if m and int(m.group(1)) == rank and first <= int(m.group(2)) <= last and not referenced(name):
            found.append(out / SHARD_DIR / name)
    return found


def write_reason(backend: Any, dest: Path, record: dict, tag: str) -> None:
    backend.make_quarantine(dest)
    backend.write(dest / "reason.json", (json.dumps(record, indent=1) + "\n").encode(), tag)


def quarantine_consolidated(
    out: Path, backend: Any, check: PartCheck, dest: Path, tag: str
) -> tuple[dict[str, Any], list[str], str | None]:
    """Move what ``check`` found damaged in a consolidated part to ``dest``: (the record written to its
    reason.json, the ids that stay committed, the consolidated part that replaces it or None)."""
    part = check.part
    if check.problem is not None:
        info = consolidated_info(part)
        present = set(list_names(out / INDEX_DIR))
        if info is not None and info[1] and all(n in present for n in info[1]):
            shards: list[Path] = []  # the parts it replaced are read again; the next compaction rebuilds it
        elif info is not None:
            shards = [out / s for s in sorted(info[0])]
        else:
            shards = _shards_of_unreadable(out, part)
        record = {
            "part": part.name,
            "shards": [s.name for s in shards],
            "reason": check.problem,
            "ids": list(check.ids),
            "rebuilt_from": sorted(info[1]) if info is not None and not shards else [],
        }
        write_reason(backend, dest, record, tag)
        backend.quarantine(dest, (*shards, part))  # shards first, as for a part of one shard
        return record, [], None
    bad = check.bad_shards
    keep = [s not in bad for s in check.row_shards]
    record = {
        "part": part.name,
        "shards": [s.rsplit("/", 1)[-1] for s in sorted(bad)],
        "reason": "; ".join(bad[s] for s in sorted(bad)),
        "ids": [sid for sid, k in zip(check.ids, keep) if not k],
    }
    write_reason(backend, dest, record, tag)
    backend.quarantine(dest, tuple(out / s for s in sorted(bad)))
    new = None
    if any(keep):
        import pyarrow as pa

        table = read_index_part(part)  # it passed its checksum a moment ago
        meta = dict(table.schema.metadata or {})
        shards_meta = {s: v for s, v in json.loads(meta[META_SHARDS]).items() if s not in bad}
        meta[META_SHARDS] = canonical_json(shards_meta).encode("utf-8")
        meta[META_SUPERSEDES] = canonical_json(
            sorted({*json.loads(meta[META_SUPERSEDES]), part.name})
        ).encode()
        rows = table.filter(pa.array(keep))
        new = write_consolidated(out, backend, rows, part_span(part.name), meta, tag).name
    backend.quarantine(dest, (part,))
    return record, [sid for sid, k in zip(check.ids, keep) if k], new
