"""What the full check of recorded inputs costs per file (issue 38 item 3; docs/extract.md, "Inputs that change").

N small files are made in folders of 1,000, then recorded as a run records them (``decode/inputs.py``:
stat, xxh3), written as one inputs file; then timed, each ``--rounds`` times (the median printed):

- ``stat``: a bare ``os.stat`` of every file (the floor of any check that looks at each file);
- ``full check``: ``store.inputs.changed_on_disk`` over the inputs file, every stamp unchanged (what a full
  resume pays when nothing changed);
- ``full check, all touched``: the same after every file's times moved (each is hashed again).

The files stay in the page cache (a second pass over a cold network filesystem costs its round trips).

    python benchmarks/inputs.py check --files 200000 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", type=int, default=200_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to make the files (default: a temp folder)")
    a = p.parse_args(argv)

    import numpy as np

    from vlfast.extraction.decode.inputs import input_record
    from vlfast.extraction.sources.sample import Sample
    from vlfast.extraction.store.backend import backend_for
    from vlfast.extraction.store.inputs import changed_on_disk, write_inputs

    root = Path(tempfile.mkdtemp(prefix="vlfast-inputs-", dir=a.dir))
    paths = []
    for i in range(a.files):
        folder = root / "media" / f"{i // 1000:05d}"
        if i % 1000 == 0:
            folder.mkdir(parents=True)
        path = folder / f"{i:08d}.jpg"
        path.write_bytes(i.to_bytes(8, "little") * 64)
        paths.append(str(path))
    with harness.Stopwatch() as sw:
        records = [input_record(Sample(f"s{i}", "image", (path,)), ()) for i, path in enumerate(paths)]
    record_s = sw.wall
    out = root / "out"
    out.mkdir()
    backend = backend_for(out, "bench")
    ids = [f"s{i}" for i in range(a.files)]
    write_inputs(out, backend, 0, 0, ids, "shards/shard-r00000-000000.safetensors", "h", records, "bench")
    keys = np.sort(np.array([r["key"] for r in records], np.uint64))
    part = _part(out)

    def timed(fn) -> float:
        return harness.median(harness.alternate({"fn": fn}, a.rounds, warmup=False)["fn"]["wall"])

    stat_s = timed(lambda: [os.stat(p) for p in paths])
    result = changed_on_disk(out, [part], keys)
    assert result[0] == [] and result[1] == a.files, result[1:]
    full_s = timed(lambda: changed_on_disk(out, [part], keys))
    for path in paths:
        os.utime(path)
    touched = changed_on_disk(out, [part], keys)
    assert touched[0] == [] and touched[2] == a.files, touched[1:]
    touched_s = timed(lambda: changed_on_disk(out, [part], keys))
    report = {
        "files": a.files,
        "record_us": 1e6 * record_s / a.files,
        "stat_us": 1e6 * stat_s / a.files,
        "full_check_us": 1e6 * full_s / a.files,
        "full_check_touched_us": 1e6 * touched_s / a.files,
        "load_average": os.getloadavg(),
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
    }
    record(report)
    print(json.dumps(report, indent=1))
    return 0


def _part(out: Path) -> Path:
    """A one-shard index part whose footer names the shard the inputs file's rows name, header "h"."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlfast.extraction.store.format import META_SHARD_BYTES, META_SHARD_HEADER

    (out / "index").mkdir()
    part = out / "index" / "part-r00000-000000-0000000000000000.parquet"
    table = pa.table({"id": ["x"]}).replace_schema_metadata({META_SHARD_BYTES: b"0", META_SHARD_HEADER: b"h"})
    pq.write_table(table, part)
    return part


def record(result: dict) -> None:
    """The result into the run's result file (a no-op outside benchmarks/SCRIPT.py MODE)."""
    harness.record(result)


if __name__ == "__main__":
    raise SystemExit(main())
