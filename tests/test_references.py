"""The built-in references are plain data (``vlfast.models.references``): `vlfast models` lists them without torch,
and what the table states is what the builders produce."""

from __future__ import annotations

import subprocess
import sys

import pytest
from torch import nn

from _transformers_support import references
from vlfast.models import build_reference
from vlfast.models.references import REFERENCES

HEAVY = ("torch", "transformers", "numpy")


@pytest.mark.parametrize("name", references())
def test_the_table_states_what_the_builder_builds(name):
    """depth, width, heads, patch and output width of `vlfast models` against the tower built on meta."""
    ref = REFERENCES[name]
    tower = build_reference(name, device="meta")
    conv = next(m for m in tower.modules() if isinstance(m, nn.Conv3d))
    merger = [m for n, m in tower.named_modules() if n.startswith("merger") and isinstance(m, nn.Linear)]
    t, p = ref.patch
    assert len(tower.blocks) == ref.depth
    assert conv.out_channels == ref.width
    assert tuple(conv.kernel_size) == (t, p, p)
    assert tower.config.num_heads == ref.heads
    assert merger[-1].out_features == ref.out_width
    assert tower.config.model_type.removesuffix("_vision") == ref.family


@pytest.mark.parametrize("argv", [["-h"], ["models"], ["models", "--json"]], ids=" ".join)
def test_answers_without_torch(argv):
    """`vlfast -h` and `vlfast models` answer at once: none of torch, transformers or numpy is imported."""
    code = (
        "import sys\n"
        "from vlfast.cli.main import app\n"
        f"try:\n    app({argv!r})\n"
        "except SystemExit as e:\n    assert not e.code, e.code\n"
        f"print('HEAVY', [m for m in {HEAVY!r} if m in sys.modules], file=sys.stderr)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stderr, out.stderr
    assert "qwen3-vl-4b" in out.stdout or argv == ["-h"]
