"""The decode stage every engine runs: a :class:`Sample` in, a :class:`DecodedSample` (the model's input) or
the reason it failed out, never an exception.

The local engine runs it in its worker pool, the Ray engine in its decode actors. Failures keep the worker
pool's form, a dict ``{"i", "ok": False, "reason"}`` (plus ``"unexpected": True`` and ``"traceback"`` for a
bug rather than bad media: :func:`~vlfast.extraction.decode.workers.unexpected_item`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vlfast.extraction.decode.embedding import EmbeddingPrompt
from vlfast.extraction.decode.inputs import input_record
from vlfast.extraction.decode.prompts import PromptBuilder
from vlfast.extraction.decode.workers import unexpected_item
from vlfast.extraction.objstore import TransientReadError
from vlfast.extraction.sources.identity import texts_used
from vlfast.extraction.sources.sample import Sample
from vlfast.extraction.sources.table import SampleTable
from vlfast.models.ref import ModelRef
from vlfast.pixels.engine import Preprocessor
from vlfast.pixels.media import SampleError
from vlfast.pixels.settings import TORCHVISION_IMAGE_PROCESSORS, ProcessorConfig

__all__ = ["DecodedSample", "SampleDataset", "prepare_decoding", "worker_init"]


@dataclass
class DecodedSample:
    """One sample ready for the model."""

    i: int  # its position in the list being decoded
    kind: str  # "image", "video", "frames", or "text" (no pixels: an embedding of a text alone)
    pixel_values: torch.Tensor  # (t*h*w, C*T*P*P): float32, or uint8 video patches normalised by the model
    grid: tuple[int, int, int]  # (t, h, w) in patches
    tokens: int  # merged vision tokens
    meta: dict[str, Any] = field(default_factory=dict)  # what preprocessing recorded (frames, sizes, prompt)
    input_ids: torch.Tensor | None = None  # the prompt's token ids, for llm features
    ref: Any = None  # what the consumer maps it back to its sample with (the Ray engine's row)
    input: dict[str, Any] | None = None  # what its input was when read (decode/inputs.py)

    @property
    def cost(self) -> int:
        """Its share of the token budget: its patches, plus its prompt for ``llm``."""
        prompt = 0 if self.input_ids is None else int(self.input_ids.numel())
        return int(self.pixel_values.shape[0]) + prompt

    @property
    def patches(self) -> int:
        return int(self.pixel_values.shape[0])


class SampleDataset:
    """Map-style dataset: sample -> :class:`DecodedSample`, or a failure dict. Never raises."""

    def __init__(
        self,
        samples: Sequence[Sample],
        pre: Preprocessor,
        prompts: PromptBuilder | EmbeddingPrompt | None,
        default_prompt: str,
        hook: Callable[[Sample], None] | None = None,
    ):
        self.samples = samples if isinstance(samples, SampleTable) else list(samples)
        self.pre, self.prompts = pre, prompts
        self.default_prompt = default_prompt
        self.hook = hook  # tests inject faults here (a crashing or hanging decoder)
        self.texts = texts_used(prompts is not None, isinstance(prompts, EmbeddingPrompt))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> DecodedSample | dict[str, Any]:
        s = self.samples[i]
        try:
            if self.hook is not None:
                self.hook(s)
            record = input_record(s, self.texts)  # before decoding: its stamp predates the bytes read
            if s.kind == "text":
                if not isinstance(self.prompts, EmbeddingPrompt):
                    raise SampleError(
                        "a text row (no path) has nothing to extract but an embedding: give it a 'path', "
                        "or run --features embedding"
                    )
                pixels, grid, meta = self.pre.no_pixels(), (0, 0, 0), {}
            else:
                pixels, grid, meta = self.pre(s)
            item = DecodedSample(
                i=i,
                kind=s.kind,
                pixel_values=pixels,
                grid=grid,
                tokens=grid[0] * grid[1] * grid[2] // self.pre.cfg.merge_size**2,
                meta=meta,
                input=record,
            )
            if isinstance(self.prompts, EmbeddingPrompt):
                item.input_ids, recorded = self.prompts(s, grid, meta)
                item.meta = {**meta, **recorded}
            elif self.prompts is not None:
                prompt = s.prompt or self.default_prompt
                item.input_ids = self.prompts(s.kind, prompt, grid, meta)
                media = "image" if s.kind == "image" else "video"
                item.meta = {**meta, "prompt": prompt.replace("{kind}", media)}
            return item
        except (SampleError, TransientReadError) as e:  # bad media or input, or storage that did not answer
            return {"i": i, "ok": False, "reason": str(e)}
        except Exception as e:  # noqa: BLE001 - a bug, not the media: never recorded (UnexpectedErrors)
            return unexpected_item(i, e)


def worker_init(_: int) -> None:
    """Workers preprocess one sample at a time; intra-op threads would only fight the main process."""
    torch.set_num_threads(1)


def prepare_decoding(
    model: str,
    family: str,
    cfg: ProcessorConfig,
    needs_llm: bool,
    images: bool,
    embedding: EmbeddingPrompt | None = None,
) -> tuple[Preprocessor, PromptBuilder | EmbeddingPrompt | None]:
    """What decoding needs, built once where samples are decoded, so forked workers inherit it: the model's
    own preprocessing (videos left as uint8 patches, normalised where the model runs), and for ``llm`` the
    prompt builder with its tokenizer loaded. ``embedding`` asks for the embedding conversation instead."""
    pre = Preprocessor(cfg, image_processor_dir=ModelRef.of(model).folder, defer_video_normalize=True)
    if images and cfg.image_processor not in TORCHVISION_IMAGE_PROCESSORS:
        pre.image_processor()  # transformers' processor runs for images: built once here
    prompts = None
    if needs_llm:
        prompts = PromptBuilder(model, family, cfg.merge_size, cfg.temporal_patch_size, cfg.video_wrapper)
        prompts.tokenizer()
        if embedding is not None:
            return pre, dataclasses.replace(embedding, builder=prompts)
    return pre, prompts
