"""The three tiers a request can climb, cheapest first."""

from __future__ import annotations

import enum

from stratus.errors import InvalidInput


class Tier(enum.IntEnum):
    """Ordered so that ``Tier.DEVICE < Tier.EDGE < Tier.CLOUD`` reads as "cheaper than"."""

    DEVICE = 1
    EDGE = 2
    CLOUD = 3

    @property
    def label(self) -> str:
        return self.name.lower()

    def __str__(self) -> str:
        """``device``, ``edge`` or ``cloud`` (an IntEnum would print ``1``)."""
        return self.label

    def to_wire(self) -> int:
        """fleet.proto's ``Tier`` value. The wire numbers TIER_DEVICE, TIER_EDGE and TIER_CLOUD
        1, 2, 3 as this enum does (a unit test holds them equal), so no table is kept in step
        and this module needs no wire import; :func:`stratus.convert.fleet.wire_tier` gives it
        the wire's type."""
        return int(self)

    @classmethod
    def from_wire(cls, value: int) -> Tier:
        """The tier a message names; TIER_UNSPECIFIED or a number this version does not know
        is the sender's mistake, not ours."""
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(f"{t.value} ({t.label})" for t in cls)
            raise InvalidInput(f"unknown tier {value}; expected one of {names}") from None

    @classmethod
    def parse(cls, text: str) -> Tier:
        """The tier named ``text`` (``device``, ``edge`` or ``cloud``)."""
        try:
            return cls[text.strip().upper()]
        except KeyError:
            names = ", ".join(t.label for t in cls)
            raise InvalidInput(f"unknown tier '{text}'; expected one of {names}") from None
