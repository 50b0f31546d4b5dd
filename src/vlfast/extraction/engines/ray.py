"""``extract`` as Ray Data stages: decoding on CPU actors, the model on actors of its own (a GPU each when
asked), writing the same OUT as the local engine, so ``FeatureCache``, ``--verify`` and resume work unchanged.

    vlfast extract clips.jsonl OUT -m /ckpt/Qwen3-VL-4B-Instruct --engine ray --ray-workers 8 --num-gpus-per-worker 1

The driver (the calling process) runs ``extract`` itself up to the model (the plan, OUT locked as rank 0,
duplicates and bad input rows recorded: ``run_session``). Then, instead of loading a model,
:class:`RayEngine` runs::

    the remaining samples (plain columns: id, kind, paths, prompt, tar member or URL as JSON)
      -> map_batches(_Decode, actor pool, num_cpus=1): each call decodes its samples in ONE forked worker of
         the actor (WorkerPool): a crash or a hang becomes a row, never a failed task
      -> map_batches(_ModelStage, N actors, num_gpus=G): each claims the first free rank 1..N (an flock per
         rank), opens its own FeatureStore, loads the model once and runs the same ``Forward`` as the local
         engine; it returns one tiny row per sample (id, status), so features never travel to the driver
      -> the driver counts the rows: progress bar, ``max_errors``, the summary.

When the dataset is done, Ray Data lets the model actors exit, which closes their stores (the last shard
commits). The driver waits for their rank locks, then re-reads OUT: a sample a model actor had buffered but
not committed when it died is extracted again in another pass, so a run that returns has every sample
committed or recorded, or says how many it lost.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
import warnings
from collections import Counter
from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from vlfast.errors import InputRefused
from vlfast.extraction.config import ExtractConfig, ExtractSummary
from vlfast.extraction.decode.stage import DecodedSample, SampleDataset, prepare_decoding, worker_init
from vlfast.extraction.engines.base import Hooks, Session, UnexpectedErrors, cpu_bits_problem, run_session
from vlfast.extraction.ids import IdSet
from vlfast.extraction.interrupts import EXIT_TERMINATED, deferred, sigterm_handler
from vlfast.extraction.model import runner
from vlfast.extraction.plan import RunPlan
from vlfast.extraction.sources.sample import Sample
from vlfast.extraction.sources.table import SampleTable
from vlfast.extraction.store.format import OutputInUse, done_by_error, error_key, is_local
from vlfast.extraction.store.out import Out

__all__ = ["INSTALL_HINT", "RayEngine"]

INSTALL_HINT = "pip install 'vlfast[ray]'"
DECODE_BATCH = 16  # samples per decode call, in one forked worker (~0.1 s to fork and reap it)
RANK_WAIT_S = 120.0  # a model actor waits this long for a free rank (a dead actor's lock goes with it)
RELEASE_WAIT_S = 600.0  # the driver waits this long for the model actors to commit their last shard
# ... and this long after SIGTERM or Ctrl-C: well inside a scheduler's grace period (Slurm --signal=TERM@120)
TERM_WAIT_S = 60.0
MAX_RANK = 99_999  # rank numbers have five digits in file names
MAX_PASSES = 3  # dataset passes: the first, plus re-runs of samples lost with a model actor that died
# Idle OpenMP threads sleep; MKL gives the same bits at any thread count (vlfast.cli.let_idle_threads_sleep)
ENV = {"OMP_WAIT_POLICY": "PASSIVE", "MKL_CBWR": "AUTO,STRICT"}


def _import_ray():
    try:
        import ray
        import ray.data  # noqa: F401 - the [data] extra: pandas, pyarrow glue
    except ImportError as e:
        raise ImportError(
            f"--engine ray needs Ray Data, which is not installed ({e}): {INSTALL_HINT}"
        ) from None
    return ray


def _schemas():
    import pyarrow as pa

    samples = pa.schema(
        [
            ("id", pa.string()),
            ("kind", pa.string()),
            ("paths", pa.list_(pa.string())),
            ("prompt", pa.string()),
            ("text", pa.string()),
            ("instruction", pa.string()),
            ("member", pa.string()),  # JSON of a TarMember / RemoteFile with its class name, or null
        ]
    )
    decoded = pa.schema(
        [
            ("id", pa.string()),
            ("source", pa.string()),
            ("kind", pa.string()),
            ("reason", pa.string()),  # why it failed to decode; null when it decoded
            ("traceback", pa.string()),  # set when that failure was unexpected (a bug, not the media)
            ("tensors", pa.large_binary()),  # safetensors bytes: pixel_values, and input_ids for llm
            ("grid", pa.list_(pa.int64())),
            ("tokens", pa.int64()),
            ("meta", pa.string()),  # JSON
            ("input", pa.string()),  # JSON: what its input was when read (decode/inputs.py)
        ]
    )
    done = pa.schema(
        [
            ("id", pa.string()),
            # ok (added to the actor's store), error (recorded), known, done, unexpected (a bug: not recorded)
            ("status", pa.string()),
            ("reason", pa.string()),  # for unexpected: the traceback
            ("patches", pa.int64()),
            ("compute_s", pa.float64()),  # this call's time inside forwards, on its first row
            ("oom_splits", pa.int64()),  # likewise
            ("load_s", pa.float64()),  # the actor's model build, on its first call's first row
            # why its CPU's products may give a sample other bits (cpu_bits_problem), likewise
            ("bits_problem", pa.string()),
        ]
    )
    return samples, decoded, done


class _ActorFacts:
    """What model actors say on their first call's first row: the longest model build, and each reason a
    sample's bits may differ on their CPU (warned once)."""

    def __init__(self):
        self.load_s, self.said = 0.0, set()

    def take(self, row: dict[str, Any]) -> None:
        self.load_s = max(self.load_s, row["load_s"] or 0.0)
        problem = row["bits_problem"]
        if problem and problem not in self.said:
            self.said.add(problem)
            warnings.warn(f"a model actor: {problem}", RuntimeWarning, stacklevel=4)


