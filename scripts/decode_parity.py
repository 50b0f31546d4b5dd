"""Check that transformers' torchvision image processors read an image path to the pixels PIL reads.

Given a path, transformers' torchvision image processor (``fetch_images``) decodes it with torchcodec's or
torchvision's ``decode_image`` in RGB mode (``transformers.image_utils.load_image_as_tensor``, torchcodec when
>= 0.16 loads); ``VisionPreprocessor`` and the parity tests read it with PIL (``load_image``). Neither decoder
loads beside the CPU torch wheel the tests run on (their C++ libraries link CUDA torch), so no test can call
them; this script does, in the venv ``benchmarks/torchcodec_env.sh`` makes (CUDA torch, which runs without a
GPU). It writes files of every kind vlfast's tests use (JPEG baseline, progressive, 4:4:4, grayscale, CMYK;
PNG in every 8-bit mode, with alpha, palette and colour-key transparency; 16-bit PNG; GIF; WebP; each EXIF
turn), decodes each both ways and prints one line per file; then clips whose display matrix turns them
(0, 90, 180, 270 degrees), every frame through transformers' ``load_video`` with torchcodec against vlfast's
decode, turned; exit 1 where an 8-bit file or a clip differs.

    bash benchmarks/torchcodec_env.sh /tmp/tcvenv
    PYTHONPATH=/tmp/tcvenv/reference-torchvision:/tmp/tcvenv/reference-torchcodec \\
        /tmp/tcvenv/bin/python scripts/decode_parity.py          # torchcodec
    PYTHONPATH=/tmp/tcvenv/reference-torchvision /tmp/tcvenv/bin/python scripts/decode_parity.py  # torchvision
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np


def files(folder: Path) -> dict[str, Path]:
    from PIL import Image

    from vlfast.demo import pattern

    rgb = pattern(240, 320, 3)
    ramp = np.arange(240 * 320, dtype=np.uint32).reshape(240, 320) % 65536
    alpha = (np.arange(320)[None, :].repeat(240, 0) % 256).astype(np.uint8)
    rgba = Image.fromarray(np.dstack([rgb, alpha]), "RGBA")
    gray = Image.fromarray(rgb).convert("L")
    made = {
        "baseline.jpg": (Image.fromarray(rgb), {"quality": 90}),
        "progressive.jpg": (Image.fromarray(rgb), {"quality": 90, "progressive": True}),
        "444.jpg": (Image.fromarray(rgb), {"quality": 100, "subsampling": 0}),
        "gray.jpg": (gray, {"quality": 90}),
        "cmyk.jpg": (Image.fromarray(rgb).convert("CMYK"), {"quality": 90}),
        "rgb.png": (Image.fromarray(rgb), {}),
        "gray.png": (gray, {}),
        "bilevel.png": (Image.fromarray(rgb).convert("1"), {}),
        "palette.png": (Image.fromarray(rgb).convert("P"), {}),
        "rgba.png": (rgba, {}),
        "la.png": (rgba.convert("LA"), {}),
        "palette_transparent.png": (Image.fromarray(rgb).convert("P"), {"transparency": 0}),
        "rgb_colour_key.png": (Image.fromarray(rgb), {"transparency": tuple(int(v) for v in rgb[0, 0])}),
        "gray_colour_key.png": (gray, {"transparency": int(gray.getpixel((0, 0)))}),
        "sixteen_bit.png": (Image.fromarray(ramp.astype(np.uint16)), {}),  # every low byte
        "animated.gif": (Image.fromarray(rgb).convert("P"), {}),
        "lossless.webp": (Image.fromarray(rgb), {"lossless": True}),
    }
    for turn in range(2, 9):
        exif = Image.Exif()
        exif[0x0112] = turn
        made[f"exif{turn}.jpg"] = (Image.fromarray(pattern(200, 300, turn)), {"quality": 90, "exif": exif})
        made[f"exif{turn}.png"] = (Image.fromarray(pattern(200, 300, turn)), {"exif": exif})
    out = {}
    for name, (img, kw) in made.items():
        img.save(folder / name, **kw)
        out[name] = folder / name
    return out


def main() -> int:
    import torch
    from transformers.image_utils import load_image, load_image_as_tensor
    from transformers.utils.import_utils import is_torchcodec_available

    from vlfast.pixels.engine import load_image as vlfast_load_image

    print(
        f"torch {torch.__version__}; decoder: {'torchcodec' if is_torchcodec_available() else 'torchvision'}"
    )
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in files(Path(tmp)).items():
            pil = torch.from_numpy(np.array(load_image(str(path)))).permute(2, 0, 1)
            decoded = load_image_as_tensor(str(path))
            same = decoded.dtype == pil.dtype and decoded.shape == pil.shape and torch.equal(decoded, pil)
            note = ""
            if not same and name.startswith("sixteen_bit"):
                # vlfast extract scales a 16-bit image to 8 bits (pixels.engine.load_image); where that
                # equals the decoder's, extract's pixels are those of transformers given the path
                scaled = torch.from_numpy(np.array(vlfast_load_image(str(path)).convert("RGB"))).permute(
                    2, 0, 1
                )
                as_extract = decoded.dtype == torch.uint8 and torch.equal(decoded, scaled)
                note = (
                    " (16-bit: VisionPreprocessor refuses such a path; "
                    f"{'equal to' if as_extract else 'not'} vlfast extract's scaling)"
                )
            else:
                failed += not same
            print(
                f"{name:26s} {'equal' if same else 'DIFFERENT'} {decoded.dtype} {tuple(decoded.shape)}{note}"
            )
    print("every 8-bit file equal" if not failed else f"{failed} 8-bit files differ")
    failed += videos()
    return 1 if failed else 0


def videos() -> int:
    """Clips whose display matrix turns them (a phone's portrait video): every frame as transformers' video
    reader for a path decodes it (``load_video``, torchcodec where it loads) against vlfast's decode with
    ``video_rotation`` (pixels.video.display_turns); the number that differ."""
    import av
    import torch
    from transformers.utils.import_utils import is_torchcodec_available
    from transformers.video_utils import load_video

    from vlfast.demo import make_video
    from vlfast.pixels.video import _decode_at

    if not is_torchcodec_available():
        print("videos: torchcodec is not importable here; the turns are torchcodec's, so not checked")
        return 0
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for degrees in (0, 90, 180, 270):
            path = make_video(
                Path(tmp) / f"r{degrees}.mp4", frames=12, fps=10, width=96, height=64, rotation=degrees
            )
            theirs, _ = load_video(str(path), backend="torchcodec")
            theirs = torch.as_tensor(np.asarray(theirs))
            theirs = theirs.permute(0, 2, 3, 1) if theirs.shape[1] == 3 else theirs  # (T, H, W, 3)
            with av.open(str(path)) as c:
                ours = torch.from_numpy(np.stack(_decode_at(c, c.streams.video[0], None, turn=True)))
            same = ours.shape == theirs.shape and torch.equal(ours, theirs)
            failed += not same
            print(
                f"video turned {degrees:3d} degrees      {'equal' if same else 'DIFFERENT'} {tuple(theirs.shape)}"
            )
    return failed


if __name__ == "__main__":
    sys.exit(main())
