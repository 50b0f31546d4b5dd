"""Replacement tags for untrained ones: names that split into trained pieces, checked like the tag."""

from __future__ import annotations

import re
from typing import Protocol

from vlfast.tokens.report import Alternative, TagReport, TokenVerdict


class SpellsTags(Protocol):
    """What a proposal needs of an audit's analysis (``vlfast.tokens.audit.Analysis``): a tag's ids,
    tokens and verdict. A protocol, not an import: the audit imports this module."""

    def tag_verdict(self, tag: str) -> tuple[list[int], list[TokenVerdict], str]: ...


# Synonyms per tag name, best first (`<thinking>`: the zero-RL reports' remedy); others get the pool.
SYNONYMS = {
    "think": ("thinking", "reasoning", "thought", "reason", "scratchpad"),
    "thinking": ("reasoning", "thought", "reason"),
    "reasoning": ("thinking", "thought", "reason"),
    "answer": ("final", "solution", "response", "result"),
    "tool_call": ("tool", "call", "action"),
    "tool_response": ("observation", "result", "output"),
}
POOL = ("thinking", "reasoning", "thought", "answer", "solution", "final", "output")
MAX_ALTERNATIVES = 3

_XML = re.compile(r"^<(/?)([A-Za-z][\w:.-]*)>$")


def tag_name(tag: str) -> tuple[str, str] | None:
    """'</think>' -> ('/', 'think'); None for control tokens such as '<|im_start|>'."""
    m = _XML.match(tag)
    return m.groups() if m else None


def propose(an: SpellsTags, tag: str) -> list[Alternative]:
    """Up to MAX_ALTERNATIVES replacements for `tag` whose opening and closing forms are both trained."""
    parsed = tag_name(tag)
    if parsed is None:
        return []
    slash, name = parsed
    out = []
    for alt in SYNONYMS.get(name, POOL):
        if alt == name:
            continue
        try:
            forms = {form: an.tag_verdict(form) for form in (f"<{alt}>", f"</{alt}>")}
        except ValueError:  # the tokenizer cannot spell it (unknown characters): not a candidate
            continue
        # A pair is only usable if both halves are trained: the format emits both.
        if all(v[2] == "trained" for v in forms.values()):
            ids, tokens, verdict = forms[f"<{slash}{alt}>"]
            out.append(Alternative(f"<{slash}{alt}>", ids, [t.piece for t in tokens], verdict))
        if len(out) == MAX_ALTERNATIVES:
            break
    return out


def suggested_mapping(reports: list[TagReport]) -> dict[str, str]:
    """One consistent mapping for the failing tags: `<think>` and `</think>` get the same new name."""
    chosen: dict[str, str] = {}  # tag name -> alternative name
    for r in reports:
        parsed = tag_name(r.tag)
        if r.verdict != "untrained" or parsed is None or not r.alternatives or parsed[1] in chosen:
            continue
        alt = tag_name(r.alternatives[0].tag)
        if alt is not None:
            chosen[parsed[1]] = alt[1]
    named = [(r.tag, tag_name(r.tag)) for r in reports]
    return {tag: f"<{p[0]}{chosen[p[1]]}>" for tag, p in named if p is not None and p[1] in chosen}
