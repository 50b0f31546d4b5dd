"""The model half of extraction, shared by the engines: load the model once, batch decoded samples by
token budget, run each batch (split in half on out-of-memory), and add the results to a store.

On the CPU each sample of a batch gets a forward of its own (:func:`runs_alone`): a batched forward gives a
sample bits that depend on its batch-mates (issue 46: ``scaled_dot_product_attention`` over a padded row
sums the softmax in another order than over the row alone, and MKL's product rows can change with the rows
beside them, in every ``MKL_CBWR`` mode). Alone, every shape a sample's forward sees is its own, so its
features are the same bytes whatever the batch, a resume or a re-sharding (at one thread count, on one
machine and library build).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vlfast.extraction.decode.embedding import EmbeddingPrompt
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
from vlfast.pixels.finish import finish_pixels
from vlfast.pixels.recipe import is_embedding_checkpoint
from vlfast.pixels.settings import ProcessorConfig

__all__ = ["Forward", "LoadedModel", "batches", "load", "runs_alone"]


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
    """Decoded samples packed by token budget (:func:`~vlfast.extraction.model.batching.pack`); with
    ``padded`` (the whole VLM runs, its rows padded to the longest), by
    :func:`~vlfast.extraction.model.batching.pack_padded`."""
    return (pack_padded if padded else pack)(items, lambda it: it.cost, budget, first_alone=first_alone)


def pixels_to(x: torch.Tensor, device: torch.device, cfg: ProcessorConfig) -> torch.Tensor:
    """A sample's pixel_values as float32 (N, C*T*P*P) on ``device``, copied from pinned memory to CUDA.
    Video patches arrive as uint8 and are normalised after the copy, on the device: a quarter of the bytes
    cross the bus (:func:`~vlfast.pixels.finish.finish_pixels`)."""
    return finish_pixels([x], cfg, device=device)


def batch_pixels(
    xs: Sequence[torch.Tensor], device: torch.device, dtype: torch.dtype, cfg: ProcessorConfig
) -> torch.Tensor:
    """Samples' pixel_values as the tower's one (sum of N, C*T*P*P) tensor of ``dtype`` on ``device``: what
    ``torch.cat`` of each one's :func:`pixels_to`, then ``.to(dtype)``, gives, bit for bit, without either
    copy."""
    return finish_pixels(xs, cfg, device=device, dtype=dtype)


def runs_alone(device: torch.device) -> bool:
    """Whether each sample gets a forward of its own on ``device``: on the CPU, where a resume must give the
    bytes of an uninterrupted run. On a GPU a batch runs as one forward, for throughput (docs/extract.md,
    "What vlfast guarantees")."""
    return device.type == "cpu"


class Forward:
    """One forward of a packed batch (split in half on out-of-memory), and the results added to a store;
    where :func:`runs_alone` (the CPU), one forward per sample of the batch. Counts its time inside forwards
    and its splits. ``hook`` (tests) sees each batch first."""

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
        self.alone = runs_alone(loaded.device)
        self.compute_seconds = 0.0
        self.oom_splits = 0

    def _on_cpu(self, batch: Sequence[DecodedSample]) -> list[DecodedSample]:
        cpu = torch.device("cpu")
        return [
            dataclasses.replace(it, pixel_values=pixels_to(it.pixel_values, cpu, self.cfg)) for it in batch
        ]

    def __call__(self, batch: Sequence[DecodedSample]) -> list[dict[str, torch.Tensor]]:
        cuda = self.loaded.device.type == "cuda"
        if self.hook is not None:
            self.hook(self._on_cpu(batch))
        t0 = time.perf_counter()
        groups = [[it] for it in batch] if self.alone else [batch]
        feats = [f for group in groups for f in self._compute(group)]
        feats = [{k: v.to("cpu", non_blocking=cuda) for k, v in f.items()} for f in feats]
        if cuda:
            torch.cuda.synchronize(self.loaded.device)
        self.compute_seconds += time.perf_counter() - t0
        return feats  # cast to the store dtype per sample, in store(): one that cannot hold it is recorded

    def _compute(self, batch: Sequence[DecodedSample]) -> list[dict[str, torch.Tensor]]:
        """One forward of ``batch``: the whole VLM for llm features, else the tower over the packed patches."""
        loaded, spec = self.loaded, self.spec
        if spec.needs_llm:
            return compute_llm_features(
                loaded.whole,
                loaded.tower,
                self._on_cpu(batch),
                spec,
                device=loaded.device,
                dtype=loaded.dtype,
                **self.token_ids,
            )
        pixels = batch_pixels([it.pixel_values for it in batch], loaded.device, loaded.dtype, self.cfg)
        vb = VisionBatch(
            pixel_values=pixels,
            grid_thw=torch.tensor([list(it.grid) for it in batch], dtype=torch.int64).to(
                loaded.device, non_blocking=True
            ),
            tokens=[int(it.tokens) for it in batch],
        )
        return compute_vision_features(loaded.tower, vb, spec.names)

    def _split(self, n: int) -> None:
        self.oom_splits += 1

    def store(
        self, batch: Sequence[DecodedSample], store, sample_of: Callable[[DecodedSample], Any], record
    ) -> list[tuple[Any, int]]:
        """Run ``batch`` and add each result to ``store``; a sample that does not fit even alone is recorded
        with ``record(id, source, reason)``. Returns (sample, patches) for each sample added, ``sample_of``
        giving what has its ``id``, ``source`` and ``kind``."""
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
