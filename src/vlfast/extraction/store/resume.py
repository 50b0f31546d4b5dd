"""Where a run stands before it writes anything: whose ids are whose, what OUT already holds, what is left.

Read-only throughout, so the pipeline answers a different configuration (``RunConfigMismatch``) or a
finished OUT ("nothing to do") before it takes a lock or builds a model, and a read-only OUT works:
``dist_info`` and ``owner_rank`` split the ids between ranks; ``check_run_config`` compares the
configuration with run.json (or, if it was deleted, with the committed index parts); ``plan_positions``
says what this rank has left; ``read_state`` what OUT holds (the quick check); ``confirm_hashed`` is the
full check of a finished OUT. The writer runs the same checks again under its lock.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vlfast.errors import InputRefused
from vlfast.extraction.ids import (  # owner_rank and partition re-exported: callers import them from here
    ArrowStrings,
    IdSet,
    first_copies,
    hash_ids,
    owner_rank,
    partition,
)
from vlfast.extraction.store.backend import live_ranks, strays_to_move
from vlfast.extraction.store.format import (
    RUN_FILE,
    DamagedFile,
    check_version,
    committed_parts,
    config_hash,
    done_by_error,
    error_key,
    gc_paused,
    is_consolidated,
    is_local,
    map_parts,
    part_meta,
    read_errors,
    read_index_part,
    read_run_file,
    resolve_out,
    shard_of_part,
    split_parts,
    stable_config,
)
from vlfast.extraction.store.integrity import HashRecord, check_part

__all__ = [
    "DEFAULT_VOLATILE_KEYS",
    "OutState",
    "RunConfigMismatch",
    "canonical_config",
    "check_run_config",
    "config_diffs",
    "confirm_hashed",
    "dist_info",
    "first_part_config",
    "duplicate_reason",
    "owner_rank",
    "owned",
    "partition",
    "plan_positions",
    "read_state",
    "unique_positions",
]

# Top-level run-config keys allowed to differ on resume (a user upgrading mid-job changes no meaning).
DEFAULT_VOLATILE_KEYS: tuple[str, ...] = ("versions", "library_versions", "created", "host")


class RunConfigMismatch(InputRefused):
    """OUT already holds an extraction whose configuration differs from the one requested."""

    def __init__(
        self,
        out: Path,
        diffs: list[tuple[str, Any, Any]],
        where: str | None = None,
        *,
        foreign: Path | None = None,
        run_file_odd: str | None = None,
    ):
        self.out = out
        self.diffs = diffs
        self.where = where or str(out / RUN_FILE)
        # An index part of another configuration in an OUT whose run.json agrees: named, to be moved out.
        self.foreign = foreign
        # run.json disagrees with every index part, and they agree with each other: it was replaced or
        # edited. "parts": they agree with this run; "request": run.json does, they do not.
        self.run_file_odd = run_file_odd
        # How to start over, in the caller's words: the CLI replaces it with its flag.
        self.remedy = "pass overwrite=True (CLI: --overwrite) to delete the existing shards and start again"
        super().__init__(out, diffs)

    def __str__(self) -> str:
        lines = [f"  {key}: {old!r} in {self.where} vs {new!r} now" for key, old, new in self.diffs]
        if not lines:
            lines = [f"  {self.where} carries another configuration hash"]
        run_file = self.out / RUN_FILE
        if self.run_file_odd == "parts":
            return (
                f"{run_file} differs from this run's configuration, but every index part of {self.out} carries "
                "this run's: run.json was replaced or edited since they were written.\n"
                + "\n".join(lines)
                + f"\nMove it aside (mv {run_file} {run_file}.replaced) and run the same command again: it "
                "writes run.json anew from the index parts; nothing is extracted again."
            )
        if self.run_file_odd == "request":
            return (
                f"{run_file} agrees with this run, but none of the index parts of {self.out} does: they carry "
                "another configuration, so run.json was replaced or edited since they were written.\n"
                + "\n".join(lines)
                + f"\nTo keep their samples, move run.json aside (mv {run_file} {run_file}.replaced) and run the "
                f"command that wrote them (its values are the ones 'in' the part above); to extract with this "
                f"configuration, use a new OUT, or {self.remedy}."
            )
        if self.foreign is not None:
            shard = (
                "the shards it points at" if is_consolidated(self.foreign) else shard_of_part(self.foreign)
            )
            return (
                f"{self.out} mixes two extractions: {RUN_FILE} agrees with this run, but an index part does not:\n"
                + "\n".join(lines)
                + f"\nMove {self.foreign} and {shard} out of {self.out} (they belong to another run), then run "
                f"again; or use a new OUT, or {self.remedy}."
            )
        return (
            f"{self.out} already holds an extraction with a different configuration:\n"
            + "\n".join(lines)
            + f"\nResuming would mix incompatible features. Use a new OUT, or {self.remedy}."
        )


# ----------------------------------------------------------------------------------------------------
# scale-out helpers


def dist_info() -> tuple[int, int]:
    """(rank, world_size): torch.distributed if initialised, else env RANK/WORLD_SIZE (torchrun), else (0, 1).
    Imports no torch."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError as e:
        raise InputRefused(f"RANK/WORLD_SIZE must be integers: {e}") from None
    if world < 1 or not 0 <= rank < world:
        raise InputRefused(f"inconsistent RANK={rank} WORLD_SIZE={world} in the environment")
    return rank, world


