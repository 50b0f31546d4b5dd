"""The model half of extraction, shared by the engines: load the model once, batch decoded samples by
token budget, run each batch (split in half on out-of-memory), and add the results to a store."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vlfast.extraction.decode.embedding import EmbeddingPrompt, is_embedding_checkpoint
from vlfast.extraction.decode.preprocess import ProcessorConfig, normalize_video_patches
from vlfast.extraction.decode.prompts import PromptBuilder
from vlfast.extraction.decode.stage import DecodedSample
from vlfast.extraction.model.batching import Failed, TokenBudget, pack, pack_padded, run_split_on_oom
from vlfast.extraction.model.features import (
    FeatureSpec,
    VisionBatch,
    cast_for_store,
    compute_llm_features,
    compute_vision_features,
    find_decoder,
)

__all__ = ["Forward", "LoadedModel", "batches", "load"]


@dataclass
class LoadedModel:
    spec: str  # the --model given: a checkpoint directory or ref:NAME
    family: str
    tower: torch.nn.Module
    whole: torch.nn.Module | None  # the VLM, only for llm features
    device: torch.device
    dtype: torch.dtype


def load(
    model: str, family: str, spec: FeatureSpec, device: torch.device, dtype: torch.dtype, patch_convs: bool
) -> LoadedModel:
    """The vision tower (and for ``llm`` the whole VLM) on ``device`` in ``dtype``, convs patched; MKL's
    vector math set up on one thread first (:func:`vlfast.numerics.settle_vector_math`)."""
    from vlfast.models import find_vision_tower, load_model, load_vision_tower
    from vlfast.numerics import settle_vector_math

    settle_vector_math()  # else the first forward's cos may be wrong in one thread's half (see there)

    if spec.needs_llm:
        # An embedding checkpoint has no LM head, and no features need one: the bare model, no random head.
        whole = load_model(model, device=device, dtype=dtype, head=not is_embedding_checkpoint(model))
        find_decoder(whole)  # no decoder layers for the llm hooks: refused before any work
        tower = find_vision_tower(whole)[1]
    else:
        whole = None
        tower = load_vision_tower(model, device=device, dtype=dtype)
    tower.eval()
    if patch_convs:
        from vlfast.patching.gemm import patch

        patch(tower)
    return LoadedModel(model, family, tower, whole, device, dtype)


def batches(
    items: Iterable[DecodedSample], budget: TokenBudget, first_alone: bool = False, padded: bool = False
):
    """Decoded samples packed by token budget (see :func:`~vlfast.extraction.model.batching.pack`); with
    ``padded`` (the whole VLM runs: its rows are padded to the longest) sorted by length within a window
    and costed as padded (:func:`~vlfast.extraction.model.batching.pack_padded`)."""
    if (
        padded
    ):  # the sort key and padding are the prompt's length (vision tokens in it); a text has no patches
        return pack_padded(items, lambda it: it.cost, budget, first_alone=first_alone)
    return pack(items, lambda it: it.cost, budget, first_alone=first_alone)


def pixels_to(x: torch.Tensor, device: torch.device, cfg: ProcessorConfig) -> torch.Tensor:
    """A sample's pixel_values as float32 (N, C*T*P*P) on ``device``. To CUDA the copy starts from pinned
    memory, so ``non_blocking`` really overlaps it (from pageable memory it would be synchronous).
    Video patches arrive as uint8 and are normalised after the copy, on the device: a quarter of the bytes
    cross the bus."""
    if device.type == "cuda" and not x.is_pinned():
        x = x.pin_memory()
    x = x.to(device, non_blocking=True)
    return normalize_video_patches(x, cfg) if x.dtype == torch.uint8 else x


class Forward:
    """One forward of a packed batch (split in half on out-of-memory), and the results added to a store.
    Counts its time inside forwards and its splits. ``hook`` (tests) sees each batch first."""

    def __init__(
        self,
        loaded: LoadedModel,
        spec: FeatureSpec,
        cfg: ProcessorConfig,
        stored_as: torch.dtype | None,
        prompts: PromptBuilder | EmbeddingPrompt | None,
        hook: Callable[[list[DecodedSample]], None] | None = None,
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

    def _on_cpu(self, batch: Sequence[DecodedSample]) -> list[DecodedSample]:
        cpu = torch.device("cpu")
        return [
            dataclasses.replace(it, pixel_values=pixels_to(it.pixel_values, cpu, self.cfg)) for it in batch
        ]

    def __call__(self, batch: Sequence[DecodedSample]) -> list[dict[str, torch.Tensor]]:
        loaded, spec = self.loaded, self.spec
        cuda = loaded.device.type == "cuda"
        if self.hook is not None:
            self.hook(self._on_cpu(batch))
        t0 = time.perf_counter()
        if spec.needs_llm:
            feats = compute_llm_features(
                loaded.whole,
                loaded.tower,
                self._on_cpu(batch),
                spec,
                device=loaded.device,
                dtype=loaded.dtype,
                **self.token_ids,
            )
        else:
            pixels = torch.cat([pixels_to(it.pixel_values, loaded.device, self.cfg) for it in batch])
            vb = VisionBatch(
                pixel_values=pixels.to(dtype=loaded.dtype),
                grid_thw=torch.tensor([list(it.grid) for it in batch], dtype=torch.int64).to(
                    loaded.device, non_blocking=True
                ),
                tokens=[int(it.tokens) for it in batch],
            )
            feats = compute_vision_features(loaded.tower, vb, spec.names)
        feats = [{k: v.to("cpu", non_blocking=cuda) for k, v in f.items()} for f in feats]
        if cuda:
            torch.cuda.synchronize(loaded.device)
        self.compute_seconds += time.perf_counter() - t0
        return feats  # cast to the store dtype per sample, in store(): one that cannot hold it is recorded

    def _split(self, n: int) -> None:
        self.oom_splits += 1

    def store(
        self, batch: Sequence[DecodedSample], store, sample_of: Callable[[DecodedSample], Any], record
    ) -> list[tuple[Any, int]]:
        """Run ``batch`` and add each result to ``store``; a sample that does not fit even alone is recorded
        with ``record(id, source, reason)``. Returns (sample, patches) for each sample added. ``sample_of``
        maps a decoded sample to what has its ``id``, ``source`` and ``kind``."""
        added = []
        for item, result in zip(batch, run_split_on_oom(batch, self, on_oom=self._split)):
            sample = sample_of(item)
            if isinstance(result, Failed):
                record(
                    sample.id, sample.source, f"out of memory even alone ({item.cost} tokens): {result.error}"
                )
                continue
            if self.stored_as is not None:
                result, refused = cast_for_store(result, self.stored_as)
                if refused is not None:  # an overflow to inf: recorded, never stored
                    record(sample.id, sample.source, refused)
                    continue
            path = None if sample.kind == "text" else sample.source
            meta = {"path": path, "kind": sample.kind, "n_tokens": int(item.tokens), **item.meta}
            store.add(sample.id, result, meta, input=item.input)
            added.append((sample, item.patches))
        return added
