"""Embeddings per second: ``vlfast extract --features embedding`` against the reference's way.

The reference (QwenLM/Qwen3-VL-Embedding, ``Qwen3VLEmbedder.process``) embeds a list in one padded forward:
it decodes and preprocesses the whole list, then runs the model, then the next list; nothing overlaps and
the list's length, not its tokens, sets the batch. ``reference`` below is that loop over lists of
``--list-size`` rows, built on tests/_embedding_reference.py (the same recipe, bit for bit the same model
inputs as the reference's processor: tests/test_extract_embedding.py). ``vlfast`` is
``vlfast.extraction.extract`` with its defaults: decode worker processes beside the model, batches packed by
token budget.

Both embed the same manifest (images with and without a caption, short videos, texts alone) with the same
random-weight Qwen3-VL-Embedding-shaped checkpoint (``--size small``: a 6-layer, 512-wide language model and
a 6-layer tower, built offline; ``tiny``: the tests' checkpoint). Each variant runs in its own subprocess,
in alternating order for ``--rounds`` rounds, so the ratio is taken in one run under the same load; wall
time covers model load to the last vector, peak RSS is the child's (``wait4``). Each round also says where
the time went: ``forward_s`` (the model's forwards, synchronised on CUDA; vlfast's own
``compute_seconds``), and for vlfast ``loop_s`` (its loop over the samples, decoding overlapped) and
``load_s``; the rest of ``seconds`` is starting, listing and planning (vlfast) or reading, decoding and
preprocessing (the reference).

    python benchmarks/embed_throughput.py [--size small] [--rows 96] [--media small|camera] [--rounds 3] [--device cpu]
        [--dtype float32] [--list-size 8] [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (benchmarks/harness.py)

ROOT = Path(__file__).resolve().parents[1]

SMALL = {  # a random Qwen3-VL-Embedding-shaped model big enough that the forward is real work
    "text": {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "rope_scaling": {"rope_type": "default", "mrope_section": [8, 12, 12], "mrope_interleaved": True},
    },
    "vision": {
        "depth": 6,
        "hidden_size": 384,
        "intermediate_size": 1536,
        "num_heads": 6,
        "out_hidden_size": 512,
        "deepstack_visual_indexes": [1, 3, 5],
    },
}


MEDIA = {  # image sizes (w, h) by row, video (width, height, frames, fps)
    "small": {"image": (320, 240), "video": (160, 120, 8, 4)},
    # what a corpus holds: camera-sized photos and 10 s clips at 30 fps, decoded at 1 fps
    "camera": {"image": (1280, 960), "video": (640, 360, 300, 30)},
}


def build(folder: Path, size: str, rows: int, media: str = "small") -> tuple[Path, Path]:
    """The checkpoint and a manifest of ``rows`` rows: half images (half of them captioned), a quarter
    videos, a quarter texts alone; ``media`` sets their sizes (:data:`MEDIA`)."""
    import torch

    from vlfast.demo import _embedding_model_class, make_images, make_tiny_qwen3_vl, make_video

    ckpt = make_tiny_qwen3_vl(folder / "ckpt", embedding=True)
    if size == "small":
        from transformers import Qwen3VLConfig

        raw = json.loads((ckpt / "config.json").read_text())
        raw["text_config"].update(SMALL["text"])
        raw["vision_config"].update(SMALL["vision"])
        config = Qwen3VLConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
        torch.manual_seed(0)
        _embedding_model_class()(config).eval().save_pretrained(ckpt)
    n_img, n_vid = rows // 2, rows // 4
    (iw, ih), (vw, vh, frames, fps) = MEDIA[media]["image"], MEDIA[media]["video"]
    sizes = [(iw + 32 * (i % 7), ih + 24 * (i % 5)) for i in range(n_img)]
    images = make_images(folder / "media", sizes)
    videos = [
        make_video(
            folder / "media" / f"v{i}.mp4",
            frames=frames + fps * (i % 3),
            fps=fps,
            width=vw,
            height=vh,
            seed=i,
        )
        for i in range(n_vid)
    ]
    lines = []
    for i, p in enumerate(images):
        row = {"id": f"img{i}", "path": str(p)}
        if i % 2:
            row["text"] = "a photograph of a patterned surface " * (1 + i % 3)
        lines.append(row)
    lines += [{"id": f"vid{i}", "path": str(p), "text": "what happens"} for i, p in enumerate(videos)]
    lines += [
        {"id": f"txt{i}", "text": f"query {i}: a red bicycle leaning on a wall " * (1 + i % 4)}
        for i in range(rows - n_img - n_vid)
    ]
    manifest = folder / "rows.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return ckpt, manifest


CHILD = r"""
import json, sys
import torch
from harness import Stopwatch  # benchmarks/, on the child's path
variant, ckpt, manifest, out, list_size, device, dtype, tests = sys.argv[1:9]
clock = Stopwatch()
rows = [json.loads(line) for line in open(manifest)]
if variant == "vlfast":
    from vlfast.extraction import extract
    s = extract(manifest, out, model=ckpt, features="embedding", dtype=dtype, device=device)
    n = s.extracted
    # where the time went: the loop over samples (decoding overlapped), its forwards, loading the model
    parts = {"loop_s": s.seconds, "forward_s": s.compute_seconds, "load_s": s.load_seconds}