def canonical_config(obj: Any) -> Any:
    """JSON round trip: tuples become lists, keys become strings, so stored and new configs compare equal."""
    try:
        return json.loads(json.dumps(obj, sort_keys=True))
    except (TypeError, ValueError) as e:
        raise InputRefused(f"run_config must be JSON-serialisable: {e}") from None


def _flat_diff(old: Any, new: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[tuple[str, Any, Any]] = []
        for key in sorted(set(old) | set(new)):
            sub = f"{prefix}.{key}" if prefix else key
            if key not in old:
                out.append((sub, "<missing>", new[key]))
            elif key not in new:
                out.append((sub, old[key], "<missing>"))
            else:
                out.extend(_flat_diff(old[key], new[key], sub))
        return out
    return [] if old == new else [(prefix or "<root>", old, new)]


def _is_volatile(key: str, volatile: Collection[str]) -> bool:
    parts = key.split(".")
    return any(".".join(parts[: i + 1]) in volatile for i in range(len(parts)))


def config_diffs(run_config: dict, old: dict, volatile: Collection[str]) -> list[tuple[str, Any, Any]]:
    """What differs between ``run_config`` and ``old`` (key, old, new), volatile keys left out."""
    return [d for d in _flat_diff(old, run_config) if not _is_volatile(d[0], volatile)]


def check_run_config(
    out: str | os.PathLike,
    run_config: Mapping[str, Any],
    volatile_keys: Collection[str] = DEFAULT_VOLATILE_KEYS,
    *,
    held_rank: int | None = None,
    run: Any = None,
) -> bool:
    """Refuse (RunConfigMismatch) if ``out`` holds a run of another configuration; reads only. The
    configuration is run.json's, or if it was deleted the committed parts'; a run.json nothing depends on (no
    part, no error record, no live rank) is answered as absent, so the corrected command replaces it.
    Returns whether run.json exists and holds this configuration. ``held_rank``: the caller's own locked
    rank. ``run``: OUT's :class:`~vlfast.extraction.store.out.Out`, whose run.json was read once.
    """
    out = resolve_out(out)
    config = canonical_config(dict(run_config))
    old = run.run_file(strict=True) if run is not None else _run_file_or_none(out)
    if old is not None:
        diffs = config_diffs(config, old.get("config", {}), volatile_keys)
        if not diffs:
            return True
        parts = committed_parts(out)
        if parts and not config_diffs(config, first_part_config(parts) or {}, volatile_keys):
            raise RunConfigMismatch(out, diffs, run_file_odd="parts")
        if parts or read_errors(out) or any(r != held_rank for r in live_ranks(out)):
            raise RunConfigMismatch(out, diffs)
        return False
    first = first_part(committed_parts(out))  # a damaged part is judged (and moved aside) when a store opens
    if first is not None:
        part, meta = first
        check_version(out, meta["format_version"])
        diffs = config_diffs(config, meta["config"], volatile_keys)
        if diffs:
            raise RunConfigMismatch(out, diffs, where=f"{part} ({RUN_FILE} is missing)")
    return False


def _run_file_or_none(out: Path) -> dict | None:
    try:
        return read_run_file(out)
    except FileNotFoundError:
        return None


def first_part(parts: Sequence[Path]) -> tuple[Path, dict[str, Any]] | None:
    """The first readable index part of ``parts`` and its metadata (``format.part_meta``); None: none is."""
    for part in parts:
        try:
            return part, part_meta(read_index_part(part, ["id"]))
        except (DamagedFile, TypeError, ValueError):
            continue
    return None


def first_part_config(parts: Sequence[Path]) -> dict | None:
    """The configuration the first readable index part carries (None: none is readable)."""
    first = first_part(parts)
    return first[1]["config"] if first is not None else None


def plan_positions(
    ids: Sequence[str],
    rank: int,
    world_size: int,
    done: Collection[str],
    *,
    hashes: np.ndarray | None = None,
    mine: np.ndarray | None = None,
    unique: tuple[np.ndarray, list[tuple[int, int]]] | None = None,
) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """(positions of ``ids`` this rank still has to extract, as an int64 array; (repeat, first) position
    pairs of this rank's repeated ids), in input order. A pure function on the ids as arrays (ten million
    cost seconds); ``hashes`` (:func:`hash_ids`), ``mine`` (:func:`owned`) and ``unique``
    (:func:`unique_positions`, independent of ``done``) may be passed when the caller has them, and ``ids``
    as an :class:`~vlfast.extraction.ids.ArrowStrings` column."""
    import pyarrow as pa

    if isinstance(ids, ArrowStrings):  # a caller planning again passes the column it made the first time
        strings = ids.array
    else:
        strings = pa.array(ids if isinstance(ids, list) else list(ids), pa.large_string())
    hashes = hash_ids(strings) if hashes is None else hashes
    if unique is None:
        mine = owned(ids, rank, world_size) if mine is None else mine
        unique = unique_positions(strings, hashes, mine)
    keep, repeats = unique
    if isinstance(done, IdSet):
        every = len(keep) == len(ids)
        is_done = done.isin(*((strings, hashes) if every else (strings.take(keep), hashes[keep])))
    else:
        is_done = np.fromiter((ids[k] in done for k in keep.tolist()), bool, len(keep))
    return keep[~is_done], repeats


def unique_positions(
    strings: Any, hashes: np.ndarray, mine: np.ndarray
) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """(positions of the first copy of each id among this rank's entries ``mine``, as an int64 array;
    (repeat, first) position pairs of the others), for the ids as an Arrow column and their hashes."""
    positions = np.flatnonzero(mine)
    every = len(positions) == len(strings)  # one rank: no copies of the ids and their hashes
    first = first_copies(*((strings, hashes) if every else (strings.take(positions), hashes[positions])))
    repeat = first != np.arange(len(positions))
    repeats = list(zip(positions[repeat].tolist(), positions[first[repeat]].tolist()))
    return positions[~repeat], repeats


def owned(ids: Sequence[str], rank: int, world_size: int) -> np.ndarray:
    """Whether rank ``rank`` of ``world_size`` owns each of ``ids`` (:func:`owner_rank`), as a bool array.
    An Arrow column is hashed from its UTF-8 bytes, without a ``str`` per id (1.25 s per million, not 1.8)."""
    import pyarrow as pa

    if world_size == 1:
        return np.ones(len(ids), bool)
    if not isinstance(ids, ArrowStrings) or pa.types.is_dictionary(ids.array.type):
        return np.fromiter((owner_rank(sid, world_size) == rank for sid in ids), bool, len(ids))
    blake2b, from_bytes = hashlib.blake2b, int.from_bytes
    values = ids.array.cast(pa.large_binary())  # valid UTF-8: an Arrow string column holds nothing else
    out = np.empty(len(values), bool)
    for k in range(0, len(values), 1 << 16):
        chunk = values.slice(k, 1 << 16).to_pylist()
        out[k : k + len(chunk)] = [
            from_bytes(blake2b(b, digest_size=8).digest(), "big") % world_size == rank for b in chunk
        ]
    return out


def duplicate_reason(k: int, first: int) -> str:
    return f"duplicate id: input entry {k} repeats entry {first}"


@dataclass
class OutState:
    """What an output folder holds, read without a lock or a write (a read-only OUT works)."""

    done: IdSet = field(default_factory=IdSet)  # committed ids and ids recorded as failed
    error_keys: set[tuple] = field(default_factory=set)  # (id, source, reason, kind) already recorded
    damaged: list[str] = field(default_factory=list)  # parts whose shard fails the quick check
    sound: list[Path] = field(default_factory=list)  # parts that pass it
    failed: set[str] = field(default_factory=set)  # ids done by a failure record alone (no part holds them)


@gc_paused()
def read_state(
    out: str | os.PathLike,
    run_config: Mapping[str, Any],
    volatile_keys: Collection[str] = DEFAULT_VOLATILE_KEYS,
    retry: Collection[str] | None = None,
    *,
    rank: int = 0,
    world_size: int = 1,
    run: Any = None,
) -> OutState:
    """Check ``run_config`` against ``out`` and say what it already holds; writes nothing, takes no lock.
    With ``world_size`` > 1, what it holds of the ids rank ``rank`` owns. The quick check finds truncated or
    replaced shards; a part of another configuration is refused (:class:`RunConfigMismatch`). Failures
    ``retry`` selects are not done, nor transient ones. ``run``: OUT's ``Out``, its run.json read once.
    """
    out = resolve_out(out)
    if is_local(out):
        if not out.exists():
            return OutState()
        if not out.is_dir():
            raise NotADirectoryError(f"{out} exists and is not a folder; choose another OUT")
    has_run_file = check_run_config(out, run_config, volatile_keys, run=run)
    config = canonical_config(dict(run_config))
    expected = config_hash(stable_config(config, frozenset(volatile_keys)))
    state = OutState()
    parts = committed_parts(out)
    if world_size > 1:
        skipped = {p.name for p in split_parts(out, parts, rank, world_size)[2]}
        parts = [p for p in parts if p.name not in skipped]
    foreign, agreeing = None, 0
    for part, check in zip(parts, map_parts(out, lambda p: check_part(p, data=False), parts)):
        if check.problem is None and check.config is not None:
            if check.config_hash != expected:
                foreign = foreign or (part, config_diffs(config, check.config, volatile_keys))
                if not has_run_file:
                    break
                continue  # to tell a part added to OUT from a run.json that no part agrees with
            agreeing += 1
        if check.ok:
            state.done.update(check.ids)
            state.sound.append(part)
        else:
            state.damaged.append(part.name)
    if foreign is not None:
        part, diffs = foreign
        odd = "request" if has_run_file and not agreeing else None
        raise RunConfigMismatch(
            out, diffs, where=str(part), foreign=part if has_run_file and not odd else None, run_file_odd=odd
        )
    # What the store would move aside: not "nothing to do"
    state.damaged += strays_to_move(out, lambda r: r % world_size == rank)
    errors = read_errors(out)
    state.failed = {r["id"] for r in errors if done_by_error(r, retry) and r["id"] not in state.done}
    state.done.update(state.failed)
    state.error_keys = {error_key(r) for r in errors}
    return state


def confirm_hashed(out: str | os.PathLike, state: OutState, tag: str = "r00000") -> list[str]:
    """The full check of the parts ``read_state`` found sound, but those :class:`HashRecord` vouches for:
    the names of the parts that fail; the ones that pass are recorded (best effort)."""
    out = resolve_out(out)
    record = HashRecord(out, tag)
    failed: list[str] = []
    try:
        for part in state.sound:
            if record.vouches(part):
                continue
            check = check_part(part, data=True)
            if check.ok:
                record.hashed(part, check.shards)
            else:
                failed.append(part.name)
    finally:
        record.save()
    return failed
