"""Round six (issue 54): thin images sized by each reference's own rule, the VLFAST_PREPROCESS switch's promise
as a property, ambiguous arrays read as transformers reads them, and what transformers refuses refused.

transformers' ``smart_resize`` (its Qwen2-VL image processor) rounds a thin side to 0 patches and then scales
the image up to the minimum budget; qwen-vl-utils' raises that side to one merged patch first. vlfast follows
the first for the processor backends (VisionPreprocessor, the switch, ``vlfast extract`` on a checkpoint) and
the second where the embedding recipe follows qwen-vl-utils, and records which in run.json (``thin_images``).
The grids are compared here with transformers' own classes; the switch's full output (pixel_values, grids,
input_ids) in a child process with transformers' real torchvision backend (tests/_transformers_reference.py).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
import _transformers_reference as reference  # noqa: E402
from vlfast import VisionPreprocessor  # noqa: E402
from vlfast.errors import InputRefused  # noqa: E402
from vlfast.pixels.media import SampleError  # noqa: E402

# Qwen3-VL's budgets (the demo checkpoint's files) and Qwen2.5-VL's minimum (3,136 pixels) with its maximum
QWEN3 = {}
QWEN25 = {"min_pixels": 3136, "max_pixels": 12_845_056}
# The cases: (height, width) -> grid by transformers at each family's budgets (factor 32)
THIN = [(12, 2400), (15, 3000), (16, 3200), (2400, 12), (1, 200), (8, 1000), (10, 2000)]


def _sizes():
    """(height, width): a thin side (1-40 pixels) against a long one within the 200:1 limit, either way up,
    or any size up to 700 a side."""
    thin = st.integers(1, 40).flatmap(lambda s: st.tuples(st.just(s), st.integers(s, min(200 * s, 3200))))
    thin = st.one_of(thin, thin.map(lambda hw: (hw[1], hw[0])))
    return st.one_of(thin, st.tuples(st.integers(1, 700), st.integers(1, 700))).filter(
        lambda hw: max(hw) / min(hw) <= 200
    )


def _pil_processor(ckpt, budgets):
    """transformers' own Qwen2VLImageProcessorPil of the checkpoint with ``budgets`` (no torchvision needed: its
    sizes are its torchvision processor's, from the same smart_resize)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    ip = Qwen2VLImageProcessorPil.from_pretrained(str(ckpt))
    if budgets:
        ip.size = {"shortest_edge": budgets["min_pixels"], "longest_edge": budgets["max_pixels"]}
    return ip