def _sample_row(s: Sample) -> dict[str, Any]:
    member = None
    if s.member is not None:
        member = json.dumps({"class": type(s.member).__name__, **dataclasses.asdict(s.member)})
    row = {name: getattr(s, name) for name in ("id", "kind", "prompt", "text", "instruction")}
    return {**row, "paths": list(s.paths), "member": member}


def _sample_of(row: dict[str, Any], classes: dict[str, type]) -> Sample:
    member = None
    if row["member"] is not None:
        fields = json.loads(row["member"])
        member = classes[fields.pop("class")](**fields)
    return Sample(
        row["id"],
        row["kind"],
        tuple(row["paths"]),
        row["prompt"],
        member,
        text=row.get("text"),
        instruction=row.get("instruction"),
    )


class _Ref(NamedTuple):
    """What the model stage knows of a sample: enough for its store entry and error records."""

    id: str
    source: str
    kind: str


def _decoded_row(item: DecodedSample, save) -> dict[str, Any]:
    """The decoded schema's columns of a sample that decoded (``save``: safetensors' ``save``)."""
    tensors = {"pixel_values": item.pixel_values.contiguous()}
    if item.input_ids is not None:
        tensors["input_ids"] = item.input_ids.contiguous()
    return {
        "tensors": save(tensors),
        "grid": [int(x) for x in item.grid],
        "tokens": int(item.tokens),
        "meta": json.dumps(item.meta),
        "input": None if item.input is None else json.dumps(item.input),
    }


def _decoded_sample(row: dict[str, Any], i: int, load) -> DecodedSample:
    """A row of the decoded schema back as the model's input (``load``: safetensors' ``load``)."""
    tensors = load(row["tensors"])
    return DecodedSample(
        i=i,
        kind=row["kind"],
        pixel_values=tensors["pixel_values"],
        grid=tuple(row["grid"]),
        tokens=row["tokens"],
        meta=json.loads(row["meta"]),
        input_ids=tensors.get("input_ids"),
        ref=_Ref(row["id"], row["source"], row["kind"]),
        input=json.loads(row["input"]) if row.get("input") else None,
    )


