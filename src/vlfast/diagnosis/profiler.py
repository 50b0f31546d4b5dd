"""``vlfast.profile``: where a vision tower's forward time goes, before and after the GEMM patch.

Components are the tower's direct children, labelled by name (:data:`COMPONENTS`), ModuleList items timed
one by one, by hooks that mark a :class:`~vlfast.diagnosis.timing.Clock` (no synchronisation inside the
forward). What the tower does inline in ``forward`` is ``other (inline)`` = forward - sum(components).
Unpatched and patched run alternately in each round, so load changes hit both alike.
"""

from __future__ import annotations

import inspect
import math
import os
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlfast.diagnosis.facts import cpu_facts, device_and_dtype
from vlfast.diagnosis.timing import Clock, measure
from vlfast.errors import InputRefused
from vlfast.patching.gemm import is_patched, patch, patched_modules, unpatch

__all__ = ["COMPONENTS", "ProfileReport", "ProfileRun", "component_modules", "profile", "time_components"]

SCHEMA = "vlfast.profile/2"
INLINE = "other (inline)"
# A ratio whose per-round values spread wider than this ((max - min) / median) is flagged unreliable:
# on a shared CPU one busy neighbour moves single forwards by 2-8x.
UNRELIABLE_SPREAD = 0.25

# (label, regular expression over the name of a direct child of the tower). First match wins.
COMPONENTS: tuple[tuple[str, str], ...] = (
    ("patch_embed", r"patch_embed"),
    ("position_embedding", r"^(pos_embed|embeddings|position_embedding|pos_emb)$"),
    ("rotary_embedding", r"rotary"),
    ("blocks", r"^(blocks|layers|layer)$"),
    ("deepstack_mergers", r"deepstack"),
    ("merger", r"^merger$"),
)

DEFAULT_SIZE = {"cuda": (384, 512), "cpu": (224, 224)}  # (h, w) pixels; 384x512 x 8 frames = 3,072 patches
# Frames per clip when none are given: 8 on GPU; 2 on CPU, where one fp32 forward of Qwen3-VL-4B's tower
# on 8 frames of 224x224 takes ~15 s on a 2-core CPU, so 3 rounds of it would not fit in a minute.
DEFAULT_FRAMES = {"cuda": 8, "cpu": 2}
MIN_ROUNDS = 3  # timed rounds below which a speedup is unreliable, whatever its spread


def component_modules(tower: nn.Module) -> list[tuple[str, str, nn.Module]]:
    """``(label, item, module)`` for every timed part of ``tower``, in module order."""
    out: list[tuple[str, str, nn.Module]] = []
    for name, child in tower.named_children():
        label = next((lab for lab, rx in COMPONENTS if re.search(rx, name)), name)
        if isinstance(child, nn.ModuleList):
            out += [(label, f"{name}.{i}", item) for i, item in enumerate(child)]
        else:
            out.append((label, name, child))
    return out


@dataclass
class ProfileRun:
    """Medians of one configuration: a tower forward on ``batch`` clips of ``frames`` frames."""

    patched: bool
    batch: int
    frames: int
    grid: tuple[int, int, int]  # (t, h, w) in patches, per clip
    patches: int  # in the whole batch
    forward_ms: float  # with hooks
    plain_forward_ms: float | None  # without hooks
    components: dict[str, float]  # label -> ms (median over runs)
    items: dict[str, float]  # "blocks.3" -> ms
    inline_ms: float  # median over runs of forward - sum(components)
    repeats: int
    vlm_forward_ms: float | None = None  # the whole VLM on the same clips (checkpoints only)
    vlm_error: str | None = None
    forward_spread: float | None = None  # (max - min) / median of the hooked forwards
    # Per round (aligned with the other run of the pair): hooked forward and component times.
    rounds_forward_ms: list[float] = field(default_factory=list)
    rounds_components: list[dict[str, float]] = field(default_factory=list)

    @property
    def timed_ms(self) -> float:
        """What the shares divide: the components' medians plus the inline rest (so shares sum to 1)."""
        return sum(self.components.values()) + max(0.0, self.inline_ms)

    @property
    def shares(self) -> dict[str, float]:
        total = self.timed_ms or float("nan")
        out = {k: v / total for k, v in self.components.items()}
        out[INLINE] = max(0.0, self.inline_ms) / total
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "patched": self.patched,
            "batch": self.batch,
            "frames": self.frames,
            "grid_thw": list(self.grid),
            "patches": self.patches,
            "forward_ms": self.forward_ms,
            "plain_forward_ms": self.plain_forward_ms,
            "components_ms": dict(self.components),
            "inline_ms": self.inline_ms,
            "shares": self.shares,
            "timed_ms": self.timed_ms,
            "forward_spread": self.forward_spread,
            "items_ms": dict(self.items),
            "repeats": self.repeats,
            "vlm_forward_ms": self.vlm_forward_ms,
            "vlm_error": self.vlm_error,
        }