@pytest.mark.parametrize(
    "budgets", [QWEN3, QWEN25, "ref:qwen2.5-vl-7b"], ids=["qwen3-vl", "qwen2.5-vl-budgets", "qwen2.5-vl"]
)
def test_thin_images_get_transformers_grid(tiny_qwen3_vl, budgets):
    """The issue's cases, then a property over sizes: VisionPreprocessor's grid is transformers' own
    processor's, thin and extreme aspect included: the demo checkpoint with Qwen3-VL's and Qwen2.5-VL's
    budgets, and Qwen2.5-VL's published numbers (patch 14, so a side of 14 pixels or less is thin)."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if isinstance(budgets, str):
        pre = VisionPreprocessor(budgets)
        cfg = pre.config
        ip = Qwen2VLImageProcessorPil(
            patch_size=cfg.patch_size,
            size={"shortest_edge": cfg.image_min_pixels, "longest_edge": cfg.image_max_pixels},
        )
    else:
        pre = VisionPreprocessor(str(tiny_qwen3_vl), **budgets)
        ip = _pil_processor(tiny_qwen3_vl, budgets)

    def check(h, w):
        img = Image.new("RGB", (w, h), (90, 20, 200))
        want = ip(images=[img], return_tensors="pt")["image_grid_thw"]
        got = pre(images=[img])["image_grid_thw"]
        assert got.tolist() == want.tolist(), (h, w)

    for h, w in THIN:
        check(h, w)

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(_sizes())
    def prop(hw):
        check(*hw)

    prop()
    assert pre.config.thin_images == "processor"


def test_the_embedding_recipe_keeps_qwen_vl_utils_rule():
    """qwen-vl-utils' own smart_resize (installed; its source read, since it imports torchvision) is the
    recipe's rule: vlfast's with thin="qwen-vl-utils" equals it, and the recipe names that rule."""
    import importlib.util

    from vlfast.pixels.recipe import RECIPE_PIXELS
    from vlfast.pixels.video import smart_resize

    assert RECIPE_PIXELS["thin_images"] == "qwen-vl-utils"
    spec = importlib.util.find_spec("qwen_vl_utils")
    if spec is None:
        pytest.skip("qwen-vl-utils is not installed")
    src = Path(spec.submodule_search_locations[0], "vision_process.py").read_text()
    ns: dict = {}
    start = src.index("def round_by_factor")
    end = src.index("def to_rgb")
    exec("import math\nfrom typing import Optional, Tuple\nMAX_RATIO = 200\n" + src[start:end], ns)  # noqa: S102
    lo, hi = RECIPE_PIXELS["image_min_pixels"], RECIPE_PIXELS["image_max_pixels"]
    for h, w in [*THIN, (3, 5), (40, 40), (700, 31), (1080, 1920)]:
        assert smart_resize(h, w, 32, lo, hi, "qwen-vl-utils") == ns["smart_resize"](h, w, 32, lo, hi), (h, w)


def test_run_json_records_the_thin_image_rule(tiny_qwen3_vl):
    """A checkpoint's OUT records thin_images "processor"; an OUT made with qwen-vl-utils' rule records it
    and resumes with it."""
    from vlfast.extraction.plan import recorded_setting
    from vlfast.pixels.engine import build_processor_config

    cfg = build_processor_config(str(tiny_qwen3_vl), family="qwen3_vl")
    assert cfg.thin_images == "processor"
    assert cfg.to_dict()["thin_images"] == "processor"
    old = {**cfg.to_dict(), "thin_images": "qwen-vl-utils"}
    rule = recorded_setting({"processor": old}, "thin_images")
    assert rule == "qwen-vl-utils"
    resumed = build_processor_config(str(tiny_qwen3_vl), family="qwen3_vl", thin_images=rule)
    assert resumed.to_dict() == old
    assert recorded_setting(None, "thin_images") is None
    with pytest.raises(InputRefused, match="thin_images"):
        type(cfg)(**{**cfg.__dict__, "thin_images": "pillow"})


def test_the_embedding_recipe_records_its_rule(tiny_qwen3_vl, tmp_path):
    """The recipe sizes thin images by qwen-vl-utils' rule where vlfast resizes them (its torchvision path);
    where transformers' PIL processor runs them, by that processor's; run.json says which."""
    import shutil

    from vlfast.pixels.engine import build_processor_config
    from vlfast.pixels.video import smart_resize

    emb = tmp_path / "emb"
    shutil.copytree(tiny_qwen3_vl, emb)
    config = json.loads((emb / "config.json").read_text())
    (emb / "config.json").write_text(json.dumps(config | {"architectures": ["Qwen3VLForEmbedding"]}))
    vlfast_path = build_processor_config(str(emb), family="qwen3_vl", image_processor="Qwen2VLImageProcessor")
    assert vlfast_path.thin_images == "qwen-vl-utils"
    assert vlfast_path.to_dict().get("thin_images", "qwen-vl-utils") == "qwen-vl-utils"
    pil = build_processor_config(str(emb), family="qwen3_vl", image_processor="Qwen2VLImageProcessorPil")
    assert pil.thin_images == "processor" and pil.to_dict()["thin_images"] == "processor"
    lo, hi = vlfast_path.image_min_pixels, vlfast_path.image_max_pixels
    # at the recipe's budgets 12x2400 is 1 x 75 merged patches by qwen-vl-utils; transformers rounds its
    # height to 0 and scales it up to the 4,096-pixel minimum: 1 x 29
    assert smart_resize(12, 2400, 32, lo, hi, "qwen-vl-utils") == (32, 2400)
    assert smart_resize(12, 2400, 32, lo, hi, "processor") == (32, 928)


@pytest.mark.parametrize(
    "option, value",
    [
        ("fps", math.inf),
        ("fps", math.nan),
        ("fps", -math.inf),
        ("min_pixels", math.nan),
        ("max_pixels", math.nan),
        ("max_pixels", math.inf),
        ("video_max_pixels", math.nan),
        ("video_max_pixels", math.inf),
        ("num_frames", 2.5),
        ("num_frames", math.inf),
        ("min_pixels", 1000.5),
    ],
)
def test_numbers_that_are_not_settings_are_refused_at_construction(tiny_qwen3_vl, option, value):
    with pytest.raises(InputRefused, match=option):
        VisionPreprocessor(str(tiny_qwen3_vl), **{option: value})


def test_every_float_setting_of_the_config_is_checked(tiny_qwen3_vl):
    pre = VisionPreprocessor(str(tiny_qwen3_vl))
    cfg = pre.config
    for name, bad in [
        ("fps", math.inf),
        ("fps", math.nan),
        ("frames_list_fps", math.nan),
        ("frames_list_fps", 0.0),
        ("rescale_factor", math.nan),
        ("video_rescale_factor", math.inf),
        ("image_mean", (0.5, math.nan, 0.5)),
        ("image_std", (0.5, 0.5, math.inf)),
        ("video_mean", (math.nan, 0.5, 0.5)),
        ("video_std", (0.5, math.nan, 0.5)),
        ("image_max_pixels", math.nan),
        ("video_min_pixels", 1.5),
    ]:
        with pytest.raises(InputRefused, match=name):
            type(cfg)(**{**cfg.__dict__, name: bad})


def test_ambiguous_arrays_are_read_as_transformers_reads_them(tiny_qwen3_vl):
    """(3, W, 3), (1, W, 3), (3, W, 1): transformers takes the first axis for channels (its
    infer_channel_dimension_format); so does vlfast, giving transformers' grid."""
    ip = _pil_processor(tiny_qwen3_vl, {})
    pre = VisionPreprocessor(str(tiny_qwen3_vl))
    rng = np.random.default_rng(3)
    for shape in [(3, 40, 3), (1, 40, 3), (3, 40, 1), (3, 300, 3), (1, 64, 1)]:
        arr = rng.integers(0, 256, shape, dtype=np.uint8)
        want = ip(images=[arr], return_tensors="pt")["image_grid_thw"]
        got = pre(images=[arr])["image_grid_thw"]
        assert got.tolist() == want.tolist(), shape
        got = pre(images=[torch.from_numpy(arr)])["image_grid_thw"]
        assert got.tolist() == want.tolist(), shape


