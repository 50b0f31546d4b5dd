"""``extract``: run a model over images and videos and store per-sample features, resumably.

The flow, per rank::

    inputs (folder / manifest) -> plan (this rank's share, minus what OUT already holds)
      -> DataLoader workers: decode + the model's own preprocessing (errors come back as records)
      -> pack by token budget (no padding: the tower takes one flat patch sequence)
      -> forward (convs patched; an out-of-memory batch is split and retried)
      -> FeatureStore (atomic shard commits, errors file)

Decoding and preprocessing run in worker processes while the main process computes, so on a machine with
a free core the end-to-end time approaches the model's own forward time.
"""

from __future__ import annotations

import os
import platform
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from vlfast.extraction.batching import Failed, TokenBudget, pack, run_split_on_oom
from vlfast.extraction.features import (
    FeatureSpec,
    PromptBuilder,
    VisionBatch,
    compute_llm_features,
    compute_vision_features,
)
from vlfast.extraction.inputs import Sample, read_inputs
from vlfast.extraction.preprocess import (
    Preprocessor,
    ProcessorConfig,
    SampleError,
    build_processor_config,
    normalize_video_patches,
)

__all__ = ["ExtractSummary", "default_batch_tokens", "default_num_workers", "extract"]

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
    total: int  # samples in the input (all ranks)
    assigned: int  # this rank's share
    skipped: int  # already in OUT (committed or errored) when the run started
    extracted: int  # added this run
    failed: int  # recorded as errors this run (duplicates included)
    errors: dict[str, int] = field(default_factory=dict)
    tokens: int = 0  # vision patches processed
    seconds: float = 0.0
    compute_seconds: float = 0.0  # inside model forwards (device synchronised)
    oom_splits: int = 0
    cpu_seconds: float | None = None  # CPU time of this process and its finished workers during the run
    stopped: str | None = None  # why the run stopped early (--max-errors), else None
    features: list[str] = field(default_factory=list)

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
    """CPU time of this process plus its reaped children (the DataLoader workers); None off Unix."""
    try:
        import resource
    except ImportError:
        return None
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _error_kind(reason: str) -> str:
    """A short class of an error reason for counts: the text before the first colon."""
    return reason.split(":", 1)[0].strip()[:60] or "error"


# ------------------------------------------------------------------------------------------ the dataset


class _SampleDataset(torch.utils.data.Dataset):
    """Map-style dataset: sample -> preprocessed tensors, or an error record. Never raises."""

    def __init__(
        self, samples: Sequence[Sample], pre: Preprocessor, prompts: PromptBuilder | None, default_prompt: str
    ):
        self.samples, self.pre, self.prompts, self.default_prompt = (
            list(samples),
            pre,
            prompts,
            default_prompt,
        )

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        s = self.samples[i]
        try:
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
        except SampleError as e:
            return {"i": i, "ok": False, "reason": str(e)}
        except Exception as e:  # noqa: BLE001 - a worker must never kill the run; the reason is recorded
            return {"i": i, "ok": False, "reason": f"unexpected {type(e).__name__}: {e}"}


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
    identity: dict[str, Any]


def _family_of(model: str) -> str:
    if model.startswith("ref:"):
        from vlfast.models import resolve_reference

        return resolve_reference(model).family
    from vlfast.models import load_config

    return str(load_config(model).model_type)


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def _resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        # bf16 where the hardware runs it fast; float32 on CPU, where bf16 matmuls are emulated on most chips.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    return value


