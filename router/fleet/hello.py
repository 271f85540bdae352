"""What of a Hello the fleet lets an agent register, and the handle it keeps of it.

A Hello arrives read and bounded (:func:`stratus.convert.hello.hello_from_wire`: the security
review's F12). :class:`Admission` holds it against the fleet: a pool's size and its members'
ids, and each family it describes against the operator's models folder or the ready agents'
description; :func:`handle_from_hello` keeps it, its declared sizes clamped."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from router.fleet.agent_handle import AgentHandle, State
from router.fleet.family_book import FamilyBook
from router.fleet.index import AgentIndex
from stratus.errors import AlreadyHeld, InvalidInput, Overloaded
from stratus.families.agent_hello import AgentHello, FamilyUnavailable
from stratus.families.description import FamilyDescription
from stratus.serving.auth import POOL_PREFIX

log = logging.getLogger("stratus.registry")

MAX_UPTIME_S = 100 * 365 * 86400.0  # past it (or NaN, or negative) a Hello's uptime is not believed
# A Hello's declared sizes steer how much work an agent is sent: clamped to these.
MAX_CAPACITY = 1024
MAX_QUEUE_LIMIT = 4096


def handle_from_hello(hello: AgentHello, *, peer: str, identity: str, now: float, heartbeat_s: float) -> AgentHandle:
    """The handle the registry keeps of a checked Hello, its declared sizes clamped (the work it
    is sent is bounded by what it is measured to serve, :meth:`AgentHandle.limit`)."""
    uptime = hello.uptime_s
    return AgentHandle(
        id=hello.agent_id,
        tier=hello.tier,
        host=hello.host,
        peer=peer,
        runtimes=tuple(hello.runtimes),
        variants={v.name: v for v in hello.variants},
        capacity=min(max(1, hello.capacity), MAX_CAPACITY),
        queue_limit=min(hello.queue_limit, MAX_QUEUE_LIMIT),
        last_heartbeat=now,
        heartbeat_s=heartbeat_s,
        unavailable=hello.unavailable,
        identity=identity,
        hardware=hello.hardware,
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

    def agreed(self, hello: AgentHello) -> AgentHello:
        """The Hello without the families it describes unlike the ready agents serving them
        (those are listed as unavailable on this agent): requests are checked and routed by
        one description of each family, and an agent that disagrees on one still serves the
        others. A Hello left with no variant is refused, saying why."""
        conflicts = self._conflicts(hello)
        if not conflicts:
            return hello
        reasons = "; ".join(f"family '{f}' {why}" for f, why in conflicts.items())
        refused = tuple(
            FamilyUnavailable(
                family=f,
                variant=",".join(v.name for v in hello.variants if v.family == f),
                reason=f"refused by the router: {why}",
            )
            for f, why in conflicts.items()
        )
        kept = dataclasses.replace(
            hello,
            variants=tuple(v for v in hello.variants if v.family not in conflicts),
            families=tuple(f for f in hello.families if f.name not in conflicts),
            unavailable=(*hello.unavailable, *refused),
        )
        if not kept.variants:
            raise InvalidInput(f"Hello from {hello.agent_id}: {reasons}")
        log.warning("agent %s: not serving %s here: %s", hello.agent_id, sorted(conflicts), reasons)
        return kept

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

    def _conflicts(self, hello: AgentHello) -> dict[str, str]:
        """Each family this Hello describes (or claims a variant for) unlike the fleet, and why."""
        conflicts: dict[str, str] = {}
        for family in hello.families:
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
