"""What a forward per sample costs against one forward per batch on the CPU (issue 46 item 8).

Since issue 46 the engines run each sample of a CPU batch alone (``vlfast.extraction.model.runner.runs_alone``)
so that its features do not depend on its batch-mates. This times both ways on the same samples in one
process, alternating each round so a drift in the machine's load favours neither, after one warm-up of each:

- ``tower``: vision features, the full-size ``ref:qwen3-vl-2b`` tower (random weights, convs patched as
  extract patches them), ``--images`` images of ``--size`` pixels square: small images are the case where a
  batch has the most to gain (each alone is a product of few rows);
- ``llm``: ``--features llm --layers -1`` through a random Qwen3-VL with Qwen3-VL-2B's published sizes and
  ``--text-layers`` decoder layers (the tower whole), prompts of different lengths (so the batch pads them),
  as benchmarks/extract.py llm-memory builds it;
- ``texts``: the same model on ``--texts`` texts alone (an embedding's text rows), 16 to 61 tokens: no tower,
  short products, where a forward's fixed cost weighs most.

Both float32 (vlfast's CPU default). Reported: each side's median seconds over ``--rounds``, the ratio
alone / batched of the medians and of each round's pair, and the machine with its load average.

    python benchmarks/extract.py alone [--images 4] [--size 224] [--text-layers 4] [--texts 16] [--rounds 3] [--only tower|llm|texts] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
from llm_features_memory import QWEN3_VL_2B_TEXT, TOKEN_IDS  # noqa: E402

import harness  # noqa: E402
from harness import cpu_model  # noqa: E402


def _images(vcfg, n: int, size: int, text: int, ids: dict[str, int] | None):
    from vlfast.extraction.decode.stage import DecodedSample

    p, m, tp = vcfg.patch_size, vcfg.spatial_merge_size, vcfg.temporal_patch_size
    grid = (1, size // p, size // p)
    patches = grid[1] * grid[2]
    g = torch.Generator().manual_seed(0)
    items = []
    for i in range(n):
        item = DecodedSample(
            i, "image", torch.randn(patches, 3 * tp * p * p, generator=g), grid, patches // m**2
        )
        if ids is not None:  # a prompt as PromptBuilder lays it out, each 3 tokens longer than the last
            words = torch.randint(0, 150_000, (text + 3 * i,), generator=g)
            start, end = (
                torch.tensor([ids["vision_start_token_id"]]),
                torch.tensor([ids["vision_end_token_id"]]),
            )
            item.input_ids = torch.cat([start, torch.full((item.tokens,), ids["image_token_id"]), end, words])
        items.append(item)
    return items


def _texts(n: int):
    from vlfast.extraction.decode.stage import DecodedSample

    g = torch.Generator().manual_seed(1)
    items = []
    for i in range(n):
        item = DecodedSample(i, "text", torch.empty(0, 3 * 2 * 16 * 16), (0, 0, 0), 0)
        item.input_ids = torch.randint(0, 150_000, (16 + 3 * i,), generator=g)
        items.append(item)
    return items


def _sides(kind: str, args) -> tuple[dict, str]:
    """The two ways to run the workload: {"batched": fn, "alone": fn}, and what it is."""
    from vlfast.extraction.model.features import (
        FeatureSpec,
        VisionBatch,
        compute_llm_features,
        compute_vision_features,
    )
    from vlfast.models import build_reference
    from vlfast.patching.gemm import patch

    if kind == "tower":
        tower = build_reference("qwen3-vl-2b").eval()
        patch(tower)
        items = _images(tower.config, args.images, args.size, 0, None)
        names = ("vision", "vision_mean")

        def run(batch):
            vb = VisionBatch(
                pixel_values=torch.cat([it.pixel_values for it in batch]),
                grid_thw=torch.tensor([list(it.grid) for it in batch]),
                tokens=[it.tokens for it in batch],
            )
            return compute_vision_features(tower, vb, names)

        what = f"tower ref:qwen3-vl-2b, {args.images} images of {args.size}x{args.size} ({items[0].patches} patches)"
    else:
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

        from vlfast.models import reference_config

        text = dict(QWEN3_VL_2B_TEXT, num_hidden_layers=args.text_layers)
        vision = reference_config("ref:qwen3-vl-2b").to_dict()
        config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **TOKEN_IDS)
        torch.manual_seed(0)
        model = Qwen3VLForConditionalGeneration(config).eval()
        patch(model.model.visual)
        if kind == "llm":
            items = _images(model.config.vision_config, args.images, args.size, args.text, TOKEN_IDS)
        else:
            items = _texts(args.texts)
        spec = FeatureSpec(("llm",), (-1,), ("last",))
        kw = {"image_token_id": TOKEN_IDS["image_token_id"], "video_token_id": TOKEN_IDS["video_token_id"]}
        kw |= {"pad_token_id": 0, "device": torch.device("cpu"), "dtype": torch.float32}

        def run(batch):
            return compute_llm_features(model, model.model.visual, batch, spec, **kw)

        lengths = [int(it.input_ids.numel()) for it in items]
        inputs = (
            f"{args.images} images of {args.size}x{args.size}" if kind == "llm" else f"{args.texts} texts"
        )
        what = (
            f"llm --layers -1, Qwen3-VL-2B sizes with {args.text_layers} decoder layers, {inputs}, prompts of "
            f"{min(lengths)}-{max(lengths)} tokens"
        )
    return {"batched": lambda: run(items), "alone": lambda: [f for it in items for f in run([it])]}, what


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--size", type=int, default=224, help="image side in pixels (multiple of 32)")
    ap.add_argument("--text", type=int, default=24, help="text tokens after the first image (+3 each next)")
    ap.add_argument("--text-layers", type=int, default=4)
    ap.add_argument("--texts", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", choices=("tower", "llm", "texts"), default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results = []
    for kind in [args.only] if args.only else ["tower", "llm", "texts"]:
        sides, what = _sides(kind, args)
        load = [round(os.getloadavg()[0], 1)]
        with torch.inference_mode():  # the harness's ABAB rounds, after a warm-up of each side
            got = harness.alternate({"alone": sides["alone"], "batched": sides["batched"]}, args.rounds)
        times = {k: v["wall"] for k, v in got.items()}
        load.append(round(os.getloadavg()[0], 1))
        med = {k: harness.median(v) for k, v in times.items()}
        results.append(
            {
                "workload": what,
                "batched_s": round(med["batched"], 3),
                "alone_s": round(med["alone"], 3),
                "alone_over_batched": round(med["alone"] / med["batched"], 3),
                # each round's two runs were back to back: their ratio sees the least drift in the load
                "per_round": [round(a / b, 3) for a, b in zip(times["alone"], times["batched"])],
                "rounds": {k: [round(x, 3) for x in v] for k, v in times.items()},
                "load_average": load,
            }
        )
        if not args.json:
            x = results[-1]
            print(
                f"{what}: batched {x['batched_s']:.2f} s, alone {x['alone_s']:.2f} s "
                f"(x{x['alone_over_batched']:.2f}; per round x{x['per_round']}; rounds {x['rounds']}; "
                f"load {load[0]}-{load[1]})"
            )
    machine = f"{cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), Python {platform.python_version()}"
    record({"machine": machine, "results": results})
    if args.json:
        print(json.dumps({"machine": machine, "results": results}))
    else:
        print(machine)


def record(result: dict) -> None:
    """The result into the run's result file (benchmarks/harness.py; a no-op outside benchmarks/SCRIPT.py MODE)."""
    try:
        import harness
    except ImportError:  # run as a child, without benchmarks/ on the path
        return
    harness.record(result)


if __name__ == "__main__":
    main()
