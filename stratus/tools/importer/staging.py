"""What an import has changed in a family's folder so far, undone if it is refused: the files
it created, the folders it made, and the files it replaced (``verified.toml``)."""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from stratus.errors import ConfigError
from stratus.families.repository import CONFIG_NAME


@dataclass
class _Staged:
    """What an import has created so far, removed again if it is refused."""

    folder: Path
    created: Path | None = None  # the topmost folder this import made
    paths: list[Path] = dataclasses.field(default_factory=list)
    # Files replaced, with what they held before (None: they did not exist).
    replaced: dict[Path, bytes | None] = dataclasses.field(default_factory=dict)

    def mkdir(self) -> None:
        missing = [p for p in (self.folder, *self.folder.parents) if not p.exists()]
        if missing:
            self.folder.mkdir(parents=True)
            self.created = missing[-1]

    def claim(self, path: Path) -> Path:
        if path.exists():
            raise ConfigError(f"{path} already exists; choose another variant name with --variant")
        self.paths.append(path)
        return path

    def discard(self, paths: Iterable[Path]) -> None:
        """Remove files this import made that it no longer keeps (a child outside tolerance)."""
        for path in paths:
            path.unlink(missing_ok=True)
            if path in self.paths:
                self.paths.remove(path)

    def scratch(self, name: str = CONFIG_NAME) -> Path:
        """Where a new file is checked; one a killed import left behind is replaced."""
        path = self.folder / f".{name}.import"
        path.unlink(missing_ok=True)
        return self.claim(path)

    def replace(self, path: Path, text: str) -> None:
        """Write ``path`` whole (a temporary file, then a rename), keeping what it held so that
        :meth:`undo` puts it back."""
        if path not in self.replaced:
            self.replaced[path] = path.read_bytes() if path.exists() else None
        scratch = self.scratch(path.name)
        scratch.write_text(text, encoding="utf-8")
        os.replace(scratch, path)

    def keep(self) -> None:
        """The import is committed: what it created now belongs to the family."""
        self.paths.clear()
        self.replaced.clear()
        self.created = None

    def undo(self) -> None:
        for path in self.paths:
            path.unlink(missing_ok=True)
        for path, before in self.replaced.items():
            if before is None:
                path.unlink(missing_ok=True)
            else:
                path.write_bytes(before)
        if self.created is not None:
            shutil.rmtree(self.created, ignore_errors=True)
