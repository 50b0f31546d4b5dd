"""Known slow paths for stride == kernel convolutions: *why* a conv may run slowly here, with a public
source and the environment-side fix. Rules explain the verdict, never decide it (the doctor's measurement
does). Each predicate is a pure function of :class:`~vlfast.diagnosis.facts.Facts` and a
:class:`ConvGeometry`, so tests play any machine by building ``Facts`` by hand.
"""

from __future__ import annotations

import os.path
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from vlfast.diagnosis.facts import Facts, version_tuple
from vlfast.errors import InputRefused

__all__ = ["RULES", "ConvGeometry", "Rule", "RuleHit", "evaluate", "rule_fires"]


@dataclass(frozen=True)
class ConvGeometry:
    """What a rule needs to know about a convolution."""

    kernel_size: tuple[int, ...]
    name: str = ""
    channels_last: bool = False  # the input arrives channels_last(_3d): torch's cuDNN guard skips it

    def __post_init__(self) -> None:
        if not self.kernel_size or any(int(k) < 1 for k in self.kernel_size):
            raise InputRefused(f"kernel_size must be positive ints, got {self.kernel_size!r}")

    @property
    def ndim(self) -> int:  # spatial dims: 3 for Conv3d, whose weight is 5-D
        return len(self.kernel_size)


Phase = Literal["forward", "backward"]


@dataclass(frozen=True)
class Rule:
    id: str
    title: str
    source: str  # public issue or code that establishes it
    applies: Callable[[Facts, ConvGeometry], bool]
    explanation: str
    env_fix: str | Callable[[Facts], str]  # what to change in the environment instead of patching
    # A fallback kernel (orders of magnitude, not a few x): a slow conv it explains is a slow path even
    # under PATHOLOGICAL_RATIO.
    pathological: bool = True
    phases: tuple[Phase, ...] = ("forward", "backward")  # the passes it slows

    def fix_for(self, facts: Facts) -> str:
        return self.env_fix(facts) if callable(self.env_fix) else self.env_fix


@dataclass
class RuleHit:
    """A rule that fires on this machine, with the convolutions it concerns."""

    id: str
    title: str
    source: str
    explanation: str
    env_fix: str
    convs: list[str] = field(default_factory=list)
    pathological: bool = True
    phases: tuple[str, ...] = ("forward", "backward")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "phases": list(self.phases)}


def _cuda(f: Facts) -> bool:  # NVIDIA CUDA, not ROCm (which also reports device type "cuda")
    return f.device_type == "cuda" and f.torch_build == "cuda"


def _cudnn_in(f: Facts, lo: int, hi: int) -> bool:
    return f.cudnn_runtime is not None and lo <= f.cudnn_runtime < hi


def _torch_290(f: Facts) -> bool:
    return f.torch is not None and f.torch[:3] in ((2, 9), (2, 9, 0))


def _guard_cudnn(f: Facts) -> int | None:
    """The cuDNN torch's skip guard reads: compile-time on 2.9.0, runtime from 2.9.1 (pytorch PR #167111)."""
    if _torch_290(f) and f.cudnn_compile is not None:
        return f.cudnn_compile
    return f.cudnn_runtime


def _cudnn_skipped(f: Facts, c: ConvGeometry) -> bool:
    # aten/src/ATen/native/Convolution.cpp, use_cudnn (torch >= 2.9): cuDNN in [9.8, 9.15), contiguous
    # suggested memory format, bf16/fp16, weight.dim() == 5 and some kernel dim != 1 -> cuDNN is not used.
    guard = _guard_cudnn(f)
    return (
        _cuda(f)
        and f.cudnn_enabled is not False
        and f.torch is not None
        and f.torch[:2] >= (2, 9)
        and guard is not None
        and 90800 <= guard < 91500
        and f.half
        and c.ndim == 3
        and not c.channels_last
        and any(k != 1 for k in c.kernel_size)
    )


def _cudnn_920_bf16_backward(f: Facts, c: ConvGeometry) -> bool:
    return (
        _cuda(f)
        and f.cudnn_enabled is not False
        and _cudnn_in(f, 92000, 92100)
        and f.dtype == "bfloat16"
        and c.ndim == 3
    )