@dataclass
class ProfileReport:
    target: str
    device: str
    dtype: str
    size: tuple[int, int]
    runs: list[ProfileRun] = field(default_factory=list)
    torch_version: str = torch.__version__
    notes: list[str] = field(default_factory=list)
    touched: list[str] = field(default_factory=list)  # component labels holding a patched conv
    load: tuple[float | None, float | None] = (None, None)  # 1-min load average at start, end
    cpus: int | None = os.cpu_count()
    omp_wait_policy: str | None = None

    def comparison(self, before: ProfileRun, after: ProfileRun) -> dict[str, dict[str, Any]]:
        """Per component and for the forward: did the patch change it, by how much, how reliably.

        A component with no patched conv is unchanged by construction (the patch is exact): its ratio is
        noise, never a speedup. A changed one's speedup is the median of the per-round ratios; it is not
        ``reliable`` when they spread wider than ``UNRELIABLE_SPREAD``, fewer than ``MIN_ROUNDS`` ran, or
        it and the medians disagree on which side is faster (``agrees_with_medians``).
        """
        out: dict[str, dict[str, Any]] = {}
        parts = list(dict.fromkeys([*before.components, *after.components]))
        series = {
            p: ([r.get(p) for r in before.rounds_components], [r.get(p) for r in after.rounds_components])
            for p in parts
        }
        series["forward"] = (before.rounds_forward_ms, after.rounds_forward_ms)
        medians = {p: (before.components.get(p), after.components.get(p)) for p in parts}
        medians["forward"] = (before.forward_ms, after.forward_ms)
        for part, (bs, as_) in series.items():
            ratios = [b / a for b, a in zip(bs, as_) if b and a]
            changed = part == "forward" or part in self.touched
            med = statistics.median(ratios) if ratios else None
            spread = _spread(ratios)
            of_medians = _ratio(*medians[part])
            # Which side is faster, by the ratios and by the medians the table shows: 1 counts as either.
            agrees = med is None or of_medians is None or (med - 1) * (of_medians - 1) >= 0
            out[part] = {
                "changed": changed,
                "speedup": med if changed else None,
                "measured_ratio": med,
                "medians_ratio": of_medians,
                "agrees_with_medians": agrees,
                "spread": spread,
                "rounds": len(ratios),
                "reliable": spread is not None
                and spread <= UNRELIABLE_SPREAD
                and len(ratios) >= MIN_ROUNDS
                and agrees,
            }
        return out

    def pairs(self) -> list[tuple[ProfileRun | None, ProfileRun | None]]:
        """(before, after) per configuration."""
        keys = sorted({(r.batch, r.frames) for r in self.runs})
        find = {(r.batch, r.frames, r.patched): r for r in self.runs}
        return [(find.get((*k, False)), find.get((*k, True))) for k in keys]

    def to_dict(self) -> dict[str, Any]:
        speedups = []
        for before, after in self.pairs():
            if before and after:
                cmp = self.comparison(before, after)
                speedups.append(
                    {
                        "batch": before.batch,
                        "frames": before.frames,
                        "forward_speedup": cmp["forward"]["speedup"],
                        "patch_embed_speedup": cmp.get("patch_embed", {}).get("speedup"),
                        "vlm_speedup": _ratio(before.vlm_forward_ms, after.vlm_forward_ms),
                        "components": cmp,
                        "reliable": all(v["reliable"] for v in cmp.values() if v["changed"]),
                    }
                )
        return {
            "schema": SCHEMA,
            "target": self.target,
            "device": self.device,
            "dtype": self.dtype,
            "frame_size": list(self.size),
            "torch_version": self.torch_version,
            "runs": [r.to_dict() for r in self.runs],
            "speedups": speedups,
            "touched_components": list(self.touched),
            "load_average": {"start": self.load[0], "end": self.load[1], "cpus": self.cpus},
            "omp_wait_policy": self.omp_wait_policy,
            "notes": list(self.notes),
        }

    def plot(self, path: str | Path) -> Path:
        """A PNG with one stacked bar per run (components in ms). Needs the ``plot`` extra."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError("the profile chart needs matplotlib: pip install 'vlfast[plot]'") from None
        path = Path(path)
        labels = [f"b{r.batch} f{r.frames} {'after' if r.patched else 'before'}" for r in self.runs]
        parts = list(dict.fromkeys(k for r in self.runs for k in r.components)) + [INLINE]
        fig, ax = plt.subplots(figsize=(9, 0.5 * len(self.runs) + 1.8))
        left = [0.0] * len(self.runs)
        cmap = plt.get_cmap("tab10")
        for i, part in enumerate(parts):
            vals = [
                max(0.0, r.inline_ms if part == INLINE else r.components.get(part, 0.0)) for r in self.runs
            ]
            ax.barh(labels, vals, left=left, label=part, color=cmap(i % 10))
            left = [a + b for a, b in zip(left, vals)]
        ax.invert_yaxis()
        ax.set_xlabel("ms per forward (median)")
        ax.set_title(f"{self.target} on {self.device} ({self.dtype}): vision tower forward by component")
        ax.legend(fontsize=8, loc="best")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _spread(values: list[float]) -> float | None:
    med = statistics.median(values) if values else 0
    return (max(values) - min(values)) / med if med else None


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _grid(spec, frames: int, size: tuple[int, int]) -> tuple[int, int, int]:
    """Patch grid of one clip as the Qwen-VL processors make it: frames padded to a multiple of T, sides
    rounded down to a multiple of patch * merge (at least one merge window)."""
    t = max(1, math.ceil(frames / spec.temporal_patch_size))
    unit = spec.patch_size * spec.spatial_merge_size
    h, w = (max(1, s // unit) * spec.spatial_merge_size for s in size)
    return (t, h, w)


class _Hooks:
    """Forward pre/post hooks that mark a clock around each component call."""

    # A forward running longer says how far it got as components end: an emulated-bf16 CPU forward can
    # take minutes, and a run killed then should say where it was.
    HEARTBEAT_S = 10.0

    def __init__(self, parts: list[tuple[str, str, nn.Module]]) -> None:
        self.clock: Clock | None = None
        self.say: Callable[[str], None] | None = None
        self.started = self.last_said = 0.0
        self.open: dict[str, int] = {}
        self.intervals: list[tuple[str, str, int, int]] = []
        self.handles = []
        for label, item, module in parts:
            self.handles.append(module.register_forward_pre_hook(self._pre(item)))
            self.handles.append(module.register_forward_hook(self._post(label, item)))

    def _pre(self, item: str):
        def hook(module, args):
            if self.clock is not None:
                self.open[item] = self.clock.mark()

        return hook

    def _post(self, label: str, item: str):
        def hook(module, args, output):
            if self.clock is not None and item in self.open:
                self.intervals.append((label, item, self.open.pop(item), self.clock.mark()))
                now = time.perf_counter()
                if self.say is not None and now - self.last_said >= self.HEARTBEAT_S:
                    self.last_said = now
                    self.say(f"{item} done, {now - self.started:,.0f} s into this forward")

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _one_run(tower: nn.Module, hooks: _Hooks, inputs: tuple, device: str):
    clock = Clock(device)
    hooks.clock, hooks.open, hooks.intervals = clock, {}, []
    hooks.started = hooks.last_said = time.perf_counter()
    start = clock.mark()
    tower(*inputs)
    end = clock.mark()
    clock.finish()
    hooks.clock = None
    total = clock.elapsed_ms(start, end)
    labels: dict[str, float] = {}
    items: dict[str, float] = {}
    for label, item, a, b in hooks.intervals:
        ms = clock.elapsed_ms(a, b)
        labels[label] = labels.get(label, 0.0) + ms
        items[item] = items.get(item, 0.0) + ms
    return total, labels, items


def time_components(
    tower: nn.Module, inputs: tuple, device: str | torch.device
) -> tuple[float, dict[str, float], dict[str, float]]:
    """One forward ``tower(*inputs)`` under ``torch.inference_mode``, timed whole and by component as
    :func:`profile` times a round: ``(forward ms, label -> ms, item -> ms)``. For callers that decide what
    changes between forwards themselves (a benchmark's variants)."""
    hooks = _Hooks(component_modules(tower))
    try:
        with torch.inference_mode():
            return _one_run(tower, hooks, tuple(inputs), str(device))
    finally:
        hooks.remove()


def _median_dict(dicts: list[dict[str, float]]) -> dict[str, float]:
    keys = list(dict.fromkeys(k for d in dicts for k in d))
    return {k: float(statistics.median(d.get(k, 0.0) for d in dicts)) for k in keys}


def _vlm_inputs(vlm: nn.Module, tower: nn.Module, pixels: torch.Tensor, grid: torch.Tensor, clips):
    """Candidate keyword sets for a full VLM forward on synthetic clips: video tokens in one vision
    start/end group per temporal patch (Qwen3-VL's timestamped layout), else per clip (Qwen2/2.5-VL)."""
    config = vlm.config
    merge = int(getattr(tower.config, "spatial_merge_size", 2))
    start, end = getattr(config, "vision_start_token_id", None), getattr(config, "vision_end_token_id", None)
    video = getattr(config, "video_token_id", None)
    if video is None or start is None or end is None:
        raise InputRefused(f"{type(config).__name__} has no video_token_id / vision_start_token_id")
    params = inspect.signature(vlm.forward).parameters
    for per_frame in (True, False):
        rows = []
        for t, h, w in clips:
            per = h * w // merge**2
            groups = [per] * t if per_frame else [per * t]
            ids = [1]
            for n in groups:
                ids += [start] + [video] * n + [end]
            rows.append(ids + [2, 3])
        width = max(len(r) for r in rows)
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows], device=pixels.device)  # left padding
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=pixels.device)
        kw = {"input_ids": ids, "attention_mask": mask, "pixel_values_videos": pixels, "video_grid_thw": grid}
        if "mm_token_type_ids" in params:
            kw["mm_token_type_ids"] = (ids == video).int() * 2  # 0 text, 1 image, 2 video
        yield kw


