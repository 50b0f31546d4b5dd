"""Report dataclasses of the token audit: data only, rendering lives in the CLI.

`to_dict()` is strict JSON: a float that is NaN or infinite (a broken row's norm) becomes None, so
`json.dumps(report.to_dict(), allow_nan=False)` never fails and no parser meets a bare `NaN`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from vlfast.tokens.verdict import VERDICTS

FLAGS = ("non-finite", "zero", "duplicate", "low-norm", "near-unused")
GENERATION_RESULTS = ("verified-strong", "verified-weak", "rejected")
MAX_LISTED_IDS = 100  # non-finite row ids listed per matrix; `count` has them all


def strict_json(value: Any) -> Any:
    """`value` with every non-finite float replaced by None, recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def one_of(field_name: str, value: str, allowed: tuple[str, ...]) -> None:
    """Refuse (ValueError) a value of the field `field_name` ("Owner.field") outside its vocabulary."""
    if value not in allowed:
        raise ValueError(f"{field_name} must be one of {allowed}, got {value!r}")


@dataclass
class TokenVerdict:
    """One token of a tag and what its embedding rows say."""

    id: int
    piece: str
    added: bool
    special: bool
    norm: float | None  # None when the row holds NaN or inf
    norm_ratio: float | None  # norm / median norm of ordinary rows
    cos_distance: float | None  # Magikarp indicator on the output matrix; None when undefined
    duplicate_of: int | None
    flags: list[str]
    verdict: str

    def __post_init__(self) -> None:
        one_of("TokenVerdict.verdict", self.verdict, VERDICTS)
        unknown = set(self.flags) - set(FLAGS)
        if unknown:
            raise ValueError(f"TokenVerdict.flags has unknown flags {sorted(unknown)}")
        if self.id < 0:
            raise ValueError(f"TokenVerdict.id must be >= 0, got {self.id}")


@dataclass
class Alternative:
    """A replacement for a tag, checked with the same indicators."""

    tag: str
    token_ids: list[int]
    pieces: list[str]
    verdict: str

    def __post_init__(self) -> None:
        one_of("Alternative.verdict", self.verdict, VERDICTS)


@dataclass
class TagReport:
    tag: str
    sources: list[str]  # where the format uses it: "tags", "template", "reward-regex", "default"
    token_ids: list[int]
    single_token: bool
    tokens: list[TokenVerdict]
    verdict: str
    alternatives: list[Alternative] = field(default_factory=list)

    def __post_init__(self) -> None:
        one_of("TagReport.verdict", self.verdict, VERDICTS)
        if len(self.tokens) != len(self.token_ids):
            raise ValueError("TagReport.tokens must have one entry per token id")


@dataclass
class SkippedTag:
    """A tag the format uses that the audit leaves out on purpose, and why."""

    tag: str
    sources: list[str]
    reason: str


@dataclass
class NonFiniteRows:
    """Rows of one matrix holding NaN or inf: a defect whatever the tags (a NaN lm_head row makes
    every softmax NaN)."""

    matrix: str
    count: int
    ids: list[int]  # the first MAX_LISTED_IDS

    def __post_init__(self) -> None:
        if self.count < len(self.ids) or self.count <= 0:
            raise ValueError(f"NonFiniteRows.count {self.count} does not cover its {len(self.ids)} ids")


@dataclass
class GenerationCheck:
    """Magikarp's second stage for one token: can the model repeat it when asked to?"""

    id: int
    piece: str
    weights_verdict: str | None  # the token's verdict from the weights audit; None when not audited
    probabilities: dict[str, float]  # prompt name -> P(next token is this one)
    max_probability: float
    result: str  # "verified-strong" | "verified-weak" (untrained confirmed) | "rejected" (reproduced)

    def __post_init__(self) -> None:
        if self.weights_verdict is not None:
            one_of("GenerationCheck.verdict", self.weights_verdict, VERDICTS)
        one_of("GenerationCheck.result", self.result, GENERATION_RESULTS)


@dataclass
class GenerationReport:
    """Repetition prompts run through the model for a set of token ids."""

    model_dir: str
    model_class: str
    device: str
    dtype: str
    prompts: dict[str, str]  # name -> template, «token» where the token's id goes
    thresholds: dict[str, float]  # "strong": below it verified-strong; "weak": below it verified-weak
    tokens: list[GenerationCheck]
    batch_size: int
    load_seconds: float
    run_seconds: float
    peak_memory_mib: float | None  # CUDA: peak allocated during the run; CPU: the process's peak RSS
    peak_memory_kind: str

    def to_dict(self) -> dict:
        return strict_json(asdict(self))


@dataclass
class IndicatorInfo:
    """How an indicator was thresholded on this checkpoint (None where it could not be computed)."""

    indicator: str
    matrix: str
    ordinary_median: float | None
    reference_median: float | None
    cut: float | None
    separation: float | None = None  # Youden's J of the cut between reference and ordinary rows
    informative: bool | None = None  # whether the verdicts rely on it (J >= 0.5)
    note: str | None = None


@dataclass
class TokenAudit:
    model_dir: str
    embedding: str
    lm_head: str | None
    tied: bool
    shape: list[int]  # (rows, width) of the input embedding
    dtype: str
    tokenizer_length: int
    reference_count: int
    reference_sources: dict[str, int]  # "padding", "unused-names", "user" -> row count
    indicators: list[IndicatorInfo]
    tags: list[TagReport]
    verdict: str
    suggested_mapping: dict[str, str]  # untrained tag -> alternative whose pieces are trained
    seconds: float
    non_finite: list[NonFiniteRows] = field(default_factory=list)
    skipped: list[SkippedTag] = field(default_factory=list)
    generation: GenerationReport | None = None  # --verify-generation

    def __post_init__(self) -> None:
        one_of("TokenAudit.verdict", self.verdict, VERDICTS)
        if len(self.shape) != 2:
            raise ValueError(f"TokenAudit.shape must be (rows, width), got {self.shape}")

    @property
    def ok(self) -> bool:
        return self.verdict != "untrained" and not self.non_finite

    @property
    def untrained_tags(self) -> list[str]:
        return [t.tag for t in self.tags if t.verdict == "untrained"]

    def to_dict(self) -> dict:
        return strict_json({**asdict(self), "ok": self.ok, "untrained_tags": self.untrained_tags})


@dataclass
class VocabularyAudit:
    """Verdict per row of the whole vocabulary (for validation against known-unused ids)."""

    verdicts: list[int]  # 0 trained, 1 suspect, 2 untrained, per row of the input embedding
    flags: dict[str, list[int]]  # flag -> ids carrying it
    reference_ids: list[int]
    tokenizer_length: int

    def __post_init__(self) -> None:
        if not set(self.verdicts) <= {0, 1, 2}:
            raise ValueError("VocabularyAudit.verdicts must be 0, 1 or 2")

    def ids(self, verdict: str) -> list[int]:
        code = VERDICTS.index(verdict)
        return [i for i, v in enumerate(self.verdicts) if v == code]
