"""Environment facts the doctor reasons about, collected once and rendered later.

:class:`Facts` is plain data: versions, backend switches, the device and dtype being diagnosed. Every
field may be ``None``, meaning "could not collect": each probe in :func:`collect_facts` fails soft, so
a broken driver or a missing package never stops the diagnosis. Rules (``vlfast.diagnosis.rules``) are pure
functions of these facts, and tests build ``Facts(...)`` by hand to play any machine.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any, TypeVar

import torch

from vlfast.errors import InputRefused

__all__ = [
    "Facts",
    "check_device",
    "collect_facts",
    "cudnn_version_str",
    "default_device",
    "default_dtype",
    "dtype_name",
    "version_tuple",
]

T = TypeVar("T")

_HALF = ("bfloat16", "float16")


_DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


def dtype_name(dtype: str | torch.dtype) -> str:
    """Canonical name of a dtype given as ``torch.bfloat16``, ``"bf16"``, ``"bfloat16"``, ..."""
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    elif isinstance(dtype, str):
        name = dtype.lower().removeprefix("torch.")
    else:
        raise InputRefused(f"dtype must be a torch.dtype or a string, got {type(dtype).__name__}")
    if name not in _DTYPE_ALIASES:
        raise InputRefused(f"unsupported dtype {dtype!r}; use float32, bfloat16 or float16")
    return _DTYPE_ALIASES[name]


def version_tuple(version: str | None) -> tuple[int, ...] | None:
    """``"2.10.0+cu128"`` -> ``(2, 10, 0)``; ``None`` for anything unparsable."""
    if not version:
        return None
    m = re.match(r"(\d+(?:\.\d+)*)", str(version))
    return tuple(int(p) for p in m.group(1).split(".")) if m else None


def cudnn_version_str(v: int | None) -> str | None:
    """cuDNN >= 9 encodes versions as major*10000 + minor*100 + patch: 91002 -> "9.10.2"."""
    if v is None:
        return None
    if v >= 10000:
        return f"{v // 10000}.{v // 100 % 100}.{v % 100}"
    return f"{v // 1000}.{v // 100 % 10}.{v % 100}"  # cuDNN 8: major*1000 + minor*100 + patch


@dataclass
class Facts:
    """What the doctor knows about this machine; ``None`` means "could not collect"."""

    device: str = "cpu"  # the device being diagnosed, e.g. "cuda:0"
    dtype: str = "bfloat16"  # the dtype being diagnosed, a torch dtype name
    python: str | None = None
    platform: str | None = None
    torch_version: str | None = None
    torch_build: str | None = None  # "cuda", "rocm" or "cpu"
    torch_cuda: str | None = None  # CUDA the wheel was built against
    torch_hip: str | None = None
    cuda_available: bool | None = None
    cuda_driver: str | None = None  # CUDA version the installed driver supports, e.g. "12.8"
    nvidia_driver: str | None = None  # e.g. "570.124.06"
    cudnn_available: bool | None = None
    cudnn_compile: int | None = None  # e.g. 91002
    cudnn_runtime: int | None = None  # the library actually loaded; this one decides use_cudnn
    cudnn_enabled: bool | None = None
    cudnn_benchmark: bool | None = None
    cudnn_allow_tf32: bool | None = None
    cudnn_deterministic: bool | None = None
    gpu_name: str | None = None
    gpu_capability: tuple[int, int] | None = None
    mps_built: bool | None = None
    mps_available: bool | None = None
    onednn_available: bool | None = None
    onednn_enabled: bool | None = None
    cpu_capability: str | None = None  # ATen's CPU kernel level, e.g. "AVX512"
    num_threads: int | None = None
    transformers_version: str | None = None
    transformers_fusion: bool | None = None  # from_pretrained(..., fusion_config={"patch_embeddings": True})
    vlfast_version: str | None = None
    autopatch_env: str | None = None  # the value of VLFAST_PATCH, if set
    model_patched: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.device, str) or not self.device:
            raise InputRefused(f"Facts.device must be a device string such as 'cuda:0', got {self.device!r}")
        if self.dtype not in ("float32", "bfloat16", "float16", "float64"):
            raise InputRefused(
                f"Facts.dtype must be float32, bfloat16, float16 or float64, got {self.dtype!r}"
            )
        if self.gpu_capability is not None:
            self.gpu_capability = tuple(int(x) for x in self.gpu_capability)

    # Derived views the rules read; kept here so every rule spells them the same way.
    @property
    def device_type(self) -> str:
        return self.device.split(":", 1)[0]

    @property
    def half(self) -> bool:
        return self.dtype in _HALF

    @property
    def torch(self) -> tuple[int, ...] | None:
        return version_tuple(self.torch_version)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["gpu_capability"] = list(self.gpu_capability) if self.gpu_capability else None
        d["cudnn_compile_str"] = cudnn_version_str(self.cudnn_compile)
        d["cudnn_runtime_str"] = cudnn_version_str(self.cudnn_runtime)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Facts:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def _soft(fn: Callable[[], T]) -> T | None:
    """Run one probe; any failure means "could not collect"."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn()
    except Exception:  # noqa: BLE001 - a fact we cannot collect is None, never an error
        return None


