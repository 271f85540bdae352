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

    @classmethod
    def parse(cls, text: str) -> Tier:
        """The tier named ``text`` (``device``, ``edge`` or ``cloud``)."""
        try:
            return cls[text.strip().upper()]
        except KeyError:
            names = ", ".join(t.label for t in cls)
            raise InvalidInput(f"unknown tier '{text}'; expected one of {names}") from None