def test_as_image_processor_refuses_what_is_not_a_qwen_vl_image_processor(tiny_qwen3_vl):
    from transformers import AutoTokenizer

    pre = VisionPreprocessor(str(tiny_qwen3_vl))
    tok = AutoTokenizer.from_pretrained(str(tiny_qwen3_vl))
    with pytest.raises(InputRefused, match=type(tok).__name__):
        pre.as_image_processor(tok)
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    video = Qwen3VLVideoProcessor.__new__(Qwen3VLVideoProcessor)
    with pytest.raises(InputRefused, match="Qwen3VLVideoProcessor"):
        pre.as_image_processor(video)
    for thing in ("hello", 3, object()):
        with pytest.raises(InputRefused, match=type(thing).__name__):
            pre.as_image_processor(thing)
    with pytest.raises(InputRefused, match="finish"):
        pre.finish([1, 2])
    with pytest.raises(InputRefused, match="finish"):
        pre.finish({"pixel_values": [1, 2]})


def test_what_transformers_refuses_vlfast_refuses(tiny_qwen3_vl, tmp_path):
    """A one-frame video: Qwen3VLVideoProcessor raises "t:1 must be larger than temporal_factor:2"; so does
    VisionPreprocessor, with that reason."""
    from vlfast.demo import make_video

    one = make_video(tmp_path / "one.mp4", frames=1, fps=5, width=64, height=64)
    pre = VisionPreprocessor(str(tiny_qwen3_vl))
    with pytest.raises(SampleError, match="t:1 must be larger than temporal_factor:2"):
        pre(videos=[str(one)])
    two = make_video(tmp_path / "two.mp4", frames=4, fps=5, width=64, height=64)
    assert pre(videos=[str(two)])["video_grid_thw"].tolist()[0][0] >= 1


