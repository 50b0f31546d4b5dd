"""``vlfast.doctor``: is the patch embedding on a slow path on this machine, why, and what fixes it.

Scan the convs, collect the facts, time each geometry against its GEMM (the measurement decides), explain
with the rules. A *slow path* (a fallback kernel, exit 1) is told from an ordinary *gain* (exit 4).
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from vlfast.diagnosis.facts import (
    Facts,
    collect_facts,
    cpu_facts,
    cudnn_libraries,
    cudnn_version_str,
    device_and_dtype,
)
from vlfast.diagnosis.probe import (
    DEFAULT_PATCHES,
    MIN_ROUNDS,
    Budget,
    ConvShape,
    ProbeResult,
    conv_shapes,
    merge_shapes,
    probe_conv,
)
from vlfast.diagnosis.rules import ConvGeometry, RuleHit, evaluate
from vlfast.errors import InputRefused

__all__ = [
    "EXIT_CODES",
    "PATHOLOGICAL_RATIO",
    "SCHEMA",
    "SLOW_RATIO",
    "DoctorReport",
    "Finding",
    "Fix",
    "disagreements",
    "doctor",
    "verdict_for",
]

SCHEMA = "vlfast.doctor/2"
SLOW_RATIO = 2.0  # conv / GEMM at or above this: patching gains enough to be worth saying
PATHOLOGICAL_RATIO = 10.0  # at or above this, whatever the rules say: a fallback kernel, a slow path
AFTER_PROBE_S = 0.5  # kept from the budget for the rules, notes and output (~0.1 s on a 2-core CPU)
ROUNDS_DISAGREE = 0.10  # ratio of medians vs median of per-round ratios beyond this: a note says so

Verdict = Literal["slow-path", "gain", "patched", "ok", "unmeasured", "no-convs"]
Status = Literal["slow-path", "gain", "ok", "error", "skipped"]
FailOn = Literal["any", "slow-path"]
Workload = Literal["training", "inference"]
# The CLI's exit status per verdict; 2 (bad input) and 3 (could not run) come from the CLI itself.
EXIT_CODES: dict[str, int] = {"slow-path": 1, "gain": 4}
_RANK = {"slow-path": 2, "gain": 1, "ok": 0}


def _vlfast_fixes(all_convs: bool) -> list[tuple[str, str, str]]:
    """The fixes vlfast offers, most local first. ``patch_transformers`` and its switches patch Conv3d
    by default: when a slow conv is a Conv1d/Conv2d (GLM's ``downsample``), each names ``all_convs``."""
    code = "vlfast.patch_transformers(all_convs=True)" if all_convs else "vlfast.patch_transformers()"
    env = "VLFAST_PATCH=all" if all_convs else "VLFAST_PATCH=1"
    run = "-m vlfast.run --all-convs" if all_convs else "-m vlfast.run"
    exact = "one line after the model is built; exact, reversible"
    once = "once, before from_pretrained: patches every transformers model built afterwards"
    also = " (all_convs: the Conv2d too)" if all_convs else ""
    cli = f"python {run} train.py ...   |   torchrun --nproc-per-node N {run} train.py ..."
    return [
        ("code", "import vlfast; vlfast.patch(model)", exact),
        ("code", f"import vlfast; {code}", once + also),
        ("env", f"{env} python train.py ...", "no code change: every transformers model built is patched"),
        ("cli", cli, "wraps an unmodified script (also under torchrun)"),
    ]


@dataclass(frozen=True)
class Fix:
    kind: str  # "code", "env", "cli" or "environment"
    text: str  # paste-ready
    note: str = ""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass
class Finding:
    """One conv geometry: its measurement, the rules that explain it and its status per pass.

    ``status`` is the worse of the two passes' (``backward_status`` None when not counted, as for
    inference). ``channels_last_escapes``: a channels-last input measures under ``slow_ratio`` while the
    contiguous one does not (None: not probed).
    """

    probe: ProbeResult
    rules: list[str] = field(default_factory=list)
    status: Status = "ok"
    forward_status: Status = "ok"
    backward_status: Status | None = None
    channels_last_escapes: bool | None = None
    disagreements: list[str] = field(default_factory=list)  # rules the selected backend contradicts

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "disagreements": list(self.disagreements),
            "forward_status": self.forward_status,
            "backward_status": self.backward_status,
            "channels_last_escapes": self.channels_last_escapes,
            "rules": list(self.rules),
            **self.probe.to_dict(),
        }


