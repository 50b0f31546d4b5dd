"""``vlfast tokens``: audit, rewrite and fix the format tags (`<think>`...) an RL run depends on.

Exit status of `audit` and `fix`: 0 when every tag the format needs has trained rows, 1 (EXIT_FINDING)
when one is untrained (with --strict also when one is only suspect), 2 for bad input, 3 when the
command could not run.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from vlfast.cli._common import EXIT_FINDING, JsonOpt, console, handle_errors, print_json

_STYLE = {"trained": "green", "suspect": "yellow", "untrained": "bold red"}

LocalModelOpt = Annotated[
    str, typer.Option("--model", "-m", help="A local checkpoint folder: safetensors weights and a tokenizer.")
]
TagsOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--tags", "-t", help="Tags to check, repeatable or comma-separated. Default: <think>, </think>."
    ),
]
TemplateOpt = Annotated[
    str | None,
    typer.Option(
        "--template", help="A chat template (.jinja, or a tokenizer_config.json); its tags are checked."
    ),
]
RegexOpt = Annotated[
    str | None,
    typer.Option("--reward-regex", help="The format reward's regex; the tags it matches are checked."),
]
ReferenceOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--reference-ids",
        help="Known never-trained ids or ranges (e.g. 151669-152063). Default: padding rows beyond the "
        "tokenizer plus [unused*]/reserved tokens.",
    ),
]


def _v(verdict: str) -> str:
    return f"[{_STYLE[verdict]}]{verdict}[/{_STYLE[verdict]}]"


def _render_audit(report) -> None:
    head = Table(title=f"Token audit: {report.model_dir}", show_header=False, title_justify="left")
    head.add_column(style="bold")
    head.add_column()
    head.add_row("embedding", f"{report.embedding} {tuple(report.shape)} {report.dtype}")
    head.add_row("lm_head", "tied to the embedding" if report.tied else str(report.lm_head))
    head.add_row("tokenizer ids", f"{report.tokenizer_length:,}")
    sources = ", ".join(f"{k} {v:,}" for k, v in report.reference_sources.items())
    head.add_row("reference rows", f"{report.reference_count:,} never-trained rows ({sources})")
    for ind in report.indicators:
        if ind.cut is None:
            head.add_row(ind.indicator, f"[dim]not computed: {ind.note}[/dim]")
            continue
        ref = "n/a" if ind.reference_median is None else f"{ind.reference_median:.4g}"
        sep = "" if ind.separation is None else f", separation {ind.separation:.2f}"
        used = "" if ind.informative else " [yellow](not informative here: ignored)[/yellow]"
        head.add_row(
            ind.indicator,
            f"median ordinary {ind.ordinary_median:.4g}, reference {ref}, cut {ind.cut:.4g}{sep}{used}",
        )
    head.add_row("time", f"{report.seconds:.2f} s")
    console.print(head)

    table = Table(title="Tags", title_justify="left")
    for col in ("tag", "used by", "id", "piece", "added", "norm / ordinary", "cos dist", "flags", "verdict"):
        table.add_column(col, justify="right" if col in ("id", "norm / ordinary", "cos dist") else "left")
    for tag in report.tags:
        for k, tok in enumerate(tag.tokens):
            first = k == 0
            table.add_row(
                tag.tag if first else "",
                ", ".join(tag.sources) if first else "",
                str(tok.id),
                repr(tok.piece),
                ("special" if tok.special else "added") if tok.added else "",
                f"{tok.norm_ratio:.2f}",
                "-" if tok.cos_distance is None else f"{tok.cos_distance:.3f}",
                ", ".join(tok.flags),
                _v(tok.verdict) + (f" -> tag {_v(tag.verdict)}" if first and len(tag.tokens) > 1 else ""),
            )
    console.print(table)
    for tag in report.tags:
        if tag.alternatives:
            alts = ", ".join(f"{a.tag} ({' '.join(a.pieces)})" for a in tag.alternatives)
            console.print(f"  {tag.tag}: trained alternatives {alts}")
    console.print(f"verdict: {_v(report.verdict)}")
    if report.suggested_mapping:
        maps = " ".join(f"--map '{a}={b}'" for a, b in report.suggested_mapping.items())
        console.print(
            f"rewrite data, template and reward with: [bold]vlfast tokens rewrite {maps} ...[/bold]"
        )
        console.print(
            f"or initialise the rows: [bold]vlfast tokens fix --model {report.model_dir} OUT[/bold]"
        )


def _exit(verdict: str, strict: bool) -> None:
    if verdict == "untrained" or (strict and verdict == "suspect"):
        raise typer.Exit(EXIT_FINDING)


@handle_errors
def audit(
    model: LocalModelOpt,
    tags: TagsOpt = None,
    template: TemplateOpt = None,
    reward_regex: RegexOpt = None,
    reference_ids: ReferenceOpt = None,
    embedding_name: Annotated[
        str | None, typer.Option(help="Input-embedding tensor name if not found.")
    ] = None,
    lm_head_name: Annotated[
        str | None, typer.Option(help="Output-projection tensor name if not found.")
    ] = None,
    alternatives: Annotated[bool, typer.Option(help="Propose trained replacements for failing tags.")] = True,
    strict: Annotated[bool, typer.Option(help="Exit 1 on suspect tags too.")] = False,
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
    )
    if json_:
        print_json(report.to_dict())
    else:
        _render_audit(report)
    _exit(report.verdict, strict)


@handle_errors
def rewrite(
    mapping: Annotated[
        list[str],
        typer.Option("--map", help="think=thinking (both halves) or '<think>=<thinking>'; repeatable."),
    ],
    dataset: Annotated[str | None, typer.Option(help="A .jsonl or .parquet dataset.")] = None,
    field: Annotated[str | None, typer.Option(help="The dataset field/column holding the text.")] = None,
    out: Annotated[str | None, typer.Option("--out", help="Where to write the rewritten dataset.")] = None,
    template: Annotated[str | None, typer.Option(help="A chat template file to rewrite.")] = None,
    template_out: Annotated[str | None, typer.Option(help="Where to write the rewritten template.")] = None,
    reward_regex: RegexOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Apply one tag mapping to a dataset field, a chat template and a reward regex."""
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
            table.add_row(
                fr.path,
                fr.out + (f" ({fr.records:,} records)" if fr.records is not None else ""),
                replaced,
                present,
            )
    if report.reward_regex is not None:
        replaced = ", ".join(f"{k} x{v}" for k, v in report.reward_replacements.items()) or "nothing"
        table.add_row(report.reward_regex, report.reward_regex_out, replaced, "-")
    console.print(table)
    console.print("mapping: " + ", ".join(f"{a} -> {b}" for a, b in report.mapping.items()))
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
    init: Annotated[
        str, typer.Option(help="pieces: mean of the tag's plain-text pieces; mean: the mean trained row.")
    ] = "pieces",
    tags: TagsOpt = None,
    template: TemplateOpt = None,
    reward_regex: RegexOpt = None,
    reference_ids: ReferenceOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Write a copy of the checkpoint whose untrained tag rows start from trained ones, then audit it."""
    from vlfast.tokens import fix_tokens

    report = fix_tokens(
        model, out, tags, init=init, template=template, reward_regex=reward_regex, reference_ids=reference_ids
    )
    if json_:
        print_json(report.to_dict())
    else:
        table = Table(title=f"Fixed rows -> {report.out_dir}", title_justify="left")
        for col in ("id", "piece", "init", "from ids", "matrices"):
            table.add_column(col)
        for r in report.rows:
            table.add_row(
                str(r.id),
                repr(r.piece),
                r.init,
                " ".join(map(str, r.source_ids)) or "-",
                ", ".join(r.matrices),
            )
        console.print(table)
        if not report.rows:
            console.print("[green]no untrained tag rows: the checkpoint was copied unchanged[/green]")
        for note in report.notes:
            console.print(f"[yellow]note:[/yellow] {note}")
        console.print(
            f"rewritten: {', '.join(report.files_rewritten) or '-'}; copied {len(report.files_copied)} files"
        )
        if report.after is not None:
            console.print(f"audit of the new checkpoint: {_v(report.after.verdict)}")
    if report.after is not None:
        _exit(report.after.verdict, strict=False)


def register(app: typer.Typer) -> None:
    tokens = typer.Typer(
        name="tokens",
        help="Audit, rewrite and fix the format tags (<think>...) that RL rewards depend on.",
        no_args_is_help=True,
    )
    tokens.command("audit")(audit)
    tokens.command("rewrite")(rewrite)
    tokens.command("fix")(fix)
    app.add_typer(tokens, name="tokens")
