"""`vlfast extract --engine ray`: the same OUT as the local engine, resumable after a SIGKILL, and refused
cleanly without Ray or with flags that do not fit. Ray runs on the session's local 2-CPU cluster (conftest)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from _selftest import compare_caches
from vlfast.cli.main import app
from vlfast.demo import make_images
from vlfast.extraction import FeatureCache
from vlfast.extraction.engines.base import Hooks
from vlfast.extraction.engines.local import LocalEngine
from vlfast.extraction.engines.ray import RayEngine

runner = CliRunner()


def test_without_ray_the_command_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    out = tmp_path / "o"
    r = runner.invoke(app, ["extract", str(tmp_path), str(out), "-m", "ref:qwen3-vl-2b", "--engine", "ray"])
    assert r.exit_code == 2, r.output
    assert "missing dependency" in r.output and "pip install 'vlfast[ray]'" in r.output
    assert not out.exists()  # refused before anything was read or written


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--engine", "spark"], "--engine must be local or ray"),
        (["--ray-workers", "2"], "--ray-workers apply to --engine ray only"),
        (
            ["--ray-address", "auto", "--num-gpus-per-worker", "1"],
            "--ray-address, --num-gpus-per-worker apply",
        ),
        (["--engine", "ray", "--ray-workers", "0"], "--ray-workers must be an integer from 1 to"),
        (
            ["--engine", "ray", "--num-gpus-per-worker", "-1"],
            "--num-gpus-per-worker must be a number from 0 to",
        ),
        (["--engine", "ray", "--ray-cpus-per-worker", "0"], "--ray-cpus-per-worker must be a number above 0"),
        (["--engine", "ray", "--workers", "0"], "--workers is the number of decode actors"),
        (["--engine", "ray", "--rank", "0", "--world-size", "2"], "the actors share it"),
        (["--rank", "1"], "give --rank and --world-size together"),
        (["--rank", "2", "--world-size", "2"], "--rank must be in 0..1"),
    ],
)
def test_bad_engine_flags_are_refused(tmp_path, flags, message):
    out = tmp_path / "o"
    r = runner.invoke(app, ["extract", str(tmp_path), str(out), "-m", "ref:qwen3-vl-2b", *flags])
    assert r.exit_code == 2, r.output
    assert message in r.output, r.output
    assert not out.exists()


def test_the_command_keeps_rays_restart_alarm_off_unless_verbose():
    """The CLI's engine spends Ray's once-per-process C++ alarm (ray #53727) out of sight unless --verbose;
    a library caller gets Ray's own behaviour. That the line then never prints is checked on the real command
    (test_sigterm_to_the_ray_driver_stops_the_job_with_its_work_committed)."""
    from vlfast.cli.extract import _engine
    from vlfast.extraction.engines.ray import RayEngine

    assert _engine("ray", None, None, None, None, None, None, verbose=False).quiet
    assert not _engine("ray", None, None, None, None, None, None, verbose=True).quiet
    assert not RayEngine().quiet


def test_rays_restart_alarm_is_spent_in_silence(ray_cluster, capfd):
    """The probe writes nothing to the console, stderr works after it, and a later actor of the same kind
    (a by-reference constructor argument, max_restarts > 0: every Ray Data pool) adds no C++ alarm line."""
    from vlfast.extraction.engines.ray import _spend_actor_restart_alarm

    ray = ray_cluster
    capfd.readouterr()
    _spend_actor_restart_alarm(ray)

    @ray.remote(num_cpus=0, max_restarts=1)
    class Pool:
        def __init__(self, arg):
            self.arg = arg

        def get(self):
            return self.arg

    actor = Pool.remote(ray.put(7))
    assert ray.get(actor.get.remote()) == 7
    ray.kill(actor)
    print("still here", file=sys.stderr)
    err = capfd.readouterr().err
    assert "core_worker.cc" not in err and "53727" not in err, err
    assert "still here" in err


def test_a_refused_probe_costs_the_run_nothing(monkeypatch):
    """The probe is cosmetic: a Ray that refuses it (a client connection, a full cluster) leaves stderr as it
    was and raises nothing."""
    from vlfast.extraction.engines.ray import _spend_actor_restart_alarm

    class Refusing:
        def remote(self, **_):
            return lambda cls: type("P", (), {"remote": staticmethod(self.refuse)})

        def put(self, value):
            return value

        @staticmethod
        def refuse(*_):
            raise RuntimeError("cluster full")

        def kill(self, _):
            raise AssertionError("nothing to kill")

    before = os.fstat(2)
    _spend_actor_restart_alarm(Refusing())
    after = os.fstat(2)
    assert (before.st_dev, before.st_ino) == (after.st_dev, after.st_ino)  # fd 2 is where it was


def test_the_driver_says_each_actors_bits_problem_once():
    """Each model actor reports its CPU's problem (cpu_bits_problem) on its first row; the driver warns once
    per reason, however many actors (or restarted ones) report it, and keeps the longest model build."""
    import warnings

    from vlfast.extraction.engines.ray import _ActorFacts

    facts = _ActorFacts()
    rows = [
        {"load_s": 2.0, "bits_problem": "threads vary"},
        {"load_s": 3.5, "bits_problem": "threads vary"},  # the other actor, the same CPU
        {"load_s": None, "bits_problem": None},  # any later row
        {"load_s": 1.0, "bits_problem": "MKL_CBWR unset"},  # an actor started without the job's env
    ]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for row in rows:
            facts.take(row)
    assert [str(w.message) for w in said] == ["a model actor: threads vary", "a model actor: MKL_CBWR unset"]
    assert all(w.category is RuntimeWarning for w in said) and facts.load_s == 3.5


def test_rank_and_world_size_flags_split_like_torchrun(media_dir, tiny_qwen3_vl, tmp_path):
    """A Slurm array's tasks: `--rank $SLURM_ARRAY_TASK_ID --world-size $SLURM_ARRAY_TASK_COUNT`."""
    base = ["extract", str(media_dir / "good"), "-m", str(tiny_qwen3_vl), "--workers", "0", "--json"]
    for rank in (0, 1):
        r = runner.invoke(
            app, [*base[:2], str(tmp_path / "ranks"), *base[2:], "--rank", str(rank), "--world-size", "2"]
        )
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["world_size"] == 2
    r = runner.invoke(app, [*base[:2], str(tmp_path / "one"), *base[2:]])
    assert r.exit_code == 0, r.output
    assert compare_caches(tmp_path / "one", tmp_path / "ranks") == []


# ------------------------------------------------------------------------------------ with a real Ray


# ray_cluster: the session's cluster (conftest.py)


@pytest.mark.slow
@pytest.mark.timeout(900)  # a hang guard: at load 11-15 the first commit alone took over 180 s
def test_a_killed_ray_job_resumes_with_only_what_is_missing(ray_cluster, tiny_qwen3_vl, tmp_path):
    """The real command, SIGKILLed once its first shard is committed, then run again: it extracts only the
    rest, nothing twice, and ends equal to an uninterrupted run. The command joins the test's cluster
    (--ray-address), as a job on a long-lived cluster does; the killed job's actors may still commit for a
    moment, which the second run (the Python API, in this process: a few seconds less) waits for."""
    from vlfast.extraction.api import extract, extract_ray

    n = 100  # two model calls (64 rows each at most): the kill lands in the first
    inputs = tmp_path / "in"
    make_images(inputs, [(32 + 8 * (k % 4), 32) for k in range(n)])
    (inputs / "zz-bad.png").write_text("not an image")
    out = tmp_path / "ray"
    cmd = [
        sys.executable, "-m", "vlfast.cli.main", "extract", str(inputs), str(out), "-m", str(tiny_qwen3_vl),
        "--engine", "ray", "--ray-address", ray_cluster.get_runtime_context().gcs_address,
        "--commit-every", "0.1", "--json",
    ]  # fmt: skip
    job = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = (
            time.monotonic() + 600
        )  # a hang guard, not a speed bound (Ray's actors start slowly when loaded)
        while not list(out.glob("index/part-*.parquet")):
            assert job.poll() is None, job.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no shard was committed in 600 s"
            time.sleep(0.02)
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate()
    committed = len(FeatureCache(out))
    assert 0 < committed < n

    summary = extract_ray(inputs, out, model=str(tiny_qwen3_vl), commit_every=0.1).to_dict()
    assert summary["engine"] == "ray" and summary["stopped"] is None
    assert summary["skipped"] + summary["extracted"] + summary["failed"] == summary["assigned"] == n + 1
    assert committed <= summary["skipped"] and summary["extracted"] <= n - committed
    index = pq.read_table(out / "index", columns=["id"]).column("id").to_pylist()
    assert sorted(index) == sorted(set(index)) and len(index) == n  # every sample committed once

    extract(inputs, tmp_path / "local", model=str(tiny_qwen3_vl), num_workers=0)
    assert compare_caches(tmp_path / "local", out) == []


def _manifest(media_dir, path):
    """Every good and bad file of media_dir, a repeated id and a line that is not JSON."""
    expected = json.loads((media_dir / "expected.json").read_text())
    rows = [
        json.dumps({"id": rel, "path": str(media_dir / rel)}) for rel in expected["good"] + expected["bad"]
    ]
    rows.insert(3, json.dumps({"id": expected["good"][0], "path": str(media_dir / expected["good"][1])}))
    rows.insert(5, "{not json")
    path.write_text("\n".join(rows) + "\n")
    return path, len(expected["good"]), len(expected["bad"])


def _poisoned_decoder(sample):
    """A decoder that kills its worker on one file and hangs on another (Ray pickles it by value)."""
    if sample.id == "good/rgb.png":
        os._exit(7)
    if sample.id == "good/gray.png":
        time.sleep(600)


def _threads_vary() -> bool:
    """A model actor's CPU whose products change their bits with the thread count (an AMD CPU's MKL can)."""
    return False


def _kill_first_actor(marker: str):
    """A forward hook that SIGKILLs the model actor running the first forward (once: the restarted actor
    carries on). By then the actor has recorded its call's decode errors; its rows never come back."""

    def hook(batch):
        if not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


@pytest.mark.slow
def test_ray_engine_equals_the_local_engine(ray_cluster, media_dir, tiny_qwen3_vl, tmp_path, monkeypatch):
    """Same features, meta and error records as the local engine: bad files, a repeated id, a bad manifest
    line, a decoder that kills its worker (retried once, then recorded) and one that hangs (stopped). The
    model actors also probe their own CPU's products (here: a stand-in that finds them vary with the thread
    count); the driver warns once, however many actors say so. And the first model actor is SIGKILLed at its
    first forward, after recording its call's decode errors: Ray restarts it and retries the call, which
    finds those records there ("known"); the summary still counts them, and every sample."""
    import warnings

    from ray import cloudpickle

    from vlfast.extraction.api import extract, extract_ray

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import tests/
    manifest, good, bad = _manifest(media_dir, tmp_path / "clips.jsonl")
    # The timeout applies to every sample: 2 s once cut off the real clip's decode on a loaded 2-core host.
    options = dict(model=str(tiny_qwen3_vl), decode_timeout=6)
    hooks = Hooks(decode=_poisoned_decoder)
    local = extract(manifest, tmp_path / "local", num_workers=1, engine=LocalEngine(hooks), **options)
    with monkeypatch.context() as mp, warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        killed = _kill_first_actor(str(tmp_path / "killed"))
        mp.setattr(
            RayEngine, "hooks", Hooks(decode=_poisoned_decoder, forward=killed, bits_probe=_threads_vary)
        )
        # Two model actors at half a CPU each, so the decode actor has the cluster's other CPU.
        ray = extract_ray(manifest, tmp_path / "ray", ray_workers=2, cpus_per_worker=0.5, **options)
    assert (tmp_path / "killed").exists()  # the kill happened
    assert compare_caches(tmp_path / "local", tmp_path / "ray") == []
    bits = [str(w.message) for w in said if "other bits at another thread count" in str(w.message)]
    assert len(bits) == 1 and bits[0].startswith("a model actor: this CPU's products"), bits
    # Failed: the bad files, the repeat, the bad line, the two poisoned decodes.
    assert (ray.engine, ray.extracted, ray.failed) == ("ray", good - 2, bad + 4)
    assert (ray.total, ray.errors) == (local.total, local.errors)
    assert ray.skipped + ray.extracted + ray.failed == ray.assigned and ray.stopped is None
    reasons = [e["reason"] for e in FeatureCache(tmp_path / "ray").errors()]
    assert "worker died while decoding this sample: exited with code 7" in reasons
    assert any(r.startswith("decoding took longer than 6 s") for r in reasons)
    ranks = {p.name.split("-")[1] for p in (tmp_path / "ray" / "shards").iterdir()}
    assert ranks and ranks <= {"r00001", "r00002"}  # model actors write ranks 1..N; the driver is rank 0
    # The driver recorded the input's problems as rank 0, the actors the decode errors as theirs.
    errors = {p.name for p in (tmp_path / "ray" / "errors").iterdir()}
    assert "errors-r00000.jsonl" in errors and errors - {"errors-r00000.jsonl"}
    again = extract_ray(manifest, tmp_path / "ray", model=str(tiny_qwen3_vl))
    assert again.nothing_to_do  # answered before Ray is touched


@pytest.mark.slow
def test_ray_engine_into_an_s3_out_equals_the_local_engine(
    ray_cluster, moto_endpoint, tiny_qwen3_vl, tmp_path
):
    """A Ray cluster without a shared filesystem writes to object storage: no locks there, so each model
    actor takes a fresh rank from the job's counter and commits before its rows go back (here one sample a
    call: six parts). Once the dataset is over the driver compacts each actor rank's parts into one. Same
    OUT as the local engine, read back from S3 (moto's server on 127.0.0.1); a second run has nothing to do."""
    pytest.importorskip("s3fs")
    from _s3 import client, options
    from vlfast.extraction.api import extract, extract_ray
    from vlfast.extraction.store.format import committed_parts, is_consolidated, resolve_out

    inputs = tmp_path / "in"
    make_images(inputs, [(32 + 8 * k, 32) for k in range(6)])
    (inputs / "zz-bad.png").write_text("not an image")
    local = extract(inputs, tmp_path / "local", model=str(tiny_qwen3_vl), num_workers=0)
    endpoint = moto_endpoint  # the session's server (conftest)
    client(endpoint, aws_access_key_id="k", aws_secret_access_key="s").create_bucket(Bucket="vlfast-ray")
    # explicit credentials: the cluster's workers were started before this test set any environment
    storage = options(endpoint, key="ray-key", secret="ray-secret")
    out = "s3://vlfast-ray/features"
    ray = extract_ray(
        inputs,
        out,
        model=str(tiny_qwen3_vl),
        ray_workers=2,
        cpus_per_worker=0.5,
        storage_options=storage,
        max_batch_samples=1,
    )
    assert (ray.extracted, ray.failed, ray.errors) == (local.extracted, local.failed, local.errors)
    remote = resolve_out(out, storage)
    assert compare_caches(tmp_path / "local", remote) == []
    shards = [n.rsplit("/", 1)[-1] for n in remote.fs.ls(f"{remote.path}/shards", detail=False)]
    assert len(shards) == 6 and all(not n.startswith("shard-r00000-") for n in shards)  # actors' fresh ranks
    parts = [p.name for p in committed_parts(remote)]
    ranks = {n.split("-")[1] for n in shards}
    assert len(parts) == len(ranks) and any(is_consolidated(remote / "index" / p) for p in parts), parts
    assert len(list(remote.fs.ls(f"{remote.path}/index", detail=False))) == len(ranks)  # replaced ones gone
    again = extract_ray(inputs, out, model=str(tiny_qwen3_vl), storage_options=storage)
    assert again.nothing_to_do


def _slow_forward_in(pid_file: str):
    """A forward hook that, from the third forward on, writes the model actor's pid and slows down, so the
    test can SIGTERM the actor while it holds uncommitted samples."""
    calls = []

    def hook(batch):
        calls.append(len(batch))
        if len(calls) >= 3:
            with open(pid_file, "a") as f:
                f.write(f"{os.getpid()}\n")
            time.sleep(0.5)

    return hook


@pytest.mark.slow
def test_sigterm_to_a_model_actor_commits_what_it_holds(ray_cluster, tiny_qwen3_vl, tmp_path, monkeypatch):
    """SIGTERM to a model actor (a node draining, a pod deleted) with nothing committed yet (commit_every
    3600): it commits the samples it holds before it exits; the restarted actor skips them, and the run
    ends equal to the local engine, every sample once."""
    import threading

    import psutil
    from ray import cloudpickle

    from vlfast.extraction.api import extract, extract_ray

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    inputs = tmp_path / "in"
    make_images(inputs, [(32 + 8 * (k % 3), 32) for k in range(12)])
    out, pid_file = tmp_path / "ray", tmp_path / "actor.pid"
    seen: dict[str, int] = {}

    def preempt():
        try:
            deadline = time.monotonic() + 240
            while not pid_file.exists() or not pid_file.read_text().strip():
                if time.monotonic() > deadline:
                    seen["error"] = "no third forward in 240 s"
                    return
                time.sleep(0.05)
            pid = int(pid_file.read_text().split()[0])
            os.kill(pid, signal.SIGTERM)
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).wait(timeout=120)
            seen["committed_at_exit"] = len(FeatureCache(out)) if (out / "index").exists() else 0
        except BaseException as e:  # reported by the assertion below, not lost with the thread
            seen["error"] = repr(e)
            raise

    monkeypatch.setattr(RayEngine, "hooks", Hooks(forward=_slow_forward_in(str(pid_file))))
    killer = threading.Thread(target=preempt, daemon=True)
    killer.start()
    s = extract_ray(
        inputs,
        out,
        model=str(tiny_qwen3_vl),
        commit_every=3600,
        max_batch_tokens=32,  # one image per forward
    )
    killer.join(timeout=150)
    assert seen.get("committed_at_exit", 0) >= 2, seen  # the two forwards before the signal, at least
    index = pq.read_table(out / "index", columns=["id"]).column("id").to_pylist()
    assert sorted(index) == sorted(set(index)) and len(index) == 12  # every sample committed once
    assert (s.extracted, s.failed, s.stopped) == (12, 0, None)
    extract(inputs, tmp_path / "local", model=str(tiny_qwen3_vl), num_workers=0)
    assert compare_caches(tmp_path / "local", out) == []