def _worse(a: Status, b: Status | None) -> Status:
    if b is None or b == "skipped":
        return a
    if a == "skipped":
        return b
    return a if _RANK.get(a, 0) >= _RANK.get(b, 0) else b


def verdict_for(findings: list[Finding], *, slow_ratio: float = SLOW_RATIO) -> Verdict:
    """The verdict from measurements alone (a rule only turns a measured gain into a slow path)."""
    if not findings:
        return "no-convs"
    losing = [f for f in findings if f.status in ("slow-path", "gain")]
    unpatched = [f for f in losing if not f.probe.shape.patched]
    if any(f.status == "slow-path" for f in unpatched):
        return "slow-path"
    if unpatched:
        return "gain"
    if losing:
        return "patched"
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
    savings_ms_per_sample: dict[str, float]  # model label -> forward conv time saved per sample
    patches: int
    slow_ratio: float = SLOW_RATIO
    elapsed_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    backward_savings_ms_per_sample: dict[str, float] = field(default_factory=dict)
    workload: Workload = "training"
    fail_on: FailOn = "any"
    budget_s: float | None = None
    probe_s: float | None = None  # what the probe took of the budget
    left_out: list[str] = field(default_factory=list)  # what the budget left out, one line each
    dtype_reason: str | None = None  # why this dtype (on CPU: native or emulated here)

    @property
    def exit_code(self) -> int:
        """1: an unpatched slow path; 4: an unpatched gain (0 with ``fail_on="slow-path"``); else 0."""
        code = EXIT_CODES.get(self.verdict, 0)
        return 0 if self.fail_on == "slow-path" and self.verdict == "gain" else code

    def pass_verdict(self, phase: str) -> Verdict | None:
        """The verdict of one pass alone ("forward" or "backward"); None when that pass was not counted."""
        attr = f"{phase}_status"
        if phase == "backward" and all(f.backward_status is None for f in self.findings):
            return None
        return verdict_for(
            [
                Finding(f.probe, f.rules, getattr(f, attr) or "skipped", getattr(f, attr) or "skipped")
                for f in self.findings
            ],
            slow_ratio=self.slow_ratio,
        )

    @property
    def expected_saving_ms_per_sample(self) -> float | None:
        return max(self.savings_ms_per_sample.values()) if self.savings_ms_per_sample else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "target": self.target,
            "verdict": self.verdict,
            "forward_verdict": self.pass_verdict("forward"),
            "backward_verdict": self.pass_verdict("backward"),
            "workload": self.workload,
            "exit_code": self.exit_code,
            "exit_codes": {**EXIT_CODES, "fail_on": self.fail_on},
            "summary": self.summary,
            "slow_ratio": self.slow_ratio,
            "pathological_ratio": PATHOLOGICAL_RATIO,
            "patches_per_sample": self.patches,
            "expected_saving_ms_per_sample": self.expected_saving_ms_per_sample,
            "savings_ms_per_sample": dict(self.savings_ms_per_sample),
            "backward_savings_ms_per_sample": dict(self.backward_savings_ms_per_sample),
            "fix": self.fixes[0].text if self.fixes else None,
            "fixes": [f.to_dict() for f in self.fixes],
            "findings": [f.to_dict() for f in self.findings],
            "rules": [r.to_dict() for r in self.rules],
            "facts": self.facts.to_dict(),
            "notes": list(self.notes),
            "budget_s": self.budget_s,
            "probe_s": self.probe_s,
            "left_out": list(self.left_out),
            "dtype_reason": self.dtype_reason,
            "elapsed_s": self.elapsed_s,
        }

    def to_markdown(self) -> str:
        """A paste-ready block for bug reports."""
        f, cudnn = self.facts, cudnn_version_str
        gpu = f.gpu_name and f"{f.gpu_name} (sm_{''.join(map(str, f.gpu_capability or ()))})"
        gpu_rows = [
            ("CUDA (build / driver)", f"{f.torch_cuda} / {f.cuda_driver} (driver {f.nvidia_driver})"),
            ("cuDNN (compile / runtime)", f"{cudnn(f.cudnn_compile)} / {cudnn(f.cudnn_runtime)}"),
            (
                "cudnn enabled / benchmark / tf32",
                f"{f.cudnn_enabled} / {f.cudnn_benchmark} / {f.cudnn_allow_tf32}",
            ),
            ("cuDNN libraries loaded", libraries_cell(f)),
            ("GPU", gpu),
        ]
        if f.torch_build not in ("cuda", "rocm"):  # a CPU build: GPU facts do not apply
            gpu_rows = [(k, "n/a (CPU build)") for k, _ in gpu_rows]
        env = [
            ("vlfast", f.vlfast_version),
            ("python", f.python),
            ("platform", f.platform),
            ("torch", f"{f.torch_version} ({f.torch_build})"),
            *gpu_rows,
            ("MPS (built / available)", f"{f.mps_built} / {f.mps_available}"),
            ("oneDNN (available / enabled)", f"{f.onednn_available} / {f.onednn_enabled}"),
            ("CPU", f.cpu_model),
            ("CPU capability / threads", f"{f.cpu_capability} / {f.num_threads}"),
            ("CPU bf16/fp16 features", cpu_features_cell(f)),
            ("dtype", f"{f.dtype}: {self.dtype_reason}" if self.dtype_reason else f.dtype),
            ("transformers", f"{f.transformers_version} (fusion_config: {f.transformers_fusion})"),
            ("VLFAST_PATCH", f.autopatch_env or "unset"),
            ("model patched", f.model_patched),
        ]
        lines = [
            "### vlfast doctor",
            "",
            f"**Verdict: {self.verdict}** (exit {self.exit_code}). {self.summary}",
            "",
            f"Target: `{self.target}` on `{f.device}` in `{f.dtype}`, {self.patches:,} patches per sample.",
            "",
            "| conv | where | windows x rounds | conv ms/sample | GEMM ms/sample | ratio (spread) "
            "| conv bwd ms/sample | GEMM bwd ms/sample | backward ratio (spread) | channels-last ratio "
            "| backend | status | rules |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
        ]
        for x in self.findings:
            p = x.probe
            lines.append(
                f"| {p.shape.describe()} | {', '.join(p.shape.names[:3])}{' ...' if len(p.shape.names) > 3 else ''} "
                f"| {timed_cell(p)} | {_num(p.per_sample_ms('conv'))} | {_num(p.per_sample_ms('gemm'))} "
                f"| {ratio_cell(p.ratio, p.spread, p.reliable)} "
                f"| {_num(p.per_sample_ms('conv_backward'))} | {_num(p.per_sample_ms('gemm_backward'))} "
                f"| {ratio_cell(p.backward_ratio, p.backward_spread, p.backward_reliable)} "
                f"| {_num(p.channels_last_ratio, 'x')} | {p.backend or '-'} "
                f"| {x.status}{' (' + p.error + ')' if p.error else ''} "
                f"| {', '.join(x.rules) or '-'} |"
            )
        lines += ["", "| fact | value |", "|---|---|"]
        lines += [f"| {k} | {'could not collect' if v is None else v} |" for k, v in env]
        if self.rules:
            lines += ["", "Rules that apply:"]
            lines += [f"- `{r.id}`: {r.title} ({r.source})" for r in self.rules]
        if self.fixes:
            lines += ["", "Fix (any one):", ""]
            lines += [f"- `{x.text}` ({x.kind}: {x.note})" for x in self.fixes]
        if self.left_out:
            lines += ["", f"Left out for lack of budget ({self.budget_s:g} s):", ""]
            lines += [f"- {x}" for x in self.left_out]
        if self.notes:
            lines += ["", *[f"- {n}" for n in self.notes]]
        return "\n".join(lines) + "\n"


