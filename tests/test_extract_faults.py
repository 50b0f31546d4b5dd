"""The issue's acceptance run: 100 manifest entries, 10 of them poisoned (a decoder that kills its worker,
one that hangs, a lone-surrogate id, a bad JSON line, a truncated video; two of each; and two good ones
that a flaky store fails until the last run, recorded as transient and retried), through the real
``vlfast extract`` command, SIGKILLed twice and SIGTERMed once mid-run and resumed: the 90 good samples end
byte-identical to an uninterrupted run and each poisoned entry is recorded exactly once with a clear reason."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from PIL import Image

from _selftest import compare_caches
from vlfast.demo import make_video, pattern
from vlfast.extraction import FeatureCache
from vlfast.extraction.store.format import read_errors

pytestmark = pytest.mark.slow

DRIVER = textwrap.dedent(
    """
    # vlfast-fault-driver: `vlfast extract` with a decoder that crashes or hangs on chosen ids.
    import functools, os, signal, sys, time
    from vlfast.extraction.engines.base import Hooks
    from vlfast.extraction.engines.local import LocalEngine

    def decode(sample):
        if sample.id in ("good-000", "good-001") and not os.environ.get("VLFAST_STORE_HEALED"):
            from vlfast.extraction.objstore import TransientReadError  # a store that answers 503 SlowDown

            raise TransientReadError(f"transient storage error: cannot read {sample.source} (SlowDown)")
        if sample.id.startswith("crash"):
            os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer or a segfaulting decoder does
        if sample.id.startswith("hang"):
            time.sleep(3600)  # a decoder stuck on a corrupt stream

    forwards = []

    def forward(batch):
        forwards.append(len(batch))
        print(f"forward {len(forwards)}", flush=True)

    LocalEngine.hooks = Hooks(decode=decode, forward=forward)
    from vlfast.cli.main import main

    sys.argv = ["vlfast", "extract", *sys.argv[1:]]
    main()
    """
)


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("faults")
    lines = []
    for k in range(84):
        path = root / "img" / f"{k:03d}.png"
        path.parent.mkdir(exist_ok=True)
        Image.fromarray(pattern(48 + k % 5 * 8, 64, k)).save(path)
        lines.append(json.dumps({"id": f"good-{k:03d}", "path": str(path)}))
    for k in range(6):
        clip = make_video(root / "vid" / f"{k}.mp4", frames=6, fps=3, width=64, height=48, seed=k)
        lines.append(json.dumps({"id": f"clip-{k}", "path": str(clip)}))
    some_image = root / "img" / "000.png"
    for k in range(2):
        lines.insert(10 + 30 * k, json.dumps({"id": f"crash-{k}", "path": str(some_image)}))
        lines.insert(20 + 30 * k, json.dumps({"id": f"hang-{k}", "path": str(some_image)}))
        lines.insert(25 + 30 * k, json.dumps({"id": f"bad\ud800id-{k}", "path": str(some_image)}))
        lines.insert(35 + 30 * k, '{"id": "broken-' + str(k) + '", "path": ')  # a line cut short
        video = make_video(root / "cut" / f"{k}.mp4", frames=30, fps=10, width=64, height=48, seed=9)
        video.write_bytes(video.read_bytes()[: video.stat().st_size // 2])
        lines.insert(45 + 30 * k, json.dumps({"id": f"truncated-{k}", "path": str(video)}))
    assert len(lines) == 100
    path = root / "clips.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    (root / "driver.py").write_text(DRIVER)
    return path


def _cmd(manifest: Path, model: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        str(manifest.parent / "driver.py"),
        str(manifest),
        str(out),
        "--model",
        str(model),
        "--workers",
        "2",
        "--decode-timeout",
        "2",
        "--commit-every",
        "0.2",
        "--batch-tokens",
        "700",
        "--json",
    ]


def _env() -> dict[str, str]:
    return os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}


def _summary(stdout: str) -> dict:
    return json.loads(stdout[stdout.index("{") :])


def _orphans(manifest: Path) -> list[psutil.Process]:
    driver = str(manifest.parent / "driver.py")
    return [p for p in psutil.process_iter(["cmdline"]) if driver in (p.info["cmdline"] or [])]


def _poisoned_decode(sample) -> None:
    """The driver's decoder with the store healed, for the uninterrupted run in this process: it runs in the
    forked decode workers (``num_workers=2``), never in this process, so its kill and its hang are theirs."""
    if sample.id.startswith("crash"):
        os.kill(os.getpid(), signal.SIGKILL)
    if sample.id.startswith("hang"):
        time.sleep(3600)


# An old OUT's resume was this pass's check that a resume equals a fresh run under other kernels; a
# poisoned manifest's resume is now (earlier development formats are refused, issue 52)
@pytest.mark.cpu_kernels
def test_poisoned_manifest_killed_twice_resumes_to_the_clean_result(manifest, tiny_qwen3_vl, tmp_path):
    from vlfast.extraction.api import extract
    from vlfast.extraction.engines.base import Hooks
    from vlfast.extraction.engines.local import LocalEngine

    ref, out = tmp_path / "ref", tmp_path / "out"
    healed = _env() | {"VLFAST_STORE_HEALED": "1"}  # the killed runs meet a flaky store (two samples)
    # The uninterrupted run, in this process with _cmd's options (the kills are what need processes of their
    # own; a fresh interpreter for the reference cost ~8 s of CPU, most of it importing torch and transformers).
    clean = extract(
        manifest,
        ref,
        model=str(tiny_qwen3_vl),
        num_workers=2,
        decode_timeout=2,
        commit_every=0.2,
        max_batch_tokens=700,
        engine=LocalEngine(Hooks(decode=_poisoned_decode)),
        progress=False,
    )
    assert (clean.extracted, clean.failed, clean.total) == (90, 10, 100), clean
    assert clean.skipped + clean.extracted + clean.failed == clean.assigned == 100

    rng = random.Random(int(os.environ.get("VLFAST_CRASH_SEED", "20261123")))
    # Killed twice and preempted once between them: SIGTERM commits what is done and exits 143.
    for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGKILL):
        before = len(FeatureCache(out)) if (out / "index").exists() else 0
        p = subprocess.Popen(
            _cmd(manifest, tiny_qwen3_vl, out),
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if sig == signal.SIGTERM else None,
            text=True,
        )
        # A clean run makes about 43 forwards, and the tiny model makes several more in a tenth of a second:
        # three runs killed at up to 12 forwards plus 0.3 s could finish the job before the last kill.
        target = rng.randint(2, 8)
        for line in p.stdout:
            if line.startswith("forward ") and int(line.split()[1]) >= target:
                break
        time.sleep(rng.uniform(0, 0.1))
        assert p.poll() is None, "the run ended before the kill"
        os.kill(p.pid, sig)
        p.wait(timeout=30)
        p.stdout.close()
        if sig == signal.SIGTERM:
            stderr = p.stderr.read()
            p.stderr.close()
            assert p.returncode == 143, stderr[-3000:]
            assert "terminated (SIGTERM)" in stderr
            assert len(FeatureCache(out)) > before  # what it had extracted is committed
        # Workers die with their parent, hung decoders included.
        deadline = time.monotonic() + 10
        while _orphans(manifest) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _orphans(manifest), "a decode worker outlived the killed run"
    partial = len(FeatureCache(out))
    assert 0 < partial < 90
    transient = {r["id"] for r in read_errors(out) if r["kind"] == "transient"}
    assert transient == {"good-000", "good-001"} and not transient & set(FeatureCache(out).ids())

    final = subprocess.run(
        _cmd(manifest, tiny_qwen3_vl, out), env=healed, capture_output=True, text=True, timeout=600
    )
    assert final.returncode == 0, final.stderr[-3000:]  # bad entries are recorded, not fatal: exit 0
    resumed = _summary(final.stdout)
    assert resumed["skipped"] + resumed["extracted"] + resumed["failed"] == resumed["assigned"] == 100
    assert resumed["skipped"] >= partial

    assert compare_caches(ref, out) == []  # ids, dtype, shape, bytes and meta of all 90; the error records
    cache = FeatureCache(out)
    assert len(cache) == 90 and cache.verify().ok
    records = cache.errors()
    reasons = {}
    for rec in records:
        reasons.setdefault(rec["id"], []).append(rec["reason"])
    assert len(records) == 10 and all(len(v) == 1 for v in reasons.values()), reasons
    by_prefix = {sid.split("-")[0].split("\\")[0]: r[0] for sid, r in reasons.items()}
    assert by_prefix["crash"].startswith(
        "worker died while decoding this sample: killed by signal 9 (SIGKILL)"
    )
    assert "longer than 2 s (--decode-timeout" in by_prefix["hang"]
    assert "truncated or corrupt video" in by_prefix["truncated"]
    bad_rows = {r["source"]: r["reason"] for r in records if r["kind"] == "input"}
    assert len(bad_rows) == 4 and all("clips.jsonl line" in where for where in bad_rows)
    assert sum("lone surrogate" in r for r in bad_rows.values()) == 2
    assert sum("not valid JSON" in r for r in bad_rows.values()) == 2
