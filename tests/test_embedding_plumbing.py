"""`--features embedding` around the recipe: instructions, manifests with text rows, padding on either side,
what is refused before OUT is written (exit 2) and what is recorded per row. The parity with an independent
one-at-a-time implementation of the recipe is tests/test_extract_embedding.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from vlfast.cli.main import app
from vlfast.errors import InputRefused
from vlfast.extraction import FeatureCache, extract
from vlfast.extraction.decode.embedding import DEFAULT_INSTRUCTION, EmbeddingPrompt, normalized_instruction
from vlfast.extraction.decode.prompts import PromptBuilder
from vlfast.extraction.decode.stage import DecodedSample
from vlfast.extraction.model import runner as model_runner
from vlfast.extraction.model.features import FeatureSpec, compute_llm_features, embedding_of
from vlfast.extraction.sources.listing import load_inputs
from vlfast.extraction.sources.sample import Sample
from vlfast.pixels.engine import build_processor_config
from vlfast.pixels.recipe import is_embedding_checkpoint
from vlfast.pixels.video import sample_frame_indices, video_resize_shape

runner = CliRunner()


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> dict[str, Path]:
    from vlfast.demo import make_images, make_video

    d = tmp_path_factory.mktemp("emb-media")
    a, b = make_images(d, [(64, 48), (90, 70)])
    return {"a": a, "b": b, "v": make_video(d / "v.mp4", frames=12, fps=4)}


def _named_embedding(checkpoint: Path, dest: Path) -> Path:
    """A copy of ``checkpoint`` whose config.json names the embedding architecture."""
    import shutil

    shutil.copytree(checkpoint, dest)
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps(config | {"architectures": ["Qwen3VLForEmbedding"]}))
    return dest


def _manifest(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------------ the instruction


@pytest.mark.parametrize(
    ("given", "used"),
    [
        (None, DEFAULT_INSTRUCTION),
        ("", DEFAULT_INSTRUCTION),
        ("   ", DEFAULT_INSTRUCTION),
        ("Find the clip", "Find the clip."),
        ("  Find the clip?  ", "Find the clip?"),
        ("找到图片。", "找到图片。"),  # a CJK full stop is punctuation (category Po)
        ("Match (this)", "Match (this)"),  # a closing bracket is punctuation (Pe): nothing added
        ("Rank 5", "Rank 5."),
    ],
)
def test_the_instruction_is_normalised_as_the_reference_does(given, used):
    assert normalized_instruction(given, DEFAULT_INSTRUCTION) == used


def test_only_a_checkpoint_naming_the_embedding_architecture_gets_the_recipe(tiny_qwen3_vl, tmp_path):
    """The recipe's pixel budgets replace the processor files' numbers for Qwen3-VL-Embedding checkpoints;
    any other Qwen3-VL keeps its own (and the run.json of such a run is unchanged: no new key)."""

    assert not is_embedding_checkpoint(str(tiny_qwen3_vl))
    plain = build_processor_config(str(tiny_qwen3_vl), family="qwen3_vl")
    assert plain.video_sizing == "processor" and plain.to_dict()["video_sizing"] == "processor"
    emb = _named_embedding(tiny_qwen3_vl, tmp_path / "emb")
    assert is_embedding_checkpoint(str(emb))
    cfg = build_processor_config(str(emb), family="qwen3_vl")
    assert (cfg.image_min_pixels, cfg.image_max_pixels) == (4 * 32 * 32, 1800 * 32 * 32)
    assert (cfg.fps, cfg.max_frames, cfg.frame_sampling, cfg.video_sizing) == (
        1.0,
        64,
        "qwen-vl-utils",
        "qwen-vl-utils",
    )
    assert "Qwen3-VL-Embedding recipe" in cfg.source
    user = build_processor_config(str(emb), family="qwen3_vl", max_pixels=256 * 32 * 32, fps=2.0)
    assert user.image_max_pixels == 256 * 32 * 32 and user.fps == 2.0  # the user's numbers win


def test_qwen_vl_utils_frames_and_sizes(tiny_qwen3_vl, tmp_path):
    """qwen-vl-utils 0.0.14's smart_nframes and fetch_video budget, worked by hand for a few videos."""

    emb = _named_embedding(tiny_qwen3_vl, tmp_path / "emb")
    cfg = build_processor_config(str(emb), family="qwen3_vl")
    # 300 frames at 30 fps = 10 s at 1 fps: 10 frames, linspace(0, 299, 10).round()
    assert sample_frame_indices(300, 30.0, cfg).tolist() == [0, 33, 66, 100, 133, 166, 199, 233, 266, 299]
    # 2 s at 1 fps = 2 frames, raised to the 4-frame minimum
    assert len(sample_frame_indices(60, 30.0, cfg)) == 4
    # an hour: capped at 64
    assert len(sample_frame_indices(108_000, 30.0, cfg)) == 64
    # 3 frames in all: 2 (the frame factor, floored)
    assert len(sample_frame_indices(3, 30.0, cfg)) == 2
    # 1080p, 10 frames: the 768-token frame cap binds (1920x1080 -> within 786,432 pixels, multiples of 32)
    h, w = video_resize_shape(10, 1080, 1920, cfg)
    assert (h, w) == (640, 1152) and h * w <= 768 * 32 * 32
    # 64 frames: the 10 x 768 x 32 x 32 total binds: 7,864,320 / 64 * 2 = 245,760 pixels a frame
    h, w = video_resize_shape(64, 1080, 1920, cfg)
    assert h * w <= 245_760 and (h, w) == (352, 640)
    # tiny frames go up to the 128-token minimum
    h, w = video_resize_shape(4, 48, 64, cfg)
    assert h * w >= 128 * 32 * 32 and h % 32 == 0 and w % 32 == 0


