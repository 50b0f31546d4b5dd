"""The local engine: the model in this process, decoding in its worker pool; under torchrun or a Slurm
array each rank is one such process with its share of the input.

Per rank::

    plan (inputs, run configuration, OUT checked) -> FeatureStore (lock; damaged shards moved aside)
      -> model -> worker processes: decode + the model's own preprocessing (errors, dead and hung workers
         come back as records) -> pack by token budget (no padding: the tower takes one flat patch sequence)
      -> forward (convs patched; an out-of-memory batch is split and retried)
      -> FeatureStore (atomic shard commits by size or every ``commit_every`` seconds, errors file)

Torch, the model and the decode pool are imported once there is work (:meth:`LocalEngine.run`), so a
finished OUT on the CPU is answered without importing torch.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

from vlfast.errors import InputRefused
from vlfast.extraction.config import ExtractConfig, ExtractSummary, device_problem
from vlfast.extraction.engines.base import (
    Hooks,
    Session,
    UnexpectedErrors,
    cpu_bits_problem,
    cpu_seconds,
    run_session,
)
from vlfast.extraction.interrupts import raise_if_terminated
from vlfast.extraction.plan import RunPlan

if TYPE_CHECKING:  # pragma: no cover
    from vlfast.extraction.decode.stage import DecodedSample
    from vlfast.extraction.model import runner

__all__ = ["LocalEngine"]


class LocalEngine:
    """This process and its decode workers (see the module's docstring)."""

    name = "local"
    hooks = Hooks()  # tests only

    def __init__(self, hooks: Hooks | None = None):
        if hooks is not None:
            self.hooks = hooks

    def configure(self, config: ExtractConfig) -> ExtractConfig:
        """The device must exist here: refused (exit 2, naming --device) before OUT is written."""
        problem = device_problem(config.device_name)
        if problem is not None:
            raise InputRefused(f"--device {config.device}: {problem}; use another --device or leave it out")
        return config

    def cpu_warnings(self, config: ExtractConfig) -> None:
        """Warn of what makes a CPU run slower or its bits depend on the batch (imports torch; tens of ms)."""
        if config.device_type != "cpu":
            return
        import torch

        if config.workers > 0 and torch.get_num_threads() > 1 and "OMP_WAIT_POLICY" not in os.environ:
            warnings.warn(
                "torch's idle OpenMP threads spin on the cores the decode workers need: set "
                "OMP_WAIT_POLICY=PASSIVE before torch is imported (`vlfast extract` does) for ~1.3x faster "
                "preprocessing-bound runs; see docs/extract.md",
                RuntimeWarning,
                stacklevel=2,
            )
        problem = cpu_bits_problem(self.hooks.bits_probe)
        if problem is not None:
            warnings.warn(problem, RuntimeWarning, stacklevel=2)

    def run(self, plan: RunPlan, config: ExtractConfig) -> ExtractSummary:
        return run_session(plan, config, self._extract)

    def _extract(self, session: Session) -> None:
        from vlfast.extraction.model import runner

        config, plan = session.config, session.plan
        self.cpu_warnings(config)
        t0, cpu0 = time.perf_counter(), cpu_seconds()
        loaded = runner.load(
            config.model,
            plan.family,
            config.spec,
            config.torch_device,
            config.torch_dtype,
            config.patch_convs,
        )
        cpu1 = cpu_seconds()
        session.model_built(time.perf_counter() - t0, None if cpu0 is None or cpu1 is None else cpu1 - cpu0)
        _Extraction(session, loaded, self.hooks).run()


class _Extraction:
    """The todo list through the worker pool and the model, into the session's store."""

    def __init__(self, session: Session, loaded: runner.LoadedModel, hooks: Hooks):
        from vlfast.extraction.decode.stage import SampleDataset, prepare_decoding
        from vlfast.extraction.model import runner

        config, plan = session.config, session.plan
        self.session, self.todo = session, session.todo
        pre, prompts = prepare_decoding(
            loaded.spec,
            loaded.family,
            plan.processor,
            config.spec.needs_llm,
            self.todo.has_kind("image"),
            embedding=config.spec.embedding_prompt(),
        )
        self.dataset = SampleDataset(self.todo, pre, prompts, config.spec.prompt, hooks.decode)
        self.forward = runner.Forward(
            loaded, config.spec, plan.processor, config.stored_as, prompts, hooks.forward
        )
        self.unexpected = UnexpectedErrors(session.summary)

    def decoded(self, pool) -> Iterator[DecodedSample]:
        """The samples that decoded; failures recorded (or counted, when unexpected) on the way."""
        from vlfast.extraction.decode.stage import DecodedSample

        session = self.session
        for item in pool:
            session.store.tick()  # a slow stretch of decoding still commits what is buffered
            if isinstance(item, DecodedSample):
                self.unexpected.other()
                yield item
                continue
            sample = self.todo[item["i"]]
            if item.get("unexpected"):
                session.bar.update(samples=1)
                self.unexpected.add(sample.id, sample.source, item["reason"], item.get("traceback"))
                continue
            self.unexpected.other()
            session.record(sample.id, sample.source, item["reason"])
            if session.over_max_errors():
                return

    def run(self) -> None:
        from vlfast.extraction.decode.stage import worker_init
        from vlfast.extraction.decode.workers import WorkerPool
        from vlfast.extraction.model import runner

        session, summary, config = self.session, self.session.summary, self.session.config
        try:
            with WorkerPool(
                self.dataset.__getitem__,
                len(self.dataset),
                num_workers=config.workers,
                timeout=config.decode_timeout,
                prefetch=8,
                worker_init=worker_init,
            ) as pool:
                padded = config.spec.needs_llm
                for batch in runner.batches(self.decoded(pool), config.budget, True, padded):
                    raise_if_terminated()  # a SIGTERM whose exception a fork hook dropped
                    added = self.forward.store(
                        batch, session.store, lambda it: self.todo[it.i], session.record
                    )
                    for _, patches in added:
                        summary.extracted += 1
                        summary.tokens += patches
                        session.bar.update(samples=1, tokens=patches)
                    if session.over_max_errors():
                        break
        finally:
            summary.compute_seconds += self.forward.compute_seconds
            summary.oom_splits += self.forward.oom_splits
