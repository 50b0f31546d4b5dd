"""Train a tiny Qwen3-VL with LlamaFactory, ms-swift and axolotl's own launchers, unpatched and then patched.

One command for all three (outside the test suite: installing takes minutes, each run a minute or two):

    python scripts/framework_runs.py                          # llamafactory, ms-swift, axolotl
    python scripts/framework_runs.py --only ms-swift --steps 3
    python scripts/framework_runs.py --fresh                  # rebuild the cached venvs first
    python scripts/framework_runs.py --only ms-swift --torch 2.9.1   # ms-swift's own Conv3d patch on

For each framework it makes (or reuses) a venv under ~/.cache/vlfast-frameworks/<name>-<version>: torch and
torchvision first, pinned (``torch===2.13.0 torchvision===0.28.0``, downloaded once into
~/.cache/vlfast-frameworks/wheels), then the framework's pinned release and this checkout of vlfast in ONE
``pip install -c constraints.txt <framework>==<version> -e REPO`` (the constraints file holds the two pins: pip
resolves vlfast beside the framework and leaves torch alone). In that venv it saves a tiny Qwen3-VL
(checkpoint, a tokenizer with Qwen's special-token ids, the processor: ``save_pretrained``, nothing downloaded
at run time) and a tiny image dataset in the framework's format, then runs the framework's own launcher
(``llamafactory-cli train``, ``swift sft``, ``axolotl train``) for a few steps, LoRA and full, each three
times: unpatched, patched as docs/training.md says (``VLFAST_PATCH=1`` in the launcher's environment), and
patched with ``VLFAST_PREPROCESS=1`` beside it (docs/preprocessing.md: the image processor's calls answered
by vlfast), all with ``VLFAST_RECORD=<file>``. It reads each step's loss from the run's ``trainer_state.json`` (the HF
Trainer's log history, which every framework here keeps: full float precision) and the record's JSON lines,
prints a table and exits 1 when a run that should pass does not.

What a run must show to pass: the same number of logged steps both ways; losses equal within ``--rtol``
relative; the unpatched run no GEMM call (``VLFAST_RECORD`` alone loads no patch, so it writes no line); the
patched run's record GEMM calls, 0 stock calls and no eligible conv left unpatched, or, where the framework
replaced ``nn.Conv3d.forward`` for the whole class (ms-swift on torch 2.9.x), that replacement named (vlfast's
GEMM is then not reached, by design). The ``VLFAST_PREPROCESS`` run: the patched run's losses (the same
pixels: equal within ``--rtol``, bit-equal in practice), and a record of image processor calls all answered
by vlfast, none passed to transformers' code.

Environment facts this script handles (each says so in its output):
- torch is PyPI's build (CUDA libraries included, run here on CPU), not a CPU-only wheel: transformers'
  Qwen3-VL processor needs torchvision (its video processor, in 5.6 and 5.19 alike: ``AutoProcessor`` fails
  without it), and PyPI's torchvision loads only beside PyPI's torch (it links torch's CUDA libraries). The
  first venv downloads about 3 GB once per Python version;
- a package the framework pulls in that still does not import (a torchaudio build for another torch) is
  uninstalled again and, where the framework imports it unconditionally (LlamaFactory's mm_plugin imports
  torchaudio, for audio only), replaced by a stub module on the venv's path;
- axolotl 0.21 needs Python >= 3.12: the script looks for one (``python3.12`` on PATH, pyenv's versions,
  ``uv python find``) and skips axolotl, saying why, when there is none.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import glob
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = Path.home() / ".cache" / "vlfast-frameworks"
TORCH = "2.13.0"
STEPS = 3
RTOL = 1e-5  # fp32 on CPU: the GEMM and the conv differ by round-off (~1e-7 relative on a loss)
RUN_TIMEOUT = 1800  # seconds for one launcher run


@dataclass(frozen=True)
class Framework:
    name: str  # the distribution on PyPI, and --only's name
    version: str
    python: str  # the Python its venv is made with (axolotl 0.21 needs >= 3.12)
    modes: tuple[str, ...] = ("lora", "full")
    drop: tuple[str, ...] = ()  # pulled in by the framework: uninstalled if they do not import beside torch
    stubs: tuple[str, ...] = ()  # modules imported unconditionally, provided as stubs where dropped
    extras: tuple[str, ...] = ()  # what its Qwen3-VL support asks for beyond its own requirements


FRAMEWORKS = {
    "llamafactory": Framework("llamafactory", "0.9.5", "3.11", drop=("torchaudio",), stubs=("torchaudio",)),
    # ms-swift's Qwen3-VL loader refuses to start without qwen_vl_utils (>= 0.0.14), not among its requirements
    "ms-swift": Framework("ms-swift", "4.6.0", "3.11", extras=("qwen_vl_utils>=0.0.14",)),
    "axolotl": Framework("axolotl", "0.21.0", "3.12"),
}

# Qwen2.5/Qwen3's added tokens at their real ids: ms-swift's Qwen-VL templates hard-code 151655 (<|image_pad|>).
QWEN_ADDED = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
    "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
    "</tool_response>", "<think>", "</think>",
]  # fmt: skip
FIRST_ADDED_ID = 151643
QWEN_SPECIAL = 14  # the first 14 are special tokens, the rest ordinary added tokens (as Qwen3's tokenizer)
VOCAB_SIZE = 151936  # Qwen3-VL's embedding rows
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SAMPLES = 8
IMAGE = 64  # pixels a side: 4 x 4 patches of 16, 4 merged image tokens
TORCHAUDIO_STUB = '''"""A stub of torchaudio put here by vlfast's scripts/framework_runs.py: the torchaudio
that pip resolved did not import beside this venv's torch, and LlamaFactory imports torchaudio unconditionally
(for audio inputs only; these runs have none)."""

__version__ = "0.0.0+vlfast-stub"


def load(*args, **kwargs):
    raise RuntimeError("torchaudio is a stub in this venv (vlfast's scripts/framework_runs.py): no audio")


class functional:  # noqa: N801
    @staticmethod
    def resample(*args, **kwargs):
        raise RuntimeError("torchaudio is a stub in this venv (vlfast's scripts/framework_runs.py): no audio")
'''


# ------------------------------------------------------------------------------------------- venvs


def find_python(minor: str) -> tuple[str | None, str]:
    """An interpreter of version ``minor`` (e.g. "3.12"), and where it was found or why there is none."""
    if f"{sys.version_info.major}.{sys.version_info.minor}" == minor:
        return sys.executable, "this interpreter"
    candidates = [shutil.which(f"python{minor}")]
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates += sorted(glob.glob(str(pyenv_root / "versions" / f"{minor}.*" / "bin" / f"python{minor}")))
    if shutil.which("uv"):
        found = subprocess.run(["uv", "python", "find", minor], capture_output=True, text=True)
        candidates.append(found.stdout.strip() if found.returncode == 0 else None)
    for python in filter(None, candidates):
        done = subprocess.run(
            [python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
        )
        if done.returncode == 0 and done.stdout.strip() == minor:
            return python, python
    return None, (
        f"no Python {minor} here (looked for python{minor} on PATH, in {pyenv_root}/versions and with "
        f"`uv python find`)"
    )


def torchvision_for(torch: str) -> str:
    """The torchvision release built for a torch release: 2.13.0 -> 0.28.0."""
    _, minor, patch = torch.split(".")[:3]
    return f"0.{int(minor) + 15}.{patch}"


def venv_dir(fw: Framework, cache: Path, torch: str) -> Path:
    return cache / (f"{fw.name}-{fw.version}" + ("" if torch == TORCH else f"-torch{torch}"))


def pip(venv: Path, *args: str, log: Path) -> None:
    cmd = [str(venv / "bin" / "python"), "-m", "pip", *args]
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        raise RuntimeError(f"`pip {' '.join(args)}` failed (exit {done.returncode}): see {log}")


def site_packages(venv: Path) -> Path:
    return Path(glob.glob(str(venv / "lib" / "python3.*" / "site-packages"))[0])


def ensure_venv(
    fw: Framework, python: str, venv: Path, cache: Path, torch: str, fresh: bool, log: Path
) -> list[str]:
    """Create (or reuse) the framework's venv; returns what was done to it beyond the plain install."""
    marker = venv / ".vlfast-framework-runs.json"
    spec = {
        "framework": f"{fw.name}=={fw.version}",
        "extras": list(fw.extras),
        "torch": torch,
        "vlfast": str(REPO),
    }
    if fresh and venv.exists():
        shutil.rmtree(venv)
    if marker.exists() and json.loads(marker.read_text()).get("spec") == spec:
        return json.loads(marker.read_text())["notes"]
    if venv.exists():
        shutil.rmtree(venv)
    print(f"  creating {venv} (several minutes; pip's output goes to {log})", flush=True)
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    pins = [f"torch==={torch}", f"torchvision==={torchvision_for(torch)}"]  # ===: PyPI's build, not +cpu
    constraints = venv / "constraints.txt"
    constraints.write_text("\n".join(pins) + "\n")
    wheels = cache / "wheels"  # torch and its CUDA libraries, downloaded once per Python version
    pip(venv, "download", "-q", "-d", str(wheels), *pins, log=log)
    pip(venv, "install", "--find-links", str(wheels), *pins, log=log)  # first: nothing else pulls a torch in
    spec_ = f"{fw.name}=={fw.version}"
    pip(
        venv,
        "install",
        "-c",
        str(constraints),
        "--find-links",
        str(wheels),
        spec_,
        *fw.extras,
        "-e",
        str(REPO),
        log=log,
    )
    notes = []
    for name in fw.drop:
        if _installed(venv, name) and not _imports(venv, name):
            pip(venv, "uninstall", "-y", name, log=log)
            notes.append(
                f"{name} uninstalled (pulled in by {fw.name}; does not load beside torch {torch} here)"
            )
    for name in fw.stubs:
        if not _imports(venv, name):
            stubs = venv / "vlfast-stubs"
            (stubs / name).mkdir(parents=True, exist_ok=True)
            (stubs / name / "__init__.py").write_text(TORCHAUDIO_STUB)
            (site_packages(venv) / "vlfast-stubs.pth").write_text(str(stubs) + "\n")
            notes.append(f"{name} is a stub module ({stubs / name}): {fw.name} imports it unconditionally")
    marker.write_text(json.dumps({"spec": spec, "notes": notes}))
    return notes


