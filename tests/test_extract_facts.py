"""A finished OUT is answered without torch and transformers (issue 39), and as safely as before: what only
transformers answers about the model is taken from ``OUT/facts.json`` only under the key it was asked under
(the checkpoint's JSON files, what is installed, vlfast's code); any other key asks again, and a changed
processor, image backend or checkpoint is refused or resumed exactly as before."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vlfast.extraction import RunConfigMismatch
from vlfast.extraction.api import extract
from vlfast.extraction.config import ExtractConfig
from vlfast.extraction.plan import make_plan
from vlfast.extraction.store import facts as facts_module
from vlfast.extraction.store.facts import ModelFacts
from vlfast.pixels import engine as preprocess

FACTS = "facts.json"


@pytest.fixture(scope="module")
def finished(media_dir, tiny_qwen3_vl, tmp_path_factory) -> tuple[Path, Path]:
    """(input folder, OUT) of a finished extraction of two images by the tiny checkpoint."""
    root = tmp_path_factory.mktemp("finished")
    inputs = root / "in"
    inputs.mkdir()
    for name in ("rgb.jpg", "gray.png"):
        shutil.copy(media_dir / "good" / name, inputs / name)
    out = root / "out"
    assert extract(str(inputs), str(out), model=str(tiny_qwen3_vl), num_workers=0).extracted == 2
    return inputs, out


@pytest.fixture
def copied(finished, tiny_qwen3_vl, tmp_path) -> tuple[Path, Path, Path]:
    """(input folder, OUT, checkpoint): copies this test may change."""
    inputs, out = finished
    return (
        inputs,
        Path(shutil.copytree(out, tmp_path / "out")),
        Path(shutil.copytree(tiny_qwen3_vl, tmp_path / "ck")),
    )


def _resume(inputs: Path, out: Path, ckpt: Path, **kw):
    return extract(str(inputs), str(out), model=str(ckpt), num_workers=0, **kw)


@pytest.fixture
def asked(monkeypatch) -> list[str]:
    """Each time transformers is asked for a checkpoint's processor files here (the first answer a plan needs
    from it; the image processor class is asked only for an OUT made with transformers' own): counted."""
    from transformers.image_processing_base import ImageProcessingMixin

    calls: list[str] = []
    real = ImageProcessingMixin.get_image_processor_dict.__func__

    def counted(cls, path, *args, **kwargs):
        calls.append(str(path))
        return real(cls, path, *args, **kwargs)

    monkeypatch.setattr(preprocess, "_IMAGE_PROCESSORS", {})
    monkeypatch.setattr(ImageProcessingMixin, "get_image_processor_dict", classmethod(counted))
    return calls