RAY_DRIVER = """
import functools, os, sys, time
from vlfast.extraction.engines.base import Hooks
from vlfast.extraction.engines.ray import RayEngine

def slow(pid_file, batch):  # runs in the model actor: pickled by value from __main__
    with open(pid_file, "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(0.1)

RayEngine.hooks = Hooks(forward=functools.partial(slow, sys.argv.pop(1)))
from vlfast.cli.main import main

sys.argv = ["vlfast", "extract", *sys.argv[1:]]
main()
"""


@pytest.mark.slow
def test_sigterm_to_the_ray_driver_stops_the_job_with_its_work_committed(
    ray_cluster, tiny_qwen3_vl, tmp_path
):
    """The real command on the test's cluster, SIGTERMed while its model actor holds uncommitted samples
    (--commit-every 3600): the driver stops the dataset, waits for the actor to finish what it was given,
    commit and release its rank, says so and exits 143; the next run extracts only the rest and ends equal to
    the local engine. It runs on the local engine, in this process: what is done is OUT's to say, and the Ray
    engine's own resume is the killed job's test above (a Ray job's actors take seconds of CPU to start)."""
    from vlfast.extraction.api import extract
    from vlfast.extraction.store.writer import rank_is_held

    n = 24
    inputs = tmp_path / "in"
    make_images(inputs, [(32 + 8 * (k % 4), 32) for k in range(n)])
    (tmp_path / "driver.py").write_text(RAY_DRIVER)
    out, pid_file = tmp_path / "ray", tmp_path / "forwards"
    cmd = [
        sys.executable, str(tmp_path / "driver.py"), str(pid_file), str(inputs), str(out),
        "-m", str(tiny_qwen3_vl), "--engine", "ray",
        "--ray-address", ray_cluster.get_runtime_context().gcs_address,
        "--commit-every", "3600", "--batch-tokens", "32",
    ]  # fmt: skip
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not pid_file.exists() or len(pid_file.read_text().split()) < 3:
            assert job.poll() is None, job.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no third forward in 180 s"
            time.sleep(0.05)
        assert not (out / "index").exists() or len(FeatureCache(out)) == 0  # nothing committed yet
        job.send_signal(signal.SIGTERM)
        _, stderr = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 143, stderr[-3000:]
    assert "terminated (SIGTERM)" in stderr
    assert "core_worker.cc" not in stderr  # Ray's C++ actor-restart alarm, spent out of sight
    committed = len(FeatureCache(out))
    # The dataset stops; what the model actor had been given (its call in flight, and those Ray Data had
    # queued on it: here all of them) is finished and committed before the driver exits.
    assert committed >= 3
    assert not any(rank_is_held(out, r) for r in (0, 1))

    s = extract(inputs, out, model=str(tiny_qwen3_vl), num_workers=0)
    assert (s.skipped, s.extracted, s.failed) == (committed, n - committed, 0)
    extract(inputs, tmp_path / "local", model=str(tiny_qwen3_vl), num_workers=0)
    assert compare_caches(tmp_path / "local", out) == []


