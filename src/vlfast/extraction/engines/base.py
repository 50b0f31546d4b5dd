"""The one seam between ``extract`` and where the model runs: the :class:`Engine` protocol, and what every
engine shares once OUT is locked (:func:`run_session`): the store, the error records the plan calls for,
the counts of the summary, the progress bar, ``--max-errors`` and the stop on repeated unexpected errors."""

from __future__ import annotations

import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from vlfast.extraction.config import ExtractConfig, ExtractSummary
from vlfast.extraction.plan import RunPlan

if TYPE_CHECKING:  # pragma: no cover
    from vlfast.extraction.sources.sample import Sample

__all__ = [
    "UNEXPECTED_IN_A_ROW",
    "Engine",
    "Hooks",
    "Progress",
    "Session",
    "UnexpectedErrors",
    "UnexpectedSampleErrors",
    "cpu_bits_problem",
    "cpu_seconds",
    "run_session",
]

# Samples in a row whose decoding raised an unexpected exception (a bug, not bad media) before the run
# stops: a regression fails every sample it touches, while two unlucky neighbours should not stop a run.
UNEXPECTED_IN_A_ROW = 3


@runtime_checkable
class Engine(Protocol):
    """Where and how the model runs over a plan. ``extract`` calls ``configure`` first (the engine's own
    defaults and refusals, before anything is read), then, unless OUT already holds everything, ``run``."""

    name: str  # the summary's ``engine``: "local", "ray"

    def configure(self, config: ExtractConfig) -> ExtractConfig: ...

    def run(self, plan: RunPlan, config: ExtractConfig) -> ExtractSummary: ...


@dataclass(frozen=True)
class Hooks:
    """Test seams, not options: ``decode(sample)`` runs before each sample is decoded (where it is decoded),
    ``forward(batch)`` before each forward, with the batch's
    :class:`~vlfast.extraction.decode.stage.DecodedSample` s on the CPU; ``bits_probe`` stands in for
    :func:`vlfast.numerics.threads_keep_their_bits`. Set on an engine or on its class."""

    forward: Callable[[list[Any]], None] | None = None
    decode: Callable[[Sample], None] | None = None
    bits_probe: Callable[[], bool] | None = None


class UnexpectedSampleErrors(RuntimeError):
    """``UNEXPECTED_IN_A_ROW`` samples in a row failed to decode with an unexpected exception: a bug, not bad
    media. The run stops (what is committed stays) instead of recording every sample as failed."""


class UnexpectedErrors:
    """Samples whose decoding raised something other than a media problem: counted in the summary, warned
    about, never recorded (a record would make them done); ``UNEXPECTED_IN_A_ROW`` in a row stop the run."""

    def __init__(self, summary: ExtractSummary):
        self.summary, self.in_a_row = summary, 0
        self.ids: set[str] = set()

    def other(self) -> None:
        """A sample came back extracted or recorded: the run of unexpected errors is broken."""
        self.in_a_row = 0

    def add(self, sample_id: str, source: str, reason: str, trace: str | None) -> None:
        self.ids.add(sample_id)
        self.summary.unexpected = len(self.ids)  # a call Ray retried may bring a sample back twice
        self.in_a_row += 1
        where = f"{sample_id!r} ({source})" if source else repr(sample_id)
        if self.in_a_row >= UNEXPECTED_IN_A_ROW:
            raise UnexpectedSampleErrors(
                f"{self.in_a_row} samples in a row failed with an unexpected error, the last {where}: a bug "
                "in vlfast or a library it calls, not bad media, so nothing was recorded for them; committed "
                f"work is kept. Fix it (or report it with this traceback), then run the same command.\n"
                f"{trace or reason}"
            )
        warnings.warn(
            f"sample {where} failed with an unexpected error ({reason}): not recorded, the next run tries it "
            "again",
            RuntimeWarning,
            stacklevel=2,
        )


