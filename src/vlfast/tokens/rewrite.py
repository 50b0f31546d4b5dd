"""Apply one tag mapping (`<think>` -> `<thinking>`, `</think>` -> `</thinking>`) consistently to a
dataset field (JSONL or Parquet), a chat template and a reward regex, so data, prompt and reward agree.
"""

from __future__ import annotations

import codecs
import itertools
import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vlfast._files import refuse_same_files, write_atomically
from vlfast.errors import InputRefused
from vlfast.tokens.jsonline import load_record, string_spans, strings_of
from vlfast.tokens.tags import BARE_NAME, compile_reward_regex, read_utf8, tag_pair


def parse_mapping(values: Sequence[str] | Mapping[str, str]) -> dict[str, str]:
    """`['think=thinking']` -> {'<think>': '<thinking>', '</think>': '</thinking>'};
    `['<think>=<thinking>']` maps exactly that string."""
    pairs = list(values.items()) if isinstance(values, Mapping) else []
    if not isinstance(values, Mapping):
        for v in values:
            if "=" not in v:
                raise InputRefused(f"mapping {v!r} must look like think=thinking or '<think>=<thinking>'")
            pairs.append(tuple(s.strip() for s in v.split("=", 1)))
    mapping: dict[str, str] = {}
    for a, b in pairs:
        if not a or not b:
            raise InputRefused(f"mapping {a!r}={b!r} has an empty side")
        if BARE_NAME.fullmatch(a) and BARE_NAME.fullmatch(b):
            expanded = list(zip(tag_pair(a), tag_pair(b)))  # a bare name maps both halves
        else:
            expanded = [(a, b)]
        for src, dst in expanded:
            if src == dst:
                raise InputRefused(f"mapping {src!r} to itself does nothing; drop it")
            if mapping.get(src, dst) != dst:
                raise InputRefused(f"{src!r} is mapped to both {mapping[src]!r} and {dst!r}; keep one")
            mapping[src] = dst
    if not mapping:
        raise InputRefused("no mapping given: pass --map think=thinking (or '<think>=<thinking>')")
    clash = set(mapping) & set(mapping.values())
    if clash:
        raise InputRefused(
            f"{sorted(clash)} are both replaced and produced; the mapping would not be one step"
        )
    return mapping


def rewrite_text(text: str, mapping: Mapping[str, str], counts: dict[str, int] | None = None) -> str:
    # Longest first, so `</think>` is never read as `<` + ... by a shorter key.
    pat = re.compile("|".join(re.escape(k) for k in sorted(mapping, key=len, reverse=True)))

    def sub(m: re.Match) -> str:
        if counts is not None:
            counts[m.group(0)] = counts.get(m.group(0), 0) + 1
        return mapping[m.group(0)]

    return pat.sub(sub, text)


def _escaped_forms(tag: str) -> list[str]:
    """`</think>` as a regex author may write it: `</think>`, `<\\/think>`, `\\<\\/think\\>`, ..."""
    options = [(c, "\\" + c) if c in "</>" else (c,) for c in tag]  # every </> written plain or escaped
    return ["".join(chars) for chars in itertools.product(*options)]


def rewrite_regex(pattern: str, mapping: Mapping[str, str], counts: dict[str, int] | None = None) -> str:
    """Rewrite the tags a reward regex matches literally, keeping the author's escaping style."""
    compile_reward_regex(pattern)
    expanded: dict[str, str] = {}
    for src, dst in mapping.items():
        src_forms, dst_forms = _escaped_forms(src), _escaped_forms(dst)
        if len(src_forms) == len(dst_forms):
            expanded.update(zip(src_forms, dst_forms, strict=True))
        else:  # differently shaped tags: the plain form only
            expanded[re.escape(src)] = re.escape(dst)
            expanded[src] = dst
    local: dict[str, int] = {}
    out = rewrite_text(pattern, expanded, local)
    if counts is not None:
        for form, n in local.items():
            key = re.sub(r"\\(.)", r"\1", form)
            counts[key] = counts.get(key, 0) + n
    compile_reward_regex(out)
    return out


def _rewrite_value(value: Any, mapping: Mapping[str, str], counts: dict[str, int]) -> Any:
    # A field may hold a string or chat messages ([{"role": ..., "content": ...}]): rewrite every string.
    if isinstance(value, str):
        return rewrite_text(value, mapping, counts)
    if isinstance(value, list):
        return [_rewrite_value(v, mapping, counts) for v in value]
    if isinstance(value, dict):
        return {k: _rewrite_value(v, mapping, counts) for k, v in value.items()}
    return value


def _rewrite_literal(literal: str, text: str, new: str, mapping: Mapping[str, str]) -> str:
    """The JSON string ``literal`` (quotes included) rewritten to hold ``new``: its tags replaced in place
    where that gives ``new`` (every escape kept), else encoded again (ASCII-only if it was)."""
    inner = rewrite_text(literal, mapping)
    try:
        if json.loads(inner) == new:
            return inner
    except json.JSONDecodeError:  # a tag holding a quote or a backslash
        pass
    return json.dumps(new, ensure_ascii=literal.isascii())