def _set_patched(scope: nn.Module, patched: bool) -> None:
    (patch if patched else unpatch)(scope)


def _profile_config(
    tower, scope, vlm, batch, frames, deadline, say, *, size, device, dtype, warmup, repeats, seed
):
    """(before, after) for one configuration in alternating rounds, cut to what fits before ``deadline``
    (``time.perf_counter()`` seconds; at least one timed round)."""
    from vlfast.models import synthetic_inputs, tower_spec

    clip = _grid(tower_spec(tower), frames, size)
    inputs = synthetic_inputs(tower, [clip] * batch, dtype=dtype, device=device, seed=seed)
    runs, round_s = _hooked_rounds(tower, scope, inputs, device, warmup, repeats, deadline, say)
    plain = _plain_rounds(tower, scope, inputs, device, len(runs[False]), round_s, deadline, say)
    results = [
        _run_of(patched, runs[patched], plain[patched], batch, frames, clip, inputs[0])
        for patched in (False, True)
    ]
    if vlm is not None:
        _time_vlm(results, scope, vlm, tower, *inputs, [clip] * batch, device, warmup, repeats)
    return results[0], results[1]


def _hooked_rounds(tower, scope, inputs, device, warmup, repeats, deadline, say) -> tuple[dict, float]:
    """({patched: [(forward ms, label -> ms, item -> ms) per timed round]}, the last round's seconds)."""
    runs: dict[bool, list] = {False: [], True: []}
    hooks = _Hooks(component_modules(tower))
    round_s = 0.0
    try:
        with torch.inference_mode():
            r = 0
            while r < warmup + repeats:  # not range(): a whole-number float (2.0) counts as before
                timed = r >= warmup
                if (
                    timed
                    and deadline is not None
                    and runs[False]
                    and time.perf_counter() + round_s > deadline
                ):
                    break  # the next round would not fit: what ran is the measurement
                t0 = time.perf_counter()
                what = f"round {r - warmup + 1}/{repeats}" if timed else f"warm-up {r + 1}/{warmup}"
                done = {}
                for patched in (False, True):
                    _set_patched(scope, patched)
                    hooks.say = lambda line, p=patched, w=what: say(
                        f"{w}, {'after' if p else 'before'}: {line}"
                    )
                    done[patched] = _one_run(tower, hooks, inputs, device)
                    if timed:
                        runs[patched].append(done[patched])
                hooks.say = None
                round_s = time.perf_counter() - t0
                say(f"{what}: before {done[False][0]:,.0f} ms, after {done[True][0]:,.0f} ms")
                r += 1
                if not timed and deadline is not None and time.perf_counter() + round_s > deadline:
                    # No timed round fits after this warm-up: it is the only measurement (one round,
                    # first calls included, so the report says it is not a result).
                    for patched in (False, True):
                        runs[patched].append(done[patched])
                    say("no timed round fits in the budget: the warm-up round is the measurement")
                    break
    finally:
        hooks.remove()
    return runs, round_s


