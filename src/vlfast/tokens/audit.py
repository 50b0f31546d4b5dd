"""The token audit: do the tags a format needs have trained embedding rows? `analyse` streams each matrix
once and fits the thresholds; `audit_tokens` gives a verdict per tag, `audit_vocabulary` one per row.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from vlfast.errors import InputRefused
from vlfast.tokens.alternatives import propose, suggested_mapping
from vlfast.tokens.report import (
    MAX_LISTED_IDS,
    IndicatorInfo,
    NonFiniteRows,
    SkippedTag,
    TagReport,
    TokenAudit,
    TokenVerdict,
    VocabularyAudit,
)
from vlfast.tokens.tags import (
    DEFAULT_TAGS,
    PLACEHOLDERS,
    read_template,
    split_tag_args,
    tags_in_regex,
    tags_in_text,
)
from vlfast.tokens.verdict import VERDICTS, Judge, worst
from vlfast.tokens.vocab import Vocabulary

if TYPE_CHECKING:  # pragma: no cover
    from vlfast.tokens.weights import CheckpointWeights


@dataclass
class Analysis:
    """Indicator arrays and thresholds of one checkpoint, plus its tokenizer."""

    weights: CheckpointWeights
    vocab: Vocabulary
    judge: Judge
    reference_ids: list[int]
    reference_sources: dict[str, int]
    ordinary: np.ndarray  # (V,) bool

    def token(self, token_id: int) -> TokenVerdict:
        flags = self.judge.flags(np.array([token_id]))
        verdict = VERDICTS[int(self.judge.verdicts(np.array([token_id]))[0])]
        s_in = self.judge.input_stats
        s_out = self.judge.output_stats or s_in
        dup = int(s_in.duplicate_of[token_id])
        if dup < 0:
            dup = int(s_out.duplicate_of[token_id])
        norm = float(s_in.norm[token_id])
        cos = None if s_out.cos_distance is None else float(s_out.cos_distance[token_id])
        finite = np.isfinite(norm)
        return TokenVerdict(
            id=int(token_id),
            piece=self.vocab.piece(token_id),
            added=token_id in self.vocab.added,
            special=self.vocab.added.get(token_id, False),
            norm=norm if finite else None,
            norm_ratio=norm / max(self.judge.norm.ordinary_median, 1e-30) if finite else None,
            cos_distance=cos if cos is not None and np.isfinite(cos) else None,
            duplicate_of=dup if dup >= 0 else None,
            flags=[k for k, v in flags.items() if bool(v[0])],
            verdict=verdict,
        )

    def tag_verdict(self, tag: str) -> tuple[list[int], list[TokenVerdict], str]:
        ids = self.vocab.split(tag)
        rows = self.judge.input_stats.rows
        bad = [i for i in ids if i >= rows]
        if bad:
            raise InputRefused(
                f"tag {tag!r} maps to ids {bad} but the embedding has only {rows} rows; "
                "the tokenizer and the weights in the folder do not belong together"
            )
        tokens = [self.token(i) for i in ids]
        return ids, tokens, worst([t.verdict for t in tokens])

    def non_finite(self) -> list[NonFiniteRows]:
        """Rows holding NaN or inf, per matrix read."""
        read = [s for s in (self.judge.input_stats, self.judge.output_stats) if s is not None]
        bad = [(s.name, np.flatnonzero(~s.finite)) for s in read]
        return [NonFiniteRows(name, len(ids), ids[:MAX_LISTED_IDS].tolist()) for name, ids in bad if len(ids)]

    def indicator_info(self) -> list[IndicatorInfo]:
        out = []
        for t in (self.judge.norm, self.judge.cos):
            if t is not None:
                d = {k: v for k, v in vars(t).items() if k != "flag_below"}  # IndicatorInfo's fields
                out.append(IndicatorInfo(**d, informative=t.informative))
        if self.judge.cos is None:
            name = (self.judge.output_stats or self.judge.input_stats).name
            out.append(IndicatorInfo("cos_distance", name, None, None, None, note=self.judge.cos_note))
        return out


_ID_OR_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?", re.ASCII)


def _parse_reference(values: Sequence[int | str] | None) -> list[tuple[int, int, str]] | None:
    """[1, '5-7', '9,10'] -> [(1, 1, '1'), (5, 7, '5-7'), (9, 9, '9'), (10, 10, '10')], ranges never expanded
    (0-1000000000000 is two numbers). A blank value, a reversed range or anything but whole numbers from 0
    is an error: each would silently leave the audit without the reference rows the user meant."""
    if values is None:
        return None
    out: list[tuple[int, int, str]] = []
    for v in [values] if isinstance(values, str) else values:
        parts = [p for p in str(v).replace(" ", "").split(",") if p]
        if not parts:
            raise InputRefused(
                f"--reference-ids {str(v)!r} names no id; give ids or ranges such as 151669-152063"
            )
        for part in parts:
            m = _ID_OR_RANGE.fullmatch(part)
            if m is None:
                raise InputRefused(
                    f"--reference-ids value {_shown(part)!r} is not an id or a range like 5-7: ids are whole "
                    "numbers from 0"
                )
            a, b = (_bounded_int(x) for x in (m[1], m[2] or m[1]))
            if a > b:
                swap = f"; write {m[2]}-{m[1]}" if len(part) <= 60 else ""
                raise InputRefused(f"reference range {_shown(part)!r} is reversed{swap}")
            out.append((a, b, part))
    return out


_BEYOND = 1 << 64  # stands for any id written with more digits than an embedding could have rows


def _bounded_int(digits: str) -> int:
    # int() of thousands of digits is slow and, past 4,300, refused by Python: any such id is out of range
    return int(digits) if len(digits.lstrip("0")) <= 19 else _BEYOND


def _shown(part: str) -> str:
    return part if len(part) <= 60 else part[:57] + "..."


def _reference_mask(ranges: list[tuple[int, int, str]], rows: int) -> np.ndarray:
    """The rows the user's ranges name, each checked against the matrix before any is expanded."""
    mask = np.zeros(rows, bool)
    for a, b, part in ranges:
        if b >= rows:
            what = f"id {_shown(part)!r} is" if a == b else f"range {_shown(part)!r} reaches"
            raise InputRefused(
                f"--reference-ids {what} past the embedding's {rows} rows (valid ids: 0-{rows - 1})"
            )
        mask[a : b + 1] = True
    return mask


