"""Images as transformers' torchvision image processor (``Qwen2VLImageProcessor``, every Qwen-VL family's)
prepares them, bit for bit, without torchvision and in a cheaper order.

transformers: PIL image -> RGB -> uint8 tensor -> ``smart_resize`` -> torchvision's ``resize`` (on CPU uint8
the ATen kernel ``F.interpolate`` runs) -> float32 rescale and normalise -> patchify, each patch repeated
``temporal_patch_size`` times: 24 bytes a pixel. Here: the same resize on the uint8 pixels as decoded, the
patch permutation on uint8, then the normalisation (elementwise per channel, so it commutes with the move)
written once per patch and copied into the other temporal slots; or, deferred, the uint8 patches (3 bytes a
pixel) are normalised on the model's device (:func:`~vlfast.pixels.video.normalize_patches`). Proven
against the class itself in tests/test_preprocess_parity.py.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import torch

from vlfast.pixels.media import MAX_ASPECT_RATIO, SampleError, checked_media
from vlfast.pixels.settings import ProcessorConfig
from vlfast.pixels.video import normalize_patches, patch_rows, resize_frames, smart_resize

__all__ = ["image_patches", "jpeg_rgb", "orientation_tag", "rgb_tensor", "same_normalization"]

# PIL.ImageOps.exif_transpose's turns, by EXIF orientation, on an (H, W, C) array: the same moves of pixels
_EXIF_TURNS = {
    2: lambda a: a[:, ::-1],  # FLIP_LEFT_RIGHT
    3: lambda a: a[::-1, ::-1],  # ROTATE_180
    4: lambda a: a[::-1],  # FLIP_TOP_BOTTOM
    5: lambda a: a.transpose(1, 0, 2),  # TRANSPOSE
    6: lambda a: a.transpose(1, 0, 2)[:, ::-1],  # ROTATE_270
    7: lambda a: a.transpose(1, 0, 2)[::-1, ::-1],  # TRANSVERSE
    8: lambda a: a.transpose(1, 0, 2)[::-1],  # ROTATE_90
}


def jpeg_rgb(path, exif_orientation: bool) -> tuple[torch.Tensor, dict] | None:
    """A baseline or progressive RGB or grayscale JPEG decoded by libjpeg-turbo straight into an array
    (simplejpeg: about half PIL's time, the same pixels, both being libjpeg-turbo with its defaults), turned
    by its EXIF orientation as PIL's exif_transpose turns it: ``((3, H, W) uint8, meta)``. None where PIL
    should read it instead: simplejpeg not installed, another format or mode, a header PIL refuses, or data
    simplejpeg calls corrupt."""
    try:
        import simplejpeg
    except ImportError:
        return None
    from PIL import Image

    checked_media(path)
    try:
        data = open(path, "rb").read() if isinstance(path, str) else path.read_bytes()  # noqa: SIM115
        img = Image.open(io.BytesIO(data))  # the header only: format, mode, size, EXIF; the bomb guard
        if img.format != "JPEG" or img.mode not in ("RGB", "L"):
            return None
        orientation = orientation_tag(img) if exif_orientation else None
        arr = simplejpeg.decode_jpeg(data, colorspace="RGB")
    except Exception:  # noqa: BLE001 - PIL reads it again and reports what is wrong, as for any image
        return None
    if orientation in _EXIF_TURNS:
        arr = np.ascontiguousarray(_EXIF_TURNS[orientation](arr))
    height, width = arr.shape[:2]
    if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        return None  # refused by the PIL path, with its message
    meta = {"width": width, "height": height, "mode": img.mode}
    return torch.from_numpy(arr).permute(2, 0, 1), meta


def orientation_tag(img) -> int | None:
    """The EXIF orientation tag (None: none), or 0 where the EXIF block cannot be read (exif_transpose then
    raises its own error, recorded as the sample's)."""
    try:
        return img.getexif().get(0x0112)
    except Exception:  # noqa: BLE001 - only this file's EXIF block is parsed here: its data, not a bug
        return 0


def rgb_tensor(img, transparency: str = "white") -> torch.Tensor:
    """(3, H, W) uint8 with channels-last strides (PIL's own layout, not copied), as transformers' torchvision
    image processor converts a PIL image (``convert_to_rgb``) by ``transparency``
    (:data:`~vlfast.pixels.settings.TRANSPARENCIES`): "white", transparency composited on white (transformers
    >= 5.21); "dropped", PIL's ``convert("RGB")`` (5.18-5.20). Other modes are converted by PIL either way."""
    from PIL import Image

    if transparency == "dropped":
        img = img if img.mode == "RGB" else img.convert("RGB")
    elif img.mode != "RGB" or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255))
        img = Image.alpha_composite(background, rgba).convert("RGB")
    # PIL's buffer, read-only: nothing here writes to it (the resize makes a new tensor)
    arr = np.asarray(img)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(arr).permute(2, 0, 1)


def image_patches(
    pixels: torch.Tensor, cfg: ProcessorConfig, *, normalize: bool = True
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """(3, H, W) uint8 -> pixel_values (h*w, C*T*P*P) float32 and grid (1, h, w), as ``Qwen2VLImageProcessor``
    with ``cfg``'s image settings; with ``normalize=False`` uint8 (h*w, C, P*P), each patch once (3 bytes a
    pixel), for :func:`~vlfast.pixels.video.normalize_patches` to finish (on the device) with the temporal repeat."""
    height, width = int(pixels.shape[-2]), int(pixels.shape[-1])
    factor = cfg.factor
    if cfg.do_resize:
        try:
            h, w = smart_resize(
                height, width, factor, cfg.image_min_pixels, cfg.image_max_pixels, cfg.thin_images
            )
        except SampleError as e:
            raise SampleError(f"the image processor refused a {width}x{height} image: {e}") from None
        pixels = resize_frames(pixels[None], (h, w), cfg.resample)[0]
    elif height % factor or width % factor:
        raise SampleError(
            f"a {width}x{height} image is not a multiple of {factor} (patch x merge) and the image processor's "
            "do_resize is false: resize the image, or set do_resize in the checkpoint's preprocessor_config.json"
        )
    else:
        h, w = height, width
    p = cfg.patch_size
    x = patch_rows(pixels[None], 1, p, cfg.merge_size)  # each patch once: the normalisation repeats it
    return (normalize_patches(x, cfg, images=True) if normalize else x), (1, h // p, w // p)


def same_normalization(cfg: ProcessorConfig) -> bool:
    """Whether images and videos are normalised alike, so deferred image patches can be finished by the video
    normalisation the model side applies to every uint8 input."""
    return (
        tuple(cfg.image_mean) == tuple(cfg.video_mean)
        and tuple(cfg.image_std) == tuple(cfg.video_std)
        and (cfg.do_rescale, cfg.do_normalize) == (cfg.video_do_rescale, cfg.video_do_normalize)
        and (not cfg.do_rescale or cfg.rescale_factor == cfg.video_rescale_factor)
    )
