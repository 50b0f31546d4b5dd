"""`vlfast models`: the built-in reference towers, their dimensions and where each number comes from."""

from __future__ import annotations

import typer
from rich.table import Table

from vlfast.cli._common import JsonOpt, handle_errors, print_json, print_table


def register(app: typer.Typer) -> None:
    app.command("models")(models)


@handle_errors
def models(as_json: JsonOpt = False) -> None:
    """List the built-in references usable as --model ref:NAME (random weights, published dimensions)."""
    from vlfast.models.references import REF_PREFIX, list_references  # plain data: no torch, no transformers

    refs = list_references()
    if as_json:
        print_json([{"spec": REF_PREFIX + r.name, **r.to_dict()} for r in refs])
        return
    table = Table(
        title="Built-in reference vision towers (random weights, published dimensions)",
        caption="Numbers from each checkpoint's config.json, vision_config; --json prints them all.",
    )
    for col in ("--model", "family", "depth", "width", "heads", "patch (T, P)", "out", "source"):
        table.add_column(col)
    for r in refs:
        numbers = (str(v) for v in (r.depth, r.width, r.heads, r.patch, r.out_width))
        source = r.source.split(" ")[0].removeprefix("huggingface.co/")
        table.add_row(REF_PREFIX + r.name, r.family, *numbers, source)
    print_table(table)
