"""What a run will do, decided before a lock is taken or a model is built: :class:`RunPlan`.

The input listed (bad rows become error records), the run configuration (run.json, hashed into every shard:
see docs/extract.md) with the weights' fingerprint, a read-only check of OUT (a different configuration is
refused, a finished OUT answered "nothing to do"), and this rank's share of the entries. The planning of a
rank's work lives here and only here: the pure rule is ``store.resume.plan_positions``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vlfast.errors import InputRefused
from vlfast.extraction.config import ExtractConfig, ExtractSummary
from vlfast.extraction.model.spec import FeatureSpec
from vlfast.extraction.sources.kept import KeptListings
from vlfast.extraction.sources.listing import load_inputs
from vlfast.extraction.sources.sample import InputProblem, Sample
from vlfast.extraction.sources.table import SampleTable
from vlfast.extraction.store.facts import ModelFacts
from vlfast.extraction.store.out import Out
from vlfast.models.ref import ModelRef, family_of
from vlfast.pixels.engine import build_processor_config
from vlfast.pixels.settings import IMAGE_BACKENDS, ProcessorConfig, with_video_wrapper

__all__ = ["RUNTIME_KEY", "RunPlan", "check_retry_kinds", "make_plan", "problem_record"]

RUNTIME_KEY = "runtime"  # run-config entries that may change on resume (how, not what, is computed)


def problem_record(problem: InputProblem) -> tuple[str, str, str]:
    """(id, source, reason) of a bad input row's error record; a row without a usable id is named by where
    it is."""
    return problem.id or problem.where, problem.where, problem.reason


def check_retry_kinds(retry: Collection[str], recorded: Collection[tuple]) -> None:
    """Refuse ``--retry-errors`` kinds that select nothing (a misspelt one would answer "nothing to do"):
    each must be "all", a record kind or the reason class of a failure OUT records (``recorded``: its
    records' (id, source, reason, kind))."""
    import difflib

    from vlfast.extraction.store.format import (
        DUPLICATE_KIND,
        ERROR_KIND,
        INPUT_KIND,
        TRANSIENT_KIND,
        reason_kind,
    )

    kinds = {"all", ERROR_KIND, TRANSIENT_KIND}
    never = sorted(set(retry) & {DUPLICATE_KIND, INPUT_KIND})
    if never:
        raise InputRefused(
            f"--retry-errors (retry_errors) {', '.join(never)}: a repeated id or a bad input row is no failure "
            "of a sample and is never retried; fix the input instead"
        )
    asked = set(retry) - kinds
    if not asked:
        return
    classes = {reason_kind(r[2]) for r in recorded if r[3] not in (DUPLICATE_KIND, INPUT_KIND)}
    unknown = sorted(asked - classes)
    if not unknown:
        return
    hints = [
        f"{k!r}: did you mean {close[0]!r}?"
        for k in unknown
        if (close := difflib.get_close_matches(k, [*sorted(kinds), *sorted(classes)], n=1, cutoff=0.6))
    ]
    shown = sorted(classes)[:10]
    held = (
        f"the reason classes of the failures it records: {', '.join(map(repr, shown))}"
        + (f" and {len(classes) - len(shown)} more" if len(classes) > len(shown) else "")
        if classes
        else "it records no failure"
    )
    raise InputRefused(
        f"--retry-errors (retry_errors) {', '.join(map(repr, unknown))} selects no failure OUT could hold: give "
        f"'all', a kind ({ERROR_KIND}, {TRANSIENT_KIND}) or the reason class of a failure OUT records; {held}"
        + (f". {' '.join(hints)}" if hints else "")
    )


@dataclass
class RunPlan:
    """Everything ``extract`` decides before OUT is locked; the engines run it."""

    out: Any  # resolved: a Path, or a UPath carrying its storage options
    samples: SampleTable  # a sequence of Sample given here is made a table
    problems: list[InputProblem]
    rank: int
    world_size: int
    family: str
    processor: ProcessorConfig
    run_config: dict[str, Any]
    volatile_keys: tuple[str, ...]
    fingerprint_seconds: float = 0.0
    listings: dict[str, bytes] = field(default_factory=dict, repr=False)  # shard listings for OUT to keep
    facts: ModelFacts | None = field(default=None, repr=False)  # what transformers answered (store.facts)
    # Committed ids of this rank whose input changed since: the store moves their shards aside, to redo
    changed: list[str] = field(default_factory=list)
    store: Out | None = field(default=None, repr=False)  # OUT as opened for this run (else made of ``out``)
    mine_problems: list[InputProblem] = field(init=False)
    total: int = field(init=False)  # entries in the input (all ranks)
    assigned: int = field(init=False)  # this rank's share of them

    _column: Any = field(init=False, repr=False, default=None)  # the ids as Arrow, once work() needs them
    _hashes: Any = field(init=False, repr=False, default=None)  # and their hashes
    _unique: Any = field(init=False, repr=False, default=None)  # first copies and repeats: done-independent
    _todo: Any = field(init=False, repr=False, default=None)  # positions left, while the preflight needs them

    def __post_init__(self) -> None:
        from vlfast.extraction.store.resume import owned, owner_rank

        self.samples = SampleTable.of(self.samples)
        if self.store is None:
            self.store = Out(self.out)
        rank, world = self.rank, self.world_size
        self.mine_problems = [
            p for p in self.problems if world == 1 or owner_rank(problem_record(p)[0], world) == rank
        ]
        self.total = self.samples.listed + len(self.problems)
        if self.world_size > 1:
            # Only this rank's share is kept (a repeated id's copies share one owner).
            self.samples = self.samples.own(np.flatnonzero(owned(self.ids, self.rank, self.world_size)))
        self.assigned = len(self.samples) + len(self.mine_problems)

    @property
    def ids(self) -> Sequence[str]:
        """The input's ids in order, read from the table's column a chunk at a time."""
        from vlfast.extraction.ids import ArrowStrings

        return ArrowStrings(self.samples.ids)

    def work(
        self, done: Collection[str], *, keep_positions: bool = False
    ) -> tuple[SampleTable, list[tuple[str, str, str, str]]]:
        """This rank's samples still to extract, and the error records its entries call for (a repeated
        id, a bad input row): (id, source, reason, kind) each. ``keep_positions``: keep the positions of
        what is left too, for the preflight's check of the inputs of what is done."""
        from vlfast.extraction.ids import hash_ids
        from vlfast.extraction.store.format import DUPLICATE_KIND, INPUT_KIND
        from vlfast.extraction.store.resume import duplicate_reason, plan_positions, unique_positions

        if self._column is None:  # made once: the preflight and the engine both plan
            self._column = self.ids  # the table's own column: no copy
            self._hashes = hash_ids(self._column.array)
            every = np.ones(len(self.samples), bool)  # the table holds this rank's entries alone
            self._unique = unique_positions(self._column.array, self._hashes, every)
        todo, repeats = plan_positions(
            self._column, self.rank, self.world_size, done, hashes=self._hashes, unique=self._unique
        )
        self._todo = todo if keep_positions else None
        entry = self.samples.entry
        records = []
        for k, first in repeats:
            s = self.samples[k]
            records.append((s.id, s.source, duplicate_reason(entry(k), entry(first)), DUPLICATE_KIND))
        records += [(*problem_record(p), INPUT_KIND) for p in self.mine_problems]
        return self.samples.take(todo), records

    def pending(
        self, done: Collection[str], is_recorded: Callable[[tuple], bool], work: tuple | None = None
    ) -> int:
        """Entries of this rank still to handle: samples to extract, repeats and bad rows not yet recorded.
        ``work``: what :meth:`work` gave for the same ``done``, when the caller has it."""
        todo, records = self.work(done) if work is None else work
        return len(todo) + sum(not is_recorded(r) for r in records)

    def summary(self, config: ExtractConfig) -> ExtractSummary:
        """The summary of a run of this plan before it starts."""
        return ExtractSummary(
            out=str(self.out),
            model=config.model,
            rank=self.rank,
            world_size=self.world_size,
            total=self.total,
            assigned=self.assigned,
            skipped=0,
            extracted=0,
            failed=0,
            features=list(config.spec.names),
            fingerprint_seconds=self.fingerprint_seconds,
        )

    def finished(self, config: ExtractConfig) -> ExtractSummary | None:
        """The "nothing to do" summary when OUT already holds all of this rank's work, read without a lock
        (the only writes are caches, skipped where OUT is read-only); None when there is work, or with
        ``overwrite``. A finished OUT gets the check a resume would (``resume_check``): what fails it is
        left to the store, which redoes it, instead of "nothing to do" over a flipped byte."""
        from vlfast.extraction.ids import IdSet
        from vlfast.extraction.store.format import release_arrow_memory
        from vlfast.extraction.store.resume import confirm_hashed, read_state

        if config.overwrite:
            return None
        state = read_state(
            self.out,
            self.run_config,
            self.volatile_keys,
            config.retry,
            rank=self.rank,
            world_size=self.world_size,
            run=self.store,
        )
        if config.retry:
            check_retry_kinds(config.retry, state.error_keys)
        work = self.work(state.done, keep_positions=True)
        pending = self.pending(state.done, state.error_keys.__contains__, work)
        del work
        # The ids are not needed past here (at ten million samples: 1.04 GiB at the peak, not 1.38 GiB).
        state.done = IdSet()
        release_arrow_memory()
        changed = self.inputs_renamed(state, config)
        self._todo = None
        if config.resume_check == "full":
            changed += self.inputs_rewritten(state, config)
            release_arrow_memory()  # the inputs files' row groups, read one at a time
        self.changed = sorted(set(changed))
        if not pending and not state.damaged and not self.changed and config.resume_check == "full":
            state.damaged = confirm_hashed(self.out, state, f"r{self.rank:05d}")
        if pending or state.damaged or self.changed:
            return None
        tag = f"r{self.rank:05d}-{os.getpid()}"
        # Like the record of full checks, caches this path writes when it can (a read-only OUT keeps none)
        self.store.keep_listings(self.listings, tag)
        if self.facts is not None:
            self.facts.save(self.out, tag)
        # A lost run.json, from the configuration the request and every part agree on: readers need it.
        self.store.restore_run_file(self.run_config, self.volatile_keys, tag)
        summary = self.summary(config)
        summary.skipped, summary.nothing_to_do = self.assigned, True
        return summary

    def inputs_renamed(self, state: Any, config: ExtractConfig) -> list[str]:
        """This rank's committed ids whose entry names another place or text than its record (docs/extract.md,
        "Inputs that change"), unless the bytes it names now are the recorded ones (hashed to tell). A row
        without a record is never changed. What is done is what ``work(..., keep_positions=True)`` left out."""
        from vlfast.extraction.decode.inputs import input_digest
        from vlfast.extraction.sources.identity import content_key, entry_keys
        from vlfast.extraction.store.inputs import Recorded, recorded_keys

        recorded = recorded_keys(self.out, state.sound)
        if not len(recorded.values):
            return []  # nothing is recorded: nothing committed, or committed without records
        texts, first = self._texts(config), self._unique[0]  # the first copy of each id (work() made it)
        suspects = []
        for at in range(0, len(first), _KEYS_AT_ONCE):
            positions = first[at : at + _KEYS_AT_ONCE]
            hashes = self._hashes[positions]
            keys = entry_keys(self.samples, texts, positions, hashes)
            suspects.append(
                positions[~Recorded.has(recorded.values, keys) & ~Recorded.has(recorded.unknown, hashes)]
            )
        del recorded
        odd = np.concatenate(suspects) if suspects else np.empty(0, np.int64)
        if len(odd) and self._todo is not None and len(self._todo):  # what is not done is extracted anyway
            at = np.searchsorted(self._todo, odd).clip(max=len(self._todo) - 1)
            odd = odd[self._todo[at] != odd]
        contents = recorded_keys(self.out, state.sound, "content").values if len(odd) else None
        changed = []
        for k in odd.tolist():
            sample = self.samples[k]
            if sample.id in state.failed:
                continue  # done by a failure record alone: nothing committed to compare
            digest = input_digest(sample)  # the same bytes elsewhere are the same input
            key = np.array([content_key(sample, texts, digest or "")], np.uint64)
            if digest is None or not Recorded.has(contents, key)[0]:
                changed.append(sample.id)
        return changed

    def inputs_rewritten(self, state: Any, config: ExtractConfig) -> list[str]:
        """The ids of the recorded local inputs this rank's entries still name whose bytes differ now
        (docs/extract.md, "Inputs that change"): each is stat'ed, one whose stamp moved hashed. One that
        cannot be read now is not called changed."""
        from vlfast.extraction.sources.identity import entry_keys
        from vlfast.extraction.store.inputs import changed_on_disk

        if not state.sound:
            return []
        first = self._unique[0]
        every = len(first) == len(self._hashes)  # no repeated id: the first copies are every entry
        keys = entry_keys(
            self.samples, self._texts(config), first, self._hashes if every else self._hashes[first]
        )
        keys.sort()
        return changed_on_disk(self.out, state.sound, keys)[0]

    @staticmethod
    def _texts(config: ExtractConfig) -> tuple[str, ...]:
        from vlfast.extraction.sources.identity import texts_used

        return texts_used(config.spec.needs_llm, config.spec.embedding)


_KEYS_AT_ONCE = 1 << 18  # entries whose keys a resume makes and looks up at a time


def make_plan(
    inputs: str | os.PathLike | Sequence[Sample], out: str | os.PathLike, config: ExtractConfig
) -> RunPlan:
    """List the input, build the run configuration and check what the model can give; reads only."""
    from vlfast.extraction.store.resume import DEFAULT_VOLATILE_KEYS, dist_info

    rank, world_size = config.rank, config.world_size
    if rank is None or world_size is None:
        env_rank, env_world = dist_info()
        rank = env_rank if rank is None else rank
        world_size = env_world if world_size is None else world_size
    # An OUT of another format is refused here, before anything is read or written (--overwrite replaces it)
    store = Out.open(out, config.storage_options, check_format=not config.overwrite)
    out = store.path
    kept = KeptListings.of_folder(store.listings_folder, rank, world_size)  # written once OUT is ours
    samples, problems = load_inputs(inputs, config.storage_options, kept)
    model_dir = ModelRef.of(config.model).spec
    # What only transformers tells, from OUT's record where it was asked under this key (store.facts)
    facts = ModelFacts(model_dir, out, read=not config.overwrite)
    family = family_of(config.model, facts)
    check_llm_request(config.model, config.spec, facts)
    recorded = None if config.overwrite else store.recorded_config()
    processor = build_processor_config(
        model_dir,
        family=family,
        fps=config.fps,
        num_frames=config.num_frames,
        min_pixels=config.min_pixels,
        max_pixels=config.max_pixels,
        video_max_pixels=config.video_max_pixels,
        exif_orientation=exif_orientation(config.exif_orientation, recorded),
        image_processor=IMAGE_BACKENDS.get(config.image_backend)
        or recorded_setting(recorded, "image_processor"),
        image_reading=recorded_setting(recorded, "image_reading"),
        video_rotation=recorded_setting(recorded, "video_rotation"),
        thin_images=recorded_setting(recorded, "thin_images"),
        facts=facts,
    )
    processor = with_video_wrapper(processor, family, config.spec.needs_llm, facts)
    from vlfast.extraction.store.fingerprint import weights_fingerprint

    shapes = None
    if not ModelRef.of(config.model).is_reference:
        from vlfast.models.checkpoints import check_tower_shapes

        def ask() -> dict:  # builds the tower on the meta device: imports torch, so only when not recorded
            from vlfast.models.towers import tower_shapes

            return tower_shapes(config.model)

        # before anything is written: a tower that does not fit its config fails at load, after run.json
        shapes = facts.answer("vision tower tensors", ask)
        check_tower_shapes(config.model, shapes)
    t0 = time.perf_counter()
    weights = weights_fingerprint(config.model, whole=config.spec.needs_llm, **_told(config, facts, shapes))
    fingerprint_seconds = time.perf_counter() - t0
    plan = RunPlan(
        out=out,
        samples=samples,
        problems=list(problems),
        rank=rank,
        world_size=world_size,
        family=family,
        processor=processor,
        run_config=as_recorded(
            recorded, run_configuration(config, family, processor, weights, world_size, facts)
        ),
        volatile_keys=(*DEFAULT_VOLATILE_KEYS, RUNTIME_KEY),
        fingerprint_seconds=fingerprint_seconds,
        listings=kept.fresh,
        facts=facts,
        store=store,
    )
    if world_size > 1:  # the whole input's columns are gone now that the plan keeps this rank's share
        from vlfast.extraction.store.format import release_arrow_memory

        del samples
        release_arrow_memory()
    return plan


def run_configuration(
    config: ExtractConfig,
    family: str,
    processor: ProcessorConfig,
    weights: Any,
    world_size: int,
    facts: ModelFacts | None = None,
) -> dict[str, Any]:
    """run.json's configuration (docs/extract.md): what is computed, and under ``runtime`` how."""
    from vlfast.extraction.store.run_file import library_versions

    model = config.model
    return {
        "task": "vlfast.extract",
        "model": ModelRef.of(model).spec,
        "model_identity": identity(model, family, facts),
        "weights": weights,
        "dtype": config.dtype_name,
        "store_dtype": config.store_dtype_name,
        "features": config.spec.to_dict(),
        "processor": processor.to_dict(),
        "versions": library_versions(),
        # The GEMM patch changes the features' bits (up to ~1e-6 relative in float32, more in bfloat16), so a
        # resume must not mix patched and unpatched samples.
        "patch_convs": config.patch_convs,
        RUNTIME_KEY: {
            "device": config.device_name,
            "num_workers": config.workers,
            "max_batch_tokens": config.budget.max_tokens,
            "world_size": world_size,
            "decode_timeout": config.decode_timeout,
            "commit_every": config.commit_every,
        },
    }


# Where the checkpoint was read, not what it is: a resume reading the same content from another path keeps
# the paths OUT recorded, so the configuration and its hash stay those of every part and shard.
LOCATION_KEYS = ("model", "processor.source")


def as_recorded(recorded: dict[str, Any] | None, run_config: dict[str, Any]) -> dict[str, Any]:
    """``run_config`` with the :data:`LOCATION_KEYS` of the configuration OUT records (None for a new OUT)
    when they are all that differs; else as it is."""
    import copy

    from vlfast.extraction.store.resume import DEFAULT_VOLATILE_KEYS, canonical_config, config_diffs

    if recorded is None:
        return run_config
    diffs = config_diffs(canonical_config(run_config), recorded, (*DEFAULT_VOLATILE_KEYS, RUNTIME_KEY))
    if not diffs or any(key not in LOCATION_KEYS or "<missing>" in (old, new) for key, old, new in diffs):
        return run_config
    adopted = copy.deepcopy(run_config)
    for key, old, _ in diffs:
        *parents, leaf = key.split(".")
        node = adopted
        for name in parents:
            node = node[name]
        node[leaf] = old
    return adopted


def recorded_setting(recorded: dict[str, Any] | None, name: str) -> Any:
    """The processor setting ``name`` OUT was made with (``image_reading``...), which a resume keeps; None
    for a new OUT, where the request and the model decide."""
    processor = (recorded or {}).get("processor")
    return processor.get(name) if isinstance(processor, dict) else None


def exif_orientation(asked: bool | None, recorded: dict[str, Any] | None) -> bool | None:
    """Whether images are turned upright by their EXIF tag: as asked; unasked, as OUT was made; None for a
    new OUT, where the model's preprocessing decides."""
    return asked if asked is not None else recorded_setting(recorded, "exif_orientation")


def identity(model: str, family: str, facts: ModelFacts | None = None) -> dict[str, Any]:
    """What tower the features come from, from its config alone (before anything is loaded)."""

    def ask() -> dict[str, Any]:
        from vlfast.models import vision_config_of, vision_model_class

        cfg = vision_config_of(model)
        return {"config": cfg.to_dict(), "class": vision_model_class(cfg).__name__}

    tower = (facts if facts is not None else ModelFacts(model)).answer("vision tower", ask)
    vision_config = tower["config"]
    for k in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "_attn_implementation"):
        vision_config.pop(k, None)
    return {"family": family, "tower_class": tower["class"], "vision_config": vision_config}


