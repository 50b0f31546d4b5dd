"""What the extraction store's bookkeeping costs as the number of samples grows (issue 22).

N tiny samples (one 64-value float16 feature each, so the bookkeeping is all there is) go through the real
``FeatureStore``, locally and/or on S3 (moto's server on 127.0.0.1), driven the way a run drives it without
a model: the input list, a ``RunPlan``, ``RunPlan.finished`` (the read-only preflight),
the engines' own ``_opened_store``, ``done_ids()`` and ``RunPlan.work``. Every measured step runs in a
fresh process (``--_step``), so its peak RSS (``ru_maxrss``) is its own:

1. write, first half: each of ``--ranks`` ranks (one after another, each its own process, shards and
   parts) writes half of its share and stops cleanly (a run interrupted half way: its buffer committed, as
   on SIGTERM); with ``--killed``, as a SIGKILL after its last commit leaves it: every part it committed
   is there, none compacted (a clean stop compacts them into one at close);
2. resume planning on that half-finished OUT, ``--resume-check quick`` then ``full``: what a rank does
   from holding its input list to the point where its first forward would start (preflight, store open
   with its check of every committed shard, ``done_ids``, the plan of what is left);
3. write, second half: each rank resumes and writes the rest; the write throughput is this and step 1;
4. resume planning on the finished OUT ("nothing to do"): quick, full with no ``checked.json`` (every
   tensor hashed) and full again (``checked.json`` vouches for every shard);
5. ``FeatureCache(OUT)`` opened (and ``len``).

Planning is measured for rank 0 of ``--ranks`` (every rank reads the same index parts and errors files
today, so the others cost the same). The input is a JSONL manifest of N rows (``{"id", "path"}``), written
once by the driver and read in each step by vlfast's own source into a ``SampleTable`` (columns), or with
``--input list`` a list of N ``Sample`` objects as an API caller would pass it. Building it is timed apart
(``inputs_s``) and not in the planning time; the peak RSS includes it, and ``bookkeeping_mib`` is the peak
minus the RSS once the inputs were built.

On S3 every HTTP request any client of the measured process makes is counted **at the server**: the moto
server runs in this process behind a WSGI middleware that counts each request by method and kind (list,
ranged GET, GET, HEAD, PUT, DELETE, POST), reset before each step. Nothing in the measured process is
patched, so requests made by s3fs, boto3, aiohttp or anything else are all counted.

    python benchmarks/extract.py scale --samples 100000 --per-part 1024 --storage local
    python benchmarks/extract.py scale --samples 100000 --per-part 1024 --storage s3 --json
    python benchmarks/extract.py scale --samples 300 --per-part 64 --storage both --ranks 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "vlfast-scale"
DIM = 64  # values per sample, float16: 128 bytes of payload
KEY_CHUNK = 1 << 16  # input keys made at a time for the records the write step adds
MODEL = "ref:qwen3-vl-2b"  # only named in the configuration: no model is built
RUN_CONFIG = {"task": "vlfast.extract", "model": "benchmark-scale", "dim": DIM, "dtype": "float16"}


def sample_id(i: int) -> str:
    return f"img-{i:010d}"


# ----------------------------------------------------------------------------------------------------
# measured steps, each in a fresh process


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _inputs(spec: dict):
    """The input list: the manifest the driver wrote, read by the real source (a SampleTable of columns),
    or (``--input list``) a list of ``Sample`` objects as an API caller would hold it."""
    if spec["input"] == "manifest":
        from vlfast.extraction.sources.kept import KeptListings
        from vlfast.extraction.sources.listing import load_inputs
        from vlfast.extraction.store.format import LISTING_DIR, resolve_out

        # As make_plan reads it: the manifest's table kept in OUT when there is one (written by the first
        # step, as a run writes it once OUT is claimed), else every row parsed
        kept = None
        if not spec.get("parse_every_time"):
            out = resolve_out(spec["out"], spec["storage_options"])
            kept = KeptListings.of_folder(out / LISTING_DIR, spec["rank"], spec["ranks"])
        samples, problems = load_inputs(spec["manifest"], None, kept)
        assert not problems and len(samples) == spec["samples"], (len(samples), problems[:3])
        return samples, ({} if kept is None else kept.fresh), bool(kept and kept.used)
    from vlfast.extraction.sources.sample import Sample

    listed = [Sample(sample_id(i), "image", (f"images/{sample_id(i)}.jpg",)) for i in range(spec["samples"])]
    return listed, {}, False


def write_manifest(path: Path, n: int) -> None:
    """A JSONL manifest of ``n`` rows, ``{"id": ..., "path": "images/....jpg"}``."""
    with open(path, "w") as f:
        for start in range(0, n, 100_000):
            f.write(
                "".join(
                    f'{{"id": "{sample_id(i)}", "path": "images/{sample_id(i)}.jpg"}}\n'
                    for i in range(start, min(n, start + 100_000))
                )
            )


def _plan(spec: dict, samples: list):
    from vlfast.extraction.config import ExtractConfig
    from vlfast.extraction.plan import RUNTIME_KEY, RunPlan
    from vlfast.extraction.store.format import resolve_out
    from vlfast.extraction.store.resume import DEFAULT_VOLATILE_KEYS

    config = ExtractConfig(
        model=MODEL,
        device="cpu",
        rank=spec["rank"],
        world_size=spec["ranks"],
        shard_max_samples=spec["per_part"],
        commit_every=None,  # parts close on size alone, so their number is what --per-part says
        resume_check=spec["mode"],
        storage_options=spec["storage_options"],
        num_workers=0,
    )
    plan = RunPlan(
        out=resolve_out(spec["out"], spec["storage_options"]),
        samples=samples,
        problems=[],
        rank=spec["rank"],
        world_size=spec["ranks"],
        family="qwen3_vl",
        processor=None,
        run_config=RUN_CONFIG,
        volatile_keys=(*DEFAULT_VOLATILE_KEYS, RUNTIME_KEY),
    )
    return plan, config


def _write(store, todo, spec: dict, res: dict[str, Any], clock) -> None:
    """The write step's adds and commits: ``spec["fraction"]`` of ``todo``, each with the input record a run
    makes (outside the store's time); its figures into ``res``."""
    import torch

    # Distinct values per sample without a generator call each: rows of a fixed table.
    table = torch.randn(4096, DIM, generator=torch.Generator().manual_seed(0)).half()
    limit = len(todo) if spec["fraction"] >= 1 else math.ceil(len(todo) * spec["fraction"])
    # The ids straight from the plan's column (a run's samples are made by its decode stage,
    # not here): what is timed is the store. The path in meta is the list input's form.
    from itertools import islice

    import numpy as np

    from vlfast.extraction.ids import ArrowStrings
    from vlfast.extraction.sources.identity import entry_keys

    # What a run's decode stage records of each input (its key from the entry, as a resume makes
    # them; a local file's stamp and checksum): made here, outside the store's time, in chunks,
    # as a run makes one a sample (five million keys held at once as Python ints were ~230 MiB
    # of this harness's own in the writing rank's peak, not the store's).
    res["keys_s"], keys = 0.0, np.empty(0, np.uint64)
    for k, sample_id in enumerate(islice(ArrowStrings(todo.ids), limit)):
        if k % KEY_CHUNK == 0:
            with harness.Stopwatch() as sw:
                keys = entry_keys(todo.take(np.arange(k, min(limit, k + KEY_CHUNK))), ()).tolist()
            res["keys_s"] += sw.wall
        path = f"/data/images/{sample_id}.jpg"
        stamp = f"54321:{1_790_000_000_000_000_000 + k}:{1_790_000_000_000_000_000 + k}:{k}"
        key = keys[k % KEY_CHUNK]
        record = {
            "scheme": 1,
            "key": key,
            "content": key ^ 1,
            "path": path,
            "size": 54321,
            "mtime_ns": 1_790_000_000_000_000_000 + k,
            "stamp": stamp,
            "xxh3": f"{key:016x}",
        }
        meta = {"path": f"images/{sample_id}.jpg"}
        store.add(sample_id, {"feature": table[k % 4096]}, meta, input=record)
    store.flush()
    res["written"] = limit
    # adds and commits, the last one included
    res["write_s"] = clock.lap() - res["keys_s"]  # clock: the step's, its last lap ended with the plan


def step(spec: dict) -> dict[str, Any]:
    """One measured step (spec["step"]: "write" or "resume" or "cache"); returns its figures."""
    import torch  # noqa: F401  (imported before the baseline, as every run has it)

    from vlfast.extraction.engines.base import _opened_store

    res: dict[str, Any] = {"rss_imports_mib": _rss_mib()}
    if spec["step"] == "cache":
        from vlfast.extraction.store.reader import FeatureCache

        with harness.Stopwatch() as sw:
            cache = FeatureCache(spec["out"], storage_options=spec["storage_options"])
        res["open_s"] = sw.wall
        res["samples"] = len(cache)
        res["rss_inputs_mib"] = res["rss_imports_mib"]
        res["peak_rss_mib"] = _peak_mib()
        return res

    clock = harness.Stopwatch()  # its laps: each phase
    samples, listings, res["inputs_kept"] = _inputs(spec)
    res["inputs_s"] = clock.lap()
    res["rss_inputs_mib"] = _rss_mib()

    plan, config = _plan(spec, samples)
    res["plan_s"] = clock.lap()
    finished = plan.finished(config)
    res["preflight_s"] = clock.lap()
    res["nothing_to_do"] = finished is not None
    if finished is not None:
        res["planning_s"] = res["plan_s"] + res["preflight_s"]
        res["todo"] = 0
    else:
        with _opened_store(plan, config) as store:
            if spec.get("killed"):  # its parts left as a SIGKILL after its last commit leaves them
                store.compact_min_parts = None
            store.keep_listings(listings)  # as run_session does, once OUT is this run's (not timed)
            listings.clear()
            res["store_open_s"] = clock.lap()
            done = store.done_ids(mine=True)  # as run_session does
            res["done_ids_s"] = clock.lap()
            todo, records = plan.work(done)
            plan.pending(done, store.is_recorded, (todo, records))  # as run_session does
            del done  # as run_session does
            res["work_s"] = clock.lap()
            res["planning_s"] = sum(
                res[k] for k in ("plan_s", "preflight_s", "store_open_s", "done_ids_s", "work_s")
            )
            res["todo"] = len(todo)
            if spec["step"] == "write":
                _write(store, todo, spec, res, clock)
            clock.lap()  # the close starts
        res["close_s"] = clock.lap()
    res["peak_rss_mib"] = _peak_mib()
    return res


# ----------------------------------------------------------------------------------------------------
# S3: moto's server in this process, every request counted


class _Counting:
    """WSGI middleware: counts each request by (method, kind) before moto sees it."""

    def __init__(self, app):
        self.app, self.lock, self.counts = app, threading.Lock(), Counter()

    def __call__(self, environ, start_response):
        method, query = environ["REQUEST_METHOD"], environ.get("QUERY_STRING", "")
        if method == "GET" and ("list-type" in query or environ.get("PATH_INFO", "/").count("/") <= 1):
            kind = "LIST"
        elif method == "GET" and environ.get("HTTP_RANGE"):
            kind = "GET range"
        else:
            kind = method
        with self.lock:
            self.counts[kind] += 1
        return self.app(environ, start_response)

    def take(self) -> dict[str, int]:
        with self.lock:
            counts, self.counts = dict(self.counts), Counter()
        return {"total": sum(counts.values()), **dict(sorted(counts.items()))}


@contextmanager
def moto_server():
    """(endpoint, counter): moto's S3 on 127.0.0.1 with a fresh bucket, for the duration."""
    import socket

    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import WSGIRequestHandler, make_server

    class Quiet(WSGIRequestHandler):
        def log_request(self, *args, **kwargs) -> None:  # one line per request on stderr otherwise
            pass

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    counter = _Counting(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", port, counter, threaded=True, request_handler=Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        import boto3

        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        counter.take()
        yield endpoint, counter
    finally:
        server.shutdown()
        thread.join()


# ----------------------------------------------------------------------------------------------------
# the driver


def _run_step(spec: dict, counter: _Counting | None, inline: bool = False) -> dict[str, Any]:
    if counter is not None:
        counter.take()
    sw = harness.Stopwatch()
    if inline:  # the smoke test's mode: no fresh process, so the RSS figures are the driver's, cumulative
        res = step(spec)
    else:
        proc = subprocess.run(
            [sys.executable, __file__, "--_step", json.dumps(spec)], capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise RuntimeError(f"step {spec['step']} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["process_s"] = sw.wall
    res["bookkeeping_mib"] = res["peak_rss_mib"] - res["rss_inputs_mib"]
    if counter is not None:
        res["requests"] = counter.take()
    return res


def _remove_checked(out: str, endpoint: str | None) -> None:
    """Delete OUT/checked.json (outside any measured step), so a full check hashes everything."""
    if endpoint is None:
        Path(out, "checked.json").unlink(missing_ok=True)
        return
    import boto3

    key = out.removeprefix(f"s3://{BUCKET}/") + "/checked.json"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").delete_object(Bucket=BUCKET, Key=key)


def _listing(out: str, endpoint: str | None) -> dict[str, int]:
    """Parts, shards and bytes in OUT (not counted: the step's counter was read already)."""
    if endpoint is None:
        files = [p for p in Path(out).rglob("*") if p.is_file()]
        names = [(p.relative_to(out).as_posix(), p.stat().st_size) for p in files]
    else:
        import boto3

        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        prefix = out.removeprefix(f"s3://{BUCKET}/") + "/"
        names = []
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
            names += [(o["Key"][len(prefix) :], o["Size"]) for o in page.get("Contents", [])]
    parts = [s for n, s in names if n.startswith("index/part-")]
    shards = [s for n, s in names if n.startswith("shards/shard-")]
    return {
        "index_parts": len(parts),
        "index_bytes": sum(parts),
        "shards": len(shards),
        "shard_bytes": sum(shards),
        "objects": len(names),
    }


def measure(storage: str, a: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    with contextlib_nullcontext() if storage == "local" else moto_server() as server:
        endpoint, counter = server if server else (None, None)
        if endpoint is None:
            out, options = str(workdir / f"out-{a.samples}-{a.per_part}-r{a.ranks}"), None
        else:
            out = f"s3://{BUCKET}/out-{a.samples}-{a.per_part}-r{a.ranks}"
            options = {"client_kwargs": {"endpoint_url": endpoint}}
        manifest = workdir / f"inputs-{a.samples}.jsonl"
        if a.input == "manifest" and not manifest.exists():
            write_manifest(manifest, a.samples)
        if a.input == "manifest":  # a manifest changed in the last 2 s is not kept (sources.kept.SETTLE_S)
            time.sleep(max(0.0, 2.1 - (time.time() - manifest.stat().st_ctime)))
        base = {
            "input": a.input,
            "manifest": str(manifest),
            "out": out,
            "storage_options": options,
            "samples": a.samples,
            "per_part": a.per_part,
            "ranks": a.ranks,
            "parse_every_time": a.parse_every_time,
        }

        def run(name: str, **spec: Any) -> dict[str, Any]:
            res = _run_step(base | spec, counter, a.inline)
            if not a.json:
                extra = f", {res['requests']['total']} requests" if "requests" in res else ""
                secs = res.get("planning_s", res.get("open_s"))
                print(
                    f"  [{storage}] {name}: {secs:.2f} s"
                    + (f" (write {res['write_s']:.2f} s)" if "write_s" in res else "")
                    + f", peak RSS {res['peak_rss_mib']:.0f} MiB{extra}"
                    + (
                        f"; inputs {res['inputs_s']:.2f} s ({'kept' if res['inputs_kept'] else 'parsed'})"
                        if "inputs_s" in res
                        else ""
                    ),
                    file=sys.stderr,
                    flush=True,
                )
            return res

        result: dict[str, Any] = {"out": out}
        write = [
            run(f"write r{r} first half", step="write", rank=r, mode="quick", fraction=0.5, killed=a.killed)
            for r in range(a.ranks)
        ]
        result["half"] = {
            "quick": run("resume half quick", step="resume", rank=0, mode="quick"),
            "full": run("resume half full", step="resume", rank=0, mode="full"),
        }
        write += [
            run(f"write r{r} rest", step="write", rank=r, mode="quick", fraction=1.0) for r in range(a.ranks)
        ]
        assert sum(w["written"] for w in write) == a.samples, write
        _remove_checked(out, endpoint)
        finished = {"quick": run("resume finished quick", step="resume", rank=0, mode="quick")}
        _remove_checked(out, endpoint)
        finished["full"] = run("resume finished full", step="resume", rank=0, mode="full")
        finished["full_vouched"] = run(
            "resume finished full (checked.json)", step="resume", rank=0, mode="full"
        )
        assert all(f["nothing_to_do"] for f in finished.values()), finished
        result["finished"] = finished
        result["cache_open"] = run("FeatureCache open", step="cache", rank=0, mode="quick")
        assert result["cache_open"]["samples"] == a.samples
        result.update(_listing(out, endpoint))
        write_s = sum(w["write_s"] for w in write)
        result["write"] = {
            "seconds": write_s,
            "samples_per_s": a.samples / write_s,
            "payload_mib_per_s": a.samples * DIM * 2 / 2**20 / write_s,
            "peak_rss_mib": max(w["peak_rss_mib"] for w in write),
            "steps": write,
        }
        if counter is not None:
            result["write"]["requests"] = sum(w["requests"]["total"] for w in write)
        return result


@contextmanager
def contextlib_nullcontext():
    yield None


def machine() -> dict[str, Any]:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=100_000)
    p.add_argument("--per-part", type=int, default=1024, help="samples per shard and index part")
    p.add_argument("--storage", choices=("local", "s3", "both"), default="local")
    p.add_argument("--ranks", type=int, default=1, help="ranks that write (each its own shards and parts)")
    p.add_argument(
        "--input",
        choices=("manifest", "list"),
        default="manifest",
        help="the input: a JSONL manifest read by vlfast's source (default), or a list of Sample objects",
    )
    p.add_argument(
        "--parse-every-time",
        action="store_true",
        help="read the manifest's rows in every step, not its table kept in OUT by the first (as before)",
    )
    p.add_argument(
        "--killed",
        action="store_true",
        help="the first half stops as a SIGKILL after its last commit leaves it: every part, none compacted",
    )
    p.add_argument("--json", action="store_true", help="the figures as JSON on stdout")
    p.add_argument("--keep", default=None, help="write the local OUT into this folder and keep it")
    p.add_argument(
        "--inline",
        action="store_true",
        help="run every step in this process (fast, for the smoke test; RSS figures are then cumulative)",
    )
    p.add_argument("--_step", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a._step is not None:
        print(json.dumps(step(json.loads(a._step))))
        return 0
    if a.samples < 2 or a.per_part < 1 or a.ranks < 1:
        p.error("--samples must be >= 2, --per-part and --ranks >= 1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(k, "benchmark")  # moto takes any
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    src = str(ROOT / "src")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))

    if a.keep:
        workdir = Path(a.keep)
        workdir.mkdir(parents=True, exist_ok=True)
    else:
        workdir = Path(tempfile.mkdtemp(prefix="vlfast-scale-"))
    sw = harness.Stopwatch()
    report: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/extract.py scale", *(argv or sys.argv[1:])]),
        "machine": machine(),
        "samples": a.samples,
        "per_part": a.per_part,
        "ranks": a.ranks,
        "input": a.input,
        "parse_every_time": a.parse_every_time,
        "feature": f"one ({DIM},) float16 tensor per sample",
        "inline": a.inline,
        "load_average_start": os.getloadavg(),
        "results": {},
    }
    try:
        for storage in ("local", "s3") if a.storage == "both" else (a.storage,):
            report["results"][storage] = measure(storage, a, workdir)
    finally:
        if not a.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    report["load_average_end"] = os.getloadavg()
    report["seconds"] = sw.wall
    record(report)
    if a.json:
        print(json.dumps(report, indent=2))
    else:
        print(table(report))
    return 0


def table(report: dict[str, Any]) -> str:
    """One Markdown row per storage: seconds, then requests on S3, then peak RSS."""
    lines = [
        "| storage | samples (per part) | index parts | FeatureCache open "
        "| resume planning, half done: quick / full | finished: quick / full / full vouched "
        "| peak RSS: resume / FeatureCache | write |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def cell(steps: list[dict[str, Any]], key: str = "planning_s") -> str:
        text = " / ".join(f"{x[key]:.2f}" for x in steps) + " s"
        if all("requests" in x for x in steps):
            text += "; " + " / ".join(f"{x['requests']['total']:,}" for x in steps) + " req"
        return text

    for storage, r in report["results"].items():
        h, f, c = r["half"], r["finished"], r["cache_open"]
        resumes = [*h.values(), *f.values()]
        peak = max(x["peak_rss_mib"] for x in resumes)
        lines.append(
            f"| {storage} | {report['samples']:,} ({report['per_part']:,}) | {r['index_parts']:,} "
            f"| {cell([c], 'open_s')} | {cell([h['quick'], h['full']])} "
            f"| {cell([f['quick'], f['full'], f['full_vouched']])} "
            f"| {peak:,.0f} / {c['peak_rss_mib']:,.0f} MiB "
            f"| {r['write']['samples_per_s']:,.0f} samples/s |"
        )
    return "\n".join(lines)


def record(result: dict) -> None:
    """The result into the run's result file (a no-op outside benchmarks/SCRIPT.py MODE)."""
    harness.record(result)


if __name__ == "__main__":
    sys.exit(main())
