"""Which features to extract: :class:`FeatureSpec`, checked when it is made.

Its own module, without torch, so that a run's configuration is made and compared before anything heavy
loads. :mod:`~vlfast.extraction.model.features` says what each feature is and computes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vlfast.errors import InputRefused
from vlfast.extraction.decode.embedding import (
    DEFAULT_INSTRUCTION,
    MAX_LENGTH,
    EmbeddingPrompt,
    normalized_instruction,
)

__all__ = [
    "ALL_FEATURES",
    "DEFAULT_PROMPT",
    "MIN_EMBEDDING_DIM",
    "POOLS",
    "VISION_FEATURES",
    "FeatureSpec",
    "parse_features",
]

VISION_FEATURES = ("vision", "vision_mean", "deepstack")
ALL_FEATURES = (*VISION_FEATURES, "llm", "embedding")
MIN_EMBEDDING_DIM = 64  # Qwen3-VL-Embedding's smallest Matryoshka dimension
POOLS = ("last", "mean")
DEFAULT_PROMPT = "Describe this {kind}."


def parse_features(features: str | Sequence[str]) -> tuple[str, ...]:
    """``"vision,vision_mean"`` or a list -> validated tuple, in the canonical order, no repeats."""
    names = [f.strip() for f in features.split(",")] if isinstance(features, str) else list(features)
    names = [n for n in names if n]
    unknown = sorted(set(names) - set(ALL_FEATURES))
    if unknown or not names:
        raise InputRefused(
            f"unknown feature(s) {unknown or names}: choose from {', '.join(ALL_FEATURES)} (comma-separated)"
        )
    return tuple(f for f in ALL_FEATURES if f in names)


@dataclass(frozen=True)
class FeatureSpec:
    """What to extract. ``layers`` and ``pools`` only matter for ``llm``."""

    names: tuple[str, ...] = ("vision", "vision_mean")
    layers: tuple[int, ...] = (-1,)
    pools: tuple[str, ...] = ("last",)
    prompt: str = DEFAULT_PROMPT  # used when a sample has no prompt; "{kind}" becomes image/video
    instruction: str = DEFAULT_INSTRUCTION  # ``embedding``: for a sample without its own instruction
    dim: int | None = None  # ``embedding``: Matryoshka dimension (None: the model's width)

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", parse_features(self.names))
        if "llm" in self.names and "embedding" in self.names:
            raise InputRefused(
                "features llm and embedding cannot be extracted in one run: each builds its own prompt "
                "(llm: --prompt about the media; embedding: the recipe's conversation); run them into two OUTs"
            )
        if not isinstance(self.instruction, str) or not self.instruction.strip():
            raise InputRefused("instruction must be a non-empty string")
        # As a row's own: the same text gives the same vector whether a row or --instruction carries it.
        object.__setattr__(self, "instruction", normalized_instruction(self.instruction, DEFAULT_INSTRUCTION))
        if self.dim is not None and (
            isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < MIN_EMBEDDING_DIM
        ):
            raise InputRefused(
                f"dim (--dim) must be an integer >= {MIN_EMBEDDING_DIM} (the smallest Matryoshka dimension "
                f"Qwen3-VL-Embedding was trained for), got {self.dim!r}"
            )
        if self.dim is not None and "embedding" not in self.names:
            raise InputRefused("dim (--dim) applies to --features embedding only")
        if not self.layers or not all(isinstance(x, int) for x in self.layers):
            raise InputRefused(f"layers must be a non-empty tuple of ints, got {self.layers!r}")
        if not self.pools or any(p not in POOLS for p in self.pools):
            raise InputRefused(f"pools must be a non-empty subset of {POOLS}, got {self.pools!r}")
        if not isinstance(self.prompt, str) or not self.prompt:
            raise InputRefused("prompt must be a non-empty string")

    @property
    def needs_llm(self) -> bool:
        """Whether the whole VLM runs (``llm`` or ``embedding``), not the vision tower alone."""
        return "llm" in self.names or self.embedding

    @property
    def embedding(self) -> bool:
        return "embedding" in self.names

    def embedding_prompt(self) -> EmbeddingPrompt | None:
        """For ``embedding``: what the decode stage builds each conversation with (its tokenizer added by
        :func:`~vlfast.extraction.decode.stage.prepare_decoding`), else None."""
        if not self.embedding:
            return None
        media = any(n in VISION_FEATURES for n in self.names)
        return EmbeddingPrompt(None, instruction=self.instruction, media_features=media)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"names": list(self.names)}
        if "llm" in self.names:
            d.update(layers=list(self.layers), pools=list(self.pools), default_prompt=self.prompt)
        if self.embedding:
            d.update(instruction=self.instruction, dim=self.dim, max_length=MAX_LENGTH)
        return d
