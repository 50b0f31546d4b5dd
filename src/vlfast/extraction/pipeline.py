"""``extract``: run a model over images and videos and store per-sample features, resumably.

The flow, per rank::

    inputs (folder / manifest / tar shards; bad rows become error records) -> run configuration, weights
      fingerprint -> read-only check of OUT (a different configuration is refused, "nothing to do" exits,
         before any lock or model load) -> FeatureStore (lock, checks and moves aside damaged shards) -> plan
      -> model -> worker processes: decode + the model's own preprocessing (errors, dead and hung workers
         come back as records) -> pack by token budget (no padding: the tower takes one flat patch sequence)
      -> forward (convs patched; an out-of-memory batch is split and retried)
      -> FeatureStore (atomic shard commits by size or every ``commit_every`` seconds, errors file)

Decoding and preprocessing run in worker processes while the main process computes, so on a machine with
a free core the end-to-end time approaches the model's own forward time.
"""

from __future__ import annotations

import os
import platform
import time
import warnings
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from vlfast.errors import InputRefused
from vlfast.extraction.decode.preprocess import (
    Preprocessor,
    ProcessorConfig,
    SampleError,
    build_processor_config,
    normalize_video_patches,
)
from vlfast.extraction.decode.workers import unexpected_item
from vlfast.extraction.interrupts import sigterm_like_sigint
from vlfast.extraction.model.batching import Failed, TokenBudget, pack, run_split_on_oom
from vlfast.extraction.model.features import (
    FeatureSpec,
    PromptBuilder,
    VisionBatch,
    compute_llm_features,
    compute_vision_features,
)
from vlfast.extraction.objstore import TransientReadError
from vlfast.extraction.sources.listing import load_inputs
from vlfast.extraction.sources.sample import InputProblem, Sample

__all__ = [
    "UNEXPECTED_IN_A_ROW",
    "ExtractSummary",
    "UnexpectedSampleErrors",
    "default_batch_tokens",
    "default_num_workers",
    "extract",
]

# Samples in a row whose decoding raised an unexpected exception (a bug, not bad media) before the run
# stops. One alone may be a rare file tripping a library bug: it is left undone (retried by the next run)
# and the run goes on. A regression fails every sample it touches, so it shows as a run of them at once;
# 3 stops it within a few samples while two unlucky neighbours do not stop a long run.
UNEXPECTED_IN_A_ROW = 3

RUNTIME_KEY = "runtime"  # run-config entries that may change on resume (how, not what, is computed)


