"""Per-row indicators of never-trained embedding rows (norm, zero, Magikarp cosine, duplicate; docs/tokens.md),
computed in one streaming pass per memory-mapped (V, D) matrix, in blocks small enough to stay in cache.
Rows holding NaN/inf are left out of the principal component and the reference mean, so one broken row
cannot turn every other row's statistics into NaN.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from vlfast.errors import InputRefused
from vlfast.tokens.weights import CheckpointWeights

ZERO_MAX_ABS = 1e-16  # Unsloth's `fix_untrained_tokens` threshold: a row whose max |x| is below is unset
PCA_SAMPLE_ELEMENTS = 16 * 2**20  # the first principal component is fitted on at most this many values:
# every row of a small matrix (30,522 x 384 whole), 4,096 evenly strided rows of a 152k x 4,096 one
POWER_ITERATIONS = 30
HASH_COLUMNS = 256  # duplicate candidates are found by hashing the raw bits of this many columns
BLOCK_ROWS = 1024  # 1,024 x 4,096 fp32 = 16 MiB: the norm, projections and hash reuse it from cache


@dataclass
class MatrixStats:
    """Indicator arrays for every row of one matrix; `cos_distance` is None when it can't be defined."""

    name: str
    norm: np.ndarray  # (V,) float32
    zero: np.ndarray  # (V,) bool: max |x| <= ZERO_MAX_ABS
    cos_distance: np.ndarray | None  # (V,) float32, Magikarp indicator; low = like the unused rows
    duplicate_of: np.ndarray  # (V,) int64: smallest other row with identical values, -1 if unique
    cos_note: str | None = None  # why cos_distance is None
    held_out: list[int] | None = None  # reference rows left out of the mean, to judge the indicator

    @property
    def finite(self) -> np.ndarray:
        """(V,) bool: rows without NaN or inf. A row's norm is finite exactly when all its values are
        (an fp32 overflow of the squares needs values near 1e19, as broken as an inf)."""
        return np.isfinite(self.norm)

    @property
    def rows(self) -> int:
        return len(self.norm)