def _rewrite_line(line: str, field_name: str, mapping: Mapping[str, str]) -> str:
    """``line`` with only the string values under ``field_name`` that hold a tag written again."""
    parts, at = [], 0
    for start, end, text in string_spans(line, field_name):
        new = rewrite_text(text, mapping)
        if new != text:
            parts += [line[at:start], _rewrite_literal(line[start:end], text, new, mapping)]
            at = end
    return "".join(parts) + line[at:]


def _holds_text(value: Any) -> bool:
    return next(strings_of(value), None) is not None


def _no_text(path: Path, field_name: str) -> InputRefused:
    # A field of numbers or nulls only: a wrong --field, which would otherwise "rewrite" nothing.
    return InputRefused(
        f"field {field_name!r} of {path} holds no text in any record (no string, nor chat messages holding "
        "one); pass the field that holds the text"
    )


@dataclass
class FileRewrite:
    path: str
    out: str
    replacements: dict[str, int]  # source tag -> occurrences replaced
    records: int | None = None  # dataset rows written
    already_present: dict[str, int] = field(default_factory=dict)  # target tags found before rewriting


@dataclass
class RewriteReport:
    mapping: dict[str, str]
    dataset: FileRewrite | None = None
    template: FileRewrite | None = None
    reward_regex: str | None = None
    reward_regex_out: str | None = None
    reward_replacements: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.mapping:
            raise ValueError("RewriteReport.mapping is empty")

    def to_dict(self) -> dict:
        return asdict(self)


def _present(text: str, targets: list[str]) -> dict[str, int]:
    return {t: text.count(t) for t in targets if t in text}


def _present_in(value: Any, targets: list[str]) -> dict[str, int]:
    """The targets found in the strings ``value`` holds (a NUL between two: no tag spans a boundary)."""
    return _present("\x00".join(strings_of(value)), targets)


# A JSON \u escape of a lone UTF-16 surrogate (escaped backslashes skipped): not writable as UTF-8.
_SURROGATE_ESCAPE = re.compile(
    r"\\\\|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}|\\u[dD][89a-fA-F][0-9a-fA-F]{2}"
)
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")


def _lone_surrogate(line: str) -> re.Match | None:
    # 6 characters: not an escaped backslash (2) nor a pair (12)
    return next((m for m in _SURROGATE_ESCAPE.finditer(line) if len(m.group()) == 6), None)


def _jsonl_records(path: Path) -> Iterator[tuple[bytes, str | None, Any]]:
    """(bytes, text, record) of every line of a JSON-lines file (a blank line: no text nor record; a leading
    BOM skipped, numbers kept as :class:`~vlfast.tokens.jsonline.Verbatim`). A line that is not UTF-8, not
    JSON, or holds a lone surrogate is refused naming the line and the byte offset of the fault."""
    with path.open("rb") as f:
        offset = 0
        for lineno, raw in enumerate(f, 1):
            start, offset = offset, offset + len(raw)
            if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
                raw, start = raw[len(codecs.BOM_UTF8) :], start + len(codecs.BOM_UTF8)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputRefused(
                    f"{path} line {lineno}, byte {start + e.start}: 0x{raw[e.start]:02x} is not UTF-8; the "
                    "dataset must be UTF-8 text (re-encode it, e.g. iconv -f latin1 -t utf-8)"
                ) from None
            if not line.strip():
                yield raw, None, None
                continue
            try:
                rec = load_record(line)
            except json.JSONDecodeError as e:
                raise InputRefused(
                    f"{path} line {lineno} is not JSON ({e}); the file must be JSON lines"
                ) from None
            except RecursionError:
                raise InputRefused(
                    f"{path} line {lineno} nests lists or objects too deeply to read; flatten that record"
                ) from None
            bad = _lone_surrogate(line) if "\\u" in line else None
            if bad is not None:
                raise InputRefused(
                    f"{path} line {lineno}, byte {start + len(line[: bad.start()].encode())}: a lone surrogate "
                    f"{bad.group()} (half of a UTF-16 pair), which is not Unicode text and cannot be written "
                    "as UTF-8; fix or drop that record"
                )
            yield raw, line, rec


def _check_output(flag: str, path: str | Path) -> None:
    if Path(path).is_dir():
        raise IsADirectoryError(f"{flag} {path} is a folder; name the file to write")


def _check_dataset(path: Path, field_name: str, out: Path | None) -> None:
    if path.is_dir():
        raise IsADirectoryError(f"dataset {path} is a folder; pass a .jsonl or .parquet file")
    if not path.is_file():
        raise FileNotFoundError(f"dataset {path} does not exist")
    if path.suffix != ".parquet" and path.suffix not in JSONL_SUFFIXES:
        raise InputRefused(f"dataset {path} must be .jsonl or .parquet")
    if not field_name or out is None:
        raise InputRefused("a dataset needs --field (the text column) and --out (a new file)")
    _check_output("--out", out)
    kind = "Parquet" if path.suffix == ".parquet" else "JSON lines"
    other = Path(out).suffix in JSONL_SUFFIXES if kind == "Parquet" else Path(out).suffix == ".parquet"
    if other:
        raise InputRefused(
            f"--out {out} names the other format: the rewrite is written as the dataset is, {kind}; name "
            f"--out {Path(out).with_suffix(path.suffix).name} (a converter can change the format afterwards)"
        )