# ------------------------------------------------------------------------------------------------ manifests


def test_manifest_text_and_instruction_columns(tmp_path, media):
    m = _manifest(
        tmp_path / "m.jsonl",
        [
            {"id": "a", "path": str(media["a"]), "text": "a cat", "instruction": "Find it"},
            {"id": "t", "text": "only words"},
            {"text": "no id"},
            {"id": "empty", "text": ""},
            {"id": "nothing"},
            {"id": "num", "text": 5},
        ],
    )
    samples, problems = load_inputs(m)
    assert [(s.id, s.kind, s.text, s.instruction) for s in samples] == [
        ("a", "image", "a cat", "Find it"),
        ("t", "text", "only words", None),
    ]
    reasons = [p.reason for p in problems]
    assert "needs an 'id'" in reasons[0]
    assert reasons[1].startswith("no path and no text") and reasons[2].startswith("no path and no text")
    assert reasons[3] == "text must be text, got int 5"


def test_csv_and_parquet_manifests_may_have_text_without_path(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    csv = tmp_path / "m.csv"
    csv.write_text('id,text,instruction\nq1,"a dog, running",Find the clip\n')
    pq.write_table(pa.table({"id": ["q1"], "text": ["a dog, running"]}), tmp_path / "m.parquet")
    for m in (csv, tmp_path / "m.parquet"):
        (s,), problems = load_inputs(m)
        assert problems == [] and (s.kind, s.text) == ("text", "a dog, running")


# -------------------------------------------------------------------------------------------------- padding


def test_left_or_right_padding_gives_the_same_vectors(tiny_qwen3_vl, media):
    """Rows of different lengths and modalities in one batch: the vector at the last real token is the
    same whichever side the padding is on (positions come from the attention mask)."""
    from vlfast.models import load_model
    from vlfast.pixels.engine import Preprocessor

    cfg = build_processor_config(str(tiny_qwen3_vl), family="qwen3_vl")
    pre = Preprocessor(cfg, image_processor_dir=str(tiny_qwen3_vl))
    prompt = EmbeddingPrompt(PromptBuilder(str(tiny_qwen3_vl), "qwen3_vl", 2, 2))
    samples = [
        Sample("a", "image", (str(media["a"]),), text="a long caption " * 6),
        Sample("t", "text", (), text="short"),
        Sample("v", "video", (str(media["v"]),)),
        Sample("b", "image", (str(media["b"]),)),
    ]
    items = []
    for i, s in enumerate(samples):
        pixels, grid, meta = pre(s) if s.kind != "text" else (pre.no_pixels(), (0, 0, 0), {})
        from vlfast.pixels.video import normalize_patches

        if pixels.dtype == torch.uint8:
            pixels = normalize_patches(pixels, cfg)
        item = DecodedSample(i, s.kind, pixels, grid, grid[0] * grid[1] * grid[2] // 4, meta)
        item.input_ids, _ = prompt(s, grid, meta)
        items.append(item)
    assert len({int(it.input_ids.numel()) for it in items}) == 4  # all lengths differ
    model = load_model(tiny_qwen3_vl, dtype=torch.float32)
    tok = prompt.tokenizer()
    ids = {
        "image_token_id": int(tok.convert_tokens_to_ids("<|image_pad|>")),
        "video_token_id": int(tok.convert_tokens_to_ids("<|video_pad|>")),
        "pad_token_id": int(tok.pad_token_id),
    }
    spec = FeatureSpec(("embedding",))
    kw = dict(device=torch.device("cpu"), dtype=torch.float32, **ids)
    right = compute_llm_features(model, model.model.visual, items, spec, padding_side="right", **kw)
    left = compute_llm_features(model, model.model.visual, items, spec, padding_side="left", **kw)
    alone = [compute_llm_features(model, model.model.visual, [it], spec, **kw)[0] for it in items]
    for r, lp, a in zip(right, left, alone):
        assert float(r["embedding"] @ lp["embedding"]) >= 0.99999
        assert float(r["embedding"] @ a["embedding"]) >= 0.99999
        assert torch.allclose(r["embedding"].norm(), torch.tensor(1.0))


def test_matryoshka_is_the_cut_state_normalised_again():
    h = torch.randn(128, dtype=torch.bfloat16)
    full, cut = embedding_of(h, None), embedding_of(h, 64)
    assert cut.shape == (64,) and cut.dtype == torch.float32
    assert torch.allclose(cut, torch.nn.functional.normalize(full[:64], dim=0), atol=1e-7)


# ------------------------------------------------------------------------------------- refused before OUT


@pytest.fixture
def no_model_load(monkeypatch):
    monkeypatch.setattr(model_runner, "load", lambda *a, **k: pytest.fail("the model was loaded"))


def _cli(inputs, out, *args):
    return runner.invoke(app, ["extract", str(inputs), str(out), "--workers", "0", *args])


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--dim", "32"), "--dim must be an integer from 64 to"),
        (("--dim", "65"), "is 64 wide"),  # the tiny model's width is 64
        (("--features", "embedding,llm"), "cannot be extracted in one run"),
        (
            ("--features", "vision", "--instruction", "x"),
            "--instruction (instruction) is for --features embedding",
        ),
        (("--features", "vision", "--dim", "64"), "applies to --features embedding only"),
        (("--prompt", "Describe"), "--prompt (prompt) is for --features llm"),
        (("--instruction", "   "), "instruction must be a non-empty string"),
    ],
)
def test_bad_embedding_flags_are_refused_before_out_is_written(
    tmp_path, media, tiny_qwen3_vl, no_model_load, args, says
):
    m = _manifest(tmp_path / "m.jsonl", [{"id": "a", "path": str(media["a"])}])
    out = tmp_path / "out"
    flags = ("--features", "embedding") if "--features" not in args else ()
    r = _cli(m, out, "-m", str(tiny_qwen3_vl), *flags, *args)
    assert r.exit_code == 2, r.output
    assert says in " ".join(r.output.split()), r.output
    assert not out.exists()