def analyse(
    model: str | Path,
    *,
    reference_ids: Sequence[int | str] | None = None,
    exclude_ids: Sequence[int] = (),
    embedding_name: str | None = None,
    lm_head_name: str | None = None,
    vocab: Vocabulary | None = None,
) -> Analysis:
    """Read the checkpoint's embedding matrices and fit the thresholds. `exclude_ids` (the audited tags'
    tokens) are kept out of both the reference and the ordinary rows: a tag never vouches for itself."""
    user = _parse_reference(reference_ids)  # before any file is read: a typo is named first
    # torch reads the matrices: imported here, so a refusal before them does not wait for it (seconds)
    from vlfast.tokens.indicators import matrix_stats
    from vlfast.tokens.weights import CheckpointWeights

    weights = CheckpointWeights.open(model, embedding_name, lm_head_name)
    vocab = vocab or Vocabulary.load(model)
    rows, _ = weights.shape(weights.embedding_name)
    if not weights.tied:
        out_rows = weights.shape(weights.lm_head_name)[0]
        if out_rows != rows:
            raise InputRefused(
                f"{weights.embedding_name} has {rows} rows but {weights.lm_head_name} has {out_rows}; "
                "pass --embedding-name/--lm-head-name to pick matching matrices"
            )
    if vocab.length > rows:
        raise InputRefused(
            f"the tokenizer in {model} has {vocab.length} ids but {weights.embedding_name} only {rows} rows; "
            "the tokenizer and the weights do not belong together"
        )
    excluded = set(int(i) for i in exclude_ids)
    if user is not None:
        mask = _reference_mask(user, rows)
        sources = {"user": int(mask.sum())}
        ref = [i for i in np.flatnonzero(mask).tolist() if i not in excluded]
    else:
        padding = list(range(vocab.length, rows))
        named = vocab.unused_by_name()
        sources = {"padding": len(padding), "unused-names": len(named)}
        ref = sorted((set(padding) | set(named)) - excluded)

    reference = np.zeros(rows, bool)
    reference[ref] = True
    ordinary = ~reference
    ordinary[vocab.length :] = False
    ordinary[list(vocab.added)] = False  # added tokens are the usual suspects, not the norm
    ordinary[list(excluded)] = False

    input_stats = matrix_stats(weights, weights.embedding_name, ref)
    output_stats = None if weights.tied else matrix_stats(weights, weights.lm_head_name, ref)
    # A row with NaN or inf is a defect of its own (flagged `non-finite`), never a sample of "ordinary".
    ordinary &= input_stats.finite & (output_stats.finite if output_stats is not None else True)
    judge = Judge.fit(input_stats, output_stats, ordinary, reference)
    return Analysis(weights, vocab, judge, ref, sources, ordinary)


def collect_tags(
    tags: str | Sequence[str] | None, template: str | Path | None, reward_regex: str | None
) -> dict[str, list[str]]:
    """tag -> where the format uses it; the Qwen3 thinking pair when nothing is given."""
    named = {"tags": split_tag_args(tags)}  # a str is one --tags value, not a list of characters
    if template is not None:
        named["template"] = tags_in_text(read_template(template))
    if reward_regex is not None:
        named["reward-regex"] = tags_in_regex(reward_regex)
        if not named["reward-regex"]:
            raise InputRefused(
                f"--reward-regex {reward_regex!r} contains no tag such as <think>; nothing to audit"
            )
    found: dict[str, list[str]] = {}
    for source, in_source in named.items():
        for tag in in_source:
            found.setdefault(tag, []).append(source)
    return found or {t: ["default"] for t in DEFAULT_TAGS}


