"""From indicator arrays to verdicts: the midpoint rule and each indicator's separation (Youden's J), as
docs/tokens.md states them (direction-free; non-finite values left out of every median and separation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from vlfast.errors import InputRefused

if TYPE_CHECKING:  # pragma: no cover - indicators imports torch, which a refusal must not wait for
    from vlfast.tokens.indicators import MatrixStats

VERDICTS = ("trained", "suspect", "untrained")
NORM_FALLBACK_RATIO = 0.5  # without reference rows: a norm below half the ordinary median is "low"
MIN_SEPARATION = 0.5  # Youden's J below which an indicator is not trusted on this checkpoint


def worst(verdicts: list[str]) -> str:
    return max(verdicts, key=VERDICTS.index, default="trained")


@dataclass
class Threshold:
    """How one indicator splits rows: medians of both groups and the cut between them."""

    indicator: str  # "norm" or "cos_distance"
    matrix: str
    ordinary_median: float
    reference_median: float | None
    cut: float
    flag_below: bool  # True: values below `cut` look untrained
    separation: float | None = None  # Youden's J on this checkpoint; None without reference rows

    @property
    def informative(self) -> bool:
        # Without reference rows the norm rule is a fixed ratio; trust it as the only evidence there is.
        return self.separation is None or self.separation >= MIN_SEPARATION

    def flags(self, values: np.ndarray) -> np.ndarray:
        return values < self.cut if self.flag_below else values > self.cut


def _threshold(indicator: str, matrix: str, values: np.ndarray, ordinary: np.ndarray, reference: np.ndarray):
    finite = np.isfinite(values)
    ordinary, reference = ordinary & finite, reference & finite
    if not ordinary.any():
        raise InputRefused(f"every ordinary row of {matrix} holds NaN or inf; the checkpoint is broken")
    o = float(np.median(values[ordinary]))
    if reference.any():
        r = float(np.median(values[reference]))
        t = Threshold(indicator, matrix, o, r, (o + r) / 2, r < o)
        t.separation = float(t.flags(values[reference]).mean() - t.flags(values[ordinary]).mean())
        return t
    if indicator == "norm":
        return Threshold(indicator, matrix, o, None, NORM_FALLBACK_RATIO * o, True)
    return None


@dataclass
class Judge:
    """Verdicts for rows of a checkpoint, given the indicator arrays of its one or two matrices."""

    input_stats: MatrixStats
    output_stats: MatrixStats | None  # None when tied: the input matrix serves both roles
    norm: Threshold
    cos: Threshold | None
    cos_note: str | None = None

    @classmethod
    def fit(
        cls,
        input_stats: MatrixStats,
        output_stats: MatrixStats | None,
        ordinary: np.ndarray,
        reference: np.ndarray,
    ) -> Judge:
        """`ordinary` and `reference` are boolean masks over rows (disjoint)."""
        if not ordinary.any():
            raise InputRefused(
                "no ordinary rows to compare with: the reference set covers the whole vocabulary"
            )
        norm = _threshold("norm", input_stats.name, input_stats.norm, ordinary, reference)
        out = output_stats or input_stats
        cos = None
        if out.cos_distance is not None:
            held_out = np.zeros_like(reference)
            held_out[out.held_out or []] = True
            cos = _threshold("cos_distance", out.name, out.cos_distance, ordinary, held_out & reference)
        return cls(input_stats, output_stats, norm, cos, out.cos_note)

    def flags(self, ids: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Boolean flag arrays for rows `ids` (all rows when None)."""
        sel = slice(None) if ids is None else np.asarray(ids, dtype=np.int64)
        stats = [self.input_stats] + ([self.output_stats] if self.output_stats is not None else [])
        out = self.output_stats or self.input_stats
        f = {
            "non-finite": np.logical_or.reduce([~s.finite[sel] for s in stats]),
            "zero": np.logical_or.reduce([s.zero[sel] for s in stats]),
            "duplicate": np.logical_or.reduce([s.duplicate_of[sel] >= 0 for s in stats]),
            "low-norm": self.norm.flags(self.input_stats.norm[sel]),
        }
        if self.cos is not None:
            f["near-unused"] = self.cos.flags(out.cos_distance[sel])
        return f

    def verdicts(self, ids: np.ndarray | None = None) -> np.ndarray:
        """Array of 0 (trained), 1 (suspect), 2 (untrained) per row."""
        f = self.flags(ids)
        thresholds = {"low-norm": self.norm, "near-unused": self.cos}
        trusted = [f[k] for k, t in thresholds.items() if k in f and t.informative]
        some = np.logical_or.reduce([f[k] for k in thresholds if k in f])
        every = np.logical_and.reduce(trusted) if trusted else np.zeros_like(some)
        hard = f["non-finite"] | f["zero"] | f["duplicate"]
        return np.where(hard | every, 2, np.where(some, 1, 0))