def _installed(venv: Path, name: str) -> bool:
    code = f"import importlib.metadata as m; m.version({name!r})"
    return subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True).returncode == 0


def _imports(venv: Path, name: str) -> bool:
    return (
        subprocess.run([str(venv / "bin" / "python"), "-c", f"import {name}"], capture_output=True).returncode
        == 0
    )


def versions(venv: Path) -> dict[str, str]:
    code = (
        "import importlib.metadata as m, json, sys\n"
        "out = {'python': '%d.%d.%d' % sys.version_info[:3]}\n"
        "for n in ('torch', 'transformers', 'peft', 'accelerate', 'trl', 'llamafactory', 'ms-swift', 'axolotl'):\n"
        "    try: out[n] = m.version(n)\n"
        "    except m.PackageNotFoundError: pass\n"
        "import torch; out['torch'] = torch.__version__  # with its build: +cu130 is PyPI's, +cpu a CPU wheel\n"
        "print(json.dumps(out))"
    )
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout)


# ---------------------------------------------------------------------- fixture (run inside the venv)


def build_fixture(out: Path) -> None:
    """The tiny Qwen3-VL (model, tokenizer with Qwen's added-token ids, processor) and its images, saved."""
    import torch
    from PIL import Image
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    from vlfast.demo import pattern, tiny_qwen3_vl_config

    ckpt, images = out / "ckpt", out / "images"
    images.mkdir(parents=True, exist_ok=True)
    texts = [sample_text(i) for i in range(SAMPLES)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    bpe.train_from_iterator([t for pair in texts for t in pair] * 4 + ["user assistant system"] * 4, trainer)
    trained = json.loads(bpe.to_str())["model"]
    vocab = dict(trained["vocab"])
    for i in range(len(vocab), FIRST_ADDED_ID):  # unreachable fillers: Qwen's added tokens at their own ids
        vocab[f"<|vlfast_unused_{i}|>"] = i
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    full = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    full.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    full.decoder = decoders.ByteLevel()
    full.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in QWEN_ADDED[:QWEN_SPECIAL]]
    )
    full.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_ADDED[QWEN_SPECIAL:]])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=full, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_ADDED}
    assert ids == {t: FIRST_ADDED_ID + i for i, t in enumerate(QWEN_ADDED)}, ids
    config = tiny_qwen3_vl_config(
        VOCAB_SIZE,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    config.text_config.eos_token_id = ids["<|im_end|>"]
    config.text_config.pad_token_id = ids["<|endoftext|>"]
    torch.manual_seed(0)
    Qwen3VLForConditionalGeneration(config).save_pretrained(ckpt)
    pixels = {"shortest_edge": IMAGE * IMAGE, "longest_edge": 4 * IMAGE * IMAGE}
    norm = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3, "patch_size": 16, "temporal_patch_size": 2}
    image_processor = Qwen2VLImageProcessorPil(merge_size=2, size=pixels, **norm)
    video_processor = Qwen3VLVideoProcessor(
        merge_size=2, size=pixels, fps=2, min_frames=4, max_frames=8, **norm
    )
    parts = {"image_processor": image_processor, "tokenizer": tok, "video_processor": video_processor}
    with video_processors_accepted():
        processor = Qwen3VLProcessor(**parts, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    for i in range(SAMPLES):
        Image.fromarray(pattern(IMAGE, IMAGE, seed=i)).save(images / f"{i}.png")


@contextlib.contextmanager
def video_processors_accepted() -> Iterator[None]:
    """Let ``ProcessorMixin.__init__`` accept a video processor where torchvision is absent (as
    ``vlfast.demo`` does): its type check looks the video processors' base class up among the names
    transformers exports, which it exports only with torchvision; the class is ``VideoProcessorMixin`` in
    recent releases, ``BaseVideoProcessor`` in older ones (5.6). Exported for the duration."""
    from transformers import processing_utils, video_processing_utils

    module = processing_utils.transformers_module
    saved = {}
    for name in ("VideoProcessorMixin", "BaseVideoProcessor"):
        real = getattr(video_processing_utils, name, None)
        if real is not None and getattr(module, name, None) is not real:  # missing, or torchvision's dummy
            saved[name] = getattr(module, name, None)
            setattr(module, name, real)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                delattr(module, name)
            else:
                setattr(module, name, old)


def sample_text(i: int) -> tuple[str, str]:
    colours = ["red", "green", "blue", "orange", "purple", "yellow", "grey", "pink"]
    return (
        "Describe this image.",
        f"A smooth pattern of {colours[i % 8]} and {colours[(i + 3) % 8]} waves, number {i}.",
    )


def patch_embed_weights(ckpt: Path, stock_out: Path, fast_out: Path) -> dict:
    """(Run inside the venv.) How far full training moved the patch embed's weight from the checkpoint's, in
    each run, and how far the patched run's final weight is from the unpatched one's (max abs)."""
    from safetensors import safe_open

    def weight(folder: Path):
        for path in sorted(folder.rglob("*.safetensors")):
            with safe_open(str(path), "pt") as f:
                key = next((k for k in f.keys() if k.endswith("patch_embed.proj.weight")), None)  # noqa: SIM118
                if key is not None:
                    return f.get_tensor(key).double()
        return None

    w0, w_stock, w_fast = weight(ckpt), weight(stock_out), weight(fast_out)
    if w0 is None or w_stock is None or w_fast is None:
        return {}
    return {
        "moved_unpatched": (w_stock - w0).abs().max().item(),
        "moved_patched": (w_fast - w0).abs().max().item(),
        "patched_vs_unpatched": (w_fast - w_stock).abs().max().item(),
    }


# ------------------------------------------------------------------------------ per-framework configs


def _messages(images: Path, i: int) -> dict:
    question, answer = sample_text(i)
    return {
        "messages": [
            {"role": "user", "content": f"<image>{question}"},
            {"role": "assistant", "content": answer},
        ],
        "images": [str(images / f"{i}.png")],
    }


def _common(steps: int) -> dict:
    return {"max_steps": steps, "learning_rate": 1e-3, "seed": 42}


def llamafactory_command(venv: Path, fx: Path, mode: str, out: Path, steps: int) -> list[str]:
    data = fx / "llamafactory-data"
    data.mkdir(exist_ok=True)
    (data / "tiny.json").write_text(json.dumps([_messages(fx / "images", i) for i in range(SAMPLES)]))
    info = {
        "tiny": {
            "file_name": "tiny.json",
            "formatting": "sharegpt",
            "columns": {"messages": "messages", "images": "images"},
            "tags": {
                "role_tag": "role",
                "content_tag": "content",
                "user_tag": "user",
                "assistant_tag": "assistant",
            },
        }
    }
    (data / "dataset_info.json").write_text(json.dumps(info))
    config = {
        "model_name_or_path": str(fx / "ckpt"),
        "stage": "sft",
        "do_train": True,
        "finetuning_type": mode,
        **({"lora_rank": 8, "lora_target": "all"} if mode == "lora" else {"freeze_vision_tower": False}),
        "dataset": "tiny",
        "dataset_dir": str(data),
        "template": "qwen3_vl_nothink",
        "cutoff_len": 256,
        "overwrite_cache": True,
        "preprocessing_num_workers": 1,
        "dataloader_num_workers": 0,
        "output_dir": str(out),
        "overwrite_output_dir": True,
        "logging_steps": 1,
        "save_strategy": "steps",
        "save_steps": steps,  # checkpoint-<steps>/trainer_state.json: the log history
        "report_to": "none",
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "lr_scheduler_type": "constant",
        "bf16": False,
        **_common(steps),
    }
    path = out.with_suffix(".yaml")
    path.write_text(json.dumps(config, indent=1))  # JSON is YAML
    return [str(venv / "bin" / "llamafactory-cli"), "train", str(path)]


def ms_swift_command(venv: Path, fx: Path, mode: str, out: Path, steps: int) -> list[str]:
    data = fx / "ms-swift-data.jsonl"
    data.write_text("".join(json.dumps(_messages(fx / "images", i)) + "\n" for i in range(SAMPLES)))
    c = _common(steps)
    args = {
        "model": str(fx / "ckpt"),
        "model_type": "qwen3_vl",
        "dataset": str(data),
        "tuner_type": mode,  # ms-swift 4.x (3.x: --train_type)
        "torch_dtype": "float32",
        "max_length": 256,
        "output_dir": str(out),
        "add_version": "false",
        "logging_steps": 1,
        "save_strategy": "steps",
        "save_steps": steps,
        "report_to": "none",
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "lr_scheduler_type": "constant",
        "warmup_ratio": 0,
        "split_dataset_ratio": 0,
        "dataloader_num_workers": 0,
        "dataset_num_proc": 1,
        "max_steps": c["max_steps"],
        "learning_rate": c["learning_rate"],
        "seed": c["seed"],
        **({"lora_rank": 8, "target_modules": "all-linear"} if mode == "lora" else {"freeze_vit": "false"}),
    }
    return [str(venv / "bin" / "swift"), "sft", *[x for k, v in args.items() for x in (f"--{k}", str(v))]]


def axolotl_command(venv: Path, fx: Path, mode: str, out: Path, steps: int) -> list[str]:
    data = fx / "axolotl-data.jsonl"
    rows = []
    for i in range(SAMPLES):
        question, answer = sample_text(i)
        rows.append(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "path": str(fx / "images" / f"{i}.png")},
                            {"type": "text", "text": question},
                        ],
                    },
                    {"role": "assistant", "content": [{"type": "text", "text": answer}]},
                ]
            }
        )
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {
        "base_model": str(fx / "ckpt"),
        "processor_type": "AutoProcessor",
        "skip_prepare_dataset": True,
        "remove_unused_columns": False,
        "sample_packing": False,
        "chat_template": "qwen2_vl",
        "datasets": [{"path": str(data), "type": "chat_template", "ds_type": "json"}],
        "output_dir": str(out),
        "sequence_len": 256,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": "adamw_torch",
        "lr_scheduler": "constant",
        "logging_steps": 1,
        "save_strategy": "steps",
        "save_steps": steps,
        "bf16": False,
        "fp16": False,
        "tf32": False,
        "val_set_size": 0,
        "dataloader_num_workers": 0,
        **(
            {
                "adapter": "lora",
                "lora_r": 8,
                "lora_alpha": 16,
                "lora_target_linear": True,
                # axolotl's Triton LoRA kernels (on by default where they apply) are CUDA only
                "lora_mlp_kernel": False,
                "lora_qkv_kernel": False,
                "lora_o_kernel": False,
            }
            if mode == "lora"
            else {}
        ),
        **_common(steps),
    }
    path = out.with_suffix(".yml")
    path.write_text(json.dumps(config, indent=1))
    return [str(venv / "bin" / "axolotl"), "train", str(path)]


