"""``vlfast tokens``: audit, rewrite and fix the format tags (`<think>`...) an RL run depends on.

`audit` and `fix` exit 1 when a tag is untrained (with --strict also suspect) or rows hold NaN or inf;
`check-pipeline` exits 1 when a check fails, 0 when each passes or is skipped; 2 bad input, 3 could not
run, 4 disk full.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from vlfast.cli._common import (
    EXIT_FINDING,
    JsonOpt,
    add_group,
    console,
    handle_errors,
    option,
    print_json,
    print_table,
    say,
)
from vlfast.cli._extras import require

_STYLE = {"trained": "green", "suspect": "yellow", "untrained": "bold red"}

LocalModelOpt = option(
    str, "--model", "-m", help="A local checkpoint folder: safetensors weights and a tokenizer."
)
TagsOpt = option(
    list[str] | None,
    "--tags",
    "-t",
    help="Tags to check, repeatable or comma-separated; a bare name is the pair, as in rewrite's --map: "
    "think = <think>, </think>. Default: <think>, </think>.",
)
TemplateOpt = option(
    str | None,
    "--template",
    help="A chat template (.jinja, or a tokenizer_config.json); its tags are checked.",
)
RegexOpt = option(
    str | None, "--reward-regex", help="The format reward's regex; the tags it matches are checked."
)
ReferenceOpt = option(
    list[str] | None,
    "--reference-ids",
    help="Known never-trained ids or ranges (e.g. 151669-152063). Default: padding rows beyond the "
    "tokenizer plus [unused*]/reserved tokens.",
)

PlaceholdersOpt = option(
    bool,
    help="Also check Qwen-VL placeholder tokens (<|image_pad|>, <|vision_start|>, <|box_start|>, ...), "
    "which are skipped by default: the model never predicts them, so their rows may look untrained.",
)


def _show(text: str) -> None:
    console.print(text, soft_wrap=True)


def _v(verdict: str) -> str:
    return f"[{_STYLE[verdict]}]{verdict}[/{_STYLE[verdict]}]"


_TAG_COLUMNS = ("tag", "used by", "id", "piece", "added", "norm / ordinary", "cos dist", "flags", "verdict")


def _render_audit(report) -> None:
    head = Table(title=f"Token audit: {escape(report.model_dir)}", show_header=False, title_justify="left")
    head.add_column(style="bold")
    head.add_column()
    head.add_row("embedding", f"{report.embedding} {tuple(report.shape)} {report.dtype}")
    head.add_row("lm_head", "tied to the embedding" if report.tied else str(report.lm_head))
    head.add_row("tokenizer ids", f"{report.tokenizer_length:,}")
    sources = ", ".join(f"{k} {v:,}" for k, v in report.reference_sources.items())
    head.add_row("reference rows", f"{report.reference_count:,} never-trained rows ({sources})")
    for bad in report.non_finite:
        more = ", ..." if bad.count > len(bad.ids[:20]) else ""
        head.add_row(
            "[bold red]non-finite rows[/bold red]",
            f"[bold red]{bad.matrix}: {bad.count:,} row(s) hold NaN or inf[/bold red] "
            f"(ids {', '.join(map(str, bad.ids[:20]))}{more}); left out of every statistic",
        )
    for ind in report.indicators:
        if ind.cut is None:
            head.add_row(ind.indicator, f"[dim]not computed: {escape(ind.note)}[/dim]")
            continue
        ref = "n/a" if ind.reference_median is None else f"{ind.reference_median:.4g}"
        sep = "" if ind.separation is None else f", separation {ind.separation:.2f}"
        used = "" if ind.informative else " [yellow](not informative here: ignored)[/yellow]"
        stats = f"median ordinary {ind.ordinary_median:.4g}, reference {ref}, cut {ind.cut:.4g}{sep}{used}"
        head.add_row(ind.indicator, stats)
    for s in report.skipped:
        head.add_row("skipped", escape(f"{s.tag} ({', '.join(s.sources)}): {s.reason}"))
    head.add_row("time", f"{report.seconds:.2f} s")
    print_table(head)

    if report.tags:
        table = Table(title="Tags", title_justify="left")
        for col in _TAG_COLUMNS:
            table.add_column(col, justify="right" if col in ("id", "norm / ordinary", "cos dist") else "left")
        for tag in report.tags:
            for k, tok in enumerate(tag.tokens):
                first = k == 0
                table.add_row(
                    escape(tag.tag) if first else "",  # tags such as [THINK] are data, not markup
                    ", ".join(tag.sources) if first else "",
                    str(tok.id),
                    escape(repr(tok.piece)),
                    ("special" if tok.special else "added") if tok.added else "",
                    "-" if tok.norm_ratio is None else f"{tok.norm_ratio:.2f}",
                    "-" if tok.cos_distance is None else f"{tok.cos_distance:.3f}",
                    ", ".join(tok.flags),
                    _v(tok.verdict) + (f" -> tag {_v(tag.verdict)}" if first and len(tag.tokens) > 1 else ""),
                )
        print_table(table)
    if report.generation is not None:
        _render_generation(report.generation)
    for tag in report.tags:
        if tag.alternatives:
            alts = ", ".join(f"{a.tag} ({' '.join(a.pieces)})" for a in tag.alternatives)
            _show(f"  {escape(tag.tag)}: trained alternatives {escape(alts)}")
    if report.skipped:
        _show(
            f"skipped {len(report.skipped)} Qwen-VL placeholder tag(s); --include-placeholders audits them too"
        )
    if report.non_finite:
        _show(
            "[bold red]broken:[/bold red] rows holding NaN or inf make the model's outputs NaN wherever "
            "they are read; restore them from a sound copy of the checkpoint"
        )
    console.print(f"verdict: {_v(report.verdict)}")
    if report.suggested_mapping:
        maps = " ".join(f"--map '{a}={b}'" for a, b in report.suggested_mapping.items())
        _show(
            f"rewrite data, template and reward with: [bold]vlfast tokens rewrite {escape(maps)} ...[/bold]"
        )
        _show(
            f"or initialise the rows: [bold]vlfast tokens fix --model {escape(report.model_dir)} OUT[/bold]"
        )


_GEN_STYLE = {"verified-strong": "bold red", "verified-weak": "yellow", "rejected": "green"}


def _render_generation(gen) -> None:
    title = (
        f"Generation check: {gen.model_class} on {gen.device}, {gen.dtype}; load {gen.load_seconds:.2f} s, "
        f"prompts {gen.run_seconds:.2f} s"
    )
    table = Table(title=title, title_justify="left")
    numbers = {"id", "max P", *gen.prompts}
    for col in ("id", "piece", "weights", *gen.prompts, "max P", "result"):
        table.add_column(col, justify="right" if col in numbers else "left")
    for t in gen.tokens:
        style = _GEN_STYLE[t.result]
        table.add_row(
            str(t.id),
            escape(repr(t.piece)),
            "-" if t.weights_verdict is None else _v(t.weights_verdict),
            *(f"{t.probabilities[name]:.2g}" for name in gen.prompts),
            f"{t.max_probability:.2g}",
            f"[{style}]{t.result}[/{style}]",
        )
    print_table(table)
    th = gen.thresholds
    _show(
        f"P = the model's probability of producing the token where a repetition prompt expects it; by the "
        f"largest (Magikarp): < {th['strong']:g} verified-strong, < {th['weak']:g} verified-weak (the row is "
        f"untrained), otherwise rejected (the model reproduces it)"
    )


def _exit(verdict: str, strict: bool, broken: bool = False) -> None:
    if broken or verdict == "untrained" or (strict and verdict == "suspect"):
        raise typer.Exit(EXIT_FINDING)


@handle_errors
def audit(
    model: LocalModelOpt,
    tags: TagsOpt = None,
    template: TemplateOpt = None,
    reward_regex: RegexOpt = None,
    reference_ids: ReferenceOpt = None,
    embedding_name: option(str | None, help="Input-embedding tensor name if not found.") = None,
    lm_head_name: option(str | None, help="Output-projection tensor name if not found.") = None,
    alternatives: option(bool, help="Propose trained replacements for failing tags.") = True,
    strict: option(bool, help="Exit 1 on suspect tags too.") = False,
    include_placeholders: PlaceholdersOpt = False,
    verify_generation: option(
        bool,
        help="Also load the model and ask it to repeat each token of the tags (Magikarp's second stage): "
        "max P < 0.001 verified-strong, < 0.1 verified-weak, else rejected.",
    ) = False,
    device: option(
        str | None, help="--verify-generation: cpu, cuda, cuda:1, mps. Default: the best available."
    ) = None,
    dtype: option(
        str | None,
        help="--verify-generation: float32, bfloat16 or float16. Default: bfloat16 on CUDA, else float32.",
    ) = None,
    json_: JsonOpt = False,
) -> None:
    """Check that the tags a format needs have trained embedding rows (reads weights memory-mapped)."""
    from vlfast.tokens import audit_tokens

    report = audit_tokens(
        model,
        tags,
        template=template,
        reward_regex=reward_regex,
        reference_ids=reference_ids,
        alternatives=alternatives,
        embedding_name=embedding_name,
        lm_head_name=lm_head_name,
        include_placeholders=include_placeholders,
        verify_generation=verify_generation,
        device=device,
        dtype=dtype,
    )
    if json_:
        print_json(report.to_dict())
    else:
        _render_audit(report)
    _exit(report.verdict, strict, broken=bool(report.non_finite))


@handle_errors
def rewrite(
    mapping: option(
        list[str], "--map", help="think=thinking (both halves) or '<think>=<thinking>'; repeatable."
    ),
    dataset: option(str | None, help="A .jsonl or .parquet dataset.") = None,
    field: option(str | None, help="The dataset field/column holding the text.") = None,
    out: option(str | None, "--out", help="Where to write the rewritten dataset.") = None,
    template: option(str | None, help="A chat template file to rewrite.") = None,
    template_out: option(str | None, help="Where to write the rewritten template.") = None,
    reward_regex: option(
        str | None,
        "--reward-regex",
        help="The format reward's regex, rewritten with the mapping (escaped forms included) and printed.",
    ) = None,
    json_: JsonOpt = False,
) -> None:
    """Apply one tag mapping to a dataset field, a chat template and a reward regex."""
    if any(str(p).endswith(".parquet") for p in (dataset, out) if p):
        require("extract", "vlfast tokens rewrite of Parquet", models=False, only=("pyarrow",))
    from vlfast.tokens import rewrite_tags

    report = rewrite_tags(
        mapping,
        dataset=dataset,
        field=field,
        dataset_out=out,
        template=template,
        template_out=template_out,
        reward_regex=reward_regex,
    )
    if json_:
        print_json(report.to_dict())
        return
    table = Table(title="Tag rewrite", title_justify="left")
    for col in ("input", "output", "replaced", "target tags already present"):
        table.add_column(col)
    for fr in (report.dataset, report.template):
        if fr is not None:
            replaced = ", ".join(f"{k} x{v}" for k, v in fr.replacements.items()) or "nothing"
            present = ", ".join(f"{k} x{v}" for k, v in fr.already_present.items()) or "-"
            records = f" ({fr.records:,} records)" if fr.records is not None else ""
            table.add_row(escape(fr.path), escape(fr.out) + records, escape(replaced), escape(present))
    if report.reward_regex is not None:
        replaced = ", ".join(f"{k} x{v}" for k, v in report.reward_replacements.items()) or "nothing"
        # escape: a regex's [a-z] is Rich markup and would vanish
        table.add_row(escape(report.reward_regex), escape(report.reward_regex_out), escape(replaced), "-")
    print_table(table)
    say("mapping: " + ", ".join(f"{a} -> {b}" for a, b in report.mapping.items()))
    if any(fr is not None and fr.already_present for fr in (report.dataset, report.template)):
        console.print(
            "[yellow]warning:[/yellow] some target tags were already in the input; after the rewrite they "
            "are indistinguishable from the replaced ones"
        )


@handle_errors
def fix(
    out: Annotated[
        str, typer.Argument(help="New folder for the fixed checkpoint (the original is untouched).")
    ],
    model: LocalModelOpt,
    init: option(
        str, help="pieces: mean of the tag's plain-text pieces; mean: the mean trained row."
    ) = "pieces",
    tags: TagsOpt = None,
    template: TemplateOpt = None,
    reward_regex: RegexOpt = None,
    reference_ids: ReferenceOpt = None,
    include_placeholders: PlaceholdersOpt = False,
    json_: JsonOpt = False,
) -> None:
    """Write a copy of the checkpoint whose untrained tag rows start from trained ones, then audit it."""
    from vlfast.tokens import fix_tokens

    report = fix_tokens(
        model,
        out,
        tags,
        init=init,
        template=template,
        reward_regex=reward_regex,
        reference_ids=reference_ids,
        include_placeholders=include_placeholders,
    )
    if json_:
        print_json(report.to_dict())
    else:
        table = Table(title=f"Fixed rows -> {escape(report.out_dir)}", title_justify="left")
        for col in ("id", "piece", "init", "from ids", "matrices"):
            table.add_column(col)
        for r in report.rows:
            sources = " ".join(map(str, r.source_ids)) or "-"
            table.add_row(str(r.id), escape(repr(r.piece)), r.init, sources, ", ".join(r.matrices))
        print_table(table)
        if not report.rows:
            console.print("[green]no untrained tag rows: the checkpoint was copied unchanged[/green]")
        for note in report.notes:
            _show(f"[yellow]note:[/yellow] {escape(note)}")
        _show(
            f"rewritten: {escape(', '.join(report.files_rewritten) or '-')}; "
            f"copied {len(report.files_copied)} files"
        )
        if report.after is not None:
            console.print(f"audit of the new checkpoint: {_v(report.after.verdict)}")
            if report.after.non_finite:
                console.print("[bold red]the new checkpoint still has rows holding NaN or inf[/bold red]")
    if report.after is not None:
        _exit(report.after.verdict, strict=False, broken=bool(report.after.non_finite))


_CHECK_STYLE = {"pass": "green", "fail": "bold red", "skip": "yellow"}


def _render_pipeline(report) -> None:
    from rich.text import Text

    # no_wrap labels and verdicts, fold for the rest: whole names in an 80-column pipe (see extract).
    head = Table(title="Pipeline check", show_header=False, title_justify="left")
    head.add_column(style="bold", no_wrap=True)
    head.add_column(overflow="fold")
    switches = ", ".join(f"{s}=True" for s in report.reasoning_switches) or "none in the template"
    regex = repr(report.reward_regex) + (" (default, DOTALL)" if report.reward_regex_default else " (DOTALL)")
    for label, value in [
        ("model", report.model_dir),
        ("template", report.template_source),
        ("reasoning switches", switches),
        ("tags", ", ".join(report.tags)),
        ("reward regex", regex),
        ("sample", report.sample_source),
        ("generation prompt", repr(report.generation_prompt)),
    ]:
        head.add_row(label, Text(value))
    console.print(head)
    table = Table(title="Checks", title_justify="left")
    table.add_column("check", no_wrap=True)
    table.add_column("verdict", no_wrap=True)
    table.add_column("finding", overflow="fold")
    for c in report.checks:
        table.add_row(c.name, Text(c.status, style=_CHECK_STYLE[c.status]), Text(c.summary))
    console.print(table)
    for c in report.checks:
        style = _CHECK_STYLE[c.status]
        console.print(f"[bold]{c.name}[/bold]: [{style}]{c.status}[/{style}]")
        for line in c.lines() + ([f"fix: {c.fix}"] if c.fix and c.status == "fail" else []):
            say("  " + line)
    for note in report.notes:
        say(f"note: {note}")
    verdict = "pass" if report.ok else "fail"
    console.print(
        f"verdict: [{_CHECK_STYLE[verdict]}]{verdict}[/{_CHECK_STYLE[verdict]}]"
        + (f" ({', '.join(report.failed)})" if report.failed else "")
    )


@handle_errors
def check_pipeline(
    model: option(
        str, "--model", "-m", help="A local model or tokenizer folder (only the tokenizer is read)."
    ),
    template: option(
        str | None,
        "--template",
        help="The chat template the trainer renders (.jinja or tokenizer_config.json). "
        "Default: the model folder's own.",
    ) = None,
    reward_regex: option(
        str | None,
        "--reward-regex",
        help="The format reward's regex (DOTALL). Default: '^<think>.*?</think>.*$'.",
    ) = None,
    sample: option(
        str | None, "--sample", help="A text file holding one completion with the tags. Default: built in."
    ) = None,
    tags: TagsOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Check the tags through the pipeline: template position, prefilled tag, decoding, round trip."""
    from vlfast.tokens.pipeline import check_pipeline as run

    report = run(model, template=template, reward_regex=reward_regex, sample=sample, tags=tags)
    if json_:
        print_json(report.to_dict())
    else:
        _render_pipeline(report)
    if not report.ok:
        raise typer.Exit(EXIT_FINDING)


def register(app: typer.Typer) -> None:
    help = "Audit, rewrite and fix the format tags (<think>...) that RL rewards depend on."
    commands = {"audit": audit, "rewrite": rewrite, "fix": fix, "check-pipeline": check_pipeline}
    add_group(app, "tokens", help, commands)
