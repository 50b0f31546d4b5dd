"""Numerical comparison for the patch tests: a tolerance per dtype and a failure that shows the worst element.

Modelled on Liger-Kernel's ``assert_verbose_allclose``: when tensors disagree the message names the worst
element (index, both values, difference), how many elements are out of tolerance, and the cosine similarity,
so a failure says how wrong the result is, not only that it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass(frozen=True)
class Tolerance:
    atol: float  # times the reference's largest magnitude (at least 1)
    rtol: float
    min_cosine: float | None = None


# fp32: round-off of a different summation order. bf16/fp16: the two kernels round partial sums
# differently, so elementwise bounds are loose and the cosine carries the claim.
TOLERANCES = {
    torch.float64: Tolerance(1e-12, 1e-10),
    torch.float32: Tolerance(1e-5, 1e-5),
    torch.bfloat16: Tolerance(2e-2, 2e-2, 0.999),
    torch.float16: Tolerance(4e-3, 4e-3, 0.9999),
}


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    denom = a.norm() * b.norm()
    if denom == 0:
        return 1.0 if torch.equal(a, b) else 0.0
    return float((a @ b) / denom)


def assert_verbose_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    name: str = "tensor",
    dtype: torch.dtype | None = None,
    tol: Tolerance | None = None,
) -> None:
    """Assert ``actual`` matches ``expected`` within the tolerance of ``dtype`` (default: expected's)."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    tol = tol or TOLERANCES[dtype or expected.dtype]
    a, e = actual.detach().double(), expected.detach().double()
    if a.numel() == 0:
        return
    scale = max(1.0, float(e.abs().max()))
    diff = (a - e).abs()
    bad = diff > tol.atol * scale + tol.rtol * e.abs()
    bad |= torch.isnan(a) != torch.isnan(e)
    cos = cosine(a, e)
    cos_ok = tol.min_cosine is None or cos >= tol.min_cosine
    if bad.any() or not cos_ok:
        worst = int(torch.nan_to_num(diff, nan=float("inf")).flatten().argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), a.shape))
        raise AssertionError(
            f"{name}: {int(bad.sum())}/{a.numel()} elements out of tolerance (atol {tol.atol} x {scale:.3g}, "
            f"rtol {tol.rtol}); worst at {index}: actual {a.flatten()[worst].item():.8g}, expected "
            f"{e.flatten()[worst].item():.8g}, |diff| {diff.flatten()[worst].item():.3g}; cosine {cos:.6f}"
            + (f" < {tol.min_cosine}" if not cos_ok else "")
        )


class ConvCount(TorchDispatchMode):
    """Counts the convolutions that reach ATen, forward and backward, however they were called (a module,
    F.conv3d, PEFT's own conv_fn, a wrapper): what ran, where equal numbers could hide the stock path."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.startswith("convolution"):  # convolution.default, convolution_backward.default
            self.calls += 1
        return func(*args, **(kwargs or {}))
