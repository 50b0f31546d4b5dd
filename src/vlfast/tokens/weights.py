"""Memory-mapped access to a checkpoint's input embedding and lm_head (one file, a sharded index or any
`*.safetensors`), without building the model: a 152k x 4k bf16 matrix is read from the page cache.
"""

from __future__ import annotations

import json
import struct
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from vlfast.errors import InputRefused

# Name endings of the token-embedding and output-projection tensors across families (Qwen/Llama
# `embed_tokens`, BERT `word_embeddings`, GPT-2 `wte`, InternLM `tok_embeddings`, GPT-NeoX `embed_out`).
INPUT_NAMES = ("embed_tokens.weight", "word_embeddings.weight", "wte.weight", "tok_embeddings.weight")
OUTPUT_NAMES = ("lm_head.weight", "embed_out.weight", "output.weight")


def _matches(name: str, endings: tuple[str, ...]) -> bool:
    return any(name == e or name.endswith("." + e) for e in endings)


def _preference(name: str) -> tuple[int, int]:
    # A VL checkpoint may hold several embeddings; the language model's is the one tags go through.
    text = "language_model" in name or "text_model" in name
    return (0 if text else 1, len(name))


def _tied_from_config(config: dict) -> bool | None:
    for scope in (config, config.get("text_config") or {}, config.get("llm_config") or {}):
        if isinstance(scope, dict) and "tie_word_embeddings" in scope:
            return bool(scope["tie_word_embeddings"])
    return None


