"""Servers give the buffers of large messages back to the system once freed (channels.py)."""

from __future__ import annotations

import subprocess
import sys

# Frees 4 MiB blocks first (glibc then raises its mapping threshold past them), then holds and
# frees 32 more; prints MB held at the peak and after, over the start.
PROBE = """
import os, sys
from stratus.serving.channels import hand_back_large_buffers
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
if sys.argv[1] == "on":
    assert hand_back_large_buffers()
del [bytes(4 * 2**20) for _ in range(2)][:]
start = rss()
held = [bytearray(4 * 2**20 + i) for i in range(32)]
for block in held:
    block[::4096] = b"x" * len(block[::4096])
peak = rss()
del held
print(round(peak - start), round(rss() - start))
"""


def held_mb(mode: str) -> tuple[int, int]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    ).stdout
    peak, after = out.split()
    return int(peak), int(after)


def test_freed_message_buffers_leave_the_process_instead_of_its_heap() -> None:
    peak_on, after_on = held_mb("on")
    peak_off, after_off = held_mb("off")
    assert peak_on >= 120 and peak_off >= 120  # 32 x 4 MiB were touched either way
    assert after_on < 16  # given back
    assert after_off > 100  # glibc's own threshold keeps them: what the setting is for
