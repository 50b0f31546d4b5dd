"""Environment facts the doctor reasons about: :class:`Facts` is plain data (versions, backend switches,
the device and dtype diagnosed). ``None`` means "could not collect": each probe in :func:`collect_facts`
fails soft, so a broken driver or a missing package never stops the diagnosis.
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
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, TypeVar

import torch

from vlfast.dtypes import dtype_name
from vlfast.errors import InputRefused
from vlfast.patching.precision import fp32_settings

__all__ = [
    "Facts",
    "DtypeChoice",
    "check_device",
    "choose_dtype",
    "collect_facts",
    "cpu_facts",
    "cudnn_libraries",
    "cudnn_version_str",
    "default_device",
    "default_dtype",
    "device_and_dtype",
    "dtype_name",
    "half_native",
    "version_tuple",
]

T = TypeVar("T")


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
    # Every libcudnn* this process has loaded, file name -> path (Linux): more than one origin means a
    # system cuDNN sub-library beside the wheel's (pytorch #188892).
    cudnn_libraries: dict[str, str] | None = None
    miopen_version: str | None = None  # ROCm builds: the MIOpen that loaded, e.g. "3.4.0"
    gpu_name: str | None = None
    gpu_capability: tuple[int, int] | None = None
    mps_built: bool | None = None
    mps_available: bool | None = None
    onednn_available: bool | None = None
    onednn_enabled: bool | None = None
    cpu_capability: str | None = None  # ATen's CPU kernel level, e.g. "AVX512"
    cpu_model: str | None = None  # e.g. "AMD EPYC 9B14"
    # The CPU features that decide native bf16/fp16 (avx512_bf16, amx_bf16, avx512_fp16, amx_fp16, ...):
    # from torch._C._cpu where it has them, else /proc/cpuinfo. None: could not tell.
    cpu_flags: tuple[str, ...] | None = None
    onednn_bf16: bool | None = None  # oneDNN has bf16 kernels here (respects ONEDNN_MAX_CPU_ISA)
    onednn_fp16: bool | None = None
    aten_cpu_capability_env: str | None = None  # ATEN_CPU_CAPABILITY, a limit the user set
    onednn_max_cpu_isa_env: str | None = None  # ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA), ditto
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
        if self.cpu_flags is not None:
            self.cpu_flags = tuple(str(x) for x in self.cpu_flags)

    @property
    def device_type(self) -> str:
        return self.device.split(":", 1)[0]

    @property
    def half(self) -> bool:
        return self.dtype in ("bfloat16", "float16")

    @property
    def torch(self) -> tuple[int, ...] | None:
        return version_tuple(self.torch_version)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["gpu_capability"] = list(self.gpu_capability) if self.gpu_capability else None
        d["cpu_flags"] = list(self.cpu_flags) if self.cpu_flags is not None else None
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


def cudnn_libraries() -> dict[str, str] | None:
    """The cuDNN libraries loaded in this process (file name -> path), from /proc/self/maps; the
    sub-libraries load lazily, so read this after a convolution ran."""
    libs: dict[str, str] = {}
    with open("/proc/self/maps", encoding="utf-8") as fh:
        for line in fh:
            path = line.rsplit(" ", 1)[-1].strip()
            name = os.path.basename(path)
            if name.startswith("libcudnn"):
                libs.setdefault(name, path)
    return libs


def _miopen_version() -> str | None:
    # On ROCm builds cudnn.version() is MIOpen's: major * 10000 + minor * 100 + patch
    # (aten/src/ATen/cuda/detail/CUDAHooks.cpp, versionMIOpen).
    v = int(torch.backends.cudnn.version())
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}"


def _transformers_fusion() -> bool:
    """Whether transformers offers ``fusion_config={"patch_embeddings": True}`` (>= 5.6), read from its
    ``fusion_mapping.py`` as text where the registry is a literal: importing transformers for this took
    seconds of the doctor's budget (4-5 s at load 9, where the references are read as data)."""
    import ast
    import importlib
    import importlib.util

    spec = importlib.util.find_spec("transformers")  # the package only: nothing is imported
    if spec is None:
        raise ModuleNotFoundError("transformers")  # not installed: could not collect
    folders = list(spec.submodule_search_locations or [])
    tree = None
    if folders:
        try:
            with open(os.path.join(folders[0], "fusion_mapping.py"), encoding="utf-8") as fh:
                tree = ast.parse(fh.read())
        except FileNotFoundError:
            return False  # transformers < 5.6
        except (OSError, SyntaxError, ValueError):
            pass
    for node in tree.body if tree is not None else []:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        if (
            isinstance(target, ast.Name)
            and target.id == "_FUSION_REGISTRY"
            and isinstance(node.value, ast.Dict)
        ):
            keys = [k.value for k in node.value.keys if isinstance(k, ast.Constant)]
            if len(keys) == len(node.value.keys):
                return "patch_embeddings" in keys
    importlib.import_module("transformers")  # not a literal: ask the module itself
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
    """bfloat16 where the device computes it natively, else float16 (GPU) or float32 (CPU, by
    :func:`choose_dtype`: emulated bf16 runs several times slower than fp32 there)."""
    kind = device.split(":", 1)[0]
    if kind == "cuda":
        return "bfloat16" if _soft(torch.cuda.is_bf16_supported) else "float16"
    if kind == "mps":
        ok = _soft(lambda: torch.ones(1, device="mps", dtype=torch.bfloat16).sum().item() == 1)
        return "bfloat16" if ok else "float16"
    return choose_dtype(cpu_facts(device), None).dtype