def _told(config: ExtractConfig, facts: ModelFacts, shapes: dict[str, Any] | None) -> dict[str, Any]:
    """What the weights fingerprint takes from ``facts`` instead of torch and transformers: the vision tower's
    tensor names (``shapes``), or a reference's torch version."""
    if ModelRef.of(config.model).is_reference:

        def version() -> str:
            import torch

            return str(torch.__version__)

        return {"torch_version": facts.answer("torch version", version)}
    if config.spec.needs_llm or shapes is None:
        return {}
    return {"tower_names": list(shapes)}


def check_llm_request(model: str, spec: FeatureSpec, facts: ModelFacts | None = None) -> None:
    """Refuse llm features that the model cannot give, from its config alone (exit 2, naming the flag):
    a reference (a vision tower only) or a ``--layers`` index past the LLM's hidden states."""
    if not spec.needs_llm:
        return
    what = "embedding" if spec.embedding else "llm"
    if ModelRef.of(model).is_reference:
        raise InputRefused(
            f"{model} is a vision tower only: {what} features need a local checkpoint directory with its "
            f"language model (drop '{what}' from --features, or pass --model DIR)"
        )

    def ask() -> dict[str, Any]:
        from vlfast.models import load_config

        config = load_config(model)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        n, width = getattr(text, "num_hidden_layers", None), getattr(text, "hidden_size", None)
        return {"class": type(config).__name__, "layers": n, "width": width}

    told = (facts if facts is not None else ModelFacts(model)).answer("language model", ask)
    n, width = told["layers"], told["width"]
    if not isinstance(n, int) or n < 1:
        raise InputRefused(
            f"{model}: its config ({told['class']}) names no language model with decoder layers, "
            f"which {what} features run; drop '{what}' from --features, or pass a vision-language checkpoint"
        )
    if spec.dim is not None and isinstance(width, int) and spec.dim > width:
        raise InputRefused(
            f"--dim {spec.dim}: the language model of {model} is {width} wide, so an embedding has at most "
            f"{width} dimensions; give --dim between 64 and {width}, or leave it out for all {width}"
        )
    # The indices of output_hidden_states: 0 the embeddings, k decoder layer k's output, n (-1) after the
    # final norm (read by hooks: features.HiddenStateTaps).
    states = n + 1
    bad = [layer for layer in spec.layers if not -states <= layer < states]
    if bad:
        raise InputRefused(
            f"--layers {','.join(map(str, bad))}: the language model of {model} has {n} layers, so its "
            f"hidden states are 0 (the embeddings) to {n}, or -{states} to -1 counting from the last"
        )
