"""Qwen3-VL-Embedding's recipe where samples are decoded: its prompt (its pixel numbers: :mod:`vlfast.pixels.recipe`).

The reference is ``src/models/qwen3_vl_embedding.py`` of github.com/QwenLM/Qwen3-VL-Embedding
(``Qwen3VLEmbedder``): a system message with the instruction, one user message holding the video, then the
image, then the text ("NULL" when there is none of them), the chat template with the generation prompt,
truncation at 8,192 tokens. docs/embeddings.md says where vlfast departs from the code.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vlfast.extraction.decode.prompts import PromptBuilder, placeholder_problem
from vlfast.extraction.sources.sample import Sample
from vlfast.pixels.media import SampleError

if TYPE_CHECKING:  # pragma: no cover
    import torch  # made where a sample is decoded: the plan needs none of it

__all__ = ["DEFAULT_INSTRUCTION", "MAX_LENGTH", "EmbeddingPrompt", "normalized_instruction"]

DEFAULT_INSTRUCTION = "Represent the user's input."
MAX_LENGTH = 8192  # the reference's MAX_LENGTH: processor(truncation=True, max_length=8192)


def normalized_instruction(instruction: str | None, default: str) -> str:
    """The reference's ``format_model_input``: stripped, a "." added unless it ends in punctuation (a
    Unicode category P*); empty or None gives ``default`` as it is."""
    if instruction:
        instruction = instruction.strip()
        if instruction and not unicodedata.category(instruction[-1]).startswith("P"):
            instruction += "."
    return instruction or default


@dataclass
class EmbeddingPrompt:
    """The token ids of one sample's embedding conversation, built in the decode workers.
    ``media_features``: vision features are extracted beside it, so a text sample is refused."""

    builder: PromptBuilder
    instruction: str = DEFAULT_INSTRUCTION
    max_length: int = MAX_LENGTH
    media_features: bool = False

    def tokenizer(self):
        return self.builder.tokenizer()

    def __call__(
        self, s: Sample, grid: Sequence[int] | None, meta: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """(input_ids (L,) int64, what the store's meta records: text, instruction when the row has its
        own, the prompt's length and, when cut, ``truncated_from``)."""
        if s.kind == "text" and self.media_features:
            raise SampleError(
                "a text row has no image or video for the vision features asked beside the embedding; "
                "extract --features embedding alone for text rows"
            )
        for field_name, value in (("text", s.text), ("instruction", s.instruction)):
            problem = placeholder_problem(field_name, value)
            if problem:
                raise SampleError(problem)
        content: list[dict[str, Any]] = []
        if s.kind != "text":
            content.append({"type": "image" if s.kind == "image" else "video"})
        if s.text:
            content.append({"type": "text", "text": s.text})
        if not content:  # the reference's "NULL" (a manifest row needs a path or a text, so only by API)
            content.append({"type": "text", "text": "NULL"})
        system = normalized_instruction(s.instruction, self.instruction)
        messages = [
            {"role": "system", "content": [{"type": "text", "text": system}]},
            {"role": "user", "content": content},
        ]
        tok = self.tokenizer()
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if s.kind != "text":
            media = "image" if s.kind == "image" else "video"
            pad = "<|image_pad|>" if media == "image" else "<|video_pad|>"
            if text.count(pad) != 1:
                raise SampleError(
                    f"the chat template of {self.builder.checkpoint} placed {text.count(pad)} {pad} for one {media}"
                )
            assert grid is not None
            text = self.builder.expand(text, media, grid, meta)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        out: dict[str, Any] = {"prompt_tokens": len(ids)}
        if s.text is not None:
            out["text"] = s.text
        if s.instruction is not None:
            out["instruction"] = system
        if len(ids) > self.max_length:
            # processor(truncation=True, max_length=...) keeps the first max_length tokens; the processor
            # then refuses a cut through image or video tokens (their count no longer matches the media).
            vision = {tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>")}
            if any(i in vision for i in ids[self.max_length :]):
                raise SampleError(
                    f"the prompt is {len(ids):,} tokens, over the {self.max_length:,}-token limit, and the cut "
                    "would go through the image or video tokens; give a shorter instruction or text, or "
                    "fewer pixels (--max-pixels, --video-max-pixels)"
                )
            out["truncated_from"] = len(ids)
            ids = ids[: self.max_length]
            out["prompt_tokens"] = len(ids)
        import torch

        return torch.tensor(ids, dtype=torch.int64), out
