"""One or more examples at the end of every command's ``--help``, as ``git`` and ``hf`` show them.

Kept as a table beside the commands rather than inside each command's file, so that what a newcomer reads
first is in one place; ``tests/test_cli_help.py`` checks that every command has an entry here.
"""

from __future__ import annotations

import typer

# -h as well as --help, as git and hf take it; set on each app, inherited by every command under it.
HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}

# command path (as typed after `vlfast`) -> example lines
EXAMPLES: dict[str, list[str]] = {
    "": [
        "vlfast doctor                                  # is this machine on a slow path?",
        "vlfast extract --demo demo_out                 # a first extraction, offline",
        "vlfast COMMAND -h                              # each command's options and examples",
    ],
    "models": ["vlfast models", "vlfast models --json"],
    "verify": [
        "vlfast verify --model ref:qwen3-vl-4b --tiny   # seconds, random weights",
        "vlfast verify --model ./Qwen3-VL-4B-Instruct   # your checkpoint, forward and backward",
    ],
    "doctor": [
        "vlfast doctor                                  # the built-in references, here",
        "vlfast doctor --model ./Qwen3-VL-4B-Instruct --dtype bfloat16",
        "vlfast doctor --fail-on slow-path              # a launcher's guard; exit 1 on a slow path",
    ],
    "profile": [
        "vlfast profile --model ref:qwen3-vl-4b --tiny",
        "vlfast profile --model ./Qwen3-VL-4B-Instruct --frames 2,8 --plot profile.png",
    ],
    "extract": [
        "vlfast extract --demo demo_out",
        "vlfast extract ./clips clips_out --model ./Qwen3-VL-4B-Instruct --features vision,llm",
        "vlfast extract manifest.jsonl s3://bucket/features -m ./Qwen3-VL-4B-Instruct   # pip install 'vlfast[s3]'",
    ],
    "out": ["vlfast out verify clips_out", "vlfast out export clips_out clips.parquet --feature vision_mean"],
    "out verify": [
        "vlfast out verify clips_out                    # exit 1 if any byte differs from its checksum",
        "vlfast out verify s3://bucket/features --json",
    ],
    "out compact": ["vlfast out compact clips_out"],
    "out export": [
        "vlfast out export clips_out clips.parquet --feature vision_mean",
        "vlfast out export clips_out clips.lance --feature vision_mean --dtype float16   # pip install 'vlfast[export]'",
        "vlfast out export s3://bucket/features table.parquet --overwrite",
    ],
    "export": ["vlfast export clips_out clips.parquet   # the same as vlfast out export"],
    "tokens": [
        "vlfast tokens audit --model ./Qwen3-8B-Base",
        "vlfast tokens rewrite --map think=thinking ...",
    ],
    "tokens audit": [
        "vlfast tokens audit --model ./Qwen3-8B-Base                  # <think> and </think>",
        "vlfast tokens audit --model ./Qwen3-8B-Base --tags answer    # <answer> and </answer>",
        "vlfast tokens audit --model ./Qwen3-8B-Base --reward-regex '^<think>.*?</think>'",
    ],
    "tokens rewrite": [
        "vlfast tokens rewrite --map think=thinking --dataset train.jsonl --field completion --out train2.jsonl",
        "vlfast tokens rewrite --map think=thinking --reward-regex '^<think>.*?</think>'",
    ],
    "tokens fix": ["vlfast tokens fix --model ./Qwen3-8B-Base ./Qwen3-8B-Base-fixed"],
    "tokens check-pipeline": [
        "vlfast tokens check-pipeline --model ./Qwen3-8B-Base --reward-regex '^<think>.*?</think>'"
    ],
    "demo-checkpoint": ["vlfast demo-checkpoint tiny-ckpt && vlfast tokens audit --model tiny-ckpt"],
}


def epilog(path: str) -> str:
    # "\b" keeps click from re-wrapping the paragraph: each example stays on its own line.
    return "Examples:\n\n\b\n" + "\n".join("  " + line for line in EXAMPLES[path])


def add_examples(app: typer.Typer, prefix: str = "") -> None:
    """Set the epilog of every command and group under ``app`` from EXAMPLES (a missing entry is a bug)."""
    app.info.epilog = epilog(prefix)
    for command in app.registered_commands:
        command.epilog = epilog(f"{prefix} {command.name}".strip())
    for group in app.registered_groups:
        name = group.name or group.typer_instance.info.name
        add_examples(group.typer_instance, f"{prefix} {name}".strip())
