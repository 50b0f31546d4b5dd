"""Peak memory of ``--features llm --layers -1``: before (``output_hidden_states``) and after (hooks).

Before this change the whole VLM ran with ``output_hidden_states=True`` and the LM head, keeping every
layer's (B, L, D) hidden states and the (B, L, vocab) logits to pool one layer. Now hooks on the requested
decoder layers pool as the forward goes and stop it after the deepest (``HiddenStateTaps``); for
``--layers -1`` every layer and the final norm run, the LM head does not.

Each variant runs in a fresh subprocess: build the model (random weights), build one batch of synthetic
images (prompts of ``<|vision_start|>`` + one ``<|image_pad|>`` per merged token + ``<|vision_end|>`` +
some text ids, as PromptBuilder lays them out), reset the kernel's peak-RSS mark (``/proc/self/clear_refs``),
run the forward, read ``VmHWM``. Reported: RSS before the forward (the model), the forward's peak above it,
the whole process's peak, the time, and what ``output_hidden_states`` and the logits weigh on paper.

Models: ``tiny`` (the tests' random Qwen3-VL, 2 layers of 64) and ``2b``, a random Qwen3-VL with the
published Qwen3-VL-2B-Instruct sizes (text: hidden 2048, MLP 6144, 28 layers, 16 heads / 8 KV heads of 128,
vocabulary 151,936, tied embeddings; vision: vlfast's ``ref:qwen3-vl-2b``), built offline in the child
(about 2.1 B parameters, 8.5 GB in float32). ``--text-layers`` builds it with fewer decoder layers.

    python benchmarks/extract.py llm-memory --model tiny
    python benchmarks/extract.py llm-memory --model 2b --images 4 --size 448 [--text-layers 28] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

QWEN3_VL_2B_TEXT = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 262144,
    "rope_theta": 5_000_000,
    "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True},
    "tie_word_embeddings": True,
}
TOKEN_IDS = {  # Qwen3-VL's, as in the published config
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def build(model: str, text_layers: int | None, tmp: str):
    import torch

    if model == "tiny":
        from vlfast.demo import make_tiny_qwen3_vl
        from vlfast.models import load_config, load_model

        path = make_tiny_qwen3_vl(os.path.join(tmp, "tiny"))
        config = load_config(path)
        ids = {k: int(getattr(config, k)) for k in TOKEN_IDS}
        return load_model(path, dtype=torch.float32), ids
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from vlfast.models import reference_config

    text = dict(QWEN3_VL_2B_TEXT)
    if text_layers:
        text["num_hidden_layers"] = text_layers
    vision = reference_config("ref:qwen3-vl-2b").to_dict()
    config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **TOKEN_IDS)
    torch.manual_seed(0)
    return Qwen3VLForConditionalGeneration(config).eval(), dict(TOKEN_IDS)


def _items(model, ids: dict, images: int, size: int, text: int) -> tuple[list, object, int]:
    """``images`` decoded samples of ``size`` pixels square, each prompt its image's tokens and some text
    (one id more each, so the batch pads); the text config and the spatial merge size."""
    import torch

    from vlfast.extraction.decode.stage import DecodedSample

    vcfg, tcfg = model.config.vision_config, model.config.text_config
    p, m, tp = vcfg.patch_size, vcfg.spatial_merge_size, vcfg.temporal_patch_size
    grid = (1, size // p, size // p)
    n_patches = grid[1] * grid[2]
    tokens = n_patches // m**2
    g = torch.Generator().manual_seed(0)
    items = []
    for i in range(images):
        words = torch.randint(0, min(tcfg.vocab_size, 150_000), (text + i,), generator=g)
        input_ids = torch.cat(
            [
                torch.tensor([ids["vision_start_token_id"]]),
                torch.full((tokens,), ids["image_token_id"]),
                torch.tensor([ids["vision_end_token_id"]]),
                words,
            ]
        )
        pixels = torch.randn(n_patches, 3 * tp * p * p, generator=g)
        items.append(DecodedSample(i, "image", pixels, grid, tokens, {}, input_ids))
    return items, tcfg, m


def child(variant: str, model_name: str, text_layers: int | None, images: int, size: int, text: int) -> dict:
    import torch

    from vlfast.extraction.decode.stage import DecodedSample
    from vlfast.extraction.model.features import FeatureSpec, compute_llm_features, llm_inputs

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        with harness.Stopwatch() as sw:
            model, ids = build(model_name, text_layers, tmp)
        build_s = sw.wall
    items, tcfg, m = _items(model, ids, images, size, text)
    kw = {
        "image_token_id": ids["image_token_id"],
        "video_token_id": ids["video_token_id"],
        "pad_token_id": 0,
        "device": torch.device("cpu"),
        "dtype": torch.float32,
    }
    tower = model.model.visual
    spec = FeatureSpec(("llm",), (-1,), ("last",))

    def before():
        # What compute_llm_features did before the hooks (inputs built inside, as it builds them).
        inputs, lengths = llm_inputs(items, **kw)
        out = model(**inputs, output_hidden_states=True, use_cache=False)
        h = out.hidden_states[-1].float()
        return [h[i, n - 1].clone() for i, n in enumerate(lengths)]

    def after():
        return [
            f["llm.last.layer" + str(tcfg.num_hidden_layers)]
            for f in compute_llm_features(model, tower, items, spec, **kw)
        ]

    import gc

    # One forward of a one-image, 2 x 2 token batch first: what is set up once (thread pools, kernel caches)
    # is not counted, and the heap does not keep the measured batch's freed blocks from a full warm-up.
    small = [DecodedSample(0, "image", items[0].pixel_values[: (2 * m) ** 2], (1, 2 * m, 2 * m), 4, {}, None)]
    small[0].input_ids = torch.cat(
        [items[0].input_ids[:1], torch.full((4,), ids["image_token_id"]), items[0].input_ids[-3:]]
    )
    warm_inputs, _ = llm_inputs(small, **kw)
    with torch.inference_mode():
        if variant == "before":
            model(**warm_inputs, output_hidden_states=True, use_cache=False)
        else:
            compute_llm_features(model, tower, small, spec, **kw)
    del warm_inputs
    gc.collect()
    rss_before = _status_kib("VmRSS") * 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM (the peak RSS) to the current RSS
    with harness.Stopwatch() as sw, torch.inference_mode():
        result = before() if variant == "before" else after()
    forward_s = sw.wall
    peak = _status_kib("VmHWM") * 1024
    batch, longest = len(items), max(int(it.input_ids.numel()) for it in items)
    elem = 4  # float32
    return {
        "variant": variant,
        "model": model_name,
        "text_layers": tcfg.num_hidden_layers,
        "hidden": tcfg.hidden_size,
        "vocab": tcfg.vocab_size,
        "params": sum(t.numel() for t in model.parameters()),
        "images": images,
        "size": size,
        "batch_tokens": batch * longest,
        "build_s": round(build_s, 1),
        "forward_s": round(forward_s, 2),
        "rss_before": rss_before,
        "peak_rss": peak,
        "forward_peak": peak - rss_before,
        "hidden_states_bytes": (tcfg.num_hidden_layers + 1) * batch * longest * tcfg.hidden_size * elem,
        "logits_bytes": batch * longest * tcfg.vocab_size * elem,
        "checksum": float(sum(r.double().sum() for r in result)),
    }


def measure(variant: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--model", args.model, "--images", str(args.images)]
    cmd += ["--size", str(args.size), "--text", str(args.text)]
    if args.text_layers:
        cmd += ["--text-layers", str(args.text_layers)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise SystemExit(f"{variant} failed ({r.returncode}):\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "2b"], default="tiny")
    ap.add_argument("--text-layers", type=int, default=None, help="decoder layers (2b: 28 unless given)")
    ap.add_argument("--images", type=int, default=4, help="images in the batch")
    ap.add_argument("--size", type=int, default=448, help="image side in pixels (multiple of 32)")
    ap.add_argument("--text", type=int, default=24, help="text tokens after each image (+ its index)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        res = child(args.child, args.model, args.text_layers, args.images, args.size, args.text)
        print(json.dumps(res))
        return
    got = harness.alternate_measured({v: lambda v=v: measure(v, args) for v in ("before", "after")}, 1)
    rows = [got["before"][0], got["after"][0]]  # each a child process measuring itself
    if rows[0]["checksum"] != rows[1]["checksum"]:
        raise SystemExit(f"before and after differ: {rows[0]['checksum']} != {rows[1]['checksum']}")
    record({"rows": rows})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    import torch

    r0 = rows[0]
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}; {args.model}: {r0['params'] / 1e9:.3f} B parameters, {r0['text_layers']} "
        f"decoder layers of {r0['hidden']}, float32; {args.images} images of {args.size}x{args.size}, "
        f"{r0['batch_tokens']} tokens in the batch (padded)"
    )
    print(
        f"# on paper: output_hidden_states {mib(r0['hidden_states_bytes'])}, logits {mib(r0['logits_bytes'])}"
    )
    print("| variant | RSS before the forward | forward's peak above it | peak RSS | forward |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['variant']} | {mib(r['rss_before'])} | {mib(r['forward_peak'])} | {mib(r['peak_rss'])} | "
            f"{r['forward_s']} s |"
        )


def record(result: dict) -> None:
    """The result into the run's result file (a no-op outside benchmarks/SCRIPT.py MODE)."""
    harness.record(result)


if __name__ == "__main__":
    main()
