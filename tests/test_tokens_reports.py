"""The token reports check themselves: a report built with a value outside its vocabulary (a verdict, a
flag, a result, an init) or inconsistent counts raises at construction, so a bug upstream is a ValueError,
never a report that says something it does not mean."""

from __future__ import annotations

import pytest

from vlfast.tokens.fix import FixReport
from vlfast.tokens.pipeline import Check
from vlfast.tokens.report import GenerationCheck, NonFiniteRows, TagReport, TokenVerdict, VocabularyAudit
from vlfast.tokens.rewrite import RewriteReport


def _verdict(**change):
    fields = dict(
        id=5,
        piece="<think>",
        added=True,
        special=False,
        norm=1.0,
        norm_ratio=1.0,
        cos_distance=0.1,
        duplicate_of=None,
        flags=[],
        verdict="trained",
    )
    return TokenVerdict(**{**fields, **change})


def test_a_sound_verdict_is_built():
    assert _verdict().verdict == "trained"


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: _verdict(verdict="great"), "TokenVerdict.verdict must be one of"),
        (lambda: _verdict(flags=["shiny"]), "unknown flags"),
        (lambda: _verdict(id=-1), "id must be >= 0"),
        (
            lambda: TagReport("<think>", ["tags"], [1, 2], False, [_verdict()], "trained"),
            "one entry per token id",
        ),
        (lambda: NonFiniteRows("embed_tokens", count=1, ids=[1, 2]), "does not cover"),
        (
            lambda: GenerationCheck(5, "<think>", "untrained", {"p": 0.1}, 0.1, "maybe"),
            "result must be one of",
        ),
        (
            lambda: VocabularyAudit(verdicts=[3], flags={}, reference_ids=[], tokenizer_length=1),
            "must be 0, 1 or 2",
        ),
        (lambda: RewriteReport(mapping={}), "mapping is empty"),
        (lambda: FixReport("m", "o", "zeros", [], [], [], "untrained"), "init must be one of"),
        (lambda: Check("spelling", "pass", "", None), "Check.name must be one of"),
        (lambda: Check("round-trip", "maybe", "", None), "Check.status must be one of"),
    ],
)
def test_a_report_with_a_value_it_cannot_mean_is_refused(build, match):
    with pytest.raises(ValueError, match=match):
        build()
