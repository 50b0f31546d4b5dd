"""Refusals and "nothing to do" answer without torch or transformers (issue 46 item 9).

A CUDA build of torch takes 6-9 s to import on a 2-core CPU and transformers seconds more
(docs/benchmarks.md, "Start-up"): a command that refuses its options, or finds nothing to do, must answer
before either is imported. Each command runs in a new process whose ``sys.meta_path`` starts with a finder
that raises on any import of torch or transformers (a lookup such as ``importlib.util.find_spec``, which
imports nothing, is let through); the command must exit as it would with them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vlfast.extraction import config as config_module

# Runs `vlfast ARGS` (sys.argv[1:]) with torch and transformers forbidden. PRETEND_GPU_BUILD makes the
# installed torch read as a CUDA build (the build every GPU user has, and pip's default on Linux), which this
# CPU-only test environment lacks.
_RUN = """
import sys

class Forbidden:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "transformers"):
            caller = sys._getframe(2).f_code.co_name  # an import, not a lookup: importlib's loader
            if caller == "_find_and_load_unlocked":
                raise ImportError(f"FORBIDDEN: {name} imported")
        return None

sys.meta_path.insert(0, Forbidden())
if PRETEND:
    import vlfast.extraction.config as c
    c.torch_gpu_build = lambda: True
