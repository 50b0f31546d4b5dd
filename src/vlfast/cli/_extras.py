"""What the optional extras provide, and the check a command runs before it imports from one.

The core install needs torch, numpy, transformers >= 4.45, safetensors, typer and rich (it installs beside
frameworks that pin an older transformers). Extraction needs the ``extract`` extra (Parquet, xxhash, PIL,
av; transformers 5.18, the first whose ``AutoImageProcessor`` works without torchvision): a command that
needs it says so and exits 2 before it does anything, instead of failing half-way on an ImportError.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Callable

# extra -> the modules its packages provide (import names), as pyproject.toml's optional-dependencies lists them
MODULES: dict[str, tuple[str, ...]] = {"extract": ("pyarrow", "av", "xxhash", "PIL")}
# extra -> the transformers it needs (pyproject.toml: the extract extra's transformers floor)
TRANSFORMERS: dict[str, tuple[int, int]] = {"extract": (5, 18)}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses it; a module in sys.modules without a spec
        return False


def _transformers_version() -> str | None:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, int]:
    major, minor = (version.split(".") + ["0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def missing(
    extra: str,
    *,
    models: bool = True,
    only: tuple[str, ...] | None = None,
    importable: Callable[[str], bool] | None = None,
    transformers_version: str | None = "installed",
) -> list[str]:
    """What of ``extra`` is not installed here: module names, and ``transformers>=X.Y (installed: V)`` unless
    ``models=False`` (a command that reads or writes the store but builds no model); ``only``: just these of
    its modules. ``importable`` and ``transformers_version`` replace what is read from this environment (tests)."""
    out = [m for m in only or MODULES.get(extra, ()) if not (importable or _importable)(m)]
    floor = TRANSFORMERS.get(extra) if models else None
    if floor is not None:
        version = _transformers_version() if transformers_version == "installed" else transformers_version
        if version is None or _release(version) < floor:
            out.append(f"transformers>={floor[0]}.{floor[1]} (installed: {version or 'none'})")
    return out


def require(extra: str, command: str, *, models: bool = True, only: tuple[str, ...] | None = None) -> None:
    """Raise ImportError (the CLI's exit 2, "missing dependency") naming the extra and its install line when
    anything ``extra`` provides (or ``only`` these of its modules) is missing."""
    gaps = missing(extra, models=models, only=only)
    if gaps:
        raise ImportError(
            f"{command} needs the {extra} extra ({', '.join(gaps)} missing): pip install 'vlfast[{extra}]'"
        )