def _cli(*args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``vlfast ARGS`` in a new process, and which of torch and transformers it imported."""
    code = (
        "import sys\n"
        "from vlfast.cli.main import app\n"
        "try:\n"
        f"    app({list(args)!r})\n"
        "except SystemExit as e:\n"
        "    print('LOADED', ','.join(m for m in ('torch', 'transformers') if m in sys.modules))\n"
        "    raise\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    loaded = next(
        (ln.split(" ", 1)[1].split(",") for ln in r.stdout.splitlines() if ln.startswith("LOADED")), []
    )
    return r, [m for m in loaded if m]


def test_a_finished_out_is_answered_without_torch_or_transformers(copied):
    """The run recorded the answers when it opened OUT: the next command imports neither. An OUT without the
    record (an older vlfast's) is answered as before once, which records them; then it is fast too."""
    inputs, out, ckpt = copied
    args = ("extract", str(inputs), str(out), "--model", str(ckpt))
    assert (out / FACTS).is_file()
    r, loaded = _cli(*args)
    assert r.returncode == 0 and "nothing to do: all 2 input entries" in r.stdout, r.stdout + r.stderr
    assert loaded == [], loaded

    (out / FACTS).unlink()  # an OUT written before the record existed
    assert _resume(inputs, out, ckpt).nothing_to_do  # asks transformers, as before, and records
    assert (out / FACTS).is_file()
    r, loaded = _cli(*args)
    assert r.returncode == 0 and "nothing to do" in r.stdout and loaded == [], r.stdout + r.stderr


@pytest.mark.parametrize("features", ["vision,vision_mean", "vision,llm", "ref"])
def test_recorded_answers_build_the_configuration_asked_ones_build(
    features, finished, tiny_qwen3_vl, tmp_path, monkeypatch
):
    """Recorded answers give the plan transformers would give (configuration, processor), and nothing asks
    transformers for them: a reference, a checkpoint's vision tower, and the whole model (llm)."""
    inputs, _ = finished
    model, features = ("ref:qwen3-vl-2b", "vision") if features == "ref" else (str(tiny_qwen3_vl), features)
    out = tmp_path / "out"
    out.mkdir()
    config = ExtractConfig(model=model, features=features, num_workers=0)
    first = make_plan(str(inputs), out, config)
    assert first.facts.recorded == frozenset() and first.facts.save(out, "r00000-test")

    import transformers.image_processing_base as ipb

    import vlfast.models

    def refused(*a, **k):
        raise AssertionError("transformers was asked")

    for name in ("load_config", "vision_config_of", "tower_tensor_names"):
        monkeypatch.setattr(vlfast.models, name, refused)
    monkeypatch.setattr(preprocess, "_image_processor", refused)
    monkeypatch.setattr(ipb.ImageProcessingMixin, "get_image_processor_dict", refused)
    again = make_plan(str(inputs), out, config)
    assert again.facts.recorded and again.run_config == first.run_config
    assert again.processor == first.processor


@pytest.mark.parametrize(
    "changed",
    ["transformers", "torch", "torchvision", "torchvision found", "pillow", "python", "vlfast"],
)
def test_another_key_asks_transformers_again(changed, copied, asked, monkeypatch):
    """Any change of what the answers are made from (a version, torchvision installed, vlfast's code) asks
    transformers again: the same answers then resume as before, and the record is made under the new key."""
    inputs, out, ckpt = copied
    assert _resume(inputs, out, ckpt).nothing_to_do and asked == []  # the record answers
    if changed == "vlfast":
        monkeypatch.setattr(facts_module, "_vlfast_source", lambda: "another vlfast")
    else:
        installed = dict(facts_module._installed())
        installed[changed] = not installed[changed] if changed.endswith("found") else "0.0.1"
        monkeypatch.setattr(facts_module, "_installed", lambda: installed)
    assert _resume(inputs, out, ckpt).nothing_to_do and asked == [str(ckpt.resolve())]
    key = json.loads((out / FACTS).read_text())["key"]
    assert key == facts_module.facts_key(str(ckpt.resolve()))


def test_another_image_backend_installed_keeps_the_recorded_one(copied, asked, monkeypatch):
    """torchvision installed mid-run (its key moves) and transformers picking its backend: the OUT records
    transformers' torchvision processor, whose operations vlfast does itself whatever is installed, so the
    resume answers as before (transformers asked again, the class not even built)."""
    inputs, out, ckpt = copied

    def refused(*a, **k):
        raise AssertionError("the image processor was built")

    monkeypatch.setattr(preprocess, "_image_processor", refused)
    recorded = json.loads((out / "run.json").read_text())["config"]["processor"]["image_processor"]
    assert recorded == "Qwen2VLImageProcessor"
    installed = {**facts_module._installed(), "torchvision": "0.28.0", "torchvision found": True}
    monkeypatch.setattr(facts_module, "_installed", lambda: installed)
    assert _resume(inputs, out, ckpt).nothing_to_do and asked == [str(ckpt.resolve())]


def test_changed_processor_files_are_asked_about_again(copied, asked):
    """Any byte of a JSON file of the checkpoint moves the key: a change of form resumes (asked again), a
    changed number is refused as before."""
    inputs, out, ckpt = copied
    config = ckpt / "preprocessor_config.json"
    config.write_text(config.read_text() + "\n")
    assert _resume(inputs, out, ckpt).nothing_to_do and len(asked) == 1
    data = json.loads(config.read_text())
    data["image_mean"] = [0.48, 0.5, 0.5]
    config.write_text(json.dumps(data))
    with pytest.raises(RunConfigMismatch) as e:
        _resume(inputs, out, ckpt)
    assert "processor.image_mean" in str(e.value)


def test_changed_weights_under_the_same_json_files_are_refused(copied, asked):
    """The record names the tower's tensors, never their bytes: a fine-tune that leaves every JSON file as it
    was keeps the key, and the weights, hashed as before, refuse it."""
    inputs, out, ckpt = copied
    from vlfast.extraction.store.format import read_header
    from vlfast.models.checkpoints import tensor_locations

    names = json.loads((out / FACTS).read_text())["answers"]["vision tower tensors"]
    weights, key = tensor_locations(ckpt, names)["patch_embed.proj.weight"]
    with open(weights, "r+b") as f:
        start, _, header = read_header(f, weights.stat().st_size)
        f.seek(start + header[key]["data_offsets"][0])
        first = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([first[0] ^ 0x01]))
    with pytest.raises(RunConfigMismatch) as e:
        _resume(inputs, out, ckpt)
    assert "weights.xxh3_128" in str(e.value) and asked == []


def test_a_damaged_or_foreign_record_is_ignored(copied, asked):
    inputs, out, ckpt = copied
    record = out / FACTS
    doc = json.loads(record.read_text())
    doc["answers"]["image processor"] = "Qwen2VLImageProcessor"  # edited without its checksum
    record.write_text(json.dumps(doc))
    assert ModelFacts(str(ckpt.resolve()), out).recorded == frozenset()
    assert _resume(inputs, out, ckpt).nothing_to_do and len(asked) == 1  # asked, and recorded again
    assert ModelFacts(str(ckpt.resolve()), out).recorded
    record.write_bytes(record.read_bytes()[:100])  # torn
    assert ModelFacts(str(ckpt.resolve()), out).recorded == frozenset()


@pytest.fixture
def no_forward(monkeypatch):
    """A run that extracts nothing: every sample's decoding fails as a recorded error (cheap)."""
    from vlfast.pixels.media import SampleError

    def fail(*a, **k):
        raise SampleError("not decoded in this test")

    monkeypatch.setattr(preprocess.Preprocessor, "__call__", fail)


def test_overwrite_deletes_the_record_with_the_rest(copied, no_forward):
    inputs, out, ckpt = copied
    (out / FACTS).write_text("{}")
    _resume(inputs, out, ckpt, overwrite=True)
    assert json.loads((out / FACTS).read_text())["format"] == "vlfast-facts"  # written anew by this run


def test_torch_gpu_build_is_read_from_its_version_file(tmp_path, monkeypatch):
    """Whether the default device may be a GPU, told without importing torch: only a torch built for neither
    CUDA nor ROCm answers "cpu" without it."""
    import importlib.util
    from types import SimpleNamespace

    from vlfast.extraction.config import torch_gpu_build

    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    )
    version = tmp_path / "version.py"
    for text, built in (
        ("cuda: Optional[str] = None\nhip: Optional[str] = None\n", False),
        ("cuda: Optional[str] = '12.6'\nhip: Optional[str] = None\n", True),
        ("cuda = None\nhip = '6.4'\n", True),
        ("cuda = None\nhip = get_hip()\n", None),  # not a literal: cannot tell
        ("cuda = None\n", None),
    ):
        version.write_text("from typing import Optional\n" + text)
        assert torch_gpu_build() is built, text
    version.unlink()
    assert torch_gpu_build() is None
