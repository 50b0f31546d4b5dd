"""The live probe: time a model's stride == kernel convolutions against their GEMM on this machine.

For each distinct conv geometry, the probe builds random input shaped as the model feeds it (one
window per row, ``(N, C, *kernel)``) and times ``F.convNd`` against ``F.linear`` on the flattened views,
at the chosen device and dtype, under whatever backend switches are active (cuDNN, oneDNN). The default
``N`` is one 8-frame 512x384 clip for Qwen3-VL: grid (t, h, w) = (4, 24, 32), 3,072 patches, the count
``benchmarks/patch_embed.py`` uses (the Blackwell report's clip, transformers #45750, had 6,080).
Every shape gets a time budget; a conv too slow to repeat is timed once (see :func:`_interleaved`).
"""

from __future__ import annotations

import math
import statistics
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vlfast.diagnosis.timing import Timing, measure
from vlfast.patching.gemm import eligibility, is_patched

__all__ = ["DEFAULT_PATCHES", "ConvShape", "ProbeResult", "conv_shapes", "merge_shapes", "probe_conv"]

DEFAULT_PATCHES = 4 * 24 * 32  # 3,072: one 8-frame clip (T=2 -> 4 temporal patches) of 512x384 px at P=16

_CONV_FN = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


@dataclass(frozen=True)
class ConvShape:
    """One conv geometry, and where it occurs: ``names`` are ``model:qualified.name`` strings."""

    kind: str  # "Conv3d"
    in_channels: int
    out_channels: int
    kernel_size: tuple[int, ...]
    bias: bool
    windows: int  # rows of the equivalent GEMM per sample
    names: tuple[str, ...] = ()
    patched: bool = False  # every module with this geometry already runs through vlfast's GEMM

    def __post_init__(self) -> None:
        if self.windows < 1:
            raise ValueError(f"windows must be >= 1, got {self.windows}")
        if len(self.kernel_size) not in _CONV_FN:
            raise ValueError(f"kernel_size must have 1-3 dims, got {self.kernel_size}")

    @property
    def key(self) -> tuple:
        return (self.kind, self.in_channels, self.out_channels, self.kernel_size, self.bias, self.windows)

    @property
    def gemm_shape(self) -> tuple[int, int, int]:  # (M, K, N) of the equivalent GEMM
        return (self.windows, self.in_channels * math.prod(self.kernel_size), self.out_channels)

    def describe(self) -> str:
        k = "x".join(str(k) for k in self.kernel_size)
        return f"{self.kind} {self.in_channels}->{self.out_channels} k={k} x {self.windows:,} windows"

    def to_dict(self) -> dict[str, Any]:
        m, k, n = self.gemm_shape
        return {
            "kind": self.kind,
            "in_channels": self.in_channels,
            "out_channels": self.out_channels,
            "kernel_size": list(self.kernel_size),
            "bias": self.bias,
            "windows": self.windows,
            "gemm_mkn": [m, k, n],
            "names": list(self.names),
            "patched": self.patched,
        }


