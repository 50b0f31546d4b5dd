"""What ran: per patched conv, how many calls took the GEMM and how many the stock conv, and why.

The proof a user can get from inside their own launcher (HF Trainer, DeepSpeed, FSDP, torchrun):
``VLFAST_RECORD=1`` prints it at exit, per rank; ``VLFAST_RECORD=PATH`` also appends one JSON line per
process to ``PATH``, a regular file or none yet (anything else is refused with one line at start, and never
opened in a way that could hold the exit). :func:`record_calls` counts between two points.

The record covers the whole process, also the eligible Conv3d vlfast did not patch and the convs whose
class ``forward`` was replaced (a global module forward pre-hook, only while a record runs). Calls inside a
``torch.compile``'d graph are not counted. Imports neither torch nor transformers (the ``.pth`` file arms it
at start-up); the image processor's calls are counted in :mod:`vlfast.pixels.adapter`, read here.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import stat
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ENV_VAR", "CallRecord", "ConvCalls", "install_from_env", "record_calls"]

from vlfast.switches.env import RECORD_VAR, env_setting, record_setting

ENV_VAR = RECORD_VAR
_lock = threading.Lock()
env_armed = False  # VLFAST_RECORD asked for counting from start-up to exit
_env_target = "1"  # where it reports: "1" (stderr) or a file's path
_finalizer_pid: int | None = None
_ADAPTER = "vlfast.pixels.adapter"  # where image processor calls are counted (read only once it is loaded)

_NAMES_SHOWN = 8  # eligible convs not patched named in the text (all in to_dict)
_BYPASSED = "vlfast's GEMM not reached, calls not counted"  # gemm.BYPASSED, without importing torch here


@dataclass
class ConvCalls:
    """One conv's calls in a record: through the GEMM, and through the stock conv by reason. ``module_calls``
    are the calls of the module itself; ``replaced`` names the forward assigned to its class that keeps
    them from the GEMM; ``patched`` is False for an eligible conv vlfast did not patch."""

    name: str
    gemm: int = 0
    stock: dict[str, int] = field(default_factory=dict)
    module_calls: int = 0
    replaced: str | None = None
    patched: bool = True

    @property
    def calls(self) -> int:
        return self.gemm + sum(self.stock.values())

    def line(self) -> str:
        if self.replaced is not None and not self.calls:
            n = self.module_calls
            calls = f"{n} call{'s' * (n != 1)} of the module"
            return f"{self.name}: forward replaced by {self.replaced}: {_BYPASSED} ({calls})"
        if not self.calls:
            return f"{self.name}: no call"
        parts = [f"{self.gemm} GEMM"]
        parts += [f"{n} stock ({why})" for why, n in sorted(self.stock.items(), key=lambda kv: -kv[1])]
        return f"{self.name}: " + ", ".join(parts)


def _rank() -> tuple[int | None, int | None]:
    """This process's rank and world size, from the launcher's variables or torch.distributed."""
    for rank_var, size_var in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        rank, size = os.environ.get(rank_var), os.environ.get(size_var)
        if rank is not None and rank.isdigit():
            return int(rank), int(size) if size and size.isdigit() else None
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:  # pragma: no cover - a process group being torn down at exit
        pass
    return None, None


def _in_worker() -> None:
    """At an image processor call under ``VLFAST_RECORD``: a multiprocessing child (a DataLoader worker) ends
    in os._exit, past atexit, so the report is one of its finalizers."""
    global _finalizer_pid
    pid = os.getpid()
    with _lock:
        if not env_armed or _finalizer_pid == pid:
            return
        _finalizer_pid = pid
    mp = sys.modules.get("multiprocessing")
    if mp is not None and mp.parent_process() is not None:
        from multiprocessing import util

        util.Finalize(None, _at_exit, args=(_env_target,), exitpriority=0)


def _image_counts() -> tuple[int, dict[str, int]]:
    adapter = sys.modules.get(_ADAPTER)  # never loaded: no image processor call was answered nor passed on
    return (0, {}) if adapter is None else adapter.image_processor_calls()


def _counts() -> dict[int, tuple[Any, int, dict[str, int], int]]:
    """id(counter) -> (counter, GEMM calls, stock calls by reason, module calls) for every counter
    (``gemm.counters``); nothing when the patch's module was never imported."""
    gemm = sys.modules.get("vlfast.patching.gemm")
    if gemm is None:
        return {}
    return {id(c): (c, c.gemm, dict(c.stock), c.entered) for c in gemm.counters()}


