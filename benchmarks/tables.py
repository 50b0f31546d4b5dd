"""The tables of docs/benchmarks.md, generated from the committed result files (benchmarks/results/).

    python benchmarks/tables.py            # rewrite every generated block of docs/benchmarks.md
    python benchmarks/tables.py --check    # exit 1 where a block differs from what its JSON gives
    python benchmarks/tables.py --from-gpu-run benchmarks/gpu-runs/2026-11-27-h200-second   # gpu.sh's run.json -> results

A generated block sits between two comments; the first names its result file, the table in it, the columns
optionally which rows (``rows=key~text``: the rows whose ``key`` contains ``text``; several joined by ``&``)
and ``head=no`` (no line naming the run: the block above named it):

    <!-- table results/amd-epyc-2c/preprocess-2026-12-05.json images cols=variant,ms,cpu_ms rows=input~640x480 -->
    ... (generated: a line naming the command, date, commit and load, then the table)
    <!-- end table -->

A run of rows sharing the first column's value shows it once. The table ``result`` is the run's ``result`` (a mode's final dict) as one row.
A column ``key`` whose row also has ``min_key`` and ``max_key`` shows "median (min-max)"; a value that is a
dict with ``median``, ``min`` and ``max`` (the harness's ``spread``) shows the same.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
DOC = BENCH.parent / "docs" / "benchmarks.md"
BLOCK = re.compile(r"(<!-- table (?P<spec>[^>]*?) -->\n)(?P<body>.*?)(<!-- end table -->)", re.S)


def _cell(row: dict, key: str) -> str:
    value = row.get(key)
    if isinstance(value, dict) and {"median", "min", "max"} <= set(value):
        return f"{_num(value['median'])} ({_num(value['min'])}-{_num(value['max'])})"
    if f"min_{key}" in row and f"max_{key}" in row:
        return f"{_num(value)} ({_num(row[f'min_{key}'])}-{_num(row[f'max_{key}'])})"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value)
    return _num(value) if isinstance(value, (int, float)) else str(value).replace("|", "\\|")


def _num(v) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int) or float(v).is_integer() and abs(v) >= 100:
        return f"{int(v):,}"
    return f"{v:.3g}" if abs(v) < 10 else f"{v:,.1f}"


def _parse(spec: str) -> tuple[str, str, list[str], list[tuple[str, str]]]:
    words = spec.split()
    path, table = words[0], words[1]
    opts = dict(w.split("=", 1) for w in words[2:])
    cols = opts["cols"].split(",")
    rows = [tuple(c.split("~", 1)) for c in opts["rows"].split("&")] if "rows" in opts else []
    return path, table, cols, rows, opts


def render(spec: str) -> str:
    """The block's body: a line naming the run, then the table."""
    path, table, cols, where, opts = _parse(spec)
    data = json.loads((BENCH / path).read_text())
    got = [data["result"]] if table == "result" else data["tables"][table]  # result: its scalars, one row
    rows = [r for r in got if all(text in str(r.get(k, "")) for k, text in where)]
    m = data["machine"]
    load = "load not recorded"
    if data.get("load_before"):
        load = f"load before/after {data['load_before'][0]}/{data['load_after'][0]}"
    head = f"`{data['command']}`: {m['date']}, commit {m.get('commit') or 'not recorded'}, {load}\n\n"
    if opts.get("head") == "no":  # the block above named the same run
        head = ""
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    previous = None
    for r in rows:  # the first column's value once for a run of rows that share it
        cells = [_cell(r, c) for c in cols]
        cells[0], previous = ("" if cells[0] == previous else cells[0]), cells[0]
        lines.append("| " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def regenerate(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + render(m.group("spec")) + m.group(4), text)


def from_gpu_run(folder: Path) -> Path:
    """benchmarks/gpu.sh's ``run.json`` as a result file: its steps, patch-embed rows, extract and doctor."""
    run = json.loads((folder / "run.json").read_text())
    facts = run["facts"]
    device = facts["cuda"]["devices"][0]
    steps = {s["name"]: s for s in run["steps"]}
    machine = {
        "gpu": device["name"],
        "cpu": facts["cpu"]["model"],
        "cores": facts["cpu"]["cores"],
        "isa": [],
        "python": facts["python"],
        "torch": facts["torch"]["version"],
        "cuda": facts["torch"]["cuda"],
        "cudnn": facts["cudnn"]["version_text"],
        "transformers": None,
        "commit": None,
        "date": run["started_at"][:10],
    }
    tables: dict[str, list[dict]] = {"steps": []}
    for s in run["steps"]:
        tables["steps"].append({"step": s["name"], "status": s["status"], "seconds": s.get("wall_s")})
    names = {"F.linear": "linear", "conv CL": "conv_cl", "conv / patched": "conv_over_patched"}
    keys = ("references", "dtype", "conv", "fallback", "patched", "F.linear", "conv CL", "conv / patched")
    tables["patch_embed"] = [
        {names.get(k, k): _value(r.get(k)) for k in keys}
        for dt in ("fp32", "bf16", "fp16")
        for t in (steps.get(f"patch_embed_{dt}", {}).get("result") or {}).get("tables", [])[:1]
        for r in t["rows"]
    ]
    tables["extract"] = [
        {
            "step": name,
            "model": "tiny checkpoint, float32"
            if name == "extract_tiny"
            else "ref:qwen3-vl-2b tower, bfloat16",
            "samples": r["extracted"],
            "tokens": r["tokens"],
            "seconds": round(r["seconds"], 2),
            "samples_per_s": round(r["extracted"] / r["seconds"], 1),
        }
        for name in ("extract_tiny", "extract_2b")
        if (r := steps.get(name, {}).get("result"))
    ]
    if embed := steps.get("embed_throughput", {}).get("result"):
        tables["embed_throughput"] = [{k: v for k, v in embed.items() if not isinstance(v, (dict, list))}]
    if doctor := steps.get("doctor", {}).get("result"):
        tables["doctor"] = [{"seconds": steps["doctor"]["wall_s"], "verdict": doctor["verdict"]}]
    data = {
        "name": "gpu",
        "command": run["command"],
        "machine": machine,
        "started": run["started_at"],
        "finished": run["finished_at"],
        "load_before": None,
        "load_after": None,
        "source": str(folder.resolve().relative_to(BENCH.parent)),
        "tables": tables,
    }
    sys.path.insert(0, str(BENCH))
    import harness

    path = harness.result_path("gpu", machine)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def _value(v):
    """gpu.sh's cells as numbers: '36958.8\\*' (timed once) -> 36958.8; 'not timed' stays."""
    try:
        return float(v.replace("\\*", "")) if isinstance(v, str) else v
    except ValueError:
        return v


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 where a table is stale")
    ap.add_argument("--doc", type=Path, default=DOC)
    ap.add_argument("--from-gpu-run", type=Path, metavar="DIR", help="convert gpu.sh's DIR/run.json first")
    args = ap.parse_args(argv)
    if args.from_gpu_run:
        print(f"wrote {from_gpu_run(args.from_gpu_run)}")
    text = args.doc.read_text()
    new = regenerate(text)
    if args.check:
        if new != text:
            print(f"{args.doc}: a generated table differs from its JSON; run python benchmarks/tables.py")
            return 1
        return 0
    args.doc.write_text(new)
    print(f"{args.doc}: {len(BLOCK.findall(text))} tables regenerated")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