else:
    sys.path.insert(0, tests)
    import _embedding_reference as ref
    torch_dtype = getattr(torch, dtype)

    parts = {"forward_s": 0.0}

    def forward(ckpt, inputs, dtype):  # the reference's _forward, on the benchmark's device
        model = ref._load(str(ckpt), dtype)[3].to(device)
        sw = Stopwatch()
        inputs = {k: v.to(device) for k, v in inputs.items()}
        with torch.no_grad():
            hidden = model(**inputs, use_cache=False).last_hidden_state
        mask = inputs["attention_mask"]
        col = mask.shape[1] - mask.flip(dims=[1]).argmax(dim=1) - 1
        got = hidden[torch.arange(hidden.shape[0], device=hidden.device), col]
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        parts["forward_s"] += sw.stop().wall  # the rest is reading, decoding and preprocessing
        return got

    ref._forward = forward
    k = int(list_size)
    n = 0
    for i in range(0, len(rows), k):
        part = [{key: r[key] for key in ("path", "text", "instruction") if key in r} for r in rows[i : i + k]]
        n += ref.reference_embed_batch(ckpt, part, torch_dtype).cpu().shape[0]
    if device.startswith("cuda"):
        torch.cuda.synchronize()
print(json.dumps({"n": n, "seconds": clock.wall, **parts}))
"""


def run_child(variant: str, ckpt: Path, manifest: Path, out: Path, args) -> dict:
    env = harness.child_env(OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    cmd = [sys.executable, "-c", CHILD, variant, str(ckpt), str(manifest), str(out)]
    cmd += [str(args.list_size), args.device, args.dtype, str(ROOT / "tests")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    stdout, stderr = proc.stdout.read(), proc.stderr.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{variant} failed:\n{stderr[-3000:]}")
    got = json.loads(stdout.strip().splitlines()[-1])
    return {**got, "rate": got["n"] / got["seconds"], "peak_rss_mib": usage.ru_maxrss / 1024}


def machine() -> str:
    import torch

    cpu, flags = platform.processor() or platform.machine(), ""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        cpu = next(
            (ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), cpu
        )
        flags = info
    except OSError:
        pass
    isa = "AVX-512" if " avx512f" in flags else "AVX2" if " avx2" in flags else "?"
    isa = os.environ.get("ATEN_CPU_CAPABILITY", isa)  # a run limited to AVX2 says so
    return f"{cpu}, {os.cpu_count()} cores, {isa}, torch {torch.__version__}, load {os.getloadavg()[0]:.2f}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=("tiny", "small"), default="small")
    ap.add_argument("--rows", type=int, default=96)
    ap.add_argument("--media", choices=tuple(MEDIA), default="small")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--list-size", type=int, default=8, help="rows per reference forward (its list)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="vlfast-embed-bench-") as tmp:
        folder = Path(tmp)
        ckpt, manifest = build(folder, args.size, args.rows, args.media)
        calls = itertools.count()  # a fresh OUT per run; each child times itself (the harness's Stopwatch)
        sides = {
            v: lambda v=v: run_child(v, ckpt, manifest, folder / f"out-{next(calls)}", args)
            for v in ("vlfast", "reference")
        }
        results = harness.alternate_measured(sides, args.rounds)
        ratios = [a["rate"] / b["rate"] for a, b in zip(results["vlfast"], results["reference"])]
    summary = {
        "machine": machine(),
        "size": args.size,
        "rows": args.rows,
        "media": args.media,
        "list_size": args.list_size,
        "device": args.device,
        "dtype": args.dtype,
        "rounds": results,
        "ratio_median": harness.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }
    harness.save_result("embed_throughput", summary)
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(summary["machine"])
    for v, rs in results.items():
        rates = [x["rate"] for x in rs]
        rss = max(x["peak_rss_mib"] for x in rs)
        fwd = harness.median(x["forward_s"] / x["seconds"] for x in rs)
        print(
            f"{v:9s} {harness.median(rates):7.2f} embeddings/s "
            f"(min {min(rates):.2f}, max {max(rates):.2f}), peak RSS {rss:,.0f} MiB, "
            f"{fwd:.0%} of the wall time in forwards"
        )
    print(
        f"ratio vlfast/reference: median {summary['ratio_median']:.2f}x "
        f"(min {summary['ratio_min']:.2f}, max {summary['ratio_max']:.2f}) over {args.rounds} rounds"
    )


if __name__ == "__main__":
    main()
