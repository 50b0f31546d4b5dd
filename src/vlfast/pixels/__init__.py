"""Pixels: what a Qwen-VL processor makes of images and videos, bit for bit; below extraction and switches
(its modules: docs/internals.md). Importing this package is free: each public name loads its module on first
use.
"""

from __future__ import annotations

from vlfast._lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(
        ["IMAGE_BACKENDS", "PIXEL_SETTINGS", "TORCHVISION_IMAGE_PROCESSORS", "ProcessorConfig"], "settings"
    ),
    **dict.fromkeys(["Media", "MediaObject", "SampleError"], "media"),
    **dict.fromkeys(["RECIPE_PIXELS", "is_embedding_checkpoint"], "recipe"),
    **dict.fromkeys(["Clip", "Preprocessor", "build_processor_config", "load_image"], "engine"),
    "finish_pixels": "finish",
    "VisionPreprocessor": "preprocessor",
    **dict.fromkeys(["as_image_processor", "pixel_settings"], "adapter"),
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
