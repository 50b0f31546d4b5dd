"""Shared fixtures: a tiny offline Qwen3-VL checkpoint and test media (good and bad), built once per session."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest

# What `vlfast extract` does before torch loads (vlfast.cli.let_idle_threads_sleep): the suite runs
# the pipeline with decode workers on a 2-core machine. Conftest loads before any test module imports torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# ... and vlfast.cli.same_bits_for_any_thread_count: the suite compares features bit for bit between this
# process (2 threads, batches of several samples), torchrun ranks and Ray actors (1 thread each).
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
# MKL reads it at its first call, not when torch loads: make that call now, so a test that removes the
# variable (test_same_bits.py) cannot leave MKL's strict mode off for the tests after it in this process.
import torch  # noqa: E402

torch.ones(64, 64) @ torch.ones(64, 64)


@pytest.fixture(scope="session")
def tiny_qwen3_vl(tmp_path_factory) -> Path:
    """A random-weight Qwen3-VL checkpoint directory (2-layer LLM and tower, trained BPE tokenizer)."""
    from vlfast.demo import make_tiny_qwen3_vl

    return make_tiny_qwen3_vl(tmp_path_factory.mktemp("tiny-qwen3-vl"))


@pytest.fixture
def two(media_dir, tmp_path) -> Path:
    """A folder of two of media_dir's good images (a JPEG and a PNG): an input for runs of their own."""
    folder = tmp_path / "in"
    folder.mkdir()
    for name in ("rgb.jpg", "gray.png"):
        shutil.copy(media_dir / "good" / name, folder / name)
    return folder


def _save(img, path: Path, **kw) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, **kw)
    return path


