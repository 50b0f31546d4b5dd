"""A newcomer's first hour (issue 24): -h, examples in every help, the mistakes everyone makes first
answered with the next step, tag names read one way, and no third-party chatter unless --verbose.

Every command the app registers is walked, so a command added later is checked too.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from _commands import COMMANDS, IDS, PATHS
from vlfast.cli._examples import EXAMPLES
from vlfast.cli.main import app
from vlfast.tokens.rewrite import parse_mapping
from vlfast.tokens.tags import split_tag_args

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_dash_h_is_help_with_examples(path):
    short = runner.invoke(app, [*path, "-h"])
    assert short.exit_code == 0, short.output
    assert short.output == runner.invoke(app, [*path, "--help"]).output
    assert "Examples:" in short.output
    examples = EXAMPLES[" ".join(path)]
    assert examples and all(line.split("#")[0].strip() in short.output for line in examples)
    assert all(line.lstrip().startswith("vlfast ") for line in examples)


def test_every_example_names_a_real_command():
    """An example of `vlfast tokens audit` starts with those words, and the command exists."""
    for key, lines in EXAMPLES.items():
        for line in lines:
            words = line.split()[1:]
            assert tuple(words[: len(key.split())]) == tuple(key.split()), (key, line)
            if key:
                assert tuple(key.split()) in COMMANDS, key


def test_extract_help_defects():
    out = runner.invoke(app, ["extract", "--help"]).output
    assert "INPUT OUT  INPUT is a folder" in out  # the label once, then the text
    assert "INPUT OUT: INPUT" not in out
    assert "0..--" not in out and "from 0 to" in out


def test_rewrite_reward_regex_has_its_own_help():
    def reward_help(command: str) -> str:
        out = runner.invoke(app, ["tokens", command, "--help"], terminal_width=200).output
        return next(line for line in out.splitlines() if "--reward-regex" in line)

    assert reward_help("rewrite") != reward_help("audit")
    assert "rewritten" in reward_help("rewrite")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["verify", "--model", "Qwen/Qwen3-VL-4B-Instruct", "--tiny"],
            "hf download Qwen/Qwen3-VL-4B-Instruct --local-dir ./Qwen3-VL-4B-Instruct",
        ),
        (["verify", "--model", "qwen3-vl-4b", "--tiny"], "--model ref:qwen3-vl-4b"),
        (["doctor", "--model", "qwen3vl-4b", "--no-probe"], "--model ref:qwen3-vl-4b"),
        (["tokens", "audit", "--model", "Qwen/Qwen3-8B-Base"], "hf download Qwen/Qwen3-8B-Base"),
        (["tokens", "audit", "--model", "ref:qwen3-vl-4b"], "vlfast demo-checkpoint DIR"),
        (["tokens", "check-pipeline", "--model", "Qwen/Qwen3-8B"], "hf download Qwen/Qwen3-8B"),
    ],
    ids=["hub-id", "ref-without-prefix", "ref-misspelt", "tokens-hub-id", "tokens-ref", "pipeline-hub-id"],
)
def test_model_mistakes_answered_with_the_next_step(argv, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # "Qwen/..." must not exist as a relative folder
    res = runner.invoke(app, argv)
    assert res.exit_code == 2, res.output
    assert expected in " ".join(res.output.split()), res.output


def test_extract_hub_id_refused_before_writing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from PIL import Image

    (tmp_path / "in").mkdir()
    Image.new("RGB", (64, 64)).save(tmp_path / "in" / "a.png")
    res = runner.invoke(app, ["extract", "in", "out", "--model", "Qwen/Qwen3-VL-4B-Instruct"])
    assert res.exit_code == 2 and "hf download Qwen/Qwen3-VL-4B-Instruct" in " ".join(res.output.split())
    assert not (tmp_path / "out").exists()


def test_bare_tag_name_is_the_pair_in_audit_as_in_rewrite():
    assert split_tag_args(["think"]) == ["<think>", "</think>"]
    assert split_tag_args("think,answer") == ["<think>", "</think>", "<answer>", "</answer>"]
    assert list(parse_mapping(["think=thinking"])) == split_tag_args(["think"])
    # written forms stay as written
    assert split_tag_args(["<think>", "<|im_end|>", "[THINK]"]) == ["<think>", "<|im_end|>", "[THINK]"]


def test_audit_tags_think_audits_the_tags(tokens_app, tiny_qwen3_vl):
    import json

    res = CliRunner().invoke(
        tokens_app, ["tokens", "audit", "-m", str(tiny_qwen3_vl), "--tags", "think", "--json"]
    )
    assert res.exit_code == 0, res.output
    assert [t["tag"] for t in json.loads(res.output)["tags"]] == ["<think>", "</think>"]


def test_demo_checkpoint_refuses_a_folder_with_files(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    res = runner.invoke(app, ["demo-checkpoint", str(tmp_path)])
    assert res.exit_code == 2 and "not an empty folder" in res.output
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def _extract(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
    )
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    code = "import sys; from vlfast.cli.main import main; sys.argv = ['vlfast', *sys.argv[1:]]; main()"
    return subprocess.run(
        [sys.executable, "-c", code, "extract", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_loading_bar_only_with_verbose(tiny_qwen3_vl, media_dir, tmp_path):
    """transformers' "Loading weights" bar came with every checkpoint extraction; now only with --verbose."""
    args = [
        str(media_dir / "good" / "rgb.png"),
        "--features",
        "vision,llm",
        "-m",
        str(tiny_qwen3_vl),
        "--workers",
        "0",
    ]
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "rgb.png").write_bytes((media_dir / "good" / "rgb.png").read_bytes())
    args = [str(inputs), *args[1:]]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:  # two independent processes (two OUTs): one per core
        quiet = pool.submit(_extract, [*args[:1], str(tmp_path / "quiet"), *args[1:]], tmp_path)
        loud = pool.submit(_extract, [*args[:1], str(tmp_path / "loud"), *args[1:], "--verbose"], tmp_path)
        quiet, loud = quiet.result(), loud.result()
    assert quiet.returncode == 0, quiet.stderr
    assert "Loading weights" not in quiet.stdout + quiet.stderr
    assert loud.returncode == 0, loud.stderr
    assert "Loading weights" in loud.stdout + loud.stderr