def cpu_bits_problem(bits_probe: Callable[[], bool] | None = None) -> str | None:
    """Why this process's CPU products may give a sample other bits in a resume, another rank or a Ray actor
    than in this run (docs/extract.md, "What vlfast guarantees"), or None: ``MKL_CBWR`` not set before torch
    loaded MKL, or a product whose bits change with the thread count (``bits_probe``, by default
    :func:`vlfast.numerics.threads_keep_their_bits`). For a CPU run only; tens of milliseconds."""
    import os

    import torch

    if "MKL_CBWR" not in os.environ and torch.backends.mkl.is_available():
        return (
            "MKL picks its summation order by thread count and batch: without MKL_CBWR=AUTO,STRICT set "
            "before torch is imported (`vlfast extract` sets it), a sample's features can differ in their "
            "last bits between this run and a resume with other workers or threads, a torchrun rank or a "
            "Ray actor; see docs/extract.md"
        )
    if bits_probe is None:
        from vlfast.numerics import threads_keep_their_bits as bits_probe
    if not bits_probe():
        return (
            "this CPU's products give other bits at another thread count, even with "
            f"MKL_CBWR={os.environ.get('MKL_CBWR', '')} (MKL's strict mode covers its code for Intel CPUs, "
            "not AMD's): a sample's features can differ in their last bits between this run and a resume at "
            "another thread count, a torchrun rank or a Ray actor (one thread each); keep OMP_NUM_THREADS "
            "the same; see docs/extract.md"
        )
    return None


def cpu_seconds() -> float | None:
    """CPU time of this process plus its reaped children (the decode workers); None off Unix."""
    try:
        import resource
    except ImportError:
        return None
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class Progress:
    """A rich progress bar with samples/s, tokens/s, ETA and the error count; silent when disabled."""

    def __init__(self, enabled: bool, total: int, label: str):
        self.enabled = enabled and total > 0
        self.started = time.perf_counter()
        self.tokens = self.errors = self.done = 0
        self._done_before = 0  # entries counted before the clock started (records made before the model)
        if not self.enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeRemainingColumn(),
            TextColumn("[red]{task.fields[errors]}"),
            transient=False,
        )
        self.task = self.bar.add_task(label, total=total, rate="", errors="")
        self.bar.start()

    def update(self, samples: int = 0, tokens: int = 0, errors: int = 0) -> None:
        self.done += samples
        self.tokens += tokens
        self.errors += errors
        if not self.enabled:
            return
        dt = max(time.perf_counter() - self.started, 1e-9)
        rate = f"{(self.done - self._done_before) / dt:.2f} samples/s  {self.tokens / dt:,.0f} tokens/s"
        errs = f"{self.errors} errors" if self.errors else ""
        self.bar.update(self.task, advance=samples, rate=rate, errors=errs)

    def restart_clock(self) -> None:
        """Rates from now on: the model has been built (its build is not the run's speed, as in the summary)."""
        self.started = time.perf_counter()
        self._done_before = self.done

    def close(self) -> None:
        if self.enabled:
            self.bar.stop()


