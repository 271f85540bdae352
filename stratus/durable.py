"""Files written whole or not at all, and still there after a power cut: what a store of
state (the site state file) and a credential (``stratus certs``) must never leave half made."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_atomically(path: Path, data: bytes, *, mode: int | None = None) -> None:
    """A scratch file in the same folder (mkstemp: 0600, a name nobody can predict, never one a
    link points at), its data synced, ``mode`` set, a rename over ``path``, then the folder
    synced (the rename is an entry of the folder: unsynced, a power cut can undo it)."""
    fd, scratch = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if mode is not None:
            os.chmod(scratch, mode)
        os.replace(scratch, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(scratch)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
