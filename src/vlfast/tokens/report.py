"""Report dataclasses of the token audit: data only, rendering lives in the CLI."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from vlfast.tokens.verdict import VERDICTS

FLAGS = ("zero", "duplicate", "low-norm", "near-unused")


def _check_verdict(owner: str, verdict: str) -> None:
    if verdict not in VERDICTS:
        raise ValueError(f"{owner}.verdict must be one of {VERDICTS}, got {verdict!r}")


@dataclass
class TokenVerdict:
    """One token of a tag and what its embedding rows say."""

    id: int
    piece: str
    added: bool
    special: bool
    norm: float
    norm_ratio: float  # norm / median norm of ordinary rows
    cos_distance: float | None  # Magikarp indicator on the output matrix; None when undefined
    duplicate_of: int | None
    flags: list[str]
    verdict: str

    def __post_init__(self) -> None:
        _check_verdict("TokenVerdict", self.verdict)
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
        _check_verdict("Alternative", self.verdict)


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
        _check_verdict("TagReport", self.verdict)
        if len(self.tokens) != len(self.token_ids):
            raise ValueError("TagReport.tokens must have one entry per token id")


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

    def __post_init__(self) -> None:
        _check_verdict("TokenAudit", self.verdict)
        if len(self.shape) != 2:
            raise ValueError(f"TokenAudit.shape must be (rows, width), got {self.shape}")

    @property
    def ok(self) -> bool:
        return self.verdict != "untrained"

    @property
    def untrained_tags(self) -> list[str]:
        return [t.tag for t in self.tags if t.verdict == "untrained"]

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok, "untrained_tags": self.untrained_tags}


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