def test_embedding_of_a_vision_tower_alone_is_refused_before_out_is_written(tmp_path, media, no_model_load):
    m = _manifest(tmp_path / "m.jsonl", [{"id": "a", "path": str(media["a"])}])
    out = tmp_path / "out"
    r = _cli(m, out, "-m", "ref:qwen3-vl-2b", "--features", "embedding")
    assert r.exit_code == 2 and "vision tower only" in r.output and "embedding" in r.output, r.output
    assert not out.exists()


def test_the_api_refuses_the_same(tmp_path, media, tiny_qwen3_vl, no_model_load):
    m = _manifest(tmp_path / "m.jsonl", [{"id": "a", "path": str(media["a"])}])
    with pytest.raises(InputRefused, match="integer >= 64"):
        extract(m, tmp_path / "out", model=str(tiny_qwen3_vl), features="embedding", dim=True)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ recorded per row


def test_rows_that_cannot_be_embedded_are_recorded_and_the_rest_extracted(tmp_path, media, tiny_qwen3_vl):
    """A row with neither path nor text is an input error; a text row beside vision features has nothing
    to give them; a 10,000-character instruction is cut at 8,192 tokens for a text row (recorded in its
    meta) and refused for an image row, whose cut would go through its image tokens."""
    long = "x" * 10_000
    rows = [
        {"id": "img", "path": str(media["a"]), "text": "a square"},
        {"id": "txt", "text": "words"},
        {"id": "none", "text": ""},
        {"id": "long-text", "text": "words", "instruction": long},
        {"id": "long-image", "path": str(media["b"]), "instruction": long},
    ]
    m = _manifest(tmp_path / "m.jsonl", rows)
    out = tmp_path / "out"
    summary = extract(m, out, model=str(tiny_qwen3_vl), features="embedding", num_workers=0, device="cpu")
    assert summary.extracted == 3 and summary.failed == 2, summary
    cache = FeatureCache(out)
    assert sorted(cache.ids()) == ["img", "long-text", "txt"]
    meta = cache.meta("long-text")
    assert meta["truncated_from"] > 8192 and meta["prompt_tokens"] == 8192 and meta["path"] is None
    assert meta["instruction"] == long + "." and meta["text"] == "words"
    assert "instruction" not in cache.meta("img")  # the run's default is in run.json, not on every row
    assert (
        json.loads((out / "run.json").read_text())["config"]["features"]["instruction"] == DEFAULT_INSTRUCTION
    )
    errors = {r["id"]: r["reason"] for r in cache.errors()}
    assert errors["none"].startswith("no path and no text")
    assert "would go through the image or video tokens" in errors["long-image"]

    out2 = tmp_path / "out2"
    extract(m, out2, model=str(tiny_qwen3_vl), features="embedding,vision_mean", num_workers=0, device="cpu")
    errors = {r["id"]: r["reason"] for r in FeatureCache(out2).errors()}
    assert "no image or video for the vision features" in errors["txt"]
    assert sorted(FeatureCache(out2)["img"]) == ["embedding", "vision_mean"]


