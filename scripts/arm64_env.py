"""An ARM64 board on this machine: a Debian arm64 chroot run under QEMU user-mode emulation,
with a Stratus device agent's dependencies installed, for tests and benchmarks of aarch64 agents.

Most devices that run an agent are ARM64 boards (Raspberry Pi 4/5, Jetson-class, gateways);
this runs the same agent code there, emulated, so every change is checked on aarch64 too. What
it does, each step skipped when already done (it is safe to run again, and from two processes
at once):

1. the host tools: ``qemu-user-static``, ``binfmt-support``, ``debootstrap`` (apt-get, as root);
2. ``binfmt_misc``: mounted when it is not, and QEMU's aarch64 entry enabled (flag F: the
   kernel opens the emulator once, so the chroot needs no copy of it);
3. the chroot: ``debootstrap --foreign`` of bookworm arm64 (minbase, Python 3.11) from the
   archive this machine's own apt sources name, then its second stage, emulated (about 3 min);
   cached in ``~/.cache/stratus/arm64-<recipe hash>``, keyed by the recipe, outside any work tree;
4. a virtual environment in it, ``/opt/stratus/venv``, from aarch64 wheels downloaded *on the
   host* (pip inside the chroot cannot verify the package index's certificate), pinned to the
   versions the host's environment runs, so both architectures run the same libraries.

The project itself is not installed there: each run bind-mounts the work tree read-only at
``/stratus`` and puts it on ``PYTHONPATH``, so the agent under test is always the tree under
test (nothing to go stale), and cannot write into it.

A process is started in the chroot (:func:`command`) in a mount namespace of its own
(``unshare``), where ``/proc``, ``/sys``, ``/dev`` and the tree are mounted: nothing is left
mounted when it ends. It is entered with ``env -i``: the host's ``PIP_*``, ``SSL_*`` and
``PYTHON*`` variables must not leak in. ``QEMU_CPU`` picks the emulated CPU (``cortex-a72``,
Raspberry Pi 4 class; ``cortex-a76``, Pi 5 class: ARMv8.2 with dot product and FP16).

Bookworm's QEMU (7.2) passes the host's x86 ``/proc/cpuinfo`` through to the guest, and
LiteRT's CPU detection crashes on it (SIGSEGV in ``Interpreter.__init__``); so each process
sees, bind-mounted over ``/proc/cpuinfo``, an aarch64 one written from what the emulated CPU
itself reports (its HWCAP, probed once per CPU). A newer QEMU emulates the file itself and
ignores the mount.

    python scripts/arm64_env.py                 # set up (or reuse) the chroot and its venv
    python scripts/arm64_env.py check           # exit 0 when it is ready here, else say why
    python scripts/arm64_env.py run [--cpu C] -- python -m stratus.cli agent ...

Nothing here imports Stratus, so any Python 3.11 runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[1]
SUITE: Final = "bookworm"
# Its C library and Python: the wheels downloaded for it may need any manylinux up to this
# (numpy 2.3 and later ship manylinux_2_28 only).
GLIBC: Final = (2, 36)
INCLUDE: Final = ("python3", "python3-venv", "python3-pip", "ca-certificates")
# What a device agent imports on a board (no ONNX Runtime or OpenVINO: LiteRT serves the device
# tier); setuptools is not among them. All have cp311 (or pure) aarch64 wheels.
WHEELS: Final = (
    "grpcio",
    "protobuf",
    "numpy",
    "zeroconf",
    "ai-edge-litert",
    "prometheus-client",
    "grpcio-health-checking",
    "uvloop",
)
# Changing any of these makes another chroot (the wheels only make another venv in it).
RECIPE: Final = (
    f"debootstrap --arch=arm64 --foreign --variant=minbase --include={','.join(INCLUDE)} {SUITE}\n"
)
HOST_TOOLS: Final = {
    "qemu-aarch64-static": "qemu-user-static",
    "update-binfmts": "binfmt-support",
    "debootstrap": "debootstrap",
}
BINFMT: Final = Path("/proc/sys/fs/binfmt_misc")
VENV: Final = "/opt/stratus/venv"
WHEELHOUSE: Final = "/opt/stratus/wheels"
TREE: Final = "/stratus"
MARKER_NAME: Final = ".stratus-arm64"
DEFAULT_CPU: Final = "cortex-a72"
# MIDR part numbers (implementer 0x41, Arm Ltd.) of the CPUs QEMU emulates, for cpuinfo.
CPU_PARTS: Final = {
    "cortex-a53": "0xd03",
    "cortex-a57": "0xd07",
    "cortex-a72": "0xd08",
    "cortex-a76": "0xd0b",
    "neoverse-n1": "0xd0c",  # server class (AWS Graviton2, Ampere Altra): ARMv8.2, dot product, FP16
}
Say = Callable[[str], None]


class Unsupported(RuntimeError):
    """This machine's kernel cannot run aarch64 binaries: binfmt_misc cannot be mounted (no
    root, an unprivileged container). The only reason the arm64 test may skip."""


class SetupFailed(RuntimeError):
    """Setting up failed for a reason that may pass (the archive, pip, apt-get): retried once,
    then the arm64 test fails, saying why, instead of skipping."""


def _say(message: str) -> None:
    print(f"arm64_env: {message}", flush=True)


def cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    digest = hashlib.sha256(RECIPE.encode()).hexdigest()[:12]
    return base / "stratus" / f"arm64-{digest}"


def chroot_dir() -> Path:
    return cache_dir() / "root"


def wanted_wheels() -> list[str]:
    """Each wheel pinned to the version this Python runs (the project's .venv under make), so the
    emulated agent runs the same grpcio, numpy and LiteRT as the x86 one it is compared with."""
    pins = []
    for name in WHEELS:
        try:
            pins.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pins.append(name)
    return pins


def venv_marker() -> str:
    return "".join(f"{pin}\n" for pin in wanted_wheels())


def chroot_ready() -> bool:
    marker = cache_dir() / MARKER_NAME
    return marker.exists() and marker.read_text() == RECIPE


def venv_ready() -> bool:
    marker = chroot_dir() / VENV.lstrip("/") / MARKER_NAME
    return chroot_ready() and marker.exists() and marker.read_text() == venv_marker()


def why_not_cached() -> str | None:
    """None when the chroot is built; else that it is not yet (``make test`` builds it)."""
    if chroot_ready():
        return None
    return f"the arm64 chroot is not built yet at {cache_dir()} (`make arm64-env` builds it, about 4 min)"


# --- 1, 2: the host ---------------------------------------------------------------------------


def host_tools(*, say: Say = _say) -> None:
    """Install what is missing with apt-get (as root); Unsupported when that cannot be done."""
    missing = sorted({package for tool, package in HOST_TOOLS.items() if shutil.which(tool) is None})
    if not missing:
        return
    if os.geteuid() != 0:
        raise Unsupported(f"binfmt_misc cannot be mounted here: not root ({', '.join(missing)} missing too)")
    if shutil.which("apt-get") is None:
        raise SetupFailed(f"{', '.join(missing)} missing and no apt-get to install them with: install them")
    say(f"installing {', '.join(missing)} with apt-get")
    install = ["apt-get", "install", "-y", "-q", *missing]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.run(install, env=env, capture_output=True, check=False).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=False)
        result = subprocess.run(install, env=env, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise SetupFailed(f"apt-get could not install {', '.join(missing)}: {result.stderr[-500:]}")


def check_binfmt(*, mount: bool) -> None:
    """The kernel runs aarch64 ELF files through QEMU. With ``mount``, make it so when it is
    not: mount binfmt_misc, enable QEMU's entry. Unsupported, saying why, when it cannot."""
    entry = BINFMT / "qemu-aarch64"
    if entry.exists() and entry.read_text().startswith("enabled"):
        return
    if not mount:
        raise SetupFailed(
            f"binfmt_misc cannot be mounted here or has no qemu-aarch64 entry ({entry} missing)"
        )
    if not (BINFMT / "register").exists():
        result = subprocess.run(
            ["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT)],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise Unsupported(
                f"binfmt_misc cannot be mounted here: {result.stderr.strip() or result.returncode}"
            )
    subprocess.run(["update-binfmts", "--enable", "qemu-aarch64"], capture_output=True, check=False)
    if not (entry.exists() and entry.read_text().startswith("enabled")):
        raise SetupFailed("binfmt_misc is mounted but update-binfmts did not enable its qemu-aarch64 entry")


def apt_archive(paths: Sequence[Path] | None = None) -> str:
    """The Debian archive this machine's apt sources name for the suite (read at run time, so no
    package-index address is written into the repository): one-line ``.list`` files and
    deb822 ``.sources`` files alike."""
    if paths is None:
        folder = Path("/etc/apt/sources.list.d")
        paths = [
            Path("/etc/apt/sources.list"),
            *sorted(folder.glob("*.list")),
            *sorted(folder.glob("*.sources")),
        ]
    for path in paths:
        try:
            text = path.read_text()
        except OSError:
            continue
        found = _deb822_archive(text) if path.suffix == ".sources" else _one_line_archive(text)
        if found:
            return found
    raise RuntimeError(  # not a skip: a Debian machine without its archive is broken
        f"no apt source names Debian {SUITE}'s main archive (read {', '.join(map(str, paths))})"
    )


def _one_line_archive(text: str) -> str | None:
    for line in text.splitlines():
        fields = re.sub(r"\[[^]]*\]", "", line.split("#")[0]).split()
        if len(fields) >= 4 and fields[0] == "deb" and fields[2] == SUITE and "main" in fields[3:]:
            return fields[1]
    return None


def _deb822_archive(text: str) -> str | None:
    for stanza in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            key, sep, value = line.partition(":")
            if sep and not line.startswith(("#", " ")):
                fields[key.strip().lower()] = value.strip()
        if fields.get("enabled", "yes").lower() == "no" or "deb" not in fields.get("types", "").split():
            continue
        if SUITE in fields.get("suites", "").split() and "main" in fields.get("components", "").split():
            return fields.get("uris", "").split()[0] if fields.get("uris") else None
    return None


# --- 3: the chroot ----------------------------------------------------------------------------


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_chroot(*, say: Say = _say) -> None:
    """debootstrap's two stages into a fresh folder, renamed into place only when both passed,
    so a failed or interrupted build leaves nothing that looks ready."""
    archive = apt_archive()
    building = cache_dir() / "root.building"
    shutil.rmtree(building, ignore_errors=True)
    shutil.rmtree(chroot_dir(), ignore_errors=True)
    started = time.monotonic()
    say(f"debootstrap (first stage) of {SUITE} arm64 from {archive}")
    _run(["debootstrap", *RECIPE.split()[1:-1], SUITE, str(building), archive])
    say("debootstrap (second stage, emulated: about 3 min)")
    _run(_enter(building, ["/debootstrap/debootstrap", "--second-stage"], env={}, tree=None, cpuinfo=None))
    building.rename(chroot_dir())
    (cache_dir() / MARKER_NAME).write_text(RECIPE)
    say(f"chroot ready in {time.monotonic() - started:.0f} s: {chroot_dir()}")


# --- 4: its virtual environment ---------------------------------------------------------------


def build_venv(*, say: Say = _say) -> None:
    """Download the aarch64 wheels here, install them there without an index."""
    root = chroot_dir()
    wheels = root / WHEELHOUSE.lstrip("/")
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    pins = wanted_wheels()
    say(f"downloading aarch64 wheels: {', '.join(pins)}")
    platforms = [
        arg for minor in range(17, GLIBC[1] + 1) for arg in ("--platform", f"manylinux_2_{minor}_aarch64")
    ]
    _run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(wheels), "--only-binary=:all:",
         *platforms, "--python-version", "3.11", "--implementation", "cp",
         "--abi", "cp311", "--abi", "abi3", "--abi", "none", *pins]
    )  # fmt: skip
    venv = root / VENV.lstrip("/")
    (venv / MARKER_NAME).unlink(missing_ok=True)
    say(f"installing them into {VENV} (emulated)")
    inside = [
        f"python3 -m venv --clear {VENV}",
        f"{VENV}/bin/pip install --quiet --no-index --find-links {WHEELHOUSE} {' '.join(pins)}",
    ]
    _run(_enter(root, ["/bin/sh", "-euc", " && ".join(inside)], env={}, tree=None, cpuinfo=None))
    (venv / MARKER_NAME).write_text(venv_marker())


