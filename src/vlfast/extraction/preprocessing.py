"""The image and video half of a Qwen-VL processor, for training data loaders: the inputs and outputs of
transformers' processor, the pixels of its torchvision backend, bit for bit, at the cost of vlfast's own path.

    pre = vlfast.VisionPreprocessor("Qwen3-VL-4B-Instruct")     # a local checkpoint, or "ref:qwen3-vl-4b"
    out = pre(images=["a.jpg", pil_image], videos=["clip.mp4"])
    out["pixel_values"], out["image_grid_thw"], out["pixel_values_videos"], out["video_grid_thw"]

The numbers come from the checkpoint's processor files, as ``vlfast extract`` reads them
(:func:`~vlfast.extraction.decode.preprocess.build_processor_config`); images by path are turned upright by
their EXIF orientation, as transformers' ``load_image`` does, PIL images are taken as they are, as its
processor takes them; videos are decoded with PyAV and sampled by the family's ``sample_frames`` (2 fps by
default). The object pickles small (DataLoader workers, spawn or fork) and holds no open file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlfast.errors import InputRefused

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from vlfast.extraction.decode.preprocess import Preprocessor

__all__ = ["VisionPreprocessor"]

_BACKENDS = {"torchvision": "Qwen2VLImageProcessor", "pil": "Qwen2VLImageProcessorPil"}


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
    # "float32": transformers' outputs. "uint8": the patches before the rescale and normalisation, uint8: a
    # video's (N, C, T*P*P), a quarter of the bytes to collate, pin and copy, an image's (N, C, P*P), each patch
    # once, an eighth; finish() makes them float32 (N, C*T*P*P) where they land, the temporal repeat included.
    pixels: str = "float32"
    _pre: Preprocessor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.image_backend not in _BACKENDS:
            raise InputRefused(f"image_backend must be torchvision or pil, got {self.image_backend!r}")
        if self.pixels not in ("float32", "uint8"):
            raise InputRefused(f"pixels must be float32 or uint8, got {self.pixels!r}")
        if self.pixels == "uint8" and self.image_backend != "torchvision":
            raise InputRefused(
                "pixels='uint8' needs image_backend='torchvision' (the PIL processor returns float32)"
            )
        from vlfast.extraction.decode.preprocess import Preprocessor, build_processor_config
        from vlfast.extraction.plan import family_of

        model = self.model if self.model.startswith("ref:") else str(Path(self.model).resolve())
        cfg = build_processor_config(
            model,
            family=family_of(model),
            fps=self.fps,
            num_frames=self.num_frames,
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
            video_max_pixels=self.video_max_pixels,
            exif_orientation=True,
            image_processor=_BACKENDS[self.image_backend],
        )
        self._pre = Preprocessor(
            cfg,
            image_processor_dir=None if model.startswith("ref:") else model,
            defer_video_normalize=self.pixels == "uint8",
        )

    @classmethod
    def from_pretrained(cls, model: str | Path, **options: Any) -> VisionPreprocessor:
        return cls(str(model), **options)

    @property
    def config(self):
        """The :class:`~vlfast.extraction.decode.processor_config.ProcessorConfig` every number comes from."""
        return self._pre.cfg

    def __call__(self, images: list | None = None, videos: list | None = None) -> dict[str, torch.Tensor]:
        """Images (paths, or PIL images) and videos (paths, or lists of frame image paths) -> tensors, each
        input's rows in order; raises :class:`~vlfast.extraction.decode.media.SampleError` naming a file
        that cannot be read."""
        import torch

        from vlfast.extraction.sources.sample import Sample

        out: dict[str, torch.Tensor] = {}
        if images:
            rows, grids = zip(*(_named(self._image, x) for x in images))
            out["pixel_values"] = _cat(rows)
            out["image_grid_thw"] = torch.tensor(grids, dtype=torch.long)
        if videos:
            rows, grids = [], []
            for x in videos:
                paths = (str(x),) if isinstance(x, (str, Path)) else tuple(str(p) for p in x)
                kind = "video" if isinstance(x, (str, Path)) else "frames"
                pixels, grid, _ = _named(self._pre, Sample(id=paths[0], kind=kind, paths=paths))
                rows.append(pixels)
                grids.append(grid)
            out["pixel_values_videos"] = _cat(rows)
            out["video_grid_thw"] = torch.tensor(grids, dtype=torch.long)
        return out

    def finish(self, batch: dict[str, torch.Tensor], device: str | torch.device | None = None) -> dict:
        """``batch`` (this object's outputs, collated) with uint8 pixel values made float32 on ``device`` (by
        default where they are): bit-equal to the float32 outputs (the rescale and normalisation are exact
        IEEE operations on any device). Other entries are moved to ``device`` as they are."""
        import torch

        from vlfast.extraction.decode.image import normalize_image_patches
        from vlfast.extraction.decode.video import normalize_video_patches

        out = {}
        for key, value in batch.items():
            if hasattr(value, "to") and device is not None:
                value = value.to(device, non_blocking=True)
            if key == "pixel_values" and value.dtype == torch.uint8:
                value = normalize_image_patches(value, self.config)
            elif key == "pixel_values_videos" and value.dtype == torch.uint8:
                value = normalize_video_patches(value, self.config)
            out[key] = value
        return out

    def as_image_processor(self, base: Any = None) -> Any:
        """``base``, a transformers Qwen-VL image processor (the one in your processor:
        ``processor.image_processor``; by default the checkpoint's ``AutoImageProcessor``), answering its calls
        with this object: the same class and methods (``fetch_images``, ``get_number_of_image_patches``,
        ``merge_size`` for the placeholder count), this object's pixels and budgets. So

            processor.image_processor = pre.as_image_processor(processor.image_processor)

        gives vlfast's path to everything that calls the processor or its image processor (TRL's collators, a
        Dataset under HF Trainer, LlamaFactory's ``mm_plugin``). Its images are PIL images, paths, or uint8
        arrays (H, W, C) and tensors (C, H, W); a pixel setting passed to a call (``size=``, ``max_pixels=``,
        ``do_normalize=``, ...) other than this object's is refused: set it here. It pickles (DataLoader
        workers)."""
        if base is None:
            base = self._checkpoint_image_processor()
        cfg = self.config
        for name in ("patch_size", "merge_size", "temporal_patch_size"):
            theirs = getattr(base, name, None)
            if theirs is not None and int(theirs) != int(getattr(cfg, name)):
                raise InputRefused(
                    f"{type(base).__name__} has {name}={theirs}, {self.model} {getattr(cfg, name)}: pass the image "
                    "processor of the same checkpoint"
                )
        return _adapted(self, base)

    def _checkpoint_image_processor(self) -> Any:
        from transformers import AutoImageProcessor

        if self.model.startswith("ref:"):
            raise InputRefused(
                f"{self.model} has no processor files: pass the image processor to adapt "
                "(as_image_processor(processor.image_processor))"
            )
        return AutoImageProcessor.from_pretrained(str(Path(self.model).resolve()))

    def _image(self, x) -> tuple[torch.Tensor, tuple[int, int, int]]:
        if isinstance(x, (str, Path)):
            pixels, grid, _ = self._pre.image(str(x))
            return pixels, grid
        from vlfast.extraction.decode.preprocess import conformed_image

        pixels, grid, _ = self._pre.pil_image(conformed_image(x))
        return pixels, grid


def _cat(rows):
    """The rows of every input, in order: one input's tensor as it is (torch.cat would copy it: 50 MB of float32
    for a 1080p image)."""
    import torch

    return rows[0] if len(rows) == 1 else torch.cat(rows)


def _named(fn, x):
    """``fn(x)``, its SampleError naming the input (a data loader's traceback then says which file)."""
    from vlfast.extraction.decode.media import SampleError

    try:
        return fn(x)
    except SampleError as e:
        what = x.paths[0] if hasattr(x, "paths") else x if isinstance(x, (str, Path)) else type(x).__name__
        raise SampleError(f"{what}: {e}") from None


# A pixel setting a call may carry, and the ProcessorConfig number it must equal (None: any value refused)
_CALL_SETTINGS = {
    "do_resize": "do_resize",
    "resample": "resample",
    "do_rescale": "do_rescale",
    "rescale_factor": "rescale_factor",
    "do_normalize": "do_normalize",
    "image_mean": "image_mean",
    "image_std": "image_std",
    "min_pixels": "image_min_pixels",
    "max_pixels": "image_max_pixels",
    "patch_size": "patch_size",
    "temporal_patch_size": "temporal_patch_size",
    "merge_size": "merge_size",
    "size": None,
    "do_convert_rgb": None,
}


def _adapted(pre: VisionPreprocessor, base: Any) -> Any:
    """A copy of ``base`` whose class is a subclass of ``base``'s answering calls with ``pre``."""
    import copy

    base_cls = type(base)
    cls = _ADAPTED.get(base_cls)
    if cls is None:
        cls = type(
            f"Vlfast{base_cls.__name__}",
            (base_cls,),
            {
                "__call__": _adapted_call,
                "preprocess": _adapted_call,
                "__reduce__": _adapted_reduce,
                "__module__": __name__,
                "__doc__": f"{base_cls.__name__} whose calls vlfast.VisionPreprocessor answers.",
            },
        )
        _ADAPTED[base_cls] = cls
    out = copy.copy(base)
    out.__class__ = cls
    out._vlfast = pre
    cfg = pre.config
    # the budgets the placeholder count reads (get_number_of_image_patches) are the ones the pixels follow
    if isinstance(getattr(out, "size", None), dict) and "longest_edge" in out.size:
        out.size = {**out.size, "shortest_edge": cfg.image_min_pixels, "longest_edge": cfg.image_max_pixels}
    for name, value in (("min_pixels", cfg.image_min_pixels), ("max_pixels", cfg.image_max_pixels)):
        if getattr(out, name, None) is not None:
            setattr(out, name, value)
    return out


_ADAPTED: dict[type, type] = {}


def _adapted_reduce(self):
    base = self.__class__.__mro__[1]
    state = {k: v for k, v in self.__dict__.items() if k != "_vlfast"}
    return (_rebuilt, (self._vlfast, base, state))


def _rebuilt(pre: VisionPreprocessor, base_cls: type, state: dict) -> Any:
    base = base_cls.__new__(base_cls)
    base.__dict__.update(state)
    return _adapted(pre, base)


def _adapted_call(self, images=None, *args, return_tensors=None, **kwargs):
    """``images`` -> BatchFeature of ``pixel_values`` and ``image_grid_thw``, by vlfast.VisionPreprocessor."""
    import numpy as np
    import torch
    from PIL import Image
    from transformers.feature_extraction_utils import BatchFeature

    pre: VisionPreprocessor = self._vlfast
    if args:
        raise TypeError(f"{type(self).__name__}: pass options by name, got {len(args)} more positional")
    cfg = pre.config
    for key, value in kwargs.items():
        if value is None:
            continue
        if key not in _CALL_SETTINGS:
            if key in ("data_format", "input_data_format", "device", "disable_grouping"):
                continue  # layout and grouping: the output is the same
            raise InputRefused(f"{type(self).__name__}: vlfast does not take {key}={value!r} in a call")
        name = _CALL_SETTINGS[key]
        if name is None or not _same(value, getattr(cfg, name)):
            ours = getattr(cfg, name) if name else "the checkpoint's"
            raise InputRefused(
                f"{type(self).__name__}: {key}={value!r} in a call, where this VisionPreprocessor has {ours}: "
                "set it on the VisionPreprocessor instead"
            )
    if images is None:
        raise InputRefused(f"{type(self).__name__}: no images given")
    flat = []
    for item in images if isinstance(images, (list, tuple)) else [images]:
        flat.extend(item if isinstance(item, (list, tuple)) else [item])
    conformed = []
    for x in flat:
        if isinstance(x, torch.Tensor):
            x = x.numpy().transpose(1, 2, 0) if x.dim() == 3 and x.shape[0] in (1, 3) else x.numpy()
        if isinstance(x, np.ndarray):
            if x.dtype != np.uint8 or x.ndim != 3 or x.shape[-1] not in (1, 3):
                raise InputRefused(
                    f"{type(self).__name__}: an array of shape {x.shape} and dtype {x.dtype}: pass uint8 "
                    "(H, W, C) or (C, H, W) with 1 or 3 channels, a PIL image or a path"
                )
            x = Image.fromarray(x if x.shape[-1] == 3 else x[..., 0])
        conformed.append(x)
    out = pre(images=conformed)
    return BatchFeature(
        {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]},
        tensor_type=return_tensors,
    )


def _same(value, ours) -> bool:
    if isinstance(ours, (tuple, list)):
        try:
            return [float(v) for v in value] == [float(v) for v in ours]
        except TypeError:
            return False
    return value == ours
