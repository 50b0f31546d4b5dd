"""Which tags a format uses: from the command line, a chat template, or a reward regex."""

from __future__ import annotations

import json
import re
from pathlib import Path

from vlfast.errors import InputRefused

DEFAULT_TAGS = ("<think>", "</think>")

# XML-like format tags (`<think>`, `</answer>`) and control tokens (`<|im_start|>`).
TAG = re.compile(r"<\|[^<>|\s]+\|>|</?[A-Za-z][\w:.-]*>")
# A tag's bare name (`think`): on the command line (--tags, --map) it stands for `<think>` and `</think>`.
BARE_NAME = re.compile(r"[A-Za-z][\w:.-]*")


def tag_pair(name: str) -> list[str]:
    """`think` -> ['<think>', '</think>']; anything else (`<think>`, `<|im_end|>`, `[THINK]`) as written."""
    return [f"<{name}>", f"</{name}>"] if BARE_NAME.fullmatch(name) else [name]


def tags_in_text(text: str) -> list[str]:
    """Distinct tags in order of first appearance."""
    return list(dict.fromkeys(TAG.findall(text)))


def split_tag_args(values: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """`--tags '<think>,</think>' --tags '<answer>'` -> ['<think>', '</think>', '<answer>'].

    A bare name is the pair: `--tags think` -> ['<think>', '</think>'], as `rewrite --map think=thinking`
    reads it. A value that names no tag (`''`, `','`, `' '`: typically an unset shell variable) is an error, not
    a request for the defaults."""
    out: list[str] = []
    for v in [values] if isinstance(values, str) else values or ():
        parts = [p.strip() for p in re.split(r"[,\s]+", v) if p.strip()]
        if not parts:
            raise InputRefused(
                f"--tags {v!r} names no tag; give tags such as --tags '<think>,</think>', "
                "or leave --tags out to check <think> and </think>"
            )
        out.extend(t for part in parts for t in tag_pair(part))
    return list(dict.fromkeys(out))


# Tokens a Qwen-VL processor or template puts in the prompt and the model never predicts: their rows may
# look untrained without harm, so a template audit skips them (and says so).
_VISION_PAD = (
    "placeholder the processor repeats once per visual token; its embedding is replaced by vision "
    "features and the model never predicts it"
)
_VISION_MARK = "marks where the visual tokens {}; written by the processor or chat template, never predicted"
_GROUNDING = (
    "Qwen2-VL grounding markup, unused since Qwen2.5-VL (boxes are plain JSON text); "
    "--include-placeholders checks it if your format has the model write it"
)
PLACEHOLDERS: dict[str, str] = {
    "<|image_pad|>": "image " + _VISION_PAD,
    "<|video_pad|>": "video " + _VISION_PAD,
    "<|vision_pad|>": "vision padding placeholder, never predicted",
    "<|vision_start|>": _VISION_MARK.format("start"),
    "<|vision_end|>": _VISION_MARK.format("end"),
    **{f"<|{name}_{end}|>": _GROUNDING for name in ("box", "quad", "object_ref") for end in ("start", "end")},
}


def compile_reward_regex(pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise InputRefused(
            f"--reward-regex {pattern!r} is not a valid Python regex ({e}); fix the pattern"
        ) from None


def tags_in_regex(pattern: str) -> list[str]:
    """Tags a reward regex matches literally; `\\<think\\>` counts as `<think>`."""
    compile_reward_regex(pattern)
    unescaped = re.sub(r"\\([^A-Za-z0-9])", r"\1", pattern)
    return tags_in_text(unescaped)


def read_utf8(path: Path, what: str) -> str:
    """The text of ``path`` exactly (line endings kept); a byte that is not UTF-8 is refused naming its
    offset, where ``read_text`` would raise UnicodeDecodeError (a bug's exit 3)."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputRefused(
            f"{what} {path} could not be read: byte {e.start} is 0x{data[e.start]:02x}, not UTF-8; pass a "
            f"readable UTF-8 {what}"
        ) from None


def read_template(path: str | Path) -> str:
    """Template text from a .jinja file, or the `chat_template` of a tokenizer_config.json."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(
            f"template {path} is a folder; pass the .jinja file or the tokenizer_config.json itself"
        )
    if not path.is_file():
        raise FileNotFoundError(
            f"template {path} does not exist; pass a .jinja file or a tokenizer_config.json"
        )
    text = read_utf8(path, "template").replace("\r\n", "\n").replace("\r", "\n")  # as open() reads it
    if path.suffix == ".json":
        text = text.removeprefix("\ufeff")  # a byte-order mark, as manifests accept it
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputRefused(f"template {path} is not valid JSON ({e})") from None
        tmpl = data.get("chat_template") if isinstance(data, dict) else None
        if isinstance(tmpl, list):  # named templates: [{"name": ..., "template": ...}]
            tmpl = "\n".join(t.get("template", "") for t in tmpl if isinstance(t, dict))
        if not isinstance(tmpl, str):
            raise InputRefused(f"{path} has no chat_template string; pass the template file itself")
        return tmpl
    return text