def _plain_rounds(tower, scope, inputs, device, rounds, round_s, deadline, say) -> dict[bool, list[float]]:
    """The same forwards without hooks, so that the hooks' own cost shows."""
    plain: dict[bool, list[float]] = {False: [], True: []}
    with torch.inference_mode():
        for i in range(rounds):
            if deadline is not None and time.perf_counter() + round_s > deadline:
                break
            for patched in (False, True):
                _set_patched(scope, patched)
                plain[patched].append(
                    measure(lambda: tower(*inputs), device=device, warmup=0, repeats=1).times_ms[0]
                )
            say(
                f"without hooks {i + 1}/{rounds}: before {plain[False][-1]:,.0f} ms, after {plain[True][-1]:,.0f} ms"
            )
    return plain


def _run_of(patched, rs, plain, batch, frames, clip, pixels) -> ProfileRun:
    return ProfileRun(
        patched=patched,
        batch=batch,
        frames=frames,
        grid=clip,
        patches=int(pixels.shape[0]),
        forward_ms=float(statistics.median(r[0] for r in rs)),
        plain_forward_ms=float(statistics.median(plain)) if plain else None,
        components=_median_dict([r[1] for r in rs]),
        items=_median_dict([r[2] for r in rs]),
        inline_ms=float(statistics.median(total - sum(labels.values()) for total, labels, _ in rs)),
        repeats=len(rs),
        forward_spread=_spread([r[0] for r in rs]),
        rounds_forward_ms=[float(r[0]) for r in rs],
        rounds_components=[dict(r[1]) for r in rs],
    )


