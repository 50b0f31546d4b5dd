"""VLFAST_PREPROCESS=1: the image half of every Qwen-VL processor a process loads answered by vlfast, in
launchers the user does not edit (LlamaFactory's, TRL's, a Trainer script), with transformers' pixels.

What is checked, in a child process with transformers' real torchvision backend (tests/_transformers_reference):
the loaded processor's image processor is swapped at ``from_pretrained``; each processor call returns the pixels,
grids and input_ids of transformers' own ``Qwen2VLImageProcessor`` on real JPEG and PNG files of several sizes
and modes; transformers' code did not run for those calls (its ``_preprocess`` counted: 0) and did run for each
call vlfast cannot answer exactly (a pixel setting in the call, a setting changed on the object, a float array),
with its own result; ``save_pretrained`` writes what transformers loads back; DataLoader workers report their
calls at exit; ``VLFAST_RECORD`` says all of it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _transformers_reference as reference  # noqa: E402
from vlfast.errors import InputRefused  # noqa: E402

# One worker runs the module: the child process behind switch_run (~15 s) runs once
pytestmark = pytest.mark.xdist_group("preprocess-switch")

CHILD = r"""
import copy, json, os, sys
sys.path.insert(0, TESTS)
import _transformers_reference as r
r._import_torchvision()
import numpy as np, torch
from PIL import Image
from transformers import AutoProcessor, Qwen2VLImageProcessor
from vlfast.switches.record import record_calls

stock_runs = []
real = Qwen2VLImageProcessor._preprocess
def counted(self, *a, **k):
    stock_runs.append(1)
    return real(self, *a, **k)
Qwen2VLImageProcessor._preprocess = counted

out = {}
proc = AutoProcessor.from_pretrained(CKPT)
out["class"] = type(proc.image_processor).__name__
out["probe_stock_runs"] = len(stock_runs)  # the proof at the swap: transformers' own call on the probes
stock_runs.clear()
stock = Qwen2VLImageProcessor.from_pretrained(CKPT)  # not through ProcessorMixin: transformers' own
plain = copy.copy(proc)
plain.image_processor = stock
prompt = "<|vision_start|><|image_pad|><|vision_end|>describe"
equal = []
with record_calls() as rec:
    for path in IMAGES:
        img = Image.open(path)
        got = proc(text=[prompt], images=[img], return_tensors="pt")
        n = len(stock_runs)
        want = plain(text=[prompt], images=[Image.open(path)], return_tensors="pt")
        assert len(stock_runs) > n, "the reference did not run transformers' code"
        del stock_runs[n:]
        equal.append([
            os.path.basename(path),
            torch.equal(got["pixel_values"], want["pixel_values"]),
            torch.equal(got["image_grid_thw"], want["image_grid_thw"]),
            torch.equal(got["input_ids"], want["input_ids"]),
        ])
out["equal"] = equal
out["stock_runs_for_answered_calls"] = len(stock_runs)
out["answered"] = rec.image_processor_calls()[0]

ip = proc.image_processor
img = Image.open(IMAGES[0])
# ms-swift's call: resized by the caller onto the patch grid, then do_resize=False: answered by vlfast
on_grid = img.convert("RGB").resize((640, 352), Image.BICUBIC)
with record_calls() as rec:
    n = len(stock_runs)
    got = ip(images=[on_grid], return_tensors="pt", do_resize=False)
    out["no_resize_stock_runs"] = len(stock_runs) - n
    want = stock(images=[on_grid], return_tensors="pt", do_resize=False)
    del stock_runs[n:]
out["no_resize_equal"] = torch.equal(got["pixel_values"], want["pixel_values"]) and got["image_grid_thw"].tolist() == [[1, 22, 40]]
out["no_resize_answered"] = rec.image_processor_calls()
def error(fn):
    try:
        fn()
    except Exception as e:
        return type(e).__name__
