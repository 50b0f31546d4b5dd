"""Which features to extract and how to compute them from one forward of the vision tower or the VLM.

Feature names (several at once):

- ``vision``: the tower's merged tokens, (n_tokens, D_out) per sample, stored with ``grid_thw`` (rows of
  (t, h, w) in patches) so they reshape to (t, h/m, w/m, D_out) with m the spatial merge size;
- ``vision_mean``: their mean over tokens, (D_out,) in float32;
- ``deepstack``: the DeepStack levels (Qwen3-VL), ``deepstack.{k}`` each (n_tokens, D_out);
- ``llm``: LLM hidden states for a prompt about the sample: for each chosen layer and pooling,
  ``llm.{pool}.layer{L}`` of shape (D_text,), with ``pool`` "last" (last prompt token) or "mean"
  (mean over all tokens). Layer indices follow ``output_hidden_states``: 0 is the embeddings, -1 the last
  (after the final norm); read by hooks (:class:`HiddenStateTaps`);
- ``embedding``: Qwen3-VL-Embedding's vector, (D,) float32: the final-norm hidden state at the last token
  of the recipe's conversation (:mod:`vlfast.extraction.decode.embedding`), L2-normalised; with ``dim``
  (Matryoshka) its first ``dim`` values, normalised again.

Vision features come from the tower alone; with ``llm`` from the same whole-model forward (a hook).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from vlfast.errors import InputRefused
from vlfast.extraction.decode.prompts import PromptBuilder, video_timestamps  # noqa: F401 - their old home
from vlfast.extraction.model.spec import VISION_FEATURES, FeatureSpec

if TYPE_CHECKING:  # pragma: no cover
    from vlfast.extraction.decode.stage import DecodedSample

__all__ = [
    "FeatureSpec",
    "HiddenStateTaps",
    "PromptBuilder",
    "VisionBatch",
    "cast_for_store",
    "compute_llm_features",
    "compute_vision_features",
    "deepstack_skipped",
    "embedding_of",
    "find_decoder",
    "llm_inputs",
]


@dataclass
class VisionBatch:
    """Several samples' patches as one sequence: pixel_values (sum N_i, C*T*P*P), grid_thw (rows, 3)."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    tokens: list[int]  # merged tokens per sample, to split the tower's output back
    rows: list[int] = field(default_factory=list)  # grid rows per sample (1 unless frames_as_images)


