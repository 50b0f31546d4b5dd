"""End to end through the real loading path (tiny offline Qwen3-VL checkpoint): features, batching,
bad inputs, resume, refusal of a changed configuration, --max-errors, OOM split-and-retry, ranks."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from vlfast.extraction import FeatureCache, RunConfigMismatch
from vlfast.extraction.api import extract
from vlfast.extraction.engines.base import Hooks
from vlfast.extraction.engines.local import LocalEngine
from vlfast.extraction.model.batching import TokenBudget, is_oom, pack, run_split_on_oom
from vlfast.extraction.sources import Sample, load_inputs
from vlfast.pixels.engine import Preprocessor, build_processor_config


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


@pytest.fixture(scope="module")
def good_dir(media_dir, tmp_path_factory):
    """Just the good media, in their own folder."""
    dst = tmp_path_factory.mktemp("good") / "in"
    shutil.copytree(media_dir / "good", dst)
    return dst


@pytest.fixture(scope="module")
def full_run(media_dir, tiny_qwen3_vl, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "out"
    summary = extract(
        media_dir,
        out,
        model=str(tiny_qwen3_vl),
        features="vision,vision_mean,deepstack",
        num_workers=1,
        max_batch_tokens=2048,
    )
    return summary, out


def test_every_input_is_extracted_or_recorded(full_run, media_dir):
    summary, out = full_run
    expected = json.loads((media_dir / "expected.json").read_text())
    cache = FeatureCache(out)
    assert sorted(cache.ids()) == expected["good"]
    errors = {e["id"]: e["reason"] for e in cache.errors()}
    assert sorted(errors) == expected["bad"]
    assert "empty file" in errors["bad/zero.jpg"] and "aspect ratio" in errors["bad/wide250.png"]
    assert summary.extracted == len(expected["good"]) and summary.failed == len(expected["bad"])
    assert summary.total == len(expected["good"]) + len(expected["bad"])
    assert sum(summary.errors.values()) == summary.failed


def test_features_match_the_naive_loop(full_run, media_dir, tiny_qwen3_vl):
    """Per sample: processor + tower alone, no batching; the pipeline's packed batches change nothing."""
    from vlfast.models import load_vision_tower, tower_outputs

    _, out = full_run
    cache = FeatureCache(out)
    cfg = build_processor_config(str(tiny_qwen3_vl), family="qwen3_vl")
    pre = Preprocessor(cfg, image_processor_dir=str(tiny_qwen3_vl))
    tower = load_vision_tower(str(tiny_qwen3_vl), dtype=torch.float32)
    for s in load_inputs(media_dir / "good")[0]:
        pixels, grid, _ = pre(s)
        with torch.inference_mode():
            ref = tower_outputs(tower(pixels, grid_thw=torch.tensor([grid])))
        got = cache["good/" + s.id]
        assert got["grid_thw"].tolist() == [list(grid)]
        t, h, w = grid
        assert got["vision"].shape == (t * h * w // 4, 64)
        assert _cos(got["vision"], ref["merged"]) >= 0.999999, s.id
        torch.testing.assert_close(got["vision"], ref["merged"], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got["vision_mean"], ref["merged"].mean(0), rtol=1e-4, atol=1e-5)
        for k, level in enumerate(ref["deepstack"]):
            torch.testing.assert_close(got[f"deepstack.{k}"], level, rtol=1e-4, atol=1e-5)
        # tokens go back to (t, h/2, w/2, D) with the stored grid
        assert got["vision"].reshape(t, h // 2, w // 2, -1).shape[-1] == 64


def test_run_metadata_records_processor_and_versions(full_run):
    _, out = full_run
    run = json.loads((out / "run.json").read_text())
    cfg = run.get("config", run)
    assert cfg["processor"]["frame_sampling"] == "qwen3-vl"
    assert cfg["processor"]["image_mean"] == [0.5, 0.5, 0.5]
    assert "video_preprocessor_config.json" in cfg["processor"]["source"]
    assert cfg["dtype"] == "float32" and cfg["versions"]["transformers"]
    assert cfg["features"]["names"] == ["vision", "vision_mean", "deepstack"]


def test_resume_skips_and_changed_config_is_refused(full_run, media_dir, tiny_qwen3_vl):
    summary, out = full_run
    again = extract(
        media_dir, out, model=str(tiny_qwen3_vl), features="vision,vision_mean,deepstack", num_workers=0
    )
    assert again.extracted == 0 and again.failed == 0 and again.skipped == summary.total
    with pytest.raises(RunConfigMismatch):
        extract(media_dir, out, model=str(tiny_qwen3_vl), features="vision", num_workers=0)
    with pytest.raises(RunConfigMismatch):
        extract(
            media_dir,
            out,
            model=str(tiny_qwen3_vl),
            features="vision,vision_mean,deepstack",
            fps=1.0,
            num_workers=0,
        )


def test_llm_features_batched_equal_single(good_dir, tiny_qwen3_vl, tmp_path):
    samples = [s for s in load_inputs(good_dir)[0] if s.id in ("rgb.jpg", "clip.mp4", "gray.png", "odd.mp4")]
    samples[0] = Sample(samples[0].id, samples[0].kind, samples[0].paths, "What colour dominates?")
    kw = dict(
        model=str(tiny_qwen3_vl),
        features="vision_mean,llm",
        layers=(-1, 1),
        pools=("last", "mean"),
        num_workers=0,
    )
    batched = extract(samples, tmp_path / "b", max_batch_samples=8, **kw)
    single = extract(samples, tmp_path / "s", max_batch_samples=1, **kw)
    assert batched.extracted == single.extracted == 4
    b, s = FeatureCache(tmp_path / "b"), FeatureCache(tmp_path / "s")
    for sample in samples:
        fb, fs = b[sample.id], s[sample.id]
        assert set(fb) == {
            "vision_mean",
            "llm.last.layer2",
            "llm.mean.layer2",
            "llm.last.layer1",
            "llm.mean.layer1",
        }
        for name in fb:
            assert fb[name].shape == (64,)
            torch.testing.assert_close(fb[name], fs[name], rtol=1e-4, atol=1e-4, msg=f"{sample.id} {name}")
    assert b.meta(samples[0].id)["prompt"] == "What colour dominates?"
    assert b.meta("gray.png")["prompt"] == "Describe this image."
    assert b.meta("odd.mp4")["prompt"] == "Describe this video."


def test_llm_needs_a_checkpoint(good_dir, tmp_path):
    with pytest.raises(ValueError, match="llm features need a local checkpoint"):
        extract(good_dir, tmp_path / "o", model="ref:qwen3-vl-2b", features="llm", num_workers=0)


def test_max_errors_stops_and_keeps_committed(media_dir, tiny_qwen3_vl, tmp_path):
    bad_first = [Sample(f"bad{k}", "image", (str(media_dir / "bad/zero.jpg"),)) for k in range(4)]
    good = [Sample("good", "image", (str(media_dir / "good/rgb.jpg"),))]
    s = extract(
        good + bad_first + good[:0],
        tmp_path / "o",
        model=str(tiny_qwen3_vl),
        max_errors=1,
        num_workers=0,
        max_batch_samples=1,
    )
    assert s.stopped and "max-errors" in s.stopped
    assert s.failed == 2 and s.extracted == 1
    assert len(FeatureCache(tmp_path / "o")) == 1


def test_duplicate_ids_are_recorded_first_kept(media_dir, tiny_qwen3_vl, tmp_path):
    rows = [
        {"id": "x", "path": str(media_dir / "good/rgb.jpg")},
        {"id": "x", "path": str(media_dir / "good/gray.png")},
        {"id": "y", "path": str(media_dir / "good/gray.png")},
    ]
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("\n".join(json.dumps(r) for r in rows))
    s = extract(manifest, tmp_path / "o", model=str(tiny_qwen3_vl), num_workers=0)
    cache = FeatureCache(tmp_path / "o")
    assert len(cache) == 2 and cache.meta("x")["path"].endswith("rgb.jpg")
    dup = [e for e in cache.errors() if e["id"] == "x"]
    assert len(dup) == 1 and "duplicate" in dup[0]["reason"] and dup[0]["source"].endswith("gray.png")
    assert s.failed == 1


def test_oom_batches_are_split_and_retried(good_dir, tiny_qwen3_vl, tmp_path):
    seen = []

    def fake_oom(batch):
        seen.append(len(batch))
        if len(batch) > 1:
            raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB")
        if batch[0].kind == "video" and batch[0].grid[0] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (fake)")

    s = extract(
        good_dir,
        tmp_path / "o",
        model=str(tiny_qwen3_vl),
        num_workers=0,
        max_batch_samples=4,
        engine=LocalEngine(Hooks(forward=fake_oom)),
    )
    cache = FeatureCache(tmp_path / "o")
    errs = {e["id"]: e["reason"] for e in cache.errors()}
    assert all("out of memory even alone" in r for r in errs.values())
    assert set(errs) == {"clip.mp4", "odd.mp4"}  # videos with t > 1 fail even alone
    assert s.oom_splits > 0 and max(seen) > 1
    assert len(cache) == s.extracted == len(list(good_dir.iterdir())) - 2


def test_ranks_split_the_work(good_dir, tiny_qwen3_vl, tmp_path):
    a = extract(good_dir, tmp_path / "o", model=str(tiny_qwen3_vl), num_workers=0, rank=0, world_size=2)
    b = extract(good_dir, tmp_path / "o", model=str(tiny_qwen3_vl), num_workers=0, rank=1, world_size=2)
    n = len(list(good_dir.iterdir()))
    assert (
        a.assigned + b.assigned == n and a.extracted + b.extracted == n and min(a.extracted, b.extracted) > 0
    )
    assert len(FeatureCache(tmp_path / "o")) == n


def test_pack_and_oom_helpers():
    budget = TokenBudget(max_tokens=10, max_samples=3)
    assert list(pack([4, 4, 4, 20, 1, 1, 1, 1], int, budget)) == [[4, 4], [4], [20], [1, 1, 1], [1]]
    assert list(pack([4, 4, 4, 1], int, budget, first_alone=True)) == [[4], [4, 4, 1]]
    assert is_oom(RuntimeError("CUDA out of memory. Tried")) and is_oom(torch.OutOfMemoryError("x"))
    assert not is_oom(RuntimeError("shape mismatch"))
    calls = []

    def fn(batch):
        calls.append(list(batch))
        if 3 in batch:
            raise RuntimeError("MPS backend out of memory")
        return [x * 2 for x in batch]

    out = run_split_on_oom([1, 2, 3, 4], fn)
    assert out[0] == 2 and out[1] == 4 and out[3] == 8 and out[2].item == 3
    with pytest.raises(ValueError):
        run_split_on_oom([1], lambda b: (_ for _ in ()).throw(ValueError("not oom")))
    with pytest.raises(ValueError):
        TokenBudget(max_tokens=0)


def test_deepstack_mergers_run_only_when_asked(tiny_qwen3_vl):
    """Without `deepstack` among the features the tower skips its DeepStack mergers (~6% of a 2B tower's
    forward); the merged tokens stay bit-identical, and the tower is left as it was, even on an error."""
    from vlfast.extraction.model.features import VisionBatch, compute_vision_features, deepstack_skipped
    from vlfast.models import load_vision_tower, tower_outputs

    tower = load_vision_tower(str(tiny_qwen3_vl), dtype=torch.float32).eval()
    depths = list(tower.deepstack_visual_indexes)
    assert depths, "the tiny checkpoint must have DeepStack levels for this test to mean anything"
    calls = []
    for merger in tower.deepstack_merger_list:
        merger.register_forward_hook(lambda *_: calls.append(1))
    torch.manual_seed(0)
    grid = torch.tensor([[1, 4, 6], [2, 4, 4]])
    pixels = torch.randn(int(grid.prod(-1).sum()), tower.patch_embed.proj.weight[0].numel())
    tokens = [int(g.prod()) // 4 for g in grid]
    batch = VisionBatch(pixel_values=pixels, grid_thw=grid, tokens=tokens)
    with torch.inference_mode():
        full = tower_outputs(tower(pixels, grid_thw=grid))
    assert len(calls) == len(depths) and len(full["deepstack"]) == len(depths)

    calls.clear()
    got = compute_vision_features(tower, batch, ("vision", "vision_mean"))
    assert calls == [] and tower.deepstack_visual_indexes == depths
    assert torch.equal(torch.cat([f["vision"] for f in got]), full["merged"])

    got = compute_vision_features(tower, batch, ("vision", "deepstack"))
    assert len(calls) == len(depths)
    for k, level in enumerate(full["deepstack"]):
        assert torch.equal(torch.cat([f[f"deepstack.{k}"] for f in got]), level)

    with pytest.raises(RuntimeError, match="boom"), deepstack_skipped(tower):
        raise RuntimeError("boom")
    assert tower.deepstack_visual_indexes == depths
    plain = torch.nn.Linear(2, 2)  # no DeepStack: runs unchanged
    with deepstack_skipped(plain):
        plain(torch.ones(1, 2))
    assert not hasattr(plain, "deepstack_visual_indexes")


def test_device_decisions_on_fabricated_facts(monkeypatch):
    """The CUDA choices, taken on CPU with fabricated facts (no GPU here): worker count, batch budget,
    device per LOCAL_RANK, dtype, and the pinned, non-blocking copy with normalisation after it."""
    import os

    from vlfast.extraction import config as pl
    from vlfast.extraction.model import runner

    for cores, cpu, gpu in ((1, 0, 0), (2, 2, 1), (16, 8, 8), (9, 8, 8)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _, n=cores: set(range(n)), raising=False)
        assert (pl.default_num_workers("cpu"), pl.default_num_workers("cuda:0")) == (cpu, gpu), cores
    assert pl.default_batch_tokens("cuda:1") == 32_768 and pl.default_batch_tokens("cpu") == 4_096
    assert pl.resolve_dtype(None, torch.device("cuda")) == torch.bfloat16
    assert pl.resolve_dtype(None, torch.device("cpu")) == torch.float32
    with pytest.raises(ValueError, match="dtype must be"):
        pl.resolve_dtype("int8", torch.device("cpu"))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "5")  # more local ranks than GPUs: ranks wrap around the devices
    assert pl.default_device() == torch.device("cuda", 1)

    calls = []
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: False)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a: calls.append("pin") or self)
    real_to = torch.Tensor.to

    def fake_to(self, *args, **kwargs):
        if args and isinstance(args[0], torch.device) and args[0].type == "cuda":
            calls.append(("to", str(args[0]), kwargs.get("non_blocking")))
            return self  # stays on CPU: only the decision is under test
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", fake_to)
    cfg = build_processor_config("ref:qwen3-vl-2b", family="qwen3_vl")
    video = torch.randint(0, 256, (4, 3, 2 * 16 * 16), dtype=torch.uint8)
    out = runner.pixels_to(video, torch.device("cuda", 0), cfg)
    assert calls == ["pin", ("to", "cuda:0", True)]  # pinned first, then an asynchronous copy
    assert out.dtype == torch.float32 and out.shape == (4, 3 * 2 * 16 * 16)  # normalised after the copy
    calls.clear()
    image = torch.randn(4, 1536)
    assert runner.pixels_to(image, torch.device("cpu"), cfg) is image and calls == []  # nothing to pin on CPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_batchs_pixels_are_normalised_into_one_tensor_without_a_concatenation(monkeypatch, dtype):
    """runner.batch_pixels gives the tower what torch.cat of each sample's float32 pixels, then .to(dtype),
    gives, bit for bit: deferred image patches (each held once: the temporal repeat), video patches, float32
    rows the workers normalised, and a batch of one (the CPU's case); torch.cat never runs, no float32 copy
    of the whole is made for another dtype, and widths that disagree are refused."""
    from vlfast.extraction.model import runner

    cfg = build_processor_config("ref:qwen3-vl-2b", family="qwen3_vl")
    gen = torch.Generator().manual_seed(3)
    image = torch.randint(0, 256, (12, 3, 16 * 16), dtype=torch.uint8, generator=gen)
    video = torch.randint(0, 256, (8, 3, 2 * 16 * 16), dtype=torch.uint8, generator=gen)
    done = torch.randn(4, 3 * 2 * 16 * 16, generator=gen)
    cpu = torch.device("cpu")
    for batch in ([image, video, done], [image], [video], [done, image]):
        want = torch.cat([runner.pixels_to(x, cpu, cfg) for x in batch]).to(dtype)
        with monkeypatch.context() as mp:
            mp.setattr(torch, "cat", lambda *a, **k: pytest.fail("torch.cat ran"))
            got = runner.batch_pixels(batch, cpu, dtype, cfg)
        assert got.dtype == dtype and got.shape == want.shape and torch.equal(got, want)
    with pytest.raises(ValueError, match="different widths"):
        runner.batch_pixels([image, torch.randn(2, 100)], cpu, dtype, cfg)
    from vlfast.pixels.video import normalize_patches

    with pytest.raises(ValueError, match="out must be a contiguous floating tensor of shape"):
        normalize_patches(video, cfg, out=torch.empty(8, 1536, dtype=torch.int32))
    with pytest.raises(ValueError, match="out must be"):
        normalize_patches(video, cfg, out=torch.empty(1536, 8).t())


