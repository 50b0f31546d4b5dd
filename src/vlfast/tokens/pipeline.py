"""The pipeline's view of the format tags: what happens to `<think>`/`</think>` between the chat template
and the reward function, which the weight audit cannot see. The four checks (:data:`CHECKS`) and their
evidence are described in docs/tokens.md; facts go into `PipelineReport` (JSON-native values only).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vlfast.errors import InputRefused
from vlfast.tokens.tags import (
    DEFAULT_TAGS,
    compile_reward_regex,
    read_template,
    split_tag_args,
    tags_in_regex,
)
from vlfast.tokens.vocab import VOCAB_FILES

CHECKS = ("template-position", "prefilled-tag", "stripped-on-decode", "round-trip")
STATUSES = ("pass", "fail", "skip")

# Template variables that switch reasoning on: Qwen3/GLM-4.5/SmolLM3 `enable_thinking`, DeepSeek-V3.1 and
# Granite `thinking`. Set to True only when the template reads them.
REASONING_SWITCHES = ("enable_thinking", "thinking")

# The prompt every render uses; its content never contains a tag.
MESSAGES = ({"role": "user", "content": "What is 2 + 3?"},)

_OPENING = re.compile(r"<[A-Za-z][\w:.-]*>")  # `<think>`, not `</think>` nor `<|im_start|>`


def default_reward_regex(tags: list[str]) -> str:
    """The typical format reward, `^<think>.*?</think>.*$` (DOTALL), for the first open/close pair."""
    opening, closing = _pair(tags)
    return f"^{re.escape(opening)}.*?{re.escape(closing)}.*$"


def builtin_sample(tags: list[str]) -> str:
    """A completion that the default regex and the usual `<answer>` regexes (TRL's, Open-R1's) accept."""
    opening, closing = _pair(tags)
    return f"{opening}\nThe user asks for 2 + 3. Adding 2 and 3 gives 5.\n{closing}\n<answer>\n5\n</answer>"


def _pair(tags: list[str]) -> tuple[str, str]:
    for t in tags:
        if _OPENING.fullmatch(t) and "</" + t[1:] in tags:
            return t, "</" + t[1:]
    return DEFAULT_TAGS[0], DEFAULT_TAGS[1]


@dataclass
class Placement:
    """One way a tag is tokenized in one context, against the tag tokenized alone."""

    tag: str
    context: str  # "generation prompt" | "completion" | "conversation"
    count: int  # occurrences tokenized this way
    ids: list[int]
    pieces: list[str]
    alone_ids: list[int]
    alone_pieces: list[str]
    before: str  # neighbouring text the tag's first token also covers
    after: str  # neighbouring text its last token also covers

    @property
    def same(self) -> bool:
        return self.kind == "same"

    @property
    def kind(self) -> str:
        """same | absorbs (same ids, but the token also covers neighbouring text: an added token's
        lstrip/rstrip, which decoding loses) | merges (other ids that cover neighbouring text) | splits."""
        if self.before or self.after:
            return "absorbs" if self.ids == self.alone_ids else "merges"
        return "same" if self.ids == self.alone_ids else "splits"

    @property
    def note(self) -> str:
        kind = self.kind
        if kind == "same":
            return "same as alone"
        if kind == "splits":
            return "splits differently than alone"
        verb = "absorbs" if kind == "absorbs" else "merges with"
        parts = [f"{verb} the preceding {self.before!r}"] if self.before else []
        parts += [f"{verb} the following {self.after!r}"] if self.after else []
        if kind == "absorbs":
            return "; ".join(parts) + " (the added token's lstrip/rstrip: decoding drops it)"
        return ("a leading-space variant: " if self.before.isspace() else "") + "; ".join(parts)


@dataclass
class PositionEvidence:
    contexts: dict[str, str]  # context name -> the text tokenized
    placements: list[Placement]
    missing: list[str]  # tags found in no context

    def lines(self) -> list[str]:
        out = [
            f"{p.tag} in the {p.context} (x{p.count}): {p.pieces} vs alone {p.alone_pieces}: {p.note}"
            for p in self.placements
        ]
        out += [f"{t} occurs in none of: {', '.join(self.contexts)}" for t in self.missing]
        return out


@dataclass
class PrefillEvidence:
    generation_suffix: str  # what the generation prompt adds after the conversation
    prefilled_tags: list[str]
    reward_regex: str
    completion: str  # the sample as the model generates it after the prompt
    with_prefill: str  # the same with the prefilled text in front
    matches_completion: bool | None  # None: not tested (nothing prefilled)
    matches_with_prefill: bool | None
    suggested_regex: str | None = None

    def lines(self) -> list[str]:
        out = [f"generation prompt adds {self.generation_suffix!r}"]
        if not self.prefilled_tags:
            return out
        yes = {True: "matches", False: "no match"}
        out += [
            f"reward regex {self.reward_regex!r} (re.search, DOTALL):",
            f"  on the completion as generated {self.completion!r}: {yes[bool(self.matches_completion)]}",
            f"  on prefill + completion {self.with_prefill!r}: {yes[bool(self.matches_with_prefill)]}",
        ]
        if self.suggested_regex:
            out.append(f"a regex that accepts both: {self.suggested_regex!r}")
        return out


@dataclass
class TagDecode:
    tag: str
    ids: list[int]
    special: list[bool]  # per id: an added token flagged special
    kept: bool  # decode(ids, skip_special_tokens=True) still contains the tag
    in_sample: int
    in_skipped_text: int


@dataclass
class DecodeEvidence:
    sample: str
    text_kept: str  # decode(ids, skip_special_tokens=False)
    text_skipped: str  # decode(ids, skip_special_tokens=True)
    tags: list[TagDecode]

    def lines(self) -> list[str]:
        out = [
            f"skip_special_tokens=False: {self.text_kept!r}",
            f"skip_special_tokens=True:  {self.text_skipped!r}",
        ]
        for t in self.tags:
            special = "special" if all(t.special) else ("partly special" if any(t.special) else "not special")
            out.append(
                f"{t.tag}: ids {t.ids} {special}; {'kept' if t.kept else 'removed'} with skip_special_tokens=True "
                f"(in the sample x{t.in_sample}, after decoding x{t.in_skipped_text})"
            )
        return out


@dataclass
class RoundTripEvidence:
    prompt_tokens: int
    completion: str
    completion_ids: list[int]
    decoded: str  # decode(completion_ids, skip_special_tokens=False)
    text_ok: bool  # decoded == completion
    completion_ok: bool  # encode(decoded) == completion_ids
    in_context_ok: bool  # encode(prompt + decoded) == prompt_ids + completion_ids
    first_difference: int | None  # index into the completion's tokens (negative: inside the prompt)
    expected_pieces: list[str]  # a window of prompt_ids + completion_ids around the difference
    got_pieces: list[str]  # the same window of encode(prompt + decoded)

    def lines(self) -> list[str]:
        out = [
            f"completion ({len(self.completion_ids)} tokens after a {self.prompt_tokens}-token prompt): "
            f"{self.completion!r}"
        ]
        if not self.text_ok:
            out.append(f"decode gives {self.decoded!r}")
        out.append(f"encode(decode(ids)) == ids for the completion alone: {self.completion_ok}")
        out.append(f"encode(prompt + decode(ids)) == prompt_ids + ids: {self.in_context_ok}")
        if self.first_difference is not None:
            k = self.first_difference
            where = f"completion token {k}" if k >= 0 else f"prompt token {k} (the prompt's end merges)"
            out.append(f"first difference at {where}:")
            out.append(f"  expected {self.expected_pieces}")
            out.append(f"  got      {self.got_pieces}")
        return out


@dataclass
class Check:
    name: str
    status: str
    summary: str
    evidence: PositionEvidence | PrefillEvidence | DecodeEvidence | RoundTripEvidence | None
    fix: str | None = None

    def __post_init__(self) -> None:
        # imported here: tokens.report imports numpy, which a refusal need not wait for
        from vlfast.tokens.report import one_of

        one_of("Check.name", self.name, CHECKS)
        one_of("Check.status", self.status, STATUSES)

    def lines(self) -> list[str]:
        return [] if self.evidence is None else self.evidence.lines()


@dataclass
class PipelineReport:
    model_dir: str
    template_source: str  # the --template path, or the tokenizer folder's own template
    reasoning_switches: list[str]  # template variables set to True when rendering
    tags: list[str]
    reward_regex: str
    reward_regex_default: bool
    sample_source: str  # a path, or "built-in"
    generation_prompt: str
    checks: list[Check]
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if c.status == "fail"]

    def check(self, name: str) -> Check:
        return next(c for c in self.checks if c.name == name)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for c, d in zip(self.checks, data["checks"]):
            if isinstance(c.evidence, PositionEvidence):
                for p, pd in zip(c.evidence.placements, d["evidence"]["placements"]):
                    pd.update(same=p.same, kind=p.kind, note=p.note)
        return {**data, "ok": self.ok, "failed": self.failed}


def load_tokenizer(model_dir: str | Path) -> Any:
    """The transformers tokenizer of a local folder (no download), the object trainers decode with."""
    folder = Path(model_dir)
    if not folder.exists():
        from vlfast.models.checkpoints import missing_model_hint  # only on this error path

        raise FileNotFoundError(
            f"model folder {folder} does not exist: {missing_model_hint(str(model_dir), references=False)}"
        )
    if not folder.is_dir():
        raise NotADirectoryError(f"--model {folder} is a file; pass the folder that holds the tokenizer")
    if not any((folder / f).is_file() for f in VOCAB_FILES):
        raise FileNotFoundError(
            f"no tokenizer files in {folder} (none of {', '.join(VOCAB_FILES)}); "
            "save the tokenizer there with tokenizer.save_pretrained(DIR)"
        )
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any failure here means "no usable tokenizer"
        raise FileNotFoundError(
            f"no usable tokenizer in {folder} (transformers said: {e}); "
            "save the tokenizer there with tokenizer.save_pretrained(DIR)"
        ) from None
    if getattr(tok, "backend_tokenizer", None) is None:
        raise InputRefused(
            f"the tokenizer in {folder} has no fast (tokenizers) backend; save it with "
            "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR) to write tokenizer.json"
        )
    # A saved tokenizer.json may pad or truncate every encoding; offsets and round trips need neither.
    tok.backend_tokenizer.no_padding()
    tok.backend_tokenizer.no_truncation()
    return tok


def _template(tok: Any, model_dir: Path, template: str | Path | None) -> tuple[str, str]:
    if template is not None:
        path = Path(template)
        try:
            return read_template(path), str(path)
        except (FileNotFoundError, IsADirectoryError):  # read_template's own words
            raise
        except (OSError, UnicodeDecodeError) as e:
            raise InputRefused(
                f"template {path} could not be read ({getattr(e, 'strerror', None) or e}); "
                "pass a readable .jinja file or a tokenizer_config.json"
            ) from None
    text = tok.chat_template
    if isinstance(text, dict):  # named templates
        text = text.get("default")
    if not isinstance(text, str) or not text.strip():
        raise InputRefused(
            f"the tokenizer in {model_dir} has no chat template (chat_template.jinja or tokenizer_config.json); "
            "pass the one your trainer uses with --template chat.jinja"
        )
    return text, f"{model_dir} (its own chat template)"


def reasoning_switches(template: str) -> list[str]:
    """The reasoning switches the template reads as top-level variables."""
    try:
        import jinja2
        from jinja2 import meta

        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", "jinja2.ext.do"])
        names = meta.find_undeclared_variables(env.parse(template))
    except Exception:  # noqa: BLE001 - transformers' own tags ({% generation %}) are not plain jinja
        names = {s for s in REASONING_SWITCHES if re.search(rf"\b{s}\b", template)}
    return [s for s in REASONING_SWITCHES if s in names]


def _render(
    tok: Any, template: str, source: str, messages: list[dict], gen: bool, switches: list[str]
) -> str:
    try:
        text = tok.apply_chat_template(
            messages,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=gen,
            **dict.fromkeys(switches, True),
        )
    except Exception as e:  # noqa: BLE001 - jinja syntax, raise_exception(), missing variables
        raise InputRefused(
            f"the chat template from {source} does not render ({type(e).__name__}: {e}); fix it or pass "
            "--template with the template your trainer uses"
        ) from None
    if not isinstance(text, str):
        raise InputRefused(f"the chat template from {source} rendered {type(text).__name__}, not text")
    return text


def _read_sample(sample: str | Path | None, tags: list[str]) -> tuple[str, str]:
    if sample is None:
        return builtin_sample(tags), "built-in"
    path = Path(sample)
    if path.is_dir():
        raise IsADirectoryError(f"sample {path} is a folder; pass a text file holding one completion")
    if not path.is_file():
        raise FileNotFoundError(f"sample {path} does not exist; pass a text file holding one completion")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputRefused(
            f"sample {path} could not be read ({getattr(e, 'strerror', None) or e}); "
            "pass a readable UTF-8 text file holding one completion"
        ) from None
    text = text[:-1] if text.endswith("\n") else text  # the newline an editor adds at the end
    if not text.strip():
        raise InputRefused(f"sample {path} is empty; pass a text file holding one completion with the tags")
    return text, str(path)


def _pieces(tok: Any, ids: list[int]) -> list[str]:
    return [tok.backend_tokenizer.id_to_token(int(i)) or "" for i in ids]


def _encode(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def check_position(tok: Any, contexts: dict[str, str], tags: list[str]) -> Check:
    backend = tok.backend_tokenizer
    encodings = {name: backend.encode(text, add_special_tokens=False) for name, text in contexts.items()}
    placements: list[Placement] = []
    for tag in tags:
        alone = backend.encode(tag, add_special_tokens=False).ids
        for context, text in contexts.items():
            enc = encodings[context]
            seen: dict[tuple, Placement] = {}
            for m in re.finditer(re.escape(tag), text):
                s, e = m.span()
                idx = [k for k, (a, b) in enumerate(enc.offsets) if a < e and b > s]
                if not idx:
                    continue
                lo, hi = min(enc.offsets[k][0] for k in idx), max(enc.offsets[k][1] for k in idx)
                ids = [enc.ids[k] for k in idx]
                before, after = text[lo:s], text[e:hi]
                key = (tuple(ids), before, after)
                if key in seen:
                    seen[key].count += 1
                else:
                    seen[key] = Placement(
                        tag, context, 1, ids, _pieces(tok, ids), alone, _pieces(tok, alone), before, after
                    )
            placements.extend(seen.values())
    missing = [t for t in tags if not any(p.tag == t for p in placements)]
    ev = PositionEvidence(dict(contexts), placements, missing)
    bad = [p for p in placements if not p.same]
    if bad:
        what = ", ".join(dict.fromkeys(f"{p.tag} in the {p.context}" for p in bad))
        fixes = []
        if any(p.kind != "absorbs" for p in bad):
            fixes.append(
                "make each tag one added token (tokenizer.add_tokens, then `vlfast tokens fix` for its rows) "
                "so it has one id everywhere, or change the template so the tag does not follow a space "
                "(the audit judges the ids a tag has alone)"
            )
        if any(p.kind == "absorbs" for p in bad):
            fixes.append("save the added tags with lstrip=False and rstrip=False")
        summary = f"tokenized differently in context than alone: {what}"
        return Check("template-position", "fail", summary, ev, "; or ".join(fixes))
    if not placements:
        return Check("template-position", "skip", "no tag occurs in the rendered template or the sample", ev)
    return Check("template-position", "pass", "each tag has the same ids in context as alone", ev)


def _suggest_regex(pattern: str, prefilled: list[str], completion: str, with_prefill: str) -> str | None:
    """`^<think>.*?</think>` -> `^(?:<think>)?.*?</think>`, if that accepts the completion both ways."""
    for tag in prefilled:
        for form in dict.fromkeys((tag, re.escape(tag), tag.replace("<", r"\<").replace(">", r"\>"))):
            for anchor in ("^", r"\A", ""):
                head = anchor + form
                if pattern.startswith(head):
                    rest = pattern[len(head) :]
                    # The newline the template prefills with the tag goes into the optional group too.
                    ws = re.match(r"(\\n|\\s\*|\\s\+|\n)?", rest).group(0)
                    new = f"{anchor}(?:{form}{ws})?{rest[len(ws) :]}"
                    try:
                        rx = re.compile(new, re.DOTALL)
                        if rx.search(completion) and rx.search(with_prefill):
                            return new
                    except re.error:
                        return None
    return None


def check_prefill(generation_suffix: str, tags: list[str], sample: str, pattern: str) -> tuple[Check, str]:
    """The check, and the completion as the model generates it after the prompt."""
    prefilled = [t for t in tags if _OPENING.fullmatch(t) and t in generation_suffix]
    if not prefilled:
        ev = PrefillEvidence(generation_suffix, [], pattern, sample, sample, None, None)
        return Check("prefilled-tag", "pass", "the generation prompt opens no tag", ev), sample
    prefill = generation_suffix[min(generation_suffix.index(t) for t in prefilled) :]
    # The model writes what follows the prefill: drop it from a sample that starts with it.
    if sample.startswith(prefill):
        completion, with_prefill = sample[len(prefill) :], sample
    elif sample.lstrip().startswith(prefill.strip()):
        completion, with_prefill = sample.lstrip()[len(prefill.strip()) :].lstrip(), sample
    else:
        completion, with_prefill = sample, prefill + sample
    rx = compile_reward_regex(pattern)
    m_c, m_p = bool(rx.search(completion)), bool(rx.search(with_prefill))
    ev = PrefillEvidence(generation_suffix, prefilled, pattern, completion, with_prefill, m_c, m_p)
    tags_txt = ", ".join(prefilled)
    if m_c:
        summary = f"the template prefills {tags_txt}; the regex accepts completions without it"
        return Check("prefilled-tag", "pass", summary, ev), completion
    if not m_p:
        summary = (
            "the regex matches the sample neither with nor without the prefilled text; pass --sample with a "
            "completion your reward accepts"
        )
        return Check("prefilled-tag", "skip", summary, ev), completion
    ev.suggested_regex = _suggest_regex(pattern, prefilled, completion, with_prefill)
    fix = "make the tag optional in the regex"
    if ev.suggested_regex:
        fix += f" ({ev.suggested_regex!r})"
    fix += (
        ", or score prefill + completion in the reward function, or render prompts without the prefill "
        "(a template change, or enable_thinking=False if the run does not need it)"
    )
    summary = (
        f"the template prefills {tags_txt} in the generation prompt and the reward regex requires the "
        "completion to contain it: it can never match (format reward stuck at 0)"
    )
    return Check("prefilled-tag", "fail", summary, ev, fix), completion


def check_decode(tok: Any, tags: list[str], sample: str) -> Check:
    ids = _encode(tok, sample)
    kept_text = tok.decode(ids, skip_special_tokens=False)
    skipped_text = tok.decode(ids, skip_special_tokens=True)
    added = tok.backend_tokenizer.get_added_tokens_decoder()
    per_tag = []
    for tag in tags:
        t_ids = _encode(tok, tag)
        special = [bool(added[i].special) if i in added else False for i in t_ids]
        kept = tag in tok.decode(t_ids, skip_special_tokens=True)
        per_tag.append(TagDecode(tag, t_ids, special, kept, sample.count(tag), skipped_text.count(tag)))
    ev = DecodeEvidence(sample, kept_text, skipped_text, per_tag)
    removed = [t.tag for t in per_tag if not t.kept]
    if not removed:
        summary = "decoding with skip_special_tokens=True keeps every tag"
        return Check("stripped-on-decode", "pass", summary, ev)
    one = len(removed) == 1
    summary = (
        f"{', '.join(removed)} {'is' if one else 'are'} special: decoding with skip_special_tokens=True "
        f"removes {'it' if one else 'them'} before the reward function sees the text"
    )
    fix = (
        "decode completions with skip_special_tokens=False (the trainer's and the engine's setting), or "
        "re-register the tags as non-special added tokens (special=False, as Qwen3 ships them), or rewrite "
        "to a tag that is not special with `vlfast tokens rewrite --map think=thinking`"
    )
    return Check("stripped-on-decode", "fail", summary, ev, fix)


def check_round_trip(tok: Any, prompt: str, completion: str) -> Check:
    p_ids, c_ids = _encode(tok, prompt), _encode(tok, completion)
    decoded = tok.decode(c_ids, skip_special_tokens=False)
    expected = p_ids + c_ids
    got = _encode(tok, prompt + decoded)
    first = next((k for k, (a, b) in enumerate(zip(expected, got)) if a != b), None)
    if first is None and len(expected) != len(got):
        first = min(len(expected), len(got))
    window = slice(max(first - 2, 0), first + 4) if first is not None else slice(0)
    ev = RoundTripEvidence(
        prompt_tokens=len(p_ids),
        completion=completion,
        completion_ids=c_ids,
        decoded=decoded,
        text_ok=decoded == completion,
        completion_ok=_encode(tok, decoded) == c_ids,
        in_context_ok=first is None,
        first_difference=None if first is None else first - len(p_ids),
        expected_pieces=_pieces(tok, expected[window]),
        got_pieces=_pieces(tok, got[window]),
    )
    problems = [] if ev.text_ok else ["decode does not give the completion's text back"]
    if not ev.completion_ok:
        problems.append("encode(decode(ids)) differs from the completion's ids")
    elif not ev.in_context_ok:
        problems.append(
            "after the prompt, the decoded completion encodes to other ids (a merge across the boundary)"
        )
    if not problems:
        summary = "encode(decode(ids)) gives the ids and the text back, after the prompt"
        return Check("round-trip", "pass", summary, ev)
    fix = (
        "keep the generated token ids from rollout to loss (never re-tokenize decoded text); end the "
        "generation prompt with a newline rather than a space; save added tags with lstrip/rstrip False"
    )
    return Check("round-trip", "fail", "; ".join(problems), ev, fix)


def check_pipeline(
    model_dir: str | Path,
    *,
    template: str | Path | None = None,
    reward_regex: str | None = None,
    sample: str | Path | None = None,
    tags: list[str] | tuple[str, ...] | None = None,
) -> PipelineReport:
    """Render the chat template, tokenize and decode a sample completion the way an RL trainer does, and
    check the tags at each step. Tags: `tags`, else `<think>`, `</think>` plus the tags the regex names."""
    model_dir = Path(model_dir)
    pattern_given = reward_regex is not None
    if pattern_given:
        compile_reward_regex(reward_regex)
    tag_list = split_tag_args(list(tags) if tags else None) or list(DEFAULT_TAGS)
    if not tags and pattern_given:
        tag_list = list(dict.fromkeys([*tag_list, *tags_in_regex(reward_regex)]))
    pattern = reward_regex if pattern_given else default_reward_regex(tag_list)
    tok = load_tokenizer(model_dir)
    template_text, template_source = _template(tok, model_dir, template)
    sample_text, sample_source = _read_sample(sample, tag_list)

    switches = reasoning_switches(template_text)
    messages = [dict(m) for m in MESSAGES]
    base = _render(tok, template_text, template_source, messages, False, switches)
    prompt = _render(tok, template_text, template_source, messages, True, switches)
    notes = []
    if prompt.startswith(base):
        suffix = prompt[len(base) :]
    else:
        # Not a pure extension: take what follows the last assistant header.
        k = prompt.lower().rfind("assistant")
        suffix = prompt[k + len("assistant") :] if k >= 0 else prompt
        notes.append(
            "the generation prompt does not extend the prompt without it; read after the last 'assistant'"
        )

    prefill, completion = check_prefill(suffix, tag_list, sample_text, pattern)
    contexts = {"generation prompt": prompt, "completion": completion}
    try:
        convo = [*messages, {"role": "assistant", "content": sample_text}]
        contexts["conversation"] = _render(tok, template_text, template_source, convo, False, switches)
    except ValueError as e:
        notes.append(f"the template does not render an assistant turn, so no conversation context: {e}")
    checks = [
        check_position(tok, contexts, tag_list),
        prefill,
        check_decode(tok, tag_list, sample_text),
        check_round_trip(tok, prompt, completion),
    ]
    return PipelineReport(
        model_dir=str(model_dir),
        template_source=template_source,
        reasoning_switches=switches,
        tags=tag_list,
        reward_regex=pattern,
        reward_regex_default=not pattern_given,
        sample_source=sample_source,
        generation_prompt=prompt,
        checks=checks,
        notes=notes,
    )
