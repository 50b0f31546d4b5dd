"""Which tags a format uses: from the command line, a chat template, or a reward regex."""

from __future__ import annotations

import json
import re
from pathlib import Path

DEFAULT_TAGS = ("<think>", "</think>")

# XML-like format tags (`<think>`, `</answer>`) and control tokens (`<|im_start|>`).
TAG = re.compile(r"<\|[^<>|\s]+\|>|</?[A-Za-z][\w:.-]*>")


def tags_in_text(text: str) -> list[str]:
    """Distinct tags in order of first appearance."""
    return list(dict.fromkeys(TAG.findall(text)))


def split_tag_args(values: list[str] | tuple[str, ...] | None) -> list[str]:
    """`--tags '<think>,</think>' --tags '<answer>'` -> ['<think>', '</think>', '<answer>']."""
    out: list[str] = []
    for v in values or ():
        out.extend(p.strip() for p in re.split(r"[,\s]+", v) if p.strip())
    return list(dict.fromkeys(out))


def compile_reward_regex(pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ValueError(
            f"--reward-regex {pattern!r} is not a valid Python regex ({e}); fix the pattern"
        ) from None


def tags_in_regex(pattern: str) -> list[str]:
    """Tags a reward regex matches literally; `\\<think\\>` counts as `<think>`."""
    compile_reward_regex(pattern)
    unescaped = re.sub(r"\\([^A-Za-z0-9])", r"\1", pattern)
    return tags_in_text(unescaped)


def read_template(path: str | Path) -> str:
    """Template text from a .jinja file, or the `chat_template` of a tokenizer_config.json."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"template {path} does not exist; pass a .jinja file or a tokenizer_config.json"
        )
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"template {path} is not valid JSON ({e})") from None
        tmpl = data.get("chat_template") if isinstance(data, dict) else None
        if isinstance(tmpl, list):  # named templates: [{"name": ..., "template": ...}]
            tmpl = "\n".join(t.get("template", "") for t in tmpl if isinstance(t, dict))
        if not isinstance(tmpl, str):
            raise ValueError(f"{path} has no chat_template string; pass the template file itself")
        return tmpl
    return text
