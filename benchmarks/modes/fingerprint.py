"""What the weights fingerprint of ``vlfast extract`` costs on a Qwen3-VL-4B-sized checkpoint.

Writes (once, reused) a checkpoint with Qwen3-VL-4B-Instruct's published layout: its config through
transformers' ``save_pretrained``, its tensors (names and shapes of transformers' own
``Qwen3VLForConditionalGeneration``, bfloat16, ~8.9 GB in 5 GB shards plus the index). The bytes are not
the real weights (none can be downloaded here); hashing speed does not depend on them.

Then times ``weights_fingerprint`` for vision features (the tower's tensors) and ``llm`` features (every
tensor, plus config and tokenizer files), warm (files in the page cache, as right after a load) and cold
(evicted with ``posix_fadvise(DONTNEED)`` first), and ``load_vision_tower`` warm for scale.

    python benchmarks/extract.py fingerprint --dir /tmp/vlfast-4b          # writes ~8.9 GB the first time
    python benchmarks/extract.py fingerprint --dir /tmp/vlfast-4b --json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

# Qwen/Qwen3-VL-4B-Instruct config.json (text_config and vision_config), the values that set tensor shapes.
TEXT = {
    "vocab_size": 151936,
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": True,
    "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True},
}
VISION = {
    "depth": 24,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_heads": 16,
    "out_hidden_size": 2560,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [5, 11, 17],
}
SHARD_BYTES = 5 << 30


def write_checkpoint(folder: Path) -> None:
    from safetensors.torch import save_file
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    folder.mkdir(parents=True, exist_ok=True)
    config = Qwen3VLConfig(text_config=TEXT, vision_config=VISION, tie_word_embeddings=True)
    config.save_pretrained(folder)
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    shards: list[dict[str, tuple]] = [{}]
    size = 0
    for name, shape in shapes.items():
        n = 2 * int(torch.Size(shape).numel())
        if size + n > SHARD_BYTES and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = shape
        size += n
    weight_map = {}
    for k, names in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        gen = torch.Generator().manual_seed(k)
        tensors = {
            n: torch.randint(0, 2**15, s, generator=gen, dtype=torch.int16).view(torch.bfloat16)
            for n, s in names.items()
        }
        save_file(tensors, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        del tensors
    total = sum(2 * int(torch.Size(s).numel()) for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (folder / "DONE").write_text("ok")


def evict(folder: Path) -> None:
    """Drop the files' pages from the page cache (clean pages only; no root needed)."""
    for p in folder.iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def use(model: torch.nn.Module) -> None:
    """Read every weight once, as a first forward does."""
    with torch.no_grad():
        for p in model.parameters():
            p.view(-1)[:: max(1, 2048 // p.element_size())].sum()  # one value per 2 KiB: every page


def timed(fn) -> float:
    return harness.seconds(fn)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/tmp/vlfast-qwen3-vl-4b-layout")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--load-whole", action="store_true", help="also time loading the whole model, cold")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()

    import transformers

    from vlfast.extraction.store.fingerprint import weights_fingerprint

    transformers.utils.logging.disable_progress_bar()
    from vlfast.models import load_model, load_vision_tower

    folder = Path(a.dir)
    if not (folder / "DONE").exists():
        print(f"writing a Qwen3-VL-4B-sized checkpoint to {folder} ...", file=sys.stderr)
        write_checkpoint(folder)
    gb = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e9
    keys = ("vision_cold", "vision_warm", "whole_cold", "whole_warm", "tower_load_warm")
    rows: dict[str, list[float]] = {k: [] for k in keys}
    if a.load_whole:
        rows |= {"load_cold": [], "fingerprint_cold_then_load": []}
    facts: dict[str, dict] = {}

    def fingerprint(scope: str) -> None:
        facts[scope] = weights_fingerprint(str(folder), whole=scope == "whole")

    for _ in range(a.rounds):
        for scope in ("vision", "whole"):
            evict(folder)
            rows[f"{scope}_cold"].append(timed(lambda s=scope: fingerprint(s)))
            rows[f"{scope}_warm"].append(timed(lambda s=scope: fingerprint(s)))
        rows["tower_load_warm"].append(timed(lambda: load_vision_tower(str(folder), dtype=torch.bfloat16)))
        if a.load_whole:
            # Does hashing first add a disk read, or move it? transformers maps the files lazily, so a
            # load alone reads little; the first forward reads every weight. "use" reads each weight once.
            evict(folder)
            rows["load_cold"].append(timed(lambda: use(load_model(str(folder), dtype=torch.bfloat16))))
            evict(folder)
            rows["fingerprint_cold_then_load"].append(
                timed(lambda: (fingerprint("whole"), use(load_model(str(folder), dtype=torch.bfloat16))))
            )
    med = {k: harness.median(v) for k, v in rows.items()}
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "checkpoint_gb": gb,
        "vision_tower_gb": facts["vision"]["bytes"] / 1e9,
        "tensors": {"vision": facts["vision"]["tensors"], "whole": facts["whole"]["tensors"]},
        "median_s": med,
        "per_round": rows,
        "load_average_end": os.getloadavg()[0],
    }
    record(result)
    if a.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"checkpoint {gb:.2f} GB ({result['tensors']['whole']} tensors), tower {result['vision_tower_gb']:.2f} GB"
    )
    print(f"vision fingerprint: warm {med['vision_warm']:.2f} s, cold {med['vision_cold']:.2f} s")
    print(f"whole-model fingerprint (llm): warm {med['whole_warm']:.2f} s, cold {med['whole_cold']:.2f} s")
    print(f"for scale, load_vision_tower warm: {med['tower_load_warm']:.2f} s")
    if a.load_whole:
        print(
            f"whole model, load and read every weight: cold {med['load_cold']:.1f} s; after a cold "
            f"fingerprint {med['fingerprint_cold_then_load']:.1f} s (both included)"
        )
    print(f"load average at the end: {result['load_average_end']:.1f}")


def record(result: dict) -> None:
    """The result into the run's result file (a no-op outside benchmarks/SCRIPT.py MODE)."""
    harness.record(result)


if __name__ == "__main__":
    main()
