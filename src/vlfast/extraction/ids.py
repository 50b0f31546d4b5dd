"""What a sample id may be, and which rank owns it: the rules the inputs and the store share.

Ids are what OUT keys on (docs/extract.md, "The output format"): UTF-8 text of at most :data:`MAX_ID_BYTES`
bytes. Which rank extracts an id is a hash of the id alone (:func:`owner_rank`), so ranks that list the
inputs in different orders still divide them with no gaps or duplicates.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from vlfast.errors import InputRefused

__all__ = ["MAX_ID_BYTES", "check_id", "owner_rank", "partition"]

MAX_ID_BYTES = 4096  # an id is stored in Parquet, JSON and the shard header; longer ones are refused


def check_id(sample_id: Any) -> str:
    """``sample_id`` if the folder can store it, else ValueError/TypeError saying why."""
    if not isinstance(sample_id, str) or not sample_id:
        raise InputRefused(f"sample_id must be a non-empty str, got {sample_id!r}")
    try:
        n = len(sample_id.encode("utf-8"))
    except UnicodeEncodeError:
        raise InputRefused(f"sample id {sample_id!r} is not valid Unicode text (a lone surrogate)") from None
    if n > MAX_ID_BYTES:
        raise InputRefused(
            f"sample id of {n} bytes is longer than the {MAX_ID_BYTES}-byte limit: {sample_id[:60]!r}..."
        )
    return sample_id


def partition(ids: Sequence[str], rank: int, world_size: int) -> list[str]:
    """The ids rank ``rank`` of ``world_size`` owns, in input order.

    An id's owner is a hash of the id alone (blake2b, not Python's salted ``hash``), so the split does not
    depend on list order or on what other ranks see: ranks that list files in different orders still
    divide the work with no gaps or duplicates, and a repeated id always lands on the same rank, where
    FeatureStore records the repeat as a "duplicate id" error. Partition the FULL id list and then drop
    ``done_ids()``; partitioning only the remaining ids would depend on when each rank looked.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise InputRefused(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InputRefused(f"rank must be in [0, {world_size}), got {rank!r}")
    if world_size == 1:
        return list(ids)
    return [i for i in ids if owner_rank(i, world_size) == rank]


def owner_rank(sample_id: str, world_size: int) -> int:
    digest = hashlib.blake2b(sample_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % world_size