def split_placeholders(wanted: dict[str, list[str]]) -> tuple[dict[str, list[str]], list[SkippedTag]]:
    """(tags to audit, VLM placeholder tags left out with the reason) from `collect_tags`' result."""
    kept = {t: s for t, s in wanted.items() if t not in PLACEHOLDERS}
    skipped = [SkippedTag(t, s, PLACEHOLDERS[t]) for t, s in wanted.items() if t in PLACEHOLDERS]
    return kept, skipped


def require_dir(model: str | Path) -> None:
    if not Path(model).is_dir():
        from vlfast.models.checkpoints import missing_model_hint  # only on this error path

        raise FileNotFoundError(
            f"{model} is not a directory: {missing_model_hint(str(model), references=False)}"
        )


def audit_tokens(
    model: str | Path,
    tags: Sequence[str] | None = None,
    *,
    template: str | Path | None = None,
    reward_regex: str | None = None,
    reference_ids: Sequence[int | str] | None = None,
    alternatives: bool = True,
    embedding_name: str | None = None,
    lm_head_name: str | None = None,
    include_placeholders: bool = False,
    verify_generation: bool = False,
    device: str | None = None,
    dtype: str | None = None,
) -> TokenAudit:
    """Audit the embedding rows of the tags a format uses, in the local checkpoint folder ``model``.

    The tags are ``tags`` (default `<think>`, `</think>` when no template or regex is given either) and
    those of ``template`` and ``reward_regex``; Qwen-VL placeholders are listed in `skipped` unless
    ``include_placeholders``. ``reference_ids``: known never-trained ids (ints or "a-b" ranges; default the
    padding rows beyond the tokenizer plus `[unused*]`/reserved entries). ``verify_generation`` also loads
    the model (on ``device``, in ``dtype``) and runs Magikarp's repetition prompts (`generation`).
    """
    t0 = time.perf_counter()
    if verify_generation:
        from vlfast.tokens.generation import resolve

        resolve(device, dtype)  # a bad --device or --dtype fails now, not after the weights pass
    elif device is not None or dtype is not None:
        raise InputRefused("--device and --dtype are for --verify-generation; add it or drop them")
    wanted = collect_tags(tags, template, reward_regex)
    wanted, skipped = (wanted, []) if include_placeholders else split_placeholders(wanted)
    require_dir(model)
    vocab = Vocabulary.load(model)
    exclude = sorted({i for t in wanted for i in vocab.split(t)})
    an = analyse(
        model,
        reference_ids=reference_ids,
        exclude_ids=exclude,
        embedding_name=embedding_name,
        lm_head_name=lm_head_name,
        vocab=vocab,
    )
    reports = []
    for tag, sources in wanted.items():
        ids, tokens, verdict = an.tag_verdict(tag)
        alts = propose(an, tag) if alternatives and verdict != "trained" else []
        reports.append(TagReport(tag, sources, ids, len(ids) == 1, tokens, verdict, alts))
    w = an.weights
    seconds = round(time.perf_counter() - t0, 3)
    generation = None
    tokens = {t.id: t.verdict for r in reports for t in r.tokens}
    if verify_generation and tokens:
        from vlfast.tokens.generation import verify_generation as run

        generation = run(
            model, list(tokens), weights_verdicts=tokens, vocab=vocab, device=device, dtype=dtype
        )
    return TokenAudit(
        model_dir=str(model),
        embedding=w.embedding_name,
        lm_head=w.lm_head_name,
        tied=w.tied,
        shape=list(w.shape(w.embedding_name)),
        dtype=w.dtype(w.embedding_name),
        tokenizer_length=an.vocab.length,
        reference_count=len(an.reference_ids),
        reference_sources=an.reference_sources,
        indicators=an.indicator_info(),
        tags=reports,
        verdict=worst([r.verdict for r in reports]),
        suggested_mapping=suggested_mapping(reports),
        seconds=seconds,
        non_finite=an.non_finite(),
        skipped=skipped,
        generation=generation,
    )


def audit_vocabulary(
    model: str | Path,
    *,
    reference_ids: Sequence[int | str] | None = None,
    embedding_name: str | None = None,
    lm_head_name: str | None = None,
) -> VocabularyAudit:
    """Verdict for every row; used to measure recall and false positives against known-unused ids."""
    an = analyse(model, reference_ids=reference_ids, embedding_name=embedding_name, lm_head_name=lm_head_name)
    verdicts = an.judge.verdicts()
    flags = {k: np.flatnonzero(v).tolist() for k, v in an.judge.flags().items()}
    return VocabularyAudit(verdicts.astype(int).tolist(), flags, an.reference_ids, an.vocab.length)
