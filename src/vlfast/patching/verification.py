"""Proof that the patch changes nothing: patched vs original on the same inputs, on the user's own model.

Three scopes, each compared with thresholds that are printed with the result:
- layer: every eligible conv on a realistic number of random windows, fp32 (max abs / relative error)
  and bf16 (cosine and SQNR against the conv, and against an fp32 reference so the GEMM is shown to be
  no less accurate than the conv it replaces);
- tower: the whole vision tower per sample (merged tokens and deepstack levels), fp32 and bf16;
- grad: gradients to the input, weight and bias of each conv, and to every tower parameter.

All metrics are computed in float64: a float32 cosine over millions of elements is itself off by ~1e-4.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from vlfast.patching.gemm import eligibility, patch, unpatch

__all__ = ["Check", "Thresholds", "VerifyReport", "compare", "verify"]

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


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
                raise ValueError(f"threshold {name} must be a non-negative number, got {value!r}")


@dataclass
class Check:
    """One comparison: where, at which dtype, the numbers, and whether they pass."""

    scope: str  # "layer", "tower" or "grad"
    name: str  # module or tensor the check is about
    dtype: str
    metrics: dict[str, float]
    limits: dict[str, str]  # metric -> rule, e.g. {"max_rel": "<= 1e-05"}
    passed: bool


@dataclass
class VerifyReport:
    model: str
    device: str
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "device": self.device,
            "passed": self.passed,
            "checks": [asdict(c) for c in self.checks],
            "notes": list(self.notes),
        }

    def __str__(self) -> str:
        lines = [f"vlfast verify {self.model} on {self.device}: {'PASS' if self.passed else 'FAIL'}"]
        for c in self.checks:
            nums = ", ".join(f"{k}={v:.3g}" for k, v in c.metrics.items())
            lines.append(f"  {'ok  ' if c.passed else 'FAIL'} {c.scope:<5} {c.dtype:<8} {c.name}: {nums}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------ metrics


def compare(reference: torch.Tensor, candidate: torch.Tensor) -> dict[str, float]:
    """Error metrics of ``candidate`` against ``reference``, computed in float64."""
    if reference.shape != candidate.shape:
        raise ValueError(
            f"shape mismatch: reference {tuple(reference.shape)} vs candidate {tuple(candidate.shape)}"
        )
    r = reference.detach().double().flatten()
    c = candidate.detach().double().flatten()
    diff = c - r
    scale = r.abs().max().item() or 1.0
    noise = diff.pow(2).sum().item()
    signal = r.pow(2).sum().item()
    denom = (r.norm() * c.norm()).item()
    return {
        "max_abs": diff.abs().max().item() if diff.numel() else 0.0,
        "max_rel": (diff.abs().max().item() / scale) if diff.numel() else 0.0,
        "cosine": (torch.dot(r, c).item() / denom) if denom > 0 else 1.0,
        "sqnr_db": 10.0 * torch.log10(torch.tensor(signal / noise)).item() if noise > 0 else float("inf"),
    }


def _low_precision_check(
    scope: str,
    name: str,
    dtype: str,
    vs_conv: dict,
    conv_vs_fp32: dict | None,
    gemm_vs_fp32: dict | None,
    th: Thresholds,
) -> Check:
    metrics = {"cosine": vs_conv["cosine"], "sqnr_db": vs_conv["sqnr_db"]}
    limits = {"cosine": f">= {th.low_cosine}", "sqnr_db": f">= {th.low_sqnr_db}"}
    ok = vs_conv["cosine"] >= th.low_cosine and vs_conv["sqnr_db"] >= th.low_sqnr_db
    if conv_vs_fp32 is not None and gemm_vs_fp32 is not None:
        metrics["conv_vs_fp32_sqnr_db"] = conv_vs_fp32["sqnr_db"]
        metrics["patched_vs_fp32_sqnr_db"] = gemm_vs_fp32["sqnr_db"]
        limits["patched_vs_fp32_sqnr_db"] = f">= conv_vs_fp32_sqnr_db - {th.low_accuracy_slack_db}"
        ok = ok and gemm_vs_fp32["sqnr_db"] >= conv_vs_fp32["sqnr_db"] - th.low_accuracy_slack_db
    return Check(scope, name, dtype, metrics, limits, ok)


def _fp32_check(scope: str, name: str, m: dict, limit: float) -> Check:
    return Check(
        scope,
        name,
        "float32",
        {"max_abs": m["max_abs"], "max_rel": m["max_rel"], "cosine": m["cosine"]},
        {"max_rel": f"<= {limit:g}"},
        m["max_rel"] <= limit,
    )


# ------------------------------------------------------------------------------------------- checks


def _convs(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and eligibility(m) is None
    ]


def _run(module: nn.Module, patched: bool, fn):
    """Call ``fn()`` with ``module``'s eligible convs patched or not, then restore the previous state."""
    was = [n for n, m in module.named_modules() if "_conv_forward" in m.__dict__]
    unpatch(module)
    if patched:
        patch(module)
    try:
        return fn()
    finally:
        unpatch(module)
        if was:
            patch(module, filter=lambda n, m: n in was)