class _Decode:
    """Ray Data stage: samples -> decoded tensors (or the reason they failed), on one CPU, one thread."""

    def __init__(self, config: ExtractConfig, family, cfg, images, decode_hook):
        torch.set_num_threads(1)  # one sample at a time; the forked worker stays on one thread too
        spec = config.spec
        self.pre, self.prompts = prepare_decoding(
            config.model, family, cfg, spec.needs_llm, images, embedding=spec.embedding_prompt()
        )
        self.default_prompt, self.timeout, self.hook = spec.prompt, config.decode_timeout, decode_hook
        from vlfast.extraction.sources.remote import RemoteFile
        from vlfast.extraction.sources.webdataset import TarMember

        self.classes = {"TarMember": TarMember, "RemoteFile": RemoteFile}
        self.schema = _schemas()[1]

    def __call__(self, table):
        import pyarrow as pa
        from safetensors.torch import save

        from vlfast.extraction.decode.workers import WorkerPool

        samples = [_sample_of(r, self.classes) for r in table.to_pylist()]
        dataset = SampleDataset(samples, self.pre, self.prompts, self.default_prompt, self.hook)
        rows = []
        # A forked worker per call: a crashing decoder kills it, not this actor (Ray would retry forever).
        with WorkerPool(
            dataset.__getitem__,
            len(samples),
            num_workers=1,
            timeout=self.timeout,
            prefetch=max(1, len(samples)),
            worker_init=worker_init,
        ) as pool:
            for item in pool:
                s = samples[item.i if isinstance(item, DecodedSample) else item["i"]]
                row = {"id": s.id, "source": s.source, "kind": s.kind, "reason": None, "traceback": None}
                if isinstance(item, DecodedSample):
                    row.update(_decoded_row(item, save))
                elif item.get("unexpected"):
                    row.update(reason=item["reason"], traceback=item.get("traceback") or item["reason"])
                else:
                    row["reason"] = item["reason"]
                rows.append(row)
        return pa.Table.from_pylist(rows, schema=self.schema)


class _ModelStage:
    """Ray Data stage: decoded samples -> features in OUT through this actor's own FeatureStore; one small
    row per sample. The store closes when the actor exits (``__del__``)."""

    def __init__(
        self,
        config: ExtractConfig,
        family,
        cfg,
        out,
        run_config,
        volatile_keys,
        store_options,
        ranks,
        hook,
        rank_counter=None,
        bits_probe=None,
    ):
        t0 = time.perf_counter()
        self.store = _claim_rank(out, run_config, volatile_keys, store_options, ranks, rank_counter)
        try:
            spec = config.spec
            device = torch.device(config.device_type)  # Ray gives each actor its GPUs as cuda:0..
            loaded = runner.load(config.model, family, spec, device, config.torch_dtype, config.patch_convs)
            prompts = (
                prepare_decoding(config.model, family, cfg, True, False, embedding=spec.embedding_prompt())[1]
                if spec.needs_llm
                else None
            )
            self.forward = runner.Forward(loaded, spec, cfg, config.stored_as, prompts, hook)
            # Measured where the model runs: the actors' nodes need not have the driver's CPU.
            self.bits_problem = cpu_bits_problem(bits_probe) if device.type == "cpu" else None
            # What another actor committed before dying: its batch in flight is retried here, not added twice.
            self.done = self.store.done_ids()
        except BaseException:
            self.store.close()
            raise
        self.budget, self.load_s = config.budget, time.perf_counter() - t0
        self.schema = _schemas()[2]
        _commit_on_sigterm(self.store)

    def __call__(self, table):
        import pyarrow as pa
        from safetensors.torch import load

        rows: list[dict[str, Any]] = []
        store = self.store

        def record(sample_id: str, source: str, reason: str) -> None:
            before = store.num_errors
            store.add_error(sample_id, source, reason)
            status = "error" if store.num_errors > before else "known"
            rows.append({"id": sample_id, "status": status, "reason": reason})

        items = []
        for r in table.to_pylist():
            if r["id"] in self.done:
                rows.append({"id": r["id"], "status": "done"})
            elif r["traceback"] is not None:  # a bug, not bad media: never recorded (that would make it done)
                rows.append({"id": r["id"], "status": "unexpected", "reason": r["traceback"]})
            elif r["reason"] is not None:
                record(r["id"], r["source"], r["reason"])
            else:
                items.append(_decoded_sample(r, len(items), load))
        compute0, splits0 = self.forward.compute_seconds, self.forward.oom_splits
        for batch in runner.batches(items, self.budget, padded=self.forward.spec.needs_llm):
            for ref, patches in self.forward.store(batch, store, lambda it: it.ref, record):
                rows.append({"id": ref.id, "status": "ok", "patches": patches})
        if is_local(store.out):
            store.tick()  # commit_every counts here too, between calls
        else:
            # No locks on object storage to tell the driver when the last shard is in: rows mean committed.
            store.flush()
        if rows:
            rows[0].update(
                compute_s=self.forward.compute_seconds - compute0,
                oom_splits=self.forward.oom_splits - splits0,
                load_s=self.load_s,
                bits_problem=self.bits_problem,
            )
            self.load_s, self.bits_problem = 0.0, None
        return pa.Table.from_pylist(rows, schema=self.schema)

    def __del__(self):
        store = getattr(self, "store", None)
        if store is not None:
            store.close()


