"""The live probe: time a model's stride == kernel convolutions against their GEMM on this machine.

Each geometry gets random windows shaped as the model feeds them (``(N, C, *kernel)``) and a share of one
:class:`Budget`: a small call of each side measures a window's cost, then at least ``MIN_ROUNDS``
interleaved rounds run. What does not fit is left out and said so, never timed once and scaled.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vlfast.diagnosis.timing import Timing, timed_call
from vlfast.errors import InputRefused
from vlfast.patching.gemm import eligibility, is_patched

__all__ = [
    "DEFAULT_PATCHES",
    "MIN_ROUNDS",
    "Budget",
    "ConvShape",
    "ProbeResult",
    "choose_windows",
    "conv_shapes",
    "merge_shapes",
    "probe_conv",
    "selected_backend",
]

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
        return {
            "kind": self.kind,
            "in_channels": self.in_channels,
            "out_channels": self.out_channels,
            "kernel_size": list(self.kernel_size),
            "bias": self.bias,
            "windows": self.windows,
            "gemm_mkn": list(self.gemm_shape),
            "names": list(self.names),
            "patched": self.patched,
        }


def conv_shapes(model: nn.Module, *, patches: int = DEFAULT_PATCHES, label: str = "") -> list[ConvShape]:
    """The eligible (stride == kernel) convolutions of ``model``, with the windows each sees per sample.

    The first in module order is the patch embedding (one window per patch); a later one (GLM's
    ``downsample``) sees ``patches // prod(kernel)``. Only attributes are read, so meta models work.
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


MIN_ROUNDS = 3  # timed rounds of each side below which a figure is unreliable and kept out of the headline
# The first, small call that tells what a window costs: at most this many windows and CALIBRATION_MACS
# multiply-adds, so GLM's 1536->4096 downsample (~40 ms per window of CPU backward) calibrates quickly.
CALIBRATION_WINDOWS = 128
CALIBRATION_MACS = 2**27
_MIN_CALIBRATION_WINDOWS = 16
_MAX_ROUNDS = 20


def _secs(ms: float) -> str:
    """ "1.8 s", or "40 ms" under a tenth of a second (where "0.0 s" would say nothing)."""
    return f"{ms / 1e3:.1f} s" if ms >= 100 else f"{ms:.0f} ms"


def _over_budget(what: str, cost: str, left_ms: float, whose: str = "it") -> str:
    """Why ``what`` was left out, in words: what it would cost against what was left of the budget."""
    if left_ms < 1:
        return f"{what}: the budget was spent before it"
    return f"{what}: {cost}, more than the {_secs(left_ms)} of the budget left for {whose}"


@dataclass
class Budget:
    """The seconds a probe may spend, read from ``clock`` (a fake one in tests)."""

    seconds: float
    clock: Callable[[], float] | None = None  # default: _now

    def __post_init__(self) -> None:
        if self.seconds <= 0:
            raise InputRefused(f"budget must be positive, got {self.seconds} s")
        self.clock = self.clock or _now
        self.start = self.clock()
        # ms per multiply-add of a round, "forward" and "all", from the shapes calibrated so far: a later
        # shape that cannot fit is left out before it is calibrated.
        self.rates: dict[str, float] = {}

    @property
    def spent_ms(self) -> float:
        return (self.clock() - self.start) * 1e3

    @property
    def left_ms(self) -> float:
        return self.seconds * 1e3 - self.spent_ms


def _now() -> float:
    """Seconds on the probe's clock (tests replace it, with :func:`_time_once`)."""
    return time.perf_counter()


def clock() -> float:
    """Seconds on the probe's clock (:func:`_now`): what a budget is counted on."""
    return _now()


def _time_once(fn: Callable[[], object], dev: torch.device) -> float:
    """Milliseconds of one call; the one place the probe reads time (tests replace it)."""
    return timed_call(fn, dev)