COMMANDS = {"llamafactory": llamafactory_command, "ms-swift": ms_swift_command, "axolotl": axolotl_command}


# ------------------------------------------------------------------------------------------- runs


@dataclass
class Run:
    framework: str
    version: str
    mode: str
    patched: bool
    preprocess: bool = False  # VLFAST_PREPROCESS=1 beside VLFAST_PATCH=1
    rc: int = -1
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)
    record: dict = field(default_factory=dict)
    log: str = ""


def run_once(
    fw: Framework,
    venv: Path,
    fx: Path,
    mode: str,
    patched: bool,
    steps: int,
    work: Path,
    preprocess: bool = False,
) -> Run:
    tag = f"{fw.name}-{mode}-{'patched' if patched else 'unpatched'}" + ("-preprocess" if preprocess else "")
    out = work / tag
    shutil.rmtree(out, ignore_errors=True)
    record = work / f"{tag}.record.jsonl"
    record.unlink(missing_ok=True)
    cmd = COMMANDS[fw.name](venv, fx, mode, out, steps)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLFAST_")}
    env.update(
        PATH=f"{venv / 'bin'}:{env.get('PATH', '')}",
        VIRTUAL_ENV=str(venv),
        VLFAST_RECORD=str(record),
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HOME=str(work / "hf-home"),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        WANDB_MODE="disabled",
        AXOLOTL_DO_NOT_TRACK="1",  # axolotl's telemetry: no network here
        DO_NOT_TRACK="1",
        DISABLE_VERSION_CHECK="1",  # LlamaFactory: its own check of the versions pip resolved
    )
    env.pop("PYTHONPATH", None)
    if patched:
        env["VLFAST_PATCH"] = "1"  # as docs/training.md says: in the launcher's environment
    if preprocess:
        env["VLFAST_PREPROCESS"] = "1"  # as docs/preprocessing.md says
    log = work / f"{tag}.log"
    start = time.monotonic()
    with log.open("w") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        try:
            done = subprocess.run(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=out.parent, timeout=RUN_TIMEOUT
            )
            rc = done.returncode
        except subprocess.TimeoutExpired:
            rc = 124
    run = Run(fw.name, fw.version, mode, patched, preprocess, rc, time.monotonic() - start, log=str(log))
    run.losses = losses_of(out)
    run.record = summarize_record(record)
    return run


