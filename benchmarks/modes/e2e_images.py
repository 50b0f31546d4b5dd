"""End to end on HD images: ``vlfast extract`` against the report's DataLoader loop, whole processes (issue 44 item 6).

Target: ``vlfast extract`` at least 3x the report's loop, start-up included. Both sides get the same N JPEGs
(half 1280x720, half 1920x1080, quality 90: a smooth pattern plus Gaussian noise, so they compress like
photos), the tiny offline Qwen3-VL checkpoint (``vlfast.demo.make_tiny_qwen3_vl``: a 2-layer tower 64 wide,
so decoding and preprocessing are most of the work), a 768*768 = 589,824-pixel image budget (both sizes
become 1024x576: 2,304 patches, 576 merged tokens) with the checkpoint's lower bound (65,536), the tower in
bf16, and save each image's mean merged vision feature. Each side is one fresh process, timed whole by this
script (interpreter start, imports, model load, the work, exit), in rounds whose order rotates:

- ``loop`` (the report's): a script of the user's own (this file's ``_loop`` mode; it imports only torch,
  PIL and transformers). A torch ``Dataset`` whose ``__getitem__`` opens the image with PIL and runs the
  checkpoint's ``AutoImageProcessor`` (``size={"longest_edge": 589824, "shortest_edge": 65536}``); a
  ``DataLoader(batch_size=8, num_workers=2)`` whose ``collate_fn`` concatenates pixel_values and grids;
  ``AutoModel.from_pretrained(CKPT).visual.to(torch.bfloat16).eval()`` run under ``torch.no_grad()`` on
  each batch, its ``pooler_output`` (the merged tokens) split per image and averaged, one ``torch.save``
  per batch. Without torchvision (as here) AutoImageProcessor picks transformers' PIL processor
  (``Qwen2VLImageProcessorPil``); the output names the class that ran.
- ``loop (torchvision)`` (``--reference-torchvision``): the same script with the torchvision wheel that
  pairs with torch on its path first (tests/_transformers_reference.py's ``_import_torchvision``,
  ``.reference/torchvision``), so AutoImageProcessor picks ``Qwen2VLImageProcessor``, the torchvision
  backend: transformers' default wherever torchvision is installed, the fairer baseline.
- ``vlfast``: ``vlfast extract IN OUT --model CKPT --min-pixels 65536 --max-pixels 589824 --dtype bfloat16
  --features vision_mean --json`` (default workers: one per core; OUT removed before each round).

Reported per side: the median wall time with its spread (min-max), images/s at the median, and vlfast's
speed-up (the loop's wall over vlfast's, within each round) with its spread; where each side's time went
(the loop's own clock: imports, model load, the loop; vlfast's summary: the run's ``seconds``, forwards,
model build, and the rest of the process, i.e. start-up and exit); CPU seconds (the process and its reaped
workers, from ``getrusage``: what a quiet machine would have to do, less sensitive to other jobs than wall
time), split into the run (the loop's, or vlfast's ``cpu_seconds``) and the rest (start-up, model build,
exit); the load average before and after each run; the machine (``lscpu`` model and AVX flags, cores, torch and transformers). Once, after the first
round, the features are compared: cosine of vlfast's ``vision_mean`` against the loop's pooled feature for
the first few images (bf16 towers on both sides; the PIL loop's pixels come from another resize than
vlfast's, which follows the torchvision backend, so this is close, not equal). ``OMP_WAIT_POLICY`` is left as
the environment has it: ``vlfast extract`` sets PASSIVE itself before torch loads, the loop (as users run
it) does not.

    python benchmarks/extract.py e2e-images                              # 96 images, 3 rounds
    python benchmarks/extract.py e2e-images --reference-torchvision --json out.json
    python benchmarks/extract.py e2e-images --images 16 --rounds 1       # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: the harness (standard library only)
import harness  # noqa: E402

# the loop's own clock starts here (after the interpreter's start-up); CPU: its own and its reaped workers'
T_START = harness.Stopwatch(both=True)

REPO = HERE.parents[1]
SIZES = ((1280, 720), (1920, 1080))
MAX_PIXELS = 768 * 768
MIN_PIXELS = 65_536  # the checkpoint's own shortest_edge (as Qwen3-VL's published preprocessor has it)
BATCH, LOOP_WORKERS = 8, 2  # the report's DataLoader
COMPARED = 8  # images whose features are compared


# ------------------------------------------------------------------------------------------- the loop


def loop_main(ckpt: str, inputs: str, out: str, torchvision: bool) -> None:
    """The report's loop, in a process of its own; imports only what a user's script would (torch, PIL,
    transformers). Prints its own clock as JSON."""
    if torchvision:
        sys.path.insert(0, str(REPO / "tests"))
        from _transformers_reference import _import_torchvision

        _import_torchvision()  # before transformers: it decides the backend at import
    import torch
    from PIL import Image
    from torch.utils.data import DataLoader, Dataset
    from transformers import AutoImageProcessor, AutoModel

    clock = T_START
    imports_s, imports_cpu = clock.lap(), clock.c0 + clock.cpu  # CPU: since the process started

    class Images(Dataset):
        """The report's Dataset: open with PIL, run the processor (in the DataLoader's workers)."""

        def __init__(self, paths: list[Path]) -> None:
            self.paths = paths

        def __len__(self) -> int:
            return len(self.paths)

        def __getitem__(self, i: int):
            with Image.open(self.paths[i]) as image:
                x = processor(images=image, return_tensors="pt")
            return self.paths[i].name, x["pixel_values"], x["image_grid_thw"]

    def collate(items):
        names, pixels, grids = zip(*items)
        return list(names), torch.cat(pixels), torch.cat(grids)  # (sum patches, 1536), (B, 3)

    processor = AutoImageProcessor.from_pretrained(
        ckpt, size={"longest_edge": MAX_PIXELS, "shortest_edge": MIN_PIXELS}
    )
    visual = AutoModel.from_pretrained(ckpt).visual.to(torch.bfloat16).eval()
    merge = visual.spatial_merge_size
    load_s, c_load = clock.lap(), clock.cpu
    paths = sorted(Path(inputs).glob("*.jpg"))
    loader = DataLoader(Images(paths), batch_size=BATCH, num_workers=LOOP_WORKERS, collate_fn=collate)
    Path(out).mkdir(parents=True, exist_ok=True)
    forward_s, n = 0.0, 0
    with torch.no_grad():
        for i, (names, pixels, grid) in enumerate(loader):
            with harness.Stopwatch() as sw:
                merged = visual(pixels.to(torch.bfloat16), grid_thw=grid).pooler_output  # (sum tokens, D)
                pooled = torch.stack([m.mean(0) for m in merged.split((grid.prod(-1) // merge**2).tolist())])
            forward_s += sw.wall
            torch.save({"names": names, "features": pooled}, Path(out) / f"batch_{i:05d}.pt")
            n += len(names)
    loop_s, c_end = clock.lap(), clock.cpu  # the workers are reaped: the loader's iterator ended
    print(
        json.dumps(
            {
                "images": n,
                "processor": type(processor).__name__,
                "imports_s": imports_s,
                "load_s": load_s,
                "loop_s": loop_s,
                "forward_s": forward_s,
                "imports_cpu_s": imports_cpu,
                "load_cpu_s": c_load - (imports_cpu - clock.c0),
                "loop_cpu_s": c_end - c_load,
            }
        )
    )


# ------------------------------------------------------------------------------------------- the parent


def make_inputs(folder: Path, n: int) -> list[Path]:
    """``n`` JPEGs, alternately 1280x720 and 1920x1080: a smooth pattern plus noise (sigma 6), quality 90."""
    import numpy as np
    from PIL import Image

    from vlfast.demo import pattern

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k in range(n):
        w, h = SIZES[k % 2]
        noise = np.random.default_rng(k).normal(0.0, 6.0, (h, w, 3))
        pixels = (pattern(h, w, k) + noise).round().clip(0, 255).astype(np.uint8)
        paths.append(folder / f"img{k:04d}.jpg")
        Image.fromarray(pixels).save(paths[-1], quality=90)
    return paths


def machine() -> dict:
    import torch
    import transformers

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    return {
        "cpu": fields.get("Model name", "?").strip(),
        "avx": sorted(f for f in flags if f.startswith(("avx", "amx"))),
        "cores": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset (vlfast sets PASSIVE; the loop spins)"),
    }


def timed(cmd: list[str]) -> tuple[float, float, str]:
    """Wall time of ``cmd`` as a fresh process, its CPU time (its workers' included: they are reaped), and
    what it printed on stdout."""
    done = harness.process_time(cmd)
    if done["returncode"] != 0:
        raise RuntimeError(
            f"{' '.join(cmd[:6])} ... failed ({done['returncode']}):\n{done['stderr'][-3000:]}"
        )
    return done["wall_s"], done["cpu_s"], done["stdout"]


def cosines(vlfast_out: Path, loop_out: Path, n: int) -> dict[str, list[float]]:
    """Cosine of vlfast's vision_mean against the loop's pooled feature for the first ``n`` images: as
    stored, and centred (each side's mean over the ``n`` images subtracted: a random tower's mean feature is
    mostly its biases, common to every image, so the raw cosine is near 1 whatever the pixels; the centred
    one compares what differs from image to image)."""
    import torch

    from vlfast.extraction import FeatureCache

    loop: dict[str, torch.Tensor] = {}
    for f in sorted(loop_out.glob("batch_*.pt")):
        saved = torch.load(f, weights_only=True)
        loop.update(zip(saved["names"], saved["features"]))
    cache = FeatureCache(vlfast_out, features=["vision_mean"])
    names = sorted(loop)[:n]
    a = torch.stack([cache[k]["vision_mean"].double() for k in names])  # (n, D)
    b = torch.stack([loop[k].double() for k in names])
    cos = torch.nn.functional.cosine_similarity
    return {
        "raw": [round(c, 5) for c in cos(a, b, dim=1).tolist()],
        "centred": [round(c, 5) for c in cos(a - a.mean(0), b - b.mean(0), dim=1).tolist()],
    }


def spread(xs: list[float], nd: int = 2) -> dict:
    return {"median": round(harness.median(xs), nd), "min": round(min(xs), nd), "max": round(max(xs), nd)}


def run(n_images: int, rounds: int, reference_torchvision: bool, workers: int | None) -> dict:
    from vlfast.demo import make_tiny_qwen3_vl

    result: dict = {"machine": machine(), "load_average_before": round(os.getloadavg()[0], 2)}
    with tempfile.TemporaryDirectory(prefix="vlfast-e2e-images-") as tmp:
        work = Path(tmp)
        ckpt = make_tiny_qwen3_vl(work / "tiny")
        make_inputs(work / "images", n_images)
        me = [sys.executable, str(Path(__file__).resolve()), "_loop", str(ckpt), str(work / "images")]
        commands = {"loop": [*me, str(work / "out-loop")]}
        if reference_torchvision:
            commands["loop (torchvision)"] = [*me, str(work / "out-loop-tv"), "--torchvision"]
        commands["vlfast"] = [
            *(
                sys.executable,
                "-m",
                "vlfast.cli.main",
                "extract",
                str(work / "images"),
                str(work / "out-vlfast"),
            ),
            *("--model", str(ckpt), "--min-pixels", str(MIN_PIXELS), "--max-pixels", str(MAX_PIXELS)),
            *("--dtype", "bfloat16", "--features", "vision_mean", "--json"),
            *(("--workers", str(workers)) if workers else ()),
        ]
        outs = {"loop": "out-loop", "loop (torchvision)": "out-loop-tv", "vlfast": "out-vlfast"}
        names, runs = list(commands), []

        def one(name: str) -> dict:
            shutil.rmtree(work / outs[name], ignore_errors=True)
            before = os.getloadavg()[0]
            wall, cpu, stdout = timed(commands[name])
            own = json.loads(stdout.strip().splitlines()[-1] if name != "vlfast" else stdout)
            row = {
                "round": sum(x["variant"] == name for x in runs) + 1,
                "variant": name,
                "wall_s": round(wall, 3),
                "cpu_s": round(cpu, 3),
                "load_before": round(before, 2),
                "load_after": round(os.getloadavg()[0], 2),
                **_own_times(name, own, wall, cpu),
            }
            if row["images"] != n_images:
                raise RuntimeError(f"{name} handled {row['images']} of {n_images} images")
            runs.append(row)
            return row

        # rounds whose order rotates who goes first (three variants: ABC BCA CAB)
        harness.alternate_measured({k: lambda k=k: one(k) for k in names}, rounds, rotate=True)
        result["cosine"] = {  # the last round's outputs (every round's features are the same)
            loop: cosines(work / outs["vlfast"], work / outs[loop], COMPARED)
            for loop in names
            if loop != "vlfast"
        }
    result["load_average_after"] = round(os.getloadavg()[0], 2)
    result.update(images=n_images, sizes=[f"{w}x{h}" for w, h in SIZES], rounds=rounds, runs=runs)
    result["variants"] = {}
    for name in names:
        mine = [x for x in runs if x["variant"] == name]
        walls = [x["wall_s"] for x in mine]
        entry = {
            "wall_s": spread(walls),
            "images_per_s": round(n_images / harness.median(walls), 2),
            **{k: spread([x[k] for x in mine]) for k in mine[0] if k.endswith("_s") and k != "wall_s"},
        }
        if "processor" in mine[0]:
            entry["processor"] = mine[0]["processor"]
        if name != "vlfast":  # vlfast's speed-up: this loop's wall over vlfast's, round by round
            vl = {x["round"]: x["wall_s"] for x in runs if x["variant"] == "vlfast"}
            entry["vlfast_speedup"] = spread([x["wall_s"] / vl[x["round"]] for x in mine], 3)
        result["variants"][name] = entry
    return result


def _own_times(name: str, own: dict, wall: float, cpu: float) -> dict:
    """Where the process's time went, by its own account."""
    if name == "vlfast":
        return {
            "images": own["extracted"],
            "run_s": round(own["seconds"], 3),  # checking OUT, decoding, forwards, writing
            "forward_s": round(own["compute_seconds"], 3),
            "model_build_s": round(own["load_seconds"], 3),
            "outside_s": round(wall - own["seconds"] - own["load_seconds"], 3),  # start-up (imports) and exit
            "run_cpu_s": round(own["cpu_seconds"], 3),
            "outside_cpu_s": round(cpu - own["cpu_seconds"], 3),  # start-up, model build, exit
        }
    return {
        "images": own["images"],
        "processor": own["processor"],
        "imports_s": round(own["imports_s"], 3),
        "model_build_s": round(own["load_s"], 3),
        "run_s": round(own["loop_s"], 3),
        "forward_s": round(own["forward_s"], 3),
        "outside_s": round(wall - own["imports_s"] - own["load_s"] - own["loop_s"], 3),  # Python start, exit
        "run_cpu_s": round(own["loop_cpu_s"], 3),
        "outside_cpu_s": round(cpu - own["loop_cpu_s"], 3),  # start-up, model build, exit
    }


def render(result: dict) -> None:
    m = result["machine"]
    print(
        f"machine: {m['cpu']}, {m['cores']} cores ({' '.join(m['avx'])}); torch {m['torch']}, "
        f"transformers {m['transformers']}, Python {m['python']}; OMP_WAIT_POLICY {m['omp_wait_policy']}"
    )
    print(
        f"{result['images']} JPEGs ({' and '.join(result['sizes'])}, half each), tiny Qwen3-VL, "
        f"{MAX_PIXELS:,}-pixel budget, bf16; {result['rounds']} rounds, order rotated; load average "
        f"{result['load_average_before']} before, {result['load_average_after']} after"
    )
    for name, v in result["variants"].items():
        w = v["wall_s"]
        line = f"  {name:<19} {w['median']:7.2f} s ({w['min']:.2f}-{w['max']:.2f})  {v['images_per_s']:6.2f} images/s"
        if "vlfast_speedup" in v:
            s = v["vlfast_speedup"]
            line += f"  vlfast {s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})  [{v['processor']}]"
        print(line)
    print("where the time went (medians, s):")
    for name, v in result["variants"].items():
        parts = [
            f"{k[:-2]} {x['median']}"
            for k, x in v.items()
            if isinstance(x, dict) and k not in ("wall_s", "vlfast_speedup")
        ]
        print(f"  {name:<19} " + ", ".join(parts))
    print("per run:")
    for x in result["runs"]:
        print(
            f"  round {x['round']} {x['variant']:<19} {x['wall_s']:7.2f} s ({x['cpu_s']:.1f} CPU s)  load {x['load_before']} -> "
            f"{x['load_after']}"
        )
    for name, cs in result["cosine"].items():
        print(
            f"cosine, vlfast vision_mean vs {name}'s pooled feature (first {len(cs['raw'])} images, bf16): "
            f"min {min(cs['raw']):.5f} as stored, {min(cs['centred']):.5f} centred {cs['centred']}"
        )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_loop":  # the loop's own process
        ckpt, inputs, out = sys.argv[2:5]
        loop_main(ckpt, inputs, out, torchvision="--torchvision" in sys.argv[5:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=96, help="JPEGs, half 1280x720, half 1920x1080")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (order rotated each round)")
    ap.add_argument(
        "--reference-torchvision",
        action="store_true",
        help="also run the loop with transformers' torchvision processor (.reference/torchvision)",
    )
    ap.add_argument("--workers", type=int, default=None, help="vlfast's --workers (default: its own)")
    ap.add_argument("--json", metavar="FILE", help="also write the result as JSON to FILE")
    args = ap.parse_args()
    if args.reference_torchvision:
        sys.path.insert(0, str(REPO / "tests"))
        from _transformers_reference import unavailable

        if why := unavailable():
            raise SystemExit(why)
    result = run(args.images, args.rounds, args.reference_torchvision, args.workers)
    record(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    render(result)


def record(result: dict) -> None:
    """The result into the run's result file (a no-op outside benchmarks/SCRIPT.py MODE)."""
    harness.record(result)


if __name__ == "__main__":
    main()