def _upgrade_cudnn(f: Facts) -> str:
    """How to get a runtime cuDNN >= 9.15 here (the wheel's bundled cuDNN is what loads; on torch 2.9.0
    the guard reads the compile-time cuDNN, so only another torch helps)."""
    if _torch_290(f) and _cuda(f):
        return (
            "upgrade torch to >= 2.9.1 (pip install -U 'torch>=2.9.1'): torch 2.9.0 decides the cuDNN skip "
            "from the cuDNN it was compiled with, so upgrading the cuDNN package cannot help on 2.9.0 "
            "(pytorch PR #167111); then make the loaded cuDNN >= 9.15 as below if it is not. "
            + _upgrade_runtime(f)
        )
    return _upgrade_runtime(f)


def _upgrade_runtime(f: Facts) -> str:
    if (f.platform or "").lower().startswith("windows"):
        return (
            "install a torch wheel that bundles cuDNN >= 9.15 (torch >= 2.11 for CUDA 13, e.g. "
            "pip install -U torch --index-url https://download.pytorch.org/whl/cu130): on Windows torch "
            "loads the cuDNN in torch\\lib by full path, so upgrading the nvidia-cudnn package does not help"
        )
    return (
        "make the loaded cuDNN >= 9.15: pip install -U 'nvidia-cudnn-cu12>=9.15' (CUDA 12 wheels) or a "
        "torch >= 2.11 CUDA 13 wheel (it pins cuDNN >= 9.19; the cu126 wheels of torch 2.9-2.14 still "
        "ship 9.10.2, and pytorch RFC #190385 proposes dropping cu126 in 2.15). Check with: "
        "python -c 'import torch; print(torch.backends.cudnn.version())'"
    )


def _blackwell_cudnn910(f: Facts, c: ConvGeometry) -> bool:
    return (
        _cuda(f)
        and f.gpu_capability is not None
        and f.gpu_capability[0] >= 10
        and _cudnn_in(f, 91000, 91100)
        and f.dtype == "bfloat16"
        and c.ndim == 3
    )


def _cudnn_disabled(f: Facts, c: ConvGeometry) -> bool:
    return _cuda(f) and f.cudnn_enabled is False


def _mps_conv3d(f: Facts, c: ConvGeometry) -> bool:
    return f.device_type == "mps" and c.ndim == 3


# ROCm 10.1 / MIOpen 3.6.1 run a stride == kernel convolution as one GEMM (ROCm/rocm-libraries PR #10912).
ROCM_FIXED = (10, 1)
MIOPEN_FIXED = (3, 6, 1)


def _rocm_miopen(f: Facts, c: ConvGeometry) -> bool:
    if not (f.device_type == "cuda" and f.torch_build == "rocm" and c.ndim == 3):
        return False
    miopen = version_tuple(f.miopen_version)
    if miopen is not None:
        return miopen < MIOPEN_FIXED
    rocm = version_tuple(f.torch_hip)
    return rocm is None or rocm[:2] < ROCM_FIXED  # unknown: most ROCm in use is older, so it applies


def _cudnn_mixed(f: Facts, c: ConvGeometry) -> bool:
    # The loaded libcudnn* libraries come from more than one place or version: the cuDNN 9.20 CUDA 13
    # wheels can load a system cuDNN sub-library beside their own (pytorch #188892).
    libs = f.cudnn_libraries or {}
    return _cuda(f) and len({_lib_origin(path) for path in libs.values()}) > 1


def _lib_origin(path: str) -> str:
    """The directory of a loaded library and the version in its file name, if any ("...so.9.20.0")."""
    m = re.search(r"\.so\.(\d+(?:\.\d+)+)$", path)
    return os.path.dirname(path) + (f" {m.group(1)}" if m else "")


def _cpu_no_onednn(f: Facts, c: ConvGeometry) -> bool:
    # Without oneDNN (mkldnn) a reduced-precision CPU conv goes to ATen's slow_conv3d / thnn_conv2d.
    return f.device_type == "cpu" and f.half and (f.onednn_available is False or f.onednn_enabled is False)


def _cpu_conv3d_backward(f: Facts, c: ConvGeometry) -> bool:
    # The gradients of a kernel-sized Conv3d on CPU (oneDNN or not) take a reference-like path.
    return f.device_type == "cpu" and c.ndim == 3


def _cpu_onednn_window(f: Facts, c: ConvGeometry) -> bool:
    # oneDNN's direct convolution on kernel-sized inputs (one output pixel per sample) does not reach
    # GEMM speed; it is the default CPU path for every dtype.
    return f.device_type == "cpu" and f.onednn_available is not False and f.onednn_enabled is not False