def losses_of(out: Path) -> list[float]:
    """Each logged step's loss, from the longest trainer_state.json log history under ``out``."""
    best: list[float] = []
    for path in out.rglob("trainer_state.json"):
        history = json.loads(path.read_text()).get("log_history", [])
        losses = [h["loss"] for h in history if "loss" in h]
        if len(losses) > len(best):
            best = losses
    return best


def summarize_record(path: Path) -> dict:
    """The record's JSON lines (one per process that loaded vlfast), added up."""
    lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    s = {
        "processes": len(lines),
        "gemm": 0,
        "stock": 0,
        "unpatched_calls": 0,
        "unpatched": [],
        "replaced": [],
        "images_vlfast": 0,  # image processor calls VLFAST_PREPROCESS's swap answered
        "images_stock": {},  # ... and passed to transformers' code, by reason
    }
    for r in lines:
        images = r.get("image_processor_calls") or {}
        s["images_vlfast"] += images.get("vlfast", 0)
        for why, n in (images.get("stock") or {}).items():
            s["images_stock"][why] = s["images_stock"].get(why, 0) + n
        s["gemm"] += r.get("gemm_calls", 0)
        s["stock"] += r.get("stock_calls", 0)
        s["unpatched_calls"] += r.get("unpatched_calls", 0)
        s["unpatched"] += [u["name"] for u in r.get("unpatched", []) if u.get("calls")]
        s["replaced"] += [
            c["forward_replaced"]
            for c in r.get("convs", []) + r.get("unpatched", [])
            if c.get("forward_replaced")
        ]
    s["unpatched"] = sorted(set(s["unpatched"]))
    s["replaced"] = sorted(set(s["replaced"]))
    return s


