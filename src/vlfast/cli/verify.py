"""`vlfast verify`: patched vs original on the same inputs, with the thresholds it is judged by."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from vlfast.cli._common import EXIT_FINDING, JsonOpt, ModelOpt, UsageError, console, handle_errors, print_json


def register(app: typer.Typer) -> None:
    app.command("verify")(verify)


def _parse_grid(text: str) -> tuple[int, int, int]:
    try:
        t, h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise UsageError(f"--grid {text!r} must look like TxHxW in patches, e.g. 2x16x16") from None
    return t, h, w


@handle_errors
def verify(
    model: ModelOpt = "ref:qwen3-vl-4b",
    grid: Annotated[
        list[str] | None,
        typer.Option(
            "--grid",
            help="Per-sample patch grid TxHxW; repeat for more samples. Default: 2x16x16 and 1x12x20.",
        ),
    ] = None,
    dtype: Annotated[
        list[str] | None,
        typer.Option(
            "--dtype", help="Low-precision dtypes to check besides float32 (repeatable). Default: bfloat16."
        ),
    ] = None,
    device: Annotated[str, typer.Option("--device", help="cpu, cuda, cuda:1, mps.")] = "cpu",
    windows: Annotated[int, typer.Option("--windows", help="Patches per layer check.")] = 3072,
    backward: Annotated[
        bool, typer.Option("--backward/--no-backward", help="Also compare gradients.")
    ] = True,
    tiny: Annotated[
        bool,
        typer.Option("--tiny", help="With ref:NAME, a seconds-fast scaled-down tower of the same family."),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Prove the patch changes nothing numerically on a model: exit 0 on pass, 1 on failure."""
    from vlfast.patching.verification import verify as run_verify

    grids = [_parse_grid(g) for g in grid] if grid else [(2, 16, 16), (1, 12, 20)]
    report = run_verify(
        model,
        grids=grids,
        dtypes=["float32", *(dtype or ["bfloat16"])],
        device=device,
        n_windows=windows,
        backward=backward,
        tiny=tiny,
    )
    if as_json:
        print_json(report.to_dict())
    else:
        table = Table(title=f"vlfast verify {report.model} on {report.device}")
        for col in ("", "scope", "dtype", "what", "metrics"):
            table.add_column(col)
        limits: dict[str, str] = {}
        for c in report.checks:
            metrics = ", ".join(f"{k}={v:.3g}" for k, v in c.metrics.items())
            limits.update({f"{c.scope}/{c.dtype} {k}": v for k, v in c.limits.items()})
            table.add_row(
                "[green]ok[/green]" if c.passed else "[red]FAIL[/red]", c.scope, c.dtype, c.name, metrics
            )
        console.print(table)
        console.print("thresholds: " + "; ".join(f"{k} {v}" for k, v in limits.items()), highlight=False)
        for note in report.notes:
            console.print(f"[yellow]note:[/yellow] {note}")
        verdict = "[bold green]PASS[/bold green]" if report.passed else "[bold red]FAIL[/bold red]"
        console.print(
            f"{verdict}: {len(report.checks) - len(report.failures)}/{len(report.checks)} checks passed"
        )
    if not report.passed:
        raise typer.Exit(EXIT_FINDING)
