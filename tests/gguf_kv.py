"""A GGUF file with string keys added to its metadata, for tests: a shipped arith model given
a chat template (the shipped files carry none), without the ``gguf`` package.

The key-value section is copied byte for byte and the new keys appended; the tensor
descriptions follow unchanged (their offsets count from the data section), then padding to
the file's alignment, then the tensor data as it was.
"""

from __future__ import annotations

import shutil
import struct
from collections.abc import Mapping
from pathlib import Path

from stratus.runtimes.gguf import STRING, read_header

HEADER_BYTES = 24  # magic, version, tensor count, key count (versions 2 and 3)
DEFAULT_ALIGNMENT = 32


def with_strings(source: Path, target: Path, values: Mapping[str, str]) -> None:
    """``source`` written to ``target`` with the string keys ``values`` added (none may be
    there already: a key is not replaced)."""
    header = read_header(source)
    present = sorted(set(values) & set(header.metadata))
    assert not present, f"{source} already has {present}"
    data = source.read_bytes()
    infos_end = tensor_infos_end(data, header.end, header.tensor_count)
    alignment = header.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    assert isinstance(alignment, int)
    added = b"".join(_string(key) + struct.pack("<I", STRING) + _string(text) for key, text in values.items())
    head = data[:8] + struct.pack("<QQ", header.tensor_count, len(header.metadata) + len(values))
    body = data[HEADER_BYTES : header.end] + added + data[header.end : infos_end]
    padding = -(HEADER_BYTES + len(body)) % alignment
    target.write_bytes(head + body + b"\0" * padding + data[aligned(infos_end, alignment) :])


def _string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def tensor_infos_end(data: bytes, start: int, count: int) -> int:
    """Where the tensor descriptions end: each a name, its dimensions, a type and an offset."""
    at = start
    for _ in range(count):
        (name_length,) = struct.unpack_from("<Q", data, at)
        at += 8 + name_length
        (dimensions,) = struct.unpack_from("<I", data, at)
        at += 4 + 8 * dimensions + 4 + 8
    return at


def aligned(offset: int, alignment: int) -> int:
    return offset + -offset % alignment


ARITH = Path(__file__).resolve().parents[1] / "models" / "arith"
TEMPLATE_KEY = "tokenizer.chat_template"


def templated_arith(models: Path, templates: Mapping[str, str]) -> Path:
    """``models`` made a model repository holding a copy of the arith family in which each
    variant named in ``templates`` carries that chat template; returns ``models``."""
    family = models / "arith"
    shutil.copytree(ARITH, family)
    for variant, template in templates.items():
        shipped = family / f"{variant}.gguf"
        rewritten = family / f"{variant}.templated"
        with_strings(shipped, rewritten, {TEMPLATE_KEY: template})
        rewritten.replace(shipped)
    return models