def choose_windows(
    round_ms_per_window: float, windows: int, share_ms: float, *, calibrated: int, rounds: int = MIN_ROUNDS
) -> int | None:
    """How many windows to time so that a warm-up round and ``rounds`` timed rounds fit in ``share_ms``
    (pure), ``round_ms_per_window`` measured on ``calibrated`` windows: all ``windows`` when they fit, else
    as many as fit, never fewer than ``calibrated`` (whose call was the warm-up); None when none fit."""
    if round_ms_per_window <= 0:
        return windows
    fit = int(share_ms / ((rounds + 1) * round_ms_per_window))
    if fit >= windows:
        return windows
    if fit > calibrated:
        return fit
    if rounds * round_ms_per_window * calibrated <= share_ms:
        return min(calibrated, windows)
    return None


@dataclass
class ProbeResult:
    """Measured time of one conv geometry and of its GEMM, per sample (one call = one sample).

    Timed in interleaved rounds on ``windows_timed`` windows, scaled to ``shape.windows`` by :attr:`scale`
    (cost is linear in the windows past a few dozen). Under ``MIN_ROUNDS`` rounds a figure is unreliable:
    shown, but kept out of every saving.
    """

    shape: ConvShape
    device: str
    dtype: str
    conv: Timing | None = None
    gemm: Timing | None = None
    # Input, weight and bias gradients, timed apart: an engine missing for the backward alone (cuDNN 9.20,
    # bf16) leaves the forward fast.
    conv_backward: Timing | None = None
    gemm_backward: Timing | None = None
    windows_timed: int | None = None  # windows per timed call (<= shape.windows)
    # The conv on a channels_last(_3d) input: a fix without vlfast, as torch's cuDNN guard looks at
    # contiguous inputs only. None: not probed.
    conv_channels_last: Timing | None = None
    gemm_for_channels_last: Timing | None = None
    onednn_enabled: bool | None = None
    cudnn_enabled: bool | None = None
    backend: str | None = None  # ATen's choice for this conv (torch._C._select_conv_backend), e.g. "Mkldnn"
    kernels: list[str] = field(default_factory=list)  # CUDA kernel names of one traced conv call
    max_abs_diff: float | None = None  # conv vs GEMM on the probe input: a sanity check, not a proof
    left_out: str | None = None  # what the budget left out of this geometry, and why
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def backward_windows(self) -> int | None:
        return self.windows_timed if self.conv_backward is not None else None

    @property
    def scale(self) -> float:
        return self.shape.windows / (self.windows_timed or self.shape.windows)

    @property
    def ratio(self) -> float | None:
        """conv / GEMM of the medians: the table's ``conv ms / GEMM ms``, so the ratio printed beside the
        two times is theirs. Under a changing load the rounds can disagree: :attr:`round_ratio` says so."""
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
    def spread(self) -> float | None:
        """(max - min) / median of the forward's per-round ratios."""
        return _spread(self.conv, self.gemm)

    @property
    def backward_spread(self) -> float | None:
        return _spread(self.conv_backward, self.gemm_backward)

    @property
    def reliable(self) -> bool:
        """The forward was timed at least ``MIN_ROUNDS`` times on each side."""
        return _reliable(self.conv, self.gemm)

    @property
    def backward_reliable(self) -> bool:
        return _reliable(self.conv_backward, self.gemm_backward)

    @property
    def round_ratio(self) -> float | None:
        """The median of the per-round conv / GEMM ratios."""
        ratios = _round_ratios(self.conv, self.gemm)
        return float(statistics.median(ratios)) if ratios else None

    def per_sample_ms(self, which: str) -> float | None:
        """Median ms of ``conv``, ``gemm``, ``conv_backward`` or ``gemm_backward``, scaled to the sample."""
        t = getattr(self, which)
        return None if t is None else t.median_ms * self.scale

    @property
    def saving_ms(self) -> float | None:
        """Forward time the GEMM saves per sample; None unless reliable."""
        return _saving(self.per_sample_ms("conv"), self.per_sample_ms("gemm"), self.reliable)

    @property
    def backward_saving_ms(self) -> float | None:
        """Backward time the GEMM saves per sample; None unless reliable."""
        return _saving(
            self.per_sample_ms("conv_backward"), self.per_sample_ms("gemm_backward"), self.backward_reliable
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "shape": self.shape.to_dict(),
            "device": self.device,
            "dtype": self.dtype,
            "windows_timed": self.windows_timed,
            "conv_ms": self.per_sample_ms("conv"),
            "gemm_ms": self.per_sample_ms("gemm"),
            "ratio": self.ratio,
            "spread": self.spread,
            "reliable": self.reliable,
            "saving_ms_per_sample": self.saving_ms,
            "conv_timing": self.conv.to_dict() if self.conv else None,
            "gemm_timing": self.gemm.to_dict() if self.gemm else None,
            "backward": {
                "conv_ms": self.per_sample_ms("conv_backward"),
                "gemm_ms": self.per_sample_ms("gemm_backward"),
                "ratio": self.backward_ratio,
                "spread": self.backward_spread,
                "reliable": self.backward_reliable,
                "saving_ms_per_sample": self.backward_saving_ms,
                "windows": self.backward_windows,
                "rounds": self.conv_backward.n if self.conv_backward else 0,
            },
            "channels_last": {
                "conv_ms": self.conv_channels_last.median_ms if self.conv_channels_last else None,
                "gemm_ms": self.gemm_for_channels_last.median_ms if self.gemm_for_channels_last else None,
                "ratio": self.channels_last_ratio,
            },
            "rounds": self.conv.n if self.conv else 0,
            "backend": self.backend,
            "kernels": list(self.kernels),
            "onednn_enabled": self.onednn_enabled,
            "cudnn_enabled": self.cudnn_enabled,
            "max_abs_diff": self.max_abs_diff,
            "left_out": self.left_out,
            "error": self.error,
            "notes": list(self.notes),
        }


