"""transformers' own processors, run in a process of their own with the real torchvision, as the parity tests'
reference.

transformers' video processors and its torchvision image processor import torchvision. PyPI's torchvision links
torch's CUDA libraries and does not import beside the CPU torch wheel this project tests with: its C++ operators
(nms, roi_align, the JPEG and video decoders) cannot load. Its Python code loads without them, and the parts the
Qwen-VL processors call (``transforms.v2.functional``: resize, normalize) are torch code, not those operators.
So the test command installs the torchvision wheel that pairs with the installed torch into ``.reference/``
(``pip install --no-deps --target .reference/torchvision torchvision==0.28.0``, README command 2), never into
the environment (there transformers would pick a torchvision it cannot import), and this script runs with it
on its path and the two modules that register those operators' meta kernels stood in for by empty ones: a
call of a missing operator would raise, not pass silently.

As a module: :func:`reference_pixels` (cases in, each case's pixel_values and grid out) and :func:`unavailable`.
As a script: ``python tests/_transformers_reference.py CASES.json OUT.pt``.

A case is a dict: ``name``; ``kind`` "image", "video", or "batch" (``images`` and ``videos``, lists of
paths, each list in one call of ``checkpoint``'s AutoImageProcessor and AutoVideoProcessor; saved as
``name:pixel_values`` and ``name:pixel_values_videos`` with their grids); ``path``, a file; ``processor``, a class name of
transformers (``Qwen2VLImageProcessor``, ``Qwen2VLImageProcessorPil``, ``Qwen2VLVideoProcessor``,
``Qwen3VLVideoProcessor``, or ``AutoImageProcessor`` / ``AutoVideoProcessor``); ``checkpoint``, a folder to
build it from (``from_pretrained``), else ``init``, the class's keyword arguments; ``call``, the call's. Images are read with transformers'
``load_image`` (EXIF orientation applied, as for a path; with ``as_tensor`` then made the uint8 tensor the
torchvision processor's ``fetch_images`` decodes from a path) or, with ``as_pil``, given as PIL opens them, videos with its ``load_video`` (PyAV backend: every
frame, sequentially) and sampled by the processor's own ``sample_frames`` (``do_sample_frames=True``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TORCHVISION_DIR = Path(os.environ.get("VLFAST_REFERENCE_TORCHVISION", REPO / ".reference" / "torchvision"))
# torch's minor version -> the torchvision release built against it
PAIRED = {"2.13": "0.28", "2.14": "0.29", "2.12": "0.27", "2.11": "0.26", "2.10": "0.25", "2.9": "0.24"}
INSTALL = "pip install --no-deps --target .reference/torchvision torchvision=={}.0"


def unavailable() -> str | None:
    """Why the reference cannot run here (None: it can)."""
    import torch

    minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    want = PAIRED.get(minor)
    found = sorted(TORCHVISION_DIR.glob("torchvision-*.dist-info"))
    if not found:
        return f"no reference torchvision in {TORCHVISION_DIR}: run `{INSTALL.format(want or 'X.Y')}`"
    version = found[0].name.removeprefix("torchvision-").removesuffix(".dist-info")
    if want is None or not version.startswith(want + "."):
        return (
            f"the torchvision in {TORCHVISION_DIR} is {version}; torch {torch.__version__} pairs with {want}"
        )
    return None


def reference_pixels(cases: list[dict[str, Any]], work: Path) -> dict[str, tuple[Any, list[int]]]:
    """{case name: (pixel_values, grid_thw as a list)} from transformers' processors, in one subprocess."""
    import torch

    work.mkdir(parents=True, exist_ok=True)
    spec, out = work / "cases.json", work / "reference.pt"
    spec.write_text(json.dumps(cases))
    env = {
        **os.environ,
        "VLFAST_REFERENCE_TORCHVISION": str(TORCHVISION_DIR),
        "TRANSFORMERS_VERBOSITY": "error",
    }
    run = subprocess.run(
        [sys.executable, __file__, str(spec), str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    if run.returncode != 0:
        raise AssertionError(f"the reference run failed:\n{run.stdout}\n{run.stderr}")
    return torch.load(out, weights_only=True)


def _import_torchvision() -> None:
    import types

    sys.path.insert(0, str(TORCHVISION_DIR))
    for name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
        sys.modules[name] = types.ModuleType(name)
    import torchvision

    where = Path(torchvision.__file__).resolve()
    if not where.is_relative_to(TORCHVISION_DIR.resolve()):
        raise SystemExit(f"torchvision imported from {where}, not from {TORCHVISION_DIR}")


def _main(spec: Path, out: Path) -> None:
    _import_torchvision()
    import numpy as np
    import PIL.Image
    import PIL.ImageOps
    import torch
    import transformers
    from transformers.image_utils import load_image
    from transformers.utils.import_utils import is_torchvision_available
    from transformers.video_utils import load_video

    if not is_torchvision_available():
        raise SystemExit("transformers does not see the reference torchvision")
    results: dict[str, tuple[torch.Tensor, list[int]]] = {}
    for case in json.loads(spec.read_text()):
        if case["kind"] == "batch":
            _batch(case, results)
            continue
        name = case["processor"]
        if case.get("checkpoint"):
            proc = getattr(transformers, name).from_pretrained(case["checkpoint"], local_files_only=True)
        else:
            proc = getattr(transformers, name)(**case.get("init", {}))
        expected = case.get("expect_class")
        if expected and type(proc).__name__ != expected:
            raise SystemExit(f"{case['name']}: built a {type(proc).__name__}, not a {expected}")
        call = dict(case.get("call", {}))
        if case["kind"] == "image":
            if case.get("as_pil"):  # the PIL image as opened: the processor composites transparency on white
                image = PIL.ImageOps.exif_transpose(PIL.Image.open(case["path"]))
            else:  # load_image, as for a path: EXIF orientation applied, then convert("RGB") drops alpha
                image = load_image(case["path"])
                if case.get("as_tensor"):
                    # what the torchvision processor's fetch_images makes of a path: torchcodec's or
                    # torchvision's decode_image in RGB mode, whose C++ decoders do not load beside the CPU
                    # torch; the same pixels as load_image's for 8-bit files (scripts/decode_parity.py, with
                    # both), and no palette or colour-key transparency
                    image = torch.from_numpy(np.array(image)).permute(2, 0, 1)
            got = proc(images=[image], return_tensors="pt", **call)
            results[case["name"]] = (got["pixel_values"], got["image_grid_thw"][0].tolist())
        else:
            frames, metadata = load_video(case["path"], backend="pyav")
            if "num_frames" in call:
                call.setdefault("fps", None)  # the class's default fps and num_frames are exclusive
            got = proc(
                videos=[frames], video_metadata=[metadata], do_sample_frames=True, return_tensors="pt", **call
            )
            results[case["name"]] = (got["pixel_values_videos"], got["video_grid_thw"][0].tolist())
    torch.save(results, out)


def _batch(case: dict, results: dict) -> None:
    """Images and videos of one training example, each list in one call of the checkpoint's image and video
    processors (what its AutoProcessor runs for them)."""
    import transformers
    from transformers.image_utils import load_image
    from transformers.video_utils import load_video

    ckpt, call = case["checkpoint"], dict(case.get("call", {}))
    if case.get("images"):
        proc = transformers.AutoImageProcessor.from_pretrained(ckpt, local_files_only=True)
        got = proc(images=[load_image(p) for p in case["images"]], return_tensors="pt")
        results[f"{case['name']}:pixel_values"] = (got["pixel_values"], got["image_grid_thw"].tolist())
    if case.get("videos"):
        proc = transformers.AutoVideoProcessor.from_pretrained(ckpt, local_files_only=True)
        loaded = [load_video(p, backend="pyav") for p in case["videos"]]
        if "num_frames" in call:
            call.setdefault("fps", None)
        got = proc(
            videos=[f for f, _ in loaded],
            video_metadata=[m for _, m in loaded],
            do_sample_frames=True,
            return_tensors="pt",
            **call,
        )
        results[f"{case['name']}:pixel_values_videos"] = (
            got["pixel_values_videos"],
            got["video_grid_thw"].tolist(),
        )


if __name__ == "__main__":
    _main(Path(sys.argv[1]), Path(sys.argv[2]))
