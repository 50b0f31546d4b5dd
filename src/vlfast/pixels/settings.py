"""The one table of pixel settings: :class:`ProcessorConfig`, every number preprocessing uses, as data, and the
names of the rules and image processors it takes. Below every other pixels module. Imports neither torch nor
transformers (but for the two rules asked of transformers, on call)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from numbers import Integral, Real
from typing import Any

from vlfast.errors import InputRefused
from vlfast.models.ref import Answers

__all__ = [
    "IMAGE_BACKENDS",
    "IMAGE_PROCESSOR_SETTINGS",
    "IMAGE_READINGS",
    "PIXEL_SETTINGS",
    "THIN_IMAGES",
    "TORCHVISION_IMAGE_PROCESSORS",
    "TRANSPARENCIES",
    "VIDEO_RESAMPLES",
    "VIDEO_SIZINGS",
    "VIDEO_WRAPPERS",
    "ProcessorConfig",
    "transparency_rule",
    "video_wrapper_rule",
    "with_video_wrapper",
]

# transformers' torchvision image processors, whose operations vlfast.pixels.image reproduces
TORCHVISION_IMAGE_PROCESSORS = frozenset({"Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast"})
# The image backends one may ask for (--image-backend, VisionPreprocessor's image_backend), by the class each is
IMAGE_BACKENDS = {"torchvision": "Qwen2VLImageProcessor", "pil": "Qwen2VLImageProcessorPil"}

VIDEO_SIZINGS = ("processor", "qwen2-vl", "qwen-vl-utils")
# How smart_resize sizes a thin image (a side of at most half a merged patch): "processor" (transformers')
# rounds that side to 0 patches, then scales the image up to the minimum budget; "qwen-vl-utils" first raises
# it to one merged patch. A 12x2400 image at Qwen3-VL's budgets: grid (1, 2, 228), and (1, 2, 150)
THIN_IMAGES = ("processor", "qwen-vl-utils")
# How transformers' image processors turn a transparent image into RGB: "white", composited on white
# (transformers >= 5.21); "dropped", PIL's convert("RGB") (5.18-5.20)
TRANSPARENCIES = ("white", "dropped")
# How an image file becomes the PIL image the processor converts (pixels.engine.load_image): "vlfast"
# (vlfast extract's), or as a reference reads a path: "decode_image" (transformers' torchvision image
# processors), "load_image" (its PIL ones), "qwen-vl-utils" (its to_rgb)
IMAGE_READINGS = ("vlfast", "decode_image", "load_image", "qwen-vl-utils")
# What a prompt's video placeholder becomes: Qwen3VLProcessor expands the template's
# <|vision_start|><|video_pad|><|vision_end|> to one "<t seconds><|vision_start|>pads<|vision_end|>" block per
# temporal patch and either "kept" the template's wrapper around them (transformers 5.18-5.24) or "replaced"
# it by them (5.25+, as 4.57)
VIDEO_WRAPPERS = ("kept", "replaced")
# PIL resampling codes vlfast's video resize implements, by the torchvision mode transformers maps each to
VIDEO_RESAMPLES = {0: "nearest-exact", 2: "bilinear", 3: "bicubic"}
# A transformers Qwen-VL image processor's settings that change pixels (attributes, and a call's options), by
# the ProcessorConfig field each must equal ("size": the image budgets; "do_convert_rgb": True)
IMAGE_PROCESSOR_SETTINGS = {
    **{k: k for k in ("do_resize", "resample", "do_rescale", "rescale_factor", "do_normalize", "image_mean")},
    "image_std": "image_std",
    "min_pixels": "image_min_pixels",
    "max_pixels": "image_max_pixels",
    **{k: k for k in ("patch_size", "temporal_patch_size", "merge_size", "size", "do_convert_rgb")},
}


@dataclass(frozen=True)
class ProcessorConfig:
    """Every number preprocessing uses; recorded in the run config so a run is reproducible."""

    source: str  # where the numbers come from: the checkpoint's files read, or the family defaults
    image_processor: str  # class of the image processor built for images, e.g. "Qwen2VLImageProcessorPil"
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    image_min_pixels: int
    image_max_pixels: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    video_min_pixels: int
    video_max_pixels: int
    video_mean: tuple[float, ...]
    video_std: tuple[float, ...]
    frame_sampling: str  # "qwen3-vl" or "qwen2-vl": whose sample_frames rule
    fps: float | None = 2.0
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768
    rescale_factor: float = 1 / 255
    video_resize: str = "torch.nn.functional.interpolate(uint8, bicubic, antialias=True)"
    frames_list_fps: float = 24.0  # timestamps of a clip given as frame images (transformers' default)
    video_sizing: str = "processor"  # VIDEO_SIZINGS: the rule pixels.video.video_resize_shape applies
    # Images turned upright by their EXIF orientation tag, as transformers' load_image does for a path
    exif_orientation: bool = False
    # The processors' settings that change pixels, as the checkpoint's files (or the classes' defaults) give
    # them; resampling by PIL's codes (0 nearest, 2 bilinear, 3 bicubic)
    resample: int = 3
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True
    video_resample: int = 3
    video_do_resize: bool = True
    video_do_rescale: bool = True
    video_do_normalize: bool = True
    video_rescale_factor: float = 1 / 255
    transparency: str = "white"  # TRANSPARENCIES, as the installed transformers' rule
    image_reading: str = "vlfast"  # IMAGE_READINGS
    # A video's frames turned upright by its display matrix, as torchcodec (transformers' reader) turns them
    video_rotation: bool = False
    video_wrapper: str = "kept"  # VIDEO_WRAPPERS, as the installed transformers' rule
    # THIN_IMAGES: for vlfast's image path and videos sized "qwen2-vl" (the other sizings follow their own)
    thin_images: str = "qwen-vl-utils"

    def __post_init__(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_frames", "max_frames"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise InputRefused(f"{name} must be a positive int, got {v!r}")
        if self.frame_sampling not in ("qwen3-vl", "qwen2-vl", "qwen-vl-utils"):
            raise InputRefused(
                f"frame_sampling must be 'qwen3-vl', 'qwen2-vl' or 'qwen-vl-utils', got {self.frame_sampling!r}"
            )
        for name, allowed in (
            ("transparency", TRANSPARENCIES),
            ("image_reading", IMAGE_READINGS),
            ("video_sizing", VIDEO_SIZINGS),
            ("video_wrapper", VIDEO_WRAPPERS),
            ("thin_images", THIN_IMAGES),
        ):
            if getattr(self, name) not in allowed:
                raise InputRefused(
                    f"{name} must be one of {', '.join(map(repr, allowed))}, got {getattr(self, name)!r}"
                )
        if self.video_resample not in VIDEO_RESAMPLES:
            raise InputRefused(
                f"the video processor's resample is {self.video_resample!r} (from {self.source}); vlfast resizes videos "
                f"as transformers' torchvision backend does for {', '.join(f'{k} ({v})' for k, v in VIDEO_RESAMPLES.items())} "
                "only: set one of these in the checkpoint's video processor settings"
            )
        if self.video_sizing == "qwen-vl-utils" and self.video_resample != 3:
            raise InputRefused("qwen-vl-utils' video sizing resizes bicubic only (video_resample 3)")
        if (self.fps is None) == (self.num_frames is None):
            raise InputRefused("give exactly one of fps and num_frames for video sampling")
        _check_numbers(self)
        for what, lo, hi, flags in (
            ("image", self.image_min_pixels, self.image_max_pixels, "--min-pixels, --max-pixels"),
            ("video", self.video_min_pixels, self.video_max_pixels, "--video-max-pixels"),
        ):
            if not 0 < lo <= hi:
                raise InputRefused(
                    f"{what} pixel budget {lo:,} to {hi:,}: need 0 < {what}_min_pixels <= {what}_max_pixels "
                    f"(from {flags} or the checkpoint's processor files)"
                )

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def to_dict(self) -> dict[str, Any]:
        """The run configuration's ``processor`` entry (run.json; docs/format.md)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


