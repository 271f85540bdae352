"""The families a router serves: as its agents' Hellos describe them, and with the thresholds
an operator pushed fleet-wide (router/thresholds/pushes.py) over theirs.

Each description arrives read (``stratus.convert.fleet.family_from_wire``, once per Hello), so
nothing here holds a Hello's messages. Under a push, the agents' own description is kept
apart, so reverting the push serves their thresholds again.
"""

from __future__ import annotations

from collections.abc import Mapping

from stratus.families.description import FamilyDescription
from stratus.tiers import Tier


class FamilyBook:
    def __init__(self) -> None:
        self.families: dict[str, FamilyDescription] = {}  # as the fleet serves each
        self._pushed: dict[str, Mapping[Tier, float]] = {}  # over the agents'
        self._own: dict[str, FamilyDescription] = {}  # as the agents describe each

    def learn(self, family: FamilyDescription) -> None:
        """A family a Hello describes, served from now on (under a push: its thresholds)."""
        if family.name not in self._pushed or family.name not in self._own:
            self._own[family.name] = family
        self.describe(self.served(family))

    def served(self, family: FamilyDescription) -> FamilyDescription:
        """The family as this fleet serves it. Under a push: the pushed thresholds over the
        first agent's (:meth:`FamilyDescription.under_push`)."""
        pushed = self._pushed.get(family.name)
        if pushed is None:
            return family
        return family.under_push(pushed, self._own.get(family.name, family))

    def override(self, family: str, thresholds: Mapping[Tier, float]) -> None:
        """Serve ``family`` with ``thresholds`` from now on, whatever its agents' Hellos say
        (a tier not named keeps theirs; empty: their own again). Its calibrated cloud share
        no longer describes the thresholds in force, so the baseline is dropped while a push
        holds."""
        if thresholds:
            self._pushed[family] = dict(thresholds)
        else:
            self._pushed.pop(family, None)
        own = self._own.get(family)
        if own is not None and family in self.families:
            self.describe(self.served(own))

    def own_thresholds(self, family: str) -> Mapping[Tier, float]:
        """The thresholds the agents' Hellos gave ``family`` (the first ready agent's)."""
        own = self._own.get(family)
        return own.thresholds if own is not None else {}

    def thresholds(self, family: str) -> Mapping[Tier, float]:
        described = self.families.get(family)
        return described.thresholds if described is not None else {}

    def describe(self, family: FamilyDescription) -> None:
        """Route ``family`` by this description."""
        self.families[family.name] = family

    def undescribe(self, name: str) -> None:
        """No listed agent serves ``name`` any more (a push over it stays, for its return)."""
        self.families.pop(name, None)

    def forget(self, name: str) -> None:
        """A new description replaces the old, which nobody serves: the agents' own goes too."""
        self.undescribe(name)
        self._own.pop(name, None)