def _bug_on(sample_id: str):
    def decode(sample):
        if sample.id == sample_id:
            sample.no_such_attribute  # noqa: B018 - a refactor's typo, in the decode actor

    return decode


@pytest.mark.slow
def test_a_bug_while_decoding_on_ray_leaves_the_sample_undone(
    ray_cluster, tiny_qwen3_vl, tmp_path, monkeypatch
):
    """As on the local engine: the decode actor's unexpected exception reaches the driver as such; nothing is
    recorded for the sample, it is not done, and it is not taken for a sample lost with an actor."""
    from ray import cloudpickle

    from vlfast.extraction.api import extract_ray

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    inputs = tmp_path / "in"
    make_images(inputs, [(32 + 8 * (k % 3), 32) for k in range(5)])
    (inputs / "zz-bad.png").write_text("not an image")
    out = tmp_path / "ray"
    with (
        pytest.warns(RuntimeWarning, match=r"unexpected error \(.*AttributeError"),
        monkeypatch.context() as mp,
    ):
        mp.setattr(RayEngine, "hooks", Hooks(decode=_bug_on("img0002.jpg")))
        s = extract_ray(inputs, out, model=str(tiny_qwen3_vl))
    assert (s.extracted, s.failed, s.unexpected, s.stopped) == (4, 1, 1, None)
    cache = FeatureCache(out)
    assert "img0002.jpg" not in set(cache.ids()) and [e["id"] for e in cache.errors()] == ["zz-bad.png"]
    # The next run extracts it: what is done is OUT's to say, whichever engine reads it (the local one here,
    # the command in this process: a Ray job's actors take seconds to start; the Ray engine's resume is tested
    # above).
    r = runner.invoke(
        app, ["extract", str(inputs), str(out), "-m", str(tiny_qwen3_vl), "--workers", "0", "--json"]
    )
    assert r.exit_code == 0, r.output
    again = json.loads(r.stdout)
    assert (again["extracted"], again["unexpected"]) == (1, 0)