def _qwen_vl_utils(*names: str) -> dict:
    """Functions of qwen-vl-utils compiled from its installed source (its module imports torchvision)."""
    import importlib.util
    import logging
    import math

    from test_extract_preprocess import _from_source

    spec = importlib.util.find_spec("qwen_vl_utils")
    if spec is None:
        pytest.skip("qwen-vl-utils is not installed (it is in the test extras)")
    origin = Path(next(iter(spec.submodule_search_locations))) / "vision_process.py"
    wanted = {"round_by_factor", "ceil_by_factor", "floor_by_factor", *names}
    wanted |= {"FPS", "FRAME_FACTOR", "FPS_MIN_FRAMES", "FPS_MAX_FRAMES", "MAX_RATIO"}
    wanted |= {"IMAGE_MIN_TOKEN_NUM", "IMAGE_MAX_TOKEN_NUM"}
    ns = {"math": math, "logger": logging.getLogger("qwen_vl_utils")}
    ns.update(Dict=dict, Any=object, Union=object, Optional=object, Tuple=tuple)
    return _from_source(origin, wanted, ns)


def test_recipe_frames_and_sizes_equal_qwen_vl_utils_own_code(tiny_qwen3_vl, tmp_path):
    """The embedding recipe's video rules against qwen-vl-utils' smart_nframes and smart_resize themselves,
    with the reference's arguments (fps 1, max_frames 64; the fetch_video per-frame budget), over a sweep."""

    ns = _qwen_vl_utils("smart_nframes", "smart_resize")
    emb = _named_embedding(tiny_qwen3_vl, tmp_path / "emb")
    cfg = build_processor_config(str(emb), family="qwen3_vl")
    for total in (2, 3, 5, 30, 61, 299, 1_000, 4_000, 200_000):
        for fps in (1.0, 12.5, 24.0, 29.97, 60.0):
            n = ns["smart_nframes"]({"fps": 1, "max_frames": 64}, total_frames=total, video_fps=fps)
            theirs = torch.linspace(0, total - 1, n).round().long().numpy()
            assert sample_frame_indices(total, fps, cfg).tolist() == theirs.tolist(), (total, fps)
    f, lo, budget = 32, 128 * 32 * 32, 10 * 768 * 32 * 32
    for n in (2, 4, 10, 32, 64):
        for h, w in ((48, 64), (240, 320), (480, 854), (1080, 1920), (2160, 3840), (100, 1500)):
            hi = max(min(768 * f * f, budget / n * 2), int(lo * 1.05))
            assert video_resize_shape(n, h, w, cfg) == ns["smart_resize"](h, w, f, lo, hi), (n, h, w)


