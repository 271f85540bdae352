"""What one Hello may declare, and what of it the fleet lets an agent register.

:func:`check_hello_bounds` runs before the router keeps anything of a Hello (the security
review's F12): a Hello comes from a stranger; its ids and names end up in logs, status and
metrics labels, so they are a plain charset of bounded length, and its counts are bounded.
:class:`Admission` then holds it against the fleet: a pool's size and its members' ids, and
each family it describes against the operator's models folder or the ready agents' description."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from router.fleet.agent_handle import AgentHandle, State
from router.fleet.family_book import FamilyBook
from router.fleet.index import AgentIndex
from stratus.convert.fleet import family_from_wire, thresholds_from_wire
from stratus.convert.hardware import from_hello as hardware_from_hello
from stratus.errors import AlreadyHeld, InvalidInput, Overloaded
from stratus.families.audit import check_family_info
from stratus.families.description import FamilyDescription
from stratus.serving.auth import POOL_PREFIX
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb

log = logging.getLogger("stratus.registry")

# What one Hello may declare, and what the router keeps of it: ids and names are client
# text (logged, listed, echoed), declared sizes steer how much work an agent is sent.
NAME = re.compile(r"[A-Za-z0-9._:@-]{1,128}")
VERSION = re.compile(r"[A-Za-z0-9.+_-]{0,64}")  # a PEP 440 version ("0.1.0", "0.2.0rc1+g3f2a"), or none
MAX_VARIANTS_PER_AGENT = 64  # a shipped agent has 6; 256 let one Hello hold 77 kB of names
MAX_FAMILIES_PER_HELLO = 64
MAX_UPTIME_S = 100 * 365 * 86400.0  # past it (or NaN, or negative) a Hello's uptime is not believed
# A Hello's declared sizes steer how much work an agent is sent: clamped to these.
MAX_CAPACITY = 1024
MAX_QUEUE_LIMIT = 4096


def check_hello_bounds(hello: fpb.Hello) -> None:
    """Refuse a Hello whose names or counts are past what the router keeps (INVALID_ARGUMENT):
    ids and names are a plain charset, 128 characters at most, so a log line or a status
    cannot be forged or flooded through them."""
    if not NAME.fullmatch(hello.agent_id):
        raise InvalidInput(f"Hello.agent_id {hello.agent_id[:40]!r} must be 1-128 of A-Z a-z 0-9 . _ : @ -")
    if not VERSION.fullmatch(hello.version):
        raise InvalidInput(
            f"Hello from {hello.agent_id}: version {hello.version[:40]!r} must be 0-64 of A-Z a-z 0-9 . + _ -"
        )
    if len(hello.variants) > MAX_VARIANTS_PER_AGENT or len(hello.families) > MAX_FAMILIES_PER_HELLO:
        raise InvalidInput(
            f"Hello from {hello.agent_id}: {len(hello.variants)} variants and {len(hello.families)} families; "
            f"at most {MAX_VARIANTS_PER_AGENT} and {MAX_FAMILIES_PER_HELLO}"
        )
    for family in hello.families:
        check_family_info(hello.agent_id, family)
        thresholds_from_wire(family.thresholds, f"Hello from {hello.agent_id}: family {family.name[:40]!r}")
    names = (
        [v.name for v in hello.variants]
        + [v.family for v in hello.variants]
        + [f.name for f in hello.families]
    )
    bad = next((name for name in names if not NAME.fullmatch(name)), None)
    if bad is not None:
        raise InvalidInput(
            f"Hello from {hello.agent_id}: model name {bad[:40]!r} must be 1-128 of A-Z a-z 0-9 . _ : @ -"
        )
    for family in hello.families:
        share = family.calibrated_cloud_share
        if family.HasField("calibrated_cloud_share") and not 0.0 <= share <= 1.0:  # NaN fails too
            raise InvalidInput(
                f"Hello from {hello.agent_id}: family {family.name}'s calibrated_cloud_share {share} "
                "must lie between 0 and 1"
            )


def handle_from_hello(hello: fpb.Hello, *, peer: str, identity: str, now: float, heartbeat_s: float) -> AgentHandle:
    """The handle the registry keeps of a checked Hello, its declared sizes clamped (the work it
    is sent is bounded by what it is measured to serve, :meth:`AgentHandle.limit`)."""
    uptime = hello.uptime_s
    return AgentHandle(
        id=hello.agent_id,
        tier=Tier.from_wire(hello.tier),
        host=hello.host,
        peer=peer,
        runtimes=tuple(hello.runtimes),
        variants={v.name: v for v in hello.variants},
        capacity=min(max(1, hello.capacity), MAX_CAPACITY),
        queue_limit=min(hello.queue_limit, MAX_QUEUE_LIMIT),
        last_heartbeat=now,
        heartbeat_s=heartbeat_s,
        unavailable=tuple(hello.unavailable),
        identity=identity,
        hardware=hardware_from_hello(hello),
        version=hello.version,
        started=now - uptime if 0 < uptime <= MAX_UPTIME_S else None,  # when its process started
    )


# What two descriptions of a family must agree on to be served together.
_DESCRIBED: Final = ("inputs", "outputs", "thresholds", "calibrated_cloud_share", "generation", "escalate", "offline")


@dataclass
class Admission:
    """What a Hello may register in this fleet, given its agents (``agents``, ``index``), the
    families they describe (``book``), the operator's own descriptions (``own_families``; None:
    the first ready agent's description is the fleet's) and pool sizes (``--agent-pool``)."""

    book: FamilyBook
    index: AgentIndex[AgentHandle]
    agents: Mapping[str, AgentHandle]
    own_families: Mapping[str, FamilyDescription] | None
    pool_sizes: Mapping[str, int]

    def check_pool(self, agent_id: str, identity: str, previous: AgentHandle | None) -> None:
        """A pool member (``pool:NAME``): every member holds the same certificate, so a member
        never takes over an id that is linked (the old link is dropped once it misses its
        heartbeats, and the id is free again), and the pool holds at most what its operator
        configured (``--agent-pool NAME=MAX``)."""
        if previous is not None and previous.state != State.LOST:
            raise AlreadyHeld(
                f"agent id {agent_id!r} is linked by another member of pool {identity[len(POOL_PREFIX):]!r}; "
                "a pool member never replaces a linked one (retry once that link is gone)"
            )
        most = self.pool_sizes.get(identity[len(POOL_PREFIX) :], 0)
        linked = sum(1 for a in self.agents.values() if a.identity == identity and a.state != State.LOST)
        if linked >= most:
            raise Overloaded(
                f"pool {identity[len(POOL_PREFIX):]!r} has {linked} agents linked, the most its operator "
                f"configured (--agent-pool {identity[len(POOL_PREFIX):]}={most})"
            )

    def agreed(self, hello: fpb.Hello) -> tuple[fpb.Hello, list[FamilyDescription]]:
        """The Hello without the families it describes unlike the ready agents serving them
        (those are listed as unavailable on this agent), and the families it still describes,
        read once, here: requests are checked and routed by one description of each family,
        and an agent that disagrees on one still serves the others. A Hello left with no
        variant is refused, saying why."""
        described = [family_from_wire(family) for family in hello.families]
        conflicts = self._conflicts(hello, described)
        if not conflicts:
            return hello, described
        reasons = "; ".join(f"family '{f}' {why}" for f, why in conflicts.items())
        kept = fpb.Hello()
        kept.CopyFrom(hello)
        del kept.variants[:], kept.families[:]
        kept.variants.extend(v for v in hello.variants if v.family not in conflicts)
        kept.families.extend(f for f in hello.families if f.name not in conflicts)
        kept.unavailable.extend(
            fpb.FamilyUnavailable(
                family=f,
                variant=",".join(v.name for v in hello.variants if v.family == f),
                reason=f"refused by the router: {why}",
            )
            for f, why in conflicts.items()
        )
        if not kept.variants:
            raise InvalidInput(f"Hello from {hello.agent_id}: {reasons}")
        log.warning("agent %s: not serving %s here: %s", hello.agent_id, sorted(conflicts), reasons)
        return kept, [family for family in described if family.name not in conflicts]

    def _unlike_own(self, family: FamilyDescription) -> str | None:
        """Why an agent's description of ``family`` is not the operator's, or None."""
        assert self.own_families is not None
        own = self.own_families.get(family.name)
        if own is None:
            return "is not in the router's own models folder (--models): an agent cannot add a family"
        differs = [f for f in _DESCRIBED if getattr(own, f) != getattr(family, f)]
        if differs:
            return f"differs from the router's own models folder ({', '.join(differs)} differ)"
        return None

    def _conflicts(self, hello: fpb.Hello, described: Sequence[FamilyDescription]) -> dict[str, str]:
        """Each family this Hello describes (or claims a variant for) unlike the fleet, and why."""
        conflicts: dict[str, str] = {}
        for family in described:
            if self.own_families is not None:
                if (why := self._unlike_own(family)) is not None:
                    conflicts[family.name] = why
                continue
            known = self.book.families.get(family.name)
            if known is None or known == self.book.served(family):
                continue
            if not self.index.serves(family.name):  # nobody serves the old description now
                self.book.forget(family.name)
                continue
            differs = [f for f in _DESCRIBED if getattr(known, f) != getattr(family, f)]
            conflicts[family.name] = (
                f"differs from the one ready agents serve ({', '.join(differs)} differ); refused until they leave"
            )
        for variant in hello.variants:
            owner = self.index.family_of(variant.name)
            if owner is not None and owner != variant.family and self.index.serves(variant.name):
                conflicts[variant.family] = (
                    f"claims variant '{variant.name}', which belongs to family '{owner}' in this fleet"
                )
        return conflicts


def check_hello_variants(hello: fpb.Hello) -> None:
    if not hello.variants:
        raise InvalidInput(f"Hello from {hello.agent_id}: no variants")