sys.argv = ["vlfast", *sys.argv[1:]]
from vlfast.cli.main import main
main()
"""


def vlfast_without_torch(*args: str, pretend_gpu_build: bool = False, env: dict | None = None):
    return subprocess.run(
        [sys.executable, "-c", _RUN.replace("PRETEND", str(pretend_gpu_build)), *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def _no_torch(r: subprocess.CompletedProcess) -> str:
    output = r.stdout + r.stderr
    assert "FORBIDDEN" not in output, output
    return output


@pytest.fixture(scope="module")
def finished_out(tiny_qwen3_vl, media_dir, tmp_path_factory) -> tuple[Path, Path]:
    """A folder of two images extracted to the end, on this machine (its facts.json recorded)."""
    from vlfast.extraction import extract

    inputs = tmp_path_factory.mktemp("inputs")
    for image in sorted((media_dir / "good").glob("*.png"))[:2]:
        (inputs / image.name).write_bytes(image.read_bytes())
    out = tmp_path_factory.mktemp("finished") / "out"
    summary = extract(inputs, out, model=str(tiny_qwen3_vl), num_workers=0)
    assert summary.extracted == 2
    return inputs, out


def _gpu_visible() -> bool:
    no_gpu_here = getattr(config_module, "no_gpu_here", None)  # (a vlfast without it: the tests fail)
    return no_gpu_here is not None and not no_gpu_here()


@pytest.mark.skipif(_gpu_visible(), reason="this machine shows a GPU: torch decides the default device")
def test_nothing_to_do_with_a_cuda_build_and_no_gpu(finished_out, tiny_qwen3_vl):
    """The default device on a machine without a GPU is the CPU, told without importing a CUDA torch."""
    inputs, out = finished_out
    r = vlfast_without_torch("extract", inputs, out, "--model", tiny_qwen3_vl, pretend_gpu_build=True)
    assert r.returncode == 0 and "nothing to do" in _no_torch(r), r.stderr


def test_nothing_to_do_with_gpus_hidden_and_named_devices(finished_out, tiny_qwen3_vl):
    inputs, out = finished_out
    args = ["extract", inputs, out, "--model", tiny_qwen3_vl]
    r = vlfast_without_torch(*args, pretend_gpu_build=True, env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0 and "nothing to do" in _no_torch(r), r.stderr
    r = vlfast_without_torch(*args, "--device", "cpu", pretend_gpu_build=True)
    assert r.returncode == 0 and "nothing to do" in _no_torch(r), r.stderr


def test_extract_refusals(finished_out, tiny_qwen3_vl, tmp_path):
    inputs, out = finished_out
    for args, words in (
        (["--features", "pixels"], "unknown feature"),
        (["--dtype", "float64"], "dtype"),
        (["--device", "cuda:x"], "--device"),
    ):
        r = vlfast_without_torch("extract", inputs, tmp_path / "new", "--model", tiny_qwen3_vl, *args)
        assert r.returncode == 2 and words in _no_torch(r), (args, r.stderr)


def test_export_refuses_its_arguments_first(finished_out, tmp_path):
    _, out = finished_out
    for args, words in (
        ([out, tmp_path / "t.parquet", "--dtype", "float64"], "float64"),
        ([out, tmp_path / "t.csv", "--format", "csv"], "csv"),
        ([tmp_path / "missing", tmp_path / "t.parquet"], "missing"),
    ):
        r = vlfast_without_torch("export", *args)
        assert r.returncode == 2 and words in _no_torch(r), (args, r.stderr)


def test_export_refuses_a_feature_out_lacks_without_torch(finished_out, tmp_path):
    _, out = finished_out
    r = vlfast_without_torch("export", out, tmp_path / "t.parquet", "--feature", "nope")
    assert r.returncode == 2 and "nope" in _no_torch(r), r.stderr


def test_tokens_rewrite_is_text_only(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "<think>a</think> b"}) + "\n")
    out = tmp_path / "d2.jsonl"
    r = vlfast_without_torch(
        "tokens", "rewrite", "--map", "think=thinking", "--dataset", data, "--field", "text", "--out", out
    )
    assert r.returncode == 0, _no_torch(r)
    assert json.loads(out.read_text()) == {"text": "<thinking>a</thinking> b"}


def test_tokens_refusals(tmp_path):
    for args in (
        ["audit", "--model", tmp_path / "missing"],
        ["check-pipeline", "--model", tmp_path / "missing"],
    ):
        r = vlfast_without_torch("tokens", *args)
        assert r.returncode == 2 and "missing" in _no_torch(r), (args, r.stderr)


def test_check_pipelines_refusal_imports_no_numpy(tmp_path):
    """The refusal loads tokens.pipeline, whose module-level import of tokens.report (the line cut's) pulled
    in numpy through tokens.verdict; numpy waits for the checks that need it."""
    code = (
        "import sys; from vlfast.cli.main import main; sys.argv = ['vlfast', *sys.argv[1:]]\n"
        "try:\n    main()\nfinally:\n    print('numpy' in sys.modules)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, "tokens", "check-pipeline", "--model", str(tmp_path / "missing")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and "missing" in r.stderr, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "False", r.stdout


@pytest.mark.parametrize(
    "args, words",
    [
        (["doctor", "--model", "ref:nope"], "ref:nope"),
        (["doctor", "--dtype", "float64"], "float64"),
        (["doctor", "--device", "cuda:x"], "cuda:x"),
        (["verify", "--model", "ref:nope"], "ref:nope"),
        (["verify", "--model", "ref:qwen3-vl-4b", "--dtype", "float64"], "float64"),
        (["profile", "--model", "ref:nope"], "ref:nope"),
        (["profile", "--dtype", "float64"], "float64"),
    ],
)
def test_refusals_of_bad_options(args, words):
    r = vlfast_without_torch(*args)
    assert r.returncode == 2 and words in _no_torch(r), r.stderr


def test_no_gpu_here_from_plain_facts(tmp_path):
    """No GPU unless the machine shows a trace of one; CUDA_VISIBLE_DEVICES "" or "-1" hides them all."""
    assert config_module.no_gpu_here(tmp_path, {}) is sys.platform.startswith("linux")
    for trace in config_module._GPU_TRACES:
        root = tmp_path / trace.replace("/", "_")
        (root / trace).parent.mkdir(parents=True)
        (root / trace).touch()
        assert config_module.no_gpu_here(root, {}) is False, trace
        assert config_module.no_gpu_here(root, {"CUDA_VISIBLE_DEVICES": ""}) is True
        assert config_module.no_gpu_here(root, {"CUDA_VISIBLE_DEVICES": "-1"}) is True
        assert config_module.no_gpu_here(root, {"CUDA_VISIBLE_DEVICES": "0"}) is False


def test_device_names_without_torch():
    assert config_module.device_name("cuda:1") == "cuda:1"
    assert config_module.device_name("mps") == "mps"
    with pytest.raises(Exception, match="--device"):
        config_module.device_name("cuda:x")