@dataclass
class CallRecord:
    """Calls of patched convs between :func:`record_calls` and :meth:`stop` (or now, while it runs)."""

    _start: dict[int, tuple[Any, int, dict[str, int], int]] = field(default_factory=dict, repr=False)
    _end: dict[int, tuple[Any, int, dict[str, int], int]] | None = field(default=None, repr=False)
    _idle: bool = field(default=False, repr=False)  # list patched convs with no call too (at exit)
    _image_start: tuple[int, dict[str, int]] = field(default=(0, {}), repr=False)
    _image_end: tuple[int, dict[str, int]] | None = field(default=None, repr=False)

    @property
    def running(self) -> bool:
        return self._end is None

    def stop(self) -> CallRecord:
        """Stop counting for this record (others keep theirs); returns the record."""
        if self._end is None:
            self._end = _counts()
            self._image_end = _image_counts()
            _set_recording(-1)
        return self

    def __enter__(self) -> CallRecord:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def convs(self, idle: bool = False) -> list[ConvCalls]:
        """Each patched conv called while the record ran, by its qualified name in the model ``patch``
        was given (convs of the same name, e.g. the same model built twice, summed); ``idle``: also the
        patched convs alive with no call."""
        return [c for c in self._all(idle) if c.patched]

    def unpatched(self) -> list[ConvCalls]:
        """Each eligible Conv3d that vlfast did not patch and that was called while the record ran, named as
        in a model ``patch`` was given, else by its class and a short id."""
        return [c for c in self._all(False) if not c.patched]

    def _all(self, idle: bool) -> list[ConvCalls]:
        end = self._end if self._end is not None else _counts()
        by_name: dict[tuple[bool, str], ConvCalls] = {}
        for key, (counter, g, stock, entered) in end.items():
            g0, s0, e0 = 0, {}, 0
            if key in self._start and self._start[key][0] is counter:
                _, g0, s0, e0 = self._start[key]
            name = counter.name or "<root>"  # a conv patch() was given itself, as PatchReport says
            if not (idle and counter.patched) and g == g0 and stock == s0 and entered == e0:
                continue
            entry = by_name.setdefault((counter.patched, name), ConvCalls(name, patched=counter.patched))
            entry.gemm += g - g0
            entry.module_calls += entered - e0
            entry.replaced = entry.replaced or counter.replaced
            for why, n in stock.items():
                if n - s0.get(why, 0):
                    entry.stock[why] = entry.stock.get(why, 0) + n - s0.get(why, 0)
        return sorted(by_name.values(), key=lambda c: c.name)

    @property
    def gemm_calls(self) -> int:
        return sum(c.gemm for c in self.convs())

    @property
    def stock_calls(self) -> int:
        return sum(sum(c.stock.values()) for c in self.convs())

    @property
    def unpatched_calls(self) -> int:
        """Calls of eligible convs vlfast did not patch (each one ran the stock conv, or its class's forward)."""
        return sum(c.module_calls for c in self.unpatched())

    def image_processor_calls(self) -> tuple[int, dict[str, int]]:
        """Image processor calls while the record ran: (answered by vlfast, passed to transformers' code by
        reason)."""
        (v1, s1), (v0, s0) = self._image_end or _image_counts(), self._image_start
        stock = {why: n - s0.get(why, 0) for why, n in s1.items() if n - s0.get(why, 0)}
        return v1 - v0, stock

    def to_dict(self) -> dict[str, Any]:
        rank, world = _rank()
        vlfast_images, stock_images = self.image_processor_calls()
        convs = self.convs(idle=self._idle)
        unpatched = self.unpatched()
        return {
            "rank": rank,
            "world_size": world,
            "pid": os.getpid(),
            "gemm_calls": sum(c.gemm for c in convs),
            "stock_calls": sum(sum(c.stock.values()) for c in convs),
            "unpatched_calls": sum(c.module_calls for c in unpatched),
            "convs": [
                {
                    "name": c.name,
                    "gemm": c.gemm,
                    "stock": c.stock,
                    "module_calls": c.module_calls,
                    "forward_replaced": c.replaced,
                }
                for c in convs
            ],
            "unpatched": [
                {"name": c.name, "calls": c.module_calls, "forward_replaced": c.replaced} for c in unpatched
            ],
            "image_processor_calls": {"vlfast": vlfast_images, "stock": stock_images},
        }

    def __str__(self) -> str:
        d = self.to_dict()
        rank, world = d["rank"], d["world_size"]
        who = "one process" if rank is None else f"rank {rank}" + (f" of {world}" if world else "")
        convs = self.convs(idle=self._idle)
        unpatched = self.unpatched()
        tail = []
        for replaced in sorted({c.replaced or "" for c in unpatched}):
            group = [c for c in unpatched if (c.replaced or "") == replaced]
            k, n = len(group), sum(c.module_calls for c in group)
            ran = f"call{'s' * (n != 1)} through {replaced}" if replaced else f"stock call{'s' * (n != 1)}"
            # nn.DataParallel's replicas are new modules at every step, each named by class and id
            names = ", ".join(c.name for c in group[:_NAMES_SHOWN])
            if k > _NAMES_SHOWN:
                names += f" and {k - _NAMES_SHOWN} more"
            tail.append(f"  {k} eligible conv{'s' * (k != 1)} not patched: {names}: {n} {ran}")
        images = _image_line(*self.image_processor_calls())
        head = f"vlfast record ({who}, pid {d['pid']}): "
        if images and not convs and env_setting() is None:  # VLFAST_PREPROCESS alone: no conv to speak of
            return "\n".join([head + images, *tail])
        if images:
            tail.append(f"  {images}")
        if not convs:
            head += "no patched convolution in this process (was the model built before VLFAST_PATCH / "
            return "\n".join([head + "patch_transformers took effect, or never patched?)", *tail])
        calls, n = d["gemm_calls"] + d["stock_calls"], len(convs)
        bypassed = [c for c in convs if c.replaced is not None and not c.calls]
        by = ", ".join(sorted({c.replaced for c in bypassed}))
        if bypassed and len(bypassed) == n:  # not "1 patched conv, 0 calls": nothing ran through vlfast
            head += f"forward replaced by {by}: {_BYPASSED} ({n} patched conv{'s' * (n != 1)})"
        else:
            head += f"{n} patched conv{'s' * (n != 1)}, {calls} call{'s' * (calls != 1)}: "
            head += f"{d['gemm_calls']} GEMM, {d['stock_calls']} stock"
            if bypassed:
                head += f"; {len(bypassed)} not reached: forward replaced by {by}"
        return "\n".join([head, *(f"  {c.line()}" for c in convs), *tail])


