"""What the commands print, run as a user runs them (a process of their own): Python warnings as one line
without a source location, no transformers deprecation notice, Ctrl-C said as SIGTERM is (what was committed,
how to resume), exit 130 in `extract -h`, and OUT's quarantine folder by its real name."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from typer.testing import CliRunner

from test_extract_runtime import DRIVER, _wait_for_forward
from vlfast.cli.main import app
from vlfast.extraction import FeatureCache

# Python's format: "/path/writer.py:469: UserWarning: ..." (or contextlib.py:81, engines/local.py:91, ...)
LOCATED = re.compile(r"\.py:\d+: \w*Warning\b")


def _env() -> dict[str, str]:
    # wide: rich folds a long path in a table cell at 80 columns
    return os.environ | {"PYTHONPATH": os.pathsep.join(sys.path), "COLUMNS": "400"}


def _vlfast(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "vlfast.cli.main", *args]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)


def _flip_tensor_byte(out: Path, sample_id: str) -> None:
    info = FeatureCache(out).info(sample_id)
    feat = max(info["features"], key=lambda f: f["nbytes"])
    shard = out / info["shard"]
    data = bytearray(shard.read_bytes())
    data[feat["offset"] + feat["nbytes"] // 2] ^= 0x10
    shard.write_bytes(bytes(data))


def test_a_quarantined_part_is_one_line_and_the_summary_names_the_folder(two, tiny_qwen3_vl, tmp_path):
    """Before: ``.../writer.py:374: UserWarning: ...`` with the source line under it, and the summary said
    "moved to OUT/quarantine"."""
    out = tmp_path / "features"
    cmd = ["extract", str(two), str(out), "-m", str(tiny_qwen3_vl), "--workers", "0"]
    first = _vlfast(*cmd)
    assert first.returncode == 0, first.stderr[-3000:]
    assert not LOCATED.search(first.stderr), first.stderr  # e.g. the RuntimeWarning about this CPU's bits
    _flip_tensor_byte(out, "rgb.jpg")
    r = _vlfast(*cmd)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not LOCATED.search(r.stderr), r.stderr
    warned = [line for line in r.stderr.splitlines() if "fail their checksum" in line]
    assert len(warned) == 1 and warned[0].startswith("vlfast: warning: "), r.stderr
    assert f"moved to {out / 'quarantine'} (the samples they held" in r.stdout, r.stdout
    assert "OUT/quarantine" not in r.stdout


def test_an_index_that_is_a_file_is_one_line(two, tiny_qwen3_vl, tmp_path):
    """Before: ``.../contextlib.py:81: UserWarning: index: index was a file, not a folder; ...``. Now a file
    where a folder belongs (a hand edit's doing) is refused, exit 2, in one line saying what to move."""
    out = tmp_path / "features"
    out.mkdir()
    (out / "index").write_text("not a folder")
    r = _vlfast("extract", str(two), str(out), "-m", str(tiny_qwen3_vl), "--workers", "0")
    assert r.returncode == 2, r.stderr[-3000:]
    assert not LOCATED.search(r.stderr), r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "index is a file where vlfast keeps a folder" in lines[0], r.stderr
    assert f"mv {out / 'index'} " in lines[0] and (out / "index").read_text() == "not a folder"


def test_a_warning_from_another_library_is_named_as_its_own(tmp_path):
    from vlfast.cli._warnings import _library

    assert _library("/usr/lib/python3/site-packages/torch/nn/modules/module.py") == "torch"
    assert _library("/venv/lib/python3.11/site-packages/vlfast/extraction/store/writer.py") is None
    assert _library("/usr/lib/python3.11/contextlib.py") is None  # vlfast's warning, raised in a with block
    script = tmp_path / "w.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, warnings
            from vlfast.cli._warnings import one_line_warnings
            one_line_warnings()
            warnings.warn("two\\n  lines", RuntimeWarning)
            """
        )
    )
    r = subprocess.run([sys.executable, str(script)], env=_env(), capture_output=True, text=True, timeout=60)
    assert r.stderr == "vlfast: warning: two lines\n"
    r = subprocess.run(
        [sys.executable, str(script)], env=_env() | {"VLFAST_DEBUG": "1"}, capture_output=True, text=True
    )
    assert LOCATED.search(r.stderr), r.stderr  # debugging keeps Python's format


def test_loading_a_tower_has_no_transformers_deprecation_notice(tiny_qwen3_vl):
    """`doctor --model` and `verify --model` load the tower so: transformers 5 said "`torch_dtype` is
    deprecated! Use `dtype` instead!" on every checkpoint."""
    code = f"from vlfast.models import load_vision_tower; load_vision_tower({str(tiny_qwen3_vl)!r})"
    r = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "deprecated" not in r.stderr, r.stderr


def test_doctor_has_no_deprecation_notice_nor_located_warning(tiny_qwen3_vl):
    r = _vlfast("doctor", "--model", str(tiny_qwen3_vl), "--budget", "5")
    assert r.returncode in (0, 1, 4), r.stderr[-3000:]
    assert "deprecated" not in r.stderr and not LOCATED.search(r.stderr), r.stderr


def test_extract_help_lists_exit_130():
    r = CliRunner().invoke(app, ["extract", "-h"])
    assert r.exit_code == 0
    said = " ".join(r.output.split())
    assert "130 Ctrl-C" in said and "143 SIGTERM" in said


def test_ctrl_c_says_what_was_committed_and_how_to_resume(tiny_qwen3_vl, tmp_path):
    """Before: Ctrl-C printed only "interrupted" (exit 130), where SIGTERM says what was committed."""
    from test_extract_runtime import make_images
    from vlfast.extraction.store.writer import rank_is_held

    inputs = tmp_path / "in"
    make_images(inputs, [(32 + 8 * (k % 4), 32) for k in range(24)])
    (tmp_path / "driver.py").write_text(DRIVER)
    out = tmp_path / "out"
    cmd = [
        sys.executable, str(tmp_path / "driver.py"), str(inputs), str(out), "-m", str(tiny_qwen3_vl),
        "--workers", "1", "--batch-tokens", "64", "--commit-every", "3600",
    ]  # fmt: skip
    # held after forward 6 until the signal is sent, and with SIGINT's default disposition as in a terminal: a
    # suite started in the background (`cmd &`) passes SIGINT on ignored, which Python and vlfast keep, as they
    # should (the run then finished, exit 0, ignoring the Ctrl-C)
    held = {"HOLD_AFTER": "6", "HOLD_UNTIL": str(tmp_path / "signalled")}
    p = subprocess.Popen(
        cmd,
        env=_env() | held,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    _wait_for_forward(p, 6)
    p.send_signal(signal.SIGINT)
    (tmp_path / "signalled").touch()
    _, stderr = p.communicate(timeout=120)  # a hang guard, not a speed bound
    assert p.returncode == 130, stderr[-3000:]
    said = " ".join(stderr.split())
    assert "interrupted (Ctrl-C): what was done is committed and OUT's locks are released" in said, said
    assert "run the same command to resume" in said
    assert 5 <= len(FeatureCache(out)) < 24
    assert not rank_is_held(out, 0)