def verdict(
    stock: Run, fast: Run, steps: int, rtol: float, weights: dict | None = None
) -> tuple[bool, str, float | None]:
    """(passed, why, max relative loss difference) for one framework and mode; ``weights`` (full training:
    :func:`patch_embed_weights`) must show the patch embed trained in both runs."""
    for run in (stock, fast):
        if run.rc != 0:
            return False, f"{'patched' if run.patched else 'unpatched'} run exited {run.rc}: {run.log}", None
        if len(run.losses) != steps:
            return False, f"{len(run.losses)} of {steps} losses logged: {run.log}", None
    if not fast.record["processes"]:
        return False, f"no record line from the patched run (vlfast's patch never loaded): {fast.log}", None
    diff = max(abs(a - b) / abs(b) for a, b in zip(fast.losses, stock.losses))
    r0, r1 = stock.record, fast.record
    if r0["gemm"]:  # VLFAST_RECORD alone loads no patch: no line at all, or one without GEMM calls
        return False, "the unpatched control ran vlfast's GEMM", diff
    if r1["replaced"]:
        # the framework's own class-level forward: vlfast's GEMM is not reached, and the record must say so
        if r1["stock"]:
            return False, "stock calls under a replaced forward", diff
    elif not r1["gemm"] or r1["stock"] or r1["unpatched_calls"]:
        return False, "the patched run's record does not show every call on the GEMM", diff
    if diff > rtol:
        return False, f"losses differ by {diff:.3g} relative (> {rtol:g})", diff
    if weights is not None and not (weights.get("moved_unpatched") and weights.get("moved_patched")):
        return False, "full training left the patch embed's weight where it was (vision tower frozen?)", diff
    why = (
        f"forward replaced by {', '.join(r1['replaced'])}, named by the record" if r1["replaced"] else "GEMM"
    )
    return True, why, diff