def _commit_on_sigterm(store) -> None:
    """In a model actor: SIGTERM commits what the store buffered and releases its rank, then exits as Ray's
    own handler does (which alone would lose the buffered samples)."""
    if threading.current_thread() is not threading.main_thread():
        return  # signals reach the main thread only; Ray's own handling stays
    ray_handler = signal.getsignal(signal.SIGTERM)

    def commit_and_exit(signum, frame):
        store.close()
        if callable(ray_handler):
            ray_handler(signum, frame)
        raise SystemExit(EXIT_TERMINATED)

    signal.signal(signal.SIGTERM, deferred(commit_and_exit))


def _claim_rank(out, run_config, volatile_keys, store_options, ranks: Sequence[int] | None, counter=None):
    """This actor's FeatureStore at the first rank no live process holds.

    Ranks are flocks (released by the kernel when a process dies), so a restarted actor takes the rank of
    the one it replaces. On object storage there are no locks: each actor takes a fresh rank from the job's
    ``counter`` instead."""
    from vlfast.extraction.store.writer import FeatureStore

    def store(rank: int, world_size: int):
        return FeatureStore(
            out, run_config, rank=rank, world_size=world_size, volatile_keys=volatile_keys, **store_options
        )

    if counter is not None:
        import ray

        return store(ray.get(counter.take.remote()), MAX_RANK + 1)
    deadline = time.monotonic() + RANK_WAIT_S
    while True:
        for rank in ranks:
            try:
                return store(rank, max(ranks) + 1)
            except OutputInUse:
                continue
        if time.monotonic() > deadline:
            raise OutputInUse(
                f"every model rank {ranks[0]}..{ranks[-1]} of {out} is held by another live process after "
                f"{RANK_WAIT_S:g} s: another job writes this OUT, or actors of an earlier one have not exited"
            )
        time.sleep(1.0)


class _RankCounter:
    """Hands out ranks to the model actors of one job on an object-storage OUT: a Ray actor counting up from
    past the highest rank OUT holds, so a job never reuses a rank an earlier job's late actor may still
    write. Past ``MAX_RANK`` it starts again at 1."""

    def __init__(self, first: int):
        self.next = first
        self.taken: list[int] = []

    def take(self) -> int:
        rank, self.next = self.next, self.next % MAX_RANK + 1
        self.taken.append(rank)
        return rank

    def handed_out(self) -> list[int]:
        return list(self.taken)

    @classmethod
    def start(cls, ray, out: Out) -> Any:
        return ray.remote(num_cpus=0)(cls).remote(out.highest_rank() % MAX_RANK + 1)


