"""An offline install of a device agent for a board: one .tar.gz to copy over.

    python scripts/agent_bundle.py --platform aarch64 --out agent.tar.gz [--models models]

The bundle holds the wheels a device agent imports, built for the board's platform and
Python (downloaded here: the board needs no internet), Stratus itself as a wheel, the models
folder, the systemd unit from ``deploy/systemd`` and ``install.sh``, which on the board makes
``/opt/stratus`` (a venv with ``bin/stratus``, as the unit expects) with ``pip install --no-index``
and copies the models beside it. A device agent serves with LiteRT: ONNX Runtime, OpenVINO and
llama.cpp are not in it (families that need them are left out on the board, saying why).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from arm64_env import WHEELS, wanted_wheels  # noqa: E402

# The manylinux tags a board's C library takes: glibc 2.17 up to Debian bookworm's 2.36.
GLIBC_MINORS: Final = range(17, 37)
PLATFORMS: Final = {"aarch64": "aarch64", "x86_64": "x86_64"}
INSTALL: Final = """#!/bin/sh
# Install the Stratus device agent from this bundle, offline: ./install.sh [PREFIX]
set -eu
here=$(cd "$(dirname "$0")" && pwd)
prefix=${1:-/opt/stratus}
python3 -m venv "$prefix"
"$prefix/bin/pip" install --quiet --no-index --find-links "$here/wheels" __PINS__
# --force-reinstall: a bundle of the same version number still replaces what an older one left
"$prefix/bin/pip" install --quiet --no-index --no-deps --force-reinstall "$here"/wheels/stratus_router-*.whl
rm -rf "$prefix/models" && cp -R "$here/models" "$prefix/models"
version=$("$prefix/bin/stratus" --version)  # fails the install (set -e) where it does not run
echo "installed: $prefix/bin/stratus ($version); models in $prefix/models"
echo "systemd: copy $here/stratus-agent.service to /etc/systemd/system/ and edit its --router"
"""


def download_wheels(platform: str, python: str, dest: Path) -> list[str]:
    """The device agent's dependencies for ``platform`` and CPython ``python`` (3.11, ...),
    pinned to the versions this Python runs, so the board runs what was tested here."""
    pins = wanted_wheels()
    tags = [arg for minor in GLIBC_MINORS for arg in ("--platform", f"manylinux_2_{minor}_{platform}")]
    abi = f"cp{python.replace('.', '')}"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(dest), "--only-binary=:all:",
         *tags, "--python-version", python, "--implementation", "cp", "--abi", abi, "--abi", "abi3",
         "--abi", "none", *pins],
        check=True,
    )  # fmt: skip
    return pins


def stratus_wheel(dest: Path) -> Path:
    """Stratus as a wheel, built from a copy of what it packages: a build in the checkout
    would leave ``build/`` and an egg-info there."""
    with tempfile.TemporaryDirectory() as scratch:
        source = Path(scratch) / "src"
        source.mkdir()
        for name in ("pyproject.toml", "README.md", "LICENSE"):
            shutil.copy(ROOT / name, source / name)
        for package in ("stratus", "edge_agent", "router", "cloud_gateway"):
            shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--quiet",
                "--no-deps",
                "--wheel-dir",
                str(dest),
                str(source),
            ],
            check=True,
        )
    (wheel,) = dest.glob("stratus_router-*.whl")
    return wheel


def build(platform: str, out: Path, *, models: Path, python: str = "3.11") -> Path:
    """Write the bundle to ``out`` and return it."""
    if platform not in PLATFORMS:
        raise SystemExit(f"agent_bundle: unknown platform {platform!r}; known: {sorted(PLATFORMS)}")
    with tempfile.TemporaryDirectory() as scratch:
        top = Path(scratch) / "stratus-agent"
        wheels = top / "wheels"
        wheels.mkdir(parents=True)
        pins = download_wheels(PLATFORMS[platform], python, wheels)
        stratus_wheel(wheels)
        shutil.copytree(models, top / "models", ignore=shutil.ignore_patterns("*.py", "__pycache__"))
        shutil.copy(ROOT / "deploy" / "systemd" / "stratus-agent.service", top / "stratus-agent.service")
        install = top / "install.sh"
        install.write_text(INSTALL.replace("__PINS__", " ".join(pins)))
        install.chmod(0o755)
        out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out, "w:gz") as bundle:
            bundle.add(top, arcname="stratus-agent")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--platform", choices=sorted(PLATFORMS), default="aarch64", help="the board's CPU")
    parser.add_argument("--python", default="3.11", help="the board's Python (bookworm: 3.11)")
    parser.add_argument("--out", type=Path, default=Path("agent.tar.gz"), help="the bundle to write")
    parser.add_argument("--models", type=Path, default=ROOT / "models", help="the models folder to ship")
    args = parser.parse_args(argv)
    out = build(args.platform, args.out, models=args.models, python=args.python)
    size = out.stat().st_size / 2**20
    print(
        f"agent_bundle: wrote {out} ({size:.1f} MiB): {', '.join(WHEELS)} for {args.platform}, Stratus, models"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