def default_num_workers(device: torch.device | str = "cpu") -> int:
    """Decode/preprocess worker processes: one per core on CPU, all cores but one with an accelerator.

    On CPU the workers only use a core while there is preprocessing to do (they prefetch a few samples,
    then wait), so a compute-bound run loses nothing and a preprocessing-bound run gets every core. With
    an accelerator the main process keeps a core to feed it. At most 8; 0 (in-process) on one core.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cores <= 1:
        return 0
    return min(8, cores if torch.device(device).type == "cpu" else cores - 1)


def default_batch_tokens(device: torch.device | str = "cpu") -> int:
    """Patches per forward: 32,768 on CUDA, where larger GEMMs fill the GPU; 4,096 elsewhere, where a
    1,200-patch image already fills the cores and bigger batches only hold more activations."""
    return 32_768 if torch.device(device).type == "cuda" else 4_096


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
    # Samples whose decoding raised an unexpected exception (a bug, not their media): neither extracted nor
    # recorded, so not done: the next run tries them again. Complete run: skipped + extracted + failed +
    # unexpected == assigned.
    unexpected: int = 0
    features: list[str] = field(default_factory=list)
    nothing_to_do: bool = False  # OUT already held everything: no lock taken, no model loaded
    quarantined: list[str] = field(default_factory=list)  # damaged index parts moved aside, redone
    fingerprint_seconds: float = 0.0  # hashing the weights the features depend on
    load_seconds: float = 0.0  # building the model (not in ``seconds``); Ray: connecting + actors' builds
    engine: str = "local"  # "local" (this process and its decode workers) or "ray" (ray_engine.extract_ray)

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


def _cpu_seconds() -> float | None:
    """CPU time of this process plus its reaped children (the decode workers); None off Unix."""
    try:
        import resource
    except ImportError:
        return None
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class UnexpectedSampleErrors(RuntimeError):
    """``UNEXPECTED_IN_A_ROW`` samples in a row failed to decode with an unexpected exception: a bug, not bad
    media. The run stops (what is committed stays) instead of recording every sample as failed."""


class _Unexpected:
    """Samples whose decoding raised something other than a media problem: counted in the summary, warned
    about, never recorded (a record would make them done); ``UNEXPECTED_IN_A_ROW`` in a row stop the run."""

    def __init__(self, summary: ExtractSummary):
        self.summary, self.in_a_row = summary, 0
        self.ids: set[str] = set()

    def other(self) -> None:
        """A sample came back extracted or recorded: the run of unexpected errors is broken."""
        self.in_a_row = 0

    def add(self, sample_id: str, source: str, reason: str, trace: str | None) -> None:
        self.ids.add(sample_id)
        self.summary.unexpected = len(self.ids)  # a call Ray retried may bring a sample back twice
        self.in_a_row += 1
        where = f"{sample_id!r} ({source})" if source else repr(sample_id)
        if self.in_a_row >= UNEXPECTED_IN_A_ROW:
            raise UnexpectedSampleErrors(
                f"{self.in_a_row} samples in a row failed with an unexpected error, the last {where}: a bug "
                "in vlfast or a library it calls, not bad media, so nothing was recorded for them; committed "
                f"work is kept. Fix it (or report it with this traceback), then run the same command.\n"
                f"{trace or reason}"
            )
        warnings.warn(
            f"sample {where} failed with an unexpected error ({reason}): not recorded, the next run tries it "
            "again",
            RuntimeWarning,
            stacklevel=2,
        )


def _error_kind(reason: str) -> str:
    """A short class of an error reason for counts (and ``--retry-errors``): see ``layout.reason_kind``."""
    from vlfast.extraction.store.format import reason_kind

    return reason_kind(reason)


# ------------------------------------------------------------------------------------------ the dataset


class _SampleDataset(torch.utils.data.Dataset):
    """Map-style dataset: sample -> preprocessed tensors, or an error record. Never raises."""

    def __init__(
        self,
        samples: Sequence[Sample],
        pre: Preprocessor,
        prompts: PromptBuilder | None,
        default_prompt: str,
        hook: Callable[[Sample], None] | None = None,
    ):
        self.samples, self.pre, self.prompts, self.default_prompt = (
            list(samples),
            pre,
            prompts,
            default_prompt,
        )
        self.hook = hook  # tests inject faults here (a crashing or hanging decoder)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        s = self.samples[i]
        try:
            if self.hook is not None:
                self.hook(s)
            pixels, grid, meta = self.pre(s)
            item: dict[str, Any] = {
                "i": i,
                "ok": True,
                "kind": s.kind,
                "pixel_values": pixels,  # (t*h*w, C*T*P*P) float32
                "grid": grid,
                "tokens": grid[0] * grid[1] * grid[2] // self.pre.cfg.merge_size**2,
                "meta": meta,
            }
            if self.prompts is not None:
                prompt = s.prompt or self.default_prompt
                item["input_ids"] = self.prompts(s.kind, prompt, grid, meta)
                media = "image" if s.kind == "image" else "video"
                item["meta"] = {**meta, "prompt": prompt.replace("{kind}", media)}
            return item
        except (SampleError, TransientReadError) as e:  # bad media or input, or storage that did not answer
            return {"i": i, "ok": False, "reason": str(e)}
        except Exception as e:  # noqa: BLE001 - a worker must never kill the run; the caller decides
            # Not a media problem but a bug (an AttributeError after a refactor): never recorded as the
            # sample's error, which would make it done; see _Unexpected.
            return unexpected_item(i, e)


def _worker_init(_: int) -> None:
    # Workers preprocess one sample at a time; intra-op threads would only fight the main process.
    torch.set_num_threads(1)


# ------------------------------------------------------------------------------------------- the model


@dataclass
class _Model:
    spec: str
    family: str
    tower: torch.nn.Module
    whole: torch.nn.Module | None  # the VLM, only for llm features
    device: torch.device
    dtype: torch.dtype


def _family_of(model: str) -> str:
    if model.startswith("ref:"):
        from vlfast.models import resolve_reference

        return resolve_reference(model).family
    from vlfast.models import load_config

    return str(load_config(model).model_type)


def _identity(model: str, family: str) -> dict[str, Any]:
    """What tower the features come from, from its config alone (before anything is loaded)."""
    from vlfast.models import vision_config_of, vision_model_class

    cfg = vision_config_of(model)
    vision_config = cfg.to_dict()
    for k in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "_attn_implementation"):
        vision_config.pop(k, None)
    return {"family": family, "tower_class": vision_model_class(cfg).__name__, "vision_config": vision_config}


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def _resolve_device(device: str | torch.device | None, check: bool) -> torch.device:
    """The device to run on; with ``check``, refused (exit 2, naming --device) unless this machine has it,
    so a wrong --device is answered before OUT is written, not when the model is moved onto it."""
    if device is None:
        return _default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InputRefused(
            f"--device {device!r} is not a device: use cpu, cuda, cuda:N or mps ({str(e).splitlines()[0]})"
        ) from None
    if check:
        problem = _device_problem(dev)
        if problem is not None:
            raise InputRefused(f"--device {device}: {problem}; use another --device or leave it out")
    return dev


def _device_problem(dev: torch.device) -> str | None:
    """Why this process cannot run on ``dev``, or None if it can (torch's own availability checks)."""
    if dev.type in ("cpu", "meta"):
        return None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            return "no CUDA GPU is available to this process (torch.cuda.is_available() is False)"
        if dev.index is not None and dev.index >= count:
            return f"this process sees {count} CUDA GPU{'s' if count > 1 else ''} (cuda:0..cuda:{count - 1})"
        return None
    if dev.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        return None if mps is not None and mps.is_available() else "MPS is not available on this machine"
    backend = getattr(torch, dev.type, None)
    is_available = getattr(backend, "is_available", None)
    if callable(is_available) and not is_available():
        return f"torch reports no {dev.type} device available"
    return None


def _check_llm_request(model: str, spec: FeatureSpec) -> None:
    """Refuse llm features that the model cannot give, from its config alone (exit 2, naming the flag):
    a reference (a vision tower only) or a ``--layers`` index past the LLM's hidden states."""
    if not spec.needs_llm:
        return
    if model.startswith("ref:"):
        raise InputRefused(
            f"{model} is a vision tower only: llm features need a local checkpoint directory "
            "(drop 'llm' from --features, or pass --model DIR)"
        )
    from vlfast.models import load_config

    config = load_config(model)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = getattr(text, "num_hidden_layers", None)
    if not isinstance(n, int):
        return  # the forward's own check stays (features.compute_llm_features)
    states = n + 1  # output_hidden_states: the embeddings, then one per layer
    bad = [layer for layer in spec.layers if not -states <= layer < states]
    if bad:
        raise InputRefused(
            f"--layers {','.join(map(str, bad))}: the language model of {model} has {n} layers, so its "
            f"hidden states are 0 (the embeddings) to {n}, or -{states} to -1 counting from the last"
        )


def _resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        # bf16 where the hardware runs it fast; float32 on CPU, where bf16 matmuls are emulated on most chips.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise InputRefused(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    return value


STORE_DTYPES = ("float16", "bfloat16", "float32")


def _resolve_store_dtype(store_dtype: str | torch.dtype | None) -> torch.dtype | None:
    """None keeps each feature as computed; else floating features are stored in this dtype (numpy reads
    float16/float32, not bfloat16)."""
    if store_dtype is None or isinstance(store_dtype, torch.dtype):
        return store_dtype
    if str(store_dtype) not in STORE_DTYPES:
        raise InputRefused(f"store_dtype must be one of {', '.join(STORE_DTYPES)}, got {store_dtype!r}")
    return getattr(torch, str(store_dtype))


def _load(
    model: str, family: str, spec: FeatureSpec, device: torch.device, dtype: torch.dtype, patch_convs: bool
) -> _Model:
    from vlfast.models import find_vision_tower, load_model, load_vision_tower

    if spec.needs_llm:
        whole = load_model(model, device=device, dtype=dtype)
        tower = find_vision_tower(whole)[1]
    else:
        whole = None
        tower = load_vision_tower(model, device=device, dtype=dtype)
    tower.eval()
    if patch_convs:
        from vlfast.patching.gemm import patch

        patch(tower)
    return _Model(model, family, tower, whole, device, dtype)


def _versions() -> dict[str, str | None]:
    import importlib.metadata as md

    out: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("vlfast", "transformers", "av", "pillow", "safetensors", "pyarrow", "numpy"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


# ------------------------------------------------------------------------------------------ the progress


class _Progress:
    """A rich progress bar with samples/s, tokens/s, ETA and the error count; silent when disabled."""

    def __init__(self, enabled: bool, total: int, label: str):
        self.enabled = enabled and total > 0
        self.started = time.perf_counter()
        self.tokens = 0
        self.errors = 0
        self.done = 0
        self._done_before = 0  # entries counted before the clock started (records made before the model)
        if not self.enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeRemainingColumn(),
            TextColumn("[red]{task.fields[errors]}"),
            transient=False,
        )
        self.task = self.bar.add_task(label, total=total, rate="", errors="")
        self.bar.start()

    def update(self, samples: int = 0, tokens: int = 0, errors: int = 0) -> None:
        self.done += samples
        self.tokens += tokens
        self.errors += errors
        if not self.enabled:
            return
        dt = max(time.perf_counter() - self.started, 1e-9)
        rate = f"{(self.done - self._done_before) / dt:.2f} samples/s  {self.tokens / dt:,.0f} tokens/s"
        errs = f"{self.errors} errors" if self.errors else ""
        self.bar.update(self.task, advance=samples, rate=rate, errors=errs)

    def restart_clock(self) -> None:
        """Rates from now on: the model has been built (its build is not the run's speed, as in the summary)."""
        self.started = time.perf_counter()
        self._done_before = self.done

    def close(self) -> None:
        if self.enabled:
            self.bar.stop()


# --------------------------------------------------------------------------------------------- extract


def extract(
    inputs: str | os.PathLike | Sequence[Sample],
    out: str | os.PathLike,
    *,
    model: str,
    features: str | Sequence[str] = ("vision", "vision_mean"),
    layers: Sequence[int] = (-1,),
    pools: Sequence[str] = ("last",),
    prompt: str | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    store_dtype: str | torch.dtype | None = None,
    fps: float | None = None,
    num_frames: int | None = None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    video_max_pixels: int | None = None,
    max_batch_tokens: int | None = None,
    max_batch_samples: int = 64,
    num_workers: int | None = None,
    decode_timeout: float | None = 120.0,
    patch_convs: bool = True,
    max_errors: int | None = None,
    overwrite: bool = False,
    shard_max_bytes: int = 256 << 20,
    shard_max_samples: int = 1024,
    commit_every: float | None = 60.0,
    resume_check: str = "full",
    rank: int | None = None,
    world_size: int | None = None,
    progress: bool = False,
    storage_options: dict[str, Any] | None = None,
    retry_errors: str | Sequence[str] | None = None,
    _forward_hook: Callable[[list[dict[str, Any]]], None] | None = None,
    _decode_hook: Callable[[Sample], None] | None = None,
    _engine: Callable[[_Job], None] | None = None,
) -> ExtractSummary:
    """Extract ``features`` of every sample in ``inputs`` with ``model`` into the folder ``out``.

    ``inputs`` is a folder (images and videos, recursive), a manifest (.jsonl/.csv/.parquet with ``path``
    and optional ``id``, ``prompt``), WebDataset tar shards (``"shards/{000000..000099}.tar"``; ids
    ``{shard}/{__key__}``), or a list of :class:`Sample`. ``model`` is a checkpoint directory or
    ``ref:NAME`` (vision features only, random weights). Running the same call again skips what ``out``
    holds, after checking it (``resume_check``: "full" hashes every committed tensor, "quick" checks sizes
    and headers); damaged shards are moved aside and redone; a different configuration or different
    weights are refused with :class:`RunConfigMismatch` before the model loads. Under ``torchrun`` each
    rank takes its share (or pass ``rank``/``world_size``). Bad samples, bad input rows, and samples whose
    decoder crashed or ran past ``decode_timeout`` seconds are recorded in ``out/errors`` and the run goes
    on; past ``max_errors`` recorded errors it stops (committed work is kept). A sample whose decoding raises
    an unexpected exception (a bug, not its media) is not recorded: ``summary.unexpected`` counts it and the
    next run tries it again; ``UNEXPECTED_IN_A_ROW`` in a row raise :class:`UnexpectedSampleErrors`. Work is
    committed at least every ``commit_every`` seconds, and on SIGTERM or Ctrl-C, which then raise
    :class:`~vlfast.extraction.interrupts.Terminated` or ``KeyboardInterrupt``. ``store_dtype``
    ("float16", "float32", "bfloat16") converts floating features before storing (default: as computed). ``inputs`` and a manifest's paths may be fsspec URLs
    (``s3://bucket/key``), opened with ``storage_options``, and so may ``out`` (see docs/extract.md, "Object
    storage": the commit protocol without renames or locks). A sample whose input could not be read from
    storage for a transient reason (connection reset, 5xx or SlowDown, timeout; the client's retries
    spent) is recorded with kind "transient" and tried again by the next run; ``retry_errors`` ("all", or
    kinds such as "error" or a reason class as the summary counts it) tries recorded failures again.
    """
    from vlfast.extraction.store.fingerprint import weights_fingerprint
    from vlfast.extraction.store.format import DUPLICATE_KIND, INPUT_KIND, parse_retry
    from vlfast.extraction.store.resume import (
        DEFAULT_VOLATILE_KEYS,
        confirm_hashed,
        dist_info,
        duplicate_reason,
        plan_positions,
        read_state,
    )
    from vlfast.extraction.store.writer import FeatureStore

    model = str(model)
    spec = FeatureSpec(
        names=tuple(features.split(",")) if isinstance(features, str) else tuple(features),
        layers=tuple(int(x) for x in layers),
        pools=tuple(pools),
        **({"prompt": prompt} if prompt else {}),
    )
    retry = parse_retry(retry_errors)
    if max_errors is not None and max_errors < 0:
        raise InputRefused(f"max_errors must be >= 0, got {max_errors}")
    if decode_timeout is not None and not decode_timeout > 0:
        raise InputRefused(
            f"decode_timeout must be a positive number of seconds or None, got {decode_timeout!r}"
        )
    if rank is None or world_size is None:
        env_rank, env_world = dist_info()
        rank = env_rank if rank is None else rank
        world_size = env_world if world_size is None else world_size
    # Another engine runs the model elsewhere (Ray actors on GPU nodes): only the local engine's device
    # must exist here.
    dev = _resolve_device(device, check=_engine is None)
    torch_dtype = _resolve_dtype(dtype, dev)
    stored_as = _resolve_store_dtype(store_dtype)
    workers = default_num_workers(dev) if num_workers is None else int(num_workers)
    if workers < 0:
        raise InputRefused(f"num_workers must be >= 0, got {workers}")
    if (
        _engine is None
        and workers > 0
        and dev.type == "cpu"
        and torch.get_num_threads() > 1
        and "OMP_WAIT_POLICY" not in os.environ
    ):
        warnings.warn(
            "torch's idle OpenMP threads spin on the cores the decode workers need: set "
            "OMP_WAIT_POLICY=PASSIVE before torch is imported (`vlfast extract` does) for ~1.3x faster "
            "preprocessing-bound runs; see docs/extract.md",
            RuntimeWarning,
            stacklevel=2,
        )
    budget = TokenBudget(
        max_tokens=int(max_batch_tokens or default_batch_tokens(dev)),
        max_samples=int(max_batch_samples),
    )

    # Everything below up to the store reads only: bad input, a different configuration, different
    # weights or a finished OUT are answered before a lock is taken or a model is built.
    from vlfast.extraction.store.format import is_local, resolve_out

    out = resolve_out(out, storage_options)
    if not is_local(out):
        from vlfast.extraction.objstore import probe_out

        probe_out(out)
    samples, problems = load_inputs(inputs, storage_options)
    family = _family_of(model)
    _check_llm_request(model, spec)
    cfg: ProcessorConfig = build_processor_config(
        model,
        family=family,
        fps=fps,
        num_frames=num_frames,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        video_max_pixels=video_max_pixels,
    )
    t0 = time.perf_counter()
    weights = weights_fingerprint(model, whole=spec.needs_llm)
    fingerprint_seconds = time.perf_counter() - t0
    run_config = {
        "task": "vlfast.extract",
        "model": model if model.startswith("ref:") else str(Path(model).resolve()),
        "model_identity": _identity(model, family),
        "weights": weights,
        "dtype": str(torch_dtype).removeprefix("torch."),
        "store_dtype": None if stored_as is None else str(stored_as).removeprefix("torch."),
        "features": spec.to_dict(),
        "processor": cfg.to_dict(),
        "versions": _versions(),
        # The GEMM patch changes the features' bits (up to ~1e-6 relative in float32, more in bfloat16), so a
        # resume must not mix patched and unpatched samples. Recorded only when unpatched: an OUT written
        # with the default by a vlfast from before this key was configuration stays resumable.
        **({} if patch_convs else {"patch_convs": False}),
        RUNTIME_KEY: {
            "device": str(dev),
            "num_workers": workers,
            "max_batch_tokens": budget.max_tokens,
            "world_size": world_size,
            "decode_timeout": decode_timeout,
            "commit_every": commit_every,
        },
    }
    volatile = (*DEFAULT_VOLATILE_KEYS, RUNTIME_KEY)
    entries = _Entries(samples, problems, rank, world_size)
    summary = ExtractSummary(
        out=str(out),
        model=model,
        rank=rank,
        world_size=world_size,
        total=entries.total,
        assigned=entries.assigned,
        skipped=0,
        extracted=0,
        failed=0,
        features=list(spec.names),
        fingerprint_seconds=fingerprint_seconds,
    )
    if not overwrite:
        state = read_state(out, run_config, volatile, retry)
        pending = entries.pending(state.done, state.error_keys.__contains__)
        if not pending and not state.damaged and resume_check == "full":
            # A finished OUT gets the same check a resume would: what fails goes to the store below, which
            # moves it aside and redoes it, instead of "nothing to do" over a flipped byte.
            state.damaged = confirm_hashed(out, state, f"r{rank:05d}")
        if not pending and not state.damaged:
            summary.skipped, summary.nothing_to_do = entries.assigned, True
            return summary

    # The run's own time, as the summary reports it, excludes building the model (``load_seconds``).
    started, cpu_started = time.perf_counter(), _cpu_seconds()

    # From here on SIGTERM (a scheduler's preemption) unwinds like Ctrl-C: the store commits what is done
    # and releases its lock on the way out.
    with (
        sigterm_like_sigint(),
        FeatureStore(
            out,
            run_config,
            rank=rank,
            world_size=world_size,
            shard_max_bytes=shard_max_bytes,
            shard_max_samples=shard_max_samples,
            commit_every=commit_every,
            overwrite=overwrite,
            volatile_keys=volatile,
            resume_check=resume_check,
            retry_errors=retry,
        ) as store,
    ):
        summary.quarantined = [q["part"] for q in store.quarantined]
        done = store.done_ids()  # reads every index part and errors file: once
        todo_positions, repeats = plan_positions(entries.ids, rank, world_size, done)
        pending = entries.pending(done, store.is_recorded)
        summary.skipped = entries.assigned - pending
        errors: Counter[str] = Counter()
        bar = _Progress(progress, pending, f"extract r{rank}" if world_size > 1 else "extract")

        def record(sample_id: str, source: str, reason: str, kind: str | None = None) -> None:
            """Record an error once; the summary, the progress bar and --max-errors all count it."""
            before = store.num_errors
            store.add_error(sample_id, source, reason, kind=kind)
            if store.num_errors > before:
                errors[_error_kind(reason)] += 1
                bar.update(samples=1, errors=1)

        recorded_elsewhere = 0

        def count_error(reason: str) -> None:
            """Count an error another engine's process recorded through its own store."""
            nonlocal recorded_elsewhere
            recorded_elsewhere += 1
            errors[_error_kind(reason)] += 1
            bar.update(samples=1, errors=1)

        try:
            for k, first in repeats:
                record(entries.ids[k], samples[k].source, duplicate_reason(k, first), DUPLICATE_KIND)
            for problem in entries.mine_problems:
                record(*_problem_record(problem), INPUT_KIND)
            todo = [samples[k] for k in todo_positions]
            if max_errors is not None and store.num_errors > max_errors:
                summary.stopped = f"more than {max_errors} errors (--max-errors)"
            elif todo and _engine is not None:
                _engine(
                    _Job(
                        todo=todo,
                        store=store,
                        summary=summary,
                        bar=bar,
                        count_error=count_error,
                        errors_so_far=lambda: store.num_errors + recorded_elsewhere,
                        model=model,
                        family=family,
                        spec=spec,
                        cfg=cfg,
                        device=dev,
                        dtype=torch_dtype,
                        stored_as=stored_as,
                        budget=budget,
                        num_workers=num_workers,
                        decode_timeout=decode_timeout,
                        patch_convs=patch_convs,
                        max_errors=max_errors,
                        run_config=run_config,
                        volatile_keys=volatile,
                        shard_max_bytes=shard_max_bytes,
                        shard_max_samples=shard_max_samples,
                        commit_every=commit_every,
                        retry_errors=retry,
                        forward_hook=_forward_hook,
                        decode_hook=_decode_hook,
                    )
                )
            elif todo:
                t0, cpu0 = time.perf_counter(), _cpu_seconds()
                loaded = _load(model, family, spec, dev, torch_dtype, patch_convs)
                summary.load_seconds = time.perf_counter() - t0
                bar.restart_clock()
                if cpu0 is not None and cpu_started is not None:
                    cpu_started += _cpu_seconds() - cpu0
                _run(
                    todo,
                    store,
                    loaded,
                    spec,
                    cfg,
                    budget,
                    workers,
                    decode_timeout,
                    stored_as,
                    summary,
                    record,
                    bar,
                    max_errors,
                    _forward_hook,
                    _decode_hook,
                )
        finally:
            bar.close()
            summary.errors = dict(errors)
            summary.failed = store.num_errors + recorded_elsewhere
            summary.seconds = time.perf_counter() - started - summary.load_seconds
            cpu_now = _cpu_seconds()
            if cpu_now is not None and cpu_started is not None:
                summary.cpu_seconds = cpu_now - cpu_started
    return summary


@dataclass
class _Job:
    """What another engine (``ray_engine``) gets once ``extract`` has done everything before the model: the
    input listed and planned, OUT checked and locked by ``store``, duplicates and bad rows recorded. The
    engine extracts ``todo`` into OUT through stores of its own, reports each error it records through
    ``count_error`` and fills ``summary`` (extracted, tokens, compute and load seconds, stopped)."""

    todo: list[Sample]
    store: Any  # the FeatureStore extract opened (this rank's lock held until the engine returns)
    summary: ExtractSummary
    bar: _Progress
    count_error: Callable[[str], None]
    errors_so_far: Callable[[], int]  # for --max-errors: this run's records, here and elsewhere
    model: str
    family: str
    spec: FeatureSpec
    cfg: ProcessorConfig
    device: torch.device
    dtype: torch.dtype
    stored_as: torch.dtype | None
    budget: TokenBudget
    num_workers: int | None  # as the caller gave it (None: the engine's default)
    decode_timeout: float | None
    patch_convs: bool
    max_errors: int | None
    run_config: dict[str, Any]
    volatile_keys: tuple[str, ...]
    shard_max_bytes: int
    shard_max_samples: int
    commit_every: float | None
    retry_errors: frozenset[str] | None = None  # recorded failures the stores must not count as done
    forward_hook: Callable | None = None
    decode_hook: Callable | None = None


def _mine(sample_id: str, rank: int, world_size: int) -> bool:
    from vlfast.extraction.store.resume import owner_rank

    return world_size == 1 or owner_rank(sample_id, world_size) == rank


def _problem_record(problem: InputProblem) -> tuple[str, str, str]:
    """(id, source, reason) of a bad input row's error record; a row without a usable id is named by where
    it is (its record never makes any id done)."""
    return problem.id or problem.where, problem.where, problem.reason


class _Entries:
    """The input's entries and this rank's share of them, for planning and for the summary's counts."""

    def __init__(
        self, samples: Sequence[Sample], problems: Sequence[InputProblem], rank: int, world_size: int
    ):
        self.ids = [s.id for s in samples]
        self.sources = [s.source for s in samples]
        self.rank, self.world_size = rank, world_size
        self.mine_problems = [p for p in problems if _mine(_problem_record(p)[0], rank, world_size)]
        self.total = len(samples) + len(problems)
        self.assigned = sum(_mine(i, rank, world_size) for i in self.ids) + len(self.mine_problems)

    def pending(self, done: Collection[str], is_recorded: Callable[[tuple], bool]) -> int:
        """Entries of this rank still to handle: samples to extract, repeats and bad rows not yet recorded."""
        from vlfast.extraction.store.format import DUPLICATE_KIND, INPUT_KIND
        from vlfast.extraction.store.resume import duplicate_reason, plan_positions

        todo, repeats = plan_positions(self.ids, self.rank, self.world_size, done)
        n = len(todo)
        n += sum(
            not is_recorded((self.ids[k], self.sources[k], duplicate_reason(k, first), DUPLICATE_KIND))
            for k, first in repeats
        )
        n += sum(not is_recorded((*_problem_record(p), INPUT_KIND)) for p in self.mine_problems)
        return n


def _pixels_to(x: torch.Tensor, device: torch.device, cfg: ProcessorConfig) -> torch.Tensor:
    """A sample's pixel_values as float32 (N, C*T*P*P) on ``device``. To CUDA the copy starts from pinned
    memory, so ``non_blocking`` really overlaps it (from pageable memory it would be synchronous).
    Video patches arrive as uint8 and are normalised after the copy, on the device: a quarter of the bytes
    cross the bus."""
    if device.type == "cuda" and not x.is_pinned():
        x = x.pin_memory()
    x = x.to(device, non_blocking=True)
    return normalize_video_patches(x, cfg) if x.dtype == torch.uint8 else x


def _decoding(
    model: str, family: str, cfg: ProcessorConfig, spec: FeatureSpec, images: bool
) -> tuple[Preprocessor, PromptBuilder | None]:
    """What decoding needs, built once where samples are decoded (this process, or a Ray decode actor):
    the model's own preprocessing, which leaves videos as uint8 patches to be normalised where the model
    runs, and for ``llm`` the prompt builder with its tokenizer loaded, so forked workers inherit both."""
    # A reference has no processor files: its family's published defaults apply (cfg).
    pre = Preprocessor(
        cfg, image_processor_dir=None if model.startswith("ref:") else model, defer_video_normalize=True
    )
    if images:
        pre.image_processor()  # import and build it once here, so forked workers inherit it
    prompts = None
    if spec.needs_llm:
        prompts = PromptBuilder(model, family, cfg.merge_size, cfg.temporal_patch_size)
        prompts.tokenizer()
    return pre, prompts


def _cost(item: dict[str, Any]) -> int:
    """A decoded sample's share of the token budget: its patches, plus its prompt for ``llm``."""
    return int(item["pixel_values"].shape[0]) + int(item.get("input_ids", torch.empty(0)).numel())


class _Forward:
    """The model half of the pipeline, shared by the engines: one forward of a packed batch (split in half
    on out-of-memory), and the results added to a store. Counts its time inside forwards and its splits."""

    def __init__(
        self,
        loaded: _Model,
        spec: FeatureSpec,
        cfg: ProcessorConfig,
        stored_as: torch.dtype | None,
        prompts: PromptBuilder | None,
        hook: Callable | None = None,
    ):
        self.loaded, self.spec, self.cfg, self.stored_as, self.hook = loaded, spec, cfg, stored_as, hook
        self.token_ids: dict[str, int] = {}
        if prompts is not None:
            tok = prompts.tokenizer()
            self.token_ids = {
                "image_token_id": int(tok.convert_tokens_to_ids("<|image_pad|>")),
                "video_token_id": int(tok.convert_tokens_to_ids("<|video_pad|>")),
                "pad_token_id": int(tok.pad_token_id if tok.pad_token_id is not None else 0),
            }
        self.compute_seconds = 0.0
        self.oom_splits = 0

    def _pixels_on(self, item: dict[str, Any], device: torch.device) -> torch.Tensor:
        return _pixels_to(item["pixel_values"], device, self.cfg)

    def __call__(self, batch: Sequence[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
        loaded, spec, cpu = self.loaded, self.spec, torch.device("cpu")
        cuda = loaded.device.type == "cuda"
        if self.hook is not None:
            self.hook([{**it, "pixel_values": self._pixels_on(it, cpu)} for it in batch])
        t0 = time.perf_counter()
        if spec.needs_llm:
            ready = [{**it, "pixel_values": self._pixels_on(it, cpu)} for it in batch]
            feats = compute_llm_features(
                loaded.whole,
                loaded.tower,
                ready,
                spec,
                device=loaded.device,
                dtype=loaded.dtype,
                **self.token_ids,
            )
        else:
            pixels = torch.cat([self._pixels_on(it, loaded.device) for it in batch])
            vb = VisionBatch(
                pixel_values=pixels.to(dtype=loaded.dtype),
                grid_thw=torch.tensor([list(it["grid"]) for it in batch], dtype=torch.int64).to(
                    loaded.device, non_blocking=True
                ),
                tokens=[int(it["tokens"]) for it in batch],
            )
            feats = compute_vision_features(loaded.tower, vb, spec.names)
        feats = [{k: v.to("cpu", non_blocking=cuda) for k, v in f.items()} for f in feats]
        if cuda:
            torch.cuda.synchronize(loaded.device)
        self.compute_seconds += time.perf_counter() - t0
        if self.stored_as is not None:
            feats = [
                {k: v.to(self.stored_as) if v.is_floating_point() else v for k, v in f.items()} for f in feats
            ]
        return feats

    def _split(self, n: int) -> None:
        self.oom_splits += 1

    def store(
        self,
        batch: Sequence[dict[str, Any]],
        store,
        sample_of: Callable[[dict[str, Any]], Sample],
        record: Callable[..., None],
    ) -> list[tuple[Sample, int]]:
        """Run ``batch`` and add each result to ``store``; a sample that does not fit even alone is recorded.
        Returns (sample, patches) for each sample added."""
        added = []
        for item, result in zip(batch, run_split_on_oom(batch, self, on_oom=self._split)):
            sample = sample_of(item)
            if isinstance(result, Failed):
                record(
                    sample.id,
                    sample.source,
                    f"out of memory even alone ({_cost(item)} tokens): {result.error}",
                )
                continue
            meta = {
                "path": sample.source,
                "kind": sample.kind,
                "n_tokens": int(item["tokens"]),
                **item["meta"],
            }
            store.add(sample.id, result, meta)
            added.append((sample, int(item["pixel_values"].shape[0])))
        return added


def _run(
    todo: list[Sample],
    store,
    loaded: _Model,
    spec: FeatureSpec,
    cfg: ProcessorConfig,
    budget: TokenBudget,
    workers: int,
    decode_timeout: float | None,
    stored_as: torch.dtype | None,
    summary: ExtractSummary,
    record: Callable[..., None],
    bar: _Progress,
    max_errors: int | None,
    forward_hook: Callable | None,
    decode_hook: Callable | None,
) -> None:
    from vlfast.extraction.decode.workers import WorkerPool

    # Workers send videos as uint8 patches, normalised here (on the device when there is one).
    pre, prompts = _decoding(loaded.spec, loaded.family, cfg, spec, any(s.kind == "image" for s in todo))
    dataset = _SampleDataset(todo, pre, prompts, spec.prompt, decode_hook)
    forward = _Forward(loaded, spec, cfg, stored_as, prompts, forward_hook)

    unexpected = _Unexpected(summary)

    def stop_now() -> bool:
        return max_errors is not None and store.num_errors > max_errors

    def good_items(pool: WorkerPool) -> Iterator[dict[str, Any]]:
        for item in pool:
            store.tick()  # a slow stretch of decoding still commits what is buffered
            sample = todo[item["i"]]
            if item.get("unexpected"):
                bar.update(samples=1)
                unexpected.add(sample.id, sample.source, item["reason"], item.get("traceback"))
                continue
            unexpected.other()
            if item["ok"]:
                yield item
                continue
            record(sample.id, sample.source, item["reason"])
            if stop_now():
                summary.stopped = f"more than {max_errors} errors (--max-errors)"
                return

    try:
        with WorkerPool(
            dataset.__getitem__,
            len(dataset),
            num_workers=workers,
            timeout=decode_timeout,
            prefetch=8,
            worker_init=_worker_init,
        ) as pool:
            for batch in pack(good_items(pool), _cost, budget, first_alone=True):
                for _, patches in forward.store(batch, store, lambda it: todo[it["i"]], record):
                    summary.extracted += 1
                    summary.tokens += patches
                    bar.update(samples=1, tokens=patches)
                if stop_now():
                    summary.stopped = summary.stopped or f"more than {max_errors} errors (--max-errors)"
                    break
    finally:
        summary.compute_seconds += forward.compute_seconds
        summary.oom_splits += forward.oom_splits
