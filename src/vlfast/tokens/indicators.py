"""Per-row indicators of never-trained embedding rows, computed in one streaming pass per matrix.

For every row of a (V, D) matrix: its L2 norm, its largest absolute value (Unsloth's zero test), the
Magikarp cosine distance to the mean of the known-unused rows after removing the first principal
component (Land & Bartolo 2024), and which other row it duplicates bit for bit. Only a few blocks of
rows are in memory at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vlfast.tokens.weights import CheckpointWeights

ZERO_MAX_ABS = 1e-16  # Unsloth's `fix_untrained_tokens` threshold: a row whose max |x| is below is unset
PCA_SAMPLE_BLOCKS = 32  # the first principal component is estimated from this many blocks of rows...
PCA_BLOCK_ROWS = 256  # ... of this many rows each (8,192 rows): the top direction is that dominant
POWER_ITERATIONS = 30
HASH_COLUMNS = 256  # duplicate candidates are found by hashing the raw bits of this many columns


@dataclass
class MatrixStats:
    """Indicator arrays for every row of one matrix; `cos_distance` is None when it can't be defined."""

    name: str
    norm: np.ndarray  # (V,) float32
    max_abs: np.ndarray  # (V,) float32
    cos_distance: np.ndarray | None  # (V,) float32, Magikarp indicator; low = like the unused rows
    duplicate_of: np.ndarray  # (V,) int64: smallest other row with identical values, -1 if unique
    cos_note: str | None = None  # why cos_distance is None
    held_out: list[int] | None = None  # reference rows left out of the mean, to judge the indicator

    def __post_init__(self) -> None:
        n = len(self.norm)
        for key in ("max_abs", "duplicate_of"):
            if len(getattr(self, key)) != n:
                raise ValueError(f"MatrixStats.{key} has {len(getattr(self, key))} rows, norm has {n}")
        if self.cos_distance is not None and len(self.cos_distance) != n:
            raise ValueError("MatrixStats.cos_distance does not have one value per row")

    @property
    def rows(self) -> int:
        return len(self.norm)


def first_principal_component(weights: CheckpointWeights, name: str) -> torch.Tensor:
    """Unit vector (D,) of the top principal direction, from evenly spread blocks of rows."""
    n, _ = weights.shape(name)
    per = min(PCA_BLOCK_ROWS, n)
    starts = np.unique(
        np.linspace(0, max(0, n - per), num=min(PCA_SAMPLE_BLOCKS, max(1, n // per))).astype(int)
    )
    ids = sorted({int(s) + k for s in starts for k in range(per) if int(s) + k < n})
    sample = weights.rows(name, ids)  # (S, D)
    sample = sample - sample.mean(0)
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(sample.shape[1], generator=gen)
    # Power iteration on the centred sample's covariance: two thin mat-vecs per step, no D x D matrix.
    for _ in range(POWER_ITERATIONS):
        v = sample.T @ (sample @ v)
        norm = v.norm()
        if norm == 0:
            break
        v = v / norm
    return v


def matrix_stats(
    weights: CheckpointWeights, name: str, reference_ids: list[int], block_rows: int = 8192
) -> MatrixStats:
    """Stream `name` once and return its indicator arrays."""
    n, d = weights.shape(name)
    cos_note = None
    direction = None
    held_out = None
    if not reference_ids:
        cos_note = "no known-unused reference rows"
    else:
        pc = first_principal_component(weights, name)
        # The mean comes from every other reference row; the rest are held out, so that how far the
        # reference rows sit from the mean is not flattered by their own contribution to it.
        held_out = list(reference_ids[1::2]) if len(reference_ids) > 1 else list(reference_ids)
        ref_mean = weights.rows(name, list(reference_ids[::2])).mean(0)
        ref_perp = ref_mean - (ref_mean @ pc) * pc
        # Zero reference rows (a padded vocabulary left at 0) have no direction to compare with.
        if ref_perp.norm() <= 1e-12 * max(1.0, float(ref_mean.norm())):
            cos_note = "the reference rows average to zero (all-zero padding); no direction to compare"
        else:
            direction = torch.stack([pc, ref_perp / ref_perp.norm()], dim=1)  # (D, 2)

    norm = np.empty(n, np.float32)
    max_abs = np.empty(n, np.float32)
    cos = np.empty(n, np.float32) if direction is not None else None
    hashes = np.empty(n, np.uint64)
    coeffs = np.random.default_rng(0).integers(1, 2**63 - 1, size=min(d, HASH_COLUMNS), dtype=np.int64) | 1

    sl = weights._handle(name).get_slice(name)
    for start in range(0, n, block_rows):
        raw = sl[start : min(n, start + block_rows)]  # (b, D) in the stored dtype
        stop = start + raw.shape[0]
        x = raw.float()
        norm[start:stop] = torch.linalg.vector_norm(x, dim=1).numpy()
        lo, hi = torch.aminmax(x, dim=1)
        max_abs[start:stop] = torch.maximum(lo.abs(), hi.abs()).numpy()
        if direction is not None:
            proj = x @ direction  # (b, 2): along the first PC, along the reference mean
            sq = norm[start:stop].astype(np.float64) ** 2
            perp = np.sqrt(np.maximum(sq - proj[:, 0].double().numpy() ** 2, 1e-30))
            # The reference direction is orthogonal to the PC, so <x - (x.p)p, m> = <x, m>.
            cos[start:stop] = 1.0 - proj[:, 1].double().numpy() / perp
        hashes[start:stop] = _row_hashes(raw[:, :HASH_COLUMNS], coeffs)
    duplicate_of = _duplicates(weights, name, hashes)
    return MatrixStats(name, norm, max_abs, cos, duplicate_of, cos_note, held_out)


def _row_hashes(raw: torch.Tensor, coeffs: np.ndarray) -> np.ndarray:
    # Hash the stored bits, not float values: identical rows must hash identically whatever the
    # blocking or BLAS kernel, and integer arithmetic wraps deterministically.
    width = raw.element_size()
    ints = (
        raw.contiguous().view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]).numpy()
    )
    with np.errstate(over="ignore"):
        return (ints.astype(np.int64) * coeffs[: ints.shape[1]]).sum(axis=1).view(np.uint64)


def _duplicates(weights: CheckpointWeights, name: str, hashes: np.ndarray) -> np.ndarray:
    duplicate_of = np.full(len(hashes), -1, np.int64)
    order = np.argsort(hashes, kind="stable")
    sorted_hashes = hashes[order]
    bounds = np.flatnonzero(np.diff(sorted_hashes)) + 1
    for group in np.split(order, bounds):
        if len(group) < 2:
            continue
        ids = sorted(int(i) for i in group)
        rows = weights.rows(name, ids)  # exact check: equal hashes on a column subset are candidates
        _, inverse = torch.unique(rows, dim=0, return_inverse=True)
        for cls in inverse.unique():
            members = [ids[k] for k in torch.nonzero(inverse == cls).flatten().tolist()]
            if len(members) > 1:
                for m in members:
                    duplicate_of[m] = min(x for x in members if x != m)
    return duplicate_of