# The switch's promise, as a property, in a process with transformers' torchvision backend: for each way of
# loading the processor, any image (sizes drawn: thin, extreme aspect, ordinary; PIL images and ambiguous
# uint8 arrays) gives the switched processor's full output equal to the stock processor's, or the same error
SWITCH_CHILD = r"""
import json, os, sys
sys.path.insert(0, TESTS)
import _transformers_reference as r
r._import_torchvision()
import numpy as np, torch
from PIL import Image
from hypothesis import HealthCheck, given, settings, strategies as st
from transformers import AutoProcessor
from transformers.processing_utils import ProcessorMixin
from vlfast.switches.record import record_calls
import test_round6_pixels as t

stock_from_pretrained = ProcessorMixin.__dict__["from_pretrained"].__func__.__wrapped__
prompt = "<|vision_start|><|image_pad|><|vision_end|>describe"
QWEN25 = dict(min_pixels=3136, max_pixels=12_845_056)
loads = {
    "checkpoint": (CKPT, {}),
    "min_max_pixels": (CKPT, QWEN25),
    "size": (CKPT, {"size": {"shortest_edge": 3136, "longest_edge": 12_845_056}}),
    "older_keys": (OLD, {}),
}
out = {"mismatches": [], "classes": {}, "answered": {}, "stock": {}}

def outcome(proc, image, call):
    try:
        got = proc(text=[prompt], images=[image], return_tensors="pt", **call)
    except Exception as e:
        return type(e).__name__
    return {k: got[k] for k in ("pixel_values", "image_grid_thw", "input_ids")}

def same(a, b):
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return all(torch.equal(a[k], b[k]) for k in a)

for name, (path, kwargs) in loads.items():
    switched = AutoProcessor.from_pretrained(path, **kwargs)
    stock = stock_from_pretrained(type(switched), path, **kwargs)
    out["classes"][name] = [type(switched.image_processor).__name__, type(stock.image_processor).__name__]

    def check(image, what, call={}):
        a, b = outcome(switched, image, call), outcome(stock, image, call)
        if not same(a, b):
            grid = lambda o: o if isinstance(o, str) else [o["image_grid_thw"].tolist(), o["input_ids"].shape[-1]]
            out["mismatches"].append([name, what, grid(a), grid(b)])

    with record_calls() as rec:
        for h, w in t.THIN:
            check(Image.fromarray(np.full((h, w, 3), 77, np.uint8)), f"{h}x{w}")
        for shape in [(3, 40, 3), (1, 40, 3), (3, 40, 1)]:
            arr = np.random.default_rng(1).integers(0, 256, shape, dtype=np.uint8)
            check(arr, f"array {shape}")
            check(torch.from_numpy(arr), f"tensor {shape}")
            for layout in ("channels_first", "channels_last"):
                check(arr, f"array {shape} {layout}", {"input_data_format": layout})

        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        @given(t._sizes(), st.integers(0, 2**31 - 1), st.sampled_from(["pil", "hwc", "chw", "tensor", "gray"]))
        def prop(hw, seed, kind):
            h, w = hw
            pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
            image = {
                "pil": lambda: Image.fromarray(pixels),
                "hwc": lambda: pixels,
                "chw": lambda: np.ascontiguousarray(pixels.transpose(2, 0, 1)),
                "tensor": lambda: torch.from_numpy(pixels).permute(2, 0, 1),
                "gray": lambda: pixels[..., 0],
            }[kind]()
            check(image, f"{kind} {h}x{w}")

        prop()
    answered, stock_calls = rec.image_processor_calls()
    out["answered"][name] = answered
    out["stock"][name] = stock_calls

# A vlfast that sized thin images by qwen-vl-utils' rule (the commit before this test): the proof at load
# time catches it on its thin probe, and the processor stays stock
import vlfast.pixels.image as vimage
right = vimage.smart_resize
vimage.smart_resize = lambda h, w, f, lo, hi, thin=None: right(h, w, f, lo, hi, "qwen-vl-utils")
out["other_rule_class"] = type(AutoProcessor.from_pretrained(CKPT).image_processor).__name__
vimage.smart_resize = right
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def switch_property(tiny_qwen3_vl, tmp_path_factory):
    why = reference.unavailable()
    if why:
        pytest.skip(why)
    import shutil

    old = tmp_path_factory.mktemp("older-keys") / "ckpt"
    shutil.copytree(tiny_qwen3_vl, old)
    cfg = json.loads((old / "preprocessor_config.json").read_text())
    del cfg["size"]  # transformers 4's layout: the budgets as min_pixels / max_pixels keys
    cfg.update(min_pixels=3136, max_pixels=12_845_056)
    (old / "preprocessor_config.json").write_text(json.dumps(cfg))
    code = (
        f"TESTS = {str(Path(__file__).parent)!r}\nCKPT = {str(tiny_qwen3_vl)!r}\nOLD = {str(old)!r}\n"
        f"EXAMPLES = 40\n" + SWITCH_CHILD
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLFAST_")}
    env.update(TRANSFORMERS_VERBOSITY="error", VLFAST_PREPROCESS="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    line = next(x for x in res.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT ")), res.stderr


def test_the_switch_gives_the_stock_output_for_any_image(switch_property):
    """Thin and extreme-aspect images, ambiguous arrays, at Qwen3-VL's and Qwen2.5-VL's budgets, loaded with
    from_pretrained(ckpt), (ckpt, min_pixels=, max_pixels=), (ckpt, size=) and from a checkpoint with the
    older min_pixels/max_pixels keys: pixel_values, image_grid_thw and input_ids equal the stock processor's."""
    out, stderr = switch_property
    for name, (switched, stock) in out["classes"].items():
        assert switched == "VlfastQwen2VLImageProcessor", (name, stderr[-2000:])
        assert stock == "Qwen2VLImageProcessor", name
    assert out["mismatches"] == []
    for name, answered in out["answered"].items():
        # the promise is not kept by handing everything to transformers: vlfast answers the images it takes
        assert answered >= 40, (name, out["stock"][name])