def _num(v: float | None, unit: str = "") -> str:
    if v is None:
        return "-"
    return f"{v:,.1f}{unit}" if v >= 10 else f"{v:.3g}{unit}"


def timed_cell(p: ProbeResult) -> str:
    """ "768 x 3": windows per timed call x rounds (figures are scaled to the sample's windows)."""
    if p.windows_timed is None or p.conv is None:
        return "-"
    return f"{p.windows_timed:,} x {p.conv.n}"


def ratio_cell(ratio: float | None, spread: float | None, reliable: bool) -> str:
    """ "4.12x (spread 6%)", or "4.12x (unreliable)" under MIN_ROUNDS rounds per side."""
    if ratio is None:
        return "-"
    if not reliable:
        return f"{ratio:.2f}x (unreliable)"
    return f"{ratio:.2f}x (spread {spread:.0%})" if spread is not None else f"{ratio:.2f}x"


def libraries_cell(f: Facts) -> str | None:
    """The loaded cuDNN libraries, listed in full only when they come from more than one place."""
    libs = f.cudnn_libraries
    if not libs:
        return None
    dirs = {os.path.dirname(p) for p in libs.values()}
    if len(dirs) == 1:
        return f"{len(libs)} from {dirs.pop()}"
    return "; ".join(f"{name}: {path}" for name, path in sorted(libs.items()))