def rewrite_dataset(
    path: str | Path, field_name: str, out: str | Path, mapping: Mapping[str, str]
) -> FileRewrite:
    """Rewrite `field_name` of every record of a JSON-lines or .parquet file into `out`, renamed into place
    when whole: a refused record anywhere leaves `out` as it was."""
    path, out = Path(path), Path(out)
    _check_dataset(path, field_name, out)
    refuse_same_files({"--out": out}, {"--dataset": path})
    counts: dict[str, int] = {}
    targets = list(mapping.values())
    present: dict[str, int] = {}
    dest = Path(os.path.realpath(out))  # through a symlink, as open() would write
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as e:
            if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError)):
                raise
            raise InputRefused(
                f"{path} is not a readable Parquet file ({e}); pass a .parquet table or a .jsonl file"
            ) from None
        if field_name not in table.column_names:
            raise InputRefused(
                f"{path} has no column {field_name!r}; columns: {', '.join(table.column_names)}"
            )
        if not table.num_rows:
            raise InputRefused(f"{path} holds no records: nothing to rewrite")
        col = table.column(field_name)
        values = col.to_pylist()
        if not any(_holds_text(v) for v in values):
            raise _no_text(path, field_name)
        present = _present_in(values, targets)
        new = pa.array([_rewrite_value(v, mapping, counts) for v in values], type=col.type)
        table = table.set_column(table.column_names.index(field_name), field_name, new)
        write_atomically(dest, lambda tmp: pq.write_table(table, tmp), overwrite=True, tag="rewrite")
        return FileRewrite(str(path), str(out), counts, table.num_rows, present)

    n = 0

    def write(tmp: Path) -> None:
        # Every byte the rewrite does not change is written as it came: only the string values under the
        # field that hold a tag are written again (a byte-order mark is dropped).
        nonlocal n
        seen, text = 0, False
        with tmp.open("wb") as dst:
            for raw, line, rec in _jsonl_records(path):
                if isinstance(rec, dict) and field_name in rec:
                    value = rec[field_name]
                    seen += 1
                    text = text or _holds_text(value)
                    for k, v in _present_in(value, targets).items():
                        present[k] = present.get(k, 0) + v
                    if _rewrite_value(value, mapping, counts) != value:
                        raw = _rewrite_line(line, field_name, mapping).encode()
                dst.write(raw)
                n += line is not None
        if not n:
            raise InputRefused(f"{path} holds no records: nothing to rewrite")
        if not seen:
            raise InputRefused(
                f"no record of {path} has a field {field_name!r}; pass the field that holds the text"
            )
        if not text:
            raise _no_text(path, field_name)

    write_atomically(dest, write, overwrite=True, tag="rewrite")
    return FileRewrite(str(path), str(out), counts, n, present)


def rewrite_tags(
    mapping: Sequence[str] | Mapping[str, str],
    *,
    dataset: str | Path | None = None,
    field: str | None = None,
    dataset_out: str | Path | None = None,
    template: str | Path | None = None,
    template_out: str | Path | None = None,
    reward_regex: str | None = None,
) -> RewriteReport:
    """Apply one tag mapping to any of: a dataset field, a chat template file, a reward regex. Everything is
    checked before anything is written (inputs exist, no output is an input or the other output, the regex
    compiles, the template is UTF-8); each output is renamed into place when whole."""
    m = parse_mapping(mapping)
    if dataset is None and template is None and reward_regex is None:
        raise InputRefused("nothing to rewrite: give --dataset, --template and/or --reward-regex")
    report = RewriteReport(m)
    if dataset is not None:
        _check_dataset(Path(dataset), field or "", dataset_out)
    if template is not None:
        template = Path(template)
        if not template.is_file():
            raise FileNotFoundError(f"template {template} does not exist")
        if template_out is None:
            raise InputRefused(
                "a template needs --template-out, a new file (the original is never overwritten)"
            )
        _check_output("--template-out", template_out)
    refuse_same_files(
        {"--out": dataset_out if dataset is not None else None, "--template-out": template_out},
        {"--dataset": dataset, "--template": template},
    )
    if reward_regex is not None:
        report.reward_regex = reward_regex
        report.reward_regex_out = rewrite_regex(reward_regex, m, report.reward_replacements)
    template_text = None if template is None else read_utf8(template, "template")
    if dataset is not None:
        report.dataset = rewrite_dataset(dataset, field, dataset_out, m)
    if template is not None:
        counts: dict[str, int] = {}
        new = rewrite_text(template_text, m, counts)
        dest = Path(os.path.realpath(template_out))
        write_atomically(
            dest, lambda tmp: tmp.write_text(new, "utf-8", newline=""), overwrite=True, tag="rewrite"
        )
        report.template = FileRewrite(
            str(template), str(template_out), counts, None, _present(template_text, list(m.values()))
        )
    return report
