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
from vlfast.errors import InputRefused
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
            raise InputRefused(f"windows must be >= 1, got {self.windows}")
        if len(self.kernel_size) not in _CONV_FN:
            raise InputRefused(f"kernel_size must have 1-3 dims, got {self.kernel_size}")

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
        raise InputRefused(f"patches must be >= 1, got {patches}")
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
    # The backward pass (input, weight and bias gradients) of each, timed apart from the forward: an
    # engine missing for the backward alone (cuDNN 9.20, bf16) leaves the forward fast.
    conv_backward: Timing | None = None
    gemm_backward: Timing | None = None
    backward_windows: int | None = None  # windows the backward was timed on (<= shape.windows)
    # The same conv with its input in channels_last (2-D) / channels_last_3d (3-D): a fix users can apply
    # without vlfast, since torch's cuDNN guard looks at contiguous inputs only. None: not probed.
    conv_channels_last: Timing | None = None
    gemm_for_channels_last: Timing | None = None
    onednn_enabled: bool | None = None
    cudnn_enabled: bool | None = None
    max_abs_diff: float | None = None  # conv vs GEMM on the probe input: a sanity check, not a proof
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        """conv / GEMM: the median of the per-round ratios when both were timed in the same rounds (a
        load change hits a round's pair alike), else the ratio of the medians."""
        return _ratio(self.conv, self.gemm)

    @property
    def backward_ratio(self) -> float | None:
        """conv backward / GEMM backward, as :attr:`ratio`."""
        return _ratio(self.conv_backward, self.gemm_backward)

    @property
    def channels_last_ratio(self) -> float | None:
        """conv with a channels-last input / its GEMM, as :attr:`ratio`."""
        return _ratio(self.conv_channels_last, self.gemm_for_channels_last)

    @property
    def saving_ms(self) -> float | None:
        """Forward time the GEMM saves per sample."""
        if self.conv is None or self.gemm is None:
            return None
        return max(0.0, self.conv.median_ms - self.gemm.median_ms)

    @property
    def backward_saving_ms(self) -> float | None:
        """Backward time the GEMM saves per sample, scaled from the windows it was timed on."""
        if self.conv_backward is None or self.gemm_backward is None:
            return None
        scale = self.shape.windows / (self.backward_windows or self.shape.windows)
        return max(0.0, self.conv_backward.median_ms - self.gemm_backward.median_ms) * scale

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
            "backward": {
                "conv_ms": _median(self.conv_backward),
                "gemm_ms": _median(self.gemm_backward),
                "ratio": self.backward_ratio,
                "saving_ms_per_sample": self.backward_saving_ms,
                "windows": self.backward_windows,
            },
            "channels_last": {
                "conv_ms": _median(self.conv_channels_last),
                "gemm_ms": _median(self.gemm_for_channels_last),
                "ratio": self.channels_last_ratio,
            },
            "onednn_enabled": self.onednn_enabled,
            "cudnn_enabled": self.cudnn_enabled,
            "max_abs_diff": self.max_abs_diff,
            "error": self.error,
            "notes": list(self.notes),
        }


def _ratio(conv: Timing | None, gemm: Timing | None) -> float | None:
    if conv is None or gemm is None or gemm.median_ms <= 0:
        return None
    c, g = conv.times_ms, gemm.times_ms
    if len(c) == len(g) and not conv.first_call and min(g) > 0:
        return float(statistics.median(a / b for a, b in zip(c, g)))
    return conv.median_ms / gemm.median_ms


def _median(t: Timing | None) -> float | None:
    return t.median_ms if t is not None else None


