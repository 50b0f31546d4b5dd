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
    from vlfast.models import REF_PREFIX, list_references

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
        v = r.vision
        width = v.get("embed_dim", v.get("hidden_size"))
        out = v.get("out_hidden_size", v.get("hidden_size") if "embed_dim" in v else None)
        table.add_row(
            REF_PREFIX + r.name,
            r.family,
            str(v["depth"]),
            str(width),
            str(v["num_heads"]),
            f"({v['temporal_patch_size']}, {v['patch_size']})",
            str(out),
            r.source.split(" ")[0].removeprefix("huggingface.co/"),
        )
    print_table(table)
