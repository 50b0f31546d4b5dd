"""The store never serves damaged or foreign data silently: every fault here is injected into real files.

Flipped bytes in a tensor, a shard header, an index part or an error line; a truncated shard; a deleted or
replaced run.json; --overwrite through symlinked folders; a read-only OUT; the umask; commits by time.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from _selftest import compare_caches, fake_features
from vlfast.cli.main import app
from vlfast.extraction import FeatureCache, FeatureStore, RunConfigMismatch
from vlfast.extraction.store.format import (
    DamagedFile,
    OutputInUse,
    OutputNotWritable,
    read_errors,
    read_index_part,
)
from vlfast.extraction.store.integrity import check_folder, check_part
from vlfast.extraction.store.writer import read_state

CFG = {"model": "m", "dtype": "bfloat16", "processor": {"max_pixels": 1024}, "versions": {"torch": "2.13"}}
IDS = [f"s{i}" for i in range(9)]


def _fill(out: Path, ids=IDS, cfg=CFG, **kw) -> None:
    with FeatureStore(out, cfg, shard_max_samples=3, **kw) as s:
        for sid in ids:
            s.add(sid, fake_features(sid), {"path": f"{sid}.mp4"})


def _resume(out: Path, ids=IDS, **kw) -> FeatureStore:
    """Re-run the "extraction": open the store, add what is not done, close."""
    with FeatureStore(out, CFG, shard_max_samples=3, **kw) as s:
        for sid in ids:
            if sid not in s.done_ids():
                s.add(sid, fake_features(sid), {"path": f"{sid}.mp4"})
    return s


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x04
    path.write_bytes(bytes(data))


@pytest.fixture
def ref(tmp_path: Path) -> Path:
    _fill(tmp_path / "ref")
    return tmp_path / "ref"


def test_flipped_byte_in_a_tensor_is_caught(tmp_path: Path, ref: Path) -> None:
    out = tmp_path / "out"
    _fill(out)
    info = FeatureCache(out).info("s4")
    tokens = next(f for f in info["features"] if f["name"] == "tokens")
    shard = out / info["shard"]
    _flip(shard, tokens["offset"] + 5)

    # Plain reads stay fast and do not hash; verify=True hashes each tensor read and names what is wrong.
    assert not torch.equal(FeatureCache(out)["s4"]["tokens"], fake_features("s4")["tokens"])
    with pytest.raises(DamagedFile, match=r"feature 'tokens' of sample 's4' in .*shard-r00000-000001"):
        FeatureCache(out, verify=True)["s4"]
    FeatureCache(out, verify=True)["s3"]  # its neighbours in the same shard are fine

    report = FeatureCache(out).verify()
    assert not report.ok and [(b["id"], b["feature"]) for b in report.bad_samples] == [("s4", "tokens")]
    assert report.samples == len(IDS) and report.bytes_checked > 0

    r = CliRunner().invoke(app, ["out", "verify", str(out)])
    assert r.exit_code == 1, r.output
    assert "s4" in r.output and "tokens" in r.output and "Damaged" in r.output
    r = CliRunner().invoke(app, ["out", "verify", str(out), "--json"])
    assert r.exit_code == 1 and json.loads(r.stdout)["bad_samples"][0]["id"] == "s4"

    # A quick resume check does not read the data, so it does not see this (documented); the full one does.
    s = FeatureStore(out, CFG, resume_check="quick")
    assert s.done_ids() == set(IDS) and not s.quarantined
    s.close()
    with pytest.warns(UserWarning, match="fail their checksum"):
        s = _resume(out)
    assert [q["ids"] for q in s.quarantined] == [["s3", "s4", "s5"]]
    assert compare_caches(ref, out) == [] and check_folder(out).ok
    assert CliRunner().invoke(app, ["out", "verify", str(out)]).exit_code == 0


def test_truncated_shard_is_named_and_redone(tmp_path: Path, ref: Path) -> None:
    out = tmp_path / "out"
    _fill(out)
    shard = out / "shards" / "shard-r00000-000002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    c = FeatureCache(out)
    assert torch.equal(c["s0"]["mean"], fake_features("s0")["mean"])  # other shards still read
    with pytest.raises(DamagedFile, match=r"shard-r00000-000002.*truncated or replaced.*sample 's6'"):
        c["s6"]
    state = read_state(out, CFG)
    assert state.damaged and not {"s6", "s7", "s8"} & state.done
    report = check_folder(out)
    assert sorted(b["id"] for b in report.bad_samples) == ["s6", "s7", "s8"]
    with pytest.warns(UserWarning, match="truncated"):
        s = _resume(out, resume_check="quick")  # sizes are checked even by the quick check
    assert len(s.quarantined) == 1
    moved = next((out / "quarantine").iterdir())
    assert (moved / shard.name).exists() and json.loads((moved / "reason.json").read_text())["ids"] == [
        "s6",
        "s7",
        "s8",
    ]
    assert compare_caches(ref, out) == []


def test_every_byte_of_a_shard_and_its_part_is_covered(tmp_path: Path) -> None:
    """Flip each byte of a small shard in turn: the full check must fail every time. Same for the part
    (its footer wholly, the rest sampled: its name's hash covers every byte alike)."""
    out = tmp_path / "out"
    with FeatureStore(out, CFG) as s:
        s.add("a", {"x": torch.arange(6, dtype=torch.int16), "y": torch.ones(2, dtype=torch.bfloat16)})
        s.add("b", {"x": torch.zeros(3)})
    shard = next((out / "shards").iterdir())
    part = next((out / "index").iterdir())
    original = shard.read_bytes()
    for offset in range(len(original)):
        _flip(shard, offset)
        check = check_part(part, data=True)
        assert not check.ok, f"a flipped byte at {offset} of {len(original)} went unnoticed"
        shard.write_bytes(original)
    original = part.read_bytes()
    # Every 7th byte, and every byte of the footer (Parquet's metadata, which has no checksum of its own)
    for offset in sorted(set(range(0, len(original), 7)) | set(range(len(original) - 600, len(original)))):
        _flip(part, offset)
        with pytest.raises(DamagedFile):
            read_index_part(part)
        part.write_bytes(original)
    assert check_part(part, data=True).ok


def test_damaged_index_part_is_moved_aside(tmp_path: Path, ref: Path) -> None:
    out = tmp_path / "out"
    _fill(out)
    part = sorted((out / "index").iterdir())[1]
    _flip(part, 40)
    with pytest.raises(DamagedFile, match="do not match the checksum in its name"):
        FeatureCache(out)
    with pytest.warns(UserWarning, match="moved to"):
        s = _resume(out, resume_check="quick")
    assert s.quarantined[0]["ids"] == ["s3", "s4", "s5"]  # named from the shard's header
    assert compare_caches(ref, out) == []


def test_deleted_run_json_still_refuses_another_configuration(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _fill(out)
    (out / "run.json").unlink()
    changed = CFG | {"processor": {"max_pixels": 2048}}
    with pytest.raises(
        RunConfigMismatch, match=r"processor.max_pixels: 1024 in .*part-r00000-000000.*missing"
    ):
        FeatureStore(out, changed)
    with pytest.raises(RunConfigMismatch):
        read_state(out, changed)  # the read-only preflight refuses it too, before any model is loaded
    assert not (out / "run.json").exists()
    with FeatureStore(out, CFG | {"versions": {"torch": "9"}}) as s:  # same meaning: resumes
        assert s.done_ids() == set(IDS)
    assert json.loads((out / "run.json").read_text())["config"]["processor"] == {"max_pixels": 1024}


def test_replaced_run_json_is_caught_by_what_the_shards_carry(tmp_path: Path) -> None:
    out, other = tmp_path / "out", tmp_path / "other"
    changed = CFG | {"model": "fine-tuned"}
    _fill(out)
    FeatureStore(other, changed).close()
    shutil.copy(other / "run.json", out / "run.json")  # someone "fixes" the folder by hand
    with pytest.raises(RunConfigMismatch, match="model: 'm' in .*part-r00000-000000"):
        FeatureStore(out, changed)
    with pytest.raises(DamagedFile, match="mixes two runs"):
        FeatureCache(out)
    assert check_folder(out).other_config_parts


def test_damaged_error_line_is_not_trusted(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with FeatureStore(out, CFG) as s:
        s.add_error("s1", "s1.mp4", "decode failed")
        s.add_error("s2", "s2.mp4", "decode failed")
    path = out / "errors" / "errors-r00000.jsonl"
    text = path.read_text()
    path.write_text(text.replace('"id": "s1"', '"id": "s7"', 1))  # a flipped bit that still parses
    assert [e["id"] for e in read_errors(out)] == ["s2"]  # s7 is not silently skipped, s1 will be redone
    assert check_folder(out).damaged_error_lines == 1
    with FeatureStore(out, CFG) as s:
        assert s.done_ids() == {"s2"}


@pytest.mark.parametrize("link", ["index", "shards", "errors"])
def test_overwrite_through_a_symlinked_folder(tmp_path: Path, link: str) -> None:
    out, target = tmp_path / "out", tmp_path / "elsewhere"
    target.mkdir()
    (target / "notes.txt").write_text("not ours")
    out.mkdir()
    (out / link).symlink_to(target, target_is_directory=True)
    _fill(out)
    with FeatureStore(out, CFG) as s:
        s.add_error("zz", "zz.mp4", "decode failed")
    changed = CFG | {"model": "other"}
    FeatureStore(out, changed, overwrite=True).close()
    assert (out / link).is_symlink() and (target / "notes.txt").exists()
    assert sorted(p.name for p in target.iterdir()) == ["notes.txt"]  # everything old is gone
    c = FeatureCache(out)
    assert len(c) == 0 and c.errors() == [] and c.run_config["model"] == "other"


def test_overwrite_with_a_dangling_symlink(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _fill(out)
    shutil.rmtree(out / "shards")
    (out / "shards").symlink_to(tmp_path / "gone", target_is_directory=True)
    FeatureStore(out, CFG, overwrite=True).close()
    assert (out / "shards").is_dir() and len(FeatureCache(out)) == 0


def test_commit_every_seconds(tmp_path: Path) -> None:
    with FeatureStore(tmp_path, CFG, commit_every=0.2) as s:
        s.add("a", fake_features("a"))
        assert len(FeatureCache(tmp_path)) == 0  # buffered
        time.sleep(0.25)
        s.tick()  # the pipeline ticks between samples; add and add_error tick too
        assert FeatureCache(tmp_path).ids() == ["a"]
        s.add("b", fake_features("b"))
        time.sleep(0.25)
        s.add_error("c", "c.mp4", "decode failed")
        assert FeatureCache(tmp_path).ids() == ["a", "b"]
    with FeatureStore(tmp_path / "n", CFG, commit_every=None) as s:
        s.add("a", fake_features("a"))
        time.sleep(0.25)
        s.tick()
        assert len(FeatureCache(tmp_path / "n")) == 0
    # commit_every=0 is refused by ExtractConfig, which checks the store's options once
    # (test_extract_config.py::test_how_out_is_written_is_checked_once_by_the_config)


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_written_files_honour_the_umask(tmp_path: Path, mask: int) -> None:
    old = os.umask(mask)
    try:
        with FeatureStore(tmp_path, CFG) as s:
            s.add("a", fake_features("a"))
            s.add_error("b", "b.mp4", "decode failed")
    finally:
        os.umask(old)
    files = [p for sub in ("shards", "index", "errors") for p in (tmp_path / sub).iterdir()]
    files.append(tmp_path / "run.json")
    assert {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o666 & ~mask}, files


def test_output_in_use_and_not_a_folder(tmp_path: Path) -> None:
    s = FeatureStore(tmp_path / "out", CFG)
    with pytest.raises(OutputInUse, match="already writing rank 0"):
        FeatureStore(tmp_path / "out", CFG)
    s.close()
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="not a folder"):
        FeatureStore(tmp_path / "file", CFG)


def test_read_only_out_simulated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An EROFS from the filesystem becomes OutputNotWritable (exit 2); reading needs no write at all."""
    import errno

    out = tmp_path / "out"
    _fill(out)
    real_mkdir = Path.mkdir

    def read_only_mkdir(self, *a, **kw):
        if str(self).startswith(str(out)):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *a, **kw)

    monkeypatch.setattr(Path, "mkdir", read_only_mkdir)
    with pytest.raises(OutputNotWritable, match="read-only filesystem.*FeatureCache"):
        FeatureStore(out, CFG)
    assert len(FeatureCache(out)) == len(IDS) and read_state(out, CFG).done == set(IDS)


def _can_mount_read_only(path: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    cmd = f"mount --bind {path} {path} && mount -o remount,ro,bind {path} && ! touch {path}/.probe"
    return subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True).returncode == 0


def test_read_only_filesystem_for_real(tmp_path: Path) -> None:
    """The same on a real read-only bind mount (a private mount namespace; needs root, as CI runs)."""
    out = tmp_path / "out"
    _fill(out)
    if not _can_mount_read_only(out):
        pytest.skip("cannot make a private read-only bind mount here (needs unshare and root)")
    code = textwrap.dedent(
        f"""
        from vlfast.extraction import FeatureCache, FeatureStore
        from vlfast.extraction.store.format import OutputNotWritable
        from vlfast.extraction.store.writer import read_state
        out = {str(out)!r}
        assert len(FeatureCache(out)) == 9 and FeatureCache(out).verify().ok
        assert len(read_state(out, {CFG!r}).done) == 9
        try:
            FeatureStore(out, {CFG!r})
        except OutputNotWritable as e:
            print("refused:", e)
        """
    )
    script = tmp_path / "ro.py"
    script.write_text(code)
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = f"mount --bind {out} {out} && mount -o remount,ro,bind {out} && {sys.executable} {script}"
    r = subprocess.run(
        ["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True, env=env, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "refused:" in r.stdout and "read-only" in r.stdout


def _other_run(out: Path, cfg: dict, negate: bool) -> None:
    """The same ids into another OUT: with ``negate`` the features of other weights (same dtypes, shapes and
    so the same shard sizes), else the very same tensors written under another torch (a version string of
    the same length, so the same shard size). The header must differ by content: safetensors writes its
    metadata keys in a random order, so two runs' headers differ by chance alone, and were equal in 1 CI run."""
    from vlfast.extraction.store import writer

    versions = writer.library_versions()
    if not negate:
        torch_version = versions["torch"]
        versions["torch"] = torch_version[:-1] + ("0" if torch_version[-1] != "0" else "1")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(writer, "library_versions", lambda: dict(versions))
        with FeatureStore(out, cfg, shard_max_samples=3) as s:
            for sid in IDS:
                feats = fake_features(sid)
                if negate:
                    feats = {k: -v if v.is_floating_point() else v for k, v in feats.items()}
                s.add(sid, feats, {"path": f"{sid}.mp4"})


@pytest.mark.parametrize(
    ("cfg", "negate", "caught_by"),
    [
        (CFG | {"weights": "fine-tuned"}, True, "made with another configuration"),
        (CFG | {"versions": {"torch": "9"}}, False, "not the shard its index part was written with"),
    ],
    ids=["other-weights", "same-config-other-header"],
)
def test_a_swapped_shard_is_refused_by_a_plain_read(
    tmp_path: Path, ref: Path, cfg, negate, caught_by
) -> None:
    """A same-named shard of another run (same inputs, same size, same ids in its header) put in place of a
    committed one: every plain read refuses it, DataLoader workers included; the resume moves it aside."""
    import traceback

    out, other = tmp_path / "out", tmp_path / "other"
    _fill(out)
    _other_run(other, cfg, negate)
    name = "shards/shard-r00000-000001.safetensors"
    assert (other / name).stat().st_size == (out / name).stat().st_size
    shutil.copy(other / name, out / name)

    cache = FeatureCache(out)
    assert torch.equal(cache["s0"]["tokens"], fake_features("s0")["tokens"])  # other shards still read
    with pytest.raises(
        DamagedFile, match=rf"shard-r00000-000001.*{caught_by}.*'s4'.*Run the same `vlfast extract`"
    ):
        cache["s4"]
    loader = torch.utils.data.DataLoader(
        FeatureCache(out), batch_size=3, num_workers=2, collate_fn=list, multiprocessing_context="fork"
    )
    with pytest.raises(DamagedFile, match=rf"shard-r00000-000001.*{caught_by}") as refused:
        list(loader)
    # Its workers stop now: left to a garbage collection, the loader's iterator waited 5 s for each of them.
    traceback.clear_frames(refused.tb)

    assert read_state(out, CFG).damaged == [sorted(p.name for p in (out / "index").iterdir())[1]]
    with pytest.warns(UserWarning, match="moved to"):
        _resume(out, resume_check="quick")
    assert compare_caches(ref, out) == []


_READER = """
import os, sys
import torch  # the aborts were seen with torch loaded
import pyarrow.parquet
from vlfast.extraction import FeatureCache

# Import torch once, then fork 6 readers, 3 at a time: each child reads OUT and then ends the script
# normally, through the interpreter's own teardown (where the aborts happened); the parent reports how.
def wait(pid):
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


statuses, children = [], []
for k in range(6):
    if k and k % 3 == 0:
        statuses += [wait(pid) for pid in children]
        children = []
    pid = os.fork()
    if pid == 0:
        tasks = lambda: set(os.listdir("/proc/self/task"))
        before = tasks()
        cache = FeatureCache(sys.argv[1])
        for i in range(len(cache)):
            cache[i]
        names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in tasks() - before]
        # jemalloc's background thread is plain C: it never enters Python or C++ teardown
        line = "new threads: %s\\n" % [n for n in names if n != "jemalloc_bg_thd"]
        os.write(1, line.encode())  # one write: the children share the pipe
        break
    children.append(pid)
else:
    statuses += [wait(pid) for pid in children]
    print("exit codes:", statuses, flush=True)
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc")
def test_reader_scripts_leave_no_arrow_threads_to_abort_at_exit(tmp_path: Path, ref: Path) -> None:
    """A script that reads OUT with FeatureCache and returns used to end now and then in SIGABRT (exit 134,
    "terminate called without an active exception"): pq.read_table goes through Arrow's dataset API, whose
    pool threads were still alive when the interpreter tore down. Index parts are now read on the calling
    thread, so a reader starts no Arrow thread at all, which each of 6 readers checks: that is what rules
    the race out on any host, loaded or not (20 readers beside two busy processes, as the test first had,
    only made the abort likelier to show before the fix, at 25-30 s of CPU). All end with exit 0."""
    script = tmp_path / "read.py"
    script.write_text(_READER)
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run(
        [sys.executable, str(script), str(ref)], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and "exit codes: " + str([0] * 6) in r.stdout, (r.stdout, r.stderr[-2000:])
    assert r.stdout.count("new threads: []") == 6, r.stdout


def test_the_record_of_full_checks_and_what_verify_does_to_it(tmp_path: Path) -> None:
    """OUT/checked.json lets a full check skip shards untouched since they passed; any write to a shard
    (even with its mtime put back) makes it hashed again. Damage no stamp shows (bytes decaying under the
    filesystem, simulated by recording the damaged shard as checked) is the record's documented blind spot:
    --verify still finds it and drops it from the record, so its advice, the same command, then repairs it."""
    from vlfast.extraction.store.integrity import HashRecord
    from vlfast.extraction.store.resume import confirm_hashed

    out = tmp_path / "out"
    _fill(out)
    time.sleep(0.05)  # past the filesystem's timestamp tick: shards this fresh are not recorded
    state = read_state(out, CFG)
    assert confirm_hashed(out, state) == []
    record = json.loads((out / "checked.json").read_text())["parts"]
    assert sorted(record) == sorted(p.name for p in (out / "index").iterdir())

    info = FeatureCache(out).info("s4")
    shard, part = out / info["shard"], sorted((out / "index").iterdir())[1]
    st = shard.stat()
    _flip(shard, info["features"][0]["offset"] + 1)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # the mtime put back: the ctime still moved
    assert confirm_hashed(out, read_state(out, CFG)) == [part.name]

    time.sleep(0.05)
    decayed = HashRecord(out, "r00000")  # as if the bytes had changed under the filesystem after a check
    decayed.hashed(part)
    decayed.save()
    assert confirm_hashed(out, read_state(out, CFG)) == []  # the blind spot, documented
    assert not check_folder(out).ok
    assert confirm_hashed(out, read_state(out, CFG)) == [part.name]  # --verify dropped it: found again
    assert not list(out.glob(".tmp-*"))  # no probe file left behind


def test_a_fifo_at_the_probe_path_does_not_stop_the_hash_record(tmp_path: Path) -> None:
    """The probe is opened read-write, as before the line cut (which made it write-only, and a write-only open
    of a FIFO waits for a reader: a hang). A stale probe of this pid is a crash's leftover, here a FIFO."""
    from vlfast.extraction.store.integrity import HashRecord

    out = tmp_path / "out"
    _fill(out)
    os.mkfifo(out / f".tmp-r00000-{os.getpid()}-checked.json")
    made = []
    opener = threading.Thread(target=lambda: made.append(HashRecord(out, "r00000")), daemon=True)
    opener.start()
    opener.join(30)
    assert made, "HashRecord hung opening the probe"


def test_a_shard_swapped_while_a_reader_runs_is_refused_when_opened_again(tmp_path: Path) -> None:
    """A reader skips the header read for a shard it opened before and that is unchanged since (its stat
    stamp): one swapped in meanwhile has another stamp, so opening it again checks and refuses it."""
    out, other = tmp_path / "out", tmp_path / "other"
    _fill(out)
    _other_run(other, CFG | {"versions": {"torch": "9"}}, negate=False)  # only the header bytes differ
    time.sleep(1.1)  # the reader only remembers headers whose ctime is over a second old
    cache = FeatureCache(out)
    assert torch.equal(cache["s4"]["tokens"], fake_features("s4")["tokens"])
    assert cache._header_ok  # remembered
    name = "shards/shard-r00000-000001.safetensors"
    shutil.copy(other / name, out / name)
    cache._handles.clear()  # as when more than 64 shards were opened since
    with pytest.raises(DamagedFile, match="shard-r00000-000001.*not the shard its index part"):
        cache["s4"]


@pytest.mark.parametrize("seed", range(4))
def test_rows_by_shard_gives_each_shards_rows_in_order(seed: int) -> None:
    """A shard's rows as a range when consecutive (as every writer leaves them), as positions when not
    (an index written otherwise): either way each shard's rows, ascending, and nothing for unused names."""
    import random

    import numpy as np
    import pyarrow as pa

    from vlfast.extraction.store.integrity import _rows_by_shard

    rnd = random.Random(seed)
    names = [f"shards/s{k}.safetensors" for k in range(5)]
    runs = [names[k] for k in range(5) for _ in range(rnd.randrange(1, 4))]
    shuffled = runs[:]
    rnd.shuffle(shuffled)
    for column in (runs, shuffled, runs[:1], []):
        expected = {n: [i for i, s in enumerate(column) if s == n] for n in set(column)}
        for array in (pa.array(column, pa.string()), pa.array(column, pa.string()).dictionary_encode()):
            if column:  # a dictionary with a name no row uses, as a row group's dictionary may hold
                array = pa.DictionaryArray.from_arrays(
                    array.dictionary_encode().indices,
                    pa.array([*array.dictionary_encode().dictionary.to_pylist(), "unused"]),
                )
            got = _rows_by_shard(array)
            assert {
                n: list(np.asarray(v) if not isinstance(v, range) else v) for n, v in got.items()
            } == expected
            if column is runs:
                assert all(isinstance(v, range) for v in got.values())


def test_a_pinned_header_is_trusted_for_the_layout_and_its_tensors_still_hashed(tmp_path: Path) -> None:
    """A header whose bytes match the checksum its part recorded is not compared with the index row by row
    (both pinned, they were compared when written): a full check then hashes the tensors at the index's
    offsets. A part that records no checksum of its shard's header is not the format's: refused as such."""
    from vlfast.extraction.store.format import committed_parts, read_header, xxh3
    from vlfast.extraction.store.integrity import _check_shard, _Verdict

    with FeatureStore(tmp_path, {"model": "m"}) as s:
        for sid in ("a", "b"):
            s.add(sid, fake_features(sid))
    (part,) = committed_parts(tmp_path)
    shard = next((tmp_path / "shards").iterdir())
    rows = read_index_part(part).column("features").to_pylist()
    with open(shard, "rb") as f:
        _, raw, _ = read_header(f, shard.stat().st_size)

    def check(header_hash, ids, data=True):
        verdict = _Verdict(part)
        return _check_shard(verdict, shard, lambda: ids, lambda: rows, None, header_hash, data), verdict

    problem, verdict = check(None, ["a", "b"])
    assert problem is not None and "no checksum of its header" in problem
    problem, verdict = check(xxh3(raw), ["a", "b"])
    assert problem is None and not verdict.bad and verdict.checked_bytes > 0
    problem, _ = check(xxh3(raw)[::-1], ["a", "b"])
    assert problem is not None and "damaged header" in problem
    moved = [[{**e, "offset": e["offset"] + 1} for e in row] for row in rows]  # index off by one byte
    verdict = _Verdict(part)
    _check_shard(verdict, shard, lambda: ["a", "b"], lambda: moved, None, xxh3(raw), True)
    assert verdict.bad  # hashed where the index says: the tensors fail their checksums
