"""The README's and docs' examples run: a tagged example that breaks fails here.

A fenced block is run when the line right before its opening fence is ``<!-- docs-test -->`` (invisible
on GitHub). Each tagged block is a test of its own, ``README.md#3`` being the README's third tagged block,
so one slow block cannot spend another's timeout. Shell blocks run under ``bash -eo pipefail``, Python
blocks under this interpreter, each in one subprocess. One file's blocks run in order in one folder, in
one pytest-xdist worker (an ``xdist_group`` per file), so a block may use what an earlier one wrote (the
README's tour builds ``tiny-ckpt`` once); a block whose earlier block failed is skipped, and a block
selected alone runs the earlier blocks of its file first, each once. Every Python block, tagged or not,
must at least compile.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = "<!-- docs-test -->"
FENCE = re.compile(r"^```\s*([\w+-]*)")
SHELL, PYTHON = ("bash", "sh", "shell", "console"), ("python", "py")
BLOCK_TIMEOUT_S = 120  # one block (a test of its own: pytest-timeout's 300 s is per block too)


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    tagged: bool

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line} ({self.lang or 'no language'})"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a markdown file; raises if a marker is not right before a fence."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.strip() == MARKER and not (i + 1 < len(lines) and FENCE.match(lines[i + 1])):
            raise ValueError(
                f"{path.relative_to(ROOT)}:{i + 1}: {MARKER} must be the line right before a ```"
            )
        m = FENCE.match(line)
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise ValueError(f"{path.relative_to(ROOT)}:{i + 1}: unclosed code fence")
        tagged = i > 0 and lines[i - 1].strip() == MARKER
        out.append(Block(path, i + 1, m.group(1).lower(), "\n".join(lines[i + 1 : end]) + "\n", tagged))
        i = end + 1
    return out


def _tagged_files() -> list[Path]:
    return [p for p in DOCS if any(b.tagged for b in blocks(p))]


def test_markers_sit_on_runnable_blocks():
    for path in DOCS:
        for b in blocks(path):
            if b.tagged:
                assert b.lang in SHELL + PYTHON, f"{b}: only shell and Python blocks can be run"
    assert ROOT / "README.md" in _tagged_files(), "the README's tour must stay tagged"


def test_python_blocks_compile():
    bad = []
    for path in DOCS:
        for b in blocks(path):
            if b.lang in PYTHON:
                try:
                    compile(b.code, str(b), "exec")
                except SyntaxError as e:
                    bad.append(f"{b}: {e.msg} (block line {e.lineno})")
    assert not bad, "\n".join(bad)


def _tagged_blocks() -> list:
    """One pytest param per tagged block: (file, its number among the file's tagged blocks, 1-based)."""
    params = []
    for path in _tagged_files():
        name = str(path.relative_to(ROOT))
        tagged = [b for b in blocks(path) if b.tagged]
        for number in range(1, len(tagged) + 1):
            with warnings.catch_warnings():  # xdist's mark is unknown under `-p no:xdist`, and unused there
                warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
                marks = [pytest.mark.slow, pytest.mark.xdist_group(f"docs:{name}")]
            params.append(pytest.param(path, number, id=f"{name}#{number}", marks=marks))
    return params


@dataclass
class _FileRun:
    """One file's tagged blocks as they run, in order, in one folder."""

    folder: Path
    results: dict[int, subprocess.CompletedProcess] = field(default_factory=dict)  # block number -> its run
    failed: str | None = None  # the first block that failed


def _run_block(b: Block, folder: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # this checkout's vlfast, in the `vlfast` command too (its console script imports the package)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env.pop("VLFAST_PATCH", None)
    # `vlfast` and `python` in a shell block are this interpreter's, as if its venv were activated: run as
    # venv/bin/python -m pytest without activating it, PATH would find another one, or none (issue 46)
    scripts = dict.fromkeys([sysconfig.get_path("scripts"), str(Path(sys.executable).parent)])
    env["PATH"] = os.pathsep.join(filter(None, [*scripts, env.get("PATH")]))
    cmd = ["bash", "-eo", "pipefail", "-c", b.code] if b.lang in SHELL else [sys.executable, "-c", b.code]
    try:
        return subprocess.run(
            cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as e:  # a failure like any other: the blocks after it are skipped
        out, err = (
            s.decode(errors="replace") if isinstance(s, bytes) else s or "" for s in (e.stdout, e.stderr)
        )
        return subprocess.CompletedProcess(cmd, -9, out, err + f"\n(killed after {BLOCK_TIMEOUT_S} s)")


def _report(b: Block, run: subprocess.CompletedProcess) -> str:
    return (
        f"{b} exited {run.returncode}\n--- block\n{b.code}--- stdout\n{run.stdout[-3000:]}"
        f"--- stderr\n{run.stderr[-3000:]}"
    )


@pytest.fixture(scope="module")
def docs_runs() -> dict[Path, _FileRun]:
    """Each tagged file's folder and the runs of its blocks so far: one per file for the module."""
    return {}


@pytest.mark.parametrize(("path", "number"), _tagged_blocks())
def test_tagged_block_runs(path: Path, number: int, docs_runs: dict[Path, _FileRun], tmp_path_factory):
    name = str(path.relative_to(ROOT))
    if path not in docs_runs:
        docs_runs[path] = _FileRun(tmp_path_factory.mktemp(name.replace("/", "_")))
    state = docs_runs[path]
    tagged = [b for b in blocks(path) if b.tagged]
    for k in range(1, number + 1):  # the earlier blocks first, where this process has not run them
        if k in state.results:
            continue
        if state.failed is not None:
            pytest.skip(f"{state.failed} failed; this block may need what that one makes")
        state.results[k] = _run_block(tagged[k - 1], state.folder)
        if state.results[k].returncode != 0:
            state.failed = str(tagged[k - 1])
            assert k == number, "an earlier block, run first, failed:\n" + _report(
                tagged[k - 1], state.results[k]
            )
    assert state.results[number].returncode == 0, _report(tagged[number - 1], state.results[number])


LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_resolve():
    """A link to a moved section (README -> docs/benchmarks.md) must follow it."""
    bad = []
    for path in DOCS:
        for target in LINK.findall(path.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                bad.append(f"{path.relative_to(ROOT)}: {target}: no such file")
            elif anchor and dest.suffix == ".md":
                headings = [
                    line.lstrip("#") for line in dest.read_text().splitlines() if line.startswith("#")
                ]
                if anchor not in {_anchor(h) for h in headings}:
                    bad.append(f"{path.relative_to(ROOT)}: {target}: no such heading")
    assert not bad, "\n".join(bad)


def test_ci_reruns_the_cpu_kernels_tests_limited_to_avx2():
    """.ci/run's second pass (issue 46) names every test file holding a test marked cpu_kernels, under the
    three limits."""
    marked = sorted(
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "tests").glob("test_*.py")
        if re.search(r"^@pytest\.mark\.cpu_kernels$", p.read_text(), re.MULTILINE)
    )
    (line,) = [
        x
        for x in (ROOT / ".ci" / "run").read_text().replace("\\\n", " ").splitlines()
        if "-m cpu_kernels" in x
    ]
    assert len(marked) >= 4 and all(f in line.split() for f in marked), (marked, line)
    assert line.startswith(
        "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python -m pytest"
    )


def test_readme_test_command_is_what_ci_runs():
    """The README's set-up command 2 and .ci/run install and test alike (CI's log shows --durations=25)."""

    def command(text: str) -> str:
        (line,) = [line for line in text.splitlines() if "python -m pytest" in line and "pip install" in line]
        return line.replace("pip install -q ", "pip install ").strip()  # CI's pip is quiet

    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    assert command(readme) == command(ci)
    assert "--durations=25" in command(ci)


def _words(path: Path) -> int:
    return len(path.read_text().split())


def test_docs_stay_within_their_word_budget():
    """Issue 53: a newcomer reads the README in minutes; the docs say each fact once. Words as
    ``len(text.split())``; a page that grows past its budget must lose words elsewhere, not raise it."""
    words = {str(p.relative_to(ROOT)): _words(p) for p in DOCS}
    assert words["README.md"] <= 1600, words["README.md"]
    assert words["docs/extract.md"] <= 5000, words["docs/extract.md"]
    assert sum(words.values()) <= 30000, words


def test_internals_names_every_module():
    """Issue 52 item 6: docs/internals.md's "Where the code lives" names every module of src/vlfast, and
    nothing that is not one: a table row per package (its folder first, as `vlfast/extraction/store/`),
    each module by file name in the rest of the row. A module added, moved or renamed fails here until the
    table says so."""
    text = (ROOT / "docs" / "internals.md").read_text()
    assert "\n## Where the code lives\n" in text, "internals.md lost its 'Where the code lives' section"
    section = text.split("\n## Where the code lives\n", 1)[1].split("\n## ", 1)[0]
    named: set[str] = set()  # module paths under src/
    for row in re.finditer(r"^\| `(vlfast/(?:\w+/)*)` \|(.*)$", section, re.MULTILINE):
        for name in re.findall(r"`(\w+\.py)`", row.group(2)):
            assert row.group(1) + name not in named, f"{row.group(1) + name} is named twice"
            named.add(row.group(1) + name)
    src = ROOT / "src"
    modules = {
        p.relative_to(src).as_posix() for p in (src / "vlfast").rglob("*.py") if p.name != "__init__.py"
    }
    assert len(modules) > 50, modules  # the tree was found
    missing, stale = sorted(modules - named), sorted(named - modules)
    assert not missing, f"modules docs/internals.md does not name: {missing}"
    assert not stale, f"docs/internals.md names modules that do not exist: {stale}"


CLI_CALL = re.compile(r"\bvlfast(?:\.cli\.main)?((?:\s+[a-z][\w-]*)*)((?:\s+[^\s|;&#`]+)*)")


def _cli_options() -> dict[tuple[str, ...], set[str]]:
    """Each command path of the ``vlfast`` CLI and the option names its ``--help`` lists."""
    import typer

    from vlfast.cli.main import app

    def walk(cmd, path=()):
        names = {"--help", "-h"}
        for p in cmd.params:
            names.update(o for o in [*p.opts, *p.secondary_opts] if o.startswith("-"))
        yield path, names
        for name, sub in getattr(cmd, "commands", {}).items():
            yield from walk(sub, (*path, name))

    return dict(walk(typer.main.get_command(app)))


def _command_lines(text: str) -> list[str]:
    """Shell lines of fenced blocks (continuations joined) and inline code spans."""
    out, fenced = [], False
    for line in text.replace("\\\n", " ").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced:
            out.append(line)
        else:
            out.extend(re.findall(r"`([^`]+)`", line))
    return out


def test_documented_options_are_the_cli_s():
    """Every `vlfast COMMAND --option` the README and docs show is an option that command's --help lists
    (issue 53: the CLI reference checked against --help), so a renamed or removed option cannot stay
    documented."""
    options = _cli_options()
    bad = []
    for path in DOCS:
        for line in _command_lines(path.read_text()):
            for m in CLI_CALL.finditer(line.split(" #")[0]):
                words = m.group(1).split()
                while tuple(words) not in options:  # the longest prefix that is a command
                    words.pop()
                known = options[tuple(words)] | options[()]
                rest = m.group(1).split()[len(words) :] + m.group(2).split()
                for flag in (w.split("=")[0] for w in rest if re.match(r"--?[a-z]", w)):
                    if flag not in known and not re.fullmatch(r"-\d.*", flag):
                        bad.append(
                            f"{path.relative_to(ROOT)}: vlfast {' '.join(words)} {flag}: {line.strip()}"
                        )
    assert not bad, "\n".join(bad)
