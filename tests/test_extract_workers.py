"""WorkerPool (vlfast.extraction.decode.workers): ordered results, and real faults in real worker processes.

Every fault here is the real thing: a worker SIGKILLs itself, dereferences NULL, exits, hangs, or loses its
parent to SIGKILL. Tasks are module-level functions (the pool forks, so closures would work too).
"""

from __future__ import annotations

import ctypes
import faulthandler
import functools
import gc
import multiprocessing
import os
import random
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch

from vlfast.extraction.decode.workers import WorkerPool, death_reason

TIMEOUT_REASON = (
    "decoding took longer than {:g} s (--decode-timeout; raise it for long videos); the worker was stopped"
)


@pytest.fixture(autouse=True)
def no_leftover_children():
    """Whatever a test does, the pool must leave no child process behind (running or zombie). Children
    that were there before the test are not its own: the session's Ray cluster (its daemons are this
    process's children) lives from the first Ray test to the last, and under pytest-xdist other tests of
    the same worker may run in between."""
    before = {k.pid for k in psutil.Process().children()}
    yield
    new = [k for k in psutil.Process().children() if k.pid not in before]  # the pool's workers are direct
    kids = new + [d for k in new for d in k.children(recursive=True)]
    assert not kids, f"left behind: {[(k.pid, k.status()) for k in kids]}"
    assert not multiprocessing.active_children()


# ----------------------------------------------------------------------------------------------- tasks


def _payload(i: int) -> torch.Tensor:
    return torch.full((64, 32), float(i))


def _segfault() -> None:
    faulthandler.disable()  # inherited from pytest: would print a traceback for the expected crash
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # and no core file
    ctypes.string_at(0)  # read address 0: a real segmentation fault


def _faulty(
    i: int,
    *,
    marker_dir: str = "",
    kill: tuple[int, ...] = (),
    kill_once: tuple[int, ...] = (),
    segv: tuple[int, ...] = (),
    hang: tuple[int, ...] = (),
    raise_: tuple[int, ...] = (),
    exit_code: tuple[int, ...] = (),
    seconds: float = 0.0,
) -> dict:
    if marker_dir:
        Path(marker_dir, f"started-{i}").write_text(str(os.getpid()))
    if i in kill:
        os.kill(os.getpid(), signal.SIGKILL)
    if i in kill_once:
        marker = Path(marker_dir, f"killed-{i}")
        if not marker.exists():  # first run only: the retry in a fresh worker succeeds
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
    if i in segv:
        _segfault()
    if i in hang:
        time.sleep(3600)
    if i in raise_:
        raise ValueError(f"boom {i}")
    if i in exit_code:
        os._exit(3)
    time.sleep(seconds)
    return {"i": i, "ok": True, "pid": os.getpid(), "x": _payload(i)}


def _sleepy(i: int) -> dict:
    time.sleep(random.Random(i).uniform(0.0, 0.02))  # finish out of order across workers
    return {"i": i, "ok": True, "pid": os.getpid()}


def _check(items: list[dict], n: int, bad: dict[int, str]) -> None:
    """Exactly one item per index, in order; the bad ones failed with a reason containing bad[i]; the
    others carry their real result."""
    assert [it["i"] for it in items] == list(range(n))
    for it in items:
        i = it["i"]
        if i in bad:
            assert not it["ok"], it
            assert bad[i] in it["reason"], it["reason"]
        else:
            assert it["ok"], it
            assert torch.equal(it["x"], _payload(i))


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # orphans may wait on a lazy init
    except psutil.NoSuchProcess:
        return True


# ----------------------------------------------------------------------------------------------- order


def test_results_come_in_order_when_workers_finish_out_of_order():
    with WorkerPool(_sleepy, 60, num_workers=3, prefetch=4, timeout=10) as pool:
        items = list(pool)
    assert [it["i"] for it in items] == list(range(60))
    pids = {it["pid"] for it in items}
    assert len(pids) == 3 and os.getpid() not in pids