def cpu_features_cell(f: Facts) -> str | None:
    if f.cpu_flags is None and f.onednn_bf16 is None:
        return None
    flags = ", ".join(x for x in (f.cpu_flags or ()) if x not in ("avx2", "avx512f")) or "none"
    env = {"ATEN_CPU_CAPABILITY": f.aten_cpu_capability_env, "ONEDNN_MAX_CPU_ISA": f.onednn_max_cpu_isa_env}
    limits = [f"{k}={v}" for k, v in env.items() if v]
    return f"{flags}; oneDNN bf16 {f.onednn_bf16}, fp16 {f.onednn_fp16}" + (
        f"; limits: {', '.join(limits)}" if limits else ""
    )


# The stride == kernel convs of each reference family, in module order: (module, kind, bias). Building the
# towers on meta gives the same, but importing five families' modeling code took 9 s of a 12 s budget at
# load 8; tests/test_doctor_layout.py checks this table against the built towers.
_FAMILY_CONVS: dict[str, tuple[tuple[str, str, bool], ...]] = {
    "qwen2_vl": (("patch_embed.proj", "Conv3d", False),),
    "qwen2_5_vl": (("patch_embed.proj", "Conv3d", False),),
    "qwen3_vl": (("patch_embed.proj", "Conv3d", True),),
    "qwen3_vl_moe": (("patch_embed.proj", "Conv3d", True),),
    "glm4v": (("patch_embed.proj", "Conv3d", True), ("downsample", "Conv2d", True)),
}


