"""The families a router serves: as its agents' Hellos describe them, and with the thresholds
an operator pushed fleet-wide (router/thresholds.py) over theirs.

Each description is kept as a copy (a Hello's sub-message kept as is keeps its whole Hello
alive), its thresholds read once, when it is described. Under a push, the agents' own
description is kept apart, so reverting the push serves their thresholds again.
"""

from __future__ import annotations

from collections.abc import Mapping

from stratus.convert.fleet import thresholds_from_wire
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb


class FamilyBook:
    def __init__(self) -> None:
        self.families: dict[str, fpb.FamilyInfo] = {}  # as the fleet serves each
        self._thresholds: dict[str, Mapping[Tier, float]] = {}  # each family's, read once
        self._pushed: dict[str, dict[str, float]] = {}  # by tier label, over the agents'
        self._own: dict[str, fpb.FamilyInfo] = {}  # as the agents describe each

    def learn(self, family: fpb.FamilyInfo) -> None:
        """A family a Hello describes, served from now on (under a push: its thresholds)."""
        if family.name not in self._pushed or family.name not in self._own:
            self._own[family.name] = _detached(family)
        self.describe(self.served(family))

    def served(self, family: fpb.FamilyInfo) -> fpb.FamilyInfo:
        """The family as this fleet serves it. Under a push: the pushed thresholds over the
        first agent's (a recalibrated agent's own thresholds and calibration figures are not
        the fleet's, so they are not held against it), and no calibrated cloud share."""
        pushed = self._pushed.get(family.name)
        if pushed is None:
            return family
        base = self._own.get(family.name, family)
        served = fpb.FamilyInfo()
        served.CopyFrom(family)
        served.thresholds.clear()
        served.thresholds.update({**base.thresholds, **pushed})
        served.ClearField("calibrated")
        for tier, figures in base.calibrated.items():
            served.calibrated[tier].CopyFrom(figures)
        served.ClearField("calibrated_cloud_share")
        return served

    def override(self, family: str, thresholds: Mapping[Tier, float]) -> None:
        """Serve ``family`` with ``thresholds`` from now on, whatever its agents' Hellos say
        (a tier not named keeps theirs; empty: their own again). Its calibrated cloud share
        no longer describes the thresholds in force, so the baseline is dropped while a push
        holds."""
        if thresholds:
            self._pushed[family] = {tier.label: value for tier, value in thresholds.items()}
        else:
            self._pushed.pop(family, None)
        own = self._own.get(family)
        if own is not None and family in self.families:
            self.describe(self.served(own))

    def own_thresholds(self, family: str) -> Mapping[Tier, float]:
        """The thresholds the agents' Hellos gave ``family`` (the first ready agent's)."""
        own = self._own.get(family)
        return {Tier.parse(k): v for k, v in own.thresholds.items()} if own else {}

    def thresholds(self, family: str) -> Mapping[Tier, float]:
        return self._thresholds.get(family, {})

    def describe(self, family: fpb.FamilyInfo) -> None:
        """Route ``family`` by this description, its thresholds read once, here (a Hello's
        were checked by check_hello_bounds; InvalidInput for a key that names no tier)."""
        self.families[family.name] = _detached(family)
        self._thresholds[family.name] = thresholds_from_wire(family.thresholds, f"family {family.name!r}")

    def undescribe(self, name: str) -> None:
        """No listed agent serves ``name`` any more (a push over it stays, for its return)."""
        self.families.pop(name, None)
        self._thresholds.pop(name, None)

    def forget(self, name: str) -> None:
        """A new description replaces the old, which nobody serves: the agents' own goes too."""
        self.undescribe(name)
        self._own.pop(name, None)


def _detached(family: fpb.FamilyInfo) -> fpb.FamilyInfo:
    """A copy of a Hello's FamilyInfo: kept as is, a sub-message keeps its whole Hello alive."""
    kept = fpb.FamilyInfo()
    kept.CopyFrom(family)
    return kept