def device_and_dtype(
    device: str | torch.device | None, dtype: str | torch.dtype | None, cpu: Callable[[str], Facts]
) -> tuple[str, str, DtypeChoice | None]:
    """(device, dtype name, the CPU's dtype choice or None off CPU): bf16 on a CPU only where it computes
    it natively. ``cpu`` is :func:`cpu_facts`, passed by the caller (tests fake the CPU through it)."""
    dev = check_device(device) if device is not None else default_device()
    asked = dtype_name(dtype) if dtype is not None else None
    if torch.device(dev).type != "cpu":
        return dev, asked or default_dtype(dev), None
    choice = choose_dtype(cpu(dev), asked)
    return dev, choice.dtype, choice


# oneDNN's ISA limits in increasing order (oneDNN docs, "CPU ISA hints and dispatcher control": the
# values ONEDNN_MAX_CPU_ISA takes); bf16 dot products need AVX512_CORE_BF16, fp16 AVX512_CORE_FP16.
_ONEDNN_ISAS = (
    "SSE41",
    "AVX",
    "AVX2",
    "AVX2_VNNI",
    "AVX2_VNNI_2",
    "AVX512_CORE",
    "AVX512_CORE_VNNI",
    "AVX512_CORE_BF16",
    "AVX10_1_512",
    "AVX512_CORE_FP16",
    "AVX10_1_512_AMX",
    "AVX512_CORE_AMX",
    "AVX10_1_512_AMX_FP16",
    "AVX512_CORE_AMX_FP16",
)
_NATIVE = {
    # dtype -> (CPU flags any one of which computes it natively, the lowest oneDNN ISA that uses them)
    "bfloat16": (("avx512_bf16", "amx_bf16"), "AVX512_CORE_BF16"),
    "float16": (("avx512_fp16", "amx_fp16"), "AVX512_CORE_FP16"),
}


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype to probe and why: ``native`` is False when it is emulated here, None if unknown."""

    dtype: str
    native: bool | None
    reason: str
    warning: str | None = None  # for the user: the dtype they asked for is emulated here


def half_native(f: Facts, dtype: str) -> tuple[bool | None, str]:
    """Whether the CPU described by ``f`` computes ``dtype`` natively, and the fact that decides it (pure).

    Without AVX512-BF16 or AMX, oneDNN and ATen convert bf16 to fp32 around every op: the issue-20 machine
    (AVX2) ran a 3,072 x 1,536 x 1,024 GEMM 8.6x slower in bf16 than in fp32.
    """
    if dtype in ("float32", "float64") or f.device_type != "cpu":
        return True, f"{dtype} is native"
    flags, isa = _NATIVE[dtype]
    limit = (f.onednn_max_cpu_isa_env or "").strip().upper()
    if limit in _ONEDNN_ISAS and _ONEDNN_ISAS.index(limit) < _ONEDNN_ISAS.index(isa):
        return False, f"ONEDNN_MAX_CPU_ISA={limit} keeps oneDNN below {isa}, so {dtype} is emulated"
    onednn = f.onednn_bf16 if dtype == "bfloat16" else f.onednn_fp16
    if f.cpu_flags is not None:
        have = [x for x in flags if x in f.cpu_flags]
        if not have:
            return False, (
                f"the CPU ({f.cpu_capability or 'unknown'} capability) has no {' / '.join(flags)}, so "
                f"{dtype} is emulated"
            )
        if onednn is False:
            return False, f"oneDNN has no {dtype} kernels here (a build or ISA limit), so {dtype} is emulated"
        aten = (f.aten_cpu_capability_env or "").strip().lower()
        note = (
            f" (ATEN_CPU_CAPABILITY={aten} limits ATen's own kernels; oneDNN's GEMM and conv stay native)"
            if aten in ("default", "avx2")
            else ""
        )
        return True, f"the CPU has {' and '.join(have)}{note}"
    if onednn is False:
        return False, f"oneDNN has no {dtype} kernels here, so {dtype} is emulated"
    cap = (f.cpu_capability or "").upper()
    if cap in ("DEFAULT", "AVX", "AVX2"):  # x86 without AVX-512: no native bf16 or fp16 instructions
        return False, f"the CPU capability is {cap}, so {dtype} is emulated"
    return None, "could not read the CPU's features"


def choose_dtype(f: Facts, requested: str | None) -> DtypeChoice:
    """The dtype to diagnose on ``f``'s device: the one asked for (with a warning when the CPU emulates
    it), else bf16 where native, else float32 with the reason. GPUs are left to :func:`default_dtype`."""
    if requested is not None:
        native, why = half_native(f, requested)
        warn = None
        if native is False:
            warn = f"{why}: expect {requested} to run several times slower than float32 here"
        return DtypeChoice(requested, native, f"asked for; {why}", warn)
    if f.device_type != "cpu":
        return DtypeChoice(f.dtype, True, "the device's default")
    native, why = half_native(f, "bfloat16")
    if native:
        return DtypeChoice("bfloat16", True, why)
    return DtypeChoice("float32", True, f"float32, not bfloat16: {why}")


_FLAG_NAMES = (
    "avx2",
    "avx512f",
    "avx512bw",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_fp16",
)


def _cpu_flags() -> tuple[str, ...] | None:
    """The CPU features :data:`_NATIVE` reads: torch's own checks where this torch has them (they see
    through virtualisation the way ATen does), else the kernel's /proc/cpuinfo."""
    cpu = getattr(torch._C, "_cpu", None)
    checks = {
        "avx512_bf16": "_is_avx512_bf16_supported",
        "amx_tile": "_is_amx_tile_supported",
        "amx_fp16": "_is_amx_fp16_supported",
    }
    if cpu is not None and all(hasattr(cpu, fn) for fn in checks.values()):
        have = [flag for flag, fn in checks.items() if getattr(cpu, fn)()]
        if "amx_tile" in have:  # torch checks the tile unit; AMX on x86 always carries bf16
            have.append("amx_bf16")
        return tuple(sorted(have))
    with open("/proc/cpuinfo", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("flags"):
                words = set(line.split(":", 1)[1].split())
                return tuple(x for x in _FLAG_NAMES if x in words)
    return None


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def cpu_facts(device: str, dtype: str = "float32") -> Facts:
    """Only the CPU facts :func:`choose_dtype` reads, for choosing a dtype before collecting the rest."""
    return Facts(
        device=device,
        dtype=dtype,
        cpu_capability=_soft(torch.backends.cpu.get_cpu_capability),
        cpu_flags=_soft(_cpu_flags),
        onednn_bf16=_soft(lambda: bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())),
        onednn_fp16=_soft(lambda: bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())),
        aten_cpu_capability_env=os.environ.get("ATEN_CPU_CAPABILITY"),
        onednn_max_cpu_isa_env=os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA"),
    )