def _image_line(vlfast_calls: int, stock: dict[str, int]) -> str | None:
    """The record's line on image processor calls (None: there were none)."""
    n = vlfast_calls + sum(stock.values())
    if not n:
        return None
    line = f"image processor: {n} call{'s' * (n != 1)}: {vlfast_calls} by vlfast, {sum(stock.values())} stock"
    reasons = sorted(stock.items(), key=lambda kv: -kv[1])
    return line + "".join(f"; {k} stock ({why})" for why, k in reasons)


def _set_recording(delta: int) -> None:
    """Add ``delta`` to the number of records running; the patch counts calls while it is not zero."""
    from vlfast.patching.gemm import count_calls  # imports torch: only where a record starts or stops

    with _lock:
        count_calls(delta)


def record_calls() -> CallRecord:
    """Start counting, in this process, the calls of every patched conv (GEMM, or stock and why).

    Returns the running :class:`CallRecord`; ``stop()`` it, or use it as a context manager. Records may
    overlap: each reports the calls made while it ran.
    """
    _set_recording(+1)
    return CallRecord(_start=_counts(), _image_start=_image_counts())


# --------------------------------------------------------------------------- VLFAST_RECORD, at exit


def _at_exit(target: str) -> None:
    # A process that never loaded the patch (a launcher) has nothing to say, nor a worker that patched nothing.
    answered, stock = _image_counts()
    images = answered + sum(stock.values())
    if "vlfast.patching.gemm" not in sys.modules and not images:
        return
    record = CallRecord(_start={}, _idle=True)
    convs = record.convs(idle=True) + record.unpatched()
    mp = sys.modules.get("multiprocessing")
    if not convs and not images and mp is not None and mp.parent_process() is not None:
        return
    with contextlib.suppress(OSError, ValueError):  # stderr closed at exit
        print(str(record), file=sys.stderr, flush=True)
    if _is_path(target):
        _append(target, json.dumps(record.to_dict()) + "\n")


