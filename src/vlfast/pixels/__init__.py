"""Pixels: what a Qwen-VL processor makes of images and videos, bit for bit; below extraction and switches.

- ``settings``: the one table of pixel settings (:class:`ProcessorConfig`) and the rules' names (no torch).
- ``recipe``: Qwen3-VL-Embedding's pixel numbers, and whether a checkpoint is one.
- ``media``: media read in place (a path, or a :class:`MediaObject`) and :class:`SampleError`.
- ``image``, ``video``, ``truncation``: images and videos as transformers' processors prepare them.
- ``finish``: one path that makes deferred uint8 patches the model's pixel_values where they land.
- ``engine``: the settings built from a checkpoint's files (:func:`build_processor_config`) and the
  :class:`Preprocessor` that turns one input into pixel values.
- ``preprocessor``: :class:`VisionPreprocessor`, the data-loader face.
- ``adapter``: a transformers image processor whose calls a VisionPreprocessor answers, and their count.

Importing this package is free: each public name loads its module on first use.
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
