"""docs/benchmarks.md's generated tables agree with the committed result files they name (benchmarks/tables.py).

Each block is rendered again in memory from its JSON and compared with the file: a hand edit of a table, or
a result file changed without `python benchmarks/tables.py`, fails here."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _tables():
    spec = importlib.util.spec_from_file_location("_bench_tables", REPO / "benchmarks" / "tables.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_generated_table_matches_its_json():
    tables = _tables()
    text = tables.DOC.read_text()
    blocks = list(tables.BLOCK.finditer(text))
    assert len(blocks) >= 5, "docs/benchmarks.md has lost its generated tables"
    for m in blocks:
        assert m.group("body") == tables.render(m.group("spec")), (
            f"{m.group('spec')}: the table differs from its JSON; run python benchmarks/tables.py"
        )
    assert tables.regenerate(text) == text


def test_a_changed_figure_is_caught(tmp_path):
    """The check compares values, not just shapes: one figure changed in a result file changes the block."""
    tables = _tables()
    m = next(tables.BLOCK.finditer(tables.DOC.read_text()))
    path, table, *_ = m.group("spec").split()
    data = json.loads((tables.BENCH / path).read_text())
    row = data["tables"][table][0]
    key = next(k for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
    row[key] = row[key] * 3 + 1
    fake = tmp_path / "r.json"
    fake.write_text(json.dumps(data))
    spec = m.group("spec").replace(path, str(fake), 1)
    assert tables.render(spec) != m.group("body")


def test_every_result_file_names_its_machine_date_commit_and_load():
    for path in sorted((REPO / "benchmarks" / "results").rglob("*.json")):
        data = json.loads(path.read_text())
        assert {"name", "command", "machine", "tables"} <= set(data), path
        assert {"cpu", "cores", "torch", "date", "commit"} <= set(data["machine"]), path
        assert "load_before" in data and "load_after" in data, path
        assert path.parent.name and path.name.startswith(data["name"]), path


def test_a_mode_run_writes_its_result_file_through_the_harness(tmp_path):
    """`benchmarks/inputs.py memory` at a tiny N: the dispatcher's Run writes one result file with the
    machine (CPU, instruction sets, versions, commit), the load before and after and the mode's tables."""
    import os
    import subprocess

    env = {**os.environ, "VLFAST_BENCH_RESULTS": str(tmp_path)}
    env.pop("VLFAST_BENCH_NO_SAVE", None)
    cmd = [sys.executable, str(REPO / "benchmarks" / "inputs.py"), "memory", "--entries", "20"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr
    (path,) = tmp_path.rglob("input_memory-*.json")
    data = json.loads(path.read_text())
    assert data["command"].startswith("python benchmarks/inputs.py memory --entries 20")
    assert {"cpu", "isa", "cores", "python", "torch", "transformers", "commit", "date"} <= set(
        data["machine"]
    )
    assert len(data["load_before"]) == len(data["load_after"]) == 3
    assert {r["name"] for r in data["tables"]["results"]} == {"manifest after", "webdataset after"}
