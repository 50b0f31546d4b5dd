"""What in OUT is not where the format puts it: a file where a folder belongs (or the reverse), a shard no
index part covers. Readers never serve these, but each hides something (``index/`` deleted makes an OUT
look empty). :func:`find_strays` lists them for ``vlfast out verify`` and a run's preflight;
:func:`uncovered_shards` tells the store which uncovered shards a kill explains (deleted) and which it does
not (moved to quarantine). Files of other names are left alone.

A kill between a shard's commit and its index part's leaves one shard above every part of its rank, which
the next start of the rank removes (on object storage once ``backend.ORPHAN_AGE`` old). Any other uncovered
shard lost its index part. Not told apart: a rank's last part deleted leaves what a kill leaves, and a rank
killed before its first commit what a lost one-shard index leaves (moved aside).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlfast.errors import InputRefused
from vlfast.extraction.store.format import (
    CHECK_FILE,
    ERROR_DIR,
    ERRORS_RE,
    INDEX_DIR,
    LOCK_DIR,
    QUARANTINE_DIR,
    RUN_FILE,
    SHARD_DIR,
    SHARD_RE,
    is_local,
    list_names,
    part_span,
    referenced_shards,
)

__all__ = [
    "FOLDERS",
    "Misplaced",
    "Stray",
    "find_strays",
    "not_files",
    "not_folders",
    "refuse_misplaced",
    "uncovered_shards",
]

# The folders a store makes or uses; a file (or a dangling link) under one of these names blocks it.
FOLDERS = (INDEX_DIR, SHARD_DIR, ERROR_DIR, QUARANTINE_DIR, LOCK_DIR)


@dataclass
class Stray:
    """One thing in OUT that is not where the format puts it."""

    path: Any  # the file, folder or shard
    problem: str  # what is wrong, for a report
    kind: str  # "not_a_folder", "not_a_file", "uncovered" (a shard no index part covers)
    rank: int | None = None  # an uncovered shard's rank
    top: bool = False  # directly in OUT (run.json, index), not in one of its folders

    @property
    def rel(self) -> str:
        """The path relative to OUT (not ``relative_to``, which keeps a URL's scheme on upath 0.2)."""
        return self.path.name if self.top else f"{self.path.parent.name}/{self.path.name}"

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.rel, "problem": self.problem, "kind": self.kind}


def not_folders(out: Any) -> list[Path]:
    """The folders of :data:`FOLDERS` that exist in the local ``out`` as something else (a file, a dangling
    link); [] on object storage, where an object named ``index`` does not hide ``index/``."""
    if not is_local(out):
        return []
    return [out / n for n in FOLDERS if os.path.lexists(out / n) and not (out / n).is_dir()]


def not_files(out: Any) -> list[Path]:
    """run.json, checked.json and the error files of the local ``out`` that are folders ([] on object storage)."""
    if not is_local(out):
        return []
    errors = out / ERROR_DIR
    candidates = [
        out / RUN_FILE,
        out / CHECK_FILE,
        *(errors / n for n in list_names(errors) if ERRORS_RE.match(n)),
    ]
    return [p for p in candidates if p.is_dir()]


class Misplaced(InputRefused):
    """A local OUT holds a file where the format keeps a folder, or the reverse: only a hand edit makes that,
    so nothing is moved; the message says what to move out of OUT."""


def refuse_misplaced(out: Any, *, overwrite: bool = False) -> None:
    """Refuse (:class:`Misplaced`, exit 2) a local ``out`` holding something of :func:`not_folders` or
    :func:`not_files`. ``overwrite``: a dangling link where a folder belongs is replaced, not refused."""
    found = [(p, "a folder", "a file") for p in not_files(out)]
    for p in not_folders(out):
        if p.is_symlink() and not p.exists():
            if not overwrite:
                found.append((p, "a dangling link", "a folder"))
        else:
            found.append((p, "a file", "a folder"))
    if found:
        what = "; ".join(f"{_rel(out, p)} is {is_} where vlfast keeps {keeps}" for p, is_, keeps in found)
        moves = "; ".join(f"mv {p} {out.parent / (out.name + '-' + p.name)}" for p, _, _ in found)
        them = "it" if len(found) == 1 else "them"
        raise Misplaced(
            f"{out}: {what}. Nothing is moved for you: move {them} out of OUT ({moves}), then run again"
        )


def _rel(out: Any, p: Any) -> str:
    return p.name if p.parent == out else f"{p.parent.name}/{p.name}"


def uncovered_shards(out: Any) -> dict[str, bool]:
    """Each shard of ``out`` no index part covers -> whether a kill explains it (the single shard of its rank
    above every part of that rank). Without a local ``index/`` no kill explains any."""
    shards = [n for n in list_names(out / SHARD_DIR) if SHARD_RE.match(n)]
    if not shards:
        return {}
    names = list_names(out / INDEX_DIR)
    referenced = referenced_shards(out)
    top: dict[int, int] = {}  # rank -> its highest part sequence number (live or superseded)
    for name in names:
        span = part_span(name)
        if span is not None:
            top[span[0]] = max(top.get(span[0], -1), span[2])
    above: dict[int, list[str]] = {}
    found: dict[str, bool] = {}
    for name in shards:
        if referenced(name):
            continue
        m = SHARD_RE.match(name)
        rank, seq = int(m.group(1)), int(m.group(2))
        found[name] = False
        if seq > top.get(rank, -1):
            above.setdefault(rank, []).append(name)
    index_is_there = not is_local(out) or (out / INDEX_DIR).is_dir()
    for rank, names_above in above.items():
        # A rank with no part: its one shard may be a kill's or a lost index's; not told apart, not deleted.
        if len(names_above) == 1 and index_is_there and rank in top:
            found[names_above[0]] = True
    return found


def find_strays(out: Any, *, uncovered: bool = True) -> list[Stray]:
    """Everything in ``out`` not where the format puts it, in a stable order: folders that are not folders,
    files that are not files, and with ``uncovered`` the shards no index part covers."""
    strays = [
        Stray(
            p,
            f"{p.name} is {'a dangling link' if p.is_symlink() else 'a file'}, not a folder",
            "not_a_folder",
            top=True,
        )
        for p in not_folders(out)
    ]
    strays += [
        Stray(p, f"{p.name} is a folder, not a file", "not_a_file", top=p.parent == out)
        for p in not_files(out)
    ]
    shards = uncovered_shards(out) if uncovered else {}
    for name in sorted(shards):
        why = (
            "no index part covers it: what a run killed between a shard and its index part leaves (the next "
            "run of its rank removes it)"
            if shards[name]
            else "no index part covers it: its index part was deleted or lost"
        )
        if not is_local(out):
            why += " (or a live writer's upload whose index part is on its way)"
        strays.append(Stray(out / SHARD_DIR / name, why, "uncovered", int(SHARD_RE.match(name).group(1))))
    return strays