off_grid = img.convert("RGB").resize((641, 352))
out["off_grid_errors"] = [error(lambda: stock(off_grid, do_resize=False)), error(lambda: ip(off_grid, do_resize=False))]
del stock_runs[n:]
fallbacks = {}
n = len(stock_runs)
fallbacks["max_pixels"] = torch.equal(ip(img, max_pixels=128 * 128, return_tensors="pt")["pixel_values"],
                                      stock(img, max_pixels=128 * 128, return_tensors="pt")["pixel_values"])
floats = np.asarray(img.convert("RGB"), dtype=np.float32)
fallbacks["float_array"] = torch.equal(ip(floats, return_tensors="pt")["pixel_values"],
                                       stock(floats, return_tensors="pt")["pixel_values"])
ip.size = {"shortest_edge": 65536, "longest_edge": 200_000}
stock.size = {"shortest_edge": 65536, "longest_edge": 200_000}
fallbacks["size_changed"] = torch.equal(ip(img, return_tensors="pt")["pixel_values"],
                                        stock(img, return_tensors="pt")["pixel_values"])
out["fallbacks"] = fallbacks
out["stock_runs_for_fallbacks"] = (len(stock_runs) - n) // 2  # each compared with transformers' own call

proc.save_pretrained(SAVED)
saved = json.load(open(os.path.join(SAVED, "processor_config.json")))["image_processor"]
out["saved_type"] = saved["image_processor_type"]
out["saved_vlfast_keys"] = [k for k in saved if "vlfast" in k]
back = Qwen2VLImageProcessor.from_pretrained(SAVED)
out["saved_size"] = dict(back.size)

