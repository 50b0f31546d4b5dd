"""Token audit for RL format tags: are the rows of `<think>`/`</think>` (or any tag a template or reward
uses) trained in this checkpoint? Plus trained alternatives, a consistent rewrite, and a fix (docs/tokens.md).
"""

from vlfast._lazy import lazy_exports

# Each name loads its module on first use: `vlfast tokens rewrite` and a refusal never wait for torch.
_EXPORTS = {
    "audit_tokens": "audit",
    "audit_vocabulary": "audit",
    "fix_tokens": "fix",
    "verify_generation": "generation",
    "rewrite_tags": "rewrite",
    "parse_mapping": "rewrite",
    **dict.fromkeys(
        (
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
        ),
        "report",
    ),
    "FixReport": "fix",
    "RewriteReport": "rewrite",
}
__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
