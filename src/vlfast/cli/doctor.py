"""``vlfast doctor``: measure the patch-embedding slow path here, explain it, print the fix.

Exit status: 0, 1 and 4 as the command's help says; 2 for bad input, 3 when it could not run.
"""

from __future__ import annotations

import typer
from rich.markup import escape
from rich.table import Table

from vlfast.cli._common import (
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    ModelOpt,
    UsageError,
    console,
    handle_errors,
    ms_cell,
    option,
    print_fitted_table,
    print_json,
    refuse_early,
)

_STATUS_STYLE = {
    "slow-path": "bold red",
    "gain": "yellow",
    "ok": "green",
    "error": "yellow",
    "skipped": "dim",
}
_VERDICT_STYLE = {"slow-path": "bold red", "gain": "bold yellow", "ok": "bold green", "patched": "bold green"}


def _environment(report) -> Table:
    """What decides the kernels here, one row each; "could not collect" where a probe failed."""
    from vlfast.diagnosis.doctor import cpu_features_cell, libraries_cell
    from vlfast.diagnosis.facts import cudnn_version_str

    f = report.facts
    env = Table(title="Environment", show_header=False, title_justify="left")
    env.add_column(style="bold")
    env.add_column()

    def row(name: str, value, applies: bool = True) -> None:
        cell = "[dim]could not collect[/dim]" if value is None else escape(str(value))
        env.add_row(name, cell if applies else "[dim]n/a[/dim]")

    cuda, rocm = f.torch_build == "cuda", f.torch_build == "rocm"
    driver = f.torch_cuda and f"{f.torch_cuda} / {f.cuda_driver} (driver {f.nvidia_driver})"
    cudnn = f.torch_cuda and f"{cudnn_version_str(f.cudnn_compile)} / {cudnn_version_str(f.cudnn_runtime)}"
    cudnn_flags = f"{f.cudnn_enabled} / {f.cudnn_benchmark} / {f.cudnn_allow_tf32}"
    capability = ".".join(map(str, f.gpu_capability or ()))
    fusion = "yes" if f.transformers_fusion else "no"
    transformers = f.transformers_version and f"{f.transformers_version} (own opt-in fusion_config: {fusion})"

    row("vlfast", f.vlfast_version)
    row("python", f.python)
    row("torch", f.torch_version and f"{f.torch_version} ({f.torch_build} build)")
    row("CUDA build / driver", driver, cuda)
    row("ROCm / HIP", f.torch_hip, rocm)
    row("cuDNN compile / runtime", cudnn, cuda)
    row("cudnn enabled / benchmark / allow_tf32", cudnn_flags, cuda)
    row("cuDNN libraries loaded", libraries_cell(f), cuda)
    row("GPU", f.gpu_name and f"{f.gpu_name} (compute capability {capability})", cuda or rocm)
    row("MPS built / available", f"{f.mps_built} / {f.mps_available}")
    row("oneDNN available / enabled", f"{f.onednn_available} / {f.onednn_enabled}")
    row("CPU", f.cpu_model)
    row("CPU capability (instruction set) / threads", f"{f.cpu_capability} / {f.num_threads}")
    row("CPU bf16/fp16 features", cpu_features_cell(f))
    row("dtype", f"{f.dtype}: {report.dtype_reason}" if report.dtype_reason else f.dtype)
    row("transformers", transformers)
    row("VLFAST_PATCH", f.autopatch_env or "unset")
    row("model patched", f.model_patched)
    return env


def _probe(report) -> Table:
    """One row per conv measured: its times, the ratio to its GEMM, the status and the rules that explain it."""
    from vlfast.diagnosis.doctor import ratio_cell, timed_cell

    f = report.facts
    probe = Table(
        title=f"Probe: {escape(report.target)} on {f.device} in {f.dtype}, {report.patches:,} patches per sample",
        title_justify="left",
    )
    numbers = ("windows x rounds", "conv ms/sample", "GEMM ms/sample", "ratio", "bwd conv ms/sample")
    numbers += ("bwd GEMM ms/sample", "backward ratio", "channels-last ratio")
    fold = {"overflow": "fold"}
    for col, kw in [("conv", {}), ("where", fold), *((n, {"justify": "right"}) for n in numbers)]:
        probe.add_column(col, **kw)
    for col, kw in [("backend", {}), ("status", {"no_wrap": True}), ("rules", fold)]:
        probe.add_column(col, **kw)

    def ratio(v, spread, reliable, status=None) -> str:
        text = ratio_cell(v, spread, reliable)
        style = _STATUS_STYLE.get(status or "", "") if v is not None else ""
        return f"[{style}]{text}[/{style}]" if style else text

    for x in report.findings:
        p = x.probe
        names = ", ".join(p.shape.names[:3]) + (" ..." if len(p.shape.names) > 3 else "")
        style = _STATUS_STYLE.get(x.status, "")
        status = "left out" if p.left_out and p.conv is None else x.status
        probe.add_row(
            p.shape.describe(),
            escape(names),
            timed_cell(p),
            ms_cell(p.per_sample_ms("conv")),
            ms_cell(p.per_sample_ms("gemm")),
            ratio(p.ratio, p.spread, p.reliable, x.forward_status),
            ms_cell(p.per_sample_ms("conv_backward")),
            ms_cell(p.per_sample_ms("gemm_backward")),
            ratio(p.backward_ratio, p.backward_spread, p.backward_reliable, x.backward_status),
            "-" if p.channels_last_ratio is None else f"{p.channels_last_ratio:.2f}x",
            p.backend or "-",
            f"[{style}]{status}[/{style}]" + (f" ({escape(p.error)})" if p.error else ""),
            ", ".join(x.rules) or "-",
        )
    return probe