def ensure(*, say: Say = _say, attempts: int = 2) -> Path:
    """Set up whatever is not yet; return the chroot. Unsupported when this kernel cannot run
    aarch64 programs (checked anew each time, never remembered); any other failure is tried
    once more, then raised as SetupFailed, saying why."""
    for attempt in range(1, attempts + 1):
        try:
            return _ensure_once(say=say)
        except Unsupported:
            raise
        except (SetupFailed, subprocess.CalledProcessError, OSError) as exc:
            why = _failure(exc)
            if attempt == attempts:
                raise SetupFailed(f"the arm64 chroot could not be set up ({attempts} tries): {why}") from exc
            say(f"setting up failed ({why}); trying once more")
    raise AssertionError("unreachable")


def _ensure_once(*, say: Say) -> Path:
    host_tools(say=say)
    check_binfmt(mount=True)
    with _locked(cache_dir().parent / f"{cache_dir().name}.lock"):
        if chroot_ready():
            say(f"reusing the chroot {chroot_dir()}")
        else:
            build_chroot(say=say)
        if venv_ready():
            say(f"reusing {VENV} ({', '.join(wanted_wheels())})")
        else:
            build_venv(say=say)
    return chroot_dir()


def _failure(exc: BaseException) -> str:
    """One failure in words, with the end of what a failed command printed."""
    if isinstance(exc, subprocess.CalledProcessError):
        printed = (exc.stderr or exc.output or "").strip()[-1500:]
        return (
            f"`{' '.join(map(str, exc.cmd))[-300:]}` exited {exc.returncode}: {printed or 'printed nothing'}"
        )
    return str(exc)


