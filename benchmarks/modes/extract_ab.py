"""Compute-bound A/B in fresh processes: the naive loop against ``vlfast extract``, alternating, N rounds.

``benchmarks/extract.py pipeline`` times its sides in one warm process; here every run is a new process, as a user
runs either, so neither side inherits the other's allocator, page cache or thread state, and the order
alternates each round so a load drift favours neither. Both times exclude building the model and include
everything after it (the naive loop gets no warm-up forward, the command none either). A third side,
``vlfast extract --workers 0``, preprocesses in the main process between forwards. The inputs are N
640x480 JPEGs through a full-size reference tower with random weights, float32 on CPU: the case where the
tower's forward fills every core, so overlapping the preprocessing wins nothing: the pipeline can only
gain by computing less (it skips the DeepStack mergers, which the loop's whole-tower call runs).

    python benchmarks/extract.py ab                      # 4 images, 4 rounds
    python benchmarks/extract.py ab --rounds 6 --json
    python benchmarks/extract.py ab --baseline e82d833   # adds `vlfast extract` of that commit as a side

``--baseline REV`` exports the package at git revision REV (``git archive``, nothing checked out) and
runs its ``vlfast extract`` with that source first on ``PYTHONPATH``: the same command before and after a
change, alternating, on the same inputs.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def export_revision(rev: str, dest: Path) -> dict[str, str]:
    """The environment that runs the package of git revision ``rev`` (exported under ``dest``)."""
    dest.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "src"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return os.environ | {"PYTHONPATH": os.pathsep.join([str(dest / "src"), os.environ.get("PYTHONPATH", "")])}


def naive_child(images: Path, model: str) -> None:
    """The loop users write, per image: the processor, then the tower. Prints its seconds as JSON."""
    import torch
    from PIL import Image

    from vlfast.models import build_reference, tower_outputs
    from vlfast.patching.gemm import patch
    from vlfast.pixels.engine import Preprocessor, build_processor_config

    tower = build_reference(model)
    patch(tower)
    pil = None if importlib.util.find_spec("torchvision") else "Qwen2VLImageProcessorPil"  # as pipeline's
    processor = Preprocessor(
        build_processor_config(model, family="qwen3_vl", image_processor=pil)
    ).image_processor()
    with harness.Stopwatch() as sw:
        for p in sorted(images.iterdir()):
            inputs = processor(images=[Image.open(p)], return_tensors="pt")
            with torch.inference_mode():
                out = tower(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
                tower_outputs(out)["merged"].mean(0)
    print(json.dumps({"seconds": sw.wall}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--model", default="ref:qwen3-vl-2b")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--baseline", metavar="REV", help="also run `vlfast extract` of this git revision")
    ap.add_argument("--naive-child", metavar="DIR", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.naive_child:
        naive_child(Path(args.naive_child), args.model)
        return

    from extract_pipeline import _machine, cli_extract, json_of  # the sibling benchmark's helpers

    from vlfast.demo import make_images

    with tempfile.TemporaryDirectory(prefix="vlfast-ab-") as tmp:
        images = Path(tmp) / "images"
        make_images(images, [(640, 480)] * args.images)
        naive_cmd = [sys.executable, __file__, "--model", args.model, "--naive-child", str(images)]
        sides = {  # round -> the run's own seconds (model loading excluded)
            "naive": lambda r: json_of(naive_cmd)["seconds"],
            "vlfast extract": lambda r: cli_extract(images, Path(tmp) / f"out-{r}", args.model)["seconds"],
            # preprocessing in the main process, between forwards: what the workers cost when compute-bound
            "--workers 0": lambda r: cli_extract(
                images, Path(tmp) / f"out0-{r}", args.model, "--workers", "0"
            )["seconds"],
        }
        if args.baseline:
            base_env = export_revision(args.baseline, Path(tmp) / "baseline")
            sides[f"@{args.baseline}"] = lambda r: cli_extract(
                images, Path(tmp) / f"outb-{r}", args.model, env=base_env
            )["seconds"]
        calls = itertools.count()  # a fresh OUT per run
        measured = {k: lambda f=f: {"seconds": float(f(next(calls)))} for k, f in sides.items()}
        got = harness.alternate_measured(measured, args.rounds)  # each run a process timing itself
        runs = {k: [x["seconds"] for x in v] for k, v in got.items()}

    def compare(a: str, b: str) -> dict:
        """How many times faster ``b`` ran than ``a``, round by round (same round = same load)."""
        ratios = [x / y for x, y in zip(runs[a], runs[b])]
        return {
            "ratio_per_round": [round(x, 3) for x in ratios],
            "median_ratio": round(harness.median(ratios), 3),
            "rounds_faster": sum(x > 1 for x in ratios),
            "best_of_each_ratio": round(min(runs[a]) / min(runs[b]), 3),
        }

    comparisons = {  # name: (baseline, side); a ratio above 1 means the side ran faster
        "naive / vlfast extract": ("naive", "vlfast extract"),
        "naive / vlfast extract --workers 0": ("naive", "--workers 0"),
    }
    if args.baseline:
        comparisons[f"vlfast extract @{args.baseline} / now"] = (f"@{args.baseline}", "vlfast extract")
    result = {
        "machine": _machine(),
        "setup": f"{args.images} x 640x480 JPEG through {args.model}, float32, CPU, fresh process per run",
        "rounds": args.rounds,
        "runs_s": {k: [round(x, 2) for x in v] for k, v in runs.items()},
        "comparisons": {name: compare(a, b) for name, (a, b) in comparisons.items()},
    }
    record(result)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    m = result["machine"]
    print(
        f"machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, load average {os.getloadavg()[0]:.2f}"
    )
    print(result["setup"])
    for k, v in result["runs_s"].items():
        print(f"  {k:15s} {v}")
    for name, c in result["comparisons"].items():
        print(
            f"{name}: median {c['median_ratio']}x per round {c['ratio_per_round']}, faster in "
            f"{c['rounds_faster']} of {args.rounds}, best of each {c['best_of_each_ratio']}x"
        )


def record(result: dict) -> None:
    """The result into the run's result file (a no-op outside benchmarks/SCRIPT.py MODE)."""
    harness.record(result)


if __name__ == "__main__":
    main()
