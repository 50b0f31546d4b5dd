"""The image and video half of a Qwen-VL processor, for training data loaders: the inputs and outputs of
transformers' processor, the pixels of its torchvision backend, bit for bit, at the cost of vlfast's own path.

    pre = vlfast.VisionPreprocessor("Qwen3-VL-4B-Instruct")     # a local checkpoint, or "ref:qwen3-vl-4b"
    out = pre(images=["a.jpg", pil_image], videos=["clip.mp4"])
    out["pixel_values"], out["image_grid_thw"], out["pixel_values_videos"], out["video_grid_thw"]

The numbers come from the checkpoint's processor files, as ``vlfast extract`` reads them; images by path
are turned upright by their EXIF orientation, as transformers' ``load_image`` does; videos are decoded with
PyAV and sampled by the family's ``sample_frames``. The object pickles small and holds no open file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlfast.errors import InputRefused
from vlfast.models.ref import ModelRef, family_of
from vlfast.pixels.adapter import conformed_inputs
from vlfast.pixels.media import SampleError
from vlfast.pixels.settings import IMAGE_BACKENDS, TORCHVISION_IMAGE_PROCESSORS

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from vlfast.pixels.engine import Preprocessor

__all__ = ["VisionPreprocessor"]


@dataclass
class VisionPreprocessor:
    """``pixel_values``/``image_grid_thw`` and ``pixel_values_videos``/``video_grid_thw`` (float32 on CPU,
    int64) for a batch of images and videos, equal to transformers' processor of ``model`` with
    ``image_backend`` (torchvision: its default for Qwen-VL, done here without torchvision; pil: its PIL
    processor, which runs). ``fps`` or ``num_frames`` sample videos; the pixel budgets override the files'."""

    model: str
    fps: float | None = None
    num_frames: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    video_max_pixels: int | None = None
    image_backend: str = "torchvision"
    # "float32": transformers' outputs. "uint8": the patches before the rescale and normalisation, a video's
    # (N, C, T*P*P), an image's (N, C, P*P), each patch once; finish() makes them float32 where they land.
    pixels: str = "float32"
    _pre: Preprocessor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.image_backend not in IMAGE_BACKENDS:
            raise InputRefused(f"image_backend must be torchvision or pil, got {self.image_backend!r}")
        if self.pixels not in ("float32", "uint8"):
            raise InputRefused(f"pixels must be float32 or uint8, got {self.pixels!r}")
        if self.pixels == "uint8" and self.image_backend != "torchvision":
            raise InputRefused(
                "pixels='uint8' needs image_backend='torchvision' (the PIL processor returns float32)"
            )
        from vlfast.pixels.engine import Preprocessor, build_processor_config

        ref = ModelRef.of(self.model)
        model = ref.spec
        asked = ("fps", "num_frames", "min_pixels", "max_pixels", "video_max_pixels")
        cfg = build_processor_config(
            model,
            family=family_of(model),
            **{k: getattr(self, k) for k in asked},
            exif_orientation=True,
            image_processor=IMAGE_BACKENDS[self.image_backend],
            # a path read as transformers' processor of that backend reads it (its fetch_images)
            image_reading="decode_image" if self.image_backend == "torchvision" else "load_image",
        )
        self._pre = Preprocessor(
            cfg,
            image_processor_dir=None if ref.is_reference else model,
            defer_video_normalize=self.pixels == "uint8",
            refuse_short_clips=True,
        )

    @classmethod
    def from_pretrained(cls, model: str | Path, **options: Any) -> VisionPreprocessor:
        return cls(str(model), **options)

    @property
    def config(self):
        """The :class:`~vlfast.pixels.settings.ProcessorConfig` every number comes from."""
        return self._pre.cfg

    def __call__(self, images: list | None = None, videos: list | None = None) -> dict[str, torch.Tensor]:
        """Images (paths, PIL images, uint8 arrays (H, W, C), (C, H, W) or (H, W) and such tensors; nested
        lists flattened) and videos (paths, or lists of frame image paths) -> tensors, each input's rows in
        order; raises :class:`~vlfast.pixels.media.SampleError` naming a file that cannot be read (or a clip
        transformers' processor refuses), and :class:`~vlfast.errors.InputRefused` naming an input of a kind
        it does not take. An array whose first axis is 1 or 3 long is (C, H, W), as transformers infers it,
        even where its last is too: (3, W, 3) is 3 channels of 3 x W. A thin image is sized as transformers'
        processor sizes it (``config.thin_images``)."""
        import torch

        out: dict[str, torch.Tensor] = {}
        if images is not None and not isinstance(images, (list, tuple)):
            images = [images]
        if images:
            conformed, why = conformed_inputs(images, "VisionPreprocessor")
            if why is not None:
                raise InputRefused(why)
            rows, grids = self._images(conformed)
            out["pixel_values"] = rows
            out["image_grid_thw"] = torch.tensor(grids, dtype=torch.long)
        if videos is not None and not isinstance(videos, (list, tuple)):
            videos = [videos]
        if videos:
            samples = [_video_sample(x) for x in videos]  # every input checked before any is decoded
            rows, grids, _ = zip(*(_named(self._pre, sample) for sample in samples))
            out["pixel_values_videos"] = _cat(rows)
            out["video_grid_thw"] = torch.tensor(grids, dtype=torch.long)
        return out

    def finish(
        self,
        batch: dict[str, torch.Tensor],
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> dict:
        """``batch`` (this object's outputs, collated) with uint8 pixel values made float32 on ``device`` (by
        default where they are): bit-equal to the float32 outputs. With ``dtype`` (the model's) the pixel
        values are written in it directly, rounded as ``.to(dtype)`` rounds the float32 ones. Other entries
        are moved to ``device`` as they are."""
        from vlfast.pixels.finish import finish_pixels

        _check_batch(batch)
        out = {}
        for key, value in batch.items():
            if key in ("pixel_values", "pixel_values_videos"):
                images = key == "pixel_values"
                value = finish_pixels([value], self.config, images=images, device=device, dtype=dtype)
            elif hasattr(value, "to") and device is not None:
                value = value.to(device, non_blocking=True)
            out[key] = value
        return out

    def as_image_processor(self, base: Any = None) -> Any:
        """``base``, a transformers Qwen-VL image processor (by default the checkpoint's
        ``AutoImageProcessor``), answering its calls with this object's pixels and budgets, its class and
        methods kept. So ``processor.image_processor = pre.as_image_processor(processor.image_processor)``
        gives vlfast's path to everything that calls the processor (TRL's collators, HF Trainer, LlamaFactory).
        Its images are PIL images, paths, or uint8 arrays (H, W, C) and tensors (C, H, W), their channel axis
        inferred as transformers infers it or as a call's ``input_data_format`` says. A pixel setting passed
        to a call other than this object's is refused: set it here. ``base`` may be a processor holding such
        an image processor; anything else (a tokenizer, a video processor) is refused. It pickles."""
        from vlfast.pixels.adapter import as_image_processor

        return as_image_processor(self, base)

    def _images(self, images: list) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """Every image's rows in one tensor, and their grids. Several float32 images through the torchvision
        path are normalised straight into that tensor from their uint8 patches, with no ``torch.cat`` copy."""
        import torch

        from vlfast.pixels.finish import finish_pixels

        cfg = self._pre.cfg
        if (
            len(images) == 1
            or self.pixels == "uint8"
            or cfg.image_processor not in TORCHVISION_IMAGE_PROCESSORS
        ):
            rows, grids = zip(*(_named(self._image, x) for x in images))
            return _cat(rows), list(grids)
        raw = dataclasses.replace(self._pre, defer_video_normalize=True)
        parts, grids = zip(*(_named(lambda y: self._image(y, raw), x) for x in images))
        # the image settings: whether videos normalise alike does not matter
        return finish_pixels(parts, cfg, images=True, dtype=torch.float32), list(grids)

    def _image(self, x, pre=None) -> tuple[torch.Tensor, tuple[int, int, int]]:
        from vlfast.pixels.engine import conformed_image

        pre = self._pre if pre is None else pre
        if isinstance(x, (str, Path)):
            pixels, grid, _ = pre.image(str(x))
        else:
            pixels, grid, _ = pre.pil_image(conformed_image(x, keep_mode=True))
        return pixels, grid


def _check_batch(batch: Any) -> None:
    """InputRefused where ``finish`` is given anything but a mapping whose pixel entries are tensors."""
    import torch

    if not hasattr(batch, "items"):
        raise InputRefused(
            f"finish: given a {type(batch).__name__}; pass the dict this VisionPreprocessor returns (collated), "
            "e.g. finish(batch, device='cuda')"
        )
    for key in ("pixel_values", "pixel_values_videos"):
        value = batch.get(key)
        if value is not None and not isinstance(value, torch.Tensor):
            raise InputRefused(
                f"finish: {key} is a {type(value).__name__}, not a tensor: pass this VisionPreprocessor's "
                "outputs (collated)"
            )


def _video_sample(x):
    """A video input (a file path, or a list of frame image paths) as a Clip; InputRefused naming anything else."""
    from vlfast.pixels.engine import Clip

    if isinstance(x, (str, Path)):
        return Clip(kind="video", paths=(str(x),))
    frames = x if isinstance(x, (list, tuple)) else [x]
    if not frames or not all(isinstance(f, (str, Path)) for f in frames):
        kinds = ", ".join(sorted({type(f).__name__ for f in frames}))
        what = f"a {type(x).__name__} of {kinds}" if frames is x else f"a {type(x).__name__}"
        raise InputRefused(
            f"VisionPreprocessor: a video given as {what if frames else 'an empty list'}: pass video file "
            "paths, or lists of frame image paths (vlfast decodes and samples them)"
        )
    return Clip(kind="frames", paths=tuple(str(f) for f in frames))


def _cat(rows):
    """The rows of every input, in order: one input's tensor as it is (torch.cat would copy it)."""
    import torch

    return rows[0] if len(rows) == 1 else torch.cat(rows)


def _named(fn, x):
    """``fn(x)``, its SampleError naming the input (a data loader's traceback then says which file)."""
    try:
        return fn(x)
    except SampleError as e:
        what = x.paths[0] if hasattr(x, "paths") else x if isinstance(x, (str, Path)) else type(x).__name__
        raise SampleError(f"{what}: {e}") from None
