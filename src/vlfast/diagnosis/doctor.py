"""``vlfast.doctor``: is the patch embedding on a slow path on this machine, why, and what fixes it.

The diagnosis runs in four steps, data first and rendering last:

1. scan the model (or every built-in reference, on ``device="meta"``) for stride == kernel convs;
2. collect environment :class:`~vlfast.diagnosis.facts.Facts`, each probe failing soft;
3. time each conv geometry against its GEMM here (:mod:`vlfast.diagnosis.probe`) - the measurement decides;
4. explain the result with the known rules (:mod:`vlfast.diagnosis.rules`) and name the fix and its saving.

The :class:`DoctorReport` renders itself as JSON (schema ``vlfast.doctor/1``, documented in
``docs/doctor.md``) or as a paste-ready markdown block; ``vlfast doctor`` adds rich tables.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from vlfast.diagnosis.facts import (
    Facts,
    check_device,
    collect_facts,
    cudnn_version_str,
    default_device,
    default_dtype,
    dtype_name,
)
from vlfast.diagnosis.probe import (
    DEFAULT_PATCHES,
    ConvShape,
    ProbeResult,
    conv_shapes,
    merge_shapes,
    probe_conv,
)
from vlfast.diagnosis.rules import ConvGeometry, RuleHit, evaluate

__all__ = ["SCHEMA", "SLOW_RATIO", "DoctorReport", "Finding", "Fix", "doctor", "verdict_for"]

SCHEMA = "vlfast.doctor/1"
SLOW_RATIO = 2.0  # conv / GEMM at or above this is a slow path worth fixing

Verdict = Literal["slow", "patched", "ok", "unmeasured", "no-convs"]

# The fixes vlfast offers, most local first. Shown whenever a slow path is found.
VLFAST_FIXES: tuple[tuple[str, str, str], ...] = (
    ("code", "import vlfast; vlfast.patch(model)", "one line after the model is built; exact, reversible"),
    (
        "code",
        "import vlfast; vlfast.patch_transformers()",
        "once, before from_pretrained: patches every transformers model built afterwards",
    ),
    (
        "env",
        "VLFAST_PATCH=1 python train.py ...",
        "no code change: every transformers model built is patched",
    ),
    (
        "cli",
        "python -m vlfast.run train.py ...   |   torchrun --nproc-per-node N -m vlfast.run train.py ...",
        "wraps an unmodified script (also under torchrun)",
    ),
)


@dataclass(frozen=True)
class Fix:
    kind: str  # "code", "env", "cli" or "environment"
    text: str  # paste-ready
    note: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "text": self.text, "note": self.note}


@dataclass
class Finding:
    """One conv geometry: its measurement, the rules that explain it and its status."""

    probe: ProbeResult
    rules: list[str] = field(default_factory=list)
    status: Literal["slow", "ok", "error", "skipped"] = "ok"

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "rules": list(self.rules), **self.probe.to_dict()}


def verdict_for(findings: list[Finding], *, slow_ratio: float = SLOW_RATIO) -> Verdict:
    """The verdict from measurements alone: rules never change it."""
    if not findings:
        return "no-convs"
    slow = [f for f in findings if f.status == "slow"]
    if slow:
        return "patched" if all(f.probe.shape.patched for f in slow) else "slow"
    if all(f.status in ("error", "skipped") for f in findings):
        return "unmeasured"
    return "ok"


@dataclass
class DoctorReport:
    """Everything ``doctor`` found: facts, per-geometry findings, fired rules, verdict and fixes."""

    target: str
    facts: Facts
    findings: list[Finding]
    rules: list[RuleHit]
    verdict: Verdict
    summary: str
    fixes: list[Fix]
    savings_ms_per_sample: dict[str, float]  # model label -> conv time saved per sample by the patch
    patches: int
    slow_ratio: float = SLOW_RATIO
    elapsed_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """1 when a patchable conv is measured >= ``slow_ratio`` x slower than its GEMM and is not patched."""
        return 1 if self.verdict == "slow" else 0

    @property
    def expected_saving_ms_per_sample(self) -> float | None:
        return max(self.savings_ms_per_sample.values()) if self.savings_ms_per_sample else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "target": self.target,
            "verdict": self.verdict,
            "exit_code": self.exit_code,
            "summary": self.summary,
            "slow_ratio": self.slow_ratio,
            "patches_per_sample": self.patches,
            "expected_saving_ms_per_sample": self.expected_saving_ms_per_sample,
            "savings_ms_per_sample": dict(self.savings_ms_per_sample),
            "fix": self.fixes[0].text if self.fixes else None,
            "fixes": [f.to_dict() for f in self.fixes],
            "findings": [f.to_dict() for f in self.findings],
            "rules": [r.to_dict() for r in self.rules],
            "facts": self.facts.to_dict(),
            "notes": list(self.notes),
            "elapsed_s": self.elapsed_s,
        }

    def to_markdown(self) -> str:
        """A paste-ready block for bug reports."""
        f = self.facts
        gpu = f.gpu_name and f"{f.gpu_name} (sm_{''.join(map(str, f.gpu_capability or ()))})"
        env = [
            ("vlfast", f.vlfast_version),
            ("python", f.python),
            ("platform", f.platform),
            ("torch", f"{f.torch_version} ({f.torch_build})"),
            ("CUDA (build / driver)", f"{f.torch_cuda} / {f.cuda_driver} (driver {f.nvidia_driver})"),
            (
                "cuDNN (compile / runtime)",
                f"{cudnn_version_str(f.cudnn_compile)} / {cudnn_version_str(f.cudnn_runtime)}",
            ),
            (
                "cudnn enabled / benchmark / tf32",
                f"{f.cudnn_enabled} / {f.cudnn_benchmark} / {f.cudnn_allow_tf32}",
            ),
            ("GPU", gpu),
            ("MPS (built / available)", f"{f.mps_built} / {f.mps_available}"),
            ("oneDNN (available / enabled)", f"{f.onednn_available} / {f.onednn_enabled}"),
            ("CPU capability / threads", f"{f.cpu_capability} / {f.num_threads}"),
            ("transformers", f"{f.transformers_version} (fusion_config: {f.transformers_fusion})"),
            ("VLFAST_PATCH", f.autopatch_env or "unset"),
            ("model patched", f.model_patched),
        ]
        if f.torch_build not in ("cuda", "rocm"):  # a CPU build: GPU facts do not apply
            skip = (
                "CUDA (build / driver)",
                "cuDNN (compile / runtime)",
                "cudnn enabled / benchmark / tf32",
                "GPU",
            )
            env = [(k, "n/a (CPU build)" if k in skip else v) for k, v in env]
        lines = [
            "### vlfast doctor",
            "",
            f"**Verdict: {self.verdict}** (exit {self.exit_code}). {self.summary}",
            "",
            f"Target: `{self.target}` on `{f.device}` in `{f.dtype}`, {self.patches:,} patches per sample.",
            "",
            "| conv | where | conv ms/sample | GEMM ms/sample | ratio | status | rules |",
            "|---|---|---:|---:|---:|---|---|",
        ]
        for x in self.findings:
            p = x.probe
            lines.append(
                f"| {p.shape.describe()} | {', '.join(p.shape.names[:3])}{' ...' if len(p.shape.names) > 3 else ''} "
                f"| {_num(p.conv.median_ms if p.conv else None)} | {_num(p.gemm.median_ms if p.gemm else None)} "
                f"| {_num(p.ratio, 'x')} | {x.status}{' (' + p.error + ')' if p.error else ''} "
                f"| {', '.join(x.rules) or '-'} |"
            )
        lines += ["", "| fact | value |", "|---|---|"]
        lines += [f"| {k} | {_fact(v)} |" for k, v in env]
        if self.rules:
            lines += ["", "Rules that apply:"]
            lines += [f"- `{r.id}`: {r.title} ({r.source})" for r in self.rules]
        if self.fixes:
            lines += ["", "Fix (any one):", ""]
            lines += [f"- `{x.text}` ({x.kind}: {x.note})" for x in self.fixes]
        if self.notes:
            lines += ["", *[f"- {n}" for n in self.notes]]
        return "\n".join(lines) + "\n"


def _num(v: float | None, unit: str = "") -> str:
    if v is None:
        return "-"
    return f"{v:,.1f}{unit}" if v >= 10 else f"{v:.3g}{unit}"


def _fact(v: Any) -> str:
    if v is None or (isinstance(v, str) and v.startswith("None")):
        return "could not collect" if v is None else v
    return str(v)


# ------------------------------------------------------------------------------------------- scanning


def _scan(model: nn.Module | str | None, patches: int) -> tuple[str, list[ConvShape]]:
    """(target label, conv shapes) for a module, a spec (``ref:NAME`` or checkpoint dir) or None."""
    from vlfast import models

    if model is None:
        shapes: list[ConvShape] = []
        for name in models.REFERENCES:
            tower = models.build_reference(name, device="meta")
            shapes += conv_shapes(tower, patches=patches, label=name)
        return f"built-in references ({len(models.REFERENCES)})", shapes
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if isinstance(model, nn.Module):
        return type(model).__name__, conv_shapes(model, patches=patches, label=type(model).__name__)
    if isinstance(model, str):
        tower = models.load_vision_tower(model, device="meta")
        label = model.removeprefix(models.REF_PREFIX)
        return model, conv_shapes(tower, patches=patches, label=label)
    raise TypeError(
        f"doctor(model=...) takes an nn.Module, a spec string (ref:NAME or a checkpoint dir) or None, "
        f"got {type(model).__name__}"
    )


def _savings(findings: list[Finding]) -> dict[str, float]:
    """Per model label: conv time saved per sample by the GEMM, over that model's slow, unpatched convs."""
    out: dict[str, float] = {}
    for f in findings:
        if f.status != "slow" or f.probe.shape.patched or f.probe.saving_ms is None:
            continue
        for name in f.probe.shape.names:
            label = name.split(":", 1)[0]
            out[label] = out.get(label, 0.0) + f.probe.saving_ms
    return out