def reference_conv_shapes(name: str, patches: int) -> list[ConvShape] | None:
    """The conv shapes of the reference ``name`` from its published numbers, without building it; None for a
    family :data:`_FAMILY_CONVS` does not describe, or where ``VLFAST_PATCH`` may patch what is built."""
    from vlfast.models.references import resolve_reference

    ref = resolve_reference(name)
    convs = _FAMILY_CONVS.get(ref.family)
    if convs is None or os.environ.get("VLFAST_PATCH"):
        return None
    v = ref.vision
    size = {
        # the patch embedding: pixels in, the tower's width out, one window per (t, p, p) patch
        "patch_embed.proj": (
            int(v["in_channels"]),
            ref.width,
            (v["temporal_patch_size"], *[v["patch_size"]] * 2),
        ),
        # GLM's merger input: the width in, the language model's out, over spatial_merge_size^2 patches
        "downsample": (ref.width, ref.out_width, (v["spatial_merge_size"],) * 2),
    }
    shapes = []
    for module, kind, bias in convs:
        c_in, c_out, kernel = size[module]
        kernel = tuple(int(k) for k in kernel)
        windows = patches if not shapes else max(1, patches // math.prod(kernel))
        shapes.append(ConvShape(kind, c_in, c_out, kernel, bias, windows, (f"{ref.name}:{module}",)))
    return shapes


def _scan(model: nn.Module | str | None, patches: int) -> tuple[str, list[ConvShape]]:
    """(target label, conv shapes) for a module, a spec (``ref:NAME`` or checkpoint dir) or None."""
    from vlfast import models

    if model is None:
        shapes: list[ConvShape] = []
        # those the installed transformers builds (transformers 4.45 has Qwen2-VL only)
        names = [name for name, ref in models.REFERENCES.items() if ref.installed()]
        for name in names:  # the published shapes where the family is known (never an empty list)
            shapes += reference_conv_shapes(name, patches) or conv_shapes(
                models.build_reference(name, device="meta"), patches=patches, label=name
            )
        return f"built-in references ({len(names)})", shapes
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if isinstance(model, nn.Module):
        return type(model).__name__, conv_shapes(model, patches=patches, label=type(model).__name__)
    if isinstance(model, str):
        ref = models.ModelRef.of(model)
        if ref.is_reference and (known := reference_conv_shapes(model, patches)) is not None:
            return model, known
        tower = models.load_vision_tower(model, device="meta")
        return model, conv_shapes(tower, patches=patches, label=ref.label)
    raise InputRefused(
        f"doctor(model=...) takes an nn.Module, a spec string (ref:NAME or a checkpoint dir) or None, "
        f"got {type(model).__name__}"
    )


def _fusion_notes(model: nn.Module | str | None) -> list[str]:
    """What transformers' own fusion did to ``model``, or will do when its checkpoint is loaded."""
    from vlfast.models.ref import ModelRef
    from vlfast.patching.fusion import fused_patch_embeddings, fusion_note

    if isinstance(model, nn.Module) and (fused := fused_patch_embeddings(model)):
        where = ", ".join(f"{n or '<root>'} ({cls})" for n, cls in fused)
        return [
            f"transformers' fusion_config already replaced the patch embedding with a Linear in {where}: "
            f"it runs the GEMM already"
        ]
    if isinstance(model, (str, os.PathLike)) and not ModelRef.of(model).is_reference:
        return [note] if (note := fusion_note(model)) else []
    return []


def _model(name: str) -> str:
    return name.split(":", 1)[0]


def _losing(f: Finding) -> bool:
    return f.status in ("slow-path", "gain") and not f.probe.shape.patched


def _savings(findings: list[Finding], phase: str = "forward") -> dict[str, float]:
    """Per model label: time the GEMM saves per sample in one pass, over that model's losing, unpatched
    convs (a geometry two models share counts for each)."""
    out: dict[str, float] = {}
    for f in findings:
        saving = f.probe.saving_ms if phase == "forward" else f.probe.backward_saving_ms
        if not _losing(f) or saving is None:
            continue
        for label in dict.fromkeys(_model(n) for n in f.probe.shape.names):
            out[label] = out.get(label, 0.0) + saving
    return out


def _fixes(
    verdict: Verdict, findings: list[Finding], rules: list[RuleHit], facts: Facts
) -> tuple[list[Fix], list[str]]:
    """The fixes to list and notes on partial ones. Every listed fix fixes every losing conv: a fix that
    covers only some (an environment change a rule names for some convs, transformers' own fusion for
    the patch embedding alone) is a note, not a fix."""
    if verdict not in ("slow-path", "gain"):
        return [], []
    losing = [f for f in findings if _losing(f)]
    all_convs = any(f.probe.shape.kind != "Conv3d" for f in losing)
    fixes = [Fix(k, t, n) for k, t, n in _vlfast_fixes(all_convs)]
    notes: list[str] = []
    patch_embed_only = all(
        f.probe.shape.kind == "Conv3d" and all(n.endswith("patch_embed.proj") for n in f.probe.shape.names)
        for f in losing
    )
    if facts.transformers_fusion and patch_embed_only:
        fixes.append(
            Fix(
                "code",
                'Model.from_pretrained(path, fusion_config={"patch_embeddings": True})',
                "transformers' own opt-in: replaces the module and renames its parameter (linear_proj)",
            )
        )
    losing_convs = {f.probe.shape.describe() for f in losing}
    seen: set[str] = set()
    for r in rules:
        if r.env_fix in seen or r.env_fix.startswith("none"):
            continue
        seen.add(r.env_fix)
        if losing_convs <= set(r.convs):
            fixes.append(Fix("environment", r.env_fix, f"removes the cause named by rule {r.id}"))
        else:
            rest = ", ".join(sorted(losing_convs - set(r.convs)))
            notes.append(f"{r.env_fix} removes the cause named by rule {r.id}, but not for {rest}")
    return fixes, notes


HEADLINE_RULE = (
    "the headline names the model whose losing convs do the most multiply-adds per sample, and its largest "
    "such conv: read from their shapes, not from timings, so the same model every run"
)


def headline(verdict: Verdict, findings: list[Finding]) -> tuple[str, Finding]:
    """(model label, conv) the headline names for a ``slow-path`` or ``gain`` verdict, by HEADLINE_RULE
    (ties: the first model scanned). Measured savings decide nothing: two models whose savings differ by
    less than the noise took turns from one run to the next."""
    losing = [f for f in findings if _losing(f) and f.status == verdict]
    work: dict[str, int] = {}  # model -> multiply-adds per sample of its losing convs, in scan order
    for f in losing:
        for n in f.probe.shape.names:
            work[_model(n)] = work.get(_model(n), 0) + math.prod(f.probe.shape.gemm_shape)
    model = max(work, key=lambda m: work[m])  # max keeps the first of equals
    mine = [f for f in losing if any(_model(n) == model for n in f.probe.shape.names)]
    return model, max(mine, key=lambda f: math.prod(f.probe.shape.gemm_shape))


def _summary(
    verdict: Verdict, findings: list[Finding], savings: dict, backward: dict, slow_ratio: float
) -> str:
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
            "A conv is slower than its GEMM here, but the model is already patched: the fast path is in use."
        )
    model, worst_f = headline(verdict, findings)
    where = next(n for n in worst_f.probe.shape.names if _model(n) == model)
    passes = []
    if worst_f.forward_status in ("slow-path", "gain"):
        passes.append(f"{worst_f.probe.ratio:.1f}x slower than its GEMM forward")
    if worst_f.backward_status in ("slow-path", "gain"):
        passes.append(f"{worst_f.probe.backward_ratio:.1f}x backward")
    kind = "Slow path" if verdict == "slow-path" else "Gain available (no slow path)"
    if model not in savings and model not in backward:
        return (
            f"{kind}: {where} is {' and '.join(passes)}; no saving is estimated for {model}: none of its losing "
            f"convs was timed {MIN_ROUNDS} times per side within the budget (raise --budget)."
        )
    fwd, bwd = savings.get(model, 0.0), backward.get(model, 0.0)
    saving = f"~{fwd:,.1f} ms per sample forward" + (f" + {bwd:,.1f} ms backward" if bwd else "")
    hours = (fwd + bwd) / 36
    return f"{kind}: {where} is {' and '.join(passes)}; patching {model} saves {saving} ({hours:,.1f} h per 100,000 samples)."


