"""Write a copy of a checkpoint whose untrained tag rows start from trained ones (`pieces` or `mean`,
docs/tokens.md). Every fixed row is scaled to its matrix's median trained norm: an average of vectors is
shorter than any of them, and a short row is what marks a row as untrained (a short untied lm_head row
keeps the token's logit below its pieces'). The original is only read; OUT is renamed into place when
whole, so a failure leaves no partial checkpoint.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from vlfast._files import is_inside, same_file, write_atomically
from vlfast.errors import InputRefused
from vlfast.tokens.audit import Analysis, analyse, audit_tokens, collect_tags, require_dir, split_placeholders
from vlfast.tokens.report import TokenAudit, one_of, strict_json
from vlfast.tokens.verdict import worst
from vlfast.tokens.vocab import Vocabulary

INITS = ("pieces", "mean")
JITTER = 0.05  # mean init: jitter norm as a fraction of the median trained norm


@dataclass
class FixedRow:
    id: int
    piece: str
    init: str  # "pieces" or "mean" (a pieces request falls back to mean when no piece is trained)
    source_ids: list[int]  # the pieces averaged (empty for mean)
    matrices: list[str]


@dataclass
class FixReport:
    model_dir: str
    out_dir: str
    init: str
    rows: list[FixedRow]
    files_rewritten: list[str]
    files_copied: list[str]
    before: str  # overall verdict before
    after: TokenAudit | None = None  # the audit of the new checkpoint
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        one_of("FixReport.init", self.init, INITS)

    @property
    def ok(self) -> bool:
        return self.after is None or self.after.ok

    def to_dict(self) -> dict:
        after = None if self.after is None else self.after.to_dict()
        return strict_json({**asdict(self), "after": after, "ok": self.ok})


def _mean_trained_row(an: Analysis, name: str) -> torch.Tensor:
    trained = an.ordinary & (an.judge.verdicts() == 0)
    total, count = None, 0
    for start, x in an.weights.blocks(name):
        m = torch.from_numpy(trained[start : start + x.shape[0]])
        s = x[m].double().sum(0)
        total = s if total is None else total + s
        count += int(m.sum())
    if not count:
        raise InputRefused(f"no trained rows in {name} to average; the checkpoint looks untrained")
    return (total / count).float()


def _targets(an: Analysis, wanted: dict[str, list[str]]) -> dict[int, str]:
    """Untrained token ids of the tags -> the text of the token."""
    return {
        t.id: an.vocab.tokenizer.decode([t.id], skip_special_tokens=False) or tag
        for tag in wanted
        for t in an.tag_verdict(tag)[1]
        if t.verdict == "untrained"
    }


def fix_tokens(
    model: str | Path,
    out: str | Path,
    tags: Sequence[str] | None = None,
    *,
    init: str = "pieces",
    template: str | Path | None = None,
    reward_regex: str | None = None,
    reference_ids: Sequence[int | str] | None = None,
    verify: bool = True,
    include_placeholders: bool = False,
) -> FixReport:
    """Write `out`, a copy of `model` whose untrained tag rows are initialised from trained rows. Qwen-VL
    placeholders (`<|image_pad|>`, ...) are left alone unless `include_placeholders`: not a format's tags."""
    if init not in INITS:
        raise InputRefused(f"--init must be one of {', '.join(INITS)}, got {init!r}")
    model, out = Path(model), Path(out)
    _refuse_out(model, out)
    wanted = collect_tags(tags, template, reward_regex)
    wanted, skipped = (wanted, []) if include_placeholders else split_placeholders(wanted)
    notes = [f"{s.tag} left alone: {s.reason}" for s in skipped]
    vocab = Vocabulary.load(model)
    exclude = sorted({i for t in wanted for i in vocab.split(t)})
    an = analyse(model, reference_ids=reference_ids, exclude_ids=exclude, vocab=vocab)
    targets = _targets(an, wanted)
    for bad in an.non_finite():
        more = ", ..." if bad.count > 10 else ""
        notes.append(
            f"{bad.matrix}: {bad.count} row(s) hold NaN or inf (ids {', '.join(map(str, bad.ids[:10]))}{more}); "
            "fix rewrites only the tags' untrained rows, so any other broken row stays broken: "
            "restore those from a sound copy of the checkpoint"
        )
    before = worst([an.tag_verdict(tag)[2] for tag in wanted])
    w = an.weights
    # Matrices to edit: the embedding, plus a stored lm_head (also when tied: keep the copy in step).
    matrices = [w.embedding_name] + ([w.lm_head_name] if w.lm_head_name else [])
    verdicts = an.judge.verdicts()
    rows: list[FixedRow] = []
    for tid, text in targets.items():
        sources = []
        if init == "pieces":
            sources = [
                p for p in an.vocab.plain_split(text) if p != tid and p < len(verdicts) and verdicts[p] == 0
            ]
            if not sources:
                notes.append(f"token {tid} ({text!r}) has no trained pieces; initialised from the mean row")
        rows.append(FixedRow(tid, an.vocab.piece(tid), "pieces" if sources else "mean", sources, matrices))

    plans = {r.id: r.source_ids for r in rows}
    new_values = {name: _new_rows(an, name, plans) for name in matrices}

    written: list[tuple[list[str], list[str]]] = []
    write_atomically(out, lambda tmp: written.append(_write(w, model, tmp, new_values)), tag="fix")
    files_rewritten, files_copied = written[0]
    report = FixReport(str(model), str(out), init, rows, files_rewritten, files_copied, before, None, notes)
    if verify and wanted:
        report.after = audit_tokens(
            out, list(wanted), reference_ids=reference_ids, alternatives=False, include_placeholders=True
        )
    return report