def _split(t: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    return list(torch.split(t, list(sizes), dim=0))


def vision_features(
    names: Sequence[str], merged: torch.Tensor, deepstack: Sequence[torch.Tensor], batch: VisionBatch
) -> list[dict[str, torch.Tensor]]:
    """Per-sample vision features from the tower's merged (sum tokens, D) and deepstack outputs."""
    if merged.shape[0] != sum(batch.tokens):
        raise RuntimeError(
            f"the tower returned {merged.shape[0]} tokens for {sum(batch.tokens)} expected: unexpected merge size"
        )
    per = _split(merged, batch.tokens)
    deep = [_split(d, batch.tokens) for d in deepstack] if "deepstack" in names else []
    grids = _split(batch.grid_thw.cpu(), batch.rows or [1] * len(batch.tokens))
    out = []
    for i, tokens in enumerate(per):
        f: dict[str, torch.Tensor] = {}
        if "vision" in names or "deepstack" in names:
            f["grid_thw"] = grids[i].to(torch.int64)
        if "vision" in names:
            f["vision"] = tokens
        if "vision_mean" in names:
            f["vision_mean"] = tokens.float().mean(dim=0)
        for k, level in enumerate(deep):
            f[f"deepstack.{k}"] = level[i]
        out.append(f)
    return out


@contextmanager
def deepstack_skipped(tower: nn.Module, skip: bool = True) -> Iterator[None]:
    """Within the block, ``tower`` skips its DeepStack mergers (Qwen3-VL and its MoE/Omni siblings).

    The mergers (about 6% of a 2B tower's forward) feed nothing else in the tower: the merged tokens are
    bit-identical without them. An empty ``deepstack_visual_indexes`` skips them all; the list is restored
    on exit. Towers without the attribute run unchanged: the skip only ever saves work.
    """
    depths = getattr(tower, "deepstack_visual_indexes", None)
    if not skip or not depths:
        yield
        return
    tower.deepstack_visual_indexes = []
    try:
        yield
    finally:
        tower.deepstack_visual_indexes = depths


@torch.inference_mode()
def compute_vision_features(tower: nn.Module, batch: VisionBatch, names: Sequence[str]) -> list[dict]:
    """One tower forward over the packed batch; features split back per sample."""
    from vlfast.models import tower_outputs

    with deepstack_skipped(tower, "deepstack" not in names):
        out = tower_outputs(tower(batch.pixel_values, grid_thw=batch.grid_thw))
    return vision_features(names, out["merged"], out["deepstack"], batch)


# Where a VLM keeps its decoder (its layers and final norm), tried in order: transformers 5's
# ...ForConditionalGeneration, the bare ...Model, a text-only ...ForCausalLM.
DECODER_PATHS = ("model.language_model", "language_model", "model")


def find_decoder(model: nn.Module) -> tuple[str, nn.Module, nn.ModuleList]:
    """The language model's decoder in ``model``: (its path, the module, its non-empty ``layers`` list);
    :class:`InputRefused` naming the model's class when none of :data:`DECODER_PATHS` holds one."""
    for path in DECODER_PATHS:
        module: Any = model
        for part in path.split("."):
            module = getattr(module, part, None)
        layers = getattr(module, "layers", None)
        if isinstance(module, nn.Module) and isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return path, module, layers
    raise InputRefused(
        f"llm features: no decoder layers found in {type(model).__name__}: expected a non-empty ModuleList "
        f"`layers` at {' or '.join('model.' + p for p in DECODER_PATHS)} (the layout of transformers' "
        "Qwen2-VL, Qwen2.5-VL, Qwen3-VL and GLM-4.1V); drop llm from --features for this model"
    )


class _Stop(Exception):
    """Raised by a hook once the deepest requested hidden state is taken: the rest of the forward is skipped."""


class HiddenStateTaps:
    """Forward hooks that hand the requested LLM hidden states to ``take(index, h)`` during a whole-model
    forward, and stop the forward right after the deepest one (the LM head is never run).

    Indices are those of ``output_hidden_states``, each captured where transformers 5 captures it (the
    values are bit-identical, tested): with n decoder layers,

    - 0: the input of the first decoder layer (the embeddings, vision tokens in place);
    - k in 1..n-1: what decoder layer k (counting from 1) returns (for Qwen3-VL before the DeepStack
      features are added: they show in state k + 1, as in ``output_hidden_states``);
    - n, or -1: the decoder's ``last_hidden_state``, after its final norm (transformers replaces the last
      layer's output with it).
    """

    def __init__(self, model: nn.Module, layers: Sequence[int], take: Any):
        _, decoder, blocks = find_decoder(model)
        self.n_states = len(blocks) + 1
        for layer in layers:
            if not -self.n_states <= layer < self.n_states:
                raise InputRefused(
                    f"layer {layer} out of range: the model has hidden states 0..{self.n_states - 1}"
                )
        self.resolved = [layer % self.n_states for layer in layers]
        self.wanted = sorted(set(self.resolved))
        self.taken: set[int] = set()
        self._take = take
        self._deepest = self.wanted[-1]
        self._decoder, self._blocks = decoder, blocks

    def _emit(self, index: int, h: torch.Tensor) -> None:
        self._take(index, h)
        self.taken.add(index)
        if index == self._deepest:
            raise _Stop

    def run(self, forward: Any) -> None:
        """Call ``forward()`` with the hooks in place; they are removed whatever happens."""
        n = self.n_states - 1
        handles = []
        try:
            for index in self.wanted:
                if index == 0:

                    def first_input(_m, args, kwargs):
                        self._emit(0, args[0] if args else kwargs["hidden_states"])

                    handles.append(self._blocks[0].register_forward_pre_hook(first_input, with_kwargs=True))
                elif index < n:

                    def layer_output(_m, _i, out, index=index):
                        self._emit(index, out[0] if isinstance(out, tuple) else out)

                    handles.append(self._blocks[index - 1].register_forward_hook(layer_output))
                else:

                    def last_state(_m, _i, out):
                        h = getattr(out, "last_hidden_state", None)
                        self._emit(n, h if h is not None else out[0])

                    handles.append(self._decoder.register_forward_hook(last_state))
            with suppress(_Stop):  # the deepest state was taken: the rest of the forward is skipped
                forward()
        finally:
            for h in handles:
                h.remove()
        missing = sorted(set(self.wanted) - self.taken)
        if missing:
            raise RuntimeError(
                f"the forward never reached hidden state(s) {missing}: the decoder was not run"
            )


def llm_inputs(
    items: Sequence[DecodedSample],
    *,
    image_token_id: int,
    video_token_id: int,
    pad_token_id: int,
    device: torch.device,
    dtype: torch.dtype,
    padding_side: str = "right",
) -> tuple[dict[str, Any], list[int]]:
    """The whole model's keyword inputs for a batch of samples (prompts padded on ``padding_side``, media
    as the processor would pass them), and each prompt's length."""
    lengths = [int(it.input_ids.numel()) for it in items]
    longest = max(lengths)
    ids = torch.full((len(items), longest), pad_token_id, dtype=torch.int64)
    mask = torch.zeros((len(items), longest), dtype=torch.int64)
    left = padding_side == "left"
    for i, it in enumerate(items):
        span = slice(longest - lengths[i], longest) if left else slice(0, lengths[i])
        ids[i, span] = it.input_ids
        mask[i, span] = 1
    mm_types = torch.where(ids == image_token_id, 1, torch.where(ids == video_token_id, 2, 0)) * mask
    kwargs: dict[str, Any] = {
        "input_ids": ids.to(device),
        "attention_mask": mask.to(device),
        "mm_token_type_ids": mm_types.to(device),
    }
    for kind, pv_key, grid_key in (
        ("image", "pixel_values", "image_grid_thw"),
        ("video", "pixel_values_videos", "video_grid_thw"),
    ):
        sel = [it for it in items if _modality(it) == kind]
        if sel:
            kwargs[pv_key] = torch.cat([it.pixel_values for it in sel]).to(device=device, dtype=dtype)
            kwargs[grid_key] = torch.tensor([list(it.grid) for it in sel], dtype=torch.int64, device=device)
    return kwargs, lengths


def _modality(item: DecodedSample) -> str:
    """ "image", "video" (a video file or a frame list) or "text" (no media)."""
    return "video" if item.kind == "frames" else item.kind


def embedding_of(hidden: torch.Tensor, dim: int | None) -> torch.Tensor:
    """Qwen3-VL-Embedding's vector from the last token's final-norm hidden state: L2-normalised in float32;
    with ``dim`` (Matryoshka) its first ``dim`` values (cut before normalising: the same vector)."""
    h = hidden.float()
    if dim is not None:
        h = h[:dim]
    return torch.nn.functional.normalize(h, p=2, dim=-1)


@torch.inference_mode()
def compute_llm_features(
    model: nn.Module,
    tower: nn.Module,
    items: Sequence[DecodedSample],
    spec: FeatureSpec,
    *,
    image_token_id: int,
    video_token_id: int,
    pad_token_id: int,
    device: torch.device,
    dtype: torch.dtype,
    padding_side: str = "right",
) -> list[dict[str, torch.Tensor]]:
    """One whole-model forward for a batch of samples (right-padded prompts, or left: the same vectors),
    up to the deepest layer asked (the last for ``embedding``).

    The requested hidden states are pooled as the forward reaches them (:class:`HiddenStateTaps`), so at
    most one layer's (B, L, D) is held beyond the forward's own. The tower's outputs are captured by a
    hook, images first then videos, as the model calls it.
    """

    inputs, _ = llm_inputs(
        items,
        image_token_id=image_token_id,
        video_token_id=video_token_id,
        pad_token_id=pad_token_id,
        device=device,
        dtype=dtype,
        padding_side=padding_side,
    )
    mask = inputs["attention_mask"].bool()
    # The last non-padding position of each row, whichever side was padded (the reference's _pooling_last).
    last = (mask.shape[1] - 1 - mask.int().flip(dims=[1]).argmax(dim=1)).tolist()
    pooled: dict[int, list[dict[str, torch.Tensor]]] = {}

    def take(index: int, hidden: torch.Tensor) -> None:
        llm = "llm" in spec.names
        h = hidden.float() if llm else None  # (B, L, D_text); an embedding needs one row of it only
        per = []
        for i, end in enumerate(last):
            f = {}
            if spec.embedding:
                f["embedding"] = embedding_of(hidden[i, end], spec.dim)
            if llm and "last" in spec.pools:
                f[f"llm.last.layer{index}"] = h[i, end].clone()
            if llm and "mean" in spec.pools:
                f[f"llm.mean.layer{index}"] = h[i][mask[i]].mean(dim=0)
            per.append(f)
        pooled[index] = per

    from vlfast.models import tower_outputs

    taps = HiddenStateTaps(model, (-1,) if spec.embedding else spec.layers, take)
    # The tower's outputs, normalised at once: the VLM later replaces the output's fields with per-image splits.
    towered: list[dict[str, Any]] = []
    handle = tower.register_forward_hook(lambda _m, _i, out: towered.append(tower_outputs(out)))
    try:
        taps.run(lambda: model(**inputs, use_cache=False))
    finally:
        handle.remove()
    results: list[dict[str, torch.Tensor]] = [{} for _ in items]
    for index in taps.resolved:  # in the order asked, as before
        for i, f in enumerate(pooled[index]):
            results[i].update(f)
    _add_tower_features(results, items, spec, towered)
    return results


def _add_tower_features(
    results: list[dict], items: Sequence[DecodedSample], spec: FeatureSpec, towered: list[dict[str, Any]]
) -> None:
    """The vision features asked, from what the tower returned during the whole-model forward."""
    order = [i for kind in ("image", "video") for i, it in enumerate(items) if _modality(it) == kind]
    vision_names = [n for n in spec.names if n in VISION_FEATURES]
    if not (vision_names and order):
        return
    # one call per modality present, images first
    merged_all = torch.cat([t["merged"] for t in towered])
    deep = [t["deepstack"] for t in towered]
    deep_all = [torch.cat(level) for level in zip(*deep)] if deep and deep[0] else []
    sorted_items = [items[i] for i in order]
    batch = VisionBatch(
        pixel_values=torch.empty(0),
        grid_thw=torch.tensor([list(it.grid) for it in sorted_items], dtype=torch.int64),
        tokens=[int(it.tokens) for it in sorted_items],
    )
    for pos, feats in zip(order, vision_features(vision_names, merged_all, deep_all, batch)):
        results[pos].update(feats)


_STORE_CHOICES = ("bfloat16", "float32")  # what a refusal suggests instead, in order of size


def cast_for_store(
    feats: dict[str, torch.Tensor], dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor] | None, str | None]:
    """One sample's features with every floating tensor cast to ``dtype`` (``--store-dtype``), or (None,
    why) when the cast would turn a finite value into inf. A NaN or inf the model computed is kept as
    computed; only what the cast changes is refused. Integers are left alone. The exact element test runs
    only when a tensor's largest magnitude is past ``dtype``'s largest value (or not finite)."""
    limit = torch.finfo(dtype).max
    out: dict[str, torch.Tensor] = {}
    for name, t in feats.items():
        if not t.is_floating_point() or t.dtype == dtype:
            out[name] = t
            continue
        cast = t.to(dtype)
        if t.numel() and not float(torch.linalg.vector_norm(t, ord=float("inf"))) <= limit:
            # Past the limit, or a NaN somewhere: did the cast make an inf of a finite value? (A value up to
            # half an ulp past the limit rounds to it, and is held.)
            made = torch.isinf(cast) & torch.isfinite(t)
            if bool(made.any()):
                peak = float(t[torch.isfinite(t)].abs().max())
                name_of = str(dtype).removeprefix("torch.")
                wider = [d for d in _STORE_CHOICES if torch.finfo(getattr(torch, d)).max > peak]
                use = f"use --store-dtype {' or '.join(wider)}" if wider else "store it as computed"
                return None, (
                    f"not storable as {name_of}: max |value| {peak:.3g} of feature {name!r} exceeds "
                    f"{name_of}'s largest value {limit:.6g} ({int(made.sum())} values would be stored as "
                    f"inf): {use}"
                )
        out[name] = cast
    return out, None