def test_a_sentence_transformers_qwen3_vl_is_an_embedding_checkpoint(tiny_qwen3_vl, tmp_path):
    """The published checkpoints are Sentence-Transformers models too: that marks them whatever their
    config.json's architectures say."""
    import shutil

    st = tmp_path / "st"
    shutil.copytree(tiny_qwen3_vl, st)
    assert not is_embedding_checkpoint(str(st))
    (st / "modules.json").write_text("[]")
    assert is_embedding_checkpoint(str(st))


def test_the_exported_table_holds_each_rows_instruction_and_text(tmp_path, media, tiny_qwen3_vl):
    """A real embedding OUT through `vlfast export`: rows without their own instruction get the run's (kept
    once in run.json), text rows have no path, and each vector is its own nearest neighbour in Lance."""
    import pyarrow.parquet as pq

    from vlfast.extraction import export

    rows = [
        {"id": "img", "path": str(media["a"]), "text": "a square"},
        {"id": "vid", "path": str(media["v"])},
        {"id": "txt", "text": "words", "instruction": "Find the picture"},
    ]
    m = _manifest(tmp_path / "m.jsonl", rows)
    out = tmp_path / "out"
    extract(m, out, model=str(tiny_qwen3_vl), features="embedding", instruction="Match it", num_workers=0)
    export(out, tmp_path / "t.parquet")
    table = {r["id"]: r for r in pq.read_table(tmp_path / "t.parquet").to_pylist()}
    assert table["img"]["instruction"] == table["vid"]["instruction"] == "Match it."
    assert table["txt"]["instruction"] == "Find the picture." and table["txt"]["path"] is None
    assert table["img"]["text"] == "a square" and table["vid"]["text"] is None
    cache = FeatureCache(out)
    for sid, row in table.items():
        assert torch.equal(torch.tensor(row["embedding"]), cache[sid]["embedding"])
    lance = pytest.importorskip("lance")
    export(out, tmp_path / "t.lance")
    ds = lance.dataset(str(tmp_path / "t.lance"))
    for sid in table:
        hit = ds.to_table(nearest={"column": "embedding", "q": cache[sid]["embedding"].numpy(), "k": 1})
        assert hit.column("id").to_pylist() == [sid]


def test_padded_packing_sorts_within_a_window_and_bounds_the_padding():
    """For the whole VLM (rows padded to the longest): each item exactly once, each batch within the budget
    as padded (rows x longest) and within the sample cap, no row padded by more than a quarter of its
    batch's shortest, and order changes only within a window."""
    import random

    from vlfast.extraction.model.batching import TokenBudget, pack_padded

    rng = random.Random(0)
    lengths = [rng.choice([40, 41, 90, 300, 310, 1200, 5000]) + rng.randrange(8) for _ in range(500)]
    budget = TokenBudget(max_tokens=4096, max_samples=16)
    batches = list(pack_padded(range(len(lengths)), lengths.__getitem__, budget, window=64))
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        longest, shortest = max(lengths[i] for i in b), min(lengths[i] for i in b)
        assert len(b) == 1 or (len(b) * longest <= budget.max_tokens and len(b) <= budget.max_samples)
        assert longest <= 1.25 * shortest or len(b) == 1
    for b in batches:  # windows of 64: a batch holds items of one window only
        assert {i // 64 for i in b} == {min(b) // 64}
    first = next(pack_padded([7, 3], int, budget, first_alone=True))
    assert first == [7]
