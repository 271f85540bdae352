"""Typed access to a parsed family.toml, refusing a wrong value with the file and key named.

Every part of a family's config (:mod:`stratus.families.repository`, the variant table, the
audit and offline tables) reads through one :class:`TableReader`, so every refusal reads alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stratus.errors import ConfigError, InvalidInput
from stratus.tiers import Tier


class TableReader:
    """Typed access to a parsed TOML table, with errors that name file and key."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.path}: key '{key}': {problem}")

    def get(self, table: Mapping[str, Any], key: str, kind: type, where: str, default: Any = ...) -> Any:
        full = f"{where}.{key}" if where else key
        if key not in table:
            if default is ...:
                raise self.fail(full, "is missing")
            return default
        value = table[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.fail(full, f"must be a {kind.__name__}, not {type(value).__name__}")
        return value

    def choice(self, table: Mapping[str, Any], key: str, choices: tuple[str, ...], where: str) -> str:
        value: str = self.get(table, key, str, where)
        if value not in choices:
            raise self.fail(
                f"{where}.{key}" if where else key, f"'{value}' is not one of {', '.join(choices)}"
            )
        return value

    def unknown_keys(self, table: Mapping[str, Any], allowed: set[str], where: str) -> None:
        for key in table:
            if key not in allowed:
                raise self.fail(f"{where}.{key}" if where else key, "is not a known setting")

    def tier(self, text: str, key: str) -> Tier:
        try:
            return Tier.parse(text)
        except InvalidInput:
            raise self.fail(key, f"'{text}' is not one of device, edge, cloud") from None
