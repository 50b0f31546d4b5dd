"""A sample's prompt as the model's processor would tokenize it, for ``llm`` features: built where the
sample is decoded (a worker, a Ray decode actor), so the tokenizer runs there and not where the model does."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vlfast.errors import InputRefused
from vlfast.pixels.media import SampleError

if TYPE_CHECKING:  # pragma: no cover
    import torch  # made where a sample is decoded: the plan needs none of it

__all__ = ["VISION_TOKENS", "PromptBuilder", "placeholder_problem", "video_timestamps"]

# Qwen-VL's vision placeholders, which the chat template places itself. Written in a prompt or a caption
# they would give the model more image tokens than the image has features, or a second vision span.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")


def placeholder_problem(field: str, text: str | None) -> str | None:
    """Why ``text`` (a prompt, a caption, an instruction) cannot go into the chat template: the vision
    placeholder tokens it holds, named; None if it holds none."""
    found = [t for t in VISION_TOKENS if text and t in text]
    if not found:
        return None
    return (
        f"the {field} holds a vision placeholder token: {', '.join(found)}; the chat template places these "
        f"itself for the image or video, so a {field} holding one would misplace them: remove it from the {field}"
    )


@dataclass
class PromptBuilder:
    """Builds the token ids of a chat prompt holding one image or video, as the model's processor would.

    The placeholder expansion mirrors ``Qwen3VLProcessor.replace_image_token`` / ``replace_video_token``
    (Qwen3-VL videos get ``<t seconds>`` per temporal patch) and ``Qwen2VLProcessor``'s plain repetition.
    ``video_wrapper``: what becomes of the template's ``<|vision_start|>...<|vision_end|>`` around a
    Qwen3-VL video (:data:`~vlfast.pixels.settings.VIDEO_WRAPPERS`), by the transformers the run was
    planned with, not the one a worker has.
    """

    checkpoint: str
    family: str
    merge_size: int
    temporal_patch_size: int
    video_wrapper: str = "kept"
    _tokenizer: Any = field(default=None, init=False, repr=False)

    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.checkpoint, local_files_only=True)
        return self._tokenizer

    def placeholder(self, kind: str, grid: Sequence[int], meta: dict[str, Any]) -> str:
        t, h, w = (int(x) for x in grid)
        if kind == "image":
            return "<|image_pad|>" * (t * h * w // self.merge_size**2)
        if not self.family.startswith("qwen3"):
            return "<|video_pad|>" * (t * h * w // self.merge_size**2)
        frame_tokens = h * w // self.merge_size**2
        stamps = video_timestamps(
            meta["frame_indices"], meta.get("video_fps") or 24.0, self.temporal_patch_size
        )
        return "".join(
            f"<{stamps[i]:.1f} seconds><|vision_start|>" + "<|video_pad|>" * frame_tokens + "<|vision_end|>"
            for i in range(t)
        )

    def expand(self, text: str, media: str, grid: Sequence[int], meta: dict[str, Any]) -> str:
        """``text`` (the chat template's, holding one pad for the ``media``) with the pad expanded as the
        processor expands it: a Qwen3-VL video's blocks inside the template's wrapper or in its place."""
        pad = "<|image_pad|>" if media == "image" else "<|video_pad|>"
        expanded = self.placeholder(media, grid, meta)
        wrapper = f"<|vision_start|>{pad}<|vision_end|>"
        # Qwen3VLProcessor.get_text_with_replacements (5.25+): the wrapper where the template wrote it, else the pad
        replaced = media == "video" and self.family.startswith("qwen3") and self.video_wrapper == "replaced"
        if replaced and wrapper in text:
            return text.replace(wrapper, expanded, 1)
        return text.replace(pad, expanded, 1)

    def __call__(self, kind: str, prompt: str, grid: Sequence[int], meta: dict[str, Any]) -> torch.Tensor:
        """input_ids (L,) int64 of the user turn plus the generation prompt."""
        media = "image" if kind == "image" else "video"
        prompt = prompt.replace("{kind}", media)
        problem = placeholder_problem("prompt", prompt)
        if problem:  # the row's input, not the template: recorded as this sample's error
            raise SampleError(problem)
        tok = self.tokenizer()
        messages = [{"role": "user", "content": [{"type": media}, {"type": "text", "text": prompt}]}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        pad = "<|image_pad|>" if media == "image" else "<|video_pad|>"
        if text.count(pad) != 1:
            raise InputRefused(
                f"the chat template of {self.checkpoint} must place exactly one {pad} for one {media}; "
                f"it placed {text.count(pad)}"
            )
        text = self.expand(text, media, grid, meta)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        import torch

        return torch.tensor(ids, dtype=torch.int64)


def video_timestamps(indices: Sequence[int], fps: float, temporal: int) -> list[float]:
    """Seconds at the middle of each temporal patch (``Qwen3VLProcessor._calculate_timestamps``)."""
    idx = list(indices)
    if len(idx) % temporal:
        idx.extend(idx[-1] for _ in range(temporal - len(idx) % temporal))
    secs = [i / fps for i in idx]
    return [(secs[i] + secs[i + temporal - 1]) / 2 for i in range(0, len(secs), temporal)]
