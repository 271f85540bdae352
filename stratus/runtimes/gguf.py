"""The key-value header of a GGUF file (llama.cpp's format), read without the ``gguf`` package.

Stratus needs a few keys of a generative variant's header (its chat template, its BOS and EOS
tokens), the same whichever runtime then loads the file, so it reads them itself: the magic
``GGUF``, a version (2 or 3: both little-endian with 64-bit counts), the tensor and key
counts, then each key (a string) and its typed value; the tensors are not read. Every length
is checked against what is left of the file before anything is read for it, so a truncated
or hostile header is a ModelLoadError naming the file, never a MemoryError.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Final, TypeAlias

from stratus.errors import ModelLoadError

MAGIC: Final = b"GGUF"
VERSIONS: Final = (2, 3)
STRING: Final = 8
ARRAY: Final = 9
# Value types of fixed size, by GGUF's type number: their struct format.
SCALARS: Final = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
MAX_DEPTH: Final = 4  # arrays of arrays: deeper than any real file nests them

GgufValue: TypeAlias = "int | float | bool | str | list[GgufValue]"


class GgufError(ModelLoadError):
    """A file that is not a GGUF file this reader knows, or is cut short."""


@dataclass(frozen=True, kw_only=True)
class GgufHeader:
    """A GGUF file's header: its version, tensor count, metadata, and where the metadata ends
    (the tensor descriptions start there)."""

    version: int
    tensor_count: int
    metadata: dict[str, GgufValue]
    end: int


def read_header(path: Path) -> GgufHeader:
    """The header of the GGUF file at ``path``; GgufError where it is not one, or is cut short."""
    try:
        with path.open("rb") as file:
            return _Reader(file, path).header()
    except OSError as exc:
        raise GgufError(f"{path} cannot be read: {exc}") from None


class _Reader:
    """Reads values from a file, each length checked against the bytes left."""

    def __init__(self, file: BinaryIO, path: Path) -> None:
        self.file = file
        self.path = path
        self.left = path.stat().st_size

    def header(self) -> GgufHeader:
        if self.take(4) != MAGIC:
            raise GgufError(f"{self.path} is not a GGUF file (its first bytes are not 'GGUF')")
        version = self.scalar("I")
        if version not in VERSIONS:
            raise GgufError(f"{self.path} is GGUF version {version}; this reader knows {list(VERSIONS)}")
        tensors, count = self.scalar("Q"), self.scalar("Q")
        metadata: dict[str, GgufValue] = {}
        for _ in range(count):
            key = self.string()
            metadata[key] = self.value(self.scalar("I"), depth=0)
        return GgufHeader(version=version, tensor_count=tensors, metadata=metadata, end=self.file.tell())

    def take(self, size: int) -> bytes:
        if size > self.left:
            raise GgufError(f"{self.path} ends inside its header (a value of {size} bytes, {self.left} left)")
        self.left -= size
        return self.file.read(size)

    def scalar(self, fmt: str) -> int:
        value = self.unpack(fmt)
        assert isinstance(value, int)  # the formats asked for here are integers
        return value

    def unpack(self, fmt: str) -> GgufValue:
        found: GgufValue = struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]
        return found

    def string(self) -> str:
        return self.take(self.scalar("Q")).decode("utf-8", "replace")

    def value(self, kind: int, *, depth: int) -> GgufValue:
        if kind in SCALARS:
            return self.unpack(SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind == ARRAY and depth < MAX_DEPTH:
            return self.array(depth)
        raise GgufError(f"{self.path} has a value of unknown type {kind} (or arrays nested past {MAX_DEPTH})")

    def array(self, depth: int) -> list[GgufValue]:
        kind, count = self.scalar("I"), self.scalar("Q")
        if kind in SCALARS:  # all at once: a vocabulary's token types are 100k+ numbers
            fmt = SCALARS[kind]
            return list(struct.unpack(f"<{count}{fmt}", self.take(count * struct.calcsize(fmt))))
        if count > self.left // 8:  # each string or array holds at least an 8-byte length
            raise GgufError(f"{self.path} declares an array of {count} values past its end")
        return [self.value(kind, depth=depth + 1) for _ in range(count)]