def doctor(
    model: nn.Module | str | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    patches: int = DEFAULT_PATCHES,
    budget_s: float = 12.0,
    slow_ratio: float = SLOW_RATIO,
    probe: bool = True,
    workload: Workload = "training",
    fail_on: FailOn = "any",
    spent_s: float = 0.0,
) -> DoctorReport:
    """Diagnose the patch-embedding slow path for ``model`` on this machine (docs/doctor.md).

    ``model``: an ``nn.Module`` (its weights never touched), a spec (``ref:NAME`` or a checkpoint directory;
    only shapes are read) or None for every built-in reference. ``budget_s`` is the whole diagnosis, the
    CLI's start-up ``spent_s`` included; the probe shares what is left between the geometries, and what
    does not fit is left out and said so. ``workload="inference"`` times the forward only;
    ``fail_on="slow-path"`` gives exit 0 for a gain.
    """
    _refuse_arguments(patches, budget_s, spent_s, slow_ratio, workload, fail_on)
    t0 = time.perf_counter()
    clock0 = probe_clock()  # the budget's clock (a fake one in tests)
    dev, dt, choice = device_and_dtype(device, dtype, cpu_facts)
    target, shapes = _scan(model, patches)
    gc.collect()  # the scan's temporary towers: collect them now, not inside a timed call
    geometries = merge_shapes(shapes)
    patched = all(s.patched for s in shapes) if shapes else None
    facts = collect_facts(dev, dt, model_patched=patched)
    backward = workload == "training"
    before_s = spent_s + probe_clock() - clock0  # start-up, the scan and the facts
    budget = Budget(max(budget_s - before_s - AFTER_PROBE_S, 1e-3))
    results = _probe_all(geometries, dev, dt, budget, before_s, budget_s, probe, backward, slow_ratio)
    if probe and facts.torch_build == "cuda":  # cuDNN's sub-libraries load with the first convolution
        with contextlib.suppress(OSError):  # no /proc here
            facts.cudnn_libraries = cudnn_libraries() or facts.cudnn_libraries
    convs = {g.key: ConvGeometry(g.kernel_size, g.describe()) for g in geometries}
    # Inference runs no backward: a rule about the backward alone explains nothing there.
    hits = [h for h in evaluate(facts, list(convs.values())) if backward or "forward" in h.phases]
    findings = [_finding(results[g.key], convs[g.key].name, hits, backward, slow_ratio) for g in geometries]
    verdict = verdict_for(findings, slow_ratio=slow_ratio)
    savings = _savings(findings, "forward")
    backward_savings = _savings(findings, "backward") if backward else {}
    fixes, notes = _fixes(verdict, findings, hits, facts)
    if choice is not None and choice.warning:
        notes.insert(0, choice.warning)
    notes += _fusion_notes(model)
    left_out = [
        f"{f.probe.shape.describe()} ({', '.join(f.probe.shape.names)}): {f.probe.left_out}"
        for f in findings
        if f.probe.left_out
    ]
    notes += _left_out_note(left_out, budget_s, findings) + _finding_notes(findings)
    notes += _autopatch_notes(facts, patched)
    return DoctorReport(
        target=target,
        facts=facts,
        findings=findings,
        rules=hits,
        verdict=verdict,
        summary=_summary(verdict, findings, savings, backward_savings, slow_ratio),
        fixes=fixes,
        savings_ms_per_sample=savings,
        patches=patches,
        slow_ratio=slow_ratio,
        elapsed_s=time.perf_counter() - t0,
        notes=notes,
        backward_savings_ms_per_sample=backward_savings,
        workload=workload,
        fail_on=fail_on,
        budget_s=budget_s,
        probe_s=budget.spent_ms / 1e3 if probe else None,
        left_out=left_out,
        dtype_reason=choice.reason if choice is not None else None,
    )