def preprocess_verdict(patched: Run, both: Run, steps: int, rtol: float) -> tuple[bool, str, float | None]:
    """(passed, why, max relative loss difference) of the run with VLFAST_PREPROCESS=1 against the patched run
    without it: the same losses (the same pixels), every image processor call answered by vlfast."""
    if both.rc != 0:
        return False, f"the VLFAST_PREPROCESS run exited {both.rc}: {both.log}", None
    if len(both.losses) != steps or len(patched.losses) != steps:
        return False, f"{len(both.losses)} of {steps} losses logged: {both.log}", None
    diff = max(abs(a - b) / abs(b) for a, b in zip(both.losses, patched.losses))
    r = both.record
    if not r["images_vlfast"]:
        return False, "no image processor call answered by vlfast (not swapped: see the log)", diff
    if r["images_stock"]:
        return False, f"image processor calls ran transformers' code: {r['images_stock']}", diff
    if diff > rtol:
        return False, f"losses differ from the patched run's by {diff:.3g} relative (> {rtol:g})", diff
    return True, f"{r['images_vlfast']} image processor calls by vlfast, 0 stock", diff


def record_text(r: dict) -> str:
    text = f"{r['gemm']} GEMM, {r['stock']} stock"
    if r["unpatched"]:
        text += f", not patched: {', '.join(r['unpatched'])} ({r['unpatched_calls']} calls)"
    if r["replaced"]:
        text += f", forward replaced by {', '.join(r['replaced'])}"
    return text


