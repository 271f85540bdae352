"""The GGUF header reader on files written here byte by byte from the format's layout (every
value type, arrays of numbers, of strings and of arrays), on files cut short or lying about
their lengths, and the test helper that adds a key to a shipped model's header: the reader
sees it, and the tensors' bytes stay where their offsets say."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path

import pytest

from stratus.runtimes.gguf import GgufError, read_header
from tests.gguf_kv import ARITH, aligned, tensor_infos_end, with_strings

# (key, GGUF type number, struct format, value) for each fixed-size type.
SCALARS = [
    ("a.u8", 0, "B", 200),
    ("a.i8", 1, "b", -100),
    ("a.u16", 2, "H", 60000),
    ("a.i16", 3, "h", -30000),
    ("a.u32", 4, "I", 4_000_000_000),
    ("a.i32", 5, "i", -2_000_000_000),
    ("a.f32", 6, "f", 0.5),
    ("a.bool", 7, "?", True),
    ("a.u64", 10, "Q", 1 << 60),
    ("a.i64", 11, "q", -(1 << 60)),
    ("a.f64", 12, "d", 0.1),
]


def string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str, kind: int, payload: bytes) -> bytes:
    return string(key) + struct.pack("<I", kind) + payload


def gguf(pairs: Sequence[bytes], *, version: int = 3, tensors: int = 0, magic: bytes = b"GGUF") -> bytes:
    return magic + struct.pack("<IQQ", version, tensors, len(pairs)) + b"".join(pairs)


def write(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "m.gguf"
    path.write_bytes(data)
    return path


def test_every_value_type_is_read_as_written(tmp_path: Path) -> None:
    pairs = [kv(key, kind, struct.pack("<" + fmt, value)) for key, kind, fmt, value in SCALARS]
    pairs.append(kv("tokenizer.chat_template", 8, string("{{ messages }} ü")))
    pairs.append(kv("ids", 9, struct.pack("<IQ", 5, 3) + struct.pack("<3i", 7, -8, 9)))
    pairs.append(kv("tokens", 9, struct.pack("<IQ", 8, 2) + string("<s>") + string("</s>")))
    nested = struct.pack("<IQ", 9, 2) + struct.pack("<IQ", 0, 1) + b"\x05" + struct.pack("<IQ", 0, 0)
    pairs.append(kv("nested", 9, nested))
    data = gguf(pairs, version=2, tensors=7)
    header = read_header(write(tmp_path, data))
    assert (header.version, header.tensor_count, header.end) == (2, 7, len(data))
    for key, _, fmt, value in SCALARS:
        assert header.metadata[key] == (pytest.approx(value) if fmt in "fd" else value), key
    assert header.metadata["tokenizer.chat_template"] == "{{ messages }} ü"
    assert header.metadata["ids"] == [7, -8, 9]
    assert header.metadata["tokens"] == ["<s>", "</s>"]
    assert header.metadata["nested"] == [[5], []]


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"GGML" + bytes(20), "is not a GGUF file"),
        (gguf([], version=1), "GGUF version 1"),
        (gguf([kv("k", 8, string("text"))])[:-2], "ends inside its header"),
        (
            gguf([kv("k", 8, struct.pack("<Q", 1 << 62))]),
            "ends inside its header",
        ),  # a string's length past the end
        (
            gguf([kv("k", 9, struct.pack("<IQ", 4, 1 << 61))]),
            "ends inside its header",
        ),  # numbers past the end
        (gguf([kv("k", 9, struct.pack("<IQ", 8, 1 << 40))]), "an array of 1099511627776 values past its end"),
        (gguf([kv("k", 13, b"")]), "unknown type 13"),
        (gguf([kv("k", 9, struct.pack("<IQ", 9, 1) * 5 + struct.pack("<IQ", 0, 0))]), "nested past 4"),
        (gguf([], tensors=1)[:10], "ends inside its header"),
    ],
)
def test_a_file_that_is_not_a_whole_gguf_header_is_refused_saying_why(
    tmp_path: Path, data: bytes, words: str
) -> None:
    with pytest.raises(GgufError, match=words):
        read_header(write(tmp_path, data))


def test_a_missing_file_is_a_load_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(GgufError, match=r"absent\.gguf cannot be read"):
        read_header(tmp_path / "absent.gguf")


def test_the_helper_adds_a_key_and_keeps_the_tensors_where_their_offsets_say(tmp_path: Path) -> None:
    shipped = ARITH / "arith-small.gguf"
    target = tmp_path / "templated.gguf"
    with_strings(shipped, target, {"tokenizer.chat_template": "{{ x }}"})
    before, after = read_header(shipped), read_header(target)
    assert after.metadata == {**before.metadata, "tokenizer.chat_template": "{{ x }}"}
    assert after.tensor_count == before.tensor_count
    old, new = shipped.read_bytes(), target.read_bytes()
    tensors = len(old) - aligned(tensor_infos_end(old, before.end, before.tensor_count), 32)
    assert new[len(new) - tensors :] == old[len(old) - tensors :]  # the tensors' bytes, unchanged
    assert (len(new) - tensors) % 32 == 0  # and still aligned where the offsets count from
    assert len(new) - len(old) >= len(string("tokenizer.chat_template") + string("{{ x }}")) + 4
    with pytest.raises(AssertionError, match="already has"):
        with_strings(target, tmp_path / "again.gguf", {"tokenizer.chat_template": "{{ y }}"})
