"""The emulated arm64 set-up's pure parts: which archive apt names, how a process enters it."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
from pathlib import Path

import pytest

from tests.scripts import load

arm64_env = load("arm64_env")
MIRROR = "http://mirror.invalid/debian"  # never a real index: the script reads the machine's own


def test_the_archive_comes_from_deb822_sources_skipping_security_and_disabled_ones(tmp_path: Path) -> None:
    sources = tmp_path / "debian.sources"
    sources.write_text(
        "Types: deb\nURIs: http://off.invalid/debian\nSuites: bookworm\nComponents: main\nEnabled: no\n\n"
        "Types: deb\nURIs: http://security.invalid/debian-security\nSuites: bookworm-security\n"
        "Components: main\n\n"
        f"Types: deb\n# a comment\nURIs: {MIRROR}\nSuites: bookworm bookworm-updates\nComponents: main\n"
    )
    assert arm64_env.apt_archive([tmp_path / "absent.list", sources]) == MIRROR


def test_the_archive_comes_from_one_line_sources_with_options(tmp_path: Path) -> None:
    listed = tmp_path / "sources.list"
    listed.write_text(
        "# deb http://commented.invalid/debian bookworm main\n"
        "deb-src http://src.invalid/debian bookworm main\n"
        f"deb [arch=amd64 signed-by=/k.gpg] {MIRROR} bookworm main contrib\n"
    )
    assert arm64_env.apt_archive([listed]) == MIRROR


def test_no_archive_for_the_suite_is_an_error_not_a_skip(tmp_path: Path) -> None:
    listed = tmp_path / "sources.list"
    listed.write_text(f"deb {MIRROR} trixie main\n")
    with pytest.raises(RuntimeError, match="no apt source names Debian bookworm") as raised:
        arm64_env.apt_archive([listed])
    assert not isinstance(raised.value, arm64_env.Unsupported)


def test_a_process_enters_with_nothing_of_the_hosts_environment_but_what_is_named() -> None:
    argv = arm64_env._enter(
        Path("/cache/root"), ["python", "-V"], env={"QEMU_CPU": "cortex-a76", "PYTHONPATH": "/stratus"},
        tree=Path("/work/tree"), cpuinfo=Path("/cache/cpuinfo-cortex-a76"),
    )  # fmt: skip
    assert argv[:2] == ["env", "QEMU_CPU=cortex-a76"]  # for the chroot's own env(1), emulated too
    assert argv[2:6] == ["unshare", "--mount", "--propagation", "private"]
    script, rest = argv[8], argv[10:]  # after the script, $0 ("arm64")
    assert 'exec chroot "$root" /usr/bin/env -i "$@"' in script and "remount,bind,ro" in script
    assert rest[:3] == ["/cache/root", "/work/tree", "/cache/cpuinfo-cortex-a76"]
    assert "QEMU_CPU=cortex-a76" in rest and "PYTHONPATH=/stratus" in rest and "HOME=/root" in rest
    assert rest[-2:] == ["python", "-V"]
    assert not [a for a in rest if a.startswith(("PIP_", "SSL_"))]


def test_the_cache_is_keyed_by_the_recipe_outside_the_work_tree(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = arm64_env.cache_dir()
    assert first.parent == tmp_path / "stratus" and first.name.startswith("arm64-")
    monkeypatch.setattr(arm64_env, "RECIPE", arm64_env.RECIPE + "# another recipe\n")
    assert arm64_env.cache_dir() != first
    assert arm64_env.why_not_cached().startswith("the arm64 chroot is not built yet")


def test_the_wheels_are_pinned_to_the_versions_this_python_runs() -> None:
    import grpc
    import numpy

    pins = arm64_env.wanted_wheels()
    assert f"numpy=={numpy.__version__}" in pins and f"grpcio=={grpc.__version__}" in pins


ROOT = Path(__file__).resolve().parents[2]
# Where code runs inside the chroot: the set-up's own probes, and the arm64 test's agents.
RUN_IN_CHROOT = (ROOT / "scripts" / "arm64_env.py", ROOT / "tests" / "integration" / "test_arm64.py")


def modules_named(source: str) -> set[tuple[str, str | None]]:
    """(module, name) for each ``from M import N`` and (module, None) for each ``import M`` or
    ``-m M`` in the string constants of ``source``: what a string run in the chroot imports."""
    found: set[tuple[str, str | None]] = set()
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
            continue
        found |= {(m, n) for m, n in re.findall(r"\bfrom ([\w.]+) import (\w+)", node.value)}
        found |= {(m, None) for m in re.findall(r"(?:^|;\s*)import ([\w.]+)", node.value)}
        found |= {(m, None) for m in re.findall(r"(?:^|\s)-m ([\w.]+)", node.value)}
    return found


def test_a_moved_module_in_a_chroot_string_is_found() -> None:
    named = modules_named('probe = "from stratus.precision import arm_hwcap_flags as f; import os"\n')
    assert named == {("stratus.precision", "arm_hwcap_flags"), ("os", None)}
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("stratus.precision")  # where the probe looked before the move


def test_every_module_a_string_run_in_the_chroot_names_imports() -> None:
    from tests.integration.cluster import Cluster

    named = set().union(*(modules_named(path.read_text()) for path in RUN_IN_CHROOT))
    named.add((inspect.signature(Cluster.start).parameters["module"].default, None))  # agents: -m stratus.cli
    assert ("stratus.families.cpu", "arm_hwcap_flags") in named
    for module, name in sorted(named, key=str):
        imported = importlib.import_module(module)
        assert name is None or hasattr(imported, name), f"{module} has no {name}"


def test_a_kernel_that_cannot_mount_binfmt_is_the_only_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure that may pass (apt-get, the archive, pip) is retried once, then fails."""
    calls: list[int] = []

    def failing(*, say: object) -> Path:
        calls.append(1)
        raise subprocess.CalledProcessError(100, ["apt-get", "install"], stderr="E: Could not get lock")

    monkeypatch.setattr(arm64_env, "_ensure_once", failing)
    with pytest.raises(
        arm64_env.SetupFailed, match=r"2 tries.*apt-get install.*Could not get lock"
    ) as raised:
        arm64_env.ensure(say=lambda message: None)
    assert len(calls) == 2 and not isinstance(raised.value, arm64_env.Unsupported)

    def unsupported(*, say: object) -> Path:
        calls.append(1)
        raise arm64_env.Unsupported("binfmt_misc cannot be mounted here: permission denied")

    calls.clear()
    monkeypatch.setattr(arm64_env, "_ensure_once", unsupported)
    with pytest.raises(arm64_env.Unsupported):
        arm64_env.ensure(say=lambda message: None)
    assert len(calls) == 1