def _load(
    model: str, spec: FeatureSpec, device: torch.device, dtype: torch.dtype, patch_convs: bool
) -> _Model:
    from vlfast.models import find_vision_tower, load_model, load_vision_tower

    family = _family_of(model)
    if spec.needs_llm:
        if model.startswith("ref:"):
            raise ValueError(
                f"{model} is a vision tower only: llm features need a local checkpoint directory "
                "(drop 'llm' from --features, or pass --model DIR)"
            )
        whole = load_model(model, device=device, dtype=dtype)
        tower = find_vision_tower(whole)[1]
    else:
        whole = None
        tower = load_vision_tower(model, device=device, dtype=dtype)
    tower.eval()
    if patch_convs:
        from vlfast.patching import patch

        patch(tower)
    cfg = getattr(tower, "config", None)
    identity = {
        "family": family,
        "tower_class": type(tower).__name__,
        "vision_config": cfg.to_dict() if hasattr(cfg, "to_dict") else None,
    }
    if identity["vision_config"]:
        for k in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "_attn_implementation"):
            identity["vision_config"].pop(k, None)
    return _Model(model, family, tower, whole, device, dtype, identity)


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
        rate = f"{self.done / dt:.2f} samples/s  {self.tokens / dt:,.0f} tokens/s"
        errs = f"{self.errors} errors" if self.errors else ""
        self.bar.update(self.task, advance=samples, rate=rate, errors=errs)

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
    fps: float | None = None,
    num_frames: int | None = None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    video_max_pixels: int | None = None,
    max_batch_tokens: int | None = None,
    max_batch_samples: int = 64,
    num_workers: int | None = None,
    patch_convs: bool = True,
    max_errors: int | None = None,
    overwrite: bool = False,
    shard_max_bytes: int = 256 << 20,
    shard_max_samples: int = 1024,
    rank: int | None = None,
    world_size: int | None = None,
    progress: bool = False,
    _forward_hook: Callable[[list[dict[str, Any]]], None] | None = None,
) -> ExtractSummary:
    """Extract ``features`` of every sample in ``inputs`` with ``model`` into the folder ``out``.

    ``inputs`` is a folder (images and videos, recursive), a manifest (.jsonl/.csv/.parquet with ``path``
    and optional ``id``, ``prompt``), or a list of :class:`Sample`. ``model`` is a checkpoint directory or
    ``ref:NAME`` (vision features only, random weights). Running the same call again skips what ``out``
    holds; a different configuration is refused with :class:`RunConfigMismatch`. Under ``torchrun`` each
    rank takes its share (or pass ``rank``/``world_size``). Bad samples are recorded in ``out/errors`` and
    the run goes on; past ``max_errors`` recorded errors it stops (committed work is kept).
    """
    from vlfast.extraction.store import DEFAULT_VOLATILE_KEYS, FeatureStore, dist_info

    model = str(model)
    spec = FeatureSpec(
        names=tuple(features.split(",")) if isinstance(features, str) else tuple(features),
        layers=tuple(int(x) for x in layers),
        pools=tuple(pools),
        **({"prompt": prompt} if prompt else {}),
    )
    if max_errors is not None and max_errors < 0:
        raise ValueError(f"max_errors must be >= 0, got {max_errors}")
    if rank is None or world_size is None:
        env_rank, env_world = dist_info()
        rank = env_rank if rank is None else rank
        world_size = env_world if world_size is None else world_size
    dev = torch.device(device) if device is not None else _default_device()
    torch_dtype = _resolve_dtype(dtype, dev)
    workers = default_num_workers(dev) if num_workers is None else int(num_workers)
    if workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {workers}")
    if (
        workers > 0
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

    samples = read_inputs(inputs)
    family = _family_of(model)
    cfg: ProcessorConfig = build_processor_config(
        model,
        family=family,
        fps=fps,
        num_frames=num_frames,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        video_max_pixels=video_max_pixels,
    )
    loaded = _load(model, spec, dev, torch_dtype, patch_convs)
    run_config = {
        "task": "vlfast.extract",
        "model": model if model.startswith("ref:") else str(Path(model).resolve()),
        "model_identity": loaded.identity,
        "dtype": str(torch_dtype).removeprefix("torch."),
        "features": spec.to_dict(),
        "processor": cfg.to_dict(),
        "versions": _versions(),
        RUNTIME_KEY: {
            "device": str(dev),
            "patch_convs": patch_convs,
            "num_workers": workers,
            "max_batch_tokens": budget.max_tokens,
            "world_size": world_size,
        },
    }
    started, cpu_started = time.perf_counter(), _cpu_seconds()
    with FeatureStore(
        out,
        run_config,
        rank=rank,
        world_size=world_size,
        shard_max_bytes=shard_max_bytes,
        shard_max_samples=shard_max_samples,
        overwrite=overwrite,
        volatile_keys=(*DEFAULT_VOLATILE_KEYS, RUNTIME_KEY),
    ) as store:
        ids = [s.id for s in samples]
        done_before = store.done_ids()
        assigned = sum(1 for k in range(len(ids)) if world_size == 1 or _owner(ids[k], world_size) == rank)
        todo_positions = store.plan(ids, [s.source for s in samples])
        todo = [samples[k] for k in todo_positions]
        skipped = len(
            {ids[k] for k in range(len(ids)) if ids[k] in done_before and _mine(ids[k], rank, world_size)}
        )
        summary = ExtractSummary(
            out=str(out),
            model=model,
            rank=rank,
            world_size=world_size,
            total=len(samples),
            assigned=assigned,
            skipped=skipped,
            extracted=0,
            failed=store.num_errors,  # duplicates recorded by plan()
            features=list(spec.names),
        )
        errors: Counter[str] = Counter({"duplicate id": store.num_errors} if store.num_errors else {})
        bar = _Progress(progress, len(todo), f"extract r{rank}" if world_size > 1 else "extract")
        try:
            _run(
                todo,
                store,
                loaded,
                spec,
                cfg,
                budget,
                workers,
                summary,
                errors,
                bar,
                max_errors,
                _forward_hook,
            )
        finally:
            bar.close()
            summary.errors = dict(errors)
            summary.failed = store.num_errors
            summary.seconds = time.perf_counter() - started
            cpu_now = _cpu_seconds()
            if cpu_now is not None and cpu_started is not None:
                summary.cpu_seconds = cpu_now - cpu_started
    return summary


def _owner(sample_id: str, world_size: int) -> int:
    from vlfast.extraction.store import owner_rank

    return owner_rank(sample_id, world_size)


def _mine(sample_id: str, rank: int, world_size: int) -> bool:
    return world_size == 1 or _owner(sample_id, world_size) == rank


def _pixels_to(x: torch.Tensor, device: torch.device, cfg: ProcessorConfig) -> torch.Tensor:
    """A sample's pixel_values as float32 (N, C*T*P*P) on ``device``. To CUDA the copy starts from pinned
    memory, so ``non_blocking`` really overlaps it (from pageable memory it would be synchronous); the
    DataLoader pins what its workers send, and anything unpinned is pinned here. Video patches arrive as
    uint8 and are normalised after the copy, on the device: a quarter of the bytes cross the bus."""
    if device.type == "cuda" and not x.is_pinned():
        x = x.pin_memory()
    x = x.to(device, non_blocking=True)
    return normalize_video_patches(x, cfg) if x.dtype == torch.uint8 else x


def _run(
    todo: list[Sample],
    store,
    loaded: _Model,
    spec: FeatureSpec,
    cfg: ProcessorConfig,
    budget: TokenBudget,
    workers: int,
    summary: ExtractSummary,
    errors: Counter,
    bar: _Progress,
    max_errors: int | None,
    forward_hook: Callable | None,
) -> None:
    if not todo:
        return
    image_dir = None if loaded.spec.startswith("ref:") else loaded.spec
    # Workers send videos as uint8 patches, normalised here (on the device when there is one).
    pre = Preprocessor(cfg, image_processor_dir=image_dir, defer_video_normalize=True)
    if any(s.kind == "image" for s in todo):
        pre.image_processor()  # import and build it once here, so forked workers inherit it
    prompts = None
    token_ids: dict[str, int] = {}
    if spec.needs_llm:
        prompts = PromptBuilder(loaded.spec, loaded.family, cfg.merge_size, cfg.temporal_patch_size)
        tok = prompts.tokenizer()
        token_ids = {
            "image_token_id": int(tok.convert_tokens_to_ids("<|image_pad|>")),
            "video_token_id": int(tok.convert_tokens_to_ids("<|video_pad|>")),
            "pad_token_id": int(tok.pad_token_id if tok.pad_token_id is not None else 0),
        }
    dataset = _SampleDataset(todo, pre, prompts, spec.prompt)
    cuda = loaded.device.type == "cuda"
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=None,  # one sample per item: packing by tokens happens below
        shuffle=False,
        num_workers=workers,
        pin_memory=cuda,
        worker_init_fn=_worker_init if workers > 0 else None,
        prefetch_factor=8 if workers > 0 else None,
    )

    def record_error(sample: Sample, reason: str) -> None:
        store.add_error(sample.id, sample.source, reason)
        errors[_error_kind(reason)] += 1
        bar.update(samples=1, errors=1)

    def stop_now() -> bool:
        return max_errors is not None and store.num_errors > max_errors

    def good_items() -> Iterator[dict[str, Any]]:
        for item in loader:
            if item["ok"]:
                yield item
                continue
            record_error(todo[item["i"]], item["reason"])
            if stop_now():
                summary.stopped = f"more than {max_errors} errors (--max-errors)"
                return

    def cost(item: dict[str, Any]) -> int:
        return int(item["pixel_values"].shape[0]) + int(item.get("input_ids", torch.empty(0)).numel())

    def pixels_on(item: dict[str, Any], device: torch.device) -> torch.Tensor:
        return _pixels_to(item["pixel_values"], device, cfg)

    def forward(batch: Sequence[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
        if forward_hook is not None:
            forward_hook([{**it, "pixel_values": pixels_on(it, torch.device("cpu"))} for it in batch])
        t0 = time.perf_counter()
        if spec.needs_llm:
            ready = [{**it, "pixel_values": pixels_on(it, torch.device("cpu"))} for it in batch]
            feats = compute_llm_features(
                loaded.whole, loaded.tower, ready, spec, device=loaded.device, dtype=loaded.dtype, **token_ids
            )
        else:
            pixels = torch.cat([pixels_on(it, loaded.device) for it in batch])
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
        summary.compute_seconds += time.perf_counter() - t0
        return feats

    def on_oom(n: int) -> None:
        summary.oom_splits += 1

    for batch in pack(good_items(), cost, budget, first_alone=True):
        results = run_split_on_oom(batch, forward, on_oom=on_oom)
        for item, result in zip(batch, results):
            sample = todo[item["i"]]
            if isinstance(result, Failed):
                record_error(sample, f"out of memory even alone ({cost(item)} tokens): {result.error}")
                continue
            meta = {
                "path": sample.source,
                "kind": sample.kind,
                "n_tokens": int(item["tokens"]),
                **item["meta"],
            }
            store.add(sample.id, result, meta)
            summary.extracted += 1
            summary.tokens += int(item["pixel_values"].shape[0])
            bar.update(samples=1, tokens=int(item["pixel_values"].shape[0]))
        if stop_now():
            summary.stopped = summary.stopped or f"more than {max_errors} errors (--max-errors)"
            break
