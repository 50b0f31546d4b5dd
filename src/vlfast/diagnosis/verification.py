"""Proof that the patch changes nothing: patched vs original on the same inputs, on the user's own model,
per layer, per tower and for the gradients (docs/patch.md), with the thresholds printed beside the result.

Metrics are float64: a float32 cosine over millions of elements is itself off by ~1e-4. Memory stays
about two towers' worth plus one forward's activations: both runs use the same module with the patch
toggled, the low-precision tower is converted from the fp32 one (in place when verify loaded it), the
patched gradients are compared one parameter at a time inside the backward, and metrics stream in chunks.
"""

from __future__ import annotations

import copy
import gc
import itertools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vlfast.dtypes import ALIASES as DTYPE_ALIASES
from vlfast.errors import InputRefused
from vlfast.patching.fusion import fused_patch_embeddings, fusion_note
from vlfast.patching.gemm import eligibility, patch, unpatch
from vlfast.patching.precision import fp32_settings, ieee_fp32

__all__ = ["Check", "Step", "Thresholds", "VerifyReport", "compare", "verify"]

# Every spelling --dtype accepts (vlfast.dtypes: one policy for every command).
DTYPES = {name: getattr(torch, canonical) for name, canonical in DTYPE_ALIASES.items()}

# Elements per float64 chunk in compare(): 2 MiB per buffer, whatever the size of the tensor.
_CHUNK = 1 << 18


@dataclass(frozen=True)
class Thresholds:
    """Pass criteria. fp32 differences are round-off (a GEMM sums in another order than a conv kernel)."""

    fp32_layer_rel: float = 1e-5  # max |patched - conv| / max |conv|
    fp32_tower_rel: float = 1e-4  # round-off grows through the blocks
    fp32_grad_rel: float = 1e-4
    low_cosine: float = 0.999  # bf16 / fp16, patched vs conv
    low_sqnr_db: float = 30.0  # bf16 / fp16, patched vs conv
    low_accuracy_slack_db: float = 1.0  # patched vs fp32 may be at most this much worse than conv vs fp32

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, (int, float)) or value < 0:
                raise InputRefused(f"threshold {name} must be a non-negative number, got {value!r}")


@dataclass
class Check:
    """One comparison: where, at which dtype, the numbers, and whether they pass."""

    scope: str  # "layer", "tower" or "grad"
    name: str  # module or tensor the check is about
    dtype: str
    metrics: dict[str, float]
    limits: dict[str, str]  # metric -> rule, e.g. {"max_rel": "<= 1e-05"}
    passed: bool


@dataclass(frozen=True)
class Step:
    """One unit of a verify run, reported to ``verify(progress=...)`` as it starts (``seconds`` None) and
    as it ends (its wall time and ``checks``). ``index`` counts from 1 to ``total``; loading the model is
    step 0 of an unknown total (``total is None``)."""

    index: int
    total: int | None
    label: str
    seconds: float | None = None
    checks: tuple[Check, ...] = ()

    @property
    def done(self) -> bool:
        return self.seconds is not None

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)


