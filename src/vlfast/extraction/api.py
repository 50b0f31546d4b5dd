"""``extract``: run a model over images and videos and store per-sample features, resumably.

Validate once (:class:`~vlfast.extraction.config.ExtractConfig`), plan (:mod:`~vlfast.extraction.plan`,
which reads only: bad input, a different configuration or a finished OUT are answered before a lock is taken
or a model is built), dispatch to an engine (:mod:`~vlfast.extraction.engines`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from vlfast.extraction.config import ExtractConfig, ExtractSummary, default_batch_tokens, default_num_workers
from vlfast.extraction.engines.base import UNEXPECTED_IN_A_ROW, Engine, UnexpectedSampleErrors
from vlfast.extraction.plan import make_plan
from vlfast.extraction.sources.sample import Sample

__all__ = [
    "UNEXPECTED_IN_A_ROW",
    "Engine",
    "ExtractConfig",
    "ExtractSummary",
    "UnexpectedSampleErrors",
    "default_batch_tokens",
    "default_num_workers",
    "engine_named",
    "extract",
    "extract_ray",
]


def engine_named(engine: str | Engine) -> Engine:
    """The engine ``--engine`` names ("local", "ray" with its defaults), or the one given."""
    if not isinstance(engine, str):
        return engine
    if engine == "local":
        from vlfast.extraction.engines.local import LocalEngine

        return LocalEngine()
    if engine == "ray":
        from vlfast.extraction.engines.ray import RayEngine

        return RayEngine()
    raise ValueError(f"engine must be 'local', 'ray' or an Engine, got {engine!r}")


def extract(
    inputs: str | os.PathLike | Sequence[Sample],
    out: str | os.PathLike,
    *,
    engine: str | Engine = "local",
    **options: Any,
) -> ExtractSummary:
    """Extract ``features`` of every sample in ``inputs`` with ``model`` into the folder ``out``.

    ``options`` are :class:`~vlfast.extraction.config.ExtractConfig`'s fields: ``model`` (a checkpoint
    directory, or ``ref:NAME``: vision features only, random weights), ``features``, ``layers``, ``pools``,
    ``prompt``, ``device``, ``dtype``, ``store_dtype``, ... ``inputs`` is a folder (images and videos,
    recursive), a manifest (.jsonl/.csv/.parquet with ``path`` and optional ``id``, ``prompt``), WebDataset
    tar shards (``"shards/{000000..000099}.tar"``; ids ``{shard}/{__key__}``), or a list of
    :class:`Sample`; it and ``out`` may be fsspec URLs (``s3://bucket/key``, with ``storage_options``).

    ``engine``: "local" (this process and its decode workers; under ``torchrun`` each rank takes its share, or
    pass ``rank``/``world_size``), "ray" (:func:`extract_ray`), or an :class:`Engine`. Running the same call
    again skips what ``out`` holds, after checking it (``resume_check``: "full" hashes every committed tensor,
    "quick" checks sizes and headers); damaged shards are moved aside (quarantined, never deleted) and redone;
    a different configuration or different weights are refused with :class:`RunConfigMismatch` before the
    model loads. Bad samples and input rows, and decoders that crashed or ran past ``decode_timeout`` seconds,
    are recorded in ``out/errors`` (past ``max_errors`` the run stops); a transient read failure is recorded
    with kind "transient" and tried again by the next run, and so are recorded ones ``retry_errors`` selects.
    A sample whose decoding hits a bug is not recorded (``summary.unexpected``); ``UNEXPECTED_IN_A_ROW`` in a
    row raise :class:`UnexpectedSampleErrors`. Work is committed at least every ``commit_every`` seconds, and
    on SIGTERM or Ctrl-C, which then raise :class:`~vlfast.extraction.interrupts.Terminated` or
    ``KeyboardInterrupt``. See docs/extract.md.
    """
    runner = engine_named(engine)
    config = runner.configure(ExtractConfig(**_known(options)))
    plan = make_plan(inputs, out, config)
    finished = plan.finished(config)
    if finished is not None:
        finished.engine = runner.name
        return finished
    return runner.run(plan, config)


def _known(options: dict[str, Any]) -> dict[str, Any]:
    """``options``, once each name is one of ExtractConfig's: a misspelt keyword is named with its fix."""
    import dataclasses
    import difflib

    fields = [f.name for f in dataclasses.fields(ExtractConfig) if f.init]
    for name in options:
        if name not in fields:
            close = difflib.get_close_matches(name, fields, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; the options are {', '.join(fields)}"
            raise TypeError(f"extract() got an unexpected keyword argument {name!r}{hint}")
    return options


def extract_ray(
    inputs: str | os.PathLike | Sequence[Sample],
    out: str | os.PathLike,
    *,
    ray_address: str | None = None,
    ray_workers: int = 1,
    num_gpus_per_worker: float | None = None,
    cpus_per_worker: float = 1.0,
    **options: Any,
) -> ExtractSummary:
    """:func:`extract` on a Ray cluster (:class:`~vlfast.extraction.engines.ray.RayEngine`); the same
    keyword arguments (``options``).

    ``ray_address``: the cluster (``ray://head:10001``, ``head:6379``, ``auto``); default ``RAY_ADDRESS``,
    else a cluster started with ``ray start`` on this machine, else a local one for this call (shut down
    at the end). ``ray_workers`` model actors, each with ``num_gpus_per_worker`` GPUs (default 1 when
    ``device`` is CUDA, else 0) and ``cpus_per_worker`` CPUs. ``num_workers`` decode actors (1 CPU each;
    default: as many as the cluster's free CPUs allow). Without a GPU the device defaults to CPU; with
    GPUs, to CUDA (bfloat16), whatever the driver machine has. ``rank``/``world_size`` are refused. OUT
    must be a folder every node sees (whose ``flock`` works across nodes when actors run on several), or
    an fsspec URL (``s3://bucket/out``, with ``storage_options``): then each model actor takes a fresh rank
    and commits at the end of each call.
    """
    from vlfast.extraction.engines.ray import RayEngine

    engine = RayEngine(ray_address, ray_workers, num_gpus_per_worker, cpus_per_worker)
    return extract(inputs, out, engine=engine, **options)