def _fixes(verdict: Verdict, rules: list[RuleHit], facts: Facts) -> list[Fix]:
    if verdict != "slow":
        return []
    fixes = [Fix(k, t, n) for k, t, n in VLFAST_FIXES]
    if facts.transformers_fusion:
        fixes.append(
            Fix(
                "code",
                'Model.from_pretrained(path, fusion_config={"patch_embeddings": True})',
                "transformers' own opt-in: replaces the module and renames its parameter (linear_proj)",
            )
        )
    seen: set[str] = set()
    for r in rules:
        if r.env_fix not in seen and not r.env_fix.startswith("none"):
            seen.add(r.env_fix)
            fixes.append(Fix("environment", r.env_fix, f"removes the cause named by rule {r.id}"))
    return fixes


def _summary(verdict: Verdict, findings: list[Finding], savings: dict[str, float], slow_ratio: float) -> str:
    ratios = [f.probe.ratio for f in findings if f.probe.ratio is not None]
    worst = max(ratios, default=None)
    if verdict == "no-convs":
        return "No stride == kernel convolution found: nothing for vlfast to patch."
    if verdict == "unmeasured":
        if all(f.status == "skipped" for f in findings):
            return "Probe disabled: facts and rules only, no verdict."
        return "The probe could not time any convolution here; see the errors below."
    if verdict == "ok":
        return (
            f"Every patchable conv runs within {slow_ratio:g}x of its GEMM here (worst {worst:.2f}x): "
            "no slow path on this machine and dtype."
        )
    if verdict == "patched":
        return (
            f"A conv is {worst:.1f}x slower than its GEMM here, but the model is already patched: "
            "the fast path is in use."
        )
    best = max(savings.values(), default=0.0)
    slowest = max((f for f in findings if f.status == "slow"), key=lambda f: f.probe.ratio)
    where = slowest.probe.shape.names[0] if slowest.probe.shape.names else slowest.probe.shape.describe()
    return (
        f"Slow path: {where} is {slowest.probe.ratio:.1f}x slower than its GEMM here; patching saves "
        f"~{best:,.1f} ms per sample ({best / 36:,.1f} h per 100,000 samples)."
    )