# The processors' settings that change pixels, by their defaults
_STEPS = ("resample", "do_resize", "do_rescale", "do_normalize")
PIXEL_SETTINGS = {
    name: getattr(ProcessorConfig, name)
    for name in (*_STEPS, "do_convert_rgb", *(f"video_{k}" for k in (*_STEPS, "rescale_factor")))
}

# The float settings, each a finite number; those named positive also above 0
_FLOATS = {"fps": True, "frames_list_fps": True, "rescale_factor": False, "video_rescale_factor": False}
_FLOAT_TUPLES = ("image_mean", "image_std", "video_mean", "video_std")


def _check_numbers(cfg: ProcessorConfig) -> None:
    """InputRefused naming the first setting that is not a usable number."""
    for name, positive in _FLOATS.items():
        v = getattr(cfg, name)
        if v is None and name == "fps":
            continue
        if isinstance(v, bool) or not isinstance(v, Real) or not math.isfinite(v):
            raise InputRefused(f"{name} must be a finite number, got {v!r}")
        if positive and v <= 0:
            raise InputRefused(f"{name} must be positive, got {v}")
    for name in _FLOAT_TUPLES:
        values = getattr(cfg, name)
        if not all(isinstance(v, Real) and math.isfinite(v) for v in values):
            raise InputRefused(f"{name} must be finite numbers, got {values!r}")
    num = cfg.num_frames
    if num is not None and (isinstance(num, bool) or not isinstance(num, Integral) or num < 1):
        raise InputRefused(f"num_frames must be a whole number >= 1, got {num!r}")
    for name in ("image_min_pixels", "image_max_pixels", "video_min_pixels", "video_max_pixels"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, Integral):
            raise InputRefused(f"{name} must be a whole number of pixels, got {v!r}")