def _refuse_out(model: Path, out: Path) -> None:
    require_dir(model)
    if same_file(out, model) or out.resolve() == model.resolve():
        raise InputRefused(
            f"OUT {out} is the checkpoint --model {model}: the original is never modified; name a new folder"
        )
    if is_inside(out, model):
        raise InputRefused(
            f"OUT {out} is inside the checkpoint --model {model}: the checkpoint folder is only read; name a "
            "new folder outside it"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputRefused(f"{out} exists and is not empty; choose a new folder for the fixed checkpoint")


def _new_rows(an: Analysis, name: str, plans: dict[int, list[int]]) -> dict[int, torch.Tensor]:
    """Each target's new row in ``name``: the mean of its trained pieces, or the mean trained row with a
    seeded jitter; scaled to the matrix's median trained norm."""
    w = an.weights
    # A stored lm_head under a tying config is a copy of the embedding: judged by the input stats.
    stats = an.judge.input_stats if name == w.embedding_name or w.tied else an.judge.output_stats
    median_norm = float(np.median(stats.norm[an.ordinary]))
    mean_row = None
    values: dict[int, torch.Tensor] = {}
    for tid, sources in plans.items():
        if sources:
            row = w.rows(name, sources).mean(0)
        else:
            if mean_row is None:
                mean_row = _mean_trained_row(an, name)
            gen = torch.Generator().manual_seed(int(tid))
            jitter = torch.randn(mean_row.shape[0], generator=gen)
            row = mean_row + jitter * (JITTER * median_norm / jitter.norm())
        if row.norm() > 0:  # an average is shorter than any of its rows: give it a trained length
            row = row * (median_norm / row.norm())
        values[tid] = row
    return values


def _write(w, model: Path, out: Path, new_values: dict[str, dict[int, torch.Tensor]]):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from vlfast._files import honour_umask

    out.mkdir()
    edit_files = {w.tensor_files[name] for name, v in new_values.items() if v}
    rewritten, copied = [], []
    for src in sorted(model.iterdir()):
        dst = out / src.name
        if src in edit_files:
            with safe_open(str(src), framework="pt") as f:
                metadata = f.metadata()
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
            for name, values in new_values.items():
                if name in tensors and values:
                    t = tensors[name].clone()
                    ids = torch.tensor(sorted(values))
                    t[ids] = torch.stack([values[i] for i in sorted(values)]).to(t.dtype)
                    tensors[name] = t
            save_file(tensors, str(dst), metadata=metadata)
            honour_umask(dst)  # safetensors writes 0600; teammates must be able to read the fixed checkpoint
            rewritten.append(src.name)
        elif src.is_dir():
            shutil.copytree(src, dst)
            copied.append(src.name + "/")
        else:
            shutil.copy2(src, dst)
            copied.append(src.name)
    return rewritten, copied
