"""`vlfast extract`: features of images and videos into a resumable, sharded output folder."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from vlfast.cli._common import (
    EXIT_ERROR,
    EXIT_FINDING,
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    UsageError,
    console,
    err_console,
    handle_errors,
    parse_storage_options,
    print_json,
    print_table,
)
from vlfast.cli._extras import require
from vlfast.cli._quiet import quiet_ray, quiet_third_party

EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a process Ctrl-C ended

DEMO_MODEL = "ref:qwen3-vl-2b"


def register(app: typer.Typer) -> None:
    app.command("extract")(extract)


def _ints(text: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UsageError(f"{option} {text!r} must be comma-separated integers, e.g. -1,-8") from None


@handle_errors
def extract(
    paths: Annotated[
        list[str],
        typer.Argument(
            help="INPUT is a folder of images/videos (recursive), a manifest (.jsonl, .csv, "
            ".parquet with columns path, id, prompt, text, instruction) or WebDataset .tar shards as a quoted pattern, e.g. "
            "'shards/{000000..000099}.tar'; OUT is the output folder. With --demo or --verify, only OUT.",
            show_default=False,
            metavar="INPUT OUT",
        ),
    ],
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            help="A local checkpoint directory, or ref:NAME (vision features only, random weights).",
        ),
    ] = None,
    features: Annotated[
        str,
        typer.Option(
            "--features",
            "-f",
            help="Comma-separated: vision, vision_mean, deepstack, llm; or embedding (Qwen3-VL-Embedding's "
            "vector of each row's media and text).",
        ),
    ] = "vision,vision_mean",
    layers: Annotated[
        str, typer.Option("--layers", help="LLM hidden-state layers for 'llm' (0 = embeddings, -1 = last).")
    ] = "-1",
    pool: Annotated[str, typer.Option("--pool", help="'last', 'mean' or 'last,mean' for 'llm'.")] = "last",
    prompt: Annotated[
        str | None,
        typer.Option(
            "--prompt", help="Prompt for 'llm' when a manifest row has none ('{kind}' = image/video)."
        ),
    ] = None,
    instruction: Annotated[
        str | None,
        typer.Option(
            "--instruction",
            help="For 'embedding': the system instruction of rows without their own 'instruction' "
            '(default: "Represent the user\'s input.").',
        ),
    ] = None,
    dim: Annotated[
        int | None,
        typer.Option(
            "--dim",
            help="For 'embedding': keep the first N dimensions, normalised again (Matryoshka, >= 64).",
        ),
    ] = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    store_dtype: Annotated[
        str | None,
        typer.Option(
            "--store-dtype",
            help="float16, float32 or bfloat16: convert floating features before storing (numpy cannot "
            "read bfloat16). Default: as computed.",
        ),
    ] = None,
    fps: Annotated[float | None, typer.Option("--fps", help="Video frames per second to sample.")] = None,
    num_frames: Annotated[
        int | None, typer.Option("--num-frames", help="Frames per video instead of --fps.")
    ] = None,
    min_pixels: Annotated[int | None, typer.Option("--min-pixels", help="Image pixel budget, lower.")] = None,
    max_pixels: Annotated[int | None, typer.Option("--max-pixels", help="Image pixel budget, upper.")] = None,
    video_max_pixels: Annotated[
        int | None, typer.Option("--video-max-pixels", help="Total pixel budget over a video's frames.")
    ] = None,
    exif_orientation: Annotated[
        bool | None,
        typer.Option(
            "--exif-orientation/--no-exif-orientation",
            help="Turn images upright by their EXIF orientation, and videos by their rotation metadata, as "
            "transformers does for a file given by path; or take the pixels as stored. Default: as OUT was "
            "made; for a new OUT, turned (not for the Qwen3-VL-Embedding recipe, as qwen-vl-utils).",
            show_default=False,
        ),
    ] = None,
    image_backend: Annotated[
        str | None,
        typer.Option(
            "--image-backend",
            help="Whose pixels images get: torchvision (transformers' torchvision image processor, done by "
            "vlfast, torchvision not needed; transformers' default for Qwen-VL) or pil (transformers' PIL "
            "processor, which runs; slower). Default: as OUT was made; for a new OUT, torchvision.",
            show_default=False,
        ),
    ] = None,
    batch_tokens: Annotated[
        int | None,
        typer.Option("--batch-tokens", help="Patches per forward. Default 32768 on CUDA, 4096 on CPU."),
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(
            "--workers",
            help="Decode/preprocess processes. Default: one per core on CPU, cores - 1 with a GPU; at most 8. "
            "With --engine ray: decode actors (default: as many as the cluster's free CPUs).",
        ),
    ] = None,
    decode_timeout: Annotated[
        float,
        typer.Option(
            "--decode-timeout",
            help="Seconds one sample may take to decode before its worker is stopped and the sample "
            "recorded as an error; 0 = no limit.",
        ),
    ] = 120.0,
    commit_every: Annotated[
        float,
        typer.Option(
            "--commit-every",
            help="Commit finished samples at least this often, in seconds; 0 = by size only.",
        ),
    ] = 60.0,
    resume_check: Annotated[
        str,
        typer.Option(
            "--resume-check",
            help="How a resume checks what OUT holds: 'full' hashes every stored tensor, 'quick' checks "
            "sizes and headers only.",
        ),
    ] = "full",
    no_patch: Annotated[
        bool, typer.Option("--no-patch", help="Leave the patch-embedding convs unpatched.")
    ] = False,
    max_errors: Annotated[
        int | None, typer.Option("--max-errors", help="Stop once more samples than this have failed.")
    ] = None,
    retry_errors: Annotated[
        str | None,
        typer.Option(
            "--retry-errors",
            metavar="KIND,...",
            help="Extract again the samples OUT records as failed: 'all', or kinds: error, transient, or a "
            "reason class as the summary counts it (e.g. 'unreadable or truncated image'). A new attempt's "
            "record supersedes the old one; a success removes it from the counts. (Transient failures are "
            "retried by every run anyway.)",
        ),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Delete what OUT holds and start over.")
    ] = False,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify",
            help="Check every byte OUT holds against its checksum and report every bad sample by id; "
            "exit 1 if any. Give only OUT.",
        ),
    ] = False,
    compact: Annotated[
        bool,
        typer.Option(
            "--compact",
            help="Replace each rank's many index parts by one consolidated part (a finished run does it "
            "itself; this is for folders written before, or runs stopped before they ended). Give only OUT.",
        ),
    ] = False,
    storage_options: Annotated[
        str | None,
        typer.Option(
            "--storage-options",
            help="JSON object passed to fsspec for INPUT and OUT URLs (s3://bucket/...), e.g. "
            '\'{"client_kwargs": {"endpoint_url": "http://localhost:9000"}}\'; credentials also come from '
            "the environment.",
        ),
    ] = None,
    engine: Annotated[
        str,
        typer.Option(
            "--engine",
            help="local: this process and its decode workers (under torchrun, one rank each); ray: Ray Data "
            "stages on a Ray cluster, decoding on CPU actors and the model on --ray-workers actors "
            "(pip install 'vlfast[ray]'). Same OUT either way.",
        ),
    ] = "local",
    ray_address: Annotated[
        str | None,
        typer.Option(
            "--ray-address",
            help="With --engine ray: the cluster (ray://head:10001, head:6379, auto). Default: RAY_ADDRESS, "
            "else a cluster started with `ray start` here, else a local one for this run.",
        ),
    ] = None,
    ray_workers: Annotated[
        int | None,
        typer.Option(
            "--ray-workers", help="With --engine ray: model actors (each claims a rank of OUT). Default 1."
        ),
    ] = None,
    num_gpus_per_worker: Annotated[
        float | None,
        typer.Option(
            "--num-gpus-per-worker",
            help="With --engine ray: GPUs per model actor. Default 1 with --device cuda, else 0 (CPU).",
        ),
    ] = None,
    ray_cpus_per_worker: Annotated[
        float | None,
        typer.Option("--ray-cpus-per-worker", help="With --engine ray: CPUs per model actor. Default 1."),
    ] = None,
    rank: Annotated[
        int | None,
        typer.Option(
            "--rank",
            help="This process's share of the input, from 0 to WORLD_SIZE minus 1, for ranks you launch "
            "yourself (a Slurm array: --rank $SLURM_ARRAY_TASK_ID). Default: torchrun's, or RANK.",
        ),
    ] = None,
    world_size: Annotated[
        int | None,
        typer.Option(
            "--world-size",
            help="How many ranks share the input (with --rank). Default: torchrun's, or WORLD_SIZE.",
        ),
    ] = None,
    demo: Annotated[
        bool,
        typer.Option(
            "--demo",
            help="Make a few images and a short video in a temp folder and extract them with --model (default "
            f"{DEMO_MODEL}: vision features; a checkpoint from `vlfast demo-checkpoint tiny-ckpt` adds LLM ones).",
        ),
    ] = False,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose",
            "-v",
            help="Also show what transformers and Ray print (loading bars, Ray's INFO and WARNING lines).",
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Extract vision-tower and LLM features per sample; run again to resume.

    Exit 0 done (bad inputs recorded in OUT/errors), 1 stopped by --max-errors, samples left undone by an
    unexpected error, or --verify found damage, 2 bad usage, a configuration or weights that differ from what
    OUT holds, OUT in use or not writable (all before OUT is written), 3 an unexpected error, most likely a
    bug (VLFAST_DEBUG=1 shows the traceback), 4 OUT's disk is full (free space and run the same command
    again: it resumes), 130 Ctrl-C and 143 SIGTERM (what was done is committed; the same command resumes).
    """
    quiet_third_party(verbose)
    # --verify and --compact read and rewrite the store only; a run builds the model and reads the inputs
    require("extract", "vlfast extract", models=not (verify or compact))
    if verify:
        if demo or len(paths) != 1:
            raise UsageError("with --verify give only OUT, e.g. `vlfast extract --verify OUT`")
        _verify(paths[0], as_json, parse_storage_options(storage_options))
        return
    if compact:
        if demo or len(paths) != 1:
            raise UsageError("with --compact give only OUT, e.g. `vlfast extract --compact OUT`")
        _compact(paths[0], as_json, parse_storage_options(storage_options))
        return
    from vlfast.extraction.api import UnexpectedSampleErrors
    from vlfast.extraction.interrupts import EXIT_TERMINATED, Terminated
    from vlfast.extraction.store.resume import RunConfigMismatch

    if demo:
        if len(paths) != 1:
            raise UsageError("with --demo give only OUT, e.g. `vlfast extract --demo demo-out`")
        tmp = tempfile.TemporaryDirectory(prefix="vlfast-demo-")
        from vlfast.demo import make_demo_inputs

        source: str = str(make_demo_inputs(tmp.name))
        out = paths[0]
        model = model or DEMO_MODEL
    else:
        if len(paths) > 2 and all(p.lower().endswith(".tar") for p in paths[:-1]):
            raise UsageError(
                f"give INPUT and OUT; got {len(paths) - 1} .tar files before OUT: quote a shard pattern "
                "so the shell leaves its braces to vlfast, e.g. 'shards/{000000..000099}.tar'"
            )
        if len(paths) != 2:
            raise UsageError("give INPUT and OUT (or --demo OUT)")
        source, out = paths
        if model is None:
            raise UsageError("--model is required: a checkpoint directory or ref:NAME (see `vlfast models`)")
    from vlfast.extraction.api import extract as run_extract

    pools = tuple(p.strip() for p in pool.split(",") if p.strip())
    options = parse_storage_options(storage_options)
    chosen = _engine(
        engine, ray_address, ray_workers, num_gpus_per_worker, ray_cpus_per_worker, rank, world_size, verbose
    )
    if engine == "ray":
        quiet_ray(verbose)
    try:
        summary = run_extract(
            source,
            out,
            engine=chosen,
            model=model,
            features=features,
            layers=_ints(layers, "--layers"),
            pools=pools,
            prompt=prompt,
            instruction=instruction,
            dim=dim,
            device=device,
            dtype=dtype,
            store_dtype=store_dtype,
            fps=fps,
            num_frames=num_frames,
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            video_max_pixels=video_max_pixels,
            exif_orientation=exif_orientation,
            image_backend=image_backend,
            max_batch_tokens=batch_tokens,
            num_workers=workers,
            decode_timeout=decode_timeout or None,
            commit_every=commit_every or None,
            resume_check=resume_check,
            patch_convs=not no_patch,
            max_errors=max_errors,
            overwrite=overwrite,
            retry_errors=retry_errors,
            progress=not as_json,
            storage_options=options,
            rank=rank,
            world_size=world_size,
        )
    except RunConfigMismatch as e:
        e.remedy = "pass --overwrite to delete what it holds and start again"
        if any(key == "processor.exif_orientation" for key, *_ in e.diffs):
            e.remedy += (
                "; or give neither --exif-orientation nor --no-exif-orientation, to resume it as it was made"
            )
        if any(key == "processor.image_processor" for key, *_ in e.diffs) and image_backend is not None:
            e.remedy += "; or leave out --image-backend, to resume it as it was made"
        if any(key == "processor.transparency" for key, *_ in e.diffs):
            e.remedy += (
                "; or resume it with a transformers of the rule it was made with (transparency on white: "
                "5.21 or later; dropped: 5.18-5.20)"
            )
        raise
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (Terminated): the run unwound the same way
        sigterm = isinstance(e, Terminated)
        err_console.print(
            f"[yellow]{'terminated (SIGTERM)' if sigterm else 'interrupted (Ctrl-C)'}:[/yellow] what was done "
            "is committed and OUT's locks are released; run the same command to resume"
        )
        raise typer.Exit(EXIT_TERMINATED if sigterm else EXIT_INTERRUPTED) from None
    except UnexpectedSampleErrors as e:
        err_console.print(f"[bold red]vlfast: stopped by a bug:[/bold red] {escape(str(e))}", highlight=False)
        raise typer.Exit(EXIT_ERROR) from None
    if as_json:
        print_json(summary.to_dict())
    elif summary.nothing_to_do:
        console.print(
            f"nothing to do: all {summary.assigned} input entries{_of_rank(summary)} are already in {out} "
            f"(extracted, or recorded in {_errors_dir(out)})",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
    else:
        _print_summary(summary, out)
    if summary.unexpected:
        err_console.print(
            f"[bold red]not done:[/bold red] {summary.unexpected} samples failed with an unexpected error (a bug, "
            "not their media; the warnings above name them): nothing was recorded for them, so the same command "
            "tries them again"
        )
    if summary.stopped:
        err_console.print(
            f"[bold red]stopped:[/bold red] {escape(summary.stopped)}; committed samples are kept"
        )
    if summary.stopped or summary.unexpected:
        raise typer.Exit(EXIT_FINDING)


def _engine(
    engine: str,
    ray_address: str | None,
    ray_workers: int | None,
    gpus: float | None,
    cpus: float | None,
    rank: int | None,
    world_size: int | None,
    verbose: bool = False,
):
    """The engine --engine names, with its own flags; flags of the other engine are refused here. The values
    themselves are checked once, by the engine and ExtractConfig, before anything is read. Ray is imported
    only for --engine ray (exit 2 with the hint if missing); its console alarms stay off unless ``verbose``."""
    if (rank is None) != (world_size is None):
        raise UsageError("give --rank and --world-size together, e.g. --rank 3 --world-size 8")
    ray_flags = {
        "--ray-address": ray_address,
        "--ray-workers": ray_workers,
        "--num-gpus-per-worker": gpus,
        "--ray-cpus-per-worker": cpus,
    }
    if engine == "local":
        given = [flag for flag, value in ray_flags.items() if value is not None]
        if given:
            raise UsageError(f"{', '.join(given)} apply to --engine ray only")
        return "local"
    if engine != "ray":
        raise UsageError(f"--engine must be local or ray, got {engine!r}")
    from vlfast.extraction.engines.ray import RayEngine

    return RayEngine(
        ray_address,
        1 if ray_workers is None else ray_workers,
        gpus,
        1.0 if cpus is None else cpus,
        quiet=not verbose,
    )


def _is_url(text: str) -> bool:
    from vlfast.extraction.objstore import is_url

    return is_url(text)


def _errors_dir(out: str) -> str:
    """OUT's errors folder as the user would name it (a URL keeps its ``//``; Path would fold it)."""
    return _in_out(out, "errors")


def _in_out(out: str, name: str) -> str:
    """OUT's folder ``name`` as the user would name it (a URL keeps its ``//``; Path would fold it)."""
    return f"{out.rstrip('/')}/{name}" if _is_url(out) else str(Path(out) / name)


def _of_rank(summary, word: str = "of") -> str:
    """Which rank, where ranks share the input (" of rank 3"); nothing for a single process."""
    return f" {word} rank {summary.rank}" if summary.world_size > 1 else ""


def _print_summary(summary, out: str) -> None:
    from vlfast.extraction.store.format import QUARANTINE_DIR

    shown = out if _is_url(out) else str(Path(out))
    table = Table(title=f"vlfast extract -> {escape(shown)}", show_header=False)
    table.add_column("", style="bold", no_wrap=True)
    table.add_column("", overflow="fold")  # paths and reasons stay whole in a narrow pipe
    rows = [
        ("model", summary.model),
        ("features", ", ".join(summary.features)),
        ("rank", f"{summary.rank} of {summary.world_size}")
        if summary.engine == "local"
        else ("engine", f"{summary.engine}: the driver is rank 0, model actors ranks 1 and up"),
        (
            "entries",
            f"{summary.total} in input"
            + (f", {summary.assigned}{_of_rank(summary, 'for')}" if summary.world_size > 1 else ""),
        ),
        ("extracted", f"{summary.extracted} this run, {summary.skipped} already in OUT"),
        ("failed", f"{summary.failed} recorded in {_errors_dir(out)}" if summary.failed else "0"),
        ("speed", f"{summary.samples_per_s:.2f} samples/s, {summary.tokens_per_s:,.0f} tokens/s"),
        ("time", f"{summary.seconds:.1f} s ({summary.compute_seconds:.1f} s in model forwards)"),
        (
            "setup",
            f"{'model' if summary.engine == 'local' else 'Ray started, models'} built in "
            f"{summary.load_seconds:.1f} s, weights hashed in {summary.fingerprint_seconds:.2f} s",
        ),
    ]
    if summary.unexpected:
        rows.append(
            ("not done", f"{summary.unexpected} (an unexpected error: not recorded, tried again next run)")
        )
    if summary.oom_splits:
        rows.append(("OOM splits", str(summary.oom_splits)))
    if summary.changed:
        rows.append(
            (
                "inputs changed",
                f"{summary.changed} since they were extracted: extracted again (their shards moved to "
                f"{_in_out(out, QUARANTINE_DIR)})",
            )
        )
    if summary.quarantined:
        rows.append(
            (
                "damaged",
                f"{len(summary.quarantined)} moved to {_in_out(out, QUARANTINE_DIR)} (the samples they held are "
                "extracted again)",
            )
        )
    for k, v in rows:
        table.add_row(k, escape(v))
    console.print(table)
    if summary.errors:
        kinds = Table(show_edge=False, box=None, padding=(0, 2))
        kinds.add_column("error kind")
        kinds.add_column("samples", justify="right")
        for kind, count in sorted(summary.errors.items(), key=lambda kv: (-kv[1], kv[0])):
            kinds.add_row(escape(kind), str(count))
        print_table(kinds)
    if summary.failed:
        console.print(
            f"errors with reasons: {_errors_dir(out)}", highlight=False, markup=False, soft_wrap=True
        )
    from vlfast.extraction.store.format import TRANSIENT_PREFIX

    if summary.errors.get(TRANSIENT_PREFIX):
        console.print(
            f"{summary.errors[TRANSIENT_PREFIX]} samples could not be read from storage for a transient "
            "reason (retries spent): run the same command again to retry them",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
    console.print(
        f"read back with: vlfast.FeatureCache({str(out)!r})", highlight=False, markup=False, soft_wrap=True
    )


def _reachable_out(out: str, storage_options: dict | None):
    """OUT as a path object for --verify and --compact; on object storage, probed first (reachable, bucket
    present), so a wrong endpoint is named before any work."""
    from vlfast.extraction.store.format import is_local, resolve_out

    path = resolve_out(out, storage_options)
    if not is_local(path):
        from vlfast.extraction.objstore import probe_out

        probe_out(path)
    return path


def _compact(out: str, as_json: bool, storage_options: dict | None) -> None:
    """``vlfast extract --compact OUT``: one consolidated index part per rank."""
    from vlfast.extraction.store.compact import compact_folder

    results = compact_folder(_reachable_out(out, storage_options))
    if as_json:
        print_json({"out": out, "ranks": [r.to_dict() for r in results]})
        return
    for r in results:
        if r.skipped:
            what = f"skipped: {r.skipped}"
        elif r.part:
            what = f"{r.replaced} parts -> {r.part} ({r.samples} samples)"
        else:
            what = "nothing to compact"
        if r.deleted:
            what += f"; {r.deleted} superseded parts deleted"
        console.print(f"rank {r.rank}: {what}", highlight=False, markup=False, soft_wrap=True)


def _verify(out: str, as_json: bool, storage_options: dict | None) -> None:
    """``vlfast extract --verify OUT``: hash everything, list every bad sample, exit 1 if any."""
    from vlfast.extraction.store.format import QUARANTINE_DIR, REDO_HINT
    from vlfast.extraction.store.integrity import check_folder

    report = check_folder(_reachable_out(out, storage_options))
    if as_json:
        print_json(report.to_dict())
    else:
        console.print(
            f"{out}: {report.shards} shard{'' if report.shards == 1 else 's'} in {report.parts} index part{'' if report.parts == 1 else 's'}, "
            f"{report.samples} samples, {report.bytes_checked / 2**20:,.1f} MiB "
            f"checked in {report.seconds:.1f} s",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
        if report.bad_samples:
            table = Table(title=f"{len(report.bad_samples)} damaged samples")
            table.add_column("id", overflow="fold")
            table.add_column("shard", overflow="fold")
            table.add_column("feature", overflow="fold")
            table.add_column("problem", overflow="fold")
            for bad in report.bad_samples:
                table.add_row(*(escape(bad[k]) for k in ("id", "shard", "feature", "reason")))
            console.print(table)
        notes = []
        if report.damaged_error_lines:
            notes.append(
                f"{report.damaged_error_lines} damaged lines in errors/ (those samples will be redone)"
            )
        if report.other_config_parts:
            notes.append(
                f"index parts made with another configuration: {', '.join(report.other_config_parts)}"
            )
        if report.unverifiable_parts:
            notes.append(f"{report.unverifiable_parts} shards of format 1 have no checksums to compare")
        # A damaged part with no samples to name (a foreign file under a part's name) is not in the table.
        notes += [f"{b['part']}: {b['reason']}" for b in report.bad_parts if not b["samples"]]
        notes += [f"{stray['path']}: {stray['problem']}" for stray in report.strays]
        for note in notes:
            console.print(note, highlight=False, markup=False, soft_wrap=True)
        if report.ok:
            console.print(
                # What was checked, and no more: bytes against checksums, not whether the values are sound.
                "checksums OK: the stored bytes are the ones written",
                highlight=False,
                markup=False,
                soft_wrap=True,
            )
        else:
            # Each finding gets the advice that works for it: the same command quarantines and redoes damage,
            # but refuses (exit 2) parts of another configuration, which only the user can move out.
            advice = []
            if report.bad_samples or report.bad_parts or report.damaged_error_lines:
                advice.append(f"Damaged. {REDO_HINT}")
            if report.strays:
                advice.append(
                    "Not where the format puts it: the same `vlfast extract` moves these aside to "
                    f"{_in_out(out, QUARANTINE_DIR)} "
                    "(a shard a killed run left is removed) and extracts again what is missing."
                )
            if report.other_config_parts:
                advice.append(
                    "Parts of another configuration (another run's, added to this OUT): move each, with the "
                    "shard of the same rank and number, out of OUT; the same `vlfast extract` refuses to "
                    "resume (exit 2) until then."
                )
            console.print(" ".join(advice), highlight=False, markup=False, soft_wrap=True)
    if not report.ok:
        raise typer.Exit(EXIT_FINDING)
