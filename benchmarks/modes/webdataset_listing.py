"""Listing WebDataset shards with and without the listings OUT keeps (vlfast.extraction.sources.kept).

Writes S shards of K keys (a small PNG and a ``.txt`` caption per key, as img2dataset writes them), then
times ``load_inputs(pattern)`` as a run's planning calls it:

- ``fresh``: every shard read to be listed (what every run, resume and rank did before listings were kept);
- ``kept``: the same with ``KeptListings`` over an OUT whose ``listings/`` a first run wrote;

on local disk (page cache warm: a cold disk or a network filesystem only widens the gap), and with
``--s3`` also at an ``s3://`` URL on moto's server in this process (requests counted by kind, as
benchmarks/extract.py scale counts them: times on localhost say little about S3, the request counts do).
Both sides alternate round by round in one process; medians and the spread are printed.

    python benchmarks/inputs.py webdataset --shards 100 --keys 1000 [--s3] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402


def write_shards(folder: Path, shards: int, keys: int) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    Image.new("RGB", (32, 24), (10, 20, 30)).save(buf, "PNG")
    png = buf.getvalue()
    for s in range(shards):
        with tarfile.open(folder / f"{s:06d}.tar", "w") as tf:
            for k in range(keys):
                for ext, data in (("png", png), ("txt", f"caption {s} {k}".encode())):
                    info = tarfile.TarInfo(f"sample_{k:06d}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
    time.sleep(2.1)  # settled: no listing is kept of a shard changed in the last 2 s (ctime included)
    return str(folder / f"{{000000..{shards - 1:06d}}}.tar")


def measure(pattern: str, listings, options=None, rounds: int = 3, counter=None) -> dict:
    from vlfast.extraction.sources import load_inputs
    from vlfast.extraction.sources.kept import KeptListings

    # a first run's listing, kept as the run would keep it
    first = KeptListings.of_folder(listings)
    samples, _ = load_inputs(pattern, options, first)
    if isinstance(listings, Path):
        listings.mkdir(parents=True, exist_ok=True)
    for name, data in first.fresh.items():
        (listings / name).write_bytes(data)
    assert first.fresh, "no listing kept: the shards are not settled"
    kept_bytes = sum(len(d) for d in first.fresh.values())
    requests: dict[str, dict] = {}
    kept: dict[str, KeptListings | None] = {}

    def setup(side: str) -> None:  # untimed: the requests counted so far dropped, the kept listings read
        if counter is not None:
            counter.take()
        kept[side] = KeptListings.of_folder(listings) if side == "kept" else None

    def side(name: str):
        def run() -> None:
            load_inputs(pattern, options, kept[name])
            if name == "kept":
                assert kept[name].used == len(first.fresh), (kept[name].used, len(first.fresh))
            if counter is not None:
                requests[name] = counter.take()

        return run

    got = harness.alternate({s: side(s) for s in ("fresh", "kept")}, rounds, warmup=False, setup=setup)
    times = {s: v["wall"] for s, v in got.items()}
    out = {
        "samples": len(samples),
        "listings": len(first.fresh),
        "listing_bytes": kept_bytes,
        **{f"{side}_s": harness.median(t) for side, t in times.items()},
        **{f"{side}_spread_s": [round(min(t), 3), round(max(t), 3)] for side, t in times.items()},
    }
    out["speedup"] = out["fresh_s"] / out["kept_s"]
    if requests:
        out["requests"] = requests
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=100)
    ap.add_argument("--keys", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--s3", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    result: dict = {"shards": args.shards, "keys_per_shard": args.keys, "load": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        pattern = write_shards(root / "shards", args.shards, args.keys)
        result["local"] = measure(pattern, root / "out" / "listings", rounds=args.rounds)
        if args.s3:
            import boto3
            from extract_scale import BUCKET, moto_server
            from upath import UPath

            with moto_server() as (endpoint, counter):
                s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
                for p in sorted((root / "shards").iterdir()):
                    s3.upload_file(str(p), BUCKET, f"shards/{p.name}")
                options = {"client_kwargs": {"endpoint_url": endpoint}}
                url = f"s3://{BUCKET}/shards/" + Path(pattern).name
                listings = UPath(f"s3://{BUCKET}/out/listings", **options)
                result["s3"] = measure(url, listings, options, args.rounds, counter)
    result["load_end"] = os.getloadavg()[0]
    record(result)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for where in ("local", "s3"):
            if where in result:
                r = result[where]
                print(
                    f"{where}: {r['samples']:,} samples in {r['listings']} shards: fresh {r['fresh_s']:.2f} s "
                    f"{r['fresh_spread_s']}, kept {r['kept_s']:.2f} s {r['kept_spread_s']} "
                    f"({r['speedup']:.1f}x); kept listings {r['listing_bytes'] / 2**20:.1f} MiB"
                    + (f"; requests {r['requests']}" if "requests" in r else "")
                )
        print(f"load {result['load']:.2f} -> {result['load_end']:.2f}")


def record(result: dict) -> None:
    """The result into the run's result file (a no-op outside benchmarks/SCRIPT.py MODE)."""
    harness.record(result)


if __name__ == "__main__":
    main()
