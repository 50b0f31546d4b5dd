"""A sample's stored features do not depend on its batch: the same bytes alone, in any batch, in any order.

Issue 46: on a 2-core AMD EPYC with AVX2 only, a resumed run's ``llm.last.layer2`` differed in its last bits
from an uninterrupted run's (tests/test_extract_compat.py): the two runs batched the sample with others, and
``scaled_dot_product_attention`` over a prompt padded to its batch's longest sums in another order than over
the prompt alone. ``ATEN_CPU_CAPABILITY=avx2`` reproduces it on an AVX-512 machine, so the check runs once
with this CPU's kernels and once limited to AVX2 (a fresh process: the limits are read when torch loads).
The cure (vlfast.extraction.model.runner.runs_alone): on the CPU each sample has a forward of its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# What the kernels of a CPU without AVX-512 are: ATen's, oneDNN's and MKL's dispatch limited to AVX2.
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
PATCH_DIM = 3 * 2 * 16 * 16  # C * T * P * P of the tiny checkpoint
SPECS = {  # the whole VLM (llm features and the tower's through a hook), and the tower alone
    "llm": dict(
        names=("vision", "vision_mean", "deepstack", "llm"), layers=(0, 1, -1), pools=("last", "mean")
    ),
    "tower": dict(names=("vision", "vision_mean", "deepstack")),
}


def _samples(checkpoint: Path) -> list:
    """Two images, a video and an image with a long prompt: different patch counts and prompt lengths, so a
    batch of them is padded, and packs products of other heights than any one of them."""
    from vlfast.extraction.decode.prompts import PromptBuilder
    from vlfast.extraction.decode.stage import DecodedSample

    prompts = PromptBuilder(str(checkpoint), "qwen3_vl", 2, 2)
    g = torch.Generator().manual_seed(46)
    shapes = [
        ("image", (1, 4, 4), "Describe this image."),
        ("image", (1, 6, 8), "What is shown?"),
        ("video", (2, 4, 4), "What happens?"),
        ("image", (1, 4, 6), "Describe this image in detail." + " And then?" * 12),
    ]
    out = []
    for i, (kind, grid, text) in enumerate(shapes):
        t, h, w = grid
        meta = {"frame_indices": [0, 6, 12, 18], "video_fps": 24.0} if kind == "video" else {}
        item = DecodedSample(
            i=i,
            kind=kind,
            pixel_values=torch.randn(t * h * w, PATCH_DIM, generator=g),
            grid=grid,
            tokens=t * h * w // 4,
            meta=meta,
        )
        item.input_ids = prompts(kind, text, grid, meta)
        out.append(item)
    return out


def _digest(t: torch.Tensor) -> str:
    raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return f"{t.dtype} {tuple(t.shape)} {hashlib.sha256(raw).hexdigest()[:16]}"


def differences(checkpoint: Path) -> tuple[list[str], int]:
    """Each sample's features computed through the engines' :class:`Forward` alone, in batches of all four
    in two orders and in pairs, for float32 and bfloat16, both specs. Returns (what differs from the sample
    alone, how many features were compared)."""
    from vlfast.extraction.decode.prompts import PromptBuilder
    from vlfast.extraction.model import runner
    from vlfast.extraction.model.spec import FeatureSpec
    from vlfast.pixels.engine import build_processor_config

    cfg = build_processor_config(str(checkpoint), family="qwen3_vl")
    items = _samples(checkpoint)
    batches = [[0, 1, 2, 3], [3, 2, 1, 0], [3, 0], [1, 2], [2, 0, 3]]
    found, compared = [], 0
    for dtype in (torch.float32, torch.bfloat16):
        for name, kw in SPECS.items():
            spec = FeatureSpec(**kw)
            loaded = runner.load(str(checkpoint), "qwen3_vl", spec, torch.device("cpu"), dtype, True)
            prompts = PromptBuilder(str(checkpoint), "qwen3_vl", 2, 2) if spec.needs_llm else None
            forward = runner.Forward(loaded, spec, cfg, None, prompts)
            alone = [{k: _digest(v) for k, v in forward([it])[0].items()} for it in items]
            for batch in batches:
                for i, feats in zip(batch, forward([items[j] for j in batch])):
                    for k, v in feats.items():
                        compared += 1
                        if _digest(v) != alone[i][k]:
                            found.append(f"{str(dtype)[6:]} {name}: sample {i} {k} in batch {batch}")
    return found, compared


def test_runs_alone_on_the_cpu_only():
    from vlfast.extraction.model.runner import runs_alone

    assert runs_alone(torch.device("cpu"))
    assert not runs_alone(torch.device("cuda", 0)) and not runs_alone(torch.device("mps"))


@pytest.mark.cpu_kernels
def test_a_samples_features_do_not_depend_on_its_batch(tiny_qwen3_vl):
    found, compared = differences(tiny_qwen3_vl)
    assert compared >= 400 and not found, "\n".join(found)


def test_nor_with_the_kernels_of_a_cpu_without_avx512(tiny_qwen3_vl):
    """The issue's machine, as near as this one comes: ATen, oneDNN and MKL limited to AVX2."""
    env = {k: v for k, v in os.environ.items() if k not in AVX2_ONLY} | AVX2_ONLY
    done = subprocess.run(
        [sys.executable, __file__, str(tiny_qwen3_vl)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["capability"] in ("AVX2", "DEFAULT"), got  # DEFAULT: a CPU without AVX2 at all
    assert got["compared"] >= 400 and not got["found"], "\n".join(got["found"])


if __name__ == "__main__":  # the check in a process of its own, under the caller's kernel limits
    found, compared = differences(Path(sys.argv[1]))
    capability = torch.backends.cpu.get_cpu_capability()
    print(json.dumps({"capability": capability, "found": found, "compared": compared}))
