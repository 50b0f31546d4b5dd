"""Clips per hour, end to end: ``vlfast extract`` against the loop the report's author wrote (issue 40, item 2).

The job that exposed the slowdown (docs: /shared/CONTEXT.md, section 3) extracted Qwen3-VL features for
8-frame clips plus a prompt with a loop of its own. Both sides here get the same generated clips, the same
checkpoint, device and dtype, and save the same feature (the last layer's hidden state at the prompt's last
token), each in its own process, alternating for ``--rounds`` rounds:

- ``loop``: the author's loop. A torch ``DataLoader`` (batch ``--batch``, ``--loop-workers`` worker
  processes) decodes each clip's 8 frames with transformers' ``read_video_pyav``; in the main process the
  transformers processor turns the batch into model inputs, ``AutoModelForImageTextToText`` runs with
  ``output_hidden_states=True``, and the batch's features go to one ``torch.save`` file. The patch
  embedding is the author's hand-made ``nn.Linear`` (the report's ``_fast_forward``, verbatim).
  Where torchvision is absent (transformers' video processor needs it to resize), the processor's video
  half is its own steps without it: ``smart_resize``, the bicubic antialiased uint8 resize torchvision's
  v2 ``resize`` runs on CPU, fused rescale and normalise, transformers' own ``patchify``; the video token
  expanded as ``Qwen3VLProcessor.replace_video_token`` and transformers 5's ``ProcessorMixin`` do it.
  ``processor`` in the output says which ran.
- ``vlfast``: ``vlfast.extraction.extract`` (what ``vlfast extract`` runs) with ``--features llm --layers
  -1 --pool last``, the same prompt and ``--num-frames 8``, its defaults otherwise (decode workers beside the
  model, batches by token budget, patched conv, sharded checksummed store).
- ``slow path`` (projected): the loop as it ran before the author's fix, on the slow path: each of the
  loop's patch-embedding calls replaced by the stock Conv3d with oneDNN (CPU) or cuDNN (CUDA) disabled,
  timed ``--slow-calls`` times at ``min(N, --slow-patches)`` patches and scaled linearly to each call's N.
  The stock conv (backend on) is projected the same way. Projected loop = measured loop - the Linear's
  measured patch-embed time + the projected calls.

Each child times from just after ``import torch`` to its last file written (model load included; the
loop's own part and vlfast's ``seconds`` are given apart). Peak memory: each child's peak RSS (``wait4``),
the peak of its process tree's summed RSS (sampled every 0.1 s; forked workers share pages, so this
over-counts), and on CUDA ``torch.cuda.max_memory_allocated``. The features of both sides are compared
(cosine, per clip) after the first round.

``--model tiny``: the tiny offline Qwen3-VL checkpoint (2-layer tower 64 wide, 2-layer LLM); preprocessing
dominates. ``--model reduced``: the same tokenizer and processor with ``ref:qwen3-vl-4b``'s tower at its
published dimensions (24 blocks, 1024 wide, the real 3->1024 patch embedding) and Qwen3-VL-4B's LLM width
(2560; 32/8 heads of 128, MLP 9728) cut to ``--llm-layers`` layers; random weights.

    python benchmarks/clips_per_hour.py --model tiny --clips 32                     # CPU, seconds per round
    python benchmarks/clips_per_hour.py --model reduced --clips 16 --clip-size 256x192
    python benchmarks/clips_per_hour.py --device cuda --model reduced --clips 64 --json   # benchmarks/gpu.py
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # both sides' children inherit it
sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (benchmarks/harness.py)

HERE = Path(__file__).resolve().parent
PROMPT = "Describe what happens in this video."  # one prompt for every clip, as the report's job had
FRAMES = 8  # frames per clip, as in the report
VARIANTS = ("loop", "vlfast")
# Qwen3-VL-4B's language model (Qwen/Qwen3-VL-4B-Instruct config.json), cut to --llm-layers layers.
QWEN3_VL_4B_TEXT = {
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True},
    "rope_theta": 5_000_000,
    "tie_word_embeddings": True,
}


# ------------------------------------------------------------------------------------------------ inputs


def make_checkpoint(folder: Path, kind: str, llm_layers: int, device: str) -> Path:
    """The tiny offline checkpoint, or with ``reduced`` its config and weights replaced (see the docstring)."""
    import torch

    from vlfast.demo import make_tiny_qwen3_vl

    ckpt = make_tiny_qwen3_vl(folder / "ckpt")
    if kind == "tiny":
        return ckpt
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from vlfast.models import REFERENCES

    raw = json.loads((ckpt / "config.json").read_text())
    raw["text_config"].update(QWEN3_VL_4B_TEXT, num_hidden_layers=llm_layers)
    raw["vision_config"].update(REFERENCES["qwen3-vl-4b"].vision)
    config = Qwen3VLConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    with torch.device(device):  # a 1-2 B model: built where it is fastest to initialise
        model = Qwen3VLForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    model.eval().save_pretrained(ckpt)
    return ckpt


def _clip(args: tuple[Path, int, int, int]) -> Path:
    from vlfast.demo import make_video

    path, width, height, seed = args
    return make_video(path, frames=16, fps=8, width=width, height=height, seed=seed)


def make_clips(folder: Path, n: int, width: int, height: int) -> list[Path]:
    """``n`` 2 s clips at 8 fps (16 frames, 8 of them sampled per clip), H.264, encoded on every core (a
    lent GPU's time runs while they are made)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    jobs = [(folder / f"clip{k:04d}.mp4", width, height, k) for k in range(n)]
    with ProcessPoolExecutor(
        max_workers=min(n, os.cpu_count() or 1), mp_context=mp.get_context("fork")
    ) as pool:
        return list(pool.map(_clip, jobs))


# -------------------------------------------------------------------------------------- the author's loop


def _fast_forward(self, hidden_states):
    """The report's fix, verbatim (transformers #45750): the Conv3d replaced by an nn.Linear on first call."""
    import torch.nn as nn

    target_dtype = self.proj.weight.dtype
    if isinstance(self.proj, nn.Conv3d):
        conv = self.proj
        out_dim = conv.out_channels
        in_dim = conv.in_channels * conv.kernel_size[0] * conv.kernel_size[1] * conv.kernel_size[2]
        w_flat = conv.weight.detach().reshape(out_dim, in_dim).contiguous()
        bias = conv.bias.detach().clone() if conv.bias is not None else None
        new_proj = nn.Linear(in_dim, out_dim, bias=bias is not None)
        new_proj.weight.data.copy_(w_flat)
        if bias is not None:
            new_proj.bias.data.copy_(bias)
        new_proj.to(device=conv.weight.device, dtype=conv.weight.dtype)
        self.proj = new_proj
    if hidden_states.dim() > 2 or hidden_states.shape[-1] != self.proj.in_features:
        hidden_states = hidden_states.reshape(-1, self.proj.in_features)
    return self.proj(hidden_states.to(dtype=target_dtype))


class Clips:
    """The loop's Dataset: one clip's ``FRAMES`` frames, decoded with transformers' ``read_video_pyav``."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        import numpy as np
        from transformers.video_utils import read_video_pyav

        def indices(metadata, **_):  # Qwen3VLVideoProcessor.sample_frames with num_frames=8
            return np.linspace(0, metadata.total_num_frames - 1, FRAMES).round().astype(int)

        frames, meta = read_video_pyav(self.paths[i], sample_indices_fn=indices)
        return Path(self.paths[i]).stem, frames, meta


class VideoStepsProcessor:
    """transformers' Qwen3-VL processor for one prompt and one video per row, where torchvision is absent:
    the video processor's steps (``Qwen3VLVideoProcessor._preprocess``) without torchvision, the prompt's
    placeholders as ``Qwen3VLProcessor.replace_video_token`` writes them."""

    def __init__(self, ckpt: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(ckpt)
        cfg = json.loads((Path(ckpt) / "video_preprocessor_config.json").read_text())
        self.size, self.patch = cfg["size"], cfg["patch_size"]
        self.merge, self.temporal = cfg["merge_size"], cfg["temporal_patch_size"]
        self.mean, self.std = cfg["image_mean"], cfg["image_std"]
        self.video_token_id = self.tokenizer.convert_tokens_to_ids("<|video_pad|>")

    def apply_chat_template(self, messages, **kw) -> str:
        return self.tokenizer.apply_chat_template(messages, **kw)

    def __call__(self, *, text, videos, video_metadata, **_):
        import torch
        import torch.nn.functional as F
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize

        rows, grids, texts = [], [], []
        for prompt, frames, meta in zip(text, videos, video_metadata):
            video = torch.from_numpy(frames).permute(0, 3, 1, 2)  # (T, C, H, W) uint8
            h, w = smart_resize(
                video.shape[0],
                video.shape[2],
                video.shape[3],
                temporal_factor=self.temporal,
                factor=self.patch * self.merge,
                min_pixels=self.size["shortest_edge"],
                max_pixels=self.size["longest_edge"],
            )
            if (h, w) != tuple(video.shape[-2:]):  # the uint8 kernel torchvision's v2 resize runs on CPU
                video = F.interpolate(video, size=(h, w), mode="bicubic", antialias=True, align_corners=False)
            video = video.float()
            mean = torch.tensor(self.mean).view(1, 3, 1, 1) * 255.0
            std = torch.tensor(self.std).view(1, 3, 1, 1) * 255.0
            video = ((video - mean) / std)[None]
            patches, gt, gh, gw = Qwen3VLVideoProcessor.patchify(
                None, video, patch_size=self.patch, merge_size=self.merge, temporal_patch_size=self.temporal
            )
            rows.append(patches[0])
            grids.append([gt, gh, gw])
            stamps = self._timestamps(list(meta.frames_indices), meta.fps or 24.0)
            per_frame = gh * gw // self.merge**2
            placeholder = "".join(
                f"<{stamps[i]:.1f} seconds><|vision_start|>" + "<|video_pad|>" * per_frame + "<|vision_end|>"
                for i in range(gt)
            )
            texts.append(
                prompt.replace("<|video_pad|>", placeholder, 1)
            )  # the video token alone, as 5.x does
        batch = dict(self.tokenizer(texts, return_tensors="pt", padding=True, padding_side="left"))
        batch["mm_token_type_ids"] = (batch["input_ids"] == self.video_token_id).long() * 2
        batch["pixel_values_videos"] = torch.cat(rows)
        batch["video_grid_thw"] = torch.tensor(grids)
        return batch

    def _timestamps(self, indices: list[int], fps: float) -> list[float]:  # Qwen3VLProcessor's, verbatim
        if len(indices) % self.temporal != 0:
            indices.extend(indices[-1] for _ in range(self.temporal - len(indices) % self.temporal))
        timestamps = [idx / fps for idx in indices]
        return [
            (timestamps[i] + timestamps[i + self.temporal - 1]) / 2
            for i in range(0, len(timestamps), self.temporal)
        ]


def _processor(ckpt: str):
    """transformers' processor where it can process videos here, else :class:`VideoStepsProcessor`."""
    try:
        import torchvision  # noqa: F401
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(ckpt), "transformers AutoProcessor"
    except ImportError:
        return VideoStepsProcessor(ckpt), "Qwen3VLVideoProcessor's steps without torchvision"


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_loop(spec: dict, clock: harness.Stopwatch) -> dict:
    """The author's loop over ``spec['clips']``; returns its times, per-call patch-embed record and the
    slow-path projection."""
    import torch
    from torch.utils.data import DataLoader
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionPatchEmbed

    device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    model = AutoModelForImageTextToText.from_pretrained(spec["ckpt"], dtype=dtype).to(device).eval()
    embed = next(m for m in model.modules() if isinstance(m, Qwen3VLVisionPatchEmbed))
    conv = embed.proj  # kept: the stock conv, for the projection after the loop
    Qwen3VLVisionPatchEmbed.forward = _fast_forward
    calls: list[tuple[int, float]] = []  # (patches, ms) per patch-embed call, device synchronised
    opened: list[harness.Stopwatch] = []

    def opening(module, args) -> None:  # hooks return None: a value would replace the call's arguments
        _sync(device)
        opened.append(harness.Stopwatch())

    def closing(module, args, output) -> None:
        _sync(device)
        calls.append((args[0].shape[0], 1e3 * opened.pop().wall))

    embed.register_forward_pre_hook(opening)
    embed.register_forward_hook(closing)
    processor, which = _processor(spec["ckpt"])
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": PROMPT}]}]
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    load_s = clock.wall  # the child's clock: started before its imports
    parts = dict.fromkeys(("wait_s", "processor_s", "forward_s", "save_s"), 0.0)
    loader = DataLoader(
        Clips(spec["clips"]), batch_size=spec["batch"], num_workers=spec["workers"], collate_fn=list
    )
    loop, n = harness.Stopwatch(), 0  # its laps: each phase of each batch
    for i, batch in enumerate(loader):
        parts["wait_s"] += loop.lap()
        ids, frames, metas = zip(*batch)
        kwargs = {"text": [text] * len(batch), "videos": list(frames), "video_metadata": list(metas)}
        kwargs.update(do_sample_frames=False, return_tensors="pt", padding=True, padding_side="left")
        try:
            inputs = processor(**kwargs)
        except Exception as e:  # transformers' own processor, untried where this was written: say, go on
            if isinstance(processor, VideoStepsProcessor):
                raise
            which += f"; failed ({type(e).__name__}: {str(e)[:200]}), so: Qwen3VLVideoProcessor's steps"
            processor = VideoStepsProcessor(spec["ckpt"])
            inputs = processor(**kwargs)
        inputs = {k: v.to(device) if hasattr(v, "to") else v for k, v in inputs.items()}
        parts["processor_s"] += loop.lap()
        with torch.inference_mode():
            hidden = model(**inputs, output_hidden_states=True).hidden_states
        feats = hidden[-1][:, -1].float().cpu()  # left padded: the last position is every row's last token
        _sync(device)
        parts["forward_s"] += loop.lap()
        torch.save({"ids": list(ids), "features": feats}, out / f"chunk_{i:05d}.pt")
        parts["save_s"] += loop.lap()
        n += len(batch)
    loop_s = loop.wall
    result = {
        "clips": n,
        "processor": which,
        "load_s": load_s,
        "loop_s": loop_s,
        **parts,
        "patch_embed_calls": calls,
        "patch_embed_s": sum(ms for _, ms in calls) / 1e3,
    }
    if spec.get("project", True):  # once per run: a slow call costs seconds (22-41 s on an H200)
        result["projection"] = project(conv, calls, device, dtype, spec["slow_patches"], spec["slow_calls"])
    return result


def project(conv, calls, device, dtype, cap: int, repeats: int) -> dict:
    """The stock conv and the slow path timed at ``min(N, cap)`` patches, scaled to each call's N."""
    import torch

    from vlfast.diagnosis.timing import measure

    off = torch.backends.cudnn.flags if device.type == "cuda" else torch.backends.mkldnn.flags
    n = min(cap, max((c for c, _ in calls), default=cap))
    x = torch.randn(n, conv.in_channels, *conv.kernel_size, generator=torch.Generator().manual_seed(0))
    x = x.to(device, dtype)
    per_patch = {}
    with torch.inference_mode():
        stock = measure(lambda: conv(x), device=device, warmup=1, repeats=max(3, repeats))
        per_patch["stock"] = stock.median_ms / n
        with off(enabled=False):
            slow = measure(lambda: conv(x), device=device, warmup=0, repeats=repeats)
        per_patch["slow"] = slow.median_ms / n
    return {
        "timed_at_patches": n,
        "slow_calls_ms": list(slow.times_ms),
        "stock_ms": stock.median_ms,
        **{
            f"{k}_s": sum(c for c, _ in calls) * v / 1e3 for k, v in per_patch.items()
        },  # all calls, projected
    }


# ------------------------------------------------------------------------------------------------- vlfast


def run_vlfast(spec: dict, clock: harness.Stopwatch) -> dict:
    from vlfast.extraction import extract

    s = extract(
        spec["clips_dir"],
        spec["out"],
        model=spec["ckpt"],
        features="llm",
        layers=(-1,),
        pools=("last",),
        prompt=PROMPT,
        num_frames=FRAMES,
        device=spec["device"],
        dtype=spec["dtype"],
    )
    return {
        "clips": s.extracted,
        "failed": s.failed,
        "load_s": s.load_seconds,
        "loop_s": s.seconds,
        "forward_s": s.compute_seconds,
        "fingerprint_s": s.fingerprint_seconds,
        "batches_tokens": s.tokens,
    }


def child(variant: str, spec: dict) -> None:
    import torch

    clock = harness.Stopwatch()
    got = run_loop(spec, clock) if variant == "loop" else run_vlfast(spec, clock)
    got["seconds"] = clock.wall
    if spec["device"].startswith("cuda"):
        got["cuda_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(got))


# ------------------------------------------------------------------------------------------------- parent


class TreeRss:
    """Peak of the summed RSS of a process and its descendants, sampled every ``every`` seconds."""

    def __init__(self, pid: int, every: float = 0.1) -> None:
        self.pid, self.every, self.peak = pid, every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            import psutil
        except ImportError:  # not a vlfast dependency: the tree's peak is then unknown
            self.peak = None
            return

        try:
            root = psutil.Process(self.pid)
        except psutil.Error:
            return
        while not self._stop.is_set():
            total = 0
            try:
                for p in [root, *root.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        total += p.memory_info().rss
            except psutil.Error:
                break
            self.peak = max(self.peak, total)
            self._stop.wait(self.every)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run_child(variant: str, spec: dict, work: Path) -> dict:
    """One side in a fresh process; its printed JSON, with its peak RSS (``wait4``) and its tree's."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parent / "src"), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", variant, "--spec", json.dumps(spec)]
    so, se = work / f"{variant}.stdout", work / f"{variant}.stderr"
    with so.open("wb") as out, se.open("wb") as err:  # files, not pipes: wait4 below reaps the child
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        tree = TreeRss(proc.pid)
        _, status, usage = os.wait4(proc.pid, 0)
        tree_peak = tree.stop()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{variant} failed ({os.waitstatus_to_exitcode(status)}):\n{se.read_text()[-3000:]}")
    got = json.loads(so.read_text().strip().splitlines()[-1])
    got["tree_peak_rss_gib"] = tree_peak / 2**30 if tree_peak is not None else None
    got["peak_rss_gib"] = usage.ru_maxrss / 2**20  # KiB on Linux
    return got


def _features_cosine(loop_out: Path, vlfast_out: Path) -> float | None:
    """Min over clips of the cosine between the loop's feature and vlfast's."""
    import torch

    from vlfast.extraction import FeatureCache

    cache = FeatureCache(vlfast_out)
    worst = None
    for f in sorted(loop_out.glob("chunk_*.pt")):
        saved = torch.load(f)
        for cid, feat in zip(saved["ids"], saved["features"]):
            match = [i for i in cache.ids() if Path(str(i)).stem == cid or str(i).endswith(cid)]
            if not match:
                continue
            sample = cache[match[0]]
            key = next((k for k in sample if k.startswith("llm.last.")), None)
            if key is None:
                continue
            v = sample[key].double().flatten()
            cos = torch.nn.functional.cosine_similarity(v, feat.double().flatten(), dim=0).item()
            worst = cos if worst is None else min(worst, cos)
    return worst


def machine(device: str) -> dict:
    import torch

    sys.path.insert(0, str(HERE))
    from harness import cpu_model

    info = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def run(args) -> dict:
    width, height = (int(v) for v in args.clip_size.lower().split("x"))
    load_start = round(os.getloadavg()[0], 2)
    with tempfile.TemporaryDirectory(prefix="vlfast-clips-") as tmp:
        work = Path(tmp)
        with harness.Stopwatch() as sw:
            clips = make_clips(work / "clips", args.clips, width, height)
            ckpt = make_checkpoint(work, args.model, args.llm_layers, args.device)
        setup_s = sw.wall
        spec = {
            "ckpt": str(ckpt),
            "clips": [str(p) for p in clips],
            "clips_dir": str(work / "clips"),
            "device": args.device,
            "dtype": args.dtype,
            "batch": args.batch,
            "workers": args.loop_workers,
            "slow_patches": args.slow_patches,
            "slow_calls": args.slow_calls,
        }
        done = {v: 0 for v in VARIANTS}

        def side(v: str) -> dict:  # a child process timing itself (its Stopwatch); round 0's output kept
            r, out = done[v], work / f"{v}-{done[v]}"
            got = run_child(v, {**spec, "out": str(out), "project": r == 0}, work)
            got["load_average"] = round(os.getloadavg()[0], 2)
            print(
                f"round {r + 1}/{args.rounds} {v}: {got['clips']} clips in {got['seconds']:.1f} s",
                file=sys.stderr,
            )
            if r:
                shutil.rmtree(out, ignore_errors=True)
            done[v] += 1
            return got

        rounds = harness.alternate_measured({v: lambda v=v: side(v) for v in VARIANTS}, args.rounds)
        cosine = _features_cosine(work / "loop-0", work / "vlfast-0") if args.rounds else None
    return summarise(rounds, args, cosine, setup_s, load_start)


def _side_rows(rounds: dict[str, list[dict]], n: int, p: dict) -> list[dict]:
    """Each side's row: whole seconds and the loop's own, clips per hour, vlfast's speed-up over it; the
    loop before its fix projected from ``p`` (the patch-embed calls timed on each path)."""
    loop = [r["seconds"] for r in rounds["loop"]]
    ours = [r["seconds"] for r in rounds["vlfast"]]
    # the loop as before its fix: its own Linear patch-embed time swapped for each path's projected calls
    slow_s = [r["seconds"] - r["patch_embed_s"] + p["slow_s"] for r in rounds["loop"]]
    stock_s = [r["seconds"] - r["patch_embed_s"] + p["stock_s"] for r in rounds["loop"]]
    # Each side's own loop (model load and start-up excluded): the rate a long job runs at.
    ours_loop = [r["loop_s"] for r in rounds["vlfast"]]
    loop_loop = [r["loop_s"] for r in rounds["loop"]]
    sides = {  # side -> (whole seconds per round, loop seconds per round)
        "vlfast": (ours, ours_loop),
        "loop": (loop, loop_loop),
        "loop, stock conv (projected)": (
            stock_s,
            [r["loop_s"] - r["patch_embed_s"] + p["stock_s"] for r in rounds["loop"]],
        ),
        "loop, slow path (projected)": (
            slow_s,
            [r["loop_s"] - r["patch_embed_s"] + p["slow_s"] for r in rounds["loop"]],
        ),
    }
    rows = [
        {
            "side": side,
            "seconds": harness.median(secs),
            "seconds_range": [min(secs), max(secs)],
            "clips_per_s": n / harness.median(secs),
            "clips_per_hour": 3600 * n / harness.median(secs),
            "vlfast_speedup": harness.median(a / b for a, b in zip(secs, ours)),
            "loop_s": harness.median(own),
            "loop_clips_per_hour": 3600 * n / harness.median(own),
            "vlfast_loop_speedup": harness.median(a / b for a, b in zip(own, ours_loop)),
        }
        for side, (secs, own) in sides.items()
    ]
    return rows


def summarise(rounds: dict[str, list[dict]], args, cosine, setup_s: float, load_start) -> dict:
    n = rounds["loop"][0]["clips"]

    def med(variant: str, key: str) -> float | None:
        vals = [r[key] for r in rounds[variant] if r.get(key) is not None]
        return harness.median(vals) if vals else None

    loop = [r["seconds"] for r in rounds["loop"]]
    ours = [r["seconds"] for r in rounds["vlfast"]]
    ratios = [a / b for a, b in zip(loop, ours)]
    own_ratios = [a["loop_s"] / b["loop_s"] for a, b in zip(rounds["loop"], rounds["vlfast"])]
    p = rounds["loop"][0]["projection"]  # timed in the first round; every round made the same calls
    rows = _side_rows(rounds, n, p)
    return {
        "model": args.model,
        "llm_layers": args.llm_layers if args.model == "reduced" else None,
        "device": args.device,
        "dtype": args.dtype,
        "clips": n,
        "clip": f"2 s, 8 fps, {args.clip_size}, H.264; {FRAMES} frames sampled",
        "batch": args.batch,
        "loop_workers": args.loop_workers,
        "rounds_run": args.rounds,
        "processor": rounds["loop"][0]["processor"],
        "rows": rows,
        "ratio_median": harness.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
        "ratio_own_loop_median": harness.median(own_ratios),
        "min_cosine_loop_vs_vlfast": cosine,
        "where": {
            "loop": {
                k: med("loop", k)
                for k in ("load_s", "loop_s", "wait_s", "processor_s", "forward_s", "patch_embed_s", "save_s")
            },
            "vlfast": {
                k: med("vlfast", k) for k in ("seconds", "load_s", "fingerprint_s", "loop_s", "forward_s")
            },
        },
        "memory_gib": {
            v: {k: med(v, k) for k in ("peak_rss_gib", "tree_peak_rss_gib", "cuda_peak_gib")}
            for v in VARIANTS
        },
        "projection": {
            "timed_at_patches": p["timed_at_patches"],
            "slow_call_ms": harness.median(p["slow_calls_ms"]),
            "stock_call_ms": p["stock_ms"],
            "patch_embed_calls": len(rounds["loop"][0]["patch_embed_calls"]),
            "patches_per_call": sorted({c for c, _ in rounds["loop"][0]["patch_embed_calls"]}),
        },
        "setup_s": setup_s,
        "rounds": rounds,
        "machine": machine(args.device),
        "load_average": {"start": load_start, "end": round(os.getloadavg()[0], 2)},
    }


def _gib(v: float | None) -> str:
    return "?" if v is None else f"{v:.2f}"


def render(s: dict) -> str:
    m, la, w, mem, p = s["machine"], s["load_average"], s["where"], s["memory_gib"], s["projection"]
    model = (
        "tiny offline Qwen3-VL"
        if s["model"] == "tiny"
        else (f"reduced Qwen3-VL-4B (full-size tower, {s['llm_layers']}-layer LLM at 2560)")
    )
    gpu = f"GPU: {m['gpu']}; " if m.get("gpu") else ""
    lines = [
        f"{s['clips']} clips ({s['clip']}) through the {model}, {s['device']}, {s['dtype']}; loop batch {s['batch']}, "
        f"{s['loop_workers']} DataLoader workers; medians of {s['rounds_run']} alternating rounds; each side's "
        "seconds from after `import torch` to its last file, model load included.",
        "",
        f"{gpu}CPU: {m['cpu']}, {m['cores']} cores; torch {m['torch']}; Python {m['python']}; OMP_WAIT_POLICY "
        f"{m['omp_wait_policy']}; load average {la['start']} at the start, {la['end']} at the end",
        "",
        "| side | end to end, s (range) | clips/s | clips/hour | vlfast speed-up | its loop, s | clips/hour "
        "in the loop | vlfast speed-up, loops |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in s["rows"]:
        lo, hi = r["seconds_range"]
        lines.append(
            f"| {r['side']} | {r['seconds']:.1f} ({lo:.1f}-{hi:.1f}) | {r['clips_per_s']:.2f} | "
            f"{r['clips_per_hour']:,.0f} | {r['vlfast_speedup']:.2f}x | {r['loop_s']:.1f} | "
            f"{r['loop_clips_per_hour']:,.0f} | {r['vlfast_loop_speedup']:.2f}x |"
        )
    lw, vw = w["loop"], w["vlfast"]
    lines += [
        "",
        f"Where the time goes (medians, s). Loop: model load {lw['load_s']:.1f}, its loop {lw['loop_s']:.1f} = waiting "
        f"for the DataLoader {lw['wait_s']:.1f} + processor {lw['processor_s']:.1f} + forward {lw['forward_s']:.1f} "
        f"(patch embed {lw['patch_embed_s']:.2f}) + torch.save {lw['save_s']:.2f}. vlfast: model load "
        f"{vw['load_s']:.1f} (weights fingerprint {vw['fingerprint_s']:.1f}), its loop {vw['loop_s']:.1f} of which "
        f"forwards {vw['forward_s']:.1f} (decoding overlapped in workers), the rest of its seconds "
        f"{vw['seconds'] - vw['load_s'] - vw['loop_s']:.1f} (imports, listing, planning, committing).",
        f"Peak memory (GiB): loop {_gib(mem['loop']['peak_rss_gib'])} RSS, {_gib(mem['loop']['tree_peak_rss_gib'])} "
        f"with its workers; vlfast {_gib(mem['vlfast']['peak_rss_gib'])} RSS, "
        f"{_gib(mem['vlfast']['tree_peak_rss_gib'])} with its workers"
        + (
            f"; CUDA loop {_gib(mem['loop']['cuda_peak_gib'])}, vlfast {_gib(mem['vlfast']['cuda_peak_gib'])}"
            if mem["loop"].get("cuda_peak_gib") is not None
            else ""
        )
        + ".",
        f"Projection: {p['patch_embed_calls']} patch-embed calls of {', '.join(f'{c:,}' for c in p['patches_per_call'])} "
        f"patches; one slow-path call timed at {p['timed_at_patches']:,} patches: {p['slow_call_ms']:,.0f} ms, "
        f"the stock conv {p['stock_call_ms']:,.1f} ms; scaled linearly by patches.",
        f"Processor in the loop: {s['processor']}. Features, loop against vlfast: min cosine "
        + (
            f"{s['min_cosine_loop_vs_vlfast']:.6f}"
            if s["min_cosine_loop_vs_vlfast"] is not None
            else "not compared"
        )
        + f". vlfast over the loop: {s['ratio_median']:.2f}x ({s['ratio_range'][0]:.2f}-{s['ratio_range'][1]:.2f}), "
        f"loops alone (model load excluded) {s['ratio_own_loop_median']:.2f}x.",
    ]
    return "\n".join(lines)


@contextlib.contextmanager
def _stdout_to_stderr():
    """File descriptor 1 onto 2 for the duration (deepspeed, where installed, logs to stdout on import)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("tiny", "reduced"), default="tiny")
    ap.add_argument("--llm-layers", type=int, default=2, help="with --model reduced: LLM layers (default 2)")
    ap.add_argument("--clips", type=int, default=32)
    ap.add_argument("--clip-size", default="256x192", help="WIDTHxHEIGHT of the generated clips")
    ap.add_argument("--batch", type=int, default=8, help="the loop's DataLoader batch (the report's: 8)")
    ap.add_argument("--loop-workers", type=int, default=2, help="the loop's DataLoader workers")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--slow-patches", type=int, default=3072, help="patches of the timed slow-path call")
    ap.add_argument("--slow-calls", type=int, default=1, help="slow-path calls timed per loop run")
    ap.add_argument("--json", action="store_true", help="print JSON (the table is its 'markdown')")
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, json.loads(args.spec))
        return 0
    if min(args.clips, args.batch, args.rounds, args.slow_patches, args.slow_calls, args.llm_layers) < 1:
        ap.error("--clips, --batch, --rounds, --slow-patches, --slow-calls and --llm-layers must be >= 1")
    with _stdout_to_stderr():  # what libraries print while building the checkpoint must not break the JSON
        result = run(args)
    result["markdown"] = render(result)
    result["command"] = "python benchmarks/clips_per_hour.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    harness.save_result("clips_per_hour", result, argv)
    print(json.dumps(result, indent=2) if args.json else result["markdown"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
