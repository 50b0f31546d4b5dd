"""`vlfast verify`: patched vs original on the same inputs, with the thresholds it is judged by."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from vlfast.cli._common import (
    EXIT_FINDING,
    JsonOpt,
    ModelOpt,
    UsageError,
    console,
    err_console,
    handle_errors,
    option,
    print_json,
    print_table,
    refuse_early,
    refuse_unfit_weights,
    say,
)
from vlfast.limits import check

if TYPE_CHECKING:
    from rich.status import Status

    from vlfast.diagnosis.verification import Step


def register(app: typer.Typer) -> None:
    app.command("verify")(verify)


def _peak_rss() -> str:
    """This process's peak resident memory so far, e.g. ", peak RSS 5.1 GiB"; empty where unknown."""
    try:
        import resource
    except ImportError:  # Windows
        return ""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak *= 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return f", peak RSS {peak / 2**30:.1f} GiB"


class _Progress:
    """Each verify step on stderr (never stdout, which ``--json`` keeps clean) as it starts and ends: in a
    terminal a spinner names the running step; elsewhere (a CI log) one plain line at each start and end."""

    def __init__(self, out: Console, model: str = "", guess: float | None = None) -> None:
        self.out = out
        self.status: Status | None = None
        self.model, self.guess = model, guess  # the checks' expected seconds, said once the model is built

    def __call__(self, step: Step) -> None:
        self._step(step)
        if self.guess is None or not (step.done or step.index > 0):
            return
        from vlfast.cli._process import since_start, since_start_words

        so_far, guess = since_start(), self.guess  # the whole run's expected time, start-up included
        say(
            f"vlfast verify {self.model}: expected ~{_duration(so_far + guess)} in all here: {so_far:.1f} s "
            f"{since_start_words()} to load torch, transformers and the model, then ~{_duration(guess)} of "
            "checks (a rough estimate from the tower's size and a GEMM rate measured now; a busy machine "
            "takes longer)",
            self.out,
        )
        self.guess = None  # said once

    def _step(self, step: Step) -> None:
        where = f"[{step.index}/{step.total}] " if step.total else ""
        if not step.done:
            if self.out.is_terminal:
                if self.status is None:
                    self.status = self.out.status("", spinner="dots")
                    self.status.start()
                self.status.update(escape(f"{where}{step.label}"))
            else:
                say(f"{where}{step.label} ...", self.out)
            return
        verdict = ("ok" if step.passed else "FAIL") if step.checks else "done"
        head, tail = f"{where}{step.label}: ", f", {step.seconds:.1f} s{_peak_rss()}"
        if self.out.is_terminal:
            color = "green" if step.passed else "red"
            line = f"{escape(head)}[{color}]{verdict}[/{color}]{escape(tail)}"
            self.out.print(line, highlight=False, soft_wrap=True)
        else:
            say(head + verdict + tail, self.out)

    def close(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None


def _duration(seconds: float) -> str:
    return f"{max(1, round(seconds))} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def _parse_grid(text: str) -> tuple[int, int, int]:
    try:
        t, h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise UsageError(f"--grid {text!r} must look like TxHxW in patches, e.g. 2x16x16") from None
    return check("--grid", t), check("--grid", h), check("--grid", w)


Grids = option(
    list[str] | None,
    "--grid",
    metavar="TxHxW",
    help="Per-sample patch grid TxHxW; repeat for more samples. Default: 2x16x16 and 1x12x20.",
)
Dtypes = option(
    list[str] | None,
    "--dtype",
    help="Low-precision dtypes to check besides float32 (repeatable). Default: bfloat16.",
)
Device = option(str, "--device", help="cpu, cuda, cuda:1, mps.")
Windows = option(int, "--windows", help="Patches per layer check.")
Backward = option(bool, "--backward/--no-backward", help="Also compare gradients.")
Tiny = option(
    bool,
    "--tiny",
    help="With ref:NAME, a seconds-fast scaled-down tower of the same family (full size: minutes on a CPU).",
)


@handle_errors
def verify(
    model: ModelOpt = "ref:qwen3-vl-4b",
    grid: Grids = None,
    dtype: Dtypes = None,
    device: Device = "cpu",
    windows: Windows = 3072,
    backward: Backward = True,
    tiny: Tiny = False,
    as_json: JsonOpt = False,
) -> None:
    """Prove the patch changes nothing numerically on a model: exit 0 on pass, 1 on failure.

    Each check is reported on stderr as it starts and as it ends; with --json, stdout is the report only.
    """
    grids = [_parse_grid(g) for g in grid] if grid else [(2, 16, 16), (1, 12, 20)]
    dtypes = ["float32", *(dtype or ["bfloat16"])]
    refuse_early(model, device, tuple(dtypes))  # before torch: seconds to import
    from vlfast.cli._process import skip_teardown
    from vlfast.diagnosis.verification import expected_seconds
    from vlfast.diagnosis.verification import verify as run_verify

    refuse_unfit_weights(model)
    skip_teardown()  # everything it says is printed before it returns
    options = dict(grids=grids, dtypes=dtypes, device=device, n_windows=windows, backward=backward, tiny=tiny)
    try:
        guess = expected_seconds(model, **options)
    except (ValueError, OSError, RuntimeError, TypeError):  # verify itself says what is wrong
        guess = None
    progress = _Progress(err_console, model, guess)
    try:
        report = run_verify(model, **options, progress=progress)
    finally:
        progress.close()
    if as_json:
        print_json(report.to_dict())
    else:
        _render(report)
    if not report.passed:
        raise typer.Exit(EXIT_FINDING)


def _render(report) -> None:
    """The checks as a table, their thresholds, the accuracy lines, notes and the verdict."""
    table = Table(title=f"vlfast verify {escape(str(report.model))} on {report.device}")
    for col in ("", "scope", "dtype", "what", "metrics"):
        table.add_column(col)
    limits: dict[str, str] = {}
    for c in report.checks:
        metrics = ", ".join(f"{k}={v:.3g}" for k, v in c.metrics.items())
        limits.update({f"{c.scope}/{c.dtype} {k}": v for k, v in c.limits.items()})
        mark = "[green]ok[/green]" if c.passed else "[red]FAIL[/red]"
        table.add_row(mark, c.scope, c.dtype, c.name, metrics)
    print_table(table)
    console.print("thresholds: " + "; ".join(f"{k} {v}" for k, v in limits.items()), highlight=False)
    for line in report.accuracy():
        console.print(escape(line), highlight=False)
    for note in report.notes:
        console.print(f"[yellow]note:[/yellow] {escape(note)}")
    verdict = "[bold green]PASS[/bold green]" if report.passed else "[bold red]FAIL[/bold red]"
    if report.fused and not report.checks:
        said = "transformers already runs the patch embedding as a GEMM; nothing to verify"
    else:
        said = f"{len(report.checks) - len(report.failures)}/{len(report.checks)} checks passed"
    console.print(f"{verdict}: {said}")
