"""What ``extract`` is asked to do (:class:`ExtractConfig`, checked once, when it is built) and what a run
did (:class:`ExtractSummary`); the device and dtype policy of extraction.

A wrong value is refused here (exit 2, naming the flag), before anything is read or written. Whether this
machine can run the model on the device is the engine's question (:func:`device_problem`).

The device and dtypes are resolved as names without torch (``device_name``, ``dtype_name``,
``store_dtype_name``), so that a finished OUT is answered without importing it (about 2 s of a 2-core CPU);
``torch_device``, ``torch_dtype`` and ``stored_as`` give the torch objects.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlfast.errors import InputRefused
from vlfast.extraction.model.batching import TokenBudget
from vlfast.extraction.model.spec import FeatureSpec
from vlfast.extraction.store.format import (
    STORE_DTYPES,  # what the store writes (numpy reads all but bfloat16)
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "STORE_DTYPES",
    "ExtractConfig",
    "ExtractSummary",
    "default_batch_tokens",
    "default_device",
    "default_num_workers",
    "device_name",
    "device_problem",
    "resolve_device",
    "resolve_dtype",
    "resolve_store_dtype",
]


@dataclass(frozen=True)
class ExtractConfig:
    """Every option of ``extract`` but its inputs, OUT and engine, checked in ``__post_init__``.

    The fields are the keyword arguments of :func:`vlfast.extraction.extract` (same names, same defaults,
    documented there); the values the run uses (``spec``, ``device_name``, ``workers``, ``budget``...) are
    resolved from them.
    """

    # What is computed: configuration (run.json; a resume with other values is refused).
    model: str
    features: str | Sequence[str] = ("vision", "vision_mean")
    layers: Sequence[int] = (-1,)
    pools: Sequence[str] = ("last",)
    prompt: str | None = None
    instruction: str | None = None
    dim: int | None = None
    dtype: str | torch.dtype | None = None
    store_dtype: str | torch.dtype | None = None
    patch_convs: bool = True
    # How media becomes patches: configuration too (the processor's numbers in run.json).
    fps: float | None = None
    num_frames: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    video_max_pixels: int | None = None
    # Images turned upright by their EXIF tag. None: as OUT was made; for a new OUT, yes (not for the embedding
    # recipe, as its reference, qwen-vl-utils).
    exif_orientation: bool | None = None
    # Whose pixels images get: transformers' "torchvision" image processor (vlfast does its operations) or
    # its "pil" one (which runs). None: as OUT was made; for a new OUT, torchvision.
    image_backend: str | None = None
    # How it runs: may change on resume.
    device: str | torch.device | None = None
    max_batch_tokens: int | None = None
    max_batch_samples: int = 64
    num_workers: int | None = None
    decode_timeout: float | None = 120.0
    rank: int | None = None
    world_size: int | None = None
    progress: bool = False
    # OUT: where and how it is written, what is redone.
    overwrite: bool = False
    shard_max_bytes: int = 256 << 20
    shard_max_samples: int = 1024
    commit_every: float | None = 60.0
    resume_check: str = "full"
    storage_options: dict[str, Any] | None = None
    retry_errors: str | Sequence[str] | None = None
    max_errors: int | None = None

    # Resolved from the fields above: names, made without torch where they can be (see the module's docstring).
    spec: FeatureSpec = field(init=False, repr=False, compare=False)
    device_name: str = field(init=False, repr=False, compare=False)  # as torch names it: "cpu", "cuda:1"
    dtype_name: str = field(init=False, repr=False, compare=False)  # the compute dtype: "float32"
    store_dtype_name: str | None = field(init=False, repr=False, compare=False)  # None: as computed
    workers: int = field(init=False, repr=False, compare=False)
    budget: TokenBudget = field(init=False, repr=False, compare=False)
    retry: frozenset[str] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        from vlfast.extraction.store.format import parse_retry

        resolved = dict(model=str(self.model), spec=_feature_spec(self))
        _check_numbers(self)
        resolved["device_name"] = dev = device_name(self.device)
        resolved["dtype_name"] = _dtype_name(self.dtype, dev)
        resolved["store_dtype_name"] = _store_dtype_name(self.store_dtype)
        resolved["workers"] = default_num_workers(dev) if self.num_workers is None else int(self.num_workers)
        tokens = self.max_batch_tokens
        resolved["budget"] = TokenBudget(
            max_tokens=int(default_batch_tokens(dev) if tokens is None else tokens),
            max_samples=int(self.max_batch_samples),
        )
        resolved["retry"] = parse_retry(self.retry_errors)
        for name, value in resolved.items():
            object.__setattr__(self, name, value)

    def writing(self, **overrides: Any) -> dict[str, Any]:
        """:class:`~vlfast.extraction.store.writer.FeatureStore`'s keywords for how this run writes OUT, for
        every engine. ``overrides``: what an engine's other stores do otherwise (a Ray model actor's)."""
        return {
            "shard_max_bytes": self.shard_max_bytes,
            "shard_max_samples": self.shard_max_samples,
            "commit_every": self.commit_every,
            "overwrite": self.overwrite,
            "resume_check": self.resume_check,
            "retry_errors": self.retry,  # parsed: an actor's store would otherwise refuse a retried id as done
            **overrides,
        }

    @property
    def device_type(self) -> str:
        """``torch_device.type``, without torch: "cpu", "cuda", "mps"."""
        return _device_type(self.device_name)

    @property
    def torch_device(self) -> torch.device:
        import torch

        return torch.device(self.device_name)

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype, self.device_name)

    @property
    def stored_as(self) -> torch.dtype | None:
        """The dtype floating features are stored in, or None: as computed."""
        return resolve_store_dtype(self.store_dtype)


def _feature_spec(config: ExtractConfig) -> FeatureSpec:
    features = config.features
    names = tuple(features.split(",")) if isinstance(features, str) else tuple(features)
    layers = tuple(int(x) for x in config.layers)
    pools = tuple(config.pools)
    stripped = {n.strip() for n in names}
    if "llm" not in stripped and (layers != (-1,) or pools != ("last",)):
        # Both select LLM hidden states; without llm features they would be ignored without a word.
        flag = "--layers (layers)" if layers != (-1,) else "--pool (pools)"
        raise InputRefused(
            f"{flag} selects LLM hidden states: add llm to --features (e.g. --features vision,llm)"
        )
    embedding = "embedding" in stripped
    if not embedding and config.instruction is not None:
        raise InputRefused(
            "--instruction (instruction) is for --features embedding; add embedding to --features"
        )
    if "llm" not in stripped and config.prompt is not None:
        raise InputRefused(
            "--prompt (prompt) is for --features llm"
            + ("; an embedding's text comes from the manifest's 'text' column" if embedding else "")
        )
    given = {"prompt": config.prompt, "instruction": config.instruction}
    from vlfast.extraction.decode.prompts import placeholder_problem

    for name, text in given.items():
        problem = placeholder_problem(name, text)
        if problem:  # every row would fail alike: refused before anything is read
            raise InputRefused(f"--{name} ({name}): {problem}")
    return FeatureSpec(
        names=names,
        layers=layers,
        pools=pools,
        dim=config.dim,
        **{k: v for k, v in given.items() if v is not None},
    )


# The numeric fields, each checked under its flag (the field's name in dashes, but for the renamed ones):
# vlfast.limits says what each takes (NaN, infinities, a zero batch and budgets no image can reach are
# refused there, for the CLI and the library alike).
_NUMBERS = (  # noqa: SIM905
    "fps num_frames min_pixels max_pixels video_max_pixels max_batch_tokens num_workers decode_timeout "
    "commit_every max_errors rank world_size"
).split()
_RENAMED_FLAGS = {"max_batch_tokens": "--batch-tokens", "num_workers": "--workers"}


def _check_numbers(config: ExtractConfig) -> None:
    from vlfast.extraction.store.format import RESUME_CHECKS
    from vlfast.limits import check

    for keyword in _NUMBERS:
        if getattr(config, keyword) is not None:
            flag = _RENAMED_FLAGS.get(keyword) or "--" + keyword.replace("_", "-")
            check(flag, getattr(config, keyword), keyword)
    if not (_positive_int(config.shard_max_bytes) and _positive_int(config.shard_max_samples)):
        raise InputRefused(
            "shard_max_bytes and shard_max_samples must be >= 1, got "
            f"{config.shard_max_bytes!r} and {config.shard_max_samples!r}"
        )
    for name in ("commit_every", "decode_timeout"):  # None: by size only, and no limit
        value = getattr(config, name)
        if value is not None and not value > 0:
            raise InputRefused(f"{name} must be a positive number of seconds or None, got {value!r}")
    if config.resume_check not in RESUME_CHECKS:
        raise InputRefused(
            f"--resume-check (resume_check) must be one of {', '.join(RESUME_CHECKS)}, got {config.resume_check!r}"
        )
    if config.exif_orientation not in (None, True, False):
        raise InputRefused(f"exif_orientation must be True, False or None, got {config.exif_orientation!r}")
    if config.image_backend not in (None, "torchvision", "pil"):
        raise InputRefused(
            f"--image-backend (image_backend) must be torchvision or pil, got {config.image_backend!r}"
        )
    rank, world = config.rank, config.world_size
    if rank is not None and world is not None and not (isinstance(rank, int) and 0 <= rank < world):
        raise InputRefused(f"--rank must be in 0..{world - 1} and --world-size >= 1, got {rank} of {world}")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _device_type(device: Any) -> str:
    """A device's type ("cuda" of "cuda:1" or of ``torch.device("cuda", 1)``), without torch."""
    return str(device).split(":", 1)[0]