@dataclass
class VerifyReport:
    model: str
    device: str
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # Where this process's float32 settings give the conv and the GEMM different precisions (TF32 convs on
    # NVIDIA by default): what that measures on the first conv. The checks run in IEEE float32 either way.
    precision: dict[str, Any] | None = None
    # (qualified name, class name) of patch embeddings transformers' fusion_config already made a Linear
    fused: list[tuple[str, str]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        if not self.checks:
            return bool(self.fused)  # fused by transformers: nothing to prove, and nothing wrong
        return all(c.passed for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    def accuracy(self) -> list[str]:
        """One sentence per accuracy check: which path is closer to float64, forward and weight gradient."""
        lines = []
        for c in self.checks:
            if c.scope != "accuracy" or "stock_fwd_rel" not in c.metrics:
                continue
            parts = []
            for what, label in (("fwd", "forward"), ("wgrad", "weight gradient")):
                if f"stock_{what}_rel" not in c.metrics:
                    continue
                stock, patched = c.metrics[f"stock_{what}_rel"], c.metrics[f"patched_{what}_rel"]
                closer = (
                    "the GEMM closer"
                    if patched < stock
                    else "the stock conv closer"
                    if stock < patched
                    else "equal"
                )
                parts.append(f"{label} stock {stock:.2g}, patched {patched:.2g} ({closer})")
            lines.append(f"{c.name} {c.dtype}, error against float64: " + "; ".join(parts))
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "device": self.device,
            "passed": self.passed,
            "checks": [asdict(c) for c in self.checks],
            "notes": list(self.notes),
            "precision": self.precision,
            "fused": [list(f) for f in self.fused],
        }

    def __str__(self) -> str:
        lines = [f"vlfast verify {self.model} on {self.device}: {'PASS' if self.passed else 'FAIL'}"]
        for c in self.checks:
            nums = ", ".join(f"{k}={v:.3g}" for k, v in c.metrics.items())
            lines.append(f"  {'ok  ' if c.passed else 'FAIL'} {c.scope:<5} {c.dtype:<8} {c.name}: {nums}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _max(a: float, b: float) -> float:
    """max() that keeps a NaN (Python's max(0.0, nan) is 0.0: a NaN output would pass unseen)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


class _Errors:
    """Running float64 sums behind compare(), fed chunk by chunk and tensor by tensor: a float64 copy of a
    415M-element gradient is 3.3 GB, and several tensors (a tower's gradients) sum into one result."""

    def __init__(self) -> None:
        self.numel = 0
        self.max_abs = 0.0  # max |candidate - reference|
        self.scale = 0.0  # max |reference|
        self.noise = 0.0  # sum (candidate - reference)^2
        self.signal = 0.0  # sum reference^2
        self.power = 0.0  # sum candidate^2
        self.dot = 0.0  # sum reference * candidate

    def add(self, reference: torch.Tensor, candidate: torch.Tensor) -> None:
        if reference.shape != candidate.shape:
            raise InputRefused(
                f"shape mismatch: reference {tuple(reference.shape)} vs candidate {tuple(candidate.shape)}"
            )
        r_all, c_all = reference.detach().flatten(), candidate.detach().flatten()
        numel = r_all.numel()
        if numel:
            # Three reused float64 buffers: a fresh tensor per chunk costs more in page faults than the sums.
            device = torch.device("cpu") if r_all.device.type == "mps" else r_all.device  # no float64 on MPS
            buffers = torch.empty(3, min(_CHUNK, numel), dtype=torch.float64, device=device)
        for start in range(0, numel, _CHUNK):
            n = min(_CHUNK, numel - start)
            r, c, diff = buffers[0, :n], buffers[1, :n], buffers[2, :n]
            r.copy_(r_all[start : start + n])
            c.copy_(c_all[start : start + n])
            torch.sub(c, r, out=diff)
            self.noise += torch.dot(diff, diff).item()
            self.signal += torch.dot(r, r).item()
            self.power += torch.dot(c, c).item()
            self.dot += torch.dot(r, c).item()
            self.max_abs = _max(self.max_abs, diff.abs_().max().item())
            self.scale = _max(self.scale, r.abs_().max().item())
        self.numel += numel

    def metrics(self) -> dict[str, float]:
        denom = math.sqrt(self.signal) * math.sqrt(self.power)
        noise, signal = self.noise, self.signal
        metrics = {
            "max_abs": self.max_abs if self.numel else 0.0,
            "max_rel": (self.max_abs / (self.scale or 1.0)) if self.numel else 0.0,
            # ||candidate - reference|| / ||reference||: the relative error public reports quote
            "rel_l2": math.sqrt(noise / signal) if signal > 0 else (0.0 if noise == 0 else math.inf),
            "cosine": (self.dot / denom) if denom > 0 else 1.0,
            "sqnr_db": 10.0 * torch.log10(torch.tensor(signal / noise)).item() if noise > 0 else math.inf,
        }
        if math.isnan(self.dot + noise + signal + self.power):
            # A NaN anywhere must fail every rule, not read as cosine 1.0 / infinite SQNR.
            metrics["cosine"] = metrics["sqnr_db"] = metrics["rel_l2"] = math.nan
        return metrics


def compare(reference: torch.Tensor, candidate: torch.Tensor) -> dict[str, float]:
    """Error metrics of ``candidate`` against ``reference``, computed in float64."""
    errors = _Errors()
    errors.add(reference, candidate)
    return errors.metrics()


def _low_precision_check(scope: str, name: str, dtype: torch.dtype, ref32, ref, res, th: Thresholds) -> Check:
    """The patched result ``res`` against the stock ``ref`` in a low dtype, and each against ``ref32``."""
    vs_conv, conv_vs_fp32, gemm_vs_fp32 = compare(ref, res), compare(ref32, ref), compare(ref32, res)
    metrics = {"cosine": vs_conv["cosine"], "sqnr_db": vs_conv["sqnr_db"]}
    limits = {"cosine": f">= {th.low_cosine}", "sqnr_db": f">= {th.low_sqnr_db}"}
    ok = vs_conv["cosine"] >= th.low_cosine and vs_conv["sqnr_db"] >= th.low_sqnr_db
    metrics["conv_vs_fp32_sqnr_db"] = conv_vs_fp32["sqnr_db"]
    metrics["patched_vs_fp32_sqnr_db"] = gemm_vs_fp32["sqnr_db"]
    limits["patched_vs_fp32_sqnr_db"] = f">= conv_vs_fp32_sqnr_db - {th.low_accuracy_slack_db}"
    ok = ok and gemm_vs_fp32["sqnr_db"] >= conv_vs_fp32["sqnr_db"] - th.low_accuracy_slack_db
    return Check(scope, name, _dtype_name(dtype), metrics, limits, ok)


def _skipped(scope: str, name: str, dtype: torch.dtype, e: Exception) -> Check:
    return Check(scope, name, _dtype_name(dtype), {}, {"skipped": str(e)[:80]}, True)


def _exact_device(device: torch.device) -> torch.device:
    return device if device.type == "cuda" else torch.device("cpu")  # MPS has no float64


def _fp32_check(scope: str, name: str, m: dict, limit: float) -> Check:
    kept = {k: m[k] for k in ("max_abs", "max_rel", "cosine")}
    return Check(scope, name, "float32", kept, {"max_rel": f"<= {limit:g}"}, m["max_rel"] <= limit)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class _Steps:
    """Runs the units of work: each announced to ``callback`` as it starts and ends, its checks kept."""

    def __init__(self, callback: Callable[[Step], None] | None, report: VerifyReport) -> None:
        self.callback, self.report = callback, report
        self.index, self.total = 0, None

    @contextmanager
    def __call__(self, label: str) -> Iterator[list[Check]]:
        index = self.index
        if self.callback:
            self.callback(Step(index, self.total, label))
        start, checks = time.perf_counter(), []
        yield checks
        self.report.checks += checks
        if self.callback:
            self.callback(Step(index, self.total, label, time.perf_counter() - start, tuple(checks)))
        if self.total is not None:
            self.index += 1


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    return itertools.chain(module.parameters(), module.buffers())


def _is_at(module: nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
    """Every tensor on ``device`` and every floating one in ``dtype``: the module can be run as it is."""
    return all(
        _same_device(t.device, device) and (t.dtype == dtype or not t.is_floating_point())
        for t in _tensors(module)
    )


def _same_device(a: torch.device, b: torch.device) -> bool:
    def index(d: torch.device) -> int:  # "cuda" means the current device; "cpu", "mps" have one
        if d.index is not None:
            return d.index
        return torch.cuda.current_device() if d.type == "cuda" else 0

    return a.type == b.type and index(a) == index(b)


def _converted_copy(module: nn.Module, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """``copy.deepcopy(module).to(device, dtype)`` without the full-precision copy in between: the
    converted tensors go in deepcopy's memo (one already in ``dtype`` on ``device`` is shared)."""
    memo: dict[int, Any] = {}
    for t in _tensors(module):
        if id(t) in memo:
            continue
        new = t.detach().to(device=device, dtype=dtype if t.is_floating_point() else None)
        if isinstance(t, nn.Parameter):
            new = nn.Parameter(new, requires_grad=t.requires_grad)
        memo[id(t)] = new
    return copy.deepcopy(module, memo)


@contextmanager
def _borrowed(module: nn.Module, *, give_back: bool) -> Iterator[None]:
    """Run ``module`` in eval mode; when it is the caller's own, restore its modes and gradients after."""
    modes = {m: m.training for m in module.modules()} if give_back else {}
    grads = {p: p.grad for p in module.parameters()} if give_back else {}
    module.eval()
    try:
        yield
    finally:
        for m, training in modes.items():
            m.training = training
        for p, grad in grads.items():
            p.grad = grad


def _convs(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and eligibility(m) is None
    ]


def _run(module: nn.Module, patched: bool, fn, *args):
    """Call ``fn(*args)`` with ``module``'s eligible convs patched or not, then restore the previous state."""
    was = [n for n, m in module.named_modules() if "_conv_forward" in m.__dict__]
    unpatch(module)
    if patched:
        patch(module)
    try:
        return fn(*args)
    finally:
        unpatch(module)
        if was:
            patch(module, filter=lambda n, m: n in was)


def _layer_checks(
    name: str, conv: nn.Module, n_windows: int, low: Sequence[torch.dtype], device, th, gen, backward, step
) -> None:
    k = tuple(conv.kernel_size)
    x32 = torch.randn(n_windows, conv.in_channels, *k, generator=gen).to(device)
    layer = copy.deepcopy(conv).float().to(device)  # one conv: small
    layer.requires_grad_(True)  # a copy: a frozen model's conv still has its gradients checked
    with step(f"layer {name} float32") as out, torch.no_grad():
        ref32 = _run(layer, False, lambda: layer(x32))
        out32 = _run(layer, True, lambda: layer(x32))
        out.append(_fp32_check("layer", name, compare(ref32, out32), th.fp32_layer_rel))
    del out32
    for dtype in low:
        with step(f"layer {name} {_dtype_name(dtype)}") as out, torch.no_grad():
            low_layer = copy.deepcopy(layer).to(dtype)
            xl = x32.to(dtype)
            try:
                ref = _run(low_layer, False, lambda: low_layer(xl))  # noqa: B023
            except RuntimeError as e:  # e.g. fp16 conv not implemented on this device
                out.append(_skipped("layer", name, dtype, e))
                continue
            res = _run(low_layer, True, lambda: low_layer(xl))  # noqa: B023
            out.append(_low_precision_check("layer", name, dtype, ref32, ref, res, th))
    for dtype in (torch.float32, *low):
        with step(f"accuracy {name} {_dtype_name(dtype)} against float64") as out:
            try:
                out.append(_accuracy_check(name, layer, x32, dtype, device, backward, th))
            except RuntimeError as e:  # e.g. a dtype's conv not implemented on this device
                out.append(_skipped("accuracy", name, dtype, e))
    if backward:
        with step(f"grad {name}") as out, torch.enable_grad():
            grads = {}
            for patched in (False, True):
                xg = x32.clone().requires_grad_(True)
                layer.zero_grad(set_to_none=True)
                y = _run(layer, patched, lambda: layer(xg))  # noqa: B023
                proj = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(device)
                (y * proj).sum().backward()
                grads[patched] = {"input": xg.grad, "weight": layer.weight.grad}
                if layer.bias is not None:
                    grads[patched]["bias"] = layer.bias.grad
            for key, ref in grads[False].items():
                m = compare(ref, grads[True][key])
                out.append(_fp32_check("grad", f"{name}.{key}", m, th.fp32_grad_rel))


# Windows in an accuracy check: enough for a stable relative error, few enough for a float64 conv and the
# stock backward of a full-size patch embed to take seconds on a CPU.
ACCURACY_WINDOWS = 512
# Unit round-off per dtype: a patched result may be this much further from float64 than the stock one
# (beyond the 1 dB slack) before the accuracy check fails; both outputs are rounded to the dtype anyway.
# Each path also sums K products in float32, in an order of its own: √K·2⁻²⁴ more is allowed for that. In
# float32 this term is the one that counts (an Intel Xeon with AMX: GLM's 256-term downsample, stock 1.5e-7
# from float64 and the GEMM 2.9e-7, both a few round-offs; the unit round-off alone allowed 2.3e-7).
_UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _accuracy_check(
    name: str, layer: nn.Module, x32: torch.Tensor, dtype, device, backward: bool, th
) -> Check:
    """Each path's ||path - float64|| / ||float64||, forward and (with ``backward``) the weight gradient.

    The float64 reference runs on the same inputs, weights and upstream gradient rounded to ``dtype``, so
    each kernel's own rounding is measured, as public reports compare it (cuDNN's bf16 Conv3d at 2.7e-3
    against 9e-6 for an fp32-accumulating GEMM, radixark/miles_diffusion PR #168).
    """
    low = copy.deepcopy(layer).to(dtype)
    low.requires_grad_(True)
    x = x32[:ACCURACY_WINDOWS].to(dtype)
    exact_device = _exact_device(device)
    exact = copy.deepcopy(low).to(exact_device, torch.float64)
    gen = torch.Generator().manual_seed(3)
    metrics: dict[str, float] = {}
    with torch.enable_grad():
        y64 = exact(x.to(exact_device, torch.float64))
        upstream = torch.randn(y64.shape, generator=gen).to(dtype)  # rounded once, used by every path
        if backward:
            y64.backward(upstream.to(exact_device, torch.float64))
        for label, patched in (("stock", False), ("patched", True)):
            low.zero_grad(set_to_none=True)
            y = _run(low, patched, lambda: low(x.to(device)))  # noqa: B023
            metrics[f"{label}_fwd_rel"] = compare(y64, y.detach().to(exact_device))["rel_l2"]
            if backward:
                y.backward(upstream.to(device))
                metrics[f"{label}_wgrad_rel"] = compare(exact.weight.grad, low.weight.grad.to(exact_device))[
                    "rel_l2"
                ]
    slack = 10 ** (th.low_accuracy_slack_db / 20)
    terms = {"fwd": low.weight[0].numel(), "wgrad": y64.numel() // y64.shape[1]}  # products in each sum
    limits, ok = {}, True
    for what in ("fwd", "wgrad") if backward else ("fwd",):
        patched, stock = metrics[f"patched_{what}_rel"], metrics[f"stock_{what}_rel"]
        u = _UNIT_ROUNDOFF.get(dtype, 0.0) + math.sqrt(terms[what]) * 2.0**-24
        limits[f"patched_{what}_rel"] = f"<= stock_{what}_rel x {slack:.3g} + {u:.2g}"
        ok = ok and patched <= stock * slack + u  # NaN fails
    return Check("accuracy", name, _dtype_name(dtype), metrics, limits, ok)


def _features(model: nn.Module, pixels: torch.Tensor, grid: torch.Tensor) -> dict[str, torch.Tensor]:
    from vlfast.models import tower_outputs

    out = tower_outputs(model(pixels, grid_thw=grid))
    return {"merged": out["merged"], **{f"deepstack[{i}]": d for i, d in enumerate(out["deepstack"])}}


def _tower_grad_check(tower: nn.Module, grid, device, th: Thresholds, seed: int) -> Check:
    """Gradients of every tower parameter, original vs patched, holding one set: each patched gradient is
    compared as it is accumulated (a post-accumulate-grad hook) and both are dropped at once."""
    from vlfast.models import synthetic_inputs

    pixels, grid_thw = synthetic_inputs(tower, [grid], device=device, seed=seed)
    params = [p for p in tower.parameters() if p.requires_grad]
    # A frozen tower (as for feature extraction): its gradients are still the check.
    thawed = [] if params else [p for p in tower.parameters() if p.is_floating_point()]
    params = params or thawed
    try:
        for p in thawed:
            p.requires_grad_(True)
        return _compare_grads(tower, params, pixels, grid_thw, device, th)
    finally:
        for p in thawed:  # left frozen, as found
            p.requires_grad_(False)
            p.grad = None


def _compare_grads(tower: nn.Module, params, pixels, grid_thw, device, th: Thresholds) -> Check:
    from vlfast.models import tower_outputs

    def backward(patched: bool) -> None:
        for p in params:
            p.grad = None
        merged = _run(tower, patched, lambda: tower_outputs(tower(pixels, grid_thw=grid_thw))["merged"])
        proj = torch.randn(merged.shape, generator=torch.Generator().manual_seed(2)).to(device)
        (merged * proj).sum().backward()

    with torch.enable_grad():
        backward(False)
        gc.collect()  # the original run's graph, before the patched run builds its own
        reference = {id(p): p.grad for p in params if p.grad is not None}
        errors, unmatched = _Errors(), 0

        def consume(p: torch.Tensor) -> None:
            nonlocal unmatched
            ref = reference.pop(id(p), None)
            if ref is None:
                unmatched += 1
            else:
                errors.add(ref, p.grad)
            p.grad = None

        handles = [p.register_post_accumulate_grad_hook(consume) for p in params]
        try:
            backward(True)
        finally:
            for h in handles:
                h.remove()
            for p in params:
                p.grad = None
    unmatched += len(reference)  # had a gradient in the original run only
    reference.clear()
    check = _fp32_check("grad", "tower parameters (all, concatenated)", errors.metrics(), th.fp32_grad_rel)
    if unmatched:
        check.metrics["unmatched_parameters"] = float(unmatched)
        check.limits["unmatched_parameters"] = "== 0"
        check.passed = False
    return check


def _tower_checks(
    tower: nn.Module, grids, low, device, th, seed: int, backward: bool, step, owned: bool
) -> None:
    """Tower checks, fp32 first (its outputs are the reference of the low-precision ones), then grads,
    then each low dtype. ``owned``: verify loaded the tower itself and may convert it in place."""
    from vlfast.models import synthetic_inputs

    # The caller's module itself when it already is fp32 on the device; else verify's own converted copy.
    if _is_at(tower, torch.float32, device):
        tower32 = tower
    else:
        tower32 = tower.float().to(device) if owned else _converted_copy(tower, torch.float32, device)
    own32 = owned or tower32 is not tower
    labels = [f"sample {i} grid={tuple(g)}" for i, g in enumerate(grids)]
    ref32s: list[dict[str, torch.Tensor]] = []
    with _borrowed(tower32, give_back=not own32):
        for i, grid in enumerate(grids):
            with step(f"tower float32 {labels[i]}") as out, torch.no_grad():
                pixels, grid_thw = synthetic_inputs(tower32, [grid], device=device, seed=seed + i)
                ref32 = _run(tower32, False, _features, tower32, pixels, grid_thw)
                out32 = _run(tower32, True, _features, tower32, pixels, grid_thw)
                for key, ref in ref32.items():
                    m = compare(ref, out32[key])
                    out.append(_fp32_check("tower", f"{labels[i]} {key}", m, th.fp32_tower_rel))
                ref32s.append(ref32)
                del out32
        if backward and grids:
            with step("grad tower parameters") as out:
                out.append(_tower_grad_check(tower32, grids[0], device, th, seed))
    for j, dtype in enumerate(low if grids else ()):
        # The last dtype converts verify's own fp32 tower in place: no copy at all.
        last = own32 and j == len(low) - 1
        model = tower32.to(dtype) if last else _converted_copy(tower32, dtype, device).eval()
        for i, grid in enumerate(grids):
            with step(f"tower {_dtype_name(dtype)} {labels[i]}") as out, torch.no_grad():
                pixels, grid_thw = synthetic_inputs(model, [grid], device=device, seed=seed + i)
                px = pixels.to(dtype)
                ref = _run(model, False, _features, model, px, grid_thw)
                res = _run(model, True, _features, model, px, grid_thw)
                for key in ref:
                    check = _low_precision_check(
                        "tower", f"{labels[i]} {key}", dtype, ref32s[i][key], ref[key], res[key], th
                    )
                    out.append(check)
        del model


def verify(
    model: nn.Module | str,
    *,
    grids: Sequence[tuple[int, int, int]] = ((2, 16, 16), (1, 12, 20)),
    dtypes: Sequence[str | torch.dtype] = ("float32", "bfloat16"),
    device: str | torch.device = "cpu",
    n_windows: int = 3072,
    backward: bool = True,
    seed: int = 0,
    thresholds: Thresholds | None = None,
    tiny: bool = False,
    progress: Callable[[Step], None] | None = None,
) -> VerifyReport:
    """Compare the patched model with the original on the same inputs, forward and backward.

    ``model`` is a module (the user's own, patched or not: its patch state, train/eval modes and
    gradients are restored afterwards, its weights never change), a local checkpoint directory, or
    ``ref:NAME``; for a path only the vision tower is loaded. ``grids`` are the per-sample (t, h, w)
    patch grids fed to the tower; ``n_windows`` the number of patches in layer checks. ``progress`` is
    called with a :class:`Step` as each unit of work starts and ends.
    """
    from vlfast.models import find_vision_tower, load_vision_tower
    from vlfast.numerics import settle_vector_math

    settle_vector_math()  # the first forward must not differ from the next for a reason of MKL's own
    th = thresholds or Thresholds()
    low = [dt for dt in _dtypes(dtypes) if dt is not torch.float32]
    if n_windows < 1:
        raise InputRefused(f"n_windows must be >= 1, got {n_windows}")
    device = torch.device(device)
    if not isinstance(model, (nn.Module, str)):
        raise InputRefused(
            f"verify expects an nn.Module, a checkpoint directory or ref:NAME, got {type(model).__name__}"
        )
    report = VerifyReport(model=model if isinstance(model, str) else type(model).__name__, device=str(device))
    steps = _Steps(progress, report)
    root, owned = model, False
    if isinstance(model, str):
        with steps(f"load {model}" + (" (tiny)" if tiny else "")):
            root, owned = load_vision_tower(model, tiny=tiny, dtype=torch.float32), True
    convs = _convs(root)
    if isinstance(model, str) and (note := fusion_note(model)):
        report.notes.append(note)
    if not convs:
        report.fused = fused_patch_embeddings(root)
        if report.fused:
            where = ", ".join(f"{n or '<root>'} ({cls})" for n, cls in report.fused)
            report.notes.append(
                f"transformers' fusion_config already replaced the patch embedding's Conv3d with a Linear "
                f"(linear_proj) in {where}: it runs the GEMM already, so vlfast has no conv to patch or verify"
            )
        else:
            report.notes.append("no stride == kernel convolution in this model: nothing to verify")
        return report
    try:
        _, tower = find_vision_tower(root)
    except ValueError:
        tower = None
    steps.index = 1
    steps.total = len(convs) * (1 + len(low) + (1 + len(low)) + backward)
    if tower is not None:
        steps.total += len(grids) * (1 + len(low)) + bool(backward and grids)
    settings = fp32_settings(device)
    if device.type in ("cuda", "cpu") and settings["conv"][0] != settings["matmul"][0]:
        name, conv = convs[0]
        report.precision = _settings_difference(name, conv, n_windows, device, seed, settings)
        report.notes.append(_settings_note(report.precision))
    gen = torch.Generator().manual_seed(seed)
    with ieee_fp32():  # the identity the patch claims, whatever rounding this process allows either side
        for name, conv in convs:
            _layer_checks(name, conv, n_windows, low, device, th, gen, backward, steps)
        if tower is None:
            report.notes.append("no vision tower (forward taking grid_thw) found: layer checks only")
            return report
        _tower_checks(tower, list(grids), low, device, th, seed, backward, steps, owned)
    return report


def _dtypes(dtypes: Sequence[str | torch.dtype]) -> list[torch.dtype]:
    out = [DTYPES.get(d, d) if isinstance(d, str) else d for d in dtypes]
    for d, dt in zip(dtypes, out):
        if not isinstance(dt, torch.dtype):
            raise InputRefused(f"unknown dtype {d!r}; use one of {sorted(DTYPES)}")
    return out


def _settings_difference(name: str, conv: nn.Module, n_windows: int, device, seed: int, settings) -> dict:
    """Stock vs patched in float32 under this process's own settings, each vs float64 (not a check)."""
    gen = torch.Generator().manual_seed(seed + 7919)  # its own: the checks' random inputs stay as they were
    x = torch.randn(n_windows, conv.in_channels, *tuple(conv.kernel_size), generator=gen)
    layer = copy.deepcopy(conv).float().to(device)
    with torch.no_grad():
        stock = _run(layer, False, lambda: layer(x.to(device)))
        patched = _run(layer, True, lambda: layer(x.to(device)))
        exact_device = _exact_device(device)
        layer64 = copy.deepcopy(conv).to(exact_device, torch.float64)
        exact = _run(layer64, False, lambda: layer64(x.to(exact_device, torch.float64)))
    return {
        "layer": name,
        "conv": settings["conv"][0],
        "conv_setting": settings["conv"][1],
        "matmul": settings["matmul"][0],
        "matmul_setting": settings["matmul"][1],
        "patched_vs_stock_max_rel": compare(stock, patched)["max_rel"],
        "stock_vs_float64_max_rel": compare(exact, stock.to(exact.device))["max_rel"],
        "patched_vs_float64_max_rel": compare(exact, patched.to(exact.device))["max_rel"],
    }


def _settings_note(d: dict) -> str:
    closer = (
        "closer to" if d["patched_vs_float64_max_rel"] <= d["stock_vs_float64_max_rel"] else "further from"
    )
    return (
        f"this process's settings run float32 convs in {d['conv']} ({d['conv_setting']}) but float32 matmuls "
        f"in {d['matmul']} ({d['matmul_setting']}); the patched conv is a matmul, so with these settings its "
        f"float32 outputs differ from the stock conv's by {d['patched_vs_stock_max_rel']:.2g} relative on "
        f"{d['layer']} (against float64: stock {d['stock_vs_float64_max_rel']:.2g}, patched "
        f"{d['patched_vs_float64_max_rel']:.2g}, {closer} exact). That is the settings' rounding, not the "
        f"patch: the float32 checks ran in IEEE float32 on both sides. For both to compute alike, either "
        f"{d['conv_setting']} = {_setting_value(d['conv_setting'], d['matmul'])} (the convs in "
        f"{d['matmul']}) or {d['matmul_setting']} = {_setting_value(d['matmul_setting'], d['conv'])} "
        f"(every float32 matmul in {d['conv']}, not only the patched convs)"
    )


def _setting_value(knob: str, precision: str) -> str:
    if knob.endswith("allow_tf32"):
        return str(precision == "tf32")
    return repr(precision)


def _gemm_rate(dtype: torch.dtype, device: torch.device) -> float:
    """Multiply-adds per second of one 1,024-cubed F.linear here (best of two after a warm-up): as the
    tower's layers run it, since with emulated bf16 ``a @ a`` takes another path, 20x slower."""
    from vlfast.diagnosis.timing import measure

    a = torch.randn(1024, 1024, device=device).to(dtype)
    ms = measure(lambda: F.linear(a, a), device=device, warmup=1, repeats=2).min_ms
    return 1024**3 / (ms / 1e3)


def expected_seconds(
    model: nn.Module | str,
    *,
    grids: Sequence[tuple[int, int, int]] = ((2, 16, 16), (1, 12, 20)),
    dtypes: Sequence[str | torch.dtype] = ("float32", "bfloat16"),
    device: str | torch.device = "cpu",
    n_windows: int = 3072,
    backward: bool = True,
    tiny: bool = False,
) -> float:
    """A rough wall time for :func:`verify` with these arguments, told before it starts.

    From the tower's size (read on meta) and a GEMM rate measured now per dtype: a tower forward costs
    about parameters x patches multiply-adds, twice per grid and dtype, the gradient check three forwards
    twice, a layer check its conv (4x its GEMM forward, 30x backward, as on a CPU) and GEMM.
    """
    from vlfast.models import load_vision_tower

    dev = torch.device(device)
    tower = model if isinstance(model, nn.Module) else load_vision_tower(model, tiny=tiny, device="meta")
    params = sum(p.numel() for p in tower.parameters())
    dts = _dtypes(dtypes)
    patches = [t * h * w for t, h, w in grids]
    macs: dict[torch.dtype, float] = {}
    if dts:  # the same multiply-adds for each dtype; the convs walked once, and only when one is asked
        tower_macs = 2 * params * sum(patches)
        layer_macs = sum(
            n_windows * m.weight[0].numel() * m.out_channels * (1 + 4 + (1 + 30) * 2 * backward)
            # the accuracy check: float64 forward and backward (~4x and 8x), stock and patched again
            + min(n_windows, ACCURACY_WINDOWS)
            * m.weight[0].numel()
            * m.out_channels
            * (4 + 1 + 12 + 31 * backward)
            for _, m in _convs(tower)
        )
        for dt in dts:
            macs[dt] = macs.get(dt, 0.0) + tower_macs + layer_macs
    if backward and patches:
        macs[torch.float32] = macs.get(torch.float32, 0.0) + 6 * params * patches[0]
    return sum(m / _gemm_rate(dt, dev) for dt, m in macs.items())
