"""Rules of the source tree that no linter we use checks: read from the code's syntax, nothing is imported.

The import layers and cycles are import-linter's job (`lint-imports`, contracts in pyproject.toml; `.ci/run`
runs it). Here: no module reaches into another module's private names, and functions stay short.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "vlfast"
LONGEST = 80  # lines a function anywhere in vlfast may take (issue 52)


def _module(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _target(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_reach_ins(root: Path = PACKAGE) -> list[str]:
    """``path:line: module takes other._name`` for each import of, or attribute read of, another module's private name."""
    src = root.parent
    modules = {_module(p, src) for p in root.rglob("*.py")}
    found = []
    for path in sorted(root.rglob("*.py")):
        me = _module(path, src)
        tree = ast.parse(path.read_text(), str(path))
        aliases: dict[str, str] = {}  # local name -> vlfast module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = _target(node, me, path.name == "__init__.py")
                if not target.startswith("vlfast"):
                    continue
                for a in node.names:
                    if f"{target}.{a.name}" in modules:  # a submodule, not a name
                        aliases[a.asname or a.name] = f"{target}.{a.name}"
                    elif _private(a.name) and target != me:
                        found.append(f"{path.relative_to(src)}:{node.lineno}: {me} takes {target}.{a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("vlfast") and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and _private(node.attr)
                and aliases[node.value.id] != me
            ):
                found.append(
                    f"{path.relative_to(src)}:{node.lineno}: {me} takes {aliases[node.value.id]}.{node.attr}"
                )
    return found


def long_functions(root: Path = PACKAGE, limit: int = LONGEST) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {node.name} is {lines} lines")
    return found


def test_no_module_takes_another_modules_private_names():
    assert private_reach_ins() == []


def test_no_function_is_over_80_lines():
    assert long_functions() == []


def test_the_checks_find_what_they_look_for(tmp_path):
    pkg = tmp_path / "vlfast" / "extraction"
    pkg.mkdir(parents=True)
    (tmp_path / "vlfast" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def _helper():\n    pass\n\n\ndef public():\n" + "    x = 1\n" * 81)
    (pkg / "b.py").write_text(
        "from vlfast.extraction.a import _helper\n"
        "from . import a\n"
        "import vlfast.extraction.a as mod\n"
        "mod._helper()\n"
        "a._helper()\n"
        "from .a import public\n"
    )
    found = private_reach_ins(tmp_path / "vlfast")
    assert len(found) == 3 and all("vlfast.extraction.a._helper" in f for f in found), found
    assert [f.split(": ", 1)[1] for f in long_functions(pkg)] == ["public is 82 lines"]


# OUT's files and the format's names for them: only extraction/store/ names them; everything else asks its
# one door, vlfast.extraction.store.out.Out (issue 52). A name spelt out, or the format's constant for it.
OUT_FILES = frozenset(
    {
        "run.json",
        "index",
        "shards",
        "errors",
        "listings",
        "quarantine",
        "locks",
        "inputs",
        "checked.json",
        "facts.json",
    }
)
OUT_NAMES = frozenset(
    {
        *("RUN_FILE", "INDEX_DIR", "SHARD_DIR", "ERROR_DIR", "LISTING_DIR", "QUARANTINE_DIR", "LOCK_DIR"),
        *("CHECK_FILE", "FACTS_FILE", "INPUTS_DIR", "SHARD_RE", "PART_RE", "COMPACT_RE", "ERRORS_RE"),
        *("read_run_file", "list_names"),
    }
)


def out_names_outside_store(root: Path = PACKAGE) -> list[str]:
    """``path:line: name`` of every place outside extraction/store/ that names one of OUT's files."""
    store = root / "extraction" / "store"
    found = []
    for path in sorted(root.rglob("*.py")):
        if store in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in OUT_FILES:
                name = node.value
            else:
                name = getattr(node, "id", None) or getattr(node, "attr", None) or getattr(node, "name", None)
                if not isinstance(node, (ast.Name, ast.Attribute, ast.alias)) or name not in OUT_NAMES:
                    continue
            found.append(f"{path.relative_to(root)}:{node.lineno}: {name}")
    return found


def test_only_the_store_names_outs_files():
    found = out_names_outside_store()
    assert found == [], found


def test_the_door_check_finds_what_it_looks_for(tmp_path):
    (tmp_path / "extraction" / "store").mkdir(parents=True)
    (tmp_path / "extraction" / "store" / "format.py").write_text('RUN_FILE = "run.json"\n')
    (tmp_path / "plan.py").write_text(
        'from vlfast.extraction.store.format import RUN_FILE\nx = out / "index"\nnote = "an index of it"\n'
    )
    assert out_names_outside_store(tmp_path) == ["plan.py:1: RUN_FILE", "plan.py:2: index"]


def test_only_models_ref_reads_a_model_spec_s_prefix():
    """What --model names is read by vlfast.models.ModelRef (issue 52): no other module tests for ``ref:``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent.name == "models":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", None) in ("startswith", "removeprefix")
                and any(
                    (isinstance(a, ast.Constant) and a.value == "ref:")
                    or getattr(a, "attr", None) == "REF_PREFIX"
                    or getattr(a, "id", None) == "REF_PREFIX"
                    for a in node.args
                )
            ):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert found == [], found