def transparency_rule() -> str:
    """How the installed transformers' image processors make a transparent image RGB: "white" or "dropped"
    (TRANSPARENCIES), asked of its own ``convert_to_rgb`` on a transparent black pixel."""
    import inspect

    import numpy as np
    from PIL import Image
    from transformers.image_transforms import convert_to_rgb

    pixel = Image.new("RGBA", (1, 1), (0, 0, 0, 0))
    # 5.21+: a PIL result is deprecated
    numpy = {"return_numpy": True} if "return_numpy" in inspect.signature(convert_to_rgb).parameters else {}
    value = np.asarray(convert_to_rgb(pixel, **numpy)).reshape(-1)[:3].tolist()
    rules = {(255, 255, 255): "white", (0, 0, 0): "dropped"}
    if tuple(value) in rules:
        return rules[tuple(value)]
    import transformers

    raise RuntimeError(
        f"transformers {transformers.__version__} makes a transparent black pixel {value}, neither white nor "
        "black: vlfast does not know this rule; install a transformers it does (5.18 or later), or report it"
    )


def with_video_wrapper(
    cfg: ProcessorConfig, family: str, prompts: bool, facts: Answers | None = None
) -> ProcessorConfig:
    """``cfg`` with the installed transformers' :func:`video_wrapper_rule` where a prompt holds it: a run
    that builds prompts for a Qwen3-VL family (any other keeps the default, so a vision-only OUT resumes
    under either rule). With ``facts`` (a ``ModelFacts``) the answer comes from OUT's record."""
    if not prompts or not family.startswith("qwen3"):
        return cfg
    rule = video_wrapper_rule() if facts is None else facts.answer("video wrapper", video_wrapper_rule)
    return replace(cfg, video_wrapper=rule)


def video_wrapper_rule() -> str:
    """How the installed transformers' ``Qwen3VLProcessor`` puts a video's expansion in a prompt
    (VIDEO_WRAPPERS): asked of its own ``get_text_with_replacements`` with nothing loaded."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    start, pad, end = "<|vision_start|>", "<|video_pad|>", "<|vision_end|>"
    probe = Qwen3VLProcessor.__new__(Qwen3VLProcessor)  # the text step reads only these four attributes
    vars(probe).update(
        image_token="<|image_pad|>", video_token=pad, vision_start_token=start, vision_end_token=end
    )
    blocks = f"<0.5 seconds>{start}{pad}{pad}{end}"
    (text,), _ = probe.get_text_with_replacements([f"a{start}{pad}{end}b"], videos_replacements=[blocks])
    rules = {f"a{start}{blocks}{end}b": "kept", f"a{blocks}b": "replaced"}
    if text in rules:
        return rules[text]
    import transformers

    raise RuntimeError(
        f"transformers {transformers.__version__}'s Qwen3VLProcessor expands a video in a prompt as {text!r}, "
        "neither keeping nor replacing the chat template's wrapper: vlfast does not know this rule; install a "
        "transformers it does (5.18 or later), or report it"
    )