def _run(command: Sequence[str]) -> None:
    result = subprocess.run(command, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        raise subprocess.CalledProcessError(result.returncode, command, output=result.stdout[-4000:])


def run_in_chroot(
    argv: Sequence[str],
    *,
    cpu: str = DEFAULT_CPU,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 300.0,
) -> str:
    """Run ``argv`` in the chroot on the emulated ``cpu`` (the work tree at /stratus) and
    return what it printed; a failure raises SetupFailed with its stderr, never a bare
    CalledProcessError that hides what the emulated program said."""
    full = command(argv, cpu=cpu, env=env)
    result = subprocess.run(full, capture_output=True, text=True, timeout=timeout_s, check=False)
    if result.returncode != 0:
        raise SetupFailed(
            f"`{' '.join(argv)[-300:]}` in the arm64 chroot ({cpu}) exited {result.returncode}: "
            f"{(result.stderr or result.stdout).strip()[-2000:] or 'printed nothing'}"
        )
    return result.stdout


# --- running in it ----------------------------------------------------------------------------

# Run by `unshare --mount` as root: mounts that live only as long as the process, then the
# command in the chroot with nothing of the host's environment but what is named.
_ENTER: Final = r"""
root=$1; tree=$2; cpuinfo=$3; shift 3
mount -t proc proc "$root/proc"
mount --rbind /sys "$root/sys"
mount --rbind /dev "$root/dev"
if [ -n "$tree" ]; then
  mkdir -p "$root/stratus"
  mount --bind "$tree" "$root/stratus"
  mount -o remount,bind,ro "$root/stratus"
fi
if [ -n "$cpuinfo" ]; then mount --bind "$cpuinfo" "$root/proc/cpuinfo"; fi
exec chroot "$root" /usr/bin/env -i "$@"
"""
_PATH: Final = f"{VENV}/bin:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"


def _enter(
    root: Path, argv: Sequence[str], *, env: Mapping[str, str], tree: Path | None, cpuinfo: Path | None
) -> list[str]:
    names = {"PATH": _PATH, "HOME": "/root", "LANG": "C.UTF-8", **env}
    assignments = [f"{key}={value}" for key, value in names.items()]
    # The chroot's own env(1) is the first aarch64 program: its emulator reads QEMU_CPU too.
    prefix = ["env", f"QEMU_CPU={env['QEMU_CPU']}"] if "QEMU_CPU" in env else []
    return [
        *prefix,
        "unshare", "--mount", "--propagation", "private", "/bin/sh", "-euc", _ENTER, "arm64",
        str(root), str(tree or ""), str(cpuinfo or ""), *assignments, *argv,
    ]  # fmt: skip


def command(
    argv: Sequence[str], *, cpu: str = DEFAULT_CPU, env: Mapping[str, str] | None = None, tree: Path = ROOT
) -> list[str]:
    """The host command that runs ``argv`` in the chroot on the emulated ``cpu``, with ``tree``
    as ``/stratus`` on ``PYTHONPATH``. The process it starts *is* the command in the end (each
    step execs the next), so its pid takes signals and its exit code is the command's."""
    root = chroot_dir()
    names = {
        "QEMU_CPU": cpu,
        "PYTHONPATH": TREE,
        "PYTHONPYCACHEPREFIX": "/var/cache/stratus-pyc",  # the tree is mounted read-only
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    return _enter(root, argv, env=names, tree=tree, cpuinfo=cpuinfo_for(cpu))


# Run in the chroot with the work tree on PYTHONPATH: every module a string run there names is
# checked to import by tests/unit/test_arm64_env.py (a moved module once broke every arm64 run).
HWCAP_PROBE: Final = "from stratus.families.cpu import arm_hwcap_flags as f; print(' '.join(f()))"


def cpuinfo_for(cpu: str) -> Path:
    """An aarch64 ``/proc/cpuinfo`` for ``cpu``: its features as the emulated CPU reports them
    (HWCAP, read in the chroot by stratus.families.precision), one block per host CPU. Probed once."""
    path = cache_dir() / f"cpuinfo-{cpu}"
    if path.exists():
        return path
    names = {"QEMU_CPU": cpu, "PYTHONPATH": TREE}
    result = subprocess.run(
        _enter(chroot_dir(), [f"{VENV}/bin/python", "-c", HWCAP_PROBE], env=names, tree=ROOT, cpuinfo=None),
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise SetupFailed(
            f"the HWCAP probe in the arm64 chroot ({cpu}) exited {result.returncode}: "
            f"{result.stderr.strip()[-2000:] or 'printed nothing'}"
        )
    features = result.stdout.split() or ["fp", "asimd"]
    part = CPU_PARTS.get(cpu, "0xd08")
    blocks = [
        f"processor\t: {n}\nBogoMIPS\t: 108.00\nFeatures\t: {' '.join(features)}\nCPU implementer\t: 0x41\n"
        f"CPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: {part}\nCPU revision\t: 0\n"
        for n in range(os.cpu_count() or 1)
    ]
    path.write_text("\n".join(blocks))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Set up the emulated arm64 chroot, or run a command in it.")
    commands = parser.add_subparsers(dest="command")
    commands.add_parser("check", help="exit 0 when the chroot is cached here; else say why not")
    run = commands.add_parser("run", help="run a command in the chroot (the work tree is /stratus)")
    run.add_argument(
        "--cpu", default=DEFAULT_CPU, help=f"QEMU_CPU (default {DEFAULT_CPU}; cortex-a76: Pi 5 class)"
    )
    run.add_argument("argv", nargs="+")
    args = parser.parse_args(argv)
    if args.command == "check":
        why = why_not_cached()
        print(why or f"cached: {chroot_dir()}")
        return 0 if why is None else 1
    try:
        ensure()
    except Unsupported as exc:
        _say(str(exc))
        return 2
    except SetupFailed as exc:
        _say(str(exc))
        return 1
    if args.command == "run":
        full = command(args.argv, cpu=args.cpu)
        os.execvp(full[0], full)
    return 0


if __name__ == "__main__":
    sys.exit(main())