def _round_ratios(conv: Timing | None, gemm: Timing | None) -> list[float]:
    if conv is None or gemm is None or len(conv.times_ms) != len(gemm.times_ms) or min(gemm.times_ms) <= 0:
        return []
    return [a / b for a, b in zip(conv.times_ms, gemm.times_ms)]


def _ratio(conv: Timing | None, gemm: Timing | None) -> float | None:
    """The ratio of the medians, never the median of per-round ratios: under load they differ (a 64.65 ms
    conv beside a 125.18 ms GEMM was once printed as 0.84x), and the table prints the medians beside it."""
    if conv is None or gemm is None or gemm.median_ms <= 0:
        return None
    return conv.median_ms / gemm.median_ms


def _spread(conv: Timing | None, gemm: Timing | None) -> float | None:
    ratios = _round_ratios(conv, gemm)
    if len(ratios) < 2:
        return None
    med = statistics.median(ratios)
    return (max(ratios) - min(ratios)) / med if med else None


def _reliable(conv: Timing | None, gemm: Timing | None) -> bool:
    return conv is not None and gemm is not None and min(conv.n, gemm.n) >= MIN_ROUNDS


def _saving(conv_ms: float | None, gemm_ms: float | None, reliable: bool) -> float | None:
    if conv_ms is None or gemm_ms is None or not reliable:
        return None
    return max(0.0, conv_ms - gemm_ms)


_CHANNELS_LAST = {2: torch.channels_last, 3: torch.channels_last_3d}


def _prewarm(dev: torch.device, dtype: torch.dtype, nd: int) -> None:
    """One tiny conv and GEMM, so lazy library loading (cuDNN, cuBLAS, oneDNN) is not timed."""
    x = torch.ones(1, 1, *([2] * nd), device=dev, dtype=dtype)
    _CONV_FN[nd](x, torch.ones(1, 1, *([2] * nd), device=dev, dtype=dtype), None, [2] * nd)
    F.linear(x.reshape(1, -1), torch.ones(1, 2**nd, device=dev, dtype=dtype))