# ------------------------------------------------------------------------------------------ the doctor


def doctor(
    model: nn.Module | str | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    patches: int = DEFAULT_PATCHES,
    budget_s: float = 8.0,
    slow_ratio: float = SLOW_RATIO,
    probe: bool = True,
) -> DoctorReport:
    """Diagnose the patch-embedding slow path for ``model`` on this machine.

    Args:
        model: an ``nn.Module`` (its convs and patch state are read, its weights never touched), a spec
            (``ref:NAME`` or a local checkpoint directory; only shapes are read) or ``None`` for every
            built-in reference.
        device, dtype: what to probe; default the best available device, bfloat16 where supported.
        patches: windows per sample fed to the patch embedding (default one 8-frame 512x384 clip, 3,072).
        budget_s: total time the probe may spend, shared between the distinct conv geometries.
        slow_ratio: conv / GEMM ratio at which a conv counts as slow.
        probe: time the convs (the verdict needs it); ``False`` gives facts and rules only.
    """
    if patches < 1:
        raise ValueError(f"patches must be >= 1, got {patches}")
    if budget_s <= 0:
        raise ValueError(f"budget_s must be positive, got {budget_s}")
    if slow_ratio <= 1:
        raise ValueError(f"slow_ratio must be > 1, got {slow_ratio}")
    t0 = time.perf_counter()
    dev = check_device(device) if device is not None else default_device()
    dt = dtype_name(dtype) if dtype is not None else default_dtype(dev)
    target, shapes = _scan(model, patches)
    gc.collect()  # the scan's temporary towers: collect them now, not inside a timed call
    geometries = merge_shapes(shapes)
    patched = all(s.patched for s in shapes) if shapes else None
    facts = collect_facts(dev, dt, model_patched=patched)

    convs = [ConvGeometry(g.kernel_size, g.describe()) for g in geometries]
    hits = evaluate(facts, convs)
    per_shape_budget = max(0.5, budget_s / max(1, len(geometries)))
    findings: list[Finding] = []
    for g, c in zip(geometries, convs):
        if probe:
            result = probe_conv(g, device=dev, dtype=getattr(torch, dt), budget_s=per_shape_budget)
        else:
            result = ProbeResult(g, dev, dt, notes=["probe disabled"])
        rules = [h.id for h in hits if c.name in h.convs]
        if result.error is not None:
            status = "error"
        elif result.ratio is None:
            status = "skipped"
        else:
            status = "slow" if result.ratio >= slow_ratio else "ok"
        findings.append(Finding(result, rules, status))

    verdict = verdict_for(findings, slow_ratio=slow_ratio)
    savings = _savings(findings)
    notes: list[str] = []
    for f in findings:
        if f.status == "slow" and not f.rules:
            notes.append(
                f"{f.probe.shape.describe()} is {f.probe.ratio:.1f}x slower than its GEMM and no known rule "
                "explains it: please report it with `vlfast doctor --markdown`."
            )
        if f.status == "ok" and f.rules:
            notes.append(
                f"Rule(s) {', '.join(f.rules)} predict a slow path for {f.probe.shape.describe()}, but it "
                f"measures {f.probe.ratio:.2f}x: the measurement wins (this build may carry a fix)."
            )
    if facts.autopatch_env and patched is False:
        notes.append(
            f"VLFAST_PATCH={facts.autopatch_env} is set but the scanned model is not patched: the hook "
            "patches models built by transformers in a process where vlfast's .pth hook is active."
        )
    return DoctorReport(
        target=target,
        facts=facts,
        findings=findings,
        rules=hits,
        verdict=verdict,
        summary=_summary(verdict, findings, savings, slow_ratio),
        fixes=_fixes(verdict, hits, facts),
        savings_ms_per_sample=savings,
        patches=patches,
        slow_ratio=slow_ratio,
        elapsed_s=time.perf_counter() - t0,
        notes=notes,
    )
