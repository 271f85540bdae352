"""What a process does when it says it serves: its startup objects leave the collector's reach."""

from __future__ import annotations

import subprocess
import sys


def test_announcing_freezes_what_starting_made_and_collects_its_garbage_first() -> None:
    """In a fresh interpreter (freezing is process-wide): the objects alive at the announcement
    are frozen, a reference cycle left as garbage before it is collected, not frozen."""
    script = """
import gc, weakref
from stratus.process import announce
gc.disable()  # no collection but announce's own: the cycle below stays until it runs

class Node:
    pass

cycle = Node(); cycle.self = cycle
gone = weakref.ref(cycle)
del cycle
kept = [Node() for _ in range(1000)]
assert gc.get_freeze_count() == 0
announce("test", "127.0.0.1:1")
assert gone() is None, "the cycle was frozen instead of collected"
assert gc.get_freeze_count() >= 1000, gc.get_freeze_count()
collected = {id(thing) for thing in gc.get_objects()}  # the generations a collection scans
assert not any(id(node) in collected for node in kept)
"""
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "STRATUS READY test 127.0.0.1:1"

