"""``vlfast profile``: per-component time of a vision tower forward, before and after patching."""

from __future__ import annotations

import typer
from rich.markup import escape
from rich.table import Table

from vlfast.cli._common import (
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    UsageError,
    console,
    err_console,
    handle_errors,
    ms_cell,
    option,
    print_json,
    print_table,
    refuse_early,
    refuse_unfit_weights,
    say,
)
from vlfast.limits import check


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UsageError(f"{what} must be comma-separated integers such as 1,2,4; got {text!r}") from None
    if not values:
        raise UsageError(f"{what} must be positive integers; got {text!r}")
    for v in values:
        check(what, v)
    return values


def _size(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    parts = text.lower().replace("*", "x").split("x")
    try:
        h, w = (int(p) for p in parts)
    except ValueError:
        raise UsageError(f"--size must be HEIGHTxWIDTH in pixels such as 384x512; got {text!r}") from None
    return (check("--size", h), check("--size", w))


def _load(v: float | None) -> str:
    return "?" if v is None else f"{v:.2f}"


def _render_pair(report, before, after) -> None:
    """One configuration's table, printed as soon as it is measured (a killed run keeps what it printed)."""
    from vlfast.diagnosis.profiler import INLINE, MIN_ROUNDS
    from vlfast.diagnosis.profiler import load_average as load_now

    end = report.load[1] if report.load[1] is not None else load_now()
    ref = before or after
    cmp = report.comparison(before, after) if before and after else {}

    def speedup(part: str, cmp: dict = cmp) -> str:
        c = cmp.get(part)
        if not c or c["measured_ratio"] is None:
            return ""
        if not c["changed"]:
            return "[dim]not patched[/dim]"  # the same computation before and after: its ratio is noise
        if c["reliable"]:  # enough rounds, a narrow spread, and the medians agree on which side is faster
            return f"{c['speedup']:.2f}x"
        if c["rounds"] < MIN_ROUNDS:
            return f"[yellow]inconclusive ({c['rounds']} round{'s' if c['rounds'] != 1 else ''})[/yellow]"
        return f"[yellow]inconclusive (spread {c['spread']:.0%})[/yellow]"

    t, h, w = ref.grid
    table = Table(
        title=(
            f"{escape(report.target)} on {report.device} ({report.dtype}): batch {ref.batch} x {ref.frames} frames, "
            f"grid {t}x{h}x{w}, {ref.patches:,} patches, median of {ref.repeats}; shares of the time timed; "
            f"load average {_load(report.load[0])} -> {_load(end)} on {report.cpus} CPUs"
        ),
        title_justify="left",
        caption="not patched: no patched conv inside, the same computation before and after, so a "
        "difference in its ms is the machine's load, not the patch",
        caption_justify="left",
    )
    table.add_column("component")
    for col in ("before ms", "share", "after ms", "share", "speedup"):
        table.add_column(col, justify="right")
    parts = list(dict.fromkeys(part for run in (before, after) if run for part in run.components))

    def cells(run, part):
        if run is None:
            return "-", "-"
        ms = run.inline_ms if part == INLINE else run.components.get(part)
        share = run.shares.get(part)
        return ms_cell(ms), "-" if share is None else f"{share:.1%}"

    for part in [*parts, INLINE]:
        label = part
        if part == "blocks":
            n = len([k for k in ref.items if k.startswith(("blocks.", "layers.", "layer."))])
            label = f"blocks (all {n})"
        speed = speedup(part) if part != INLINE else ""
        table.add_row(label, *cells(before, part), *cells(after, part), speed)
    for name, getter in [
        ("forward (hooked)", lambda r: r.forward_ms),
        ("forward (no hooks)", lambda r: r.plain_forward_ms),
        ("whole VLM forward", lambda r: r.vlm_forward_ms),
    ]:
        bv, av = (getter(r) if r else None for r in (before, after))
        if bv is None and av is None:
            continue
        plain = f"{bv / av:.1f}x" if bv and av else ""
        speed = speedup("forward") if name == "forward (hooked)" else plain
        table.add_row(f"[bold]{name}[/bold]", ms_cell(bv), "", ms_cell(av), "", f"[bold]{speed}[/bold]")
    print_table(table)
    for run in (before, after):
        if run is not None and run.vlm_error:
            console.print(
                f"[yellow]whole VLM forward not timed:[/yellow] {escape(run.vlm_error)}", highlight=False
            )


ProfileModel = option(
    str | None,
    "--model",
    "-m",
    help="ref:NAME (default ref:qwen3-vl-4b) or a local checkpoint directory (also times the whole VLM).",
)
Batch = option(str, "--batch", help="Batch sizes (clips per forward), e.g. 1,2,4.")
Frames = option(str | None, "--frames", help="Frames per clip, e.g. 2,8,16. Default 8 on GPU, 2 on CPU.")
Size = option(
    str | None,
    "--size",
    metavar="HxW",
    help="Frame size HEIGHTxWIDTH in pixels. Default 384x512 on GPU, 224x224 on CPU.",
)
Warmup = option(int, "--warmup", help="Discarded forwards per configuration.")
Repeats = option(int, "--repeats", help="Timed forwards per configuration.")
Tiny = option(bool, "--tiny", help="Build references at test size (seconds on CPU).")
NoVlm = option(bool, "--no-vlm", help="Skip the whole-VLM forward of a checkpoint.")
Plot = option(
    str | None, "--plot", metavar="PNG", help="Write a PNG bar chart here (pip install 'vlfast[plot]')."
)
Budget = option(
    float,
    "--budget",
    help="Seconds the timing may take in total (model building not counted): each "
    "configuration cuts its rounds to fit and says so.",
)


def register(app: typer.Typer) -> None:
    app.command("profile")(profile_cmd)


@handle_errors
def profile_cmd(
    model: ProfileModel = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    batch: Batch = "1",
    frames: Frames = None,
    size: Size = None,
    warmup: Warmup = 1,
    repeats: Repeats = 3,
    tiny: Tiny = False,
    no_vlm: NoVlm = False,
    plot: Plot = None,
    budget: Budget = 60.0,
    json_out: JsonOpt = False,
) -> None:
    """Time each component of a vision tower forward before and after patching, with medians and shares.

    Components: patch embedding, position and rotary embedding, each block, deepstack mergers,
    merger, and what the tower computes inline. With a checkpoint the whole VLM forward is timed too.
    """
    refuse_early(model, device, (dtype,))  # before torch: seconds to import
    batch_sizes = _ints(batch, "--batch")
    frame_counts = _ints(frames, "--frames") if frames is not None else None
    frame_size = _size(size)
    from vlfast.cli._process import skip_teardown
    from vlfast.diagnosis.profiler import profile
    from vlfast.models import ModelRef, vision_config_of

    skip_teardown()  # everything it says (the chart too) is written before it returns
    # Fail before minutes of measuring: the chart's dependency, a checkpoint without a vision tower.
    if plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ImportError("--plot needs matplotlib: pip install 'vlfast[plot]'") from None
    if model is not None and not ModelRef.of(model).is_reference:
        vision_config_of(model)
        refuse_unfit_weights(model)
    report = profile(
        model,
        device=device,
        dtype=dtype,
        batch_sizes=batch_sizes,
        frames=frame_counts,
        budget_s=budget,
        progress=lambda line: say(line, err_console),  # stderr: where a killed run was; stdout stays JSON
        on_pair=None if json_out else _render_pair,
        size=frame_size,
        warmup=warmup,
        repeats=repeats,
        tiny=tiny,
        vlm=not no_vlm,
    )
    png = str(report.plot(plot)) if plot else None
    if json_out:
        print_json({**report.to_dict(), "plot": png})
    else:
        for note in report.notes:  # the tables were printed as each configuration was measured
            console.print(f"[yellow]note:[/yellow] {escape(note)}", highlight=False)
        if png:
            console.print(f"chart: {png}", highlight=False)
