"""Check what docs/training.md says about LlamaFactory, ms-swift and verl against their released source.

Each framework's wheel is fetched from PyPI without its dependencies (``pip download --no-deps``) into a
temporary folder (or read from ``--wheels DIR``, which holds ``<name>-<version>-*.whl`` files) and read as
text, never imported. Each claim is a pattern that must (or must not) occur in a named file of a named
release; the script prints one line per claim and exits 1 when any does not hold. A developer's tool: it
needs the network (PyPI), so no test runs it.

    python scripts/check_framework_claims.py            # ~60 MB of wheels, ~1 min
    python scripts/check_framework_claims.py --wheels /tmp/fw
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Claim:
    package: str  # the distribution on PyPI
    version: str
    path: str  # the file inside the wheel
    pattern: str  # a regular expression, searched in the file's text (re.S: it may span lines)
    says: str  # what docs/training.md says, in its words
    present: bool = True  # False: the pattern must not occur (or the file must not exist)


# The guard of LlamaFactory 0.9.5 (model/loader.py, load_model, after the weights are loaded):
# is_torch_version_greater_than is `>=` (extras/packages.py), so it refuses 2.9.0 <= torch < 2.10.0.
LF = ("llamafactory", "0.9.5")
_LF_GUARD = (
    r'is_torch_version_greater_than\("2\.9\.0"\) and not is_torch_version_greater_than\("2\.10\.0"\):\s*'
    r"if any\(isinstance\(m, torch\.nn\.Conv3d\) for m in model\.modules\(\)\):\s*raise ValueError"
)
# ms-swift replaces nn.Conv3d.forward for the whole class (a GEMM that raises NotImplementedError for any Conv3d
# that is not stride == kernel, padding 0): 3.11.2-3.12.x when SWIFT_PATCH_CONV3D is true; 4.0.0-4.0.1 by
# default on 2.9.0 < torch < 2.10.0, the variable turning it on or off; from 4.0.2 always on
# 2.9.0 <= torch < 2.10.0, no variable.
_SWIFT = {
    "opt-in": r"if strtobool\(os\.getenv\('SWIFT_PATCH_CONV3D', 'false'\)\):\s*_patch_conv3d\(\)",
    "default-on": r"SWIFT_PATCH_CONV3D = get_env_args\('SWIFT_PATCH_CONV3D', bool, None\).*?"
    r"if SWIFT_PATCH_CONV3D is None:.*?"
    r"SWIFT_PATCH_CONV3D = version\.parse\('2\.9\.0'\) < torch_version < version\.parse\('2\.10\.0'\).*?"
    r"if SWIFT_PATCH_CONV3D:\s*_patch_conv3d\(\)",
    "always": r"requires_patch = version\.parse\('2\.9\.0'\) <= version\.parse\(torch\.__version__\) < "
    r"version\.parse\('2\.10\.0'\)\s*if requires_patch:\s*_patch_conv3d\(\)",
}
_SWIFT_SAYS = {
    "opt-in": "SWIFT_PATCH_CONV3D=1 turns its Conv3d patch on",
    "default-on": "its Conv3d patch is on by default for 2.9.0 < torch < 2.10.0, SWIFT_PATCH_CONV3D=0/1 decides",
    "always": "its Conv3d patch is always on for 2.9.0 <= torch < 2.10.0 (no variable)",
}
_SWIFT_CLASS = r"nn\.Conv3d\.forward = forward"


def _swift(version: str, mode: str | None) -> list[Claim]:
    """The claims about one ms-swift release: which of the three forms (or none) it has."""
    path = "swift/llm/model/utils.py" if version.startswith("3.") else "swift/model/utils.py"
    claims = [Claim("ms-swift", version, path, _SWIFT[m], _SWIFT_SAYS[m], m == mode) for m in _SWIFT]
    if mode is not None:
        claims.append(
            Claim("ms-swift", version, path, _SWIFT_CLASS, "it replaces nn.Conv3d.forward (the class)")
        )
    return claims


CLAIMS: list[Claim] = [
    Claim(*LF, "llamafactory/model/loader.py", _LF_GUARD, "refuses torch 2.9.x when any nn.Conv3d exists"),
    Claim(
        *LF,
        "llamafactory/model/loader.py",
        r"def load_model\(.*?model\.load_state_dict.*?" + _LF_GUARD,
        "the guard runs in load_model, after the model is built and loaded",
    ),
    Claim(
        *LF,
        "llamafactory/extras/packages.py",
        r"def is_torch_version_greater_than\(content: str\):\s*"
        r'return _get_package_version\("torch"\) >= version\.parse\(content\)',
        "'greater than' is >=: 2.9.0 is refused, 2.10.0 is not",
    ),
    Claim(
        *LF,
        "llamafactory/launcher.py",
        r'is_env_enabled\("FORCE_TORCHRUN"\) or \(get_device_count\(\) > 1',
        "starts torchrun itself with FORCE_TORCHRUN=1 or more than one device",
    ),
    *_swift("3.11.1", None),
    *_swift("3.11.2", "opt-in"),
    *_swift("3.12.6", "opt-in"),
    *_swift("4.0.0", "default-on"),
    *_swift("4.0.1", "default-on"),
    *_swift("4.0.2", "always"),
    *_swift("4.1.0", "always"),
    *_swift("4.6.0", "always"),
    Claim(
        "verl",
        "0.9.1",
        "verl/trainer/main_ppo.py",
        r'ray_init_kwargs = config\.ray_kwargs\.get\("ray_init", \{\}\)\s*'
        r'runtime_env_kwargs = ray_init_kwargs\.get\("runtime_env", \{\}\).*?'
        r"ray\.init\(\*\*OmegaConf\.to_container\(ray_init_kwargs\)\)",
        "main_ppo passes ray_kwargs.ray_init (its runtime_env merged on verl's) to ray.init",
    ),
    Claim(
        "verl",
        "0.9.1",
        "verl/trainer/config/ppo_trainer.yaml",
        r"ray_kwargs:\s*(#[^\n]*\s*)*ray_init:.*?runtime_env:",
        "ppo_trainer.yaml has ray_kwargs.ray_init.runtime_env",
    ),
]


def wheel(package: str, version: str, folder: Path) -> Path:
    stem = f"{package.replace('-', '_')}-{version}-"
    found = sorted(folder.rglob(f"{stem}*.whl"))
    if found:
        return found[0]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "-d",
            str(folder),
            f"{package}=={version}",
        ],
        check=True,
    )
    return next(folder.glob(f"{stem}*.whl"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--wheels", type=Path, help="a folder holding the wheels (else fetched into a temp folder)"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.wheels or Path(tmp)
        failed = 0
        for claim in CLAIMS:
            with zipfile.ZipFile(wheel(claim.package, claim.version, folder)) as whl:
                text = whl.read(claim.path).decode() if claim.path in whl.namelist() else ""
            holds = bool(re.search(claim.pattern, text, re.S)) == claim.present
            failed += not holds
            verdict = "ok  " if holds else "FAIL"
            said = claim.says if claim.present else f"NOT: {claim.says}"
            print(f"{verdict} {claim.package} {claim.version} {claim.path}: {said}")
    print(f"{len(CLAIMS) - failed} of {len(CLAIMS)} claims hold")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