def default_num_workers(device: torch.device | str = "cpu") -> int:
    """Decode/preprocess worker processes: one per core on CPU (they only use it while there is work to
    do), all cores but one with an accelerator (the main process feeds it). At most 8; 0 on one core."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cores <= 1:
        return 0
    return min(8, cores if _device_type(device) == "cpu" else cores - 1)


def default_batch_tokens(device: torch.device | str = "cpu") -> int:
    """Patches per forward: 32,768 on CUDA, where larger GEMMs fill the GPU; 4,096 elsewhere, where a
    1,200-patch image already fills the cores and bigger batches only hold more activations."""
    return 32_768 if _device_type(device) == "cuda" else 4_096


def default_device() -> torch.device:
    """This rank's GPU (``LOCAL_RANK``, wrapping around the GPUs there are), else the CPU."""
    import torch

    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device asked for (refused, naming --device, unless torch can parse it), else the default."""
    if device is None:
        return default_device()
    import torch

    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InputRefused(
            f"--device {device!r} is not a device: use cpu, cuda, cuda:N or mps ({str(e).splitlines()[0]})"
        ) from None


# The device types torch names (c10's DeviceType names): "cuda", "cuda:1" of these is named as written.
_DEVICE_TYPES = frozenset(
    "cpu cuda mkldnn opengl opencl ideep hip ve fpga maia xla lazy vulkan mps meta hpu mtia xpu ipu".split()  # noqa: SIM905
)
_DEVICE = re.compile(r"[a-z]+(?::(?:0|[1-9][0-9]*))?")


def device_name(device: str | torch.device | None) -> str:
    """:func:`resolve_device`'s device as torch names it (``str(torch.device)``), asking torch only for a
    name it alone can parse, or for the default unless torch is not imported yet and cannot see a GPU (built
    for neither CUDA nor ROCm, or :func:`no_gpu_here`): then "cpu"."""
    if device is None:
        if "torch" not in sys.modules and (torch_gpu_build() is False or no_gpu_here()):
            return "cpu"
    elif (name := named_device(device)) is not None:
        return name
    return str(resolve_device(device))


def named_device(device: Any) -> str | None:
    """``device`` as torch names it, told without torch, where its type is one torch names as written
    ("cuda:1"); refused (naming --device) where torch would not parse it ("cuda:01"). None for anything
    else, which only torch can judge (a type a plug-in registers, a torch.device)."""
    if not isinstance(device, str) or _device_type(device) not in _DEVICE_TYPES:
        return None
    if not _DEVICE.fullmatch(device):
        raise InputRefused(f"--device {device!r} is not a device: use cpu, cuda, cuda:N or mps")
    return device


# What a GPU torch could use leaves on Linux: the NVIDIA driver's folder (where libcuda has not created
# /dev/nvidia* yet) and device nodes (mounted in a container too), AMD's ROCm node, WSL's GPU.
_GPU_TRACES = ("proc/driver/nvidia", "dev/nvidiactl", "dev/nvidia0", "dev/kfd", "dev/dxg")


def no_gpu_here(root: Path = Path("/"), environ: Mapping[str, str] | None = None) -> bool:
    """True where no GPU can be visible to this process, told without torch (a CUDA build took 6.7-8.4 s
    to import on a 2-core CPU, ``git show 925c8ac:docs/benchmarks.md``): ``CUDA_VISIBLE_DEVICES`` hides
    every GPU ("" or "-1"), or on Linux none of :data:`_GPU_TRACES` exists under ``root``. False where one
    may be (then only torch can tell), and off Linux."""
    environ = os.environ if environ is None else environ
    if environ.get("CUDA_VISIBLE_DEVICES", "0").strip() in ("", "-1"):
        return True
    if not sys.platform.startswith("linux"):
        return False
    return not any(os.path.lexists(root / trace) for trace in _GPU_TRACES)


def torch_gpu_build() -> bool | None:
    """Whether the installed torch was built for CUDA or ROCm (``torch.version.cuda`` or ``.hip`` set), read
    from its ``version.py`` without importing torch; None where that cannot be told."""
    import ast
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch")
        folders = list(spec.submodule_search_locations or []) if spec is not None else []
        tree = ast.parse(Path(folders[0], "version.py").read_text(encoding="utf-8")) if folders else None
    except (OSError, ValueError, SyntaxError, ImportError):
        return None
    found: dict[str, Any] = {}
    for node in tree.body if tree is not None else []:
        if not isinstance(node, ast.AnnAssign | ast.Assign):
            continue
        for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
            if isinstance(target, ast.Name) and target.id in ("cuda", "hip"):
                if not isinstance(node.value, ast.Constant):
                    return None
                found[target.id] = node.value.value
    if set(found) != {"cuda", "hip"}:
        return None
    return bool(found["cuda"] or found["hip"])


def device_problem(dev: torch.device | str) -> str | None:
    """Why this process cannot run on ``dev``, or None if it can (torch's own availability checks)."""
    kind = _device_type(dev)
    if kind in ("cpu", "meta"):
        return None
    import torch

    dev = torch.device(dev)
    if kind == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            return "no CUDA GPU is available to this process (torch.cuda.is_available() is False)"
        if dev.index is not None and dev.index >= count:
            return f"this process sees {count} CUDA GPU{'s' if count > 1 else ''} (cuda:0..cuda:{count - 1})"
        return None
    if kind == "mps":
        mps = getattr(torch.backends, "mps", None)
        return None if mps is not None and mps.is_available() else "MPS is not available on this machine"
    backend = getattr(torch, kind, None)
    is_available = getattr(backend, "is_available", None)
    if callable(is_available) and not is_available():
        return f"torch reports no {kind} device available"
    return None


def _dtype_name(dtype: str | torch.dtype | None, device: str) -> str:
    """:func:`resolve_dtype`'s dtype by name, without torch."""
    if dtype is None:
        return "bfloat16" if _device_type(device) == "cuda" else "float32"
    from vlfast.dtypes import dtype_name

    return dtype_name(dtype)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The compute dtype: any spelling :mod:`vlfast.dtypes` accepts, else bfloat16 on CUDA and float32
    elsewhere (bf16 matmuls are emulated on most CPUs)."""
    import torch

    return getattr(torch, _dtype_name(dtype, str(device)))


def _store_dtype_name(store_dtype: str | torch.dtype | None) -> str | None:
    """:func:`resolve_store_dtype`'s dtype by name, without torch."""
    if store_dtype is None:
        return None
    from vlfast.dtypes import dtype_name

    try:
        name = dtype_name(store_dtype)
    except InputRefused:
        name = None
    if name not in STORE_DTYPES:
        raise InputRefused(
            f"store_dtype (--store-dtype) must be one of {', '.join(STORE_DTYPES)}, got {store_dtype!r}"
        )
    return name


def resolve_store_dtype(store_dtype: str | torch.dtype | None) -> torch.dtype | None:
    """None keeps each feature as computed; else floating features are stored in this dtype, one of
    :data:`STORE_DTYPES` (numpy reads float16/float32, not bfloat16)."""
    name = _store_dtype_name(store_dtype)
    if name is None:
        return None
    import torch

    return getattr(torch, name)


@dataclass
class ExtractSummary:
    """What a run did. ``errors`` counts this run's recorded failures by reason kind."""

    out: str
    model: str
    rank: int
    world_size: int
    # Entries are the input's samples, repeated ids and rows that are not samples (bad manifest rows).
    # When a run completes: skipped + extracted + failed == assigned, as the progress bar counts them.
    total: int  # entries in the input (all ranks)
    assigned: int  # this rank's share of them
    skipped: int  # already handled in OUT (committed, or recorded as an error) when the run started
    extracted: int  # added this run
    failed: int  # recorded as errors this run (duplicates and bad input rows included)
    errors: dict[str, int] = field(default_factory=dict)
    tokens: int = 0  # vision patches processed
    seconds: float = 0.0  # the run's own time: checking OUT, decoding, forwards, writing; not the model build
    compute_seconds: float = 0.0  # inside model forwards (device synchronised)
    oom_splits: int = 0
    cpu_seconds: float | None = None  # CPU time of this process and its finished workers during the run
    stopped: str | None = None  # why the run stopped early (--max-errors), else None
    # Samples whose decoding hit a bug (not their media): not recorded, so the next run tries them again.
    # Complete run: skipped + extracted + failed + unexpected == assigned.
    unexpected: int = 0
    features: list[str] = field(default_factory=list)
    nothing_to_do: bool = False  # OUT already held everything: no lock taken, no model loaded
    quarantined: list[str] = field(default_factory=list)  # damaged index parts moved aside, redone
    # Committed samples whose input changed: extracted again (docs/extract.md, "Inputs that change")
    changed: int = 0
    fingerprint_seconds: float = 0.0  # hashing the weights the features depend on
    load_seconds: float = 0.0  # building the model (not in ``seconds``); Ray: connecting + actors' builds
    engine: str = "local"  # "local" (this process and its decode workers) or "ray" (engines.ray)

    @property
    def samples_per_s(self) -> float:
        return self.extracted / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(samples_per_s=round(self.samples_per_s, 3), tokens_per_s=round(self.tokens_per_s, 1))
        return d
