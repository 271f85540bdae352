"""A launched process that starts a child of its own and leaves it running when it exits
(as a server that started another might): test_launcher's stand-in."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from stratus.process import announce

if __name__ == "__main__":
    child = subprocess.Popen(["sleep", "600"])
    print(f"child {child.pid}", file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # exits without ending its child
    announce("spawner", "127.0.0.1:1")
    while True:
        time.sleep(1)