def collect_facts(device: str, dtype: str, *, model_patched: bool | None = None) -> Facts:
    """Everything about this machine that decides which conv kernel runs; each probe fails soft."""
    import vlfast

    dev = torch.device(device)
    cpu = cpu_facts(str(dev), dtype)
    on_gpu = dev.type == "cuda" and bool(_soft(torch.cuda.is_available))
    cudnn = torch.backends.cudnn
    mps = getattr(torch.backends, "mps", None)
    hip = getattr(torch.version, "hip", None)
    return replace(
        cpu,
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
        cudnn_runtime=_soft(cudnn.version) if not hip else None,
        cudnn_enabled=_soft(lambda: bool(cudnn.enabled)),
        cudnn_benchmark=_soft(lambda: bool(cudnn.benchmark)),
        # through the per-op setting where torch has one: the legacy flag raises once the two are mixed
        cudnn_allow_tf32=_soft(lambda: fp32_settings("cuda")["conv"][0] == "tf32"),
        cudnn_deterministic=_soft(lambda: bool(cudnn.deterministic)),
        cudnn_libraries=_soft(cudnn_libraries) if torch.version.cuda else None,
        miopen_version=_soft(_miopen_version) if hip else None,
        gpu_name=_soft(lambda: torch.cuda.get_device_name(dev)) if on_gpu else None,
        gpu_capability=_soft(lambda: tuple(torch.cuda.get_device_capability(dev))) if on_gpu else None,
        mps_built=_soft(mps.is_built) if mps is not None else False,
        mps_available=_soft(mps.is_available) if mps is not None else False,
        onednn_available=_soft(torch.backends.mkldnn.is_available),
        onednn_enabled=_soft(lambda: bool(torch.backends.mkldnn.enabled)),
        cpu_model=_soft(_cpu_model),
        num_threads=_soft(torch.get_num_threads),
        transformers_version=_soft(_transformers_version),
        transformers_fusion=_soft(_transformers_fusion),
        vlfast_version=vlfast.__version__,
        autopatch_env=os.environ.get("VLFAST_PATCH"),
        model_patched=model_patched,
    )