def _map_batches_bounded(ds, fn, **kwargs):
    """``ds.map_batches`` with a model actor restarted, and its call retried, at most 3 times (Ray Data's
    default, forever, loops on a batch that kills its actor). Ray 2.60 deprecates every way to say so; if
    a later Ray drops ``ray_remote_args_fn``, its defaults apply."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
        try:
            return ds.map_batches(
                fn, ray_remote_args_fn=lambda: {"max_restarts": 3, "max_task_retries": 3}, **kwargs
            )
        except TypeError:
            return ds.map_batches(fn, **kwargs)


def _spend_actor_restart_alarm(ray) -> None:
    """Have Ray's core worker print its actor-restart alarm once, to nowhere, so that it does not print it later.

    For an actor with ``max_restarts > 0`` whose constructor takes an object-store reference, the driver's C++
    core worker writes an ``E`` line to the console, once per process (ray #53727). Every Ray Data actor pool
    is such an actor and keeps that reference for its lifetime, so for vlfast's stages the alarm is false,
    and a C++ log line cannot be filtered. So one such actor is created here while file descriptor 2 points
    at /dev/null, and killed at once. Best effort: if Ray refuses the probe, the line may print.
    """

    @ray.remote(num_cpus=0, max_restarts=1)
    class _Probe:
        def __init__(self, _arg):
            pass

    probe = None
    try:
        arg = ray.put(0)
        sys.stderr.flush()
        saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, 2)
            probe = _Probe.remote(arg)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.close(null)
    except Exception:
        return
    with contextlib.suppress(Exception):
        ray.kill(probe)


def _take_rows(job: Session, rows, actors, unexpected, counted: Counter, added: dict[str, int]) -> None:
    """Count the model actors' rows as they come, until the dataset ends or ``max_errors`` is passed."""
    summary = job.summary
    for row in rows:
        summary.compute_seconds += row["compute_s"] or 0.0
        summary.oom_splits += row["oom_splits"] or 0
        actors.take(row)
        if row["status"] == "unexpected":
            job.bar.update(samples=1)
            trace = row["reason"]
            unexpected.add(row["id"], "", trace.strip().splitlines()[-1], trace)
            continue
        unexpected.other()
        if row["status"] == "ok":
            if row["id"] not in added:
                job.bar.update(samples=1, tokens=row["patches"])
            added[row["id"]] = row["patches"]
        elif row["status"] == "error":
            counted[row["reason"]] += 1
            job.count_error(row["reason"])
            if job.over_max_errors():
                return


def _count_from_out(
    job: Session, recorded_before, counted: Counter, added: dict[str, int], to_extract_ids, done
):
    """The summary's counts from what OUT holds, not from the rows: an actor killed after committing but
    before returning its rows is restarted, and its retried call finds those samples done."""
    errors_now = job.plan.store.errors()
    recorded = Counter(r["reason"] for r in errors_now if error_key(r) not in recorded_before)
    for reason in (recorded - counted).elements():
        job.count_error(reason)
    # Only this run's records: one from before that --retry-errors selected is superseded by the commit.
    failed = IdSet({r["id"] for r in errors_now if error_key(r) not in recorded_before and done_by_error(r)})
    extracted = done.isin(to_extract_ids) & ~failed.isin(to_extract_ids)
    job.summary.extracted = int(extracted.sum())
    to_extract = IdSet(to_extract_ids)
    job.summary.tokens = sum(p for i, p in added.items() if i in to_extract and i in done and i not in failed)


class RayEngine:
    """Ray Data stages in place of a model in this process (see the module's docstring).

    ``address``: the cluster (``ray://head:10001``, ``head:6379``, ``auto``); default ``RAY_ADDRESS``, else a
    cluster started with ``ray start`` on this machine, else a local one for the run. ``workers`` model
    actors, each with ``gpus_per_worker`` GPUs (default 1 when the device is CUDA, else 0) and
    ``cpus_per_worker`` CPUs. ``quiet``: keep Ray's false actor-restart alarm off the console
    (``_spend_actor_restart_alarm``; the CLI sets it unless ``--verbose``).
    """

    name = "ray"
    hooks = Hooks()  # tests only

    def __init__(
        self,
        address: str | None = None,
        workers: int = 1,
        gpus_per_worker: float | None = None,
        cpus_per_worker: float = 1.0,
        hooks: Hooks | None = None,
        quiet: bool = False,
    ):
        if not isinstance(workers, int) or workers < 1:
            raise InputRefused(f"--ray-workers must be >= 1 (ray_workers: model actors), got {workers!r}")
        if gpus_per_worker is not None and not gpus_per_worker >= 0:
            raise InputRefused(
                f"--num-gpus-per-worker must be >= 0 (num_gpus_per_worker), got {gpus_per_worker:g}"
            )
        if not cpus_per_worker > 0:
            raise InputRefused(
                f"--ray-cpus-per-worker must be > 0 (cpus_per_worker), got {cpus_per_worker:g}"
            )
        self.address, self.workers, self.cpus = address, workers, float(cpus_per_worker)
        self.gpus_asked = gpus_per_worker
        self.quiet = quiet
        self.gpus = 0.0 if gpus_per_worker is None else float(gpus_per_worker)
        if hooks is not None:
            self.hooks = hooks
        self.stage_env: dict[str, Any] | None = None
        self._counters: list[Any] = []  # this run's rank counters (object storage): whose parts to compact

    def configure(self, config: ExtractConfig) -> ExtractConfig:
        """The driver is rank 0 of one; the device follows the GPUs asked for (the model actors' machines
        must have it). A missing Ray is a usage error here, before anything is read."""
        if config.rank is not None or config.world_size is not None:
            raise InputRefused(
                "--rank/--world-size (rank, world_size) split the input between processes you launch; with "
                "--engine ray the actors share it: drop them, or use --engine local"
            )
        if config.num_workers is not None and config.num_workers < 1:
            raise InputRefused(
                f"with --engine ray, --workers is the number of decode actors (num_workers): >= 1, got "
                f"{config.num_workers}"
            )
        device = config.device
        wants_cuda = device is not None and config.torch_device.type == "cuda"
        gpus = self.gpus if self.gpus_asked is not None else (1.0 if wants_cuda else 0.0)
        if device is None:
            device = "cuda" if gpus > 0 else "cpu"
        elif gpus > 0 and not wants_cuda:
            raise InputRefused(f"num_gpus_per_worker={gpus:g} needs device cuda, got {device!r}")
        elif wants_cuda and gpus == 0:
            raise InputRefused(
                "device cuda needs GPUs on the model actors: num_gpus_per_worker >= 1 (--num-gpus-per-worker)"
            )
        self.gpus = gpus
        _import_ray()
        return dataclasses.replace(config, device=device, rank=0, world_size=1)

    def run(self, plan: RunPlan, config: ExtractConfig) -> ExtractSummary:
        summary = run_session(plan, config, self._session)
        summary.engine = "ray"
        summary.cpu_seconds = None  # the actors' CPU time is spent in other processes, on other machines
        return summary

    def _session(self, job: Session) -> None:
        ray = _import_ray()
        t0 = time.perf_counter()
        started = not ray.is_initialized()
        if started:
            ray.init(
                address=self.address,
                include_dashboard=False,
                logging_level=logging.WARNING,
                runtime_env={"env_vars": ENV},
            )
        # The workers need ENV before torch loads in them: set per stage when the caller's Ray lacks it.
        job_env = (ray.get_runtime_context().runtime_env or {}).get("env_vars") or {}
        if any(job_env.get(k) != v for k, v in ENV.items()):
            self.stage_env = {"env_vars": ENV}
        if self.quiet:
            _spend_actor_restart_alarm(ray)
        ray.data.DataContext.get_current().enable_progress_bars = False  # the driver shows its own bar
        logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)  # ... and says so
        job.model_built(time.perf_counter() - t0, None)
        # ray.init made SIGTERM exit at once: here it unwinds like Ctrl-C, so the actors get time to commit.
        previous = None
        if started and threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, sigterm_handler())
        try:
            self._extract(ray, job)
        finally:
            if started:
                ray.shutdown()
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def _extract(self, ray, job: Session) -> None:
        summary = job.summary
        self._counters.clear()  # an engine run again: counters of a cluster since shut down
        # Model actors of an earlier run may outlive their killed driver and still commit: wait them out.
        held = sorted(r for r in job.plan.store.live_ranks() if r != job.store.rank)
        stale = self._wait_released(job, held, RANK_WAIT_S)
        if stale:
            raise OutputInUse(
                f"ranks {stale} of {job.store.out} are still held by live processes after {RANK_WAIT_S:g} s: "
                "another job writes this OUT, or actors of an earlier one have not exited; wait or stop them"
            )
        done = job.store.done_ids()
        todo = SampleTable.of(job.todo)
        remaining = todo.take(np.flatnonzero(~done.isin(todo.ids)))  # columns, not a Sample per entry
        summary.skipped += len(todo) - len(remaining)
        to_extract_ids = remaining.ids
        recorded_before = job.plan.store.error_keys()
        counted: Counter[str] = Counter()  # reasons of the error rows the driver saw
        added: dict[str, int] = {}  # id -> patches, of samples a model actor added (buffered or committed)
        actors = _ActorFacts()
        unexpected = UnexpectedErrors(summary)
        for attempt in range(MAX_PASSES):
            if not remaining:
                break
            if attempt:
                warnings.warn(
                    f"{len(remaining)} samples were lost with a model actor that died before committing them; "
                    "extracting them again",
                    RuntimeWarning,
                    stacklevel=2,
                )
            rows = iter(self._dataset(ray, job, remaining).iter_rows())
            try:
                _take_rows(job, rows, actors, unexpected, counted, added)
            except KeyboardInterrupt:  # SIGTERM (Terminated) or Ctrl-C: let the actors commit, then go
                self._close(rows)
                self._wait_for_actors(
                    job,
                    TERM_WAIT_S,
                    "the stop: what their actors had not committed is extracted again by the next run",
                )
                raise
            finally:
                self._close(rows)  # stops the dataset; its actors exit, committing what they hold
            # Also after --max-errors: an actor with a call in flight holds samples no row has named yet.
            self._wait_for_actors(
                job,
                RELEASE_WAIT_S,
                "the dataset ended: what their actors had not committed yet is counted as missing",
            )
            done = job.store.done_ids()
            # A sample whose decoding hit a bug is not done, but not lost either: the next run retries it.
            keep = ~done.isin(remaining.ids)
            if unexpected.ids:
                keep &= ~IdSet(unexpected.ids).isin(remaining.ids)
            remaining = remaining.take(np.flatnonzero(keep))
            if summary.stopped:
                break
        self._compact_actor_ranks(ray, job)
        _count_from_out(job, recorded_before, counted, added, to_extract_ids, done)
        summary.load_seconds += actors.load_s
        if remaining and not summary.stopped:
            summary.stopped = (
                f"{len(remaining)} samples were lost with model actors that died before committing them, "
                f"{MAX_PASSES} times; run the same command again to extract them"
            )

    def _dataset(self, ray, job: Session, samples: SampleTable):
        import pyarrow as pa

        sample_schema = _schemas()[0]
        step = 1 << 16
        table = pa.Table.from_batches(
            [
                pa.RecordBatch.from_pylist(
                    [_sample_row(s) for s in samples[k : k + step]], schema=sample_schema
                )
                for k in range(0, len(samples), step)
            ],
            schema=sample_schema,
        )
        # Blocks of a few calls each, at most ~2,000 of them: enough to spread over the decode actors.
        rows = max(DECODE_BATCH, -(-len(samples) // 2000))
        blocks = [table.slice(k, rows) for k in range(0, len(samples), rows)]
        if job.config.num_workers is not None:
            decoders = ray.data.ActorPoolStrategy(size=job.config.num_workers)
        else:
            free = int(ray.cluster_resources().get("CPU", 1) - self.workers * self.cpus)
            decoders = ray.data.ActorPoolStrategy(min_size=1, max_size=max(1, free))
        # Decoding is stateless: a decode actor lost to a node failure is replaced and its call re-run.
        decoded = ray.data.from_arrow(blocks).map_batches(
            _Decode,
            batch_size=DECODE_BATCH,
            batch_format="pyarrow",
            compute=decoders,
            num_cpus=1,
            runtime_env=self.stage_env,
            fn_constructor_kwargs=dict(
                config=job.config,
                family=job.plan.family,
                cfg=job.plan.processor,
                images=samples.has_kind("image"),
                decode_hook=self.hooks.decode,
            ),
        )
        # The driver's store has just checked OUT as asked: each actor re-checks sizes and headers only.
        store_options, counter = job.config.writing(resume_check="quick", overwrite=False), None
        if not is_local(job.store.out):
            # An actor's close may be cut short by its teardown (no lock tells): the driver compacts them.
            store_options["compact_min_parts"] = None
            counter = _RankCounter.start(ray, job.plan.store)
            self._counters.append(counter)
        return _map_batches_bounded(
            decoded,
            _ModelStage,
            batch_size=job.config.budget.max_samples,
            batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(size=self.workers),
            num_cpus=self.cpus,
            num_gpus=self.gpus or None,
            runtime_env=self.stage_env,
            fn_constructor_kwargs=dict(
                config=job.config,  # not the plan: its sample table stays on the driver
                family=job.plan.family,
                cfg=job.plan.processor,
                out=job.store.out,  # a Path, or a UPath carrying its storage options
                run_config=job.plan.run_config,
                volatile_keys=tuple(job.plan.volatile_keys),
                store_options=store_options,
                ranks=list(range(1, self.workers + 1)) if is_local(job.store.out) else None,
                rank_counter=counter,
                hook=self.hooks.forward,
                bits_probe=self.hooks.bits_probe,
            ),
        )

    def _compact_actor_ranks(self, ray, job: Session) -> None:
        """On object storage: compact the index parts of the ranks this job's model actors wrote (one part
        per call), so that opening OUT reads a part per rank. A failure leaves the parts for
        ``vlfast out compact OUT`` (or the next run)."""
        from vlfast.extraction.store.compact import compact_folder

        ranks = sorted({r for c in self._counters for r in ray.get(c.handed_out.remote())})
        self._counters.clear()
        if not ranks:
            return
        try:
            compact_folder(job.store.out, ranks=ranks)
        except Exception as e:  # the samples are committed: compaction only makes OUT quicker to open
            warnings.warn(
                f"the model actors' index parts of {job.store.out} were not compacted ({e}); "
                "`vlfast out compact OUT` does it",
                RuntimeWarning,
                stacklevel=2,
            )

    @staticmethod
    def _close(rows) -> None:
        close = getattr(rows, "close", None)
        if close is not None:
            close()

    def _wait_for_actors(self, job: Session, timeout: float, after: str) -> None:
        """Wait for the model actors to release their ranks; warn if some are held ``timeout`` s ``after``."""
        if self._wait_released(job, range(1, self.workers + 1), timeout):
            warnings.warn(
                f"model ranks of {job.store.out} are still held {timeout:g} s after {after}",
                RuntimeWarning,
                stacklevel=3,
            )

    @staticmethod
    def _wait_released(job: Session, ranks: Collection[int], timeout: float) -> list[int]:
        """Wait until no process holds these ranks of OUT; the ranks still held after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        for k, rank in enumerate(sorted(ranks)):
            while job.plan.store.rank_is_held(rank):
                if time.monotonic() > deadline:
                    return sorted(ranks)[k:]
                time.sleep(0.1)
        return []