@dataclass
class CheckpointWeights:
    """Where the embedding matrices of a checkpoint live, and how to read rows of them lazily."""

    model_dir: Path
    tensor_files: dict[str, Path]  # tensor name -> safetensors file holding it
    embedding_name: str
    lm_head_name: str | None  # None: no separate output matrix stored (tied)
    tied: bool
    config: dict = field(default_factory=dict)
    _headers: dict[Path, tuple[dict, int]] = field(default_factory=dict, repr=False)

    @classmethod
    def open(
        cls, model_dir: str | Path, embedding_name: str | None = None, lm_head_name: str | None = None
    ) -> CheckpointWeights:
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"{model_dir} is not a directory; pass --model a local checkpoint folder")
        tensor_files = _tensor_files(model_dir)
        config = {}
        if (model_dir / "config.json").is_file():
            try:
                config = json.loads((model_dir / "config.json").read_text())
            except json.JSONDecodeError as e:
                raise InputRefused(f"{model_dir / 'config.json'} is not valid JSON ({e})") from None
        w = cls(model_dir, tensor_files, "", None, False, config)  # names picked below, by w.shape
        shape, names = w.shape, list(tensor_files)
        if embedding_name is None:
            found = sorted(
                (n for n in names if _matches(n, INPUT_NAMES) and len(shape(n)) == 2), key=_preference
            )
            if not found:
                raise InputRefused(
                    f"no input-embedding tensor (…{', …'.join(INPUT_NAMES)}) in {model_dir}; "
                    "name it with --embedding-name"
                )
            embedding_name = found[0]
        elif embedding_name not in tensor_files or len(shape(embedding_name)) != 2:
            raise InputRefused(f"--embedding-name {embedding_name!r} is not a 2-D tensor in {model_dir}")
        if lm_head_name is None:
            # Only a matrix shaped like the embedding is the output projection (not a layer's output.weight).
            emb = shape(embedding_name)
            found = sorted(
                (n for n in names if _matches(n, OUTPUT_NAMES) and shape(n) == emb), key=_preference
            )
            lm_head_name = found[0] if found else None
        elif lm_head_name not in tensor_files or len(shape(lm_head_name)) != 2:
            raise InputRefused(f"--lm-head-name {lm_head_name!r} is not a 2-D tensor in {model_dir}")
        w.embedding_name, w.lm_head_name = embedding_name, lm_head_name
        # No stored lm_head: tied. A copy stored under a tying config is ignored on load; fix keeps it too.
        w.tied = lm_head_name is None or bool(_tied_from_config(config))
        return w

    def _header(self, path: Path) -> tuple[dict, int]:
        if path not in self._headers:
            self._headers[path] = read_header(path)
        return self._headers[path]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._header(self.tensor_files[name])[0][name]["shape"])

    def dtype(self, name: str) -> str:
        return self._header(self.tensor_files[name])[0][name]["dtype"]

    def matrix(self, name: str) -> torch.Tensor:
        """The tensor in its stored dtype, a read-only memory map: slicing reads only those rows, uncopied."""
        path = self.tensor_files[name]
        header, base = self._header(path)
        info = header[name]
        if info["dtype"] not in _DTYPES:
            raise InputRefused(
                f"{name} in {path.name} is {info['dtype']}; the audit reads floating-point weights "
                f"({', '.join(_DTYPES)}), dequantise the checkpoint first"
            )
        np_dtype, torch_view = _DTYPES[info["dtype"]]
        start, end = info["data_offsets"]
        mm = np.memmap(path, dtype=np_dtype, mode="r", offset=base + start, shape=tuple(info["shape"]))
        with warnings.catch_warnings():  # torch warns that the map is read-only; nothing writes to it
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(mm)
        return t.view(torch_view) if torch_view is not None else t

    def blocks(self, name: str, block_rows: int = 4096) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield (first_row, rows as float32) blocks of a 2-D tensor, `block_rows` at a time."""
        m = self.matrix(name)
        for start in range(0, m.shape[0], block_rows):
            yield start, m[start : start + block_rows].float()

    def rows(self, name: str, ids: list[int] | torch.Tensor) -> torch.Tensor:
        """Rows `ids` of a 2-D tensor as float32, (len(ids), D)."""
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        return self.matrix(name)[ids].float()


# safetensors dtype -> (numpy dtype to map the bytes with, torch dtype to view them as)
_DTYPES = {
    "BF16": (np.uint16, torch.bfloat16),  # numpy has no bfloat16: map the bits, view them in torch
    "F16": (np.float16, None),
    "F32": (np.float32, None),
    "F64": (np.float64, None),
}


def read_header(path: Path) -> tuple[dict, int]:
    """(header without __metadata__, offset of the data section) of a safetensors file."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise InputRefused(f"{path} is not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100_000_000:
            raise InputRefused(f"{path} is not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise InputRefused(f"{path} is not a safetensors file (unreadable header)") from None
    header.pop("__metadata__", None)
    try:
        end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
    except (TypeError, KeyError, IndexError, ValueError, AttributeError):
        raise InputRefused(f"{path} is not a safetensors file (header without data offsets)") from None
    size = path.stat().st_size
    if size < 8 + n + end:  # a copy cut short: numpy's memmap would fail without the file's name
        raise InputRefused(
            f"{path} is truncated: its header describes {8 + n + end:,} bytes but the file has {size:,}; "
            "copy or download it again"
        )
    return header, 8 + n


def check_weight_files(model_dir: str | Path) -> None:
    """Read every safetensors header of the checkpoint: a truncated or damaged file fails here, named."""
    for path in sorted(set(_tensor_files(Path(model_dir)).values())):
        read_header(path)


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise InputRefused(f"{index} has no weight_map; the sharded checkpoint index is damaged")
        files = {name: model_dir / shard for name, shard in weight_map.items()}
        missing = sorted({str(p) for p in files.values() if not p.is_file()})
        if missing:
            raise FileNotFoundError(f"shards listed in {index} are missing: {', '.join(missing[:3])}")
        return files
    paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(
            f"no *.safetensors in {model_dir}; convert the checkpoint to safetensors first "
            "(vlfast never unpickles .bin files)"
        )
    return {name: path for path in paths for name in read_header(path)[0]}
