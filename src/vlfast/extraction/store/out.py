"""OUT, opened once per run: :class:`Out`, the one door through which the planner, the engines and the sources
learn what an extraction folder holds.

Nothing outside ``extraction/store/`` names OUT's files or parses run.json; they ask an :class:`Out`, which
reads run.json once and refuses an OUT of another format before anything is written
(:class:`~vlfast.extraction.store.format.OldFormat`, exit 2).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from vlfast.errors import InputRefused
from vlfast.extraction.store.format import (
    ERROR_DIR,
    INDEX_DIR,
    LISTING_DIR,
    PART_RE,
    QUARANTINE_DIR,
    RUN_FILE,
    SHARD_DIR,
    SHARD_RE,
    DamagedFile,
    committed_parts,
    is_local,
    list_names,
    read_errors,
    read_run_file,
    resolve_out,
)
from vlfast.extraction.store.layout import find_strays, refuse_misplaced

__all__ = ["Out"]

_UNREAD = object()


class Out:
    """One extraction folder, local or on object storage, as a run sees it. ``path`` is the resolved OUT
    (a ``Path``, or a ``UPath`` carrying its storage options)."""

    def __init__(self, path: Any):
        self.path = path
        self._run: Any = _UNREAD
        self._damage: Exception | None = None  # what reading run.json raised, where it is damaged

    @classmethod
    def open(
        cls, out: Any, storage_options: Mapping[str, Any] | None = None, *, check_format: bool = True
    ) -> Out:
        """OUT resolved and probed (:meth:`reach`), and with ``check_format`` an OUT of another format
        refused: reads only."""
        if isinstance(out, Out):
            return out
        store = cls(cls.reach(out, storage_options))
        path = store.path
        refuse_misplaced(path, overwrite=not check_format)  # a file where a folder belongs: what to move
        if not check_format:  # --overwrite: what OUT holds is replaced, never read
            store._run = None
            return store
        # OldFormat (or a newer vlfast's) here, before anything else is read or written
        if store.run_file() is None and (not store.local or path.is_dir()):
            store._check_parts_format()
        return store

    @staticmethod
    def reach(out: Any, storage_options: Mapping[str, Any] | None = None) -> Any:
        """OUT resolved; on object storage probed first (reachable, its bucket there), so a wrong endpoint is
        named before any work."""
        path = resolve_out(out, dict(storage_options) if storage_options else None)
        if not is_local(path):
            from vlfast.extraction.objstore import probe_out

            probe_out(path)
        return path

    @staticmethod
    def _shown(out: str, name: str) -> str:
        """OUT's folder ``name`` as the user would name it, from OUT as typed (a URL keeps its ``//``)."""
        from vlfast.extraction.objstore import is_url

        return f"{out.rstrip('/')}/{name}" if is_url(out) else str(Path(out) / name)

    @classmethod
    def errors_shown(cls, out: str) -> str:
        return cls._shown(out, ERROR_DIR)

    @classmethod
    def quarantine_shown(cls, out: str) -> str:
        return cls._shown(out, QUARANTINE_DIR)

    def _check_parts_format(self) -> None:
        """Where run.json is lost, the format the first index part records (its footer alone)."""
        from vlfast.extraction.store.format import META_FORMAT, check_version, read_part_footer

        parts = committed_parts(self.path)
        raw = read_part_footer(parts[0]) if parts else None
        if raw is not None and META_FORMAT in raw:
            try:
                version: Any = int(raw[META_FORMAT])
            except ValueError:
                return  # a damaged footer: the part is judged (and moved aside) when a store opens
            check_version(self.path, version)

    def __str__(self) -> str:
        return str(self.path)

    @property
    def local(self) -> bool:
        return is_local(self.path)

    def run_file(self, *, strict: bool = False) -> dict | None:
        """run.json parsed and checked, read once. None: OUT has none, or (unless ``strict``, which raises
        what reading it raised) it is damaged. An OUT of another format is refused here."""
        if self._run is _UNREAD:
            try:
                self._run = read_run_file(self.path)
            except FileNotFoundError:
                self._run = None
            except (NotADirectoryError, DamagedFile) as e:
                self._run, self._damage = None, e
        if strict and self._damage is not None:
            raise self._damage
        return self._run

    def recorded_config(self) -> dict[str, Any] | None:
        """The configuration OUT records: run.json's, or the first index part's if run.json is lost; None if
        there is none or it cannot be read."""
        from vlfast.extraction.store.resume import first_part_config

        run = self.run_file()
        if run is not None:
            recorded = run.get("config")
        else:
            try:
                recorded = first_part_config(committed_parts(self.path)) if self.path.exists() else None
            except (InputRefused, OSError):
                return None
        return recorded if isinstance(recorded, dict) else None

    def errors(self) -> list[dict]:
        """Every rank's error records as they stand (``format.read_errors``)."""
        return read_errors(self.path)

    def error_keys(self) -> set[tuple]:
        """(id, source, reason, kind) of every error record OUT holds."""
        from vlfast.extraction.store.format import error_key

        return {error_key(r) for r in self.errors()}

    def live_ranks(self) -> list[int]:
        """The ranks a live process holds now ([] on object storage, which has no locks)."""
        from vlfast.extraction.store.backend import live_ranks

        return live_ranks(self.path)

    def rank_is_held(self, rank: int) -> bool:
        from vlfast.extraction.store.backend import rank_is_held

        return rank_is_held(self.path, rank)

    def highest_rank(self) -> int:
        """The highest rank any index part or shard of OUT carries (0 for none)."""
        seen = [0]
        for folder, rx in ((INDEX_DIR, PART_RE), (SHARD_DIR, SHARD_RE)):
            seen += [int(m.group(1)) for n in list_names(self.path / folder) if (m := rx.match(n))]
        return max(seen)

    @property
    def listings_folder(self) -> Any:
        """Where OUT keeps WebDataset shard listings (``sources.kept.KeptListings.of_folder`` reads it)."""
        return self.path / LISTING_DIR

    def keep_listings(self, listings: Mapping[str, bytes], tag: str) -> None:
        """Keep fresh shard listings in OUT (best effort: a read-only OUT keeps none)."""
        from vlfast.extraction.store.backend import keep_listings

        keep_listings(self.path, listings, tag)

    def strays(self, *, uncovered: bool = True) -> list[Any]:
        """Everything in OUT that is not where the format puts it (``layout.find_strays``)."""
        return find_strays(self.path, uncovered=uncovered)

    def restore_run_file(
        self, run_config: Mapping[str, Any], volatile_keys: Collection[str], tag: str
    ) -> bool:
        """Write run.json where a finished OUT lost it, whole or not at all; whether it was written. Best
        effort: a read-only OUT keeps none (its readers say how to get it back)."""
        from vlfast.extraction.store.backend import backend_for
        from vlfast.extraction.store.resume import canonical_config
        from vlfast.extraction.store.run_file import library_versions, run_file_bytes

        path = self.path / RUN_FILE
        if path.exists():
            return False
        data = run_file_bytes(canonical_config(dict(run_config)), volatile_keys, library_versions())
        try:
            backend_for(self.path, tag).write(path, data, tag)
        except OSError:
            return False
        return True