def _nvidia_driver() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    out = subprocess.run(
        [exe, "--query-gpu=driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=5,
        check=True,
    ).stdout
    return out.strip().splitlines()[0].strip() or None


def _cuda_driver() -> str | None:
    v = int(torch._C._cuda_getDriverVersion())  # e.g. 12080
    return f"{v // 1000}.{v % 1000 // 10}" if v > 0 else None


def _cudnn_compile() -> int | None:
    v = torch._C._cudnn.getCompileVersion()  # (major, minor, patch)
    major, minor, patch = (int(x) for x in v)
    return major * 10000 + minor * 100 + patch if major >= 9 else major * 1000 + minor * 100 + patch


def _transformers_fusion() -> bool:
    import importlib

    importlib.import_module("transformers")  # not installed: could not collect
    try:
        mod = importlib.import_module("transformers.fusion_mapping")  # transformers >= 5.6
    except ModuleNotFoundError:
        return False
    return "patch_embeddings" in getattr(mod, "_FUSION_REGISTRY", {})


def _transformers_version() -> str | None:
    from importlib.metadata import version

    return version("transformers")


def default_device() -> str:
    """The best available device: CUDA (or ROCm), then MPS, then CPU."""
    if _soft(torch.cuda.is_available):
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and _soft(mps.is_available):
        return "mps"
    return "cpu"


def check_device(device: str | torch.device) -> str:
    """``device`` as a string, or ``ValueError`` saying why this machine cannot use it."""
    try:
        dev = torch.device(device)
        torch.empty(1, device=dev)
    except (RuntimeError, AssertionError, ValueError) as e:
        raise InputRefused(f"device {str(device)!r} is not usable here: {str(e).splitlines()[0]}") from None
    return str(dev)


def default_dtype(device: str) -> str:
    """bfloat16 where the device supports it (CPU always does), else float16."""
    kind = device.split(":", 1)[0]
    if kind == "cuda":
        return "bfloat16" if _soft(torch.cuda.is_bf16_supported) else "float16"
    if kind == "mps":
        ok = _soft(lambda: torch.ones(1, device="mps", dtype=torch.bfloat16).sum().item() == 1)
        return "bfloat16" if ok else "float16"
    return "bfloat16"


def collect_facts(device: str, dtype: str, *, model_patched: bool | None = None) -> Facts:
    """Everything about this machine that decides which conv kernel runs; each probe fails soft."""
    import vlfast

    dev = torch.device(device)
    on_gpu = dev.type == "cuda" and bool(_soft(torch.cuda.is_available))
    cudnn = torch.backends.cudnn
    mps = getattr(torch.backends, "mps", None)
    hip = getattr(torch.version, "hip", None)
    return Facts(
        device=str(dev),
        dtype=dtype,
        python=sys.version.split()[0],
        platform=_soft(platform.platform),
        torch_version=torch.__version__,
        torch_build="rocm" if hip else ("cuda" if torch.version.cuda else "cpu"),
        torch_cuda=torch.version.cuda,
        torch_hip=hip,
        cuda_available=_soft(torch.cuda.is_available),
        cuda_driver=_soft(_cuda_driver) if torch.version.cuda else None,
        nvidia_driver=_soft(_nvidia_driver) if torch.version.cuda else None,
        cudnn_available=_soft(cudnn.is_available),
        cudnn_compile=_soft(_cudnn_compile) if torch.version.cuda else None,
        cudnn_runtime=_soft(cudnn.version),
        cudnn_enabled=_soft(lambda: bool(cudnn.enabled)),
        cudnn_benchmark=_soft(lambda: bool(cudnn.benchmark)),
        cudnn_allow_tf32=_soft(lambda: bool(cudnn.allow_tf32)),
        cudnn_deterministic=_soft(lambda: bool(cudnn.deterministic)),
        gpu_name=_soft(lambda: torch.cuda.get_device_name(dev)) if on_gpu else None,
        gpu_capability=_soft(lambda: tuple(torch.cuda.get_device_capability(dev))) if on_gpu else None,
        mps_built=_soft(mps.is_built) if mps is not None else False,
        mps_available=_soft(mps.is_available) if mps is not None else False,
        onednn_available=_soft(torch.backends.mkldnn.is_available),
        onednn_enabled=_soft(lambda: bool(torch.backends.mkldnn.enabled)),
        cpu_capability=_soft(torch.backends.cpu.get_cpu_capability),
        num_threads=_soft(torch.get_num_threads),
        transformers_version=_soft(_transformers_version),
        transformers_fusion=_soft(_transformers_fusion),
        vlfast_version=vlfast.__version__,
        autopatch_env=os.environ.get("VLFAST_PATCH"),
        model_patched=model_patched,
    )