def test_ray_console_lines_kept_to_errors():
    pytest.importorskip("ray.data")
    from vlfast.cli._quiet import quiet_ray

    def passes(level: int) -> list[bool]:
        out = []
        for name in ("ray", "ray.data"):
            for h in logging.getLogger(name).handlers:
                if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                    record = logging.LogRecord(name, level, __file__, 1, "m", None, None)
                    out.append(bool(h.filter(record)))
        return out

    quiet_ray(verbose=True)
    assert passes(logging.INFO) and all(passes(logging.WARNING))  # --verbose: left alone
    quiet_ray(verbose=False)
    quiet_ray(verbose=False)  # twice: one filter per handler
    assert not any(passes(logging.INFO)) and not any(passes(logging.WARNING))
    assert all(passes(logging.ERROR))


def test_verbose_takes_back_only_what_quiet_set(monkeypatch):
    from vlfast.cli import _quiet

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    monkeypatch.setattr(_quiet, "_set_here", [])
    _quiet.quiet_third_party(verbose=False)
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    _quiet.quiet_third_party(verbose=True)
    assert "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")  # the user's own choice
    _quiet.quiet_third_party(verbose=False)
    _quiet.quiet_third_party(verbose=True)
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "0"


def test_patch_is_not_a_command_and_says_what_is():
    res = runner.invoke(app, ["patch", "model.pt"])
    assert res.exit_code == 2
    text = " ".join(res.output.split())
    assert "vlfast.patch(model)" in text and "VLFAST_PATCH=1" in text and "python -m vlfast.run" in text


def test_a_mistyped_local_path_is_not_taken_for_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    res = runner.invoke(app, ["verify", "--model", "checkpoints/qwen3-vl-4b-typo", "--tiny"])
    assert res.exit_code == 2 and "hf download" not in res.output


DEEPSPEED_IMPORT = """
import logging, sys
from vlfast.cli._quiet import quiet_third_party
quiet_third_party(verbose={verbose})
import deepspeed  # says "Setting accelerator to CPU" where no GPU is found
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_deepspeeds_accelerator_warning_is_quiet_unless_verbose(verbose):
    """accelerate imports DeepSpeed (where installed) inside transformers' save_pretrained: its WARNING
    line on a machine without a GPU must not land in a command's output, unless --verbose."""
    pytest.importorskip("deepspeed")
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    done = subprocess.run(
        [sys.executable, "-c", DEEPSPEED_IMPORT.format(verbose=verbose)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert ("Setting accelerator to CPU" in done.stderr + done.stdout) is verbose