def test_tasks_in_flight_are_bounded_by_workers_times_prefetch(tmp_path):
    fn = functools.partial(_faulty, marker_dir=str(tmp_path))
    with WorkerPool(fn, 30, num_workers=2, prefetch=3, timeout=10) as pool:
        for k, it in enumerate(pool):
            time.sleep(0.02)  # a slow consumer: workers run ahead as far as they may
            started = len(list(tmp_path.glob("started-*")))
            assert started <= k + 2 * 3, (k, started)
            assert it["ok"]


def test_no_workers_runs_in_the_calling_process():
    fn = functools.partial(_faulty, raise_=(2,))
    pool = WorkerPool(fn, 4, num_workers=0)
    items = list(pool)
    assert [it["i"] for it in items] == [0, 1, 2, 3]
    assert {it["pid"] for it in items if it["ok"]} == {os.getpid()}
    assert items[2]["reason"] == "unexpected ValueError: boom 2"


def test_an_exception_in_fn_becomes_an_error_record():
    with WorkerPool(functools.partial(_faulty, raise_=(3,)), 8, num_workers=2, timeout=10) as pool:
        _check(list(pool), 8, {3: "unexpected ValueError: boom 3"})
        assert pool.stats.deaths == 0


def test_tensors_round_trip_exactly():
    with WorkerPool(_tensors, 6, num_workers=2, timeout=30) as pool:
        for it in pool:
            want = _tensors(it["i"])
            assert it.keys() == want.keys()
            for key, value in want.items():
                if isinstance(value, torch.Tensor):
                    got = it[key]
                    assert got.dtype == value.dtype and got.shape == value.shape, key
                    assert got.stride() == value.stride(), key
                    assert torch.equal(got, value), key
                elif key == "many":
                    assert all(torch.equal(a, b) for a, b in zip(it[key], value, strict=True))
                else:
                    assert it[key] == value, key
            # Two views of one storage still share it: torch's reductions keep that, as in a DataLoader.
            assert it["big"].untyped_storage().data_ptr() == it["view"].untyped_storage().data_ptr()