def _conclusion(report) -> None:
    """The rules that apply, the verdict, the fixes, what was left out, and where the time went."""
    from vlfast.cli._process import since_start, since_start_words
    from vlfast.diagnosis.doctor import HEADLINE_RULE

    for r in report.rules:
        console.print(
            f"[bold]rule {r.id}[/bold]: {escape(r.title)}\n  {escape(r.explanation)}\n"
            f"  [dim]source: {escape(r.source)}[/dim]"
        )
    style = _VERDICT_STYLE.get(report.verdict, "bold yellow")
    console.print(
        f"\n[{style}]verdict: {report.verdict}[/{style}]  {escape(report.summary)}", highlight=False
    )
    models = {n.split(":", 1)[0] for x in report.findings for n in x.probe.shape.names}
    if report.verdict in ("slow-path", "gain") and len(models) > 1:
        console.print(f"[dim]({HEADLINE_RULE}; the table has every model's figures)[/dim]", highlight=False)
    if report.fixes:
        console.print("\n[bold]fix[/bold] (any one of these):")
        for fix in report.fixes:
            console.print(
                f"  [cyan]{escape(fix.text)}[/cyan]\n    [dim]{fix.kind}: {escape(fix.note)}[/dim]",
                highlight=False,
                soft_wrap=True,
            )
    for item in report.left_out:
        console.print(f"[yellow]left out for lack of budget:[/yellow] {escape(item)}", highlight=False)
    for note in report.notes:
        console.print(f"[yellow]note:[/yellow] {escape(note)}", highlight=False)
    wall = since_start()
    probe_s = (
        f", of which the probe {report.probe_s:.1f} s; a {report.budget_s:g} s budget for the whole command"
        if report.probe_s is not None
        else ""
    )
    console.print(
        f"[dim]{wall:.1f} s {since_start_words()}: {max(0.0, wall - report.elapsed_s):.1f} s starting up "
        f"(Python, torch, transformers), {report.elapsed_s:.1f} s diagnosing{probe_s}; --markdown prints a "
        "block for bug reports[/dim]",
        highlight=False,
    )


def register(app: typer.Typer) -> None:
    @app.command("doctor")
    @handle_errors
    def doctor_cmd(
        model: ModelOpt = None,
        device: DeviceOpt = None,
        dtype: DtypeOpt = None,
        patches: option(
            int | None,
            "--patches",
            help="Patches per sample fed to the probe. Default 3,072: one 8-frame 512x384 clip.",
            show_default=False,
        ) = None,
        budget: option(
            float,
            "--budget",
            help="Seconds the whole command may take: start-up, building the models, the probe and the "
            "output. The probe gets what the rest leaves and times fewer windows, fewer rounds or fewer "
            "shapes to keep it, saying what it left out.",
        ) = 12.0,
        no_probe: option(bool, "--no-probe", help="Facts and rules only, no timing (no verdict).") = False,
        markdown: option(
            bool, "--markdown", help="Print a paste-ready markdown block for bug reports."
        ) = False,
        inference: option(
            bool,
            "--inference",
            help="Forward only: do not time or count the backward pass (training counts both).",
        ) = False,
        fail_on: option(
            str,
            "--fail-on",
            metavar="WHAT",
            help="any: exit 1 for a slow path, 4 for an ordinary gain. slow-path: exit 0 for a gain "
            "(the launcher guard that passes on CPU runners).",
        ) = "any",
        json_out: JsonOpt = False,
    ) -> None:
        """Measure whether the patch embedding runs on a slow path here, explain why, and print the fix.

        With no --model it probes every built-in reference (offline). Exit status 1 for a slow path (a
        fallback kernel: >= 10x its GEMM, or >= 2x with a known cause) in an unpatched conv; 4 for an
        ordinary gain (>= 2x; 0 with --fail-on slow-path); 0 otherwise.
        """
        if fail_on not in ("any", "slow-path"):
            raise UsageError(f"--fail-on takes 'any' or 'slow-path', got {fail_on!r}")
        refuse_early(model, device, (dtype,))  # before torch: seconds to import
        from vlfast.cli._process import since_start, skip_teardown
        from vlfast.diagnosis.doctor import doctor
        from vlfast.diagnosis.probe import DEFAULT_PATCHES

        skip_teardown()  # everything it says is printed before it returns
        report = doctor(
            model,
            device=device,
            dtype=dtype,
            patches=patches or DEFAULT_PATCHES,
            budget_s=budget,
            probe=not no_probe,
            workload="inference" if inference else "training",
            fail_on=fail_on,
            spent_s=since_start(),  # the budget is the whole command's: start-up included
        )
        if json_out:
            print_json({**report.to_dict(), "wall_s": since_start()})
        elif markdown:
            typer.echo(report.to_markdown(), nl=False)
        else:
            print_fitted_table(_environment(report))
            print_fitted_table(_probe(report))
            _conclusion(report)
        raise typer.Exit(report.exit_code)
