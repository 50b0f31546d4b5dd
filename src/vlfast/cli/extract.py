"""`vlfast extract`: features of images and videos into a resumable, sharded output folder. The options
become :func:`vlfast.extraction.extract`'s keywords (ExtractConfig's names, which it checks once).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from vlfast.cli._common import (
    EXIT_ERROR,
    EXIT_FINDING,
    EXIT_USAGE,
    DeviceOpt,
    DtypeOpt,
    HelpCommand,
    JsonOpt,
    UsageError,
    console,
    err_console,
    handle_errors,
    option,
    parse_storage_options,
    print_json,
    print_table,
    say,
)
from vlfast.cli._extras import require
from vlfast.cli._quiet import quiet_ray, quiet_third_party

if TYPE_CHECKING:
    from typer._click import Context

EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a process Ctrl-C ended

DEMO_MODEL = "ref:qwen3-vl-2b"

# Flags that were once modes of `vlfast extract` -> the command that does it now
MOVED = {"--verify": "vlfast out verify OUT", "--compact": "vlfast out compact OUT"}


class ExtractCommand(HelpCommand):
    """`vlfast extract`, answering a flag that was once another mode of it with the command that does it now
    (exit 2, one line), before anything else is parsed."""

    def parse_args(self, ctx: Context, args: list[str]) -> list[str]:
        for arg in args[: args.index("--")] if "--" in args else args:
            if arg in MOVED:
                err_console.print(
                    f"[bold red]vlfast: error:[/bold red] `vlfast extract {arg}` is now a command of its own: "
                    f"`{MOVED[arg]}`",
                    highlight=False,
                    soft_wrap=True,
                )
                ctx.exit(EXIT_USAGE)
        return super().parse_args(ctx, args)


def register(app: typer.Typer) -> None:
    app.command("extract", cls=ExtractCommand)(extract)


# The options, by what they decide; parameters take ExtractConfig's names (--batch-tokens: max_batch_tokens).

# What is computed
Paths = Annotated[
    list[str],
    typer.Argument(
        help="INPUT is a folder of images/videos (recursive), a manifest (.jsonl, .csv, "
        ".parquet with columns path, id, prompt, text, instruction) or WebDataset .tar shards as a quoted pattern, "
        "e.g. 'shards/{000000..000099}.tar'; OUT is the output folder. With --demo, only OUT.",
        show_default=False,
        metavar="INPUT OUT",
    ),
]
Model = option(
    str | None,
    "--model",
    "-m",
    help="A local checkpoint directory, or ref:NAME (vision features only, random weights).",
)
Features = option(
    str,
    "--features",
    "-f",
    help="Comma-separated: vision, vision_mean, deepstack, llm; or embedding (Qwen3-VL-Embedding's "
    "vector of each row's media and text).",
)
Layers = option(str, "--layers", help="LLM hidden-state layers for 'llm' (0 = embeddings, -1 = last).")
Pools = option(str, "--pool", help="'last', 'mean' or 'last,mean' for 'llm'.")
Prompt = option(
    str | None, "--prompt", help="Prompt for 'llm' when a manifest row has none ('{kind}' = image/video)."
)
Instruction = option(
    str | None,
    "--instruction",
    help="For 'embedding': the system instruction of rows without their own 'instruction' "
    '(default: "Represent the user\'s input.").',
)
Dim = option(
    int | None,
    "--dim",
    help="For 'embedding': keep the first N dimensions, normalised again (Matryoshka, >= 64).",
)
StoreDtype = option(
    str | None,
    "--store-dtype",
    help="float16, float32 or bfloat16: convert floating features before storing (numpy cannot "
    "read bfloat16). Default: as computed.",
)
NoPatch = option(bool, "--no-patch", help="Leave the patch-embedding convs unpatched.")

# How media becomes patches
Fps = option(float | None, "--fps", help="Video frames per second to sample.")
NumFrames = option(int | None, "--num-frames", help="Frames per video instead of --fps.")
MinPixels = option(int | None, "--min-pixels", help="Image pixel budget, lower.")
MaxPixels = option(int | None, "--max-pixels", help="Image pixel budget, upper.")
VideoMaxPixels = option(int | None, "--video-max-pixels", help="Total pixel budget over a video's frames.")
ExifOrientation = option(
    bool | None,
    "--exif-orientation/--no-exif-orientation",
    help="Turn images upright by their EXIF orientation, and videos by their rotation metadata, as "
    "transformers does for a file given by path; or take the pixels as stored. Default: as OUT was "
    "made; for a new OUT, turned (not for the Qwen3-VL-Embedding recipe, as qwen-vl-utils).",
    show_default=False,
)
ImageBackend = option(
    str | None,
    "--image-backend",
    help="Whose pixels images get: torchvision (transformers' torchvision image processor, done by "
    "vlfast, torchvision not needed; transformers' default for Qwen-VL) or pil (transformers' PIL "
    "processor, which runs; slower). Default: as OUT was made; for a new OUT, torchvision.",
    show_default=False,
)

# How it runs
BatchTokens = option(
    int | None, "--batch-tokens", help="Patches per forward. Default 32768 on CUDA, 4096 on CPU."
)
Workers = option(
    int | None,
    "--workers",
    help="Decode/preprocess processes. Default: one per core on CPU, cores - 1 with a GPU; at most 8. "
    "With --engine ray: decode actors (default: as many as the cluster's free CPUs).",
)
DecodeTimeout = option(
    float,
    "--decode-timeout",
    help="Seconds one sample may take to decode before its worker is stopped and the sample "
    "recorded as an error; 0 = no limit.",
)
Rank = option(
    int | None,
    "--rank",
    help="This process's share of the input, from 0 to WORLD_SIZE minus 1, for ranks you launch "
    "yourself (a Slurm array: --rank $SLURM_ARRAY_TASK_ID). Default: torchrun's, or RANK.",
)
WorldSize = option(
    int | None,
    "--world-size",
    help="How many ranks share the input (with --rank). Default: torchrun's, or WORLD_SIZE.",
)

# OUT: how it is written, what is redone
CommitEvery = option(
    float, "--commit-every", help="Commit finished samples at least this often, in seconds; 0 = by size only."
)
ResumeCheck = option(
    str,
    "--resume-check",
    help="How a resume checks what OUT holds: 'full' hashes every stored tensor, 'quick' checks "
    "sizes and headers only.",
)
MaxErrors = option(int | None, "--max-errors", help="Stop once more samples than this have failed.")
RetryErrors = option(
    str | None,
    "--retry-errors",
    metavar="KIND,...",
    help="Extract again the samples OUT records as failed: 'all', or kinds: error, transient, or a "
    "reason class as the summary counts it (e.g. 'unreadable or truncated image'). A new attempt's "
    "record supersedes the old one; a success removes it from the counts. (Transient failures are "
    "retried by every run anyway.)",
)
Overwrite = option(bool, "--overwrite", help="Delete what OUT holds and start over.")
StorageOptions = option(
    str | None,
    "--storage-options",
    help="JSON object passed to fsspec for INPUT and OUT URLs (s3://bucket/...), e.g. "
    '\'{"client_kwargs": {"endpoint_url": "http://localhost:9000"}}\'; credentials also come from '
    "the environment.",
)

# Where the model runs
EngineName = option(
    str,
    "--engine",
    help="local: this process and its decode workers (under torchrun, one rank each); ray: Ray Data "
    "stages on a Ray cluster, decoding on CPU actors and the model on --ray-workers actors "
    "(pip install 'vlfast[ray]'). Same OUT either way.",
)
RayAddress = option(
    str | None,
    "--ray-address",
    help="With --engine ray: the cluster (ray://head:10001, head:6379, auto). Default: RAY_ADDRESS, "
    "else a cluster started with `ray start` here, else a local one for this run.",
)
RayWorkers = option(
    int | None,
    "--ray-workers",
    help="With --engine ray: model actors (each claims a rank of OUT). Default 1.",
)
GpusPerWorker = option(
    float | None,
    "--num-gpus-per-worker",
    help="With --engine ray: GPUs per model actor. Default 1 with --device cuda, else 0 (CPU).",
)
CpusPerWorker = option(
    float | None, "--ray-cpus-per-worker", help="With --engine ray: CPUs per model actor. Default 1."
)

# This command's own
Demo = option(
    bool,
    "--demo",
    help="Make a few images and a short video in a temp folder and extract them with --model (default "
    f"{DEMO_MODEL}: vision features; a checkpoint from `vlfast demo-checkpoint tiny-ckpt` adds LLM ones).",
)
Verbose = option(
    bool,
    "--verbose",
    "-v",
    help="Also show what transformers and Ray print (loading bars, Ray's INFO and WARNING lines).",
)


@handle_errors
def extract(
    ctx: typer.Context,
    paths: Paths,
    model: Model = None,
    features: Features = "vision,vision_mean",
    layers: Layers = "-1",
    pools: Pools = "last",
    prompt: Prompt = None,
    instruction: Instruction = None,
    dim: Dim = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    store_dtype: StoreDtype = None,
    fps: Fps = None,
    num_frames: NumFrames = None,
    min_pixels: MinPixels = None,
    max_pixels: MaxPixels = None,
    video_max_pixels: VideoMaxPixels = None,
    exif_orientation: ExifOrientation = None,
    image_backend: ImageBackend = None,
    max_batch_tokens: BatchTokens = None,
    num_workers: Workers = None,
    decode_timeout: DecodeTimeout = 120.0,
    commit_every: CommitEvery = 60.0,
    resume_check: ResumeCheck = "full",
    no_patch: NoPatch = False,
    max_errors: MaxErrors = None,
    retry_errors: RetryErrors = None,
    overwrite: Overwrite = False,
    storage_options: StorageOptions = None,
    engine: EngineName = "local",
    ray_address: RayAddress = None,
    ray_workers: RayWorkers = None,
    num_gpus_per_worker: GpusPerWorker = None,
    ray_cpus_per_worker: CpusPerWorker = None,
    rank: Rank = None,
    world_size: WorldSize = None,
    demo: Demo = False,
    verbose: Verbose = False,
    as_json: JsonOpt = False,
) -> None:
    """Extract vision-tower and LLM features per sample; run again to resume.

    Exit 0 done (bad inputs recorded in OUT/errors), 1 stopped by --max-errors, or samples left undone by an
    unexpected error, 2 bad usage, a configuration or weights that differ from what OUT holds, OUT in use or
    not writable (all before OUT is written), 3 an unexpected error, most likely a bug (VLFAST_DEBUG=1 shows
    the traceback), 4 OUT's disk is full (free space and run the same command again: it resumes), 130 Ctrl-C
    and 143 SIGTERM (what was done is committed; the same command resumes). To verify, compact or export a
    finished OUT: `vlfast out`.
    """
    quiet_third_party(verbose)
    require("extract", "vlfast extract")  # a run builds the model and reads the inputs
    request = _request(ctx.params)
    summary = _run(request)
    _report(summary, request.out, as_json)


@dataclass
class _Request:
    """What the parsed command line asks :func:`vlfast.extraction.extract` to do."""

    source: str
    out: str
    engine: Any  # "local", or a RayEngine with its flags
    options: dict[str, Any]  # ExtractConfig's keywords
    demo_inputs: tempfile.TemporaryDirectory | None = None  # kept (and removed) with the request


_RAY_ARGS = ("engine", "ray_address", "ray_workers", "num_gpus_per_worker", "ray_cpus_per_worker")
_ENGINE_ARGS = (*_RAY_ARGS, "rank", "world_size", "verbose")  # in _engine's order
_COMMAND_LINE = frozenset({"paths", "no_patch", *_RAY_ARGS, "demo", "verbose", "as_json"})


def _request(params: dict[str, Any]) -> _Request:
    """The parsed options as the library's call; usage mistakes refused (exit 2) before anything is read."""
    paths, demo_inputs = params["paths"], None
    if params["demo"]:
        if len(paths) != 1:
            raise UsageError("with --demo give only OUT, e.g. `vlfast extract --demo demo-out`")
        from vlfast.demo import make_demo_inputs

        demo_inputs = tempfile.TemporaryDirectory(prefix="vlfast-demo-")
        source, out = str(make_demo_inputs(demo_inputs.name)), paths[0]
        params = {**params, "model": params["model"] or DEMO_MODEL}
    else:
        if len(paths) > 2 and all(p.lower().endswith(".tar") for p in paths[:-1]):
            raise UsageError(
                f"give INPUT and OUT; got {len(paths) - 1} .tar files before OUT: quote a shard pattern "
                "so the shell leaves its braces to vlfast, e.g. 'shards/{000000..000099}.tar'"
            )
        if len(paths) != 2:
            raise UsageError("give INPUT and OUT (or --demo OUT)")
        source, out = paths
        if params["model"] is None:
            raise UsageError("--model is required: a checkpoint directory or ref:NAME (see `vlfast models`)")
    storage_options = parse_storage_options(params["storage_options"])
    engine = _engine(*(params[k] for k in _ENGINE_ARGS))
    if params["engine"] == "ray":
        quiet_ray(params["verbose"])
    options = {k: v for k, v in params.items() if k not in _COMMAND_LINE}
    options.update(
        layers=_ints(params["layers"], "--layers"),
        pools=tuple(p.strip() for p in params["pools"].split(",") if p.strip()),
        decode_timeout=params["decode_timeout"] or None,  # 0: no limit
        commit_every=params["commit_every"] or None,  # 0: by size only
        patch_convs=not params["no_patch"],
        progress=not params["as_json"],
        storage_options=storage_options,
    )
    return _Request(source, out, engine, options, demo_inputs)


