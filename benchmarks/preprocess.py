"""Preprocessing per core, side by side: from the encoded file to the tensor the vision tower receives.

    python benchmarks/preprocess.py [--rounds 5] [--json PATH]

Images (JPEG, 640x480, 1280x720, 1920x1080, 4000x3000; Qwen3-VL's published settings): transformers' PIL
image processor and its torchvision one (``Qwen2VLImageProcessor``, with the torchvision wheel from
``.reference/torchvision``, see tests/_transformers_reference.py), qwen-vl-utils' ``fetch_image`` (its PIL
resize) before the torchvision processor, as the model cards do, vlfast's image path as a data loader gets
it (``VisionPreprocessor``: float32 on CPU) and as ``vlfast extract``'s decode workers make it (uint8
patches, finished on the model's device), and decode alone: PIL, and libjpeg-turbo (simplejpeg), the bound. Videos (H.264, 10 s at 30 fps, 640x360 and 1280x720, x264's default GOPs (a
keyframe every 250 frames: 2 GOPs) and a keyframe every second as cameras and streaming encoders make them;
Qwen3-VL, 8 frames): transformers' ``Qwen3VLVideoProcessor`` after its own ``load_video`` (PyAV, every frame),
vlfast's ``read_video`` + ``patchify_video``, every frame decoded sequentially, the sampled frames alone
(vlfast's ``read_video``: a sparse decode that seeks past GOPs nothing is wanted from and skips the frames
nothing refers to), and the bound, a keyframe-seeking decode written here independently of vlfast (for each
sampled frame, a seek to the keyframe before it unless the decode already runs in its GOP, then a forward
decode that skips non-reference frames). Variants alternate within each round, torch on one thread; each row
gives the median per item, its spread (min-max over rounds), the ratio to transformers' torchvision processor
and to the decode bound, the median CPU time (the process's, all threads: on a shared machine the wall time
also counts waits for a core) and its ratio to the bound's, and whether the output equals that processor's
bit for bit (for the video decode rows: the sequential decode's frames at the sampled indices).

    python benchmarks/preprocess.py --only video   # the video rows alone

transformers' default video reader, torchcodec, loads only beside a CUDA build of torch (PyPI's torchcodec
wheels are CUDA builds): ``bash benchmarks/torchcodec_env.sh`` makes a venv with one (it runs on the CPU) and
says how to run this script there for the torchcodec rows.

Each image size runs in a Python process of its own (``--image-sizes`` names one or more; this process then
measures them itself): in one process for all four, the 4000x3000 row of ``VisionPreprocessor`` took 600-1036
ms per image after the smaller sizes had run, against 208-255 ms in a process of its own with the same
variants alternated (2026-12-02, quiet machine; transformers' 676-718 and 616-1340 ms): the first sizes' work
leaves the process's memory in a state that makes the large outputs' fresh pages dearer, for some variants more
than others, whatever the order within a round.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
# decord and torchcodec, the other video readers of qwen-vl-utils and transformers, are kept out of the test
# environment (transformers' load_video picks torchcodec when it imports): the benchmark takes them from
# .reference/ where they were put with `pip install --no-deps --target .reference/decord decord==0.6.0`
# (likewise torchcodec), or from the environment
for _reader in ("decord", "torchcodec"):
    if (REPO / ".reference" / _reader).is_dir():
        sys.path.append(str(REPO / ".reference" / _reader))
# qwen-vl-utils reads its video backend when imported: decord, its first choice, where it loads
os.environ.setdefault("FORCE_QWENVL_VIDEO_READER", "decord")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import _transformers_reference as reference  # noqa: E402
import harness  # noqa: E402

torch.set_num_threads(1)

IMAGE_SIZES = [(640, 480), (1280, 720), (1920, 1080), (4000, 3000)]
CLIP_SIZES = [(640, 360), (1280, 720)]
QWEN3_IMAGE = {"size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16}
QWEN3_VIDEO = {"size": {"shortest_edge": 4096, "longest_edge": 25_165_824}, "fps": 2, "patch_size": 16}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--name", default="preprocess", help="the result file's name (default preprocess)")
    ap.add_argument("--json", type=Path, help="also write the rows here (the result file is written anyway)")
    ap.add_argument(
        "--variants",
        choices=["all", "core", "framework"],
        default="all",
        help="core: transformers' torchvision processor, VisionPreprocessor float32 and uint8, the decode bound; "
        "for videos the keyframe bound, transformers (PyAV, torchcodec where it loads) and vlfast; framework: "
        "a framework's call with a decoded image, transformers' processor against VLFAST_PREPROCESS's swap",
    )
    ap.add_argument("--only", choices=["image", "video"], help="measure one kind of input")
    ap.add_argument(
        "--image-sizes",
        help="comma-separated WxH measured in this process (default: the four sizes, each in a process of its own)",
    )
    args = ap.parse_args()
    why = reference.unavailable()
    if why:
        raise SystemExit(f"transformers' torchvision processors need the reference torchvision: {why}")
    reference._import_torchvision()  # before transformers is imported (the harness's machine() imports it)
    with harness.Run(args.name, save=not args.image_sizes) as run:
        rows = _main(args)
        run.table("images", [r for r in rows if r["input"].startswith("image")])
        run.table("videos", [r for r in rows if r["input"].startswith("video")])
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps({"machine": harness.machine(), "rows": rows}, indent=2))


CORE = (
    "reference bound",
    "transformers torchvision processor",
    "vlfast (VisionPreprocessor: float32 on CPU)",
    "vlfast (VisionPreprocessor pixels='uint8': the CPU's share)",
    "transformers Qwen3VLVideoProcessor (load_video pyav)",
    "transformers Qwen3VLVideoProcessor (load_video torchcodec)",
    "vlfast",
)


def _keep(variants: dict, which: str) -> dict:
    """``which`` = core: the rows issue 53 asks for (CORE); framework: a framework's call, both ways."""
    if which == "all":
        return variants
    if which == "framework":
        keep = ("reference bound", "in a framework", "transformers torchvision processor")
        return {k: v for k, v in variants.items() if any(w in k for w in keep) and "bfloat16" not in k}
    return {k: v for k, v in variants.items() if k in CORE or "reference bound" in k}