@pytest.fixture(scope="session")
def media_dir(tmp_path_factory) -> Path:
    """Good images and clips of every awkward kind, plus the bad inputs the issue lists, in one folder.

    ``good/`` must extract; ``bad/`` must each be recorded as an error. ``expected.json`` says which.
    """
    from PIL import Image

    from vlfast.demo import make_video, pattern

    root = tmp_path_factory.mktemp("media")
    good, bad = root / "good", root / "bad"
    rgb = Image.fromarray(pattern(120, 160, 1))
    _save(rgb, good / "rgb.jpg", quality=90)
    _save(rgb, good / "rgb.png")
    rgba = np.dstack([pattern(90, 100, 2), np.linspace(0, 255, 90 * 100).reshape(90, 100).astype(np.uint8)])
    _save(Image.fromarray(rgba), good / "rgba.png")
    _save(rgb.convert("L"), good / "gray.png")
    _save(rgb.convert("P", palette=Image.Palette.ADAPTIVE), good / "palette.png")
    _save(rgb.convert("CMYK"), good / "cmyk.jpg")
    sixteen = (np.asarray(rgb.convert("L"), dtype=np.uint16) * 257).astype(np.uint16)
    _save(Image.fromarray(sixteen), good / "gray16.png")
    _save(Image.fromarray(pattern(3, 5, 3)), good / "tiny.png")  # 5x3 pixels: upscaled to the minimum
    frames = [Image.fromarray(pattern(64, 64, 10 + k)) for k in range(3)]
    _save(frames[0], good / "animated.gif", save_all=True, append_images=frames[1:], duration=100, loop=0)
    _save(Image.fromarray(pattern(20, 3000, 4)), good / "wide150.png")  # 150:1, within Qwen's limit
    make_video(good / "clip.mp4", frames=10, fps=5, width=96, height=64)
    make_video(good / "one_frame.mp4", frames=1, fps=5, width=64, height=64)
    make_video(good / "odd.mp4", frames=3, fps=2, width=64, height=48)  # 3 frames: padded to even

    bad.mkdir()
    (bad / "zero.jpg").write_bytes(b"")
    (bad / "text.png").write_text("this is not an image\n")
    data = (good / "rgb.jpg").read_bytes()
    (bad / "truncated.jpg").write_bytes(data[: len(data) // 3])
    _save(Image.fromarray(pattern(2, 500, 5)), bad / "wide250.png")  # 250:1 > 200:1
    (bad / "corrupt.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 20)
    (bad / "empty.mp4").write_bytes(b"")
    expected = {
        "good": sorted(p.relative_to(root).as_posix() for p in good.iterdir()),
        "bad": sorted(p.relative_to(root).as_posix() for p in bad.iterdir()),
    }
    (root / "expected.json").write_text(json.dumps(expected, indent=1))
    return root


@pytest.fixture(scope="module")
def tokens_app():
    """The `vlfast tokens` command group alone, for CliRunner: no other command module is imported."""
    import typer

    from vlfast.cli.tokens import register

    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        """test root"""

    register(app)
    return app


# ------------------------------------------------------------------------------------------------ Ray

_LAST_RAY_TEST = pytest.StashKey[str | None]()


def pytest_configure(config) -> None:
    """With pytest-xdist, only ``--dist loadgroup`` keeps the Ray tests together (below); any other mode
    would start a Ray cluster in each worker that runs one of them, and leave some running to the end.
    A worker that dies is named with the test it was in (tests/_worker_crash.py)."""
    from _worker_crash import WorkerCrashes

    config.pluginmanager.register(WorkerCrashes(config), "vlfast-worker-crashes")
    config.addinivalue_line(
        "markers",
        "cpu_kernels: its outcome depends on the CPU's kernels (AVX-512 or not); .ci/run runs these files' "
        "marked tests again with ATen, oneDNN and MKL limited to AVX2 (issue 46)",
    )
    numprocesses = getattr(config.option, "numprocesses", None)
    dist = getattr(config.option, "dist", "no")
    if numprocesses and dist not in ("no", "loadgroup") and not hasattr(config, "workerinput"):
        raise pytest.UsageError(f"run the tests with -n N --dist loadgroup, not --dist {dist}")
    if numprocesses and dist == "loadgroup" and not hasattr(config, "workerinput") and not _groups_take():
        raise pytest.UsageError(
            f"--dist loadgroup would group nothing with pytest {pytest.__version__}: it loses the '@group' "
            "suffix pytest-xdist puts on a test's node id, so the Ray tests would start a cluster in each "
            "worker; install 'pytest<9.2' (the test extra's pin)"
        )


def _groups_take() -> bool:
    """Whether pytest-xdist's loadgroup can group here: it marks a test's group by setting the item's
    ``_nodeid`` to ``ID@group``, which pytest 9.2 no longer reads back as the node id (without a word: every
    test is then scheduled alone). The probe does what xdist does, on an item made without a collection."""

    class Probe(pytest.Item):
        def runtest(self) -> None:
            pass

    item = object.__new__(Probe)
    item._nodeid = "probe@group"
    try:
        return item.nodeid == "probe@group"
    except AttributeError:  # pytest 9.2: the node id comes from a field this bare item lacks
        return False


# tryfirst: before pytest-xdist's own hook, which reads the group marks into the node ids
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """Under pytest-xdist (``--dist loadgroup``) every test that uses the Ray cluster runs in one worker, one
    after another: one cluster for the run, stopped after its last test (below) by the worker that started it.
    Split across workers, each would start a cluster of its own on the 2 cores, and a worker whose share did
    not include the last Ray test would keep its cluster (its daemons are that worker's children) to the end."""
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("ray"))


def pytest_collection_finish(session) -> None:
    """Note the last test that uses the Ray cluster: the cluster stops after it, not at the session's end,
    so the tests after it do not run beside an idle cluster (its daemons, its workers, its SIGTERM handler)."""
    users = [item.nodeid for item in session.items if "ray_cluster" in getattr(item, "fixturenames", ())]
    session.config.stash[_LAST_RAY_TEST] = users[-1] if users else None


@pytest.fixture(scope="session")
def _ray_session():
    """One local 2-CPU Ray cluster for every test that needs one (starting one takes seconds on 2 cores).
    Yields ``(ray, start)``; ``start()`` (re)starts it when needed and returns the SIGTERM handler ray.init
    installed."""
    ray = pytest.importorskip("ray")
    state: dict = {}

    def start():
        if not ray.is_initialized():
            # Ray starts its workers at nice 15 (RAY_worker_niceness, read by the raylet): beside work at normal
            # priority they get a few percent of a core, and at load 10 the killed-job test outlived its 900 s
            # (2026-12-02). The suite's cluster runs them at the priority of the rest of the suite.
            os.environ.setdefault("RAY_worker_niceness", "0")
            before = signal.getsignal(signal.SIGTERM)
            # The job's workers get what `vlfast extract` sets for itself, so the engine adds no per-stage env.
            ray.init(
                num_cpus=2,
                include_dashboard=False,
                runtime_env={"env_vars": {"OMP_WAIT_POLICY": "PASSIVE"}},
                logging_level="WARNING",
            )
            # ray.init's handler (it exits) is put in place by ray_cluster for its tests only
            state["handler"] = signal.signal(signal.SIGTERM, before)
        return state["handler"]

    yield ray, start
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def ray_cluster(_ray_session, request):
    """The session's Ray cluster, as this process's ``ray`` module: during the test SIGTERM has ray.init's
    handler, as in a driver that called ray.init itself; after it, the handler the test found."""
    ray, start = _ray_session
    before = signal.signal(signal.SIGTERM, start())
    try:
        yield ray
    finally:
        if request.node.nodeid == request.config.stash.get(_LAST_RAY_TEST, None):
            ray.shutdown()
        signal.signal(signal.SIGTERM, before)


# ----------------------------------------------------------------------------------------------- S3


@pytest.fixture(scope="session")
def moto_endpoint():
    """One moto S3 server on 127.0.0.1 for the session (tests/_s3.py); yields its endpoint URL. Moto keeps
    buckets per process, not per server, so sharing one server changes nothing a test sees: each module
    makes buckets of its own, each test writes under a bucket or prefix of its own."""
    pytest.importorskip("moto.server")
    from _s3 import moto_s3

    with moto_s3() as endpoint:
        yield endpoint
