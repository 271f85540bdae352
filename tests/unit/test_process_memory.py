"""A server's large buffers go back to the system when freed (security F11), checked by what
glibc itself counts, in a fresh interpreter so that this test process's allocator is untouched."""

from __future__ import annotations

import ctypes.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# How many 1 MiB blocks glibc keeps as mappings of their own, after a freed 4 MiB one would
# have raised its own threshold above them; "set" first fixes the threshold as a server does.
_COUNT_MAPPED = textwrap.dedent(
    """
    import ctypes, sys
    from stratus.process import return_large_buffers

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    if sys.argv[1] == "set":
        print(return_large_buffers())
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    block = b"\\x01" * (4 << 20)
    del block
    before = libc.mallinfo2().hblks
    blocks = [b"\\x01" * (1 << 20) for _ in range(8)]
    print(libc.mallinfo2().hblks - before)
    """
)


def _mapped_blocks(mode: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", _COUNT_MAPPED, mode], cwd=ROOT, capture_output=True, text=True, check=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    return done.stdout.split()


glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or "libc.so.6" not in (ctypes.util.find_library("c") or ""),
    reason="mallopt and mallinfo2 are glibc's",
)


@glibc
def test_large_buffers_are_their_own_mappings() -> None:
    assert _mapped_blocks("set") == ["True", "8"]


@glibc
def test_without_it_glibc_serves_them_from_the_heap() -> None:
    """What the setting is for: glibc's own moving threshold keeps such blocks in the heap."""
    assert _mapped_blocks("unset") == ["0"]
