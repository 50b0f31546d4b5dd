"""Token audit for RL format tags: are the rows of `<think>`/`</think>` (or any tag a template or
reward uses) trained in this checkpoint? Plus trained alternatives, a consistent rewrite, and a fix.

    from vlfast.tokens import audit_tokens
    report = audit_tokens("path/to/Qwen3-8B-Base")        # checks <think> and </think>
    report.verdict, report.untrained_tags, report.suggested_mapping
    report.non_finite, report.skipped                      # rows holding NaN/inf; Qwen-VL placeholders
    audit_tokens(path, verify_generation=True).generation  # Magikarp's repetition check, model loaded
"""

from vlfast.tokens.audit import audit_tokens, audit_vocabulary
from vlfast.tokens.fix import FixReport, fix_tokens
from vlfast.tokens.generation import verify_generation
from vlfast.tokens.report import (
    Alternative,
    GenerationCheck,
    GenerationReport,
    IndicatorInfo,
    NonFiniteRows,
    SkippedTag,
    TagReport,
    TokenAudit,
    TokenVerdict,
    VocabularyAudit,
)
from vlfast.tokens.rewrite import RewriteReport, parse_mapping, rewrite_tags

__all__ = [
    "audit_tokens",
    "audit_vocabulary",
    "fix_tokens",
    "verify_generation",
    "rewrite_tags",
    "parse_mapping",
    "TokenAudit",
    "TagReport",
    "TokenVerdict",
    "Alternative",
    "IndicatorInfo",
    "VocabularyAudit",
    "NonFiniteRows",
    "SkippedTag",
    "GenerationReport",
    "GenerationCheck",
    "FixReport",
    "RewriteReport",
]