def _cudnn_window(f: Facts, c: ConvGeometry) -> bool:
    # cuDNN in use (not skipped, not disabled): its heuristics pick a general implicit-GEMM kernel for a
    # kernel-sized conv (implicit_convolveNd_sgemm for the 3-channel Conv3d on an H200), a few x its GEMM.
    return (
        _cuda(f)
        and f.cudnn_enabled is not False
        and f.cudnn_runtime is not None
        and any(k != 1 for k in c.kernel_size)  # a 1x1 conv is a GEMM to cuDNN too
        and not _cudnn_skipped(f, c)
    )


RULES: tuple[Rule, ...] = (
    Rule(
        "cudnn-skip-conv3d",
        "torch >= 2.9 skips cuDNN for bf16/fp16 Conv3d with cuDNN 9.8-9.14",
        "pytorch/pytorch#163539, PR #163581, regression #166122; aten/src/ATen/native/Convolution.cpp use_cudnn",
        _cudnn_skipped,
        "Because cuDNN 9.10 returned wrong bf16 results, torch >= 2.9 does not use cuDNN for 5-D bf16/fp16 "
        "convolutions with a non-1 kernel and a contiguous input while the loaded (runtime) cuDNN is in "
        "[9.8, 9.15); they fall back to vol2col / slow_conv3d. What counts is the cuDNN that loads, not "
        "torch's version: the torch 2.9-2.10 cu128 wheels and the cu126 wheels through 2.14 ship cuDNN "
        "9.10.2. A channels_last_3d input escapes the guard (the narrowing PR #166480 was closed "
        "unmerged, so this is the rule as shipped).",
        _upgrade_cudnn,
    ),
    Rule(
        "cudnn-920-bf16-backward",
        "cuDNN 9.20 has no bf16 engine for the Qwen3-VL patch-embedding Conv3d backward",
        "NVIDIA-TAO/tao-core PR #29 (Qwen3-VL patch embedding backward on cuDNN 9.20, replaced by linear ops)",
        _cudnn_920_bf16_backward,
        "With cuDNN 9.20 the bf16 backward of the patch-embedding Conv3d finds no engine: training fails "
        "or falls back to a slow path, while the forward is fine. A version check cannot cover every such "
        "engine gap, which is why the doctor also times the backward.",
        _upgrade_cudnn,
        phases=("backward",),
    ),
    Rule(
        "blackwell-cudnn910-bf16",
        "Blackwell GPU + cuDNN 9.10 + bf16 Conv3d",
        "huggingface/transformers#45750",
        _blackwell_cudnn910,
        "On Blackwell (sm_100/sm_120) with cuDNN 9.10 the bf16 patch-embedding Conv3d of one 8-frame clip "
        "took 16 s per call against 0.3 ms for the equivalent Linear.",
        _upgrade_cudnn,
    ),
    Rule(
        "cudnn-disabled",
        "torch.backends.cudnn.enabled is False",
        "torch.backends.cudnn documentation; aten/src/ATen/native/Convolution.cpp use_cudnn",
        _cudnn_disabled,
        "With cuDNN disabled every CUDA convolution runs ATen's native fallback (im2col / vol2col + GEMM).",
        "remove `torch.backends.cudnn.enabled = False` from the code or its launcher",
    ),
    Rule(
        "mps-conv3d",
        "Conv3d on Apple MPS",
        "pytorch/pytorch#192213 (conv3d at ~7% of conv2d throughput), #182823",
        _mps_conv3d,
        "MPS dispatches Conv3d through a path that reaches about 7% of the throughput of Conv2d or matmul "
        "on the same machine.",
        "none known in torch; the GEMM patch is the fix",
    ),
    Rule(
        "rocm-miopen-conv3d",
        "Conv3d on ROCm / MIOpen below ROCm 10.1 / MIOpen 3.6.1",
        "pytorch/pytorch#146998; fixed by ROCm/rocm-libraries PR #10912 (ROCm 10.1, MIOpen 3.6.1)",
        _rocm_miopen,
        "MIOpen before 3.6.1 picks slow Conv3d kernels (or fails) for many shapes, including patch "
        "embeddings; from ROCm 10.1 / MIOpen 3.6.1 it runs a stride == kernel convolution as one GEMM.",
        "upgrade to ROCm >= 10.1 (MIOpen >= 3.6.1), or patch",
    ),
    Rule(
        "cudnn-mixed-libraries",
        "the loaded cuDNN libraries disagree (a system cuDNN sub-library beside the wheel's)",
        "pytorch/pytorch#188892 (cuDNN 9.20 CUDA 13 wheels loading a mismatched system sub-library)",
        _cudnn_mixed,
        "The cuDNN sub-libraries this process loaded come from different directories or versions: a "
        "system cuDNN found on the library path was loaded beside the one torch's wheel ships, and a "
        "mismatched pair can lose engines or fail. The loaded libraries are listed in the facts.",
        "load one cuDNN: remove the system cuDNN directory from LD_LIBRARY_PATH (or uninstall it) so the "
        "wheel's nvidia-cudnn libraries load, then check the facts' cuDNN libraries agree",
    ),
    Rule(
        "cpu-onednn-window-conv",
        "CPU convolution over kernel-sized windows (oneDNN default path)",
        "vlfast benchmarks/patch_embed.py: 2.7-4.1x on a 2-core AMD EPYC (AVX-512), torch 2.13, 3->1024 "
        "k=2x16x16; in bf16 on a 2-core Intel Xeon with AMX, 54-122x (patch_embed.py) and 24-41x (doctor)",
        _cpu_onednn_window,
        "On CPU, oneDNN runs a patch-embedding conv as a direct convolution with one output pixel per "
        "sample, which stays several times slower than the same product as one GEMM (tens of times in "
        "bf16 on an Intel Xeon with AMX, measured).",
        "none in the environment; the GEMM patch is the fix",
        pathological=False,
        phases=("forward",),
    ),
    Rule(
        "cudnn-window-conv",
        "GPU convolution over kernel-sized windows (cuDNN's default path)",
        "vlfast benchmarks/gpu.sh on an NVIDIA H200, torch 2.11.0+cu130, cuDNN 9.19.0, bf16: Conv3d "
        "2.9-3.5x forward and 3.0-4.9x backward, Conv2d k=2x2 2.6x / 1.9x (benchmarks/gpu-runs/2026-11-27-h200)",
        _cudnn_window,
        "With cuDNN in use, a patch-embedding conv (3 input channels, one output pixel per window) runs a "
        "general implicit-GEMM kernel (implicit_convolveNd_sgemm for the Conv3d on an H200) that stays a "
        "few times slower than the same product as one GEMM, forward and backward. Not a fallback: "
        "milliseconds, not seconds.",
        "none in the environment; the GEMM patch is the fix",
        pathological=False,
    ),
    Rule(
        "cpu-conv3d-backward",
        "CPU Conv3d backward over kernel-sized windows",
        "vlfast doctor's backward probe, 3->1024 k=2x16x16 x 3,072 windows: 20-31x the GEMM's backward in "
        "bf16 on a 2-core AMD EPYC (Zen 4, AVX-512 + AVX512-BF16), torch 2.13.0; 35x (bf16) and 11x (fp32) "
        "on the earlier 2-core AMD EPYC, torch 2.14.1",
        _cpu_conv3d_backward,
        "On CPU the input and weight gradients of a patch-embedding Conv3d cost tens of times the "
        "forward, where the GEMM's backward costs about as much as its forward: CPU training loses most "
        "of its patch-embedding time here.",
        "none in the environment; the GEMM patch is the fix",
        phases=("backward",),
    ),
    Rule(
        "cpu-no-onednn",
        "bf16/fp16 CPU convolution without oneDNN",
        "aten/src/ATen/native/Convolution.cpp use_mkldnn; measured 56x the GEMM (bf16, one 3,072-patch "
        "clip) on a 2-core AMD EPYC (Zen 4, AVX-512 + AVX512-BF16), 35-109x on the earlier 2-core AMD EPYC",
        _cpu_no_onednn,
        "Without oneDNN (mkldnn unavailable in this build, or torch.backends.mkldnn.enabled = False) a "
        "reduced-precision CPU convolution runs ATen's slow_conv3d / thnn_conv2d reference kernels.",
        "set torch.backends.mkldnn.enabled = True (or use a torch build with oneDNN)",
    ),
)


def rule_fires(rule_id: str, facts: Facts, conv: ConvGeometry) -> bool:
    """Whether the rule named ``rule_id`` fires for ``conv`` on the machine described by ``facts``."""
    for rule in RULES:
        if rule.id == rule_id:
            return bool(rule.applies(facts, conv))
    raise InputRefused(f"unknown rule {rule_id!r}; known: {', '.join(r.id for r in RULES)}")


def evaluate(facts: Facts, convs: Sequence[ConvGeometry]) -> list[RuleHit]:
    """Every rule that fires for at least one of ``convs``, in the order of :data:`RULES`."""
    hits: list[RuleHit] = []
    for r in RULES:
        if names := [c.name for c in convs if r.applies(facts, c)]:
            fix = r.fix_for(facts)
            hits.append(RuleHit(r.id, r.title, r.source, r.explanation, fix, names, r.pathological, r.phases))
    return hits
