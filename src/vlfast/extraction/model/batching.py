"""Packing preprocessed samples into batches by token budget, and surviving out-of-memory batches.

The vision tower takes one flat sequence of patches (``grid_thw`` marks where each sample begins), so a
batch costs what its patches cost: batches are filled greedily, in arrival order, up to ``max_tokens``
patches. A batch that runs out of memory is split in half and each half retried; a sample that fails
alone is reported to the caller as an error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Generic, TypeVar

from vlfast.errors import InputRefused

__all__ = ["TokenBudget", "is_oom", "pack", "pack_padded", "run_split_on_oom"]

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class TokenBudget:
    """How much one forward may hold: ``max_tokens`` patches and at most ``max_samples`` samples."""

    max_tokens: int = 16_384
    max_samples: int = 64

    def __post_init__(self) -> None:
        for name, value in (("max_tokens", self.max_tokens), ("max_samples", self.max_samples)):
            if not isinstance(value, int) or value < 1:
                raise InputRefused(f"{name} must be a positive int, got {value!r}")


def pack(
    items: Iterable[T], cost: Callable[[T], int], budget: TokenBudget, *, first_alone: bool = False
) -> Iterator[list[T]]:
    """Greedy in-order packing: yield a batch as soon as the next item would overflow the budget.
    ``first_alone`` yields the first item by itself, so the model starts as soon as one sample is ready."""
    batch: list[T] = []
    used = 0
    items = iter(items)
    if first_alone:
        yield from ([item] for item in islice(items, 1))
    for item in items:
        c = int(cost(item))
        if batch and (used + c > budget.max_tokens or len(batch) >= budget.max_samples):
            yield batch
            batch, used = [], 0
        batch.append(item)
        used += c
    if batch:
        yield batch


def pack_padded(
    items: Iterable[T],
    length: Callable[[T], int],
    budget: TokenBudget,
    *,
    window: int | None = None,
    first_alone: bool = False,
) -> Iterator[list[T]]:
    """Batches for a model that pads each row to the batch's longest (the whole VLM for ``llm`` and
    ``embedding``): a batch costs ``len(batch) * longest``, which must fit ``max_tokens``.

    Items are taken ``window`` at a time (default ``4 * max_samples``) and sorted by length, so rows of like
    length share a batch; a batch also ends where the next row is over ``1 + max_padding`` times its
    shortest. Only the order within a window changes. ``first_alone`` as in :func:`pack`.
    """
    max_padding = 0.25
    window = window or 4 * budget.max_samples
    held: list[T] = []

    def flush() -> Iterator[list[T]]:
        held.sort(key=length)
        batch: list[T] = []
        for item in held:
            longest = max(length(batch[-1]), length(item)) if batch else length(item)
            full = (len(batch) + 1) * longest > budget.max_tokens or len(batch) >= budget.max_samples
            if batch and (full or length(item) > (1 + max_padding) * length(batch[0])):
                yield batch
                batch = []
            batch.append(item)
        if batch:
            yield batch
        held.clear()

    items = iter(items)
    if first_alone:
        yield from ([item] for item in islice(items, 1))
    for item in items:
        held.append(item)
        if len(held) >= window:
            yield from flush()
    yield from flush()


def is_oom(error: BaseException) -> bool:
    """An allocator failure on any device (CUDA, MPS, XPU, CPU), by type or by message."""
    import torch  # here, not at the top: TokenBudget is part of a configuration made before torch loads

    oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    if isinstance(error, MemoryError) or (oom_type is not None and isinstance(error, oom_type)):
        return True
    if isinstance(error, RuntimeError):
        msg = str(error).lower()
        return "out of memory" in msg or "can't allocate memory" in msg or "failed to allocate" in msg
    return False


class Failed(Generic[T]):
    """An item that ran out of memory even alone; ``error`` is the allocator's message (text only: the
    exception would keep the failed forward's frames, and their tensors, alive)."""

    def __init__(self, item: T, error: str):
        self.item, self.error = item, error


def run_split_on_oom(
    batch: Sequence[T],
    fn: Callable[[Sequence[T]], list[R]],
    *,
    on_oom: Callable[[int], None] | None = None,
) -> list[R | Failed[T]]:
    """``fn(batch)``, splitting the batch in halves on out-of-memory until single samples fail.

    Returns one entry per item, in order: ``fn``'s result, or a :class:`Failed` when even that item alone
    does not fit. Other exceptions propagate. The halves run after the ``except`` block has ended: the
    traceback holds the failed attempt's activations, which a retry inside the handler would still hold.
    """
    try:
        out = fn(batch)
        if len(out) != len(batch):
            raise RuntimeError(f"batch function returned {len(out)} results for {len(batch)} items")
        return list(out)
    except Exception as e:  # noqa: BLE001 - only OOM is handled, the rest is re-raised
        if not is_oom(e):
            raise
        message = str(e)
    # Here the exception and its traceback are gone: the failed attempt's tensors are free.
    _free_device_memory()
    if on_oom is not None:
        on_oom(len(batch))
    if len(batch) == 1:
        return [Failed(batch[0], message)]
    half = len(batch) // 2
    return run_split_on_oom(batch[:half], fn, on_oom=on_oom) + run_split_on_oom(
        batch[half:], fn, on_oom=on_oom
    )


def _free_device_memory() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    mps = getattr(torch, "mps", None)
    if mps is not None and torch.backends.mps.is_available():
        mps.empty_cache()