def _refuse_arguments(patches, budget_s, spent_s, slow_ratio, workload, fail_on) -> None:
    for refused, why in (
        (patches < 1, f"patches must be >= 1, got {patches}"),
        (not budget_s > 0, f"budget_s must be positive, got {budget_s}"),
        (not spent_s >= 0, f"spent_s must be >= 0, got {spent_s}"),
        (slow_ratio <= 1, f"slow_ratio must be > 1, got {slow_ratio}"),
        (
            workload not in ("training", "inference"),
            f"workload must be 'training' or 'inference', got {workload!r}",
        ),
        (fail_on not in ("any", "slow-path"), f"fail_on must be 'any' or 'slow-path', got {fail_on!r}"),
    ):
        if refused:
            raise InputRefused(why)


def _left_out_note(left_out: list[str], budget_s: float, findings: list[Finding]) -> list[str]:
    if not left_out:
        return []
    more = budget_s * (1 + sum(1 for f in findings if f.probe.left_out))  # twice the budget per shape
    return [
        f"the {budget_s:g} s budget left out {len(left_out)} item(s), listed above; "
        f"--budget {more:g} would probe them"
    ]


def _probe_all(geometries, dev, dt, budget, before_s, budget_s, probe, backward, slow_ratio) -> dict:
    """Each geometry's ProbeResult, those most references share first (what the budget leaves out matters
    least)."""
    order = sorted(geometries, key=lambda g: -len({_model(n) for n in g.names}))
    results: dict[tuple, ProbeResult] = {}
    for i, g in enumerate(order):
        if not probe:
            results[g.key] = ProbeResult(g, dev, dt, notes=["probe disabled"])
            continue
        if budget_s - before_s - AFTER_PROBE_S <= 0:
            why = (
                f"the whole shape: {before_s:.1f} s of the {budget_s:g} s budget went before the probe "
                "(start-up, building the models, the facts)"
            )
            results[g.key] = ProbeResult(g, dev, dt, left_out=why)
            continue
        # What the earlier shapes left, shared by how many models each remaining shape stands for.
        weights = [len({_model(n) for n in x.names}) for x in order[i:]]
        share_s = max(0.0, budget.left_ms / 1e3) * weights[0] / sum(weights)
        if share_s <= 0:
            spent = "the whole shape: the budget was spent before it"
            results[g.key] = ProbeResult(g, dev, dt, left_out=spent)
            continue
        results[g.key] = probe_conv(
            g,
            device=dev,
            dtype=getattr(torch, dt),
            budget_s=share_s,
            budget=budget,
            stretch_s=share_s,  # up to twice its share when that keeps the backward in
            backward=backward,
            slow_ratio=slow_ratio,
        )
    return results


def _finding(
    result: ProbeResult, name: str, hits: list[RuleHit], backward: bool, slow_ratio: float
) -> Finding:
    mine = [h for h in hits if name in h.convs]
    rules, disagree = [h.id for h in mine], disagreements(mine, result.backend)
    if result.error is not None:
        return Finding(result, rules, "error", "error", disagreements=disagree)

    def status(ratio: float | None, phase: str) -> Status:  # a pathological rule makes a gain a slow path
        if ratio is None:
            return "skipped"
        pathological = any(h.pathological and phase in h.phases for h in mine)
        if ratio >= PATHOLOGICAL_RATIO or (ratio >= slow_ratio and pathological):
            return "slow-path"
        return "gain" if ratio >= slow_ratio else "ok"

    fwd = status(result.ratio, "forward")
    bwd = status(result.backward_ratio, "backward") if backward else None
    escapes = None
    if result.channels_last_ratio is not None and fwd in ("slow-path", "gain"):
        escapes = result.channels_last_ratio < slow_ratio
    return Finding(result, rules, _worse(fwd, bwd), fwd, bwd, escapes, disagree)