class Session:
    """One rank's run of a plan, OUT locked by ``store``: what an engine extracts (``todo``) and how it
    reports back. Every error this rank records goes through ``record``; one another process recorded
    through its own store (a Ray model actor) is counted with ``count_error``."""

    def __init__(self, plan: RunPlan, config: ExtractConfig, store, summary: ExtractSummary, bar: Progress):
        self.plan, self.config, self.store, self.summary, self.bar = plan, config, store, summary, bar
        self.todo: Sequence[Sample] = ()  # a SampleTable once planned
        self.errors: Counter[str] = Counter()
        self.recorded_elsewhere = 0
        self.cpu_excluded = 0.0  # CPU seconds outside the run's own time (the model build)

    def record(self, sample_id: str, source: str, reason: str, kind: str | None = None) -> None:
        """Record an error once; the summary, the progress bar and --max-errors all count it."""
        before = self.store.num_errors
        self.store.add_error(sample_id, source, reason, kind=kind)
        if self.store.num_errors > before:
            self._count(reason)

    def count_error(self, reason: str) -> None:
        """Count an error another engine's process recorded through its own store."""
        self.recorded_elsewhere += 1
        self._count(reason)

    def _count(self, reason: str) -> None:
        from vlfast.extraction.store.format import reason_kind

        self.errors[reason_kind(reason)] += 1
        self.bar.update(samples=1, errors=1)

    def errors_so_far(self) -> int:
        """This run's records, here and elsewhere (for --max-errors)."""
        return self.store.num_errors + self.recorded_elsewhere

    def over_max_errors(self) -> bool:
        """Past --max-errors: sets the summary's ``stopped`` (once) and says so."""
        limit = self.config.max_errors
        if limit is None or self.errors_so_far() <= limit:
            return False
        self.summary.stopped = self.summary.stopped or f"more than {limit} errors (--max-errors)"
        return True

    def model_built(self, seconds: float, cpu: float | None) -> None:
        """The model took ``seconds`` (and ``cpu`` CPU seconds) to build: not the run's own time."""
        self.summary.load_seconds += seconds
        self.cpu_excluded += cpu or 0.0
        self.bar.restart_clock()


@contextmanager
def _opened_store(plan: RunPlan, config: ExtractConfig) -> Iterator[Any]:
    from vlfast.extraction.interrupts import sigterm_like_sigint
    from vlfast.extraction.store.writer import FeatureStore

    # From here on SIGTERM unwinds like Ctrl-C: the store commits what is done on the way out.
    with (
        sigterm_like_sigint(),
        FeatureStore(
            plan.out,
            plan.run_config,
            rank=plan.rank,
            world_size=plan.world_size,
            volatile_keys=plan.volatile_keys,
            stale=plan.changed,
            **config.writing(),
        ) as store,
    ):
        yield store


def run_session(
    plan: RunPlan, config: ExtractConfig, extract_todo: Callable[[Session], None]
) -> ExtractSummary:
    """Lock OUT (this rank's FeatureStore), record what the plan calls for, then let ``extract_todo`` (the
    engine) extract ``session.todo``; fill in the summary's counts and times whatever happens."""
    summary = plan.summary(config)
    started, cpu_started = time.perf_counter(), cpu_seconds()
    with _opened_store(plan, config) as store:
        store.keep_listings(plan.listings)  # now that OUT is this run's: never written by a refused run
        plan.listings.clear()  # a kept manifest table holds the whole input's columns until it is written
        if plan.facts is not None:  # what transformers answered, for a later run to answer without it
            store.keep_facts(plan.facts)
        summary.quarantined = [q["part"] for q in store.quarantined]
        summary.changed = len(plan.changed)  # their shards are moved aside (store.superseded), so not done
        done = store.done_ids(mine=True)
        todo, records = plan.work(done)
        pending = plan.pending(done, store.is_recorded, (todo, records))
        del done  # it shares the store's arrays as they were (170 MB at 10M ids), which the store outgrows
        summary.skipped = plan.assigned - pending
        label = f"extract r{plan.rank}" if plan.world_size > 1 else "extract"
        session = Session(plan, config, store, summary, Progress(config.progress, pending, label))
        try:
            for rec in records:
                session.record(*rec)
            session.todo = todo
            if not session.over_max_errors() and todo:
                extract_todo(session)
        finally:
            session.bar.close()
            summary.errors = dict(session.errors)
            summary.failed = session.errors_so_far()
            summary.seconds = time.perf_counter() - started - summary.load_seconds
            cpu_now = cpu_seconds()
            if cpu_now is not None and cpu_started is not None:
                summary.cpu_seconds = cpu_now - cpu_started - session.cpu_excluded
    return summary