def _main(args) -> list[dict]:
    sizes = IMAGE_SIZES
    if args.image_sizes:
        sizes = [tuple(int(v) for v in s.lower().split("x")) for s in args.image_sizes.split(",")]
    c = _context()
    rows = []
    if args.only != "video" and not args.image_sizes:  # each size in a fresh process (see the docstring)
        rows += _sizes_apart(c.work, sizes, args)
        sizes = []
    for w, h in sizes if args.only != "video" else []:
        rows += _image_rows(c, w, h, args)
    clips = [(w, h, gop) for gop in (None, 30) for w, h in CLIP_SIZES] if args.only != "image" else []
    for w, h, gop in clips:
        rows += _video_rows(c, w, h, gop, args)
    torchcodec_why, decord_why = c.torchcodec_why, c.decord_why
    print(f"\nmachine: {harness.machine()}")
    for reader, why in (("torchcodec", torchcodec_why), ("decord", decord_why)):
        if why is not None and args.only != "image":
            print(f"{reader}: not measured, it does not load here: {why}")
            if reader == "torchcodec":
                print(
                    "  (PyPI's torchcodec is a CUDA build: benchmarks/torchcodec_env.sh makes a venv where it loads)"
                )
    return rows


def _context() -> types.SimpleNamespace:
    """The processors, the config and the functions every row uses, made once."""
    import transformers
    from PIL import Image
    from transformers.image_utils import load_image as tf_load_image
    from transformers.video_utils import load_video

    from vlfast.demo import make_video, pattern
    from vlfast.extraction.model.runner import batch_pixels
    from vlfast.pixels.engine import build_processor_config
    from vlfast.pixels.video import _decode_at, patchify_video, read_video

    work = Path(tempfile.mkdtemp(prefix="vlfast-preprocess-"))
    cfg = build_processor_config("ref:qwen3-vl-2b", family="qwen3_vl", num_frames=8)
    from dataclasses import replace

    cfg = replace(cfg, image_processor="Qwen2VLImageProcessor")
    tv = transformers.Qwen2VLImageProcessor(**QWEN3_IMAGE, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    pil = transformers.Qwen2VLImageProcessorPil(**QWEN3_IMAGE, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    video_proc = transformers.Qwen3VLVideoProcessor(**QWEN3_VIDEO)
    import simplejpeg
    from qwen_vl_utils.vision_process import fetch_image, fetch_video

    from vlfast import VisionPreprocessor
    from vlfast.pixels.engine import Preprocessor

    torchcodec_why, decord_why = _loads("torchcodec.decoders"), _loads("decord")
    vision = VisionPreprocessor("ref:qwen3-vl-2b")
    vision_uint8 = VisionPreprocessor("ref:qwen3-vl-2b", pixels="uint8")
    deferred = Preprocessor(cfg, defer_video_normalize=True)
    from vlfast.pixels.adapter import adapted

    swapped = adapted(vision, tv, fallback=True)  # what swap_image_processor installs
    return types.SimpleNamespace(
        Image=Image,
        _decode_at=_decode_at,
        batch_pixels=batch_pixels,
        cfg=cfg,
        decord_why=decord_why,
        deferred=deferred,
        fetch_image=fetch_image,
        fetch_video=fetch_video,
        load_video=load_video,
        make_video=make_video,
        patchify_video=patchify_video,
        pattern=pattern,
        pil=pil,
        read_video=read_video,
        simplejpeg=simplejpeg,
        swapped=swapped,
        tf_load_image=tf_load_image,
        torchcodec_why=torchcodec_why,
        tv=tv,
        video_proc=video_proc,
        vision=vision,
        vision_uint8=vision_uint8,
        work=work,
    )


def _sizes_apart(work: Path, sizes: list, args) -> list[dict]:
    """Each image size measured by a process of its own (the docstring says why); their rows."""
    rows = []
    for w, h in sizes:
        part = work / f"rows-{w}x{h}.json"
        cmd = [
            sys.executable,
            __file__,
            "--only",
            "image",
            "--image-sizes",
            f"{w}x{h}",
            "--variants",
            args.variants,
        ]
        subprocess.run(
            [*cmd, "--rounds", str(args.rounds), "--json", str(part)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        rows += json.loads(part.read_text())["rows"]
    return rows


def _image_file(c, w: int, h: int) -> tuple[str, bytes, object]:
    """A photo-like JPEG of w x h, its bytes, and the PIL image a framework's collator would hand over."""
    work, pattern, Image, tf_load_image = c.work, c.pattern, c.Image, c.tf_load_image
    path = work / f"{w}x{h}.jpg"
    # a photo-like pattern with noise: JPEG decode costs what a photo's does
    rng = np.random.default_rng(w)
    arr = np.clip(pattern(h, w, 1).astype(np.int16) + rng.integers(-20, 20, (h, w, 3)), 0, 255).astype(
        np.uint8
    )
    Image.fromarray(arr).save(path, quality=90)
    p = str(path)

    data = path.read_bytes()
    given = tf_load_image(p)  # decoded once: what a framework's collator hands the processor
    given.load()
    return p, data, given


def _image_variants(c, p: str, data: bytes, given) -> dict:
    """Every way to turn the JPEG at ``p`` into pixels, by name."""
    (
        Image,
        simplejpeg,
        pil,
        tv,
        tf_load_image,
        fetch_image,
        vision,
        vision_uint8,
        batch_pixels,
        deferred,
        cfg,
        swapped,
    ) = (
        c.Image,
        c.simplejpeg,
        c.pil,
        c.tv,
        c.tf_load_image,
        c.fetch_image,
        c.vision,
        c.vision_uint8,
        c.batch_pixels,
        c.deferred,
        c.cfg,
        c.swapped,
    )

    def decode(p=p):
        img = Image.open(p)
        img.load()
        return img

    variants = {
        "decode only (PIL)": decode,
        "decode only (libjpeg-turbo: simplejpeg; reference bound)": lambda data=data: simplejpeg.decode_jpeg(
            data
        ),
        "transformers PIL processor": lambda p=p: pil(images=[tf_load_image(p)], return_tensors="pt"),
        "transformers torchvision processor": lambda p=p: tv(images=[tf_load_image(p)], return_tensors="pt"),
        "qwen-vl-utils fetch_image + torchvision processor": lambda p=p: tv(
            images=[fetch_image({"image": p}, image_patch_size=16)], return_tensors="pt"
        ),
        "vlfast (VisionPreprocessor: float32 on CPU)": lambda p=p: vision(images=[p])["pixel_values"],
        # the data loader's share where finish() runs on the GPU: the decode and the uint8 patch move
        "vlfast (VisionPreprocessor pixels='uint8': the CPU's share)": lambda p=p: vision_uint8(images=[p])[
            "pixel_values"
        ],
        # the decode workers' uint8 patches and the model side's normalisation, on the CPU here: the whole path
        "vlfast extract (uint8 patches, normalised by the model side: CPU here)": lambda p=p: batch_pixels(
            [deferred.image(p)[0]], torch.device("cpu"), torch.float32, cfg
        ),
        # a bf16 tower's input (the report's loop, every GPU user's): transformers' float32 output cast, and
        # vlfast's uint8 patches normalised straight into bfloat16 (the same bits as the cast)
        "transformers torchvision processor, then .to(bfloat16)": lambda p=p: tv(
            images=[tf_load_image(p)], return_tensors="pt"
        )["pixel_values"].to(torch.bfloat16),
        "vlfast extract, a bf16 tower's input (normalised straight into bfloat16: CPU here)": lambda p=p: (
            batch_pixels([deferred.image(p)[0]], torch.device("cpu"), torch.bfloat16, cfg)
        ),
        # a framework's call (LlamaFactory, TRL, ms-swift): a decoded PIL image in, float32 out; with
        # VLFAST_PREPROCESS=1 the processor's image processor is vlfast's swap
        "in a framework, decoded image given: transformers torchvision processor": lambda g=given: tv(
            images=[g], return_tensors="pt"
        ),
        "in a framework, decoded image given: VLFAST_PREPROCESS's swap": lambda g=given: swapped(
            images=[g], return_tensors="pt"
        ),
    }
    return variants


def _image_equal(c, variants: dict, p: str, given) -> dict:
    """Whether each variant's output equals transformers' torchvision processor's, bit for bit."""
    tv, pil, tf_load_image, vision_uint8, swapped = c.tv, c.pil, c.tf_load_image, c.vision_uint8, c.swapped
    ref = tv(images=[tf_load_image(p)], return_tensors="pt")["pixel_values"]

    equal = {
        "transformers PIL processor": torch.equal(
            pil(images=[tf_load_image(p)], return_tensors="pt")["pixel_values"].float(), ref
        ),
        "transformers torchvision processor": True,
        "qwen-vl-utils fetch_image + torchvision processor": torch.equal(
            variants["qwen-vl-utils fetch_image + torchvision processor"]()["pixel_values"], ref
        ),
        "vlfast (VisionPreprocessor: float32 on CPU)": torch.equal(
            variants["vlfast (VisionPreprocessor: float32 on CPU)"](), ref
        ),
        "vlfast (VisionPreprocessor pixels='uint8': the CPU's share)": torch.equal(
            vision_uint8.finish({"pixel_values": vision_uint8(images=[p])["pixel_values"]})["pixel_values"],
            ref,
        ),
        "vlfast extract (uint8 patches, normalised by the model side: CPU here)": torch.equal(
            variants["vlfast extract (uint8 patches, normalised by the model side: CPU here)"](), ref
        ),
        "transformers torchvision processor, then .to(bfloat16)": True,
        "vlfast extract, a bf16 tower's input (normalised straight into bfloat16: CPU here)": torch.equal(
            variants["vlfast extract, a bf16 tower's input (normalised straight into bfloat16: CPU here)"](),
            ref.to(torch.bfloat16),
        ),
        "in a framework, decoded image given: transformers torchvision processor": True,
        "in a framework, decoded image given: VLFAST_PREPROCESS's swap": torch.equal(
            swapped(images=[given], return_tensors="pt")["pixel_values"],
            tv(images=[given], return_tensors="pt")["pixel_values"],
        ),
    }
    return equal


def _image_rows(c, w: int, h: int, args) -> list[dict]:
    p, data, given = _image_file(c, w, h)
    variants = _image_variants(c, p, data, given)
    equal = _image_equal(c, variants, p, given)
    n = 2 if w >= 4000 else 4
    bf16 = {
        "vlfast extract, a bf16 tower's input (normalised straight into bfloat16: CPU here)": (
            "transformers torchvision processor, then .to(bfloat16)"
        )
    }
    rows = measure(f"image {w}x{h} JPEG", _keep(variants, args.variants), equal, args.rounds, n, bf16)

    return rows + _batch_rows(c, p, data, w, h, args)


def _batch_rows(c, p: str, data: bytes, w: int, h: int, args) -> list[dict]:
    tv, tf_load_image, simplejpeg, vision, vision_uint8 = (
        c.tv,
        c.tf_load_image,
        c.simplejpeg,
        c.vision,
        c.vision_uint8,
    )
    # A data loader's collator calls the processor once per batch: 8 images in one call (2 at 4000x3000),
    # the row's time per call. transformers concatenates the images' rows; vlfast writes them into one
    # tensor (VisionPreprocessor._images)
    k = 2 if w >= 4000 else 8
    batch = [p] * k
    tf_batch = tv(images=[tf_load_image(x) for x in batch], return_tensors="pt")["pixel_values"]
    batched = {
        "decode only, each image (libjpeg-turbo; reference bound)": lambda k=k, data=data: [
            simplejpeg.decode_jpeg(data) for _ in range(k)
        ],
        "transformers torchvision processor": lambda batch=batch: tv(
            images=[tf_load_image(x) for x in batch], return_tensors="pt"
        ),
        "vlfast (VisionPreprocessor: float32 on CPU)": lambda batch=batch: vision(images=batch)[
            "pixel_values"
        ],
        "vlfast (VisionPreprocessor pixels='uint8': the CPU's share)": lambda batch=batch: vision_uint8(
            images=batch
        )["pixel_values"],
    }
    batch_equal = {
        "transformers torchvision processor": True,
        "vlfast (VisionPreprocessor: float32 on CPU)": torch.equal(
            vision(images=batch)["pixel_values"], tf_batch
        ),
        "vlfast (VisionPreprocessor pixels='uint8': the CPU's share)": torch.equal(
            vision_uint8.finish({"pixel_values": vision_uint8(images=batch)["pixel_values"]})["pixel_values"],
            tf_batch,
        ),
    }
    return measure(
        f"image {w}x{h} JPEG, {k} in one call", _keep(batched, args.variants), batch_equal, args.rounds, 1
    )


def _video_variants(c, p: str) -> tuple:
    """Every way to turn the clip at ``p`` into pixels (or frames), by name, and what the checks call."""
    (
        load_video,
        video_proc,
        _decode_at,
        read_video,
        cfg,
        patchify_video,
        torchcodec_why,
        decord_why,
        fetch_video,
    ) = (
        c.load_video,
        c.video_proc,
        c._decode_at,
        c.read_video,
        c.cfg,
        c.patchify_video,
        c.torchcodec_why,
        c.decord_why,
        c.fetch_video,
    )

    def transformers_video(p=p, backend="pyav"):
        frames, meta = load_video(p, backend=backend)
        return video_proc(
            videos=[frames],
            video_metadata=[meta],
            do_sample_frames=True,
            num_frames=8,
            fps=None,
            return_tensors="pt",
        )["pixel_values_videos"]

    def sequential(p=p):
        import av

        with av.open(p) as c:
            return _decode_at(c, c.streams.video[0], None)

    def sampled(p=p):
        return read_video(p, cfg)[0]

    indices = read_video(p, cfg)[1]["frame_indices"]

    def seeking(p=p, indices=indices):
        return keyframe_seeking_decode(p, indices)

    variants = {
        "decode all frames (PyAV, sequential)": sequential,
        "decode the sampled frames (vlfast's sparse decode)": sampled,
        "keyframe-seeking decode (reference bound)": seeking,
        "transformers Qwen3VLVideoProcessor (load_video pyav)": transformers_video,
        "vlfast": lambda p=p: patchify_video(read_video(p, cfg)[0], cfg)[0],
        "vlfast, normalised on the device": lambda p=p: patchify_video(
            read_video(p, cfg)[0], cfg, normalize=False
        )[0],
    }
    if torchcodec_why is None:
        variants["transformers Qwen3VLVideoProcessor (load_video torchcodec)"] = functools.partial(
            transformers_video, p, "torchcodec"
        )
    if decord_why is None:

        def qwen_vl_utils_decord(p=p):
            # the model card's path: qwen-vl-utils samples and resizes, the processor does the rest
            video, meta = fetch_video(
                {"video": p, "nframes": 8}, image_patch_size=16, return_video_metadata=True
            )
            return video_proc(
                videos=[video],
                video_metadata=[meta],
                do_resize=False,
                do_sample_frames=False,
                return_tensors="pt",
            )["pixel_values_videos"]

        variants["qwen-vl-utils fetch_video (decord) + Qwen3VLVideoProcessor"] = qwen_vl_utils_decord
    return variants, transformers_video, sequential, sampled, seeking, indices


def _video_rows(c, w: int, h: int, gop: int | None, args) -> list[dict]:
    work, make_video = c.work, c.make_video
    options = {"g": str(gop)} if gop else None
    path = make_video(
        work / f"clip_{w}x{h}_{gop}.mp4", frames=300, fps=30, width=w, height=h, seed=2, options=options
    )
    p = str(path)
    variants, transformers_video, sequential, sampled, seeking, indices = _video_variants(c, p)
    ref = transformers_video()
    every = np.stack(sequential())[indices]
    equal = {
        "decode the sampled frames (vlfast's sparse decode)": np.array_equal(
            sampled().permute(0, 2, 3, 1).numpy(), every
        ),
        "keyframe-seeking decode (reference bound)": np.array_equal(np.stack(seeking()), every),
        "transformers Qwen3VLVideoProcessor (load_video pyav)": True,
        "vlfast": torch.equal(variants["vlfast"](), ref),
    }
    for name in variants:
        if name not in equal and ("torchcodec" in name or "decord" in name):
            out = variants[name]()
            equal[name] = out.shape == ref.shape and torch.equal(out, ref)
    what = f"video {w}x{h} 10 s, {'GOP 1 s' if gop else 'GOP 250'}, 8"
    return measure(what, _keep(variants, args.variants), equal, args.rounds, 1)


def _loads(module: str) -> str | None:
    """None where ``module`` imports, else why not (its last line)."""
    import importlib

    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - a wheel that does not load here, for any reason, is reported
        return f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    return None


def keyframe_seeking_decode(path: str, indices: list[int]) -> list[np.ndarray]:
    """RGB frames at ``indices`` (ranks in presentation order), decoded the way a seeking player would: one
    demux pass for the packets' timestamps and keyframes, then for each frame a seek to the keyframe before
    it unless the decoder already runs in that GOP, and a forward decode to it that sends the frames nothing
    wants with ``skip_frame = NONREF``. Right for closed GOPs (the clips here), which is all a bound needs."""
    import bisect

    import av

    with av.open(path) as c:
        s = c.streams.video[0]
        packets = [(p.pts, p.is_keyframe) for p in c.demux(s) if p.size]
        order = sorted(t for t, _ in packets)
        keys = sorted(t for t, key in packets if key)
        want = {order[i] for i in indices}
        ctx, out, gop, demux = s.codec_context, {}, None, None
        for t in sorted(want):
            if t in out:
                continue
            key = keys[bisect.bisect_right(keys, t) - 1]
            if key != gop:
                c.seek(key, stream=s, backward=True, any_frame=False)
                gop, demux = key, c.demux(s)
            for packet in demux:
                if packet.pts is not None:
                    ctx.skip_frame = "DEFAULT" if packet.pts in want or packet.is_keyframe else "NONREF"
                for frame in ctx.decode(packet):
                    if frame.pts in want:
                        out[frame.pts] = frame.to_ndarray(format="rgb24")
                if t in out:
                    break
        ctx.skip_frame = "DEFAULT"
        return [out[order[i]] for i in indices]


def measure(
    what: str, variants: dict, equal: dict, rounds: int, n: int, bases: dict | None = None
) -> list[dict]:
    """Each variant's wall and CPU time over ``rounds`` alternated rounds of ``n`` calls; "vs tf" against
    transformers' torchvision row, or the row ``bases`` names for a variant (the bf16 rows: its cast)."""
    got = harness.alternate(variants, rounds, n)
    times = {k: v["wall"] for k, v in got.items()}
    cpu = {k: v["cpu"] for k, v in got.items()}
    base_name = next(
        k for k in variants if k.startswith("transformers") and "torchvision" in k or "Video" in k
    )
    bound_name = next((k for k in variants if "reference bound" in k), next(iter(variants)))
    base, bound = harness.median(times[base_name]), harness.median(times[bound_name])
    cpu_bound = harness.median(cpu[bound_name])
    out = []
    for name, ts in times.items():
        med = harness.median(ts)
        if bases and name in bases:
            base_of = bases[name]
            base = harness.median(times[base_of])
        else:
            base_of, base = base_name, harness.median(times[base_name])
        out.append(
            {
                "input": what,
                "variant": name,
                "ms": round(med * 1000, 2),
                "min_ms": round(min(ts) * 1000, 2),
                "max_ms": round(max(ts) * 1000, 2),
                "speedup_vs_transformers": round(base / med, 2),
                "compared_with": base_of,
                "x_decode_bound": round(med / bound, 2),
                "cpu_ms": round(harness.median(cpu[name]) * 1000, 2),
                "cpu_x_decode_bound": round(harness.median(cpu[name]) / cpu_bound, 2),
                "cpu_speedup_vs_transformers": round(
                    harness.median(cpu[base_of]) / harness.median(cpu[name]), 2
                ),
                "equal": equal.get(name),
            }
        )
    return out


def print_table(rows: list[dict]) -> None:
    print(
        f"{'input':32} {'variant':52} {'ms (min-max)':>22} {'vs tf':>7} {'x bound':>8} "
        f"{'cpu ms':>8} {'x bound':>8} equal"
    )
    for r in rows:
        spread = f"{r['ms']:.1f} ({r['min_ms']:.1f}-{r['max_ms']:.1f})"
        eq = "" if r["equal"] is None else ("yes" if r["equal"] else "NO")
        print(
            f"{r['input']:32} {r['variant']:52} {spread:>22} {r['speedup_vs_transformers']:>6.2f}x "
            f"{r['x_decode_bound']:>7.2f}x {r['cpu_ms']:>8.1f} {r['cpu_x_decode_bound']:>7.2f}x {eq}"
        )


if __name__ == "__main__":
    main()