def _tensors(i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    big = torch.randn(1000, 1536, generator=g)
    return {
        "i": i,
        "ok": True,
        "big": big,
        "view": big[10:20, 3:9].t(),  # offset, non-contiguous, same storage as big
        "u8": torch.randint(0, 256, (300, 3, 512), dtype=torch.uint8, generator=g),
        "i64": torch.arange(i, i + 7),
        "bf16": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "bool": torch.rand(9, generator=g) > 0.5,
        "scalar": torch.tensor(float(i)),
        "empty": torch.empty(0, 4),
        "many": [torch.full((3,), float(k)) for k in range(250)],  # more descriptors than one sendmsg carries
        "grid": (1, 2 * i, 4),
        "meta": {"prompt": f"sample {i}", "fps": 2.0},
    }


# ------------------------------------------------------------------------------------------- dead workers


def test_a_task_that_always_kills_its_worker_is_recorded_and_the_rest_come_back_once():
    with WorkerPool(functools.partial(_faulty, kill=(4,)), 16, num_workers=2, timeout=10) as pool:
        items = list(pool)
        stats = pool.stats
    _check(items, 16, {4: death_reason(-signal.SIGKILL)})
    assert items[4]["reason"] == (
        "worker died while decoding this sample: killed by signal 9 (SIGKILL), often the out-of-memory killer"
    )
    assert (stats.deaths, stats.retried, stats.recovered) == (2, 1, 0)  # first run, then the lone retry


def test_results_a_worker_sent_before_dying_are_kept(tmp_path):
    # One worker runs ahead (prefetch) while the consumer is busy, sends 1..4 and dies on 5 before the
    # parent reads them: their tensors must still arrive (their descriptors travel with the messages).
    with WorkerPool(functools.partial(_faulty, kill=(5,)), 8, num_workers=1, timeout=10) as pool:
        items = []
        for it in pool:
            if it["i"] == 0:
                time.sleep(0.5)
            items.append(it)
    _check(items, 8, {5: "SIGKILL"})


def test_a_task_killed_once_is_retried_and_its_real_result_returned(tmp_path):
    fn = functools.partial(_faulty, kill_once=(2,), marker_dir=str(tmp_path))
    with WorkerPool(fn, 10, num_workers=2, timeout=10) as pool:
        items = list(pool)
        stats = pool.stats
    assert (tmp_path / "killed-2").exists()  # it really was killed once
    _check(items, 10, {})
    assert (stats.deaths, stats.retried, stats.recovered) == (1, 1, 1)


def test_without_retry_one_death_is_recorded():
    with WorkerPool(functools.partial(_faulty, kill=(1,)), 5, num_workers=2, retry_dead=False) as pool:
        _check(list(pool), 5, {1: "killed by signal 9 (SIGKILL)"})
        assert (pool.stats.deaths, pool.stats.retried) == (1, 0)


def test_a_segfault_is_named():
    with WorkerPool(functools.partial(_faulty, segv=(1,)), 6, num_workers=2, timeout=10) as pool:
        items = list(pool)
    _check(items, 6, {1: "killed by signal 11 (SIGSEGV): the decoder crashed"})


# ------------------------------------------------------------------------------------------- hung workers


def test_a_hung_task_times_out_and_the_run_finishes(tmp_path):
    fn = functools.partial(_faulty, hang=(2,), marker_dir=str(tmp_path))
    t0 = time.monotonic()
    with WorkerPool(fn, 10, num_workers=2, timeout=1.0) as pool:
        items = list(pool)
        stats = pool.stats
    elapsed = time.monotonic() - t0
    _check(items, 10, {2: TIMEOUT_REASON.format(1.0)})
    assert items[2]["reason"] == TIMEOUT_REASON.format(1)
    # At least the timeout (load only adds to that); the run ending at all, the task hanging 3600 s, shows the
    # worker was stopped: no upper bound on the wall clock, which a loaded host breaks.
    assert elapsed >= 1.0
    assert (stats.timeouts, stats.deaths, stats.retried) == (1, 0, 0)  # stopped, not died: no retry
    assert _gone(int((tmp_path / "started-2").read_text()))


def test_a_slow_consumer_causes_no_false_timeout():
    # Tasks take 0.15 s, well within the 0.5 s timeout, but the consumer is away for 1 s while each worker
    # has 8 queued (1.2 s of work): when it comes back, results that arrived meanwhile must be read before
    # any deadline is judged, or the clock of the task now running looks a second old.
    fn = functools.partial(_faulty, seconds=0.15)
    with WorkerPool(fn, 24, num_workers=2, prefetch=8, timeout=0.5) as pool:
        items = []
        for it in pool:
            if it["i"] == 0:
                time.sleep(1.0)
            items.append(it)
        assert pool.stats.timeouts == 0
        assert pool.stats.started == 2  # and no worker was stopped on a stale clock
    _check(items, 24, {})


def test_several_faults_in_one_run(tmp_path):
    fn = functools.partial(
        _faulty,
        marker_dir=str(tmp_path),
        kill=(3,),
        kill_once=(7,),
        segv=(12,),
        hang=(20,),
        raise_=(25,),
        exit_code=(30,),
    )
    with WorkerPool(fn, 40, num_workers=2, timeout=1.5) as pool:
        items = list(pool)
        stats = pool.stats
    bad = {
        3: "killed by signal 9 (SIGKILL)",
        12: "killed by signal 11 (SIGSEGV)",
        20: TIMEOUT_REASON.format(1.5),
        25: "unexpected ValueError: boom 25",
        30: "worker died while decoding this sample: exited with code 3",
    }
    _check(items, 40, bad)
    assert (stats.timeouts, stats.retried, stats.recovered) == (1, 4, 1)  # 3, 7, 12, 30 retried; 7 recovered
    assert stats.deaths == 7


# ----------------------------------------------------------------------------------- workers and set-up


_INIT_ID: int | None = None


def _init(worker_id: int) -> None:
    global _INIT_ID
    _INIT_ID = worker_id
    torch.set_num_threads(1)


def _report_init(i: int) -> dict:
    if i == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return {"i": i, "ok": True, "init": _INIT_ID, "threads": torch.get_num_threads()}


def test_worker_init_runs_in_every_worker_including_replacements():
    with WorkerPool(_report_init, 12, num_workers=2, worker_init=_init, timeout=10) as pool:
        items = list(pool)
        assert pool.stats.restarts >= 1
    good = [it for it in items if it["ok"]]
    assert len(good) == 11
    assert {it["init"] for it in good} <= {0, 1} and {it["threads"] for it in good} == {1}
    assert _INIT_ID is None  # ran in the workers only


def _bad_init(worker_id: int) -> None:
    raise OSError("no decoder here")


def test_a_failing_worker_init_raises_in_the_parent():
    with (
        pytest.raises(RuntimeError, match="worker_init failed.*OSError: no decoder here"),
        WorkerPool(_sleepy, 4, num_workers=1, worker_init=_bad_init) as pool,
    ):
        list(pool)


@pytest.mark.parametrize(
    "kwargs",
    [{"n": -1}, {"num_workers": -1}, {"prefetch": 0}, {"timeout": 0}, {"timeout": -3.0}],
)
def test_invalid_arguments_are_refused(kwargs):
    args = {"n": 3, "num_workers": 1, **kwargs}
    with pytest.raises(ValueError):
        WorkerPool(_sleepy, args.pop("n"), **args)


# ------------------------------------------------------------------------------------------- shutdown


def test_breaking_out_early_leaves_no_worker_behind():
    fn = functools.partial(_faulty, hang=(1,))  # one worker is busy (hung) when the consumer leaves
    with WorkerPool(fn, 50, num_workers=2, timeout=None) as pool:
        for first in pool:  # noqa: B007 - used after the loop
            pids = pool.worker_pids()
            break
    assert first["i"] == 0 and len(pids) == 2
    assert pool.worker_pids() == []
    assert all(_gone(pid) for pid in pids)
    pool.close()  # idempotent


def test_an_exception_in_the_consumer_and_garbage_collection_stop_the_workers():
    with pytest.raises(KeyError), WorkerPool(_sleepy, 50, num_workers=2) as pool:
        for _ in pool:
            raise KeyError("consumer failed")
    assert pool.worker_pids() == []

    pool = WorkerPool(_sleepy, 50, num_workers=2)
    it = iter(pool)
    next(it)
    pids = pool.worker_pids()
    del it, pool
    gc.collect()
    assert pids and all(_gone(pid) for pid in pids)


def test_a_hung_worker_dies_with_its_parent(tmp_path):
    pid_file = tmp_path / "worker.pid"
    parent = textwrap.dedent(
        f"""
        import os, time
        from pathlib import Path
        from vlfast.extraction.decode.workers import WorkerPool

        def hang(i):
            Path({str(pid_file)!r} + ".tmp").write_text(str(os.getpid()))
            os.replace({str(pid_file)!r} + ".tmp", {str(pid_file)!r})
            time.sleep(3600)

        next(iter(WorkerPool(hang, 1, num_workers=1, timeout=None)))
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", parent])
    worker = None
    try:
        deadline = time.monotonic() + 60  # the parent imports torch first
        while not pid_file.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pid_file.exists(), f"the parent's pool never started (exit code {proc.poll()})"
        worker = int(pid_file.read_text())
        assert psutil.Process(worker).ppid() == proc.pid
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 5
        while not _gone(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(worker), "the hung worker outlived its killed parent"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if worker is not None and not _gone(worker):
            os.kill(worker, signal.SIGKILL)  # the worker this test started, by pid


def test_workers_of_a_parent_that_ran_openmp_do_not_hang(tmp_path):
    """GNU OpenMP is not fork-safe: after the parent has run a parallel region, a forked worker's first
    parallel op hangs unless the worker keeps to one thread (as DataLoader's workers do)."""
    script = tmp_path / "omp_then_fork.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            x = torch.randn(1500, 1500)
            (x @ x).sum()  # a parallel region in the parent, before the fork
            from vlfast.extraction.decode.workers import WorkerPool

            def fn(i):
                y = torch.randn(800, 800)
                return {"i": i, "ok": True, "s": float((y @ y).sum())}

            with WorkerPool(fn, 4, num_workers=2, timeout=20) as pool:
                print([it["ok"] for it in pool])
            """
        )
    )
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "2"}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[True, True, True, True]"
