"""A setting's value as its field's type: text from a flag or a variable, or a TOML value, read
as a path, number, boolean, enum member or tuple (``stratus.config`` calls :func:`coerce`),
and shown back the way it is written (:func:`show_value`, for flags' help and errors)."""

from __future__ import annotations

import enum
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from stratus.errors import ConfigError


def coerce(raw: Any, kind: Any, where: str, item: Callable[[str], Any] | None) -> Any:
    """``raw`` (TOML value, variable text or flag value) as a ``kind``, or a one-line error.
    Text is parsed only where it came as text (a variable, a flag): a file says what it means
    (``concurrency = 2``, not ``"2"``)."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return coerce(raw, next(a for a in args if a is not type(None)), where, item)
    if typing.get_origin(kind) in (tuple, Sequence) or kind is tuple:
        return _items(raw, args[0] if args else str, where, item)
    try:
        if _in_a_file(where) and kind in (bool, int, float) and not _native(raw, kind):
            raise TypeError(type(raw).__name__)
        return _scalar(raw, kind)
    except (TypeError, ValueError, KeyError):
        raise ConfigError(f"{where}: {_expected(kind)}, not {raw!r}") from None


def _native(raw: Any, kind: type) -> bool:
    """Whether a TOML value already is a ``kind``: an int is a float, but no bool a number."""
    if kind is bool or isinstance(raw, bool):
        return kind is bool and isinstance(raw, bool)
    return isinstance(raw, int) if kind is int else isinstance(raw, (int, float))


def _in_a_file(where: str) -> bool:
    return not where.startswith(("$", "-"))


def _items(raw: Any, kind: Any, where: str, item: Callable[[str], Any] | None) -> tuple[Any, ...]:
    text = isinstance(raw, str) and not _in_a_file(where)
    texts = [t.strip() for t in raw.split(",") if t.strip()] if text else raw
    if not isinstance(texts, (list, tuple)):
        raise ConfigError(f"{where}: a list, not {raw!r}")
    if item is None:
        return tuple(coerce(t, kind, where, None) for t in texts)
    try:
        return tuple(t if isinstance(t, tuple) else item(str(t)) for t in texts)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _scalar(raw: Any, kind: Any) -> Any:
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return raw if isinstance(raw, kind) else _member(kind, str(raw))
    if kind is bool:
        return _boolean(raw)
    if kind in (int, float) and isinstance(raw, bool):
        raise TypeError("a truth value is not a number")
    if kind is float:
        return float(raw) if isinstance(raw, (int, float, str)) else _refuse(raw)
    if kind is int:
        return raw if isinstance(raw, int) else int(str(raw), 10) if isinstance(raw, str) else _refuse(raw)
    if kind is Path:
        return Path(raw) if isinstance(raw, (str, Path)) else _refuse(raw)
    if kind is str:
        return raw if isinstance(raw, str) else _refuse(raw)
    raise TypeError(f"no loader for {kind}")


def _member(kind: type[enum.Enum], text: str) -> enum.Enum:
    for member in kind:
        if text.strip().lower() == label(member):
            return member
    raise ValueError(text)


def label(member: enum.Enum) -> str:
    """How files, variables and flags spell a member: its value, or a number's name."""
    return member.value if isinstance(member.value, str) else member.name.lower()


def _boolean(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def _refuse(raw: Any) -> Any:
    raise TypeError(type(raw).__name__)


def _expected(kind: Any) -> str:
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return "one of " + ", ".join(label(m) for m in kind)
    return {
        bool: "true or false",
        int: "a whole number",
        float: "a number",
        Path: "a path",
        str: "a string",
    }.get(kind, f"a {kind}")


def show_value(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return label(value)
    if isinstance(value, tuple):
        return ",".join(show_value(v) if not isinstance(v, tuple) else "=".join(map(str, v)) for v in value) or "(none)"
    if value == "":
        return '""'
    return "(none)" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