def first_principal_component(weights: CheckpointWeights, name: str) -> torch.Tensor:
    """Unit vector (D,) of the top principal direction, from all rows or an evenly strided sample (not a
    block: vocabularies are ordered, bytes then merges by frequency, so a block is not a fair sample)."""
    n, d = weights.shape(name)
    keep = max(PCA_SAMPLE_ELEMENTS // d, 1024)
    ids = np.arange(n) if n <= keep else np.unique(np.linspace(0, n - 1, num=keep).astype(np.int64))
    sample = weights.rows(name, ids)  # (S, D)
    # A row sum is non-finite exactly when the row holds NaN/inf (or overflows): an (S,) test, not (S, D).
    finite = torch.isfinite(sample.sum(dim=1))
    if not finite.all():
        sample = sample[finite]
    if not len(sample):
        raise InputRefused(f"every sampled row of {name} holds NaN or inf; the checkpoint is broken")
    sample = sample - sample.mean(0)
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(d, generator=gen)
    # Power iteration by GEMVs: on CPU an (S, D) x (D, k) product with small k takes a slower GEMM path.
    for _ in range(POWER_ITERATIONS):
        v = torch.mv(sample.T, torch.mv(sample, v))
        length = v.norm()
        if length == 0:
            break
        v = v / length
    return v


@contextmanager
def _one_thread() -> Iterator[None]:
    # The pass is memory-bound; torch's waiting OpenMP workers spin, which on a shared 2-core machine cost
    # ~8x the CPU of one thread (a 1,024 x 4,096 block's bf16 -> fp32: 8 ms CPU with 2 threads, 1 ms with 1).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@_one_thread()
def matrix_stats(
    weights: CheckpointWeights, name: str, reference_ids: list[int], block_rows: int = BLOCK_ROWS
) -> MatrixStats:
    """Stream `name` once and return its indicator arrays."""
    n, d = weights.shape(name)
    cos_note = direction = held_out = None
    if not reference_ids:
        cos_note = "no known-unused reference rows"
    else:
        pc = first_principal_component(weights, name)
        # The mean from every other reference row; the rest, held out, judge it without flattering it.
        held_out = list(reference_ids[1::2]) if len(reference_ids) > 1 else list(reference_ids)
        ref_rows = weights.rows(name, list(reference_ids[::2]))  # (R, D)
        ref_rows = ref_rows[torch.isfinite(ref_rows.sum(dim=1))]
        ref_mean = ref_rows.mean(0) if len(ref_rows) else torch.zeros(d)
        ref_perp = ref_mean - (ref_mean @ pc) * pc
        # Zero reference rows (a padded vocabulary left at 0) have no direction to compare with.
        if not len(ref_rows):
            cos_note = "every reference row used for the mean holds NaN or inf"
        elif ref_perp.norm() <= 1e-12 * max(1.0, float(ref_mean.norm())):
            cos_note = "the reference rows average to zero (all-zero padding); no direction to compare"
        else:
            direction = (pc, ref_perp / ref_perp.norm())  # two unit vectors (D,), orthogonal

    norm = np.empty(n, np.float32)
    zero = np.zeros(n, bool)
    cos = np.empty(n, np.float32) if direction is not None else None
    hashes = np.empty(n, np.uint64)
    coeffs = np.random.default_rng(0).integers(1, 2**63 - 1, size=min(d, HASH_COLUMNS), dtype=np.int64) | 1
    # max |x| <= t implies ||x|| <= sqrt(D) t: only rows that short need the exact max.
    zero_norm = math.sqrt(d) * ZERO_MAX_ABS

    matrix = weights.matrix(name)  # (V, D), memory-mapped, stored dtype
    for start in range(0, n, block_rows):
        raw = matrix[start : start + block_rows]
        stop = start + raw.shape[0]
        x = raw.float()  # (b, D)
        nrm = torch.linalg.vector_norm(x, dim=1)
        norm[start:stop] = nrm.numpy()
        short = torch.nonzero(nrm <= zero_norm).flatten()
        if len(short):
            zero[start + short.numpy()] = (x[short].abs().amax(dim=1) <= ZERO_MAX_ABS).numpy()
        if direction is not None:
            along_pc = torch.mv(x, direction[0]).double().numpy()  # (b,)
            along_ref = torch.mv(x, direction[1]).double().numpy()  # (b,)
            with np.errstate(invalid="ignore"):  # inf - inf in a non-finite row: NaN, masked later
                perp = np.sqrt(np.maximum(nrm.double().numpy() ** 2 - along_pc**2, 1e-30))
                # The reference direction is orthogonal to the PC, so <x - (x.p)p, m> = <x, m>.
                cos[start:stop] = 1.0 - along_ref / perp
        hashes[start:stop] = _row_hashes(raw[:, :HASH_COLUMNS], coeffs)
    duplicate_of = _duplicates(weights, name, hashes)
    return MatrixStats(name, norm, zero, cos, duplicate_of, cos_note, held_out)


def _row_hashes(raw: torch.Tensor, coeffs: np.ndarray) -> np.ndarray:
    # The stored bits, not floats: the same for identical rows whatever the kernel; integers wrap exactly.
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[raw.element_size()]
    ints = raw.view(bits).numpy()
    return (ints.astype(np.int64) * coeffs[: ints.shape[1]]).sum(axis=1).view(np.uint64)


def _duplicates(weights: CheckpointWeights, name: str, hashes: np.ndarray) -> np.ndarray:
    duplicate_of = np.full(len(hashes), -1, np.int64)
    order = np.argsort(hashes, kind="stable")
    sorted_hashes = hashes[order]
    same = sorted_hashes[1:] == sorted_hashes[:-1]
    # Only hash values shared by several rows are visited; each group is checked exactly.
    for h in np.unique(sorted_hashes[1:][same]):
        lo, hi = np.searchsorted(sorted_hashes, h, "left"), np.searchsorted(sorted_hashes, h, "right")
        ids = np.sort(order[lo:hi])
        rows = weights.rows(name, ids)
        _, inverse = torch.unique(rows, dim=0, return_inverse=True)
        for cls in inverse.unique():
            members = ids[(inverse == cls).numpy()]
            if len(members) > 1:
                duplicate_of[members] = members[0]
                duplicate_of[members[0]] = members[1]
    return duplicate_of
