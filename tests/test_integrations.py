"""patch_transformers, family discovery and the zero-code switches (env var, python -m vlfast.run)."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import vlfast
from _transformers_support import FAMILIES, TOWER, TOWER_LOADS_ALONE, needs
from vlfast.patching.integrations import (
    discover_families,
    patch_transformers,
    transformers_patched,
    unpatch_transformers,
)

EXPECTED = {
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "glm4v",
    "glm4v_moe",
    "qwen2_5_omni",
    "qwen3_omni_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "glm_ocr",
}


@pytest.fixture
def switch_on():
    patch_transformers()
    yield
    unpatch_transformers()


def _sub_configs(config, seen=None):
    """The config and every nested sub-config (thinker_config.vision_config and the like)."""
    from transformers import PretrainedConfig

    seen = seen if seen is not None else []
    if isinstance(config, PretrainedConfig) and all(config is not s for s in seen):
        seen.append(config)
        for value in vars(config).values():
            _sub_configs(value, seen)
    return seen


def _shrink(config):
    for key in ("depth", "num_hidden_layers", "num_layers"):
        if isinstance(getattr(config, key, None), int):
            setattr(config, key, 1)
    return config


def _models_of_family(family):
    """Every PreTrainedModel of the family buildable from a (shrunk) default config, built on meta."""
    from transformers import CONFIG_MAPPING, PreTrainedModel

    modeling = importlib.import_module(family.module)
    config_module = importlib.import_module(family.module.replace(".modeling_", ".configuration_"))
    configs = []
    if family.model_type in CONFIG_MAPPING:
        try:
            configs = _sub_configs(CONFIG_MAPPING[family.model_type]())
        except Exception:  # some top-level configs need arguments; their sub-configs are built below
            configs = []
    for obj in vars(config_module).values():  # sub-config classes with usable defaults
        if (
            inspect.isclass(obj)
            and obj.__module__ == config_module.__name__
            and not any(type(c) is obj for c in configs)
        ):
            with contextlib.suppress(Exception):
                configs.append(obj())
    for config in configs:
        for cls in vars(modeling).values():
            if (
                inspect.isclass(cls)
                and issubclass(cls, PreTrainedModel)
                and getattr(cls, "config_class", None) is type(config)
            ):
                try:
                    with torch.device("meta"):
                        yield cls._from_config(_shrink(config))
                except Exception:
                    continue


def test_discovery_finds_the_known_families():
    found = {f.model_type for f in discover_families()}
    expected = EXPECTED & FAMILIES  # those the installed transformers has (qwen2_vl on every one)
    assert "qwen2_vl" in expected and found >= expected, f"missing: {sorted(expected - found)}"
    qwen2 = next(f for f in discover_families() if f.model_type == "qwen2_vl")
    assert "PatchEmbed" in qwen2.classes
    if "qwen3_vl" in FAMILIES:
        qwen3 = next(f for f in discover_families() if f.model_type == "qwen3_vl")
        assert "Qwen3VLVisionPatchEmbed" in qwen3.classes


@pytest.mark.parametrize("family", discover_families(), ids=lambda f: f.model_type)
def test_every_discovered_family_is_patched_by_patch_transformers(family, switch_on):
    """The meta-test that keeps discovery honest: each family, built, comes out patched."""
    holders = set(family.classes)
    for model in _models_of_family(family):
        if any(type(m).__name__ in holders for m in model.modules()):
            assert vlfast.is_patched(model), f"{type(model).__name__} was built but not patched"
            patched = [type(m).__name__ for n, m in model.named_modules() if "_conv_forward" in m.__dict__]
            assert all(k == "Conv3d" for k in patched)
            return
    pytest.fail(f"could not build any model of {family.model_type} holding {sorted(holders)}")


def test_switch_is_reversible_and_leaves_built_models_patched():
    from vlfast.models import build_reference

    patch_transformers()
    assert transformers_patched()
    on = build_reference(TOWER, tiny=True)
    unpatch_transformers()
    assert not transformers_patched()
    off = build_reference(TOWER, tiny=True)
    assert vlfast.is_patched(on) and not vlfast.is_patched(off)
    unpatch_transformers()  # harmless when off


@needs("glm4v")
def test_default_switch_leaves_conv2d_alone_and_all_convs_takes_it(switch_on):
    from vlfast.models import build_reference

    glm = build_reference(
        "glm-4.1v-9b", tiny=True
    )  # patch_embed Conv3d + downsample Conv2d (kernel == stride)
    kinds = {type(m).__name__ for m in glm.modules() if "_conv_forward" in m.__dict__}
    assert kinds == {"Conv3d"}
    patch_transformers(all_convs=True)
    glm = build_reference("glm-4.1v-9b", tiny=True)
    kinds = {type(m).__name__ for m in glm.modules() if "_conv_forward" in m.__dict__}
    assert kinds == {"Conv3d", "Conv2d"}


@TOWER_LOADS_ALONE
def test_from_pretrained_comes_out_patched_with_identical_outputs(tmp_path, switch_on):
    from vlfast.models import build_reference, synthetic_inputs, tower_outputs

    unpatch_transformers()
    stock = build_reference(TOWER, tiny=True)
    stock.save_pretrained(tmp_path)
    patch_transformers()
    loaded = type(stock).from_pretrained(tmp_path)
    assert vlfast.is_patched(loaded) and not vlfast.is_patched(stock)
    pixels, grid = synthetic_inputs(stock, [(2, 4, 6)])
    with torch.no_grad():
        a = tower_outputs(stock(pixels, grid_thw=grid))["merged"]
        b = tower_outputs(loaded.eval()(pixels, grid_thw=grid))["merged"]
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


SCRIPT = textwrap.dedent(
    """
    import sys
    from vlfast.models import build_reference
    import vlfast
    print("PATCHED" if vlfast.is_patched(build_reference("TOWER", tiny=True)) else "NOT", sys.argv[1:])
    """
).replace("TOWER", TOWER)


def _run(args, env_extra=None, cwd=None):
    env = {k: v for k, v in os.environ.items() if k != "VLFAST_PATCH"}
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=120
    )


def test_env_var_switch_patches_a_plain_script(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    with ThreadPoolExecutor(2) as pool:  # two independent processes: one per core
        off, on = pool.map(lambda env: _run([str(script)], env), [None, {"VLFAST_PATCH": "1"}])
    assert "NOT" in off.stdout, off.stderr
    assert "PATCHED" in on.stdout, on.stderr


def test_env_var_does_not_import_torch_at_startup():
    out = _run(
        ["-c", "import sys; print('torch' in sys.modules, 'transformers' in sys.modules)"],
        {"VLFAST_PATCH": "1"},
    )
    assert out.stdout.strip() == "False False", out.stdout + out.stderr


def test_run_module_wraps_scripts_and_modules(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "job.py").write_text(SCRIPT)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:  # independent processes: one per core
        by_path = pool.submit(_run, ["-m", "vlfast.run", str(tmp_path / "train.py"), "--lr", "1"])
        by_module = pool.submit(_run, ["-m", "vlfast.run", "-m", "pkg.job", "x"], cwd=tmp_path)
        usage = pool.submit(_run, ["-m", "vlfast.run"])
        by_path, by_module, usage = by_path.result(), by_module.result(), usage.result()
    assert "PATCHED ['--lr', '1']" in by_path.stdout, by_path.stderr
    assert "PATCHED ['x']" in by_module.stdout, by_module.stderr
    assert usage.returncode == 2 and "usage" in usage.stderr


def test_patch_transformers_rejects_bad_filter():
    with pytest.raises(TypeError, match="filter"):
        patch_transformers(filter=42)
    assert not transformers_patched()


def test_patch_transformers_filter_narrows(switch_on):
    from vlfast.models import build_reference

    patch_transformers(filter=lambda name, m: False)
    assert not vlfast.is_patched(build_reference(TOWER, tiny=True))
    assert isinstance(nn.Conv3d, type)
