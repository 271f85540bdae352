"""``[offline]`` in a family's files: unsure answers kept for the cloud while it is away.

When a climb stops below the cloud because the cloud cannot be reached (its breaker is open,
its link is down, or it cannot answer inside the budget), a family with ``defer = true`` gets
a *provisional* answer (``stratus.provisional``, with ``stratus.request_id``), and its unsure
items are kept durably until the cloud, back, judges them (router/offline). The bounds keep
that store from growing without end through a long outage::

    [offline]
    defer = true
    max_items = 10000        # deferred items kept for the family at once; past it, refused
    max_bytes = 67108864     # ... and their bytes (inputs and answers)
    max_age_s = 86400        # an item not judged by then is dropped (expired)

Off by default: a deferred item is a copy of the client's inputs kept on the router's disk
(or the site's store), which a family must ask for.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from stratus.families.toml_reader import TableReader

DEFAULT_MAX_ITEMS: Final = 10_000
DEFAULT_MAX_BYTES: Final = 64 << 20
DEFAULT_MAX_AGE_S: Final = 86_400.0
# The largest bounds a family may ask for: a router holds an index entry per item in memory.
MOST_ITEMS: Final = 1_000_000
MOST_BYTES: Final = 64 << 30


@dataclass(frozen=True, kw_only=True)
class OfflineSpec:
    """``[offline]``: whether unsure answers are deferred, and the bounds of what is kept."""

    defer: bool = False
    max_items: int = DEFAULT_MAX_ITEMS
    max_bytes: int = DEFAULT_MAX_BYTES
    max_age_s: float = DEFAULT_MAX_AGE_S

    def __post_init__(self) -> None:
        problem = bounds_problem(self)
        if problem is not None:
            raise ValueError(problem)


def bounds_problem(spec: OfflineSpec) -> str | None:
    """Why ``spec``'s bounds cannot be kept (None: they can)."""
    if not 1 <= spec.max_items <= MOST_ITEMS:
        return f"max_items {spec.max_items} must lie between 1 and {MOST_ITEMS}"
    if not 1 <= spec.max_bytes <= MOST_BYTES:
        return f"max_bytes {spec.max_bytes} must lie between 1 and {MOST_BYTES}"
    if not 0 < spec.max_age_s <= 365 * 86_400:
        return f"max_age_s {spec.max_age_s} must lie in (0, one year]"
    return None


def parse_offline(reader: TableReader, data: Mapping[str, Any], *, generative: bool) -> OfflineSpec:
    """``[offline]`` read and checked; absent: nothing is deferred."""
    table = reader.get(data, "offline", dict, "", {})
    reader.unknown_keys(table, {"defer", "max_items", "max_bytes", "max_age_s"}, "offline")
    defer: bool = reader.get(table, "defer", bool, "offline", False)
    if defer and generative:
        raise reader.fail(
            "offline.defer",
            "generative families are not deferred yet (a provisional text has no top-1 to judge): "
            "leave it out",
        )
    try:
        return OfflineSpec(
            defer=defer,
            max_items=reader.get(table, "max_items", int, "offline", DEFAULT_MAX_ITEMS),
            max_bytes=reader.get(table, "max_bytes", int, "offline", DEFAULT_MAX_BYTES),
            max_age_s=float(reader.get(table, "max_age_s", float, "offline", DEFAULT_MAX_AGE_S)),
        )
    except ValueError as exc:
        raise reader.fail(f"offline.{str(exc).split()[0]}", str(exc)) from None
