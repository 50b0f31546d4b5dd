"""Qwen3-VL-Embedding's pixel numbers, and how a checkpoint is known to be one.

The reference is ``src/models/qwen3_vl_embedding.py`` of github.com/QwenLM/Qwen3-VL-Embedding
(``Qwen3VLEmbedder``): images and videos prepared by qwen-vl-utils with patch size 16 (:data:`RECIPE_PIXELS`),
then the processor without resizing again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vlfast.models.ref import ModelRef

__all__ = [
    "EMBEDDING_ARCHITECTURES",
    "RECIPE_PIXELS",
    "SENTENCE_TRANSFORMERS_FILES",
    "is_embedding_checkpoint",
]

# config.json "architectures" of the published Qwen3-VL-Embedding checkpoints (the reference's model class)
EMBEDDING_ARCHITECTURES = frozenset({"Qwen3VLForEmbedding"})

_FACTOR = 32  # IMAGE_FACTOR: patch 16 x merge 2
# The reference's constants, as ProcessorConfig fields: images within MIN_PIXELS..MAX_PIXELS; videos at FPS
# 1, at most MAX_FRAMES 64, each frame within qwen-vl-utils' VIDEO_MIN_TOKEN_NUM 128 and
# VIDEO_MAX_TOKEN_NUM 768 tokens, and MAX_TOTAL_PIXELS (10 x FRAME_MAX_PIXELS) over all frames.
RECIPE_PIXELS: dict[str, Any] = {
    "image_min_pixels": 4 * _FACTOR * _FACTOR,
    "image_max_pixels": 1800 * _FACTOR * _FACTOR,
    "video_min_pixels": 128 * _FACTOR * _FACTOR,
    "video_max_pixels": 10 * 768 * _FACTOR * _FACTOR,
    "max_video_tokens": 768,
    "fps": 1.0,
    "min_frames": 4,
    "max_frames": 64,
    "frame_sampling": "qwen-vl-utils",
    "video_sizing": "qwen-vl-utils",
    # qwen-vl-utils' smart_resize raises a thin side to one merged patch first (pixels.video.smart_resize)
    "thin_images": "qwen-vl-utils",
}


# What Sentence-Transformers saves beside a model: the published embedding checkpoints are also
# Sentence-Transformers models, whatever their config.json's "architectures" says.
SENTENCE_TRANSFORMERS_FILES = ("config_sentence_transformers.json", "modules.json")


def is_embedding_checkpoint(model: str) -> bool:
    """Whether ``model`` is a Qwen3-VL-Embedding checkpoint: its config.json names the embedding
    architecture, or it is a Qwen3-VL saved as a Sentence-Transformers model (config.json read as JSON)."""
    if ModelRef.of(model).is_reference:
        return False
    try:
        config = json.loads(Path(model, "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(config, dict):
        return False
    names = config.get("architectures")
    if isinstance(names, list) and EMBEDDING_ARCHITECTURES & set(map(str, names)):
        return True
    return config.get("model_type") == "qwen3_vl" and any(
        Path(model, f).is_file() for f in SENTENCE_TRANSFORMERS_FILES
    )