def _time_vlm(results, scope, vlm, tower, pixels, grid_thw, clips, device, warmup, repeats) -> None:
    """The whole VLM forward on the same clips, before and after alternately; failures go to ``vlm_error``."""
    errors = []
    try:
        for kw in _vlm_inputs(vlm, tower, pixels, grid_thw, clips):
            times: dict[bool, list[float]] = {False: [], True: []}
            try:
                with torch.inference_mode():
                    for r in range(warmup + repeats):
                        for patched in (False, True):
                            _set_patched(scope, patched)
                            ms = measure(
                                lambda kw=kw: vlm(**kw), device=device, warmup=0, repeats=1
                            ).times_ms[0]
                            if r >= warmup:
                                times[patched].append(ms)
            except (RuntimeError, ValueError, IndexError) as e:
                errors.append(f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
                continue
            for run in results:
                run.vlm_forward_ms = float(statistics.median(times[run.patched]))
            return
    except ValueError as e:
        errors.append(str(e))
    for run in results:
        run.vlm_error = "; ".join(errors) or "no input layout worked"


def _load_model(model: nn.Module | str | None, device: str, dtype: torch.dtype, tiny: bool, whole: bool):
    """(target label, tower, whole VLM or None)."""
    from vlfast import models

    if model is None:
        model = models.REF_PREFIX + models.DEFAULT_REFERENCE
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if isinstance(model, nn.Module):
        try:
            name, tower = models.find_vision_tower(model)
        except ValueError:
            name, tower = "", model
        return type(model).__name__, tower, (model if name else None)
    if isinstance(model, str):
        if models.ModelRef.of(model).is_reference:
            tower = models.build_reference(model, tiny=tiny, device=device, dtype=dtype)
            return model + (" (tiny)" if tiny else ""), tower, None
        models.vision_config_of(model)  # a text-only checkpoint is refused before any weight loads
        if not whole:  # only the tower's weights are read
            return model, models.load_vision_tower(model, device=device, dtype=dtype), None
        vlm = models.load_model(model, device=device, dtype=dtype)
        _, tower = models.find_vision_tower(vlm)
        return model, tower, vlm
    raise InputRefused(
        f"profile(model=...) takes an nn.Module, a spec string (ref:NAME or a checkpoint dir) or None, "
        f"got {type(model).__name__}"
    )


def profile(
    model: nn.Module | str | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    batch_sizes: Sequence[int] = (1,),
    frames: Sequence[int] | None = None,
    size: tuple[int, int] | None = None,
    warmup: int = 1,
    repeats: int = 3,
    tiny: bool = False,
    vlm: bool = True,
    seed: int = 0,
    budget_s: float | None = None,
    progress: Callable[[str], None] | None = None,
    on_pair: Callable[[ProfileReport, ProfileRun, ProfileRun], None] | None = None,
) -> ProfileReport:
    """Per-component time of a vision tower forward, before and after :func:`vlfast.patch`.

    ``model``: ``ref:NAME`` (default ``ref:qwen3-vl-4b``), a checkpoint directory (the whole VLM forward
    is timed too, unless ``vlm=False``) or an ``nn.Module`` (a tower or a VLM holding one). Every (batch
    size, frames) combination is profiled. ``budget_s`` (building the model not counted) is shared between
    them; None: ``warmup`` + ``repeats`` rounds, however long. ``progress`` gets a line per round,
    ``on_pair`` each (before, after) as measured. The model's patch state is restored afterwards.
    """
    _refuse_arguments(budget_s, warmup, repeats, frames, batch_sizes)
    param = next(model.parameters(), None) if isinstance(model, nn.Module) else None
    if param is not None:  # a module given as is runs where it lives, in its own dtype
        device = param.device if device is None else device
        dtype = param.dtype if dtype is None else dtype
    # On CPU: bf16 only where the CPU computes it natively, or a warning that it is emulated.
    dev, dt_name, choice = device_and_dtype(device, dtype, cpu_facts)
    dt = getattr(torch, dt_name)
    kind = torch.device(dev).type
    frames = tuple(frames) if frames is not None else (DEFAULT_FRAMES.get(kind, DEFAULT_FRAMES["cuda"]),)
    say = progress or (lambda _: None)
    size = tuple(size) if size is not None else DEFAULT_SIZE.get(kind, DEFAULT_SIZE["cuda"])
    if len(size) != 2 or min(size) < 1:
        raise InputRefused(f"size must be (height, width) in pixels, got {size}")
    target, tower, whole = _load_model(model, dev, dt, tiny, vlm)
    tower.eval()
    report = ProfileReport(target, dev, dt_name, size, omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"))
    report.load = (load_average(), None)
    report.notes += _setup_notes(choice, dtype is None, kind, report.omp_wait_policy, say)
    scope = whole if whole is not None and vlm else tower
    before_names = {n for n, _ in patched_modules(scope)}
    patch(scope)
    report.touched = list(dict.fromkeys(label for label, _, m in component_modules(tower) if is_patched(m)))
    if not is_patched(tower):
        report.notes.append("nothing to patch in this tower: 'after' equals 'before'")
    try:
        kw = {"size": size, "device": dev, "dtype": dt, "warmup": warmup, "repeats": repeats, "seed": seed}
        _profile_configs(
            report, tower, scope, whole if vlm else None, batch_sizes, frames, budget_s, say, on_pair, **kw
        )
    finally:
        unpatch(scope)
        if before_names:
            patch(scope, filter=lambda name, m: name in before_names)
    report.load = (report.load[0], load_average())
    report.notes += _inconclusive_notes(report)
    return report


def _setup_notes(choice, default: bool, kind: str, omp_wait_policy: str | None, say) -> list[str]:
    notes = []
    if choice is not None and choice.warning:
        notes.append(choice.warning)
        say(f"warning: {choice.warning}")
    elif choice is not None and default:
        notes.append(f"dtype {choice.dtype} ({choice.reason})")
    if kind == "cpu" and (omp_wait_policy or "").upper() != "PASSIVE":
        notes.append(
            "OMP_WAIT_POLICY is not PASSIVE: idle OpenMP threads spin, and beside a busy process single "
            "forwards slow by several x. The vlfast command sets it; in Python, set it before torch loads."
        )
    return notes


def _refuse_arguments(budget_s, warmup, repeats, frames, batch_sizes) -> None:
    if budget_s is not None and budget_s <= 0:
        raise InputRefused(f"budget_s must be positive, got {budget_s}")
    if warmup < 0 or repeats < 1:
        raise InputRefused(f"need warmup >= 0 and repeats >= 1, got {warmup}, {repeats}")
    if frames is not None and (not frames or min(frames) < 1):
        raise InputRefused(f"frame counts must be positive, got {frames}")
    if not batch_sizes or min(batch_sizes) < 1:
        raise InputRefused(f"batch sizes must be positive, got {batch_sizes}")


def _profile_configs(report, tower, scope, vlm, batch_sizes, frames, budget_s, say, on_pair, **kw) -> None:
    """Every (batch, frames) configuration, each given an equal share of what the earlier ones left."""
    configs = [(b, f) for b in batch_sizes for f in frames]
    start = time.perf_counter()
    pairs = []
    for i, (b, f) in enumerate(configs):
        deadline = None
        if budget_s is not None:
            left = budget_s - (time.perf_counter() - start)
            deadline = time.perf_counter() + max(0.0, left) / (len(configs) - i)
        where = f"[{i + 1}/{len(configs)}] batch {b} x {f} frames"

        def tell(line: str, where: str = where) -> None:
            say(f"{where}: {line}")

        tell(f"timing {report.target} on {report.device} ({report.dtype}), before and after patching")
        before, after = _profile_config(tower, scope, vlm, b, f, deadline, tell, **kw)
        pairs.append((before, after))
        if before.repeats < min(kw["repeats"], MIN_ROUNDS):
            report.notes.append(
                f"batch {b} x {f} frames: only {before.repeats} timed round(s) fit in the budget "
                f"({budget_s:g} s): not a result; raise --budget or lower --frames / --size"
            )
        if on_pair is not None:
            on_pair(report, before, after)
    report.runs = [before for before, _ in pairs] + [after for _, after in pairs]


def _inconclusive_notes(report: ProfileReport) -> list[str]:
    notes = []
    load = "unknown" if report.load[1] is None else f"{report.load[1]:.2f}"
    for before, after in report.pairs():
        if before and after:
            bad = [  # fewer than MIN_ROUNDS rounds has its own note
                k
                for k, v in report.comparison(before, after).items()
                if v["changed"] and v["rounds"] >= MIN_ROUNDS and not v["reliable"]
            ]
            if bad:
                notes.append(
                    f"batch {before.batch} x {before.frames} frames: inconclusive for {', '.join(bad)}: the "
                    f"per-round ratios spread more than {UNRELIABLE_SPREAD:.0%} or disagree with the medians on "
                    f"which side is faster (load average {load}, {report.cpus} CPUs); run "
                    "again on a quieter machine or with more --repeats."
                )
    return notes
