"""Timing that is honest on every device: :func:`measure` synchronises around each call, discards warm-ups
and stops once a budget is spent (a pathologically slow kernel is timed once instead of hanging the caller);
:class:`Clock` marks points inside one run without synchronising in between on CUDA.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vlfast.errors import InputRefused

__all__ = ["Clock", "Timing", "measure", "synchronize"]


def _device(device: str | torch.device | None) -> torch.device:
    return torch.device(device) if device is not None else torch.device("cpu")


def synchronize(device: str | torch.device | None = None) -> None:
    """Wait for all queued work on ``device`` (a no-op on CPU)."""
    dev = _device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":
        torch.mps.synchronize()
    elif dev.type == "xpu" and hasattr(torch, "xpu"):
        torch.xpu.synchronize(dev)


@dataclass(frozen=True)
class Timing:
    """Wall times of the timed calls (warm-up excluded unless the budget allowed only one call)."""

    times_ms: tuple[float, ...]
    warmup: int = 0  # calls run and discarded before the timed ones
    budget_hit: bool = False  # repeats stopped early because the time budget was spent
    first_call: bool = False  # the only timing is the first call (too slow to repeat; includes setup)

    def __post_init__(self) -> None:
        if not self.times_ms:
            raise ValueError("Timing needs at least one time")

    @property
    def n(self) -> int:
        return len(self.times_ms)

    @property
    def median_ms(self) -> float:
        return float(statistics.median(self.times_ms))

    @property
    def min_ms(self) -> float:
        return float(min(self.times_ms))

    def to_dict(self) -> dict[str, Any]:
        return {
            "median_ms": self.median_ms,
            "min_ms": self.min_ms,
            "n": self.n,
            "warmup": self.warmup,
            "budget_hit": self.budget_hit,
            "first_call": self.first_call,
        }


def timed_call(fn: Callable[[], Any], dev: torch.device) -> float:
    """Milliseconds of one call of ``fn``, with the device idle before and after."""
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(dev)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))
    synchronize(dev)
    t0 = time.perf_counter()
    fn()
    synchronize(dev)
    return (time.perf_counter() - t0) * 1e3


def measure(
    fn: Callable[[], Any],
    *,
    device: str | torch.device | None = None,
    warmup: int = 1,
    repeats: int = 10,
    budget_s: float | None = None,
    min_repeats: int = 1,
) -> Timing:
    """Time ``fn()``: ``warmup`` discarded calls, then up to ``repeats`` timed calls, garbage collection off.

    With ``budget_s``, no call starts once the calls so far used it (after ``min_repeats`` timed ones). A
    first warm-up call over half the budget is the measurement (``Timing.first_call``): a 16-second conv
    costs 16 seconds, not 16 x (warm-up + repeats).
    """
    if repeats < 1 or warmup < 0 or min_repeats < 1:
        raise InputRefused(
            f"need repeats >= 1, warmup >= 0, min_repeats >= 1; got {repeats}, {warmup}, {min_repeats}"
        )
    if budget_s is not None and budget_s <= 0:
        raise InputRefused(f"budget_s must be positive, got {budget_s}")
    dev = _device(device)
    gc_was_enabled = gc.isenabled()
    gc.disable()  # as timeit does: a collection triggered inside one call is not that call's cost
    try:
        spent_ms = 0.0
        for i in range(warmup):
            ms = timed_call(fn, dev)
            spent_ms += ms
            if i == 0 and budget_s is not None and ms > 0.5 * budget_s * 1e3:
                return Timing((ms,), warmup=0, budget_hit=True, first_call=True)
        times: list[float] = []
        budget_hit = False
        while len(times) < repeats:
            if budget_s is not None and len(times) >= min_repeats and spent_ms >= budget_s * 1e3:
                budget_hit = True
                break
            ms = timed_call(fn, dev)
            spent_ms += ms
            times.append(ms)
        return Timing(tuple(times), warmup=warmup, budget_hit=budget_hit)
    finally:
        if gc_was_enabled:
            gc.enable()


@dataclass
class Clock:
    """Marks inside one run, resolved to milliseconds after it: ``mark()`` records a CUDA event (no
    synchronisation) or reads ``perf_counter`` (after a synchronisation on MPS, which has no public timing
    events); call ``finish()`` once after the run, then ``elapsed_ms(a, b)`` for any two marks."""

    device: str | torch.device | None = None
    _marks: list[Any] = field(default_factory=list, repr=False)
    _finished: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        self._dev = _device(self.device)

    def mark(self) -> int:
        """Record now; returns the mark's index."""
        if self._dev.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._marks.append(ev)
        else:
            synchronize(self._dev)
            self._marks.append(time.perf_counter())
        return len(self._marks) - 1

    def finish(self) -> None:
        synchronize(self._dev)
        self._finished = True

    def elapsed_ms(self, a: int, b: int) -> float:
        if not self._finished:
            raise RuntimeError("Clock.finish() must be called before reading elapsed times")
        ma, mb = self._marks[a], self._marks[b]
        if self._dev.type == "cuda":
            return float(ma.elapsed_time(mb))
        return (mb - ma) * 1e3