@pytest.mark.parametrize(
    "oom",
    [
        lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        lambda: RuntimeError("CUDA out of memory."),
    ],
    ids=["OutOfMemoryError", "RuntimeError"],
)
def test_oom_retry_runs_after_the_failed_attempt_is_freed(oom):
    """The halves run with the failed attempt's tensors freed: its exception (whose traceback holds the
    forward's frames and their activations) is not kept, only its message."""
    import weakref

    attempts: list[list[weakref.ref]] = []
    alive_at_retry: list[int] = []

    def forward(batch):
        # Each attempt finds every earlier attempt's activations gone.
        alive_at_retry.append(sum(r() is not None for refs in attempts for r in refs))
        activations = [torch.ones(256, 256) * x for x in batch]  # real allocations the frame holds
        attempts.append([weakref.ref(t) for t in activations])
        if len(batch) > 1 or batch[0] == 3:
            raise oom()  # a fresh error each time, as the allocator raises
        return [float(a[0, 0]) for a in activations]

    out = run_split_on_oom([1, 2, 3, 4], forward)
    assert out[0] == 1.0 and out[1] == 2.0 and out[3] == 4.0
    assert out[2].item == 3 and out[2].error == str(oom()) and isinstance(out[2].error, str)
    assert len(attempts) == 7  # [1,2,3,4] -> [1,2] [3,4] -> [1] [2] [3] [4]
    assert alive_at_retry == [0] * 7