fresh = AutoProcessor.from_pretrained(CKPT)
class Images(torch.utils.data.Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        return fresh.image_processor(Image.open(IMAGES[i % len(IMAGES)]), return_tensors="pt")["image_grid_thw"]
loader = torch.utils.data.DataLoader(Images(), batch_size=None, num_workers=2,
                                     multiprocessing_context="fork")
out["worker_grids"] = [g.tolist() for g in loader]

# A vlfast whose resize is off by one level: the proof at load time catches it, the processor stays stock
import vlfast.pixels.image as vimage
right = vimage.resize_frames
vimage.resize_frames = lambda *a, **k: right(*a, **k).clamp(0, 254)
broken = AutoProcessor.from_pretrained(CKPT)
vimage.resize_frames = right
out["broken_class"] = type(broken.image_processor).__name__
print("RESULT " + json.dumps(out))
"""


def _child(code: str, env_extra: dict, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLFAST_")}
    env.update(TRANSFORMERS_VERBOSITY="error", **env_extra)
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def switch_run(tiny_qwen3_vl, media_dir, tmp_path_factory):
    why = reference.unavailable()
    if why:
        pytest.skip(why)
    from PIL import Image

    from vlfast.demo import pattern

    work = tmp_path_factory.mktemp("switch")
    hd = work / "hd.jpg"
    Image.fromarray(pattern(720, 1280, 5)).save(hd, quality=90)
    tall = work / "tall.png"
    Image.fromarray(pattern(517, 333, 6)).save(tall)
    names = ("rgb.jpg", "rgb.png", "rgba.png", "gray.png", "palette.png", "cmyk.jpg")
    images = [str(hd), str(tall), *(str(media_dir / "good" / n) for n in names)]
    record = work / "record.jsonl"
    code = (
        f"TESTS = {str(Path(__file__).parent)!r}\nCKPT = {str(tiny_qwen3_vl)!r}\nIMAGES = {images!r}\n"
        f"SAVED = {str(work / 'saved')!r}\n" + CHILD
    )
    res = _child(code, {"VLFAST_PREPROCESS": "1", "VLFAST_RECORD": str(record)})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    line = next(x for x in res.stdout.splitlines() if x.startswith("RESULT "))
    lines = [json.loads(x) for x in record.read_text().splitlines()]
    return json.loads(line.removeprefix("RESULT ")), lines, res.stderr, len(images)


def test_the_switch_gives_transformers_pixels_without_its_code(switch_run):
    out, _, _, n = switch_run
    assert out["class"] == "VlfastQwen2VLImageProcessor"
    assert out["probe_stock_runs"] == 4  # three probe images (one thin), and one with do_resize=False
    assert len(out["equal"]) == n
    for name, pixels, grid, ids in out["equal"]:
        assert (pixels, grid, ids) == (True, True, True), name
    assert out["stock_runs_for_answered_calls"] == 0  # transformers' _preprocess never ran for them
    assert out["answered"] == n


def test_do_resize_false_as_ms_swift_calls_it(switch_run):
    """ms-swift resizes with qwen-vl-utils and calls the image processor with do_resize=False: vlfast answers
    that call too (transformers' pixels, its code not run); an image off the patch grid fails in
    transformers' code as it does without vlfast."""
    out, lines, _, _ = switch_run
    assert out["no_resize_equal"] is True
    assert out["no_resize_stock_runs"] == 0
    assert out["no_resize_answered"] == [1, {}]
    assert out["off_grid_errors"][0] is not None and out["off_grid_errors"][0] == out["off_grid_errors"][1]


def test_what_vlfast_cannot_answer_runs_transformers_code(switch_run):
    """A pixel setting in the call, a float array, a setting changed on the object after loading: each
    runs transformers' own code (counted), with its result, never vlfast's pixels under another setting."""
    out, lines, _, _ = switch_run
    assert out["fallbacks"] == {"max_pixels": True, "float_array": True, "size_changed": True}
    assert out["stock_runs_for_fallbacks"] == 3
    main = next(x for x in lines if x["image_processor_calls"]["stock"])
    reasons = " | ".join(main["image_processor_calls"]["stock"])
    assert "max_pixels=16384 in a call" in reasons
    assert "an array of shape" in reasons and "float32" in reasons
    assert "size changed since vlfast took its calls" in reasons
    assert "an image vlfast refused" in reasons  # the off-grid image with do_resize=False
    assert sum(main["image_processor_calls"]["stock"].values()) == 4


def test_save_pretrained_writes_what_transformers_loads(switch_run):
    out, _, _, _ = switch_run
    assert out["saved_type"] == "Qwen2VLImageProcessor"
    assert out["saved_vlfast_keys"] == []
    assert out["saved_size"] == {"shortest_edge": 65536, "longest_edge": 200_000}


def test_dataloader_workers_report_their_calls(switch_run):
    """Forked DataLoader workers end past atexit: each says what it answered (its own calls, not the
    parent's, which it inherited), through a multiprocessing finalizer."""
    out, lines, stderr, _ = switch_run
    assert len(out["worker_grids"]) == 4
    workers = [
        x for x in lines if x["image_processor_calls"]["vlfast"] and not x["image_processor_calls"]["stock"]
    ]
    assert sum(x["image_processor_calls"]["vlfast"] for x in workers) == 4, lines
    assert len({x["pid"] for x in workers}) == 2
    assert stderr.count("vlfast record (") == len(lines) == 3


def test_pixels_that_differ_at_load_keep_transformers_processor(switch_run):
    """The swap is proven where it happens, on the transformers installed: two probe images through both
    paths, bit for bit; a vlfast whose pixels are off (its resize clamped at 254 here) is not swapped, and
    says so once with the difference."""
    out, _, stderr, _ = switch_run
    assert out["broken_class"] == "Qwen2VLImageProcessor"
    said = [x for x in stderr.splitlines() if "keeps transformers' image processor" in x]
    assert len(said) == 1 and "differ from Qwen2VLImageProcessor's" in said[0] and "probe image" in said[0]
    assert "pixel values up to" in said[0]


def test_a_processor_vlfast_does_not_reproduce_is_left_alone_and_said(tiny_qwen3_vl):
    """Without torchvision transformers picks its PIL image processor, whose pixels are another resize's:
    the switch leaves it in place and says why (once), rather than change the pixels."""
    from _transformers_support import qwen3_vl_processor
    from vlfast.switches.preprocess import swap_image_processor

    proc = qwen3_vl_processor(str(tiny_qwen3_vl))
    before = proc.image_processor
    why = swap_image_processor(proc, str(tiny_qwen3_vl))
    assert proc.image_processor is before
    assert "Qwen2VLImageProcessorPil" in why and "torchvision" in why


def test_the_switch_costs_nothing_at_start_up_and_refuses_a_typo():
    code = "import sys; print('transformers' in sys.modules, 'torch' in sys.modules)"
    res = _child(code, {"VLFAST_PREPROCESS": "1"}, timeout=60)
    assert res.returncode == 0 and res.stdout.split() == ["False", "False"], res.stderr
    res = _child("pass", {"VLFAST_PREPROCESS": "al"}, timeout=60)
    said = [x for x in res.stderr.splitlines() if "VLFAST_PREPROCESS" in x]
    assert len(said) == 1 and "'al'" in said[0] and "left as they are" in said[0], res.stderr


def test_as_image_processor_budgets_reach_the_placeholder_count(tiny_qwen3_vl, media_dir):
    """transformers 5 keeps the budgets in a SizeDict, not a dict: the swapped object's
    get_number_of_image_patches (vLLM's and the processors' placeholder count) must follow the
    VisionPreprocessor's budgets, as its pixels do."""
    from PIL import Image

    from _transformers_support import qwen3_vl_processor
    from vlfast import VisionPreprocessor

    proc = qwen3_vl_processor(str(tiny_qwen3_vl))
    pre = VisionPreprocessor(str(tiny_qwen3_vl), min_pixels=32 * 32, max_pixels=96 * 96)
    swapped = pre.as_image_processor(proc.image_processor)
    img = Image.open(media_dir / "good" / "rgb.jpg").convert("RGB")
    grid = pre(images=[img])["image_grid_thw"][0]
    assert swapped.get_number_of_image_patches(img.height, img.width) == int(grid.prod())
    assert swapped.to_dict()["image_processor_type"] == "Qwen2VLImageProcessor"
    assert not [k for k in swapped.to_dict() if "vlfast" in k]
    assert torch.equal(swapped(img, return_tensors="pt")["image_grid_thw"][0], grid)
    # a budget changed on the object after the swap is not followed silently: refused (VLFAST_PREPROCESS's
    # swap runs transformers' code instead, test_what_vlfast_cannot_answer_runs_transformers_code)
    swapped.size = dataclasses.replace(swapped.size, longest_edge=64 * 64)
    with pytest.raises(InputRefused, match="size changed since vlfast took its calls"):
        swapped(img, return_tensors="pt")


def test_a_switch_that_cannot_arm_leaves_transformers_importable():
    """The switch arms inside the import of transformers.processing_utils: if vlfast's side fails there (a
    broken install, here its module made unimportable), that import and the user's launcher go on, stock,
    and one line says why."""
    code = (
        "import sys\n"
        "sys.modules['vlfast.switches.preprocess'] = None  # import of it raises ImportError\n"
        "import vlfast.switches.patch as a; a._arm_preprocess()\n"
        "import transformers.processing_utils as pu\n"
        "print(getattr(pu.ProcessorMixin.from_pretrained.__func__, '_vlfast_switch', False))\n"
    )
    res = _child(code, {"VLFAST_PREPROCESS": "1"}, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["False"]
    said = [x for x in res.stderr.splitlines() if "could not arm it" in x]
    assert len(said) == 1 and "VLFAST_PREPROCESS" in said[0] and "ModuleNotFoundError" in said[0], res.stderr