def selected_backend(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, kernel: tuple[int, ...]
) -> str | None:
    """The convolution backend ATen selects for ``conv(x, w, b, stride=kernel)``: "Mkldnn", "Cudnn",
    "Slow3d", "SlowDilated3d", "Empty", ... None on a torch without ``torch._C._select_conv_backend``
    (a private helper, present since torch 1.12) or when it refuses the arguments."""
    select = getattr(torch._C, "_select_conv_backend", None)
    if select is None:
        return None
    nd = len(kernel)
    try:
        with torch.no_grad():
            backend = select(x, w, b, list(kernel), [0] * nd, [1] * nd, False, [0] * nd, 1)
    except (RuntimeError, TypeError):
        return None
    return str(backend).rsplit(".", 1)[-1]


_KERNEL_WORDS = ("im2col", "vol2col", "col2im", "col2vol", "cudnn", "gemm", "conv", "xmma", "cutlass")


def _cuda_kernels(fn: Callable[[], object]) -> list[str]:
    """The CUDA kernels one call of ``fn`` launches, as a short torch.profiler trace shows them (only the
    names that tell the path: im2col / vol2col, cudnn, gemm)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as trace

    with trace(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages() if any(w in e.key.lower() for w in _KERNEL_WORDS)]
    return [n[:120] for n in dict.fromkeys(names)][:6]


def probe_conv(
    shape: ConvShape,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    budget_s: float = 2.0,
    budget: Budget | None = None,
    stretch_s: float = 0.0,
    max_repeats: int = _MAX_ROUNDS,
    seed: int = 0,
    backward: bool = True,
    channels_last: bool | None = None,
    slow_ratio: float = 2.0,
) -> ProbeResult:
    """Time ``shape``'s conv and its GEMM at ``dtype`` on ``device`` in about ``budget_s`` seconds.

    A calibration call per side gives the cost per window; :func:`choose_windows` sizes the rounds (with
    ``backward``, the gradients too), run until the share is spent or ``max_repeats`` ran. ``budget``,
    shared between shapes, caps it; ``stretch_s`` more seconds may keep the backward in (a training verdict
    rests on it). What does not fit is named in ``left_out``. ``channels_last`` also times a channels-last
    input (``None``: on CUDA when the forward is ``>= slow_ratio``). Failures are recorded in ``error``.
    """
    dev = torch.device(device)
    budget = budget if budget is not None else Budget(budget_s)
    result = ProbeResult(
        shape,
        str(dev),
        str(dtype).removeprefix("torch."),
        onednn_enabled=bool(torch.backends.mkldnn.enabled) if dev.type == "cpu" else None,
        cudnn_enabled=bool(torch.backends.cudnn.enabled) if dev.type == "cuda" else None,
    )
    c, k, d = shape.in_channels, shape.kernel_size, shape.out_channels
    nd = len(k)
    try:
        gen = torch.Generator().manual_seed(seed)
        # (N, C, *k): every row one window, as the model's view(-1, C, T, P, P) produces.
        x_all = torch.randn(shape.windows, c, *k, generator=gen).to(dev, dtype)
        w = (torch.randn(d, c, *k, generator=gen) / (c * math.prod(k)) ** 0.5).to(dev, dtype)
        b = torch.randn(d, generator=gen).to(dev, dtype) if shape.bias else None
        result.backend = selected_backend(x_all, w, b, shape.kernel_size)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _prewarm(dev, dtype, nd)
            timed = _time_sides(result, x_all, w, b, budget, budget_s, stretch_s, backward, max_repeats)
        if timed is None:
            return result
        n, times = timed
        result.windows_timed = n
        for side, t in times.items():  # gemm, conv and, with the backward, gemm_ and conv_backward
            setattr(result, side, Timing(tuple(t), warmup=1))
        if dev.type == "cuda":
            result.kernels = _cuda_kernels(lambda: _CONV_FN[nd](x_all[:n], w, b, shape.kernel_size))
        if not result.reliable or ("conv_backward" in times and not result.backward_reliable):
            result.notes.append(
                f"fewer than {MIN_ROUNDS} rounds fit in the budget: unreliable, left out of the savings"
            )
        slow = result.ratio is not None and result.ratio >= slow_ratio
        # By default only where it can help: torch's cuDNN guard (contiguous inputs only) is CUDA's; on
        # CPU a channels-last input makes oneDNN's kernel-sized conv slower still (2-3x here).
        wanted = channels_last is None and slow and dev.type == "cuda"
        if nd in _CHANNELS_LAST and (channels_last or wanted):
            _time_channels_last(result, x_all[:n], w, b, budget, budget_s, max_repeats)
    except (RuntimeError, NotImplementedError, MemoryError) as e:
        result.error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return result


def _time_sides(result, x_all, w, b, budget, budget_s, stretch_s, backward, max_repeats):
    """(windows timed, times per side) after the calibration, or None with ``result.left_out`` saying why."""
    shape, dev = result.shape, x_all.device
    conv_fn, n_all, d = _CONV_FN[len(shape.kernel_size)], shape.windows, shape.out_channels
    # Plan to 90% of the share: what is not predicted (tensor set-up, scheduling noise) takes the rest.
    share_end = budget.spent_ms + 0.9 * min(budget_s * 1e3, budget.left_ms)  # in budget.spent_ms units
    _, k, _ = shape.gemm_shape
    n0 = min(n_all, CALIBRATION_WINDOWS, max(_MIN_CALIBRATION_WINDOWS, CALIBRATION_MACS // (k * d)))
    left = lambda: share_end - budget.spent_ms  # noqa: E731 - what is left of this shape's share
    # What the shapes before predict for this one's calibration and MIN_ROUNDS rounds on it.
    macs = n0 * k * d
    before = f"at the speed of the shapes probed before it, a warm-up and {MIN_ROUNDS} timed rounds"
    if backward and "all" in budget.rates and budget.rates["all"] * macs * (MIN_ROUNDS + 1) > left():
        backward = False
        cost = f"{before} of it on just {n0} windows would take ~{_secs(budget.rates['all'] * macs * (MIN_ROUNDS + 1))}"
        result.left_out = _over_budget("the backward", cost, left(), "this shape")
    if "forward" in budget.rates and budget.rates["forward"] * macs * (MIN_ROUNDS + 1) > left():
        cost = f"{before} on just {n0} windows would take ~{_secs(budget.rates['forward'] * macs * (MIN_ROUNDS + 1))}"
        result.left_out = _over_budget("the whole shape", cost, left())
        return None
    sides = _sides(x_all[:n0], w, b, conv_fn, shape.kernel_size, backward)
    cal: dict[str, float] = {}
    for name, fn in sides.items():  # the calibration: one call each, which also warms them up
        if budget.left_ms <= 0:
            result.left_out = "the whole shape: the budget was spent before it"
            return None
        cal[name] = _time_once(fn, dev)
    fwd_ms = cal["gemm"] + cal["conv"]
    budget.rates["forward"] = fwd_ms / macs
    if backward:
        budget.rates["all"] = sum(cal.values()) / macs
    with torch.inference_mode():  # a sanity check on the calibration windows, not a proof
        x = x_all[:n0]
        y_conv = conv_fn(x, w, b, shape.kernel_size).reshape(n0, d).float()
        y_gemm = F.linear(x.reshape(n0, -1), w.reshape(d, -1), b).float()
        result.max_abs_diff = float((y_conv - y_gemm).abs().max())
    # A round per window, plus the forward that builds the backward graphs on new windows.
    per_window = (sum(cal.values()) + fwd_ms / (MIN_ROUNDS + 1)) / n0
    n = choose_windows(per_window, n_all, left(), calibrated=n0)
    if n is None and backward and stretch_s > 0:
        stretched = min(stretch_s * 1e3, max(0.0, budget.left_ms - left()))
        n = choose_windows(per_window, n0, left() + 0.9 * stretched, calibrated=n0)
        if n is not None:
            share_end += 0.9 * stretched
    if n is None and backward:
        n = choose_windows(fwd_ms / n0, n_all, left(), calibrated=n0)
        if n is not None:
            cost = (
                f"{MIN_ROUNDS} timed rounds of it on just {n0} windows would take "
                f"~{_secs(MIN_ROUNDS * (cal['conv_backward'] + cal['gemm_backward']))} here"
            )
            result.left_out = _over_budget("the backward", cost, left(), "this shape")
            sides = {k: v for k, v in sides.items() if not k.endswith("backward")}
    if n is None:
        cost = f"{MIN_ROUNDS} timed rounds on just {n0} windows would take ~{_secs(MIN_ROUNDS * fwd_ms)} here"
        result.left_out = _over_budget("the whole shape", cost, left())
        return None
    if n != n0:
        sides = _sides(x_all[:n], w, b, conv_fn, shape.kernel_size, "conv_backward" in sides)
        for fn in sides.values():  # the warm-up round at this size (choose_windows paid for it)
            _time_once(fn, dev)
    return n, _rounds(sides, dev, budget, left, max_repeats)


def _time_channels_last(result, x, w, b, budget, budget_s, max_repeats) -> None:
    """The same conv with its input in channels_last(_3d), against its GEMM, in a quarter of the share."""
    n, d, kernel = x.shape[0], w.shape[0], result.shape.kernel_size
    xc = x.contiguous(memory_format=_CHANNELS_LAST[len(kernel)])
    cl_end = budget.spent_ms + min(budget_s * 1e3 / 4, budget.left_ms)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cl = {
            "gemm": lambda: F.linear(x.reshape(n, -1), w.reshape(d, -1), b),
            "conv": lambda: _CONV_FN[len(kernel)](xc, w, b, kernel),
        }
        _time_once(cl["conv"], x.device)
        t = _rounds(cl, x.device, budget, lambda: cl_end - budget.spent_ms, max_repeats)
    if t["conv"]:
        result.gemm_for_channels_last = Timing(tuple(t["gemm"]), warmup=1)
        result.conv_channels_last = Timing(tuple(t["conv"]), warmup=1)


def _rounds(
    sides: dict, dev: torch.device, budget: Budget, left: Callable, max_rounds: int
) -> dict[str, list]:
    """Interleaved rounds, one call of every side each, so a load change hits every side alike. Stops
    after ``max_rounds``, or once ``MIN_ROUNDS`` ran and the next round would overrun this shape's share;
    never starts a round the whole budget cannot pay for (with a little slack until ``MIN_ROUNDS`` ran)."""
    times: dict[str, list[float]] = {k: [] for k in sides}
    last = 0.0
    # Below MIN_ROUNDS a round may dip into 15% of the whole budget: a reliable figure is worth that much.
    slack = 0.15 * budget.seconds * 1e3
    while len(times["conv"]) < max_rounds:
        short = len(times["conv"]) < MIN_ROUNDS
        if budget.left_ms + (slack if short else 0.0) < last or (not short and left() < last):
            break
        t0 = budget.spent_ms
        for name, fn in sides.items():
            times[name].append(_time_once(fn, dev))
        last = budget.spent_ms - t0
    return times


def _sides(x, w, b, conv_fn, kernel_size, backward: bool) -> dict[str, Callable[[], object]]:
    """The timed callables on the windows of ``x``: GEMM and conv forward, and their backward graphs."""
    n, d = x.shape[0], w.shape[0]

    def gemm() -> None:
        with torch.inference_mode():
            F.linear(x.reshape(n, -1), w.reshape(d, -1), b)  # (N, C*K) @ (C*K, D)

    def conv() -> None:
        with torch.inference_mode():
            conv_fn(x, w, b, kernel_size)  # (N, D, 1, ..., 1)

    sides = {"gemm": gemm, "conv": conv}
    if backward:
        conv_bwd, gemm_bwd = _backward_graphs(x, w, b, conv_fn, kernel_size)
        sides.update(gemm_backward=gemm_bwd, conv_backward=conv_bwd)
    for fn in sides.values():
        fn.windows = n  # what a call's cost is linear in: a fake clock in the tests reads it
    return sides


def _backward_graphs(x, w, b, conv_fn, kernel_size):
    """(conv backward, GEMM backward) callables, each on its graph built once and retained, so a timed
    call is the backward alone: input (for a tower behind another module), weight and bias gradients."""
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
