"""Fleet-wide threshold pushes: a family's escalation thresholds, versioned, on every router.

The agents' Hellos carry each family's thresholds (family.toml); before this a recalibrated
family was refused on a router until the last agent serving the old thresholds reloaded.
An operator's push (``stratus fleet thresholds FAMILY --apply``) makes a new *version* of the
family's thresholds, with who, when and why: the router's cascade uses it instead of the
Hellos' at once (``FleetRegistry.override_thresholds``), agents announcing other thresholds
are no longer refused for it, and ``--revert`` makes a new version holding what was in
force before the current one (walking back one version per revert; past the first, the
agents' own thresholds again).

Versions only grow: every change is written to the site's store (``router/site/mirror.py``)
by compare-and-swap on the revision it was made on, so of two routers changing one family at
once one wins and the other's operator is told; every router follows the store, and a
restarted router applies the records before its first agent links.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from stratus.convert.fleet import audit_row_to_wire
from stratus.errors import ConfigError, Conflict, InvalidInput, NotFound
from stratus.families.confidence import threshold_problem
from stratus.families.description import FamilyDescription
from stratus.families.suggest import AuditRow
from stratus.obs.metrics import Metric, gauge
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb

log = logging.getLogger("stratus.thresholds")

# Bounds on a record, wherever it comes from (an operator, the site's store).
MAX_HISTORY: Final = 50
MAX_TEXT: Final = 1000
# Families with pushed thresholds one router keeps: a site's store holds one record per family
# (benchmarks/site_state.py found 256 too few: a router restarted on a store of 500 dropped the
# family it served, the last one written).
MAX_FAMILIES: Final = 4096
MAX_VERSION: Final = 2**53

Thresholds = Mapping[Tier, float]
Listener = Callable[[str, Thresholds], None]


@dataclass(frozen=True, kw_only=True)
class Version:
    """One version of a family's pushed thresholds. Empty ``thresholds``: the agents' own."""

    version: int
    thresholds: Thresholds
    author: str = ""
    reason: str = ""
    updated: float = 0.0  # unix time of the change, where it was made
    origin: str = ""  # the router that made it
    base: int = 0  # the version whose thresholds this one replaced (0: the agents' own)

    def __post_init__(self) -> None:
        """Checked whoever made it: a bad record from the store must not reach the cascade."""
        if not 1 <= self.version <= MAX_VERSION or not 0 <= self.base < self.version:
            raise InvalidInput(f"threshold version {self.version} (base {self.base}) is out of bounds")
        check_thresholds(self.thresholds)
        if any(len(text) > MAX_TEXT for text in (self.author, self.reason, self.origin)):
            raise InvalidInput(
                f"a threshold version's author, reason and origin are at most {MAX_TEXT} characters"
            )

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "thresholds": {tier.label: value for tier, value in sorted(self.thresholds.items())},
            "author": self.author,
            "reason": self.reason,
            "updated": self.updated,
            "origin": self.origin,
            "base": self.base,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Version:
        return cls(
            version=int(data["version"]),
            thresholds=parse_thresholds(data.get("thresholds", {})),
            author=str(data.get("author", "")),
            reason=str(data.get("reason", "")),
            updated=float(data.get("updated", 0.0)),
            origin=str(data.get("origin", "")),
            base=int(data.get("base", 0)),
        )


def check_thresholds(thresholds: Thresholds) -> None:
    """Each value one the cascade can compare confidences with (``threshold_problem``)."""
    for tier, value in thresholds.items():
        problem = threshold_problem(value) if isinstance(tier, Tier) else f"{value!r} names no tier"
        if problem is not None:
            raise InvalidInput(f"the {getattr(tier, 'label', tier)} threshold {problem}")


def parse_thresholds(named: Mapping[str, float]) -> dict[Tier, float]:
    """Thresholds by tier name ("device", "edge") as the wire and the file spell them."""
    try:
        parsed = {Tier.parse(str(name)): float(value) for name, value in named.items()}
    except (ValueError, TypeError) as exc:
        raise InvalidInput(f"thresholds name a tier (device, edge, cloud) and a number: {exc}") from None
    check_thresholds(parsed)
    return parsed


def labelled(thresholds: Thresholds) -> dict[str, float]:
    return {tier.label: value for tier, value in sorted(thresholds.items())}


@dataclass(frozen=True, kw_only=True)
class Record:
    """A family's versions, oldest first; the last is in force."""

    family: str
    history: tuple[Version, ...]

    def __post_init__(self) -> None:
        if not self.history or len(self.history) > MAX_HISTORY or len(self.family) > MAX_TEXT:
            raise InvalidInput(f"a threshold record holds 1 to {MAX_HISTORY} versions of a named family")
        versions = [v.version for v in self.history]
        if versions != sorted(set(versions)):
            raise InvalidInput(f"threshold versions of '{self.family}' must rise: {versions}")

    @property
    def current(self) -> Version:
        return self.history[-1]

    def find(self, version: int) -> Version | None:
        return next((v for v in self.history if v.version == version), None)

    def to_json(self) -> dict[str, Any]:
        return {"family": self.family, "history": [v.to_json() for v in self.history]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Record:
        try:
            return cls(
                family=str(data["family"]), history=tuple(Version.from_json(v) for v in data["history"])
            )
        except (KeyError, TypeError, ValueError, InvalidInput) as exc:
            raise ConfigError(f"a threshold record is malformed: {type(exc).__name__}: {exc}") from None


class ThresholdPushes:
    """The pushed thresholds one router applies. Owned by its event loop;
    ``listeners`` are told (family, thresholds in force; empty: the agents' own) of every change."""

    def __init__(
        self,
        *,
        router_id: str,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.router_id = router_id
        self._wall = wall_clock
        self._records: dict[str, Record] = {}
        self.listeners: list[Listener] = []
        # Told of each push made here (an operator's, --auto-thresholds'), to write to the site's store.
        self.on_change: Callable[[str], None] | None = None

    # -- operator actions ------------------------------------------------------------------
    def apply(
        self, family: str, thresholds: Thresholds, *, author: str, reason: str, expected: int = 0
    ) -> Version:
        """A new version holding ``thresholds``, in force on this router at once."""
        if not thresholds:
            raise InvalidInput("a push names at least one tier's threshold (for example device=0.9)")
        current = self._current(family, expected)
        base = current.version if current is not None else 0
        return self._add(family, dict(thresholds), author=author, reason=reason, base=base)

    def revert(self, family: str, *, author: str, reason: str, expected: int = 0) -> Version:
        """A new version holding what was in force before the current one."""
        current = self._current(family, expected)
        if current is None or (current.base == 0 and not current.thresholds):
            raise InvalidInput(f"'{family}' runs on its agents' own thresholds: there is nothing to revert")
        if current.base == 0:
            return self._add(family, {}, author=author, reason=reason, base=0)
        before = self._records[family].find(current.base)
        if before is None:
            raise InvalidInput(
                f"version {current.base} of '{family}' is past the {MAX_HISTORY} kept: apply the thresholds wanted"
            )
        return self._add(family, dict(before.thresholds), author=author, reason=reason, base=before.base)

    # -- reads ---------------------------------------------------------------------------------
    def record(self, family: str) -> Record | None:
        return self._records.get(family)

    def in_force(self, family: str) -> Thresholds:
        """The pushed thresholds of ``family``; empty where its agents' own apply."""
        record = self._records.get(family)
        return record.current.thresholds if record is not None else {}

    def families(self) -> list[str]:
        return sorted(self._records)

    # -- changes ---------------------------------------------------------------------------------
    def _current(self, family: str, expected: int) -> Version | None:
        record = self._records.get(family)
        current = record.current if record is not None else None
        version = current.version if current is not None else 0
        if expected and expected != version:
            raise Conflict(
                f"'{family}' is at threshold version {version}, not {expected}: someone changed it; read it again"
            )
        if current is None and family not in self._records and len(self._records) >= MAX_FAMILIES:
            raise InvalidInput(f"{MAX_FAMILIES} families have pushed thresholds already, the most kept")
        return current

    def _add(
        self, family: str, thresholds: dict[Tier, float], *, author: str, reason: str, base: int
    ) -> Version:
        record = self._records.get(family)
        history = record.history if record is not None else ()
        version = Version(
            version=(history[-1].version if history else 0) + 1,
            thresholds=thresholds,
            author=author[:MAX_TEXT],
            reason=reason[:MAX_TEXT],
            updated=self._wall(),
            origin=self.router_id,
            base=base,
        )
        self._adopt(Record(family=family, history=(*history, version)[-MAX_HISTORY:]))
        log.info("thresholds of %s: version %d %s by %s: %s", family, version.version,
                 labelled(thresholds) or "(the agents' own)", author, reason)  # fmt: skip
        if self.on_change is not None:
            self.on_change(family)
        return version

    # -- the site's store (router/site/mirror.py) ------------------------------------------------
    def adopt(self, record: Record) -> None:
        """A record from the site's store, taken whatever its version (the store orders them)."""
        if record.family not in self._records and len(self._records) >= MAX_FAMILIES:
            log.warning("thresholds of %r not adopted: %d families kept already", record.family, MAX_FAMILIES)
            return
        self._adopt(record)

    def restore(self, family: str, record: Record | None) -> None:
        """Put back the record a refused change replaced (None: the family had none)."""
        if record is None:
            self._records.pop(family, None)
            for listener in self.listeners:
                listener(family, {})
        else:
            self._adopt(record)

    def _adopt(self, record: Record) -> None:
        self._records[record.family] = record
        for listener in self.listeners:
            listener(record.family, record.current.thresholds)


# ---------------------------------------------------------------------------------------------
# The Fleet service's Thresholds call (authorised by the servicer)
# ---------------------------------------------------------------------------------------------


class FamilyThresholds(Protocol):
    """What a push reads of the registry (``router.fleet.registry.FleetRegistry``)."""

    def family(self, name: str) -> FamilyDescription | None: ...

    def thresholds(self, family: str) -> Mapping[Tier, float]: ...

    def own_thresholds(self, family: str) -> Mapping[Tier, float]: ...

    def family_tiers(self, family: str) -> frozenset[Tier]: ...


def steer(
    pushes: ThresholdPushes,
    registry: FamilyThresholds,
    request: fpb.ThresholdsRequest,
    rows: Callable[[str], Sequence[AuditRow]] | None = None,
) -> fpb.ThresholdsReply:
    """Read, apply or revert ``request.family``'s pushed thresholds; the reply says what is in
    force (and, asked for, the audit rows a suggestion is chosen on)."""
    family, action = request.family, request.action
    if action == fpb.THRESHOLDS_ACTION_STATUS:
        answer = reply(pushes, registry, family)
        if request.include_rows and rows is not None:
            answer.rows.extend(audit_row_to_wire(row) for row in rows(family))
        return answer
    if registry.family(family) is None:
        raise NotFound(f"no agent serves a family '{family}'")
    author, why = request.author or "operator", request.reason or "no reason given"
    if action == fpb.THRESHOLDS_ACTION_APPLY:
        thresholds = pushable(request.thresholds)
        _check_tiers_served(family, thresholds, registry)
        version = pushes.apply(family, thresholds, author=author, reason=why, expected=request.expected_version)
    elif action == fpb.THRESHOLDS_ACTION_REVERT:
        version = pushes.revert(family, author=author, reason=why, expected=request.expected_version)
    else:
        raise InvalidInput(f"unknown thresholds action {action}")
    shown = labelled(version.thresholds) or "the agents' own"
    return reply(pushes, registry, family, f"version {version.version} in force: {shown}")


def _check_tiers_served(family: str, thresholds: Mapping[Tier, float], registry: FamilyThresholds) -> None:
    """A push names only tiers the family has: an agent of it listed there, or a threshold of
    its own there. ``edge=0.5`` for a device-and-cloud family was kept and never read."""
    has = registry.family_tiers(family) | set(registry.own_thresholds(family))
    missing = sorted(tier for tier in thresholds if tier not in has)
    if missing:
        served = "/".join(t.label for t in sorted(has - {Tier.CLOUD})) or "no tier below the cloud"
        raise InvalidInput(
            f"'{family}' has no {'/'.join(t.label for t in missing)} tier (no agent of it there, no "
            f"threshold of its own there): push thresholds for {served}"
        )


def pushable(named: Mapping[str, float]) -> dict[Tier, float]:
    """A push's thresholds: tiers below the cloud (the top tier always answers)."""
    thresholds = parse_thresholds(named)
    if Tier.CLOUD in thresholds:
        raise InvalidInput("the cloud tier answers whatever its confidence: push device and edge thresholds")
    return thresholds


def reply(
    pushes: ThresholdPushes, registry: FamilyThresholds, family: str, message: str = ""
) -> fpb.ThresholdsReply:
    record = pushes.record(family)
    history = record.history if record is not None else ()
    return fpb.ThresholdsReply(
        family=family,
        history=[to_wire(v) for v in history],
        in_force=labelled(registry.thresholds(family)),
        agents=labelled(registry.own_thresholds(family)),
        message=message,
    )


def to_wire(version: Version) -> fpb.ThresholdVersion:
    return fpb.ThresholdVersion(
        version=version.version,
        thresholds=labelled(version.thresholds),
        author=version.author,
        reason=version.reason,
        updated=version.updated,
        origin=version.origin,
        base=version.base,
    )


def threshold_levels(pushes: ThresholdPushes, registry: FamilyThresholds) -> list[Metric]:
    """What Prometheus reads at each scrape: each family's pushed version (it only grows, so
    its increase counts the changes) and each tier's threshold in force on this router."""
    families = pushes.families()
    in_force = [
        ([f, tier.label], value) for f in families for tier, value in sorted(registry.thresholds(f).items())
    ]
    versions = [([f], float(record.current.version)) for f in families if (record := pushes.record(f))]
    return [
        gauge("stratus_router_threshold_version", "The pushed threshold version in force for a family "
              "(stratus fleet thresholds; its increase counts pushes and reverts).", ["family"], versions),
        gauge("stratus_router_threshold", "A tier's escalation threshold in force for a family where a "
              "push holds (the agents' own for tiers the push does not name).", ["family", "tier"], in_force),
    ]  # fmt: skip
