"""The review's walk (reviews/structure2.md §2), counted as it runs: what one function is handed,
followed through every call it is handed to. ``benchmarks/walk.py`` counts it in a router's
``RouterDataPlane.infer``; ``walk_hook/sitecustomize.py`` in an agent's ``serve_work``. Kept
apart from walk.py, which imports the router: the hook loads this module into an agent as it
starts, before anything else."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import FrameType
from typing import Any


@dataclass
class Followed:
    """The value the first call to ``root`` is handed as ``argument``, followed.

    A *stay* is a call one of whose arguments (``self`` included) is that value or the wire
    message inside it (an ``InferRequest``'s, a Work's ``request``); a coroutine resumed is
    not a new stay; counting stops when ``root`` returns. *Rooms* are the files of the
    stays, and a *return* is a stay in a file the walk had left before (the file of the
    previous stay differs, and this one was seen earlier). What the value's contents become
    (its tensors, the Job) is not followed, as the review's reading did not follow them."""

    root: str  # the function's qualified name
    argument: str
    ours: tuple[str, ...]  # the folders whose calls count
    generated: str = "\0"  # a folder among them whose calls do not (generated code)
    stays: list[tuple[str, str]] = field(default_factory=list)
    returns: int = 0
    _followed: tuple[object, ...] = ()
    _entered: set[int] = field(default_factory=set)
    _frames: list[FrameType] = field(default_factory=list)  # kept alive: their ids stay theirs
    _seen: set[str] = field(default_factory=set)
    _root: FrameType | None = None

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(self.ours) or code.co_filename.startswith(self.generated):
            return
        if not self._followed:
            if code.co_qualname != self.root:
                return
            value = frame.f_locals[self.argument]
            inner = getattr(value, "_wire", None) or getattr(value, "request", None) or value
            self._followed = (value, inner)
            self._root = frame
        if id(frame) in self._entered or not self._inside(frame):
            return  # a coroutine resumed, or a call made after the root returned
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if not any(frame.f_locals.get(name) is value for name in names for value in self._followed):
            return
        self._entered.add(id(frame))
        self._frames.append(frame)
        if self.stays and self.stays[-1][0] != code.co_filename and code.co_filename in self._seen:
            self.returns += 1
        self._seen.add(code.co_filename)
        self.stays.append((code.co_filename, code.co_qualname))

    def is_root(self, frame: FrameType) -> bool:
        return frame is self._root

    def _inside(self, frame: FrameType | None) -> bool:
        """Whether ``frame`` runs within the root call (an await chain runs on one stack)."""
        while frame is not None:
            if frame is self._root:
                return True
            frame = frame.f_back
        return False

    def rooms(self) -> set[str]:
        return {filename for filename, _ in self.stays}