def _layer_checks(
    name: str, conv: nn.Module, n_windows: int, low: Sequence[torch.dtype], device, th, gen, backward: bool
) -> list[Check]:
    checks = []
    k = tuple(conv.kernel_size)
    x32 = torch.randn(n_windows, conv.in_channels, *k, generator=gen).to(device)
    layer = copy.deepcopy(conv).float().to(device)
    ref32 = _run(layer, False, lambda: layer(x32).detach())
    out32 = _run(layer, True, lambda: layer(x32).detach())
    checks.append(_fp32_check("layer", name, compare(ref32, out32), th.fp32_layer_rel))
    for dtype in low:
        low_layer = copy.deepcopy(layer).to(dtype)
        xl = x32.to(dtype)
        try:
            ref = _run(low_layer, False, lambda: low_layer(xl).detach())  # noqa: B023
        except RuntimeError as e:  # e.g. fp16 conv not implemented on this device
            checks.append(
                Check("layer", name, str(dtype).replace("torch.", ""), {}, {"skipped": str(e)[:80]}, True)
            )
            continue
        out = _run(low_layer, True, lambda: low_layer(xl).detach())  # noqa: B023
        checks.append(
            _low_precision_check(
                "layer",
                name,
                str(dtype).replace("torch.", ""),
                compare(ref, out),
                compare(ref32, ref),
                compare(ref32, out),
                th,
            )
        )
    if backward:
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
        for key in grads[False]:
            checks.append(
                _fp32_check(
                    "grad", f"{name}.{key}", compare(grads[False][key], grads[True][key]), th.fp32_grad_rel
                )
            )
    return checks


def _tower_checks(tower: nn.Module, grids, low, device, th, seed: int, backward: bool) -> list[Check]:
    from vlfast.models import synthetic_inputs, tower_outputs

    checks: list[Check] = []
    tower32 = copy.deepcopy(tower).float().to(device).eval()
    low_towers = {dtype: copy.deepcopy(tower32).to(dtype) for dtype in low}

    def features(model, pixels, grid):
        out = tower_outputs(model(pixels, grid_thw=grid))
        return {"merged": out["merged"], **{f"deepstack[{i}]": d for i, d in enumerate(out["deepstack"])}}

    for i, grid in enumerate(grids):
        pixels, grid_thw = synthetic_inputs(tower32, [grid], device=device, seed=seed + i)
        label = f"sample {i} grid={tuple(grid)}"
        with torch.no_grad():
            ref32 = _run(tower32, False, lambda: features(tower32, pixels, grid_thw))  # noqa: B023
            out32 = _run(tower32, True, lambda: features(tower32, pixels, grid_thw))  # noqa: B023
        for key in ref32:
            checks.append(
                _fp32_check("tower", f"{label} {key}", compare(ref32[key], out32[key]), th.fp32_tower_rel)
            )
        for dtype, model in low_towers.items():
            px = pixels.to(dtype)
            with torch.no_grad():
                ref = _run(model, False, lambda: features(model, px, grid_thw))  # noqa: B023
                out = _run(model, True, lambda: features(model, px, grid_thw))  # noqa: B023
            for key in ref:
                checks.append(
                    _low_precision_check(
                        "tower",
                        f"{label} {key}",
                        str(dtype).replace("torch.", ""),
                        compare(ref[key], out[key]),
                        compare(ref32[key], ref[key]),
                        compare(ref32[key], out[key]),
                        th,
                    )
                )
    if backward and grids:
        pixels, grid_thw = synthetic_inputs(tower32, [grids[0]], device=device, seed=seed)
        grads = {}
        for patched in (False, True):
            tower32.zero_grad(set_to_none=True)
            merged = _run(
                tower32, patched, lambda: tower_outputs(tower32(pixels, grid_thw=grid_thw))["merged"]
            )  # noqa: B023
            proj = torch.randn(merged.shape, generator=torch.Generator().manual_seed(2)).to(device)
            (merged * proj).sum().backward()
            grads[patched] = torch.cat([p.grad.flatten() for p in tower32.parameters() if p.grad is not None])
        checks.append(
            _fp32_check(
                "grad",
                "tower parameters (all, concatenated)",
                compare(grads[False], grads[True]),
                th.fp32_grad_rel,
            )
        )
    return checks


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
) -> VerifyReport:
    """Compare the patched model with the original on the same inputs, forward and backward.

    ``model`` is a module (the user's own, patched or not: its state is restored afterwards), a local
    checkpoint directory, or ``ref:NAME``; for a path only the vision tower is loaded. ``grids`` are the
    per-sample (t, h, w) patch grids fed to the tower; ``n_windows`` the number of patches in layer checks.
    """
    from vlfast.models import find_vision_tower, load_vision_tower

    th = thresholds or Thresholds()
    low = []
    for d in dtypes:
        dt = DTYPES.get(d, d) if isinstance(d, str) else d
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"unknown dtype {d!r}; use one of {sorted(DTYPES)}")
        if dt is not torch.float32:
            low.append(dt)
    if n_windows < 1:
        raise ValueError(f"n_windows must be >= 1, got {n_windows}")
    device = torch.device(device)
    if isinstance(model, nn.Module):
        label, root = type(model).__name__, model
    elif isinstance(model, str):
        label, root = model, load_vision_tower(model, tiny=tiny, dtype=torch.float32)
    else:
        raise TypeError(
            f"verify expects an nn.Module, a checkpoint directory or ref:NAME, got {type(model).__name__}"
        )
    report = VerifyReport(model=label, device=str(device))
    convs = _convs(root)
    if not convs:
        report.notes.append("no stride == kernel convolution in this model: nothing to verify")
        return report
    gen = torch.Generator().manual_seed(seed)
    for name, conv in convs:
        report.checks += _layer_checks(name, conv, n_windows, low, device, th, gen, backward)
    try:
        _, tower = find_vision_tower(root)
    except ValueError:
        report.notes.append("no vision tower (forward taking grid_thw) found: layer checks only")
        return report
    report.checks += _tower_checks(tower, list(grids), low, device, th, seed, backward)
    return report