def _is_path(target: str) -> bool:
    return target.lower() not in ("1", "true", "yes", "on")


def _not_a_file(mode: int) -> str | None:
    """What a file of this ``st_mode`` is when it is not a regular file (the record appends to one only)."""
    if stat.S_ISREG(mode):
        return None
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"))
    kinds += ((stat.S_ISSOCK, "a socket"), (stat.S_ISBLK, "a block device"))
    return next((kind for test, kind in kinds if test(mode)), "not a regular file")


def _refusal(target: str, what: str) -> str:
    return (
        f"vlfast record: {ENV_VAR}={target!r} is {what}, not a regular file: the record goes to stderr only"
    )


def _append(target: str, line: str) -> None:
    # O_NONBLOCK: a FIFO made after start-up must not hold the exit (without a reader its open fails at
    # once with ENXIO); a regular file ignores it.
    fd = None
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK | os.O_NOCTTY, 0o644)
        what = _not_a_file(os.fstat(fd).st_mode)
        if what is not None:  # a FIFO with a reader, a device: not the file a script reads back
            print(_refusal(target, what), file=sys.stderr)
            return
        os.write(fd, line.encode())  # one write of one line: ranks appending do not interleave
    except OSError as e:
        print(f"vlfast record: could not append to {ENV_VAR}={target!r}: {e}", file=sys.stderr)
    finally:
        if fd is not None:
            os.close(fd)


def install_from_env() -> bool:
    """Arm ``VLFAST_RECORD``: count from the patch's first import, report at exit. Safe to call twice."""
    global env_armed, _env_target
    target = record_setting()
    if target is None or env_armed:
        return target is not None
    env_armed = True
    import importlib

    importlib.import_module(_ADAPTER).on_call.append(_in_worker)  # no torch: the counter and its listeners
    if _is_path(target):
        try:
            what = _not_a_file(os.stat(target).st_mode)  # stat never opens: a FIFO cannot block it
        except OSError:  # not there yet: created at exit (its folder may be made by the run)
            what = None
        if what is not None:
            print(_refusal(target, what), file=sys.stderr)
            target = "1"
    if "vlfast.patching.gemm" in sys.modules:
        _set_recording(+1)
    # else: gemm reads env_armed when it is imported and starts counting then
    _env_target = target
    atexit.register(_at_exit, target)
    return True