_CHANNELS_LAST = {2: torch.channels_last, 3: torch.channels_last_3d}
# The backward is timed on at most this many windows and its saving scaled to the sample: a CPU Conv3d
# backward takes seconds at 3,072 windows, and its ratio to the GEMM's barely moves with N (37x at
# 3,072, 36x at 768 in bf16 on this project's CPU), so the doctor stays a matter of seconds.
BACKWARD_WINDOWS = 768
# ... and on at least this many (or all there are): below it the GEMM is too small for its ratio, and for
# a saving scaled from it, to mean anything.
BACKWARD_MIN_WINDOWS = 256
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
    that took over ``_ONE_CALL_MS`` or the whole budget, where setup cost is noise) is the measurement.
    """
    budget_ms = budget_s * 1e3
    g0 = measure(gemm, device=dev, warmup=0, repeats=1).times_ms[0]
    c0 = measure(conv, device=dev, warmup=0, repeats=1).times_ms[0]
    spent = g0 + c0
    if c0 > 0.5 * budget_ms:
        g = measure(gemm, device=dev, warmup=0, repeats=max_repeats, budget_s=max(1e-3, 0.1 * budget_s))
        if c0 > _ONE_CALL_MS or c0 > budget_ms:  # a second call would overrun the budget
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
    backward: bool = True,
    channels_last: bool | None = None,
    slow_ratio: float = 2.0,
) -> ProbeResult:
    """Time ``shape``'s conv and its GEMM at ``dtype`` on ``device`` within about ``budget_s`` seconds.

    Both are warmed up once, then timed alternately, one call each per round, until their share of the
    budget is spent or ``max_repeats`` rounds ran (medians reported). With ``backward`` the gradients
    (input, weight, bias) of each are timed the same way, apart from the forward. ``channels_last``
    also times the conv on a channels-last input; ``None`` does so only when the contiguous forward
    measures ``>= slow_ratio`` (then it is a candidate fix worth knowing). Failures (out of memory, an op
    missing on the backend) are recorded in ``error``, never raised.
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
    # Half the budget for the forward, half for the backward; the channels-last candidate (CUDA, when
    # the forward loses) a quarter more.
    forward_budget = budget_s / 2 if backward else budget_s
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
            result.gemm, result.conv = _interleaved(gemm, conv, dev, forward_budget, max_repeats)
            if result.conv.first_call:
                result.notes.append("conv too slow to repeat: its first call is the measurement")
            diff = (last["conv"].reshape(n, d).float() - last["gemm"].float()).abs().max()
            result.max_abs_diff = float(diff)
        slow = result.ratio is not None and result.ratio >= slow_ratio
        # By default only where it can help: torch's cuDNN guard (contiguous inputs only) is CUDA's; on
        # CPU a channels-last input makes oneDNN's kernel-sized conv slower still (2-3x here).
        wanted = channels_last is None and slow and dev.type == "cuda"
        if nd in _CHANNELS_LAST and (channels_last or wanted):
            xc = x.contiguous(memory_format=_CHANNELS_LAST[nd])
            with torch.inference_mode(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result.gemm_for_channels_last, result.conv_channels_last = _interleaved(
                    lambda: F.linear(x.reshape(n, -1), w.reshape(d, -1), b),
                    lambda: conv_fn(xc, w, b, shape.kernel_size),
                    dev,
                    budget_s / 4,
                    max_repeats,
                )
        if backward:
            _probe_backward(result, x, w, b, conv_fn, dev, budget_s / 2, max_repeats)
    except (RuntimeError, NotImplementedError, MemoryError) as e:
        result.error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return result


def _probe_backward(result: ProbeResult, x, w, b, conv_fn, dev, budget_s: float, max_repeats: int) -> None:
    """Time the gradients of the conv and of its GEMM: one graph each, differentiated repeatedly.

    ``retain_graph`` keeps each graph, so a timed call is the backward alone, as training runs it after
    the forward: input, weight and bias gradients (the patch embedding's input is pixels, which need no
    gradient in training, but a tower fine-tuned behind another module's output would need it).
    On ``BACKWARD_WINDOWS`` windows; on ``BACKWARD_MIN_WINDOWS`` when a first call on that many shows
    the conv backward could not run three times on more within the budget (that first call then warms
    it up), and that call alone is the measurement when it took the whole budget (a CPU bf16 Conv2d
    backward costs ~26 ms per window here: a fallback kernel, far above the thresholds however timed).
    """
    n = min(x.shape[0], BACKWARD_WINDOWS)
    first = min(n, BACKWARD_MIN_WINDOWS)
    conv_bwd, gemm_bwd = _backward_graphs(x[:first], w, b, conv_fn, result.shape.kernel_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ms = measure(conv_bwd, device=dev, warmup=0, repeats=1).times_ms[0]
        if ms > budget_s * 1e3:  # too slow to repeat: this call is the measurement
            n = first
            gemm = measure(gemm_bwd, device=dev, warmup=1, repeats=max_repeats, budget_s=0.2 * budget_s)
            conv = Timing((ms,), budget_hit=True, first_call=True)
        else:
            if ms * n / first > budget_s * 1e3 / 3:
                n = first
            if n != first:
                conv_bwd, gemm_bwd = _backward_graphs(x[:n], w, b, conv_fn, result.shape.kernel_size)
            gemm, conv = _interleaved(gemm_bwd, conv_bwd, dev, budget_s, max_repeats)
    result.backward_windows, result.gemm_backward, result.conv_backward = n, gemm, conv
    if conv.first_call:
        result.notes.append("conv backward too slow to repeat: its first call is the measurement")


def _backward_graphs(x, w, b, conv_fn, kernel_size):
    """(conv backward, GEMM backward) callables, each on its graph built once."""
    n, d = x.shape[0], w.shape[0]
    leaves = [t.detach().requires_grad_() for t in (x, w, b) if t is not None]
    xg, wg, bg = leaves[0], leaves[1], leaves[2] if b is not None else None
    with torch.enable_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y_conv = conv_fn(xg, wg, bg, kernel_size)  # (N, D, 1, ..., 1)
        g_conv = torch.ones_like(y_conv)

        def conv_bwd() -> None:
            with torch.enable_grad():
                torch.autograd.grad(y_conv, leaves, g_conv, retain_graph=True)

        y_gemm = F.linear(xg.reshape(n, -1), wg.reshape(d, -1), bg)  # (N, D)
        g_gemm = g_conv.reshape(n, d)

        def gemm_bwd() -> None:
            with torch.enable_grad():
                torch.autograd.grad(y_gemm, leaves, g_gemm, retain_graph=True)

    return conv_bwd, gemm_bwd