def _finding_notes(findings: list[Finding]) -> list[str]:
    notes = []
    for f in findings:
        where = f.probe.shape.describe()
        if f.probe.kernels:  # the evidence, as the original report gave it: what one conv call launches
            notes.append(
                f"{where}: ATen selects {f.probe.backend or 'an unknown backend'}; one "
                f"traced call launches {'; '.join(f.probe.kernels)}"
            )
        notes += [f"{where}: {d}" for d in f.disagreements]
        rounds = f.probe.round_ratio
        if f.probe.ratio and rounds and abs(rounds / f.probe.ratio - 1) > ROUNDS_DISAGREE:
            notes.append(
                f"{where}: its rounds disagree (the load changed while it was timed): "
                f"the medians give {f.probe.ratio:.2f}x, the table's ratio, but the median of the per-round "
                f"ratios is {rounds:.2f}x; run it again on a quieter machine for a figure to rely on"
            )
        if not f.probe.reliable and f.probe.conv is not None:
            notes.append(
                f"{where}: fewer than {MIN_ROUNDS} rounds per side fit in the budget; "
                "its figures are unreliable and left out of the savings"
            )
    for f in findings:
        where = f.probe.shape.describe()
        if f.status in ("slow-path", "gain") and not f.rules:
            notes.append(
                f"{where} is {_ratios(f)} slower than its GEMM and no known rule explains "
                "it: please report it with `vlfast doctor --markdown`."
            )
        if f.status == "ok" and f.rules:
            notes.append(
                f"Rule(s) {', '.join(f.rules)} predict a slow path for {where}, but it "
                f"measures {_ratios(f)}: the measurement wins (this build may carry a fix)."
            )
        if f.channels_last_escapes:
            notes.append(
                f"{where}: with its input in channels_last_3d the stock conv runs at "
                f"{f.probe.channels_last_ratio:.2f}x its GEMM, out of the slow path without vlfast "
                "(x = x.contiguous(memory_format=torch.channels_last_3d) before the conv)."
            )
    return notes


def _autopatch_notes(facts: Facts, patched: bool | None) -> list[str]:
    if not facts.autopatch_env or patched is not False:
        return []
    from vlfast.switches.env import env_setting

    if env_setting({"VLFAST_PATCH": facts.autopatch_env}) is None:
        return [
            f"VLFAST_PATCH={facts.autopatch_env} is not a value vlfast understands, so it patches "
            "nothing: use 1 (Conv3d) or all (every eligible conv)."
        ]
    return [
        f"VLFAST_PATCH={facts.autopatch_env} is set but the scanned model is not patched: the hook "
        "patches models built by transformers in a process where vlfast's .pth hook is active."
    ]


def probe_clock() -> float:
    """Seconds on :func:`vlfast.diagnosis.probe.clock` (a test replaces this)."""
    from vlfast.diagnosis import probe as probe_module

    return probe_module.clock()


# What each rule's slow path runs on, as torch._C._select_conv_backend names it. A rule that fires while
# ATen selects another backend for the same conv is contradicted by the evidence: shown, never hidden.
_RULE_BACKENDS: dict[str, tuple[str, ...]] = {
    "cudnn-skip-conv3d": ("Slow3d", "SlowDilated3d"),
    "cudnn-disabled": ("Slow2d", "Slow3d", "SlowDilated2d", "SlowDilated3d"),
    "mps-conv3d": ("Mps",),
    "rocm-miopen-conv3d": ("Miopen",),
    "cpu-onednn-window-conv": ("Mkldnn",),
    "cudnn-window-conv": ("Cudnn",),
    "cpu-no-onednn": ("Slow2d", "Slow3d", "SlowDilated2d", "SlowDilated3d"),
}


def disagreements(hits: list[RuleHit], backend: str | None) -> list[str]:
    """One line per fired rule whose predicted path the backend ATen selected contradicts. Pure."""
    if backend is None:
        return []
    return [
        f"disagreement: rule {h.id} predicts the {' / '.join(expected)} path, but ATen selects "
        f"{backend} for this conv (torch._C._select_conv_backend)"
        for h in hits
        if (expected := _RULE_BACKENDS.get(h.id)) and backend not in expected
    ]


def _ratios(f: Finding) -> str:
    parts = [f"{f.probe.ratio:.2f}x forward"] if f.probe.ratio is not None else []
    if f.backward_status is not None and f.probe.backward_ratio is not None:
        parts.append(f"{f.probe.backward_ratio:.2f}x backward")
    return ", ".join(parts) or "unmeasured"