@pytest.mark.slow
def test_embeddings_through_ray_equal_the_local_engine(ray_cluster, media_dir, tiny_qwen3_vl, tmp_path):
    """Text rows (no media) and each row's text and instruction cross Ray's sample and decoded schemas:
    the same embeddings and meta as the local engine. One sample per forward in both: a padded batch's
    matmuls differ from a lone row's in their last bits (the parity tests bound that), which would hide
    nothing here but make "the same" approximate."""
    import warnings

    from vlfast.extraction.api import extract, extract_ray

    rows = [
        {"id": "img", "path": str(media_dir / "good" / "rgb.jpg"), "text": "a picture"},
        {"id": "txt", "text": "words alone", "instruction": "Find the picture"},
        {"id": "none", "text": ""},
    ]
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    options = dict(model=str(tiny_qwen3_vl), features="embedding", dim=64, max_batch_samples=1)
    extract(manifest, tmp_path / "local", num_workers=0, **options)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        ray = extract_ray(manifest, tmp_path / "ray", ray_workers=1, **options)
    # The actor's own probe of its CPU (the real one): MKL_CBWR reached it, and it says what this process
    # measures (products keep their bits across thread counts, or not), which the driver says once
    from vlfast.numerics import threads_keep_their_bits

    bits = [str(w.message) for w in said if "bits" in str(w.message)]
    assert len(bits) == (0 if threads_keep_their_bits() else 1), bits
    assert (ray.extracted, ray.failed) == (2, 1)
    assert compare_caches(tmp_path / "local", tmp_path / "ray") == []
    assert FeatureCache(tmp_path / "ray").meta("txt")["instruction"] == "Find the picture."
