"""Loaded into an agent by ``benchmarks/walk.py --agent`` (this folder on its PYTHONPATH): each
Work's walk from ``serve_work``, counted (walk_follow.Followed), written as JSON to
``STRATUS_WALK_OUT`` after every Work. Does nothing where that variable is not set."""

from __future__ import annotations

import json
import os
import sys
from types import FrameType
from typing import Any


def _install(out: str, bench: str, root: str) -> None:
    sys.path.insert(0, bench)
    from walk_follow import Followed

    ours = tuple(os.path.join(root, folder) + os.sep for folder in ("router", "stratus", "edge_agent"))
    generated = os.path.join(root, "stratus", "wire") + os.sep
    walks: list[Followed] = []

    def write() -> None:
        rows = [[[os.path.relpath(f, root), name] for f, name in walk.stays] for walk in walks]
        with open(out, "w", encoding="utf-8") as file:
            json.dump(rows, file)

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        new_work = event == "call" and frame.f_code.co_qualname == "serve_work"
        if new_work and not (walks and walks[-1].is_root(frame)):  # not the same Work resumed
            if walks:
                write()  # the walk before this one is over
            walks.append(Followed("serve_work", "work", ours, generated))
        if walks:
            walks[-1].profile(frame, event, arg)

    sys.setprofile(profile)


if os.environ.get("STRATUS_WALK_OUT"):
    _install(os.environ["STRATUS_WALK_OUT"], os.environ["STRATUS_WALK_BENCH"], os.environ["STRATUS_WALK_ROOT"])