def test_a_vlfast_with_another_thin_rule_is_not_swapped_in(switch_property):
    """The proof at load time has a thin probe image: a vlfast sizing thin images by qwen-vl-utils' rule
    would give another grid, so the switch leaves transformers' image processor in place and says why."""
    out, stderr = switch_property
    assert out["other_rule_class"] == "Qwen2VLImageProcessor"
    said = [x for x in stderr.splitlines() if "keeps transformers' image processor" in x]
    assert any("12 probe image" in x and "grid" in x for x in said), said


def test_extract_follows_and_records_the_processors_rule(tiny_qwen3_vl, tmp_path):
    """``vlfast extract`` on a checkpoint sizes a thin image as transformers' processor does and records the
    rule in run.json; an OUT made with qwen-vl-utils' rule (recorded) resumes with it, as it was made, also
    for the samples it adds."""
    import warnings

    from PIL import Image

    import vlfast
    from vlfast.extraction import plan

    def extract(out):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return vlfast.extract(str(tmp_path / "in"), str(out), model=str(tiny_qwen3_vl), num_workers=0)

    def grids(out):
        cache = vlfast.FeatureCache(str(out))
        return {i: cache[i]["grid_thw"].tolist()[0] for i in cache.ids()}

    (tmp_path / "in").mkdir()
    Image.new("RGB", (2400, 12), (10, 200, 30)).save(tmp_path / "in" / "a.png")
    new = tmp_path / "new"
    extract(new)
    run = json.loads((new / "run.json").read_text())
    assert run["config"]["processor"]["thin_images"] == "processor"
    assert list(grids(new).values()) == [[1, 2, 228]]  # transformers' grid (the issue's case)

    # an OUT made with qwen-vl-utils' rule, as the recipe's are
    old = tmp_path / "old"
    recorded = plan.recorded_setting
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            plan, "recorded_setting", lambda r, n: "qwen-vl-utils" if n == "thin_images" else recorded(r, n)
        )
        extract(old)
    assert json.loads((old / "run.json").read_text())["config"]["processor"]["thin_images"] == "qwen-vl-utils"
    assert list(grids(old).values()) == [[1, 2, 150]]
    Image.new("RGB", (12, 2400), (50, 20, 90)).save(tmp_path / "in" / "b.png")
    summary = extract(old)
    assert summary.extracted == 1
    assert json.loads((old / "run.json").read_text())["config"]["processor"]["thin_images"] == "qwen-vl-utils"
    assert sorted(grids(old).values()) == [[1, 2, 150], [1, 150, 2]]