# ------------------------------------------------------------------------------------------- main


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in lscpu.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
        if "avx512f" in lscpu:
            model += ", AVX-512"
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only", default=",".join(FRAMEWORKS), help="comma-separated: " + ", ".join(FRAMEWORKS)
    )
    parser.add_argument("--modes", default="lora,full", help="comma-separated: lora, full")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"training steps per run (default {STEPS})")
    parser.add_argument(
        "--rtol", type=float, default=RTOL, help=f"largest relative loss difference (default {RTOL:g})"
    )
    parser.add_argument("--cache", type=Path, default=CACHE, help=f"where the venvs live (default {CACHE})")
    parser.add_argument("--torch", default=TORCH, help=f"the torch release each venv pins (default {TORCH})")
    parser.add_argument("--fresh", action="store_true", help="recreate the venvs instead of reusing them")
    parser.add_argument(
        "--work", type=Path, help="where runs, logs and results go (default: a temporary folder, kept)"
    )
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(names) - set(FRAMEWORKS))
    if unknown:
        parser.error(f"unknown framework(s) {', '.join(unknown)}: choose from {', '.join(FRAMEWORKS)}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(modes) - {"lora", "full"}:
        parser.error("--modes takes lora and/or full")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    work = args.work or Path(tempfile.mkdtemp(prefix="vlfast-framework-runs-"))
    work.mkdir(parents=True, exist_ok=True)
    args.cache.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"vlfast framework runs, {when}, {machine()}; work folder {work}", flush=True)
    rows, failed = [], 0
    for name in names:
        fw = FRAMEWORKS[name]
        python, where = find_python(fw.python)
        if python is None:
            print(
                f"{name} {fw.version}: skipped: {fw.name} {fw.version} needs Python >= {fw.python}; {where}"
            )
            rows.append(
                {"framework": name, "version": fw.version, "skipped": f"needs Python {fw.python}: {where}"}
            )
            continue
        venv = venv_dir(fw, args.cache, args.torch)
        t0 = time.monotonic()
        try:
            notes = ensure_venv(
                fw, python, venv, args.cache, args.torch, args.fresh, work / f"{name}-pip.log"
            )
        except (RuntimeError, subprocess.CalledProcessError) as e:
            print(f"{name} {fw.version}: FAILED to install: {e}")
            rows.append({"framework": name, "version": fw.version, "failed": f"install: {e}"})
            failed += 1
            continue
        vers = versions(venv)
        print(f"{name} {fw.version}: venv {venv} ready in {time.monotonic() - t0:.0f} s ({python}): "
              + ", ".join(f"{k} {v}" for k, v in vers.items()), flush=True)  # fmt: skip
        for note in notes:
            print(f"  note: {note}")
        fx = work / f"{name}-fixture"
        done = subprocess.run(
            [str(venv / "bin" / "python"), __file__, "_fixture", str(fx)], capture_output=True, text=True
        )
        if done.returncode:
            print(f"{name}: FAILED to build the tiny Qwen3-VL:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
            rows.append({"framework": name, "version": fw.version, "failed": "fixture"})
            failed += 1
            continue
        for mode in modes:
            if mode not in fw.modes:
                continue
            runs = []
            for patched, preprocess in ((False, False), (True, False), (True, True)):
                run = run_once(fw, venv, fx, mode, patched, args.steps, work, preprocess)
                runs.append(run)
                what = ("patched" if patched else "unpatched") + (
                    " + VLFAST_PREPROCESS" if preprocess else ""
                )
                images = f", image processor calls: {run.record['images_vlfast']} by vlfast, stock "
                images += str(run.record["images_stock"] or 0)
                print(f"  {mode} {what}: exit {run.rc}, {run.seconds:.0f} s, losses {run.losses}, "
                      f"record {record_text(run.record)}{images}", flush=True)  # fmt: skip
            weights = None
            if mode == "full":  # the vision tower trains: the patch embed's weight must have moved
                done = subprocess.run(
                    [str(venv / "bin" / "python"), __file__, "_weights", str(fx / "ckpt"),
                     str(work / f"{name}-full-unpatched"), str(work / f"{name}-full-patched")],
                    capture_output=True, text=True,
                )  # fmt: skip
                weights = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {}
                print(f"  patch embed weight: {weights or done.stderr[-2000:]}", flush=True)
            ok, why, diff = verdict(runs[0], runs[1], args.steps, args.rtol, weights)
            pre_ok, pre_why, pre_diff = preprocess_verdict(runs[1], runs[2], args.steps, args.rtol)
            failed += (not ok) + (not pre_ok)
            rows.append({
                "framework": name, "version": fw.version, "mode": mode, "steps": len(runs[1].losses),
                "max_rel_loss_diff": diff, "record": runs[1].record, "control_record": runs[0].record,
                "losses": {"unpatched": runs[0].losses, "patched": runs[1].losses},
                "verdict": ("pass: " if ok else "FAIL: ") + why, "versions": vers, "notes": notes,
                "seconds": [round(r.seconds) for r in runs], "patch_embed_weight": weights,
                "preprocess": {
                    "verdict": ("pass: " if pre_ok else "FAIL: ") + pre_why, "max_rel_loss_diff": pre_diff,
                    "losses": runs[2].losses, "record": runs[2].record,
                },
            })  # fmt: skip
    print_table(rows)
    total = time.monotonic() - started
    print(f"\n{total:.0f} s in all; logs and outputs in {work}")
    if args.json:
        args.json.write_text(
            json.dumps({"date": when, "machine": machine(), "seconds": total, "rows": rows}, indent=1)
        )
    return 1 if failed else 0


def print_table(rows: list[dict]) -> None:
    head = ["framework", "version", "mode", "steps", "max rel. loss diff", "record (patched run)"]
    head += ["patch embed weight (full)", "verdict", "VLFAST_PREPROCESS=1 beside it: loss diff, verdict"]
    lines = []
    for r in rows:
        if "mode" not in r:
            lines.append(
                [r["framework"], r["version"], *["-"] * 5, r.get("skipped") or "FAIL: " + r["failed"], "-"]
            )
            continue
        v = r["versions"]
        version = f"{r['version']} (transformers {v.get('transformers')}, torch {v.get('torch')})"
        diff = "-" if r["max_rel_loss_diff"] is None else f"{r['max_rel_loss_diff']:.2g}"
        w = r.get("patch_embed_weight")
        moved = "-"
        if w:
            moved = f"moved {w['moved_patched']:.2g}; runs differ {w['patched_vs_unpatched']:.2g}"
        line = [r["framework"], version, r["mode"], str(r["steps"]), diff, record_text(r["record"]), moved]
        pre = r["preprocess"]
        pre_diff = "-" if pre["max_rel_loss_diff"] is None else f"{pre['max_rel_loss_diff']:.2g}"
        lines.append([*line, r["verdict"], f"{pre_diff}; {pre['verdict']}"])
    print(f"\n| {' | '.join(head)} |\n|{'---|' * len(head)}")
    for line in lines:
        print(f"| {' | '.join(line)} |")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "_fixture":
        build_fixture(Path(sys.argv[2]))
        sys.exit(0)
    if len(sys.argv) == 5 and sys.argv[1] == "_weights":
        print(json.dumps(patch_embed_weights(*map(Path, sys.argv[2:]))))
        sys.exit(0)
    sys.exit(main())