def conv_shapes(model: nn.Module, *, patches: int = DEFAULT_PATCHES, label: str = "") -> list[ConvShape]:
    """The eligible (stride == kernel) convolutions of ``model``, with the windows each sees per sample.

    The first eligible conv in module order is the patch embedding: it sees one window per patch. A
    later one (GLM's ``downsample``) consumes the embedded patches grouped by its own kernel, so it sees
    ``patches // prod(kernel)`` windows. Works on ``device="meta"`` models: only attributes are read.
    """
    if patches < 1:
        raise ValueError(f"patches must be >= 1, got {patches}")
    shapes: list[ConvShape] = []
    for name, m in model.named_modules():
        if not isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) or eligibility(m) is not None:
            continue
        kernel = tuple(int(k) for k in m.kernel_size)
        windows = patches if not shapes else max(1, patches // math.prod(kernel))
        shapes.append(
            ConvShape(
                type(m).__name__,
                int(m.in_channels),
                int(m.out_channels),
                kernel,
                m.bias is not None,
                windows,
                (f"{label}:{name}" if label else name,),
                patched=is_patched(m),
            )
        )
    return shapes


def merge_shapes(shapes: list[ConvShape]) -> list[ConvShape]:
    """One entry per distinct geometry, with the names of every place it occurs, in first-seen order."""
    merged: dict[tuple, ConvShape] = {}
    for s in shapes:
        if s.key in merged:
            prev = merged[s.key]
            merged[s.key] = ConvShape(
                *s.key[:5], s.windows, prev.names + s.names, patched=prev.patched and s.patched
            )
        else:
            merged[s.key] = s
    return list(merged.values())


@dataclass
class ProbeResult:
    """Measured time of one conv geometry and of its GEMM, per sample (one call = one sample)."""

    shape: ConvShape
    device: str
    dtype: str
    conv: Timing | None = None
    gemm: Timing | None = None
    onednn_enabled: bool | None = None
    cudnn_enabled: bool | None = None
    max_abs_diff: float | None = None  # conv vs GEMM on the probe input: a sanity check, not a proof
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        """conv / GEMM: the median of the per-round ratios when both were timed in the same rounds (a
        load change hits a round's pair alike), else the ratio of the medians."""
        if self.conv is None or self.gemm is None or self.gemm.median_ms <= 0:
            return None
        c, g = self.conv.times_ms, self.gemm.times_ms
        if len(c) == len(g) and not self.conv.first_call and min(g) > 0:
            return float(statistics.median(a / b for a, b in zip(c, g)))
        return self.conv.median_ms / self.gemm.median_ms

    @property
    def saving_ms(self) -> float | None:
        if self.conv is None or self.gemm is None:
            return None
        return max(0.0, self.conv.median_ms - self.gemm.median_ms)

    def to_dict(self) -> dict[str, Any]:
        return {
            "shape": self.shape.to_dict(),
            "device": self.device,
            "dtype": self.dtype,
            "conv_ms": self.conv.median_ms if self.conv else None,
            "gemm_ms": self.gemm.median_ms if self.gemm else None,
            "ratio": self.ratio,
            "saving_ms_per_sample": self.saving_ms,
            "conv_timing": self.conv.to_dict() if self.conv else None,
            "gemm_timing": self.gemm.to_dict() if self.gemm else None,
            "onednn_enabled": self.onednn_enabled,
            "cudnn_enabled": self.cudnn_enabled,
            "max_abs_diff": self.max_abs_diff,
            "error": self.error,
            "notes": list(self.notes),
        }


_ONE_CALL_MS = 5000.0  # a first call this slow is timed once: library loading and setup are noise


def _prewarm(dev: torch.device, dtype: torch.dtype, nd: int) -> None:
    """One tiny conv and GEMM, so lazy library loading (cuDNN, cuBLAS, oneDNN) is not timed."""
    x = torch.ones(1, 1, *([2] * nd), device=dev, dtype=dtype)
    _CONV_FN[nd](x, torch.ones(1, 1, *([2] * nd), device=dev, dtype=dtype), None, [2] * nd)
    F.linear(x.reshape(1, -1), torch.ones(1, 2**nd, device=dev, dtype=dtype))


def _interleaved(gemm, conv, dev: torch.device, budget_s: float, max_repeats: int) -> tuple[Timing, Timing]:
    """Warm both up, then alternate one GEMM call and one conv call until the budget is spent.

    Alternating makes a load change on a shared machine hit both alike, so the ratio stays fair.
    A conv that eats half the budget in one call is too slow to repeat: its second call (its first if
    that took over ``_ONE_CALL_MS``, where setup cost is noise) is the measurement.
    """
    budget_ms = budget_s * 1e3
    g0 = measure(gemm, device=dev, warmup=0, repeats=1).times_ms[0]
    c0 = measure(conv, device=dev, warmup=0, repeats=1).times_ms[0]
    spent = g0 + c0
    if c0 > 0.5 * budget_ms:
        g = measure(gemm, device=dev, warmup=0, repeats=max_repeats, budget_s=max(1e-3, 0.1 * budget_s))
        if c0 > _ONE_CALL_MS:
            return g, Timing((c0,), budget_hit=True, first_call=True)
        c1 = measure(conv, device=dev, warmup=0, repeats=1).times_ms[0]  # without one-time setup
        return g, Timing((c1,), warmup=1, budget_hit=True)
    gs: list[float] = []
    cs: list[float] = []
    while len(cs) < max_repeats and (not cs or spent < budget_ms):
        gs.append(measure(gemm, device=dev, warmup=0, repeats=1).times_ms[0])
        cs.append(measure(conv, device=dev, warmup=0, repeats=1).times_ms[0])
        spent += gs[-1] + cs[-1]
    hit = len(cs) < max_repeats
    return Timing(tuple(gs), warmup=1, budget_hit=hit), Timing(tuple(cs), warmup=1, budget_hit=hit)


def probe_conv(
    shape: ConvShape,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    budget_s: float = 2.0,
    max_repeats: int = 20,
    seed: int = 0,
) -> ProbeResult:
    """Time ``shape``'s conv and its GEMM at ``dtype`` on ``device`` within about ``budget_s`` seconds.

    Both are warmed up once, then timed alternately, one call each per round, until the budget is spent
    or ``max_repeats`` rounds ran (medians reported). Failures (out of memory, an op missing on the
    backend) are recorded in ``error``, never raised.
    """
    dev = torch.device(device)
    result = ProbeResult(
        shape,
        str(dev),
        str(dtype).removeprefix("torch."),
        onednn_enabled=bool(torch.backends.mkldnn.enabled) if dev.type == "cpu" else None,
        cudnn_enabled=bool(torch.backends.cudnn.enabled) if dev.type == "cuda" else None,
    )
    nd = len(shape.kernel_size)
    n, d = shape.windows, shape.out_channels
    try:
        gen = torch.Generator().manual_seed(seed)
        # (N, C, *k): every row one window, as the model's view(-1, C, T, P, P) produces.
        x = torch.randn(n, shape.in_channels, *shape.kernel_size, generator=gen).to(dev, dtype)
        fan_in = shape.in_channels * math.prod(shape.kernel_size)
        w = (torch.randn(d, shape.in_channels, *shape.kernel_size, generator=gen) / fan_in**0.5).to(
            dev, dtype
        )
        b = torch.randn(d, generator=gen).to(dev, dtype) if shape.bias else None
        conv_fn = _CONV_FN[nd]

        last: dict[str, torch.Tensor] = {}  # the latest output of each, for the agreement check

        def conv() -> None:
            last["conv"] = conv_fn(x, w, b, shape.kernel_size)  # (N, D, 1, ..., 1)

        def gemm() -> None:
            last["gemm"] = F.linear(x.reshape(n, -1), w.reshape(d, -1), b)  # (N, C*K) @ (C*K, D)

        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _prewarm(dev, dtype, nd)
            result.gemm, result.conv = _interleaved(gemm, conv, dev, budget_s, max_repeats)
            if result.conv.first_call:
                result.notes.append("conv too slow to repeat: its first call is the measurement")
            diff = (last["conv"].reshape(n, d).float() - last["gemm"].float()).abs().max()
            result.max_abs_diff = float(diff)
    except (RuntimeError, NotImplementedError, MemoryError) as e:
        result.error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return result