def _ints(text: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UsageError(f"{option} {text!r} must be comma-separated integers, e.g. -1,-8") from None


def _run(request: _Request):
    """:func:`vlfast.extraction.extract` on the request; what stops it is said with what to do next."""
    from vlfast.extraction.api import UnexpectedSampleErrors
    from vlfast.extraction.api import extract as run_extract
    from vlfast.extraction.interrupts import EXIT_TERMINATED, Terminated
    from vlfast.extraction.store.resume import RunConfigMismatch

    try:
        return run_extract(request.source, request.out, engine=request.engine, **request.options)
    except RunConfigMismatch as e:
        e.remedy = _remedy(e.diffs, request.options["image_backend"])
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


# A recorded setting that differs -> what else resumes the OUT, besides --overwrite
_REMEDIES = {
    "processor.exif_orientation": "give neither --exif-orientation nor --no-exif-orientation, to resume it as "
    "it was made",
    "processor.image_processor": "leave out --image-backend, to resume it as it was made",
    "processor.transparency": "resume it with a transformers of the rule it was made with (transparency on "
    "white: 5.21 or later; dropped: 5.18-5.20)",
    "processor.video_wrapper": "resume it with a transformers of the rule it was made with (a video's prompt "
    "with the chat template's wrapper replaced: 5.25 or later; kept: 5.18-5.24)",
}


def _remedy(diffs, image_backend: str | None) -> str:
    """What resumes an OUT whose recorded configuration differs from this command's in ``diffs``."""
    keys = {key for key, *_ in diffs} - ({"processor.image_processor"} if image_backend is None else set())
    ways = [way for key, way in _REMEDIES.items() if key in keys]
    return "; or ".join(["pass --overwrite to delete what it holds and start again", *ways])


def _report(summary, out: str, as_json: bool) -> None:
    """The summary as JSON or a table; exit 1 where the run stopped early or left samples undone."""
    from vlfast.extraction.store.out import Out

    if as_json:
        print_json(summary.to_dict())
    elif summary.nothing_to_do:
        of_rank = f" of rank {summary.rank}" if summary.world_size > 1 else ""  # where ranks share the input
        say(
            f"nothing to do: all {summary.assigned} input entries{of_rank} are already in {out} "
            f"(extracted, or recorded in {Out.errors_shown(out)})"
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
    """The engine --engine names, with its own flags; the other engine's flags are refused here (values are
    checked by the engine and ExtractConfig). Ray is imported only for --engine ray."""
    if (rank is None) != (world_size is None):
        raise UsageError("give --rank and --world-size together, e.g. --rank 3 --world-size 8")
    if engine == "local":
        flags = ("--ray-address", "--ray-workers", "--num-gpus-per-worker", "--ray-cpus-per-worker")
        given = [flag for flag, v in zip(flags, (ray_address, ray_workers, gpus, cpus)) if v is not None]
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


def _print_summary(summary, out: str) -> None:
    from vlfast.extraction.objstore import is_url
    from vlfast.extraction.store.format import TRANSIENT_PREFIX
    from vlfast.extraction.store.out import Out

    shown = out if is_url(out) else str(Path(out))
    table = Table(title=f"vlfast extract -> {escape(shown)}", show_header=False)
    table.add_column("", style="bold", no_wrap=True)
    table.add_column("", overflow="fold")  # paths and reasons stay whole in a narrow pipe
    split = f", {summary.assigned} for rank {summary.rank}" if summary.world_size > 1 else ""
    rows = [
        ("model", summary.model),
        ("features", ", ".join(summary.features)),
        ("rank", f"{summary.rank} of {summary.world_size}")
        if summary.engine == "local"
        else ("engine", f"{summary.engine}: the driver is rank 0, model actors ranks 1 and up"),
        ("entries", f"{summary.total} in input{split}"),
        ("extracted", f"{summary.extracted} this run, {summary.skipped} already in OUT"),
        ("failed", f"{summary.failed} recorded in {Out.errors_shown(out)}" if summary.failed else "0"),
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
    quarantine = Out.quarantine_shown(out)
    if summary.changed:
        changed = (
            f"{summary.changed} since they were extracted: extracted again (their shards moved to "
            f"{quarantine})"
        )
        rows.append(("inputs changed", changed))
    if summary.quarantined:
        damaged = (
            f"{len(summary.quarantined)} moved to {quarantine} (the samples they held are extracted again)"
        )
        rows.append(("damaged", damaged))
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
        say(f"errors with reasons: {Out.errors_shown(out)}")
    if summary.errors.get(TRANSIENT_PREFIX):
        say(
            f"{summary.errors[TRANSIENT_PREFIX]} samples could not be read from storage for a transient "
            "reason (retries spent): run the same command again to retry them"
        )
    say(f"read back with: vlfast.FeatureCache({str(out)!r})")
