"""The fleet registry: every agent that said Hello, its state, and the families they describe.

Owned by the router's event loop (no locks): the AgentLink servicer registers agents and
feeds their heartbeats and results in; the data plane reads snapshots from the index and
asks the agents there (each handle's Work goes through its own ``work``,
:mod:`router.backends.agent`); the Fleet service reads status and watches changes. An agent whose
stream breaks (HTTP/2 keepalive tells a dead or frozen peer within seconds), or that
misses three heartbeats, is marked lost at once and every request it held fails over.

Where each agent stands (ready, draining, lost), the moves between those states and the
heartbeats' pace are kept by :class:`router.fleet.states.AgentStates`; the registry admits
agents, takes their reloads, wires their Work and answers reads.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence

from router.backends.agent import AgentWork, WorkSettings
from router.backends.base import Backend
from router.fleet.agent_handle import AgentHandle, State
from router.fleet.family_book import FamilyBook
from router.fleet.hello import Admission, handle_from_hello
from router.fleet.index import AgentIndex
from router.fleet.states import AgentStates
from router.fleet.watchers import Watchers
from router.policy import FleetSnapshot
from stratus.convert.hardware import describe as describe_hardware
from stratus.convert.work import WorkResult
from stratus.errors import AlreadyHeld, InvalidInput, NotFound
from stratus.families.agent_hello import AgentHello
from stratus.families.description import FamilyDescription
from stratus.families.generation import Chunk
from stratus.obs.metrics import RouterMetrics
from stratus.obs.stats import LoadReport
from stratus.sched.batching import DEFAULT_MAX_DELAY_S
from stratus.serving.auth import POOL_PREFIX
from stratus.tiers import Tier

log = logging.getLogger("stratus.registry")

# What holds an agent's Work side: AgentWork for a linked agent; the router's own tier gives its
# own (router/fleet/in_process.py), which runs a classifier's batches without a message.
WorkMaker = Callable[[AgentHandle, WorkSettings], AgentWork]

# Longest a Reload call waits for its agent (the caller chooses less, never more).
MAX_RELOAD_WAIT_S = 600.0


class FleetRegistry:
    def __init__(
        self,
        *,
        heartbeat_s: float = 1.0,
        max_heartbeats_per_s: float = 100.0,
        max_batch_delay_s: float = DEFAULT_MAX_DELAY_S,
        clock: Callable[[], float] = time.monotonic,
        metrics: RouterMetrics | None = None,
        pool_sizes: Mapping[str, int] | None = None,
        own_families: Mapping[str, FamilyDescription] | None = None,
    ) -> None:
        self.metrics = metrics
        self.heartbeat_s = heartbeat_s
        self.max_batch_delay_s = max_batch_delay_s
        self._clock = clock
        self.agents: dict[str, AgentHandle] = {}
        self.book = FamilyBook()  # the families the agents describe, and thresholds pushed over them
        self.index: AgentIndex[AgentHandle] = AgentIndex()
        self._ids = itertools.count(1)
        self.watchers = Watchers()  # Fleet.Watch calls, told of each change
        # Each agent's state and the moves between them (drains, losses, the heartbeats' pace).
        self.states = AgentStates(
            self.agents,
            self.index,
            self.book,
            heartbeat_s=heartbeat_s,
            max_heartbeats_per_s=max_heartbeats_per_s,
            clock=clock,
            changed=self.changed,
        )
        # What a Hello may register: pools up to --agent-pool NAME=MAX; families as the operator's
        # own copy of the models folder describes them (--models), whoever speaks first
        # (security2 F2), else as the first ready agent described them.
        self.admission = Admission(
            self.book,
            self.index,
            self.agents,
            own_families=dict(own_families) if own_families is not None else None,
            pool_sizes=dict(pool_sizes or {}),
        )
        # What the site's store says an operator made of an agent ("drained", "ready",
        # "forgotten"; None: nothing), so an agent drained site-wide stays so when it links here.
        self.site_mark: Callable[[str], str | None] = lambda agent_id: None
        # Whether the cloud serves a family (set by the data plane, which knows the cloud): where it does,
        # an agent's unanswered Work is bounded by its patience (``elsewhere``).
        self.cloud_serves: Callable[[str], bool] = lambda family: False

    def now(self) -> float:
        return self._clock()

    @property
    def pace_s(self) -> float:
        """The heartbeat interval agents are asked for now (:func:`router.fleet.states.pace_for`)."""
        return self.states.pace_s

    @property
    def families(self) -> dict[str, FamilyDescription]:
        """Each family as this fleet serves it (a push's thresholds over its agents')."""
        return self.book.families

    # -- joining and reloading ---------------------------------------------------------
    def register(
        self, hello: AgentHello, peer: str, identity: str = "anonymous", *, work: WorkMaker = AgentWork
    ) -> AgentHandle:
        """Admit an agent. An id already linked is replaced only by the identity that holds it
        (the agent reconnected before we noticed); another identity is refused, so a stranger
        cannot knock an agent off its link (see :class:`stratus.serving.auth.RouterCredentials`)."""
        previous = self.agents.get(hello.agent_id)
        if previous is not None and previous.state != State.LOST and previous.identity != identity:
            raise AlreadyHeld(
                f"agent id {hello.agent_id!r} is linked by another identity; it is not replaced"
            )
        if identity.startswith(POOL_PREFIX):
            self.admission.check_pool(hello.agent_id, identity, previous)
        hello = self.admission.agreed(hello)
        if previous is not None:
            if previous.state != State.LOST:
                log.warning("agent %s reconnected from %s; dropping its old link", hello.agent_id, peer)
                self.lose(previous, "replaced by a new link")
            self.states.drop(previous)
        handle = handle_from_hello(hello, peer=peer, identity=identity, now=self.now(), heartbeat_s=self.pace_s)
        handle.work = work(handle, self._work_settings(handle))
        for family in hello.families:
            if family.name not in self.families:
                self.book.learn(family)
        log.info(
            "agent %s joined: tier %s, hardware %s, variants %s, from %s",
            handle.id,
            handle.tier.label,
            describe_hardware(handle.hardware),
            sorted(handle.variants),
            peer,
        )
        self.states.joined(handle)
        self.changed()
        return handle

    def reannounce(self, handle: AgentHandle, hello: AgentHello) -> None:
        """A Hello on a live link: the agent reloaded and now serves what it says.

        Work already sent carries on (the agent keeps answering it); the index moves the
        agent to its new names at once. A Hello this fleet would refuse leaves the agent
        registered as it was, and says why, to the operator who asked for the reload.
        """
        if hello.agent_id != handle.id or hello.tier is not handle.tier:
            raise InvalidInput(f"a reload may not change the agent's name or tier ({handle.id})")
        ready = handle.ready
        self.index.forget(handle)  # its old names, so only other agents count in the check
        try:
            hello = self.admission.agreed(hello)
        except InvalidInput as exc:
            self._readd(handle, ready)
            handle.settle_reloads(f"refused: {exc}")
            raise
        handle.announce({v.name: v for v in hello.variants})
        handle.unavailable = hello.unavailable
        for family in hello.families:
            self.book.learn(family)
        self._readd(handle, ready)
        log.info("agent %s reloaded: variants %s", handle.id, sorted(handle.variants))
        handle.settle_reloads("")
        self.changed()

    def _readd(self, handle: AgentHandle, ready: bool) -> None:
        self.index.add(handle)
        if ready:
            self.index.ready(handle)

    def reload_failed(self, handle: AgentHandle, message: str) -> None:
        log.warning("agent %s could not reload: %r", handle.id, message[:500])
        handle.settle_reloads(message or "reload failed")

    async def reload(self, agent_id: str, timeout_s: float) -> tuple[AgentHandle, str]:
        """Ask an agent to reload and wait for its answer: ("" or the problem)."""
        handle = self.agents.get(agent_id)
        if handle is None or handle.state == State.LOST:
            raise NotFound(f"no linked agent '{agent_id}'")
        return handle, await handle.reload(min(timeout_s, MAX_RELOAD_WAIT_S))

    # -- where agents stand: router/fleet/states.py ---------------------------------------
    def draining(self, handle: AgentHandle) -> None:
        self.states.draining(handle)

    def lose(self, handle: AgentHandle, reason: str) -> None:
        self.states.lose(handle, reason)

    def heartbeat(self, handle: AgentHandle, beat: LoadReport) -> None:
        self.states.heartbeat(handle, beat)

    def check_heartbeats(self) -> None:
        self.states.check_heartbeats()

    def check_mark(self, agent_id: str, mark: str) -> AgentHandle:
        return self.states.check_mark(agent_id, mark)

    def drain(self, agent_id: str) -> AgentHandle:
        return self.states.drain(agent_id)

    def undrain(self, agent_id: str) -> AgentHandle:
        return self.states.undrain(agent_id)

    def forget(self, agent_id: str) -> AgentHandle:
        return self.states.forget(agent_id)

    # -- work ------------------------------------------------------------------------------
    def result(self, handle: AgentHandle, result: WorkResult) -> None:
        if handle.work.result(result):
            handle.completions.add(result.items)

    def chunk(self, handle: AgentHandle, request_id: str, chunk: Chunk) -> None:
        handle.work.chunk(request_id, chunk)

    def _work_settings(self, handle: AgentHandle) -> WorkSettings:
        metrics = self.metrics
        return WorkSettings(
            clock=self._clock,
            ids=self._ids,
            max_batch_delay_s=self.max_batch_delay_s,
            on_batch=metrics.batch_items.observe if metrics is not None else lambda items: None,
            on_stuck=lambda reason: self.lose(handle, reason),
            elsewhere=lambda variant: self.elsewhere(handle, variant),
        )

    def elsewhere(self, handle: AgentHandle, variant: str) -> bool:
        """Another ready agent, or the cloud (``cloud_serves``, set by the data plane), serves the family
        of ``variant`` that ``handle`` runs: its requests have somewhere else to go."""
        family = self.index.family_of(variant) or variant
        if self.cloud_serves(family):
            return True
        return any(agent is not handle for pool in self.index.pools(family).values() for agent in pool)

    # -- reads -------------------------------------------------------------------------------
    def snapshot(self, model: str, cloud: Sequence[Backend] = ()) -> FleetSnapshot[Backend]:
        """What the policy needs for one model, with ``cloud``'s gateways that serve it:
        constant cost, whatever the fleet's size."""
        pools: Mapping[Tier, Sequence[Backend]] = self.index.pools(model)
        tiers = self.index.tiers(model)
        if cloud:
            pools = {**pools, Tier.CLOUD: cloud}
            tiers = tiers | {Tier.CLOUD}
        return FleetSnapshot(pools=pools, tiers=tiers)

    def family(self, name: str) -> FamilyDescription | None:
        return self.book.families.get(name)

    def thresholds(self, family: str) -> Mapping[Tier, float]:
        return self.book.thresholds(family)

    def own_thresholds(self, family: str) -> Mapping[Tier, float]:
        return self.book.own_thresholds(family)

    def family_tiers(self, family: str) -> frozenset[Tier]:
        """The tiers with an agent of ``family`` listed (ready, draining or lost)."""
        return self.index.tiers(family)

    def describe(self, family: FamilyDescription) -> None:
        self.book.describe(family)

    def override_thresholds(self, family: str, thresholds: Mapping[Tier, float]) -> None:
        """Serve ``family`` with ``thresholds`` from now on (:meth:`FamilyBook.override`)."""
        self.book.override(family, thresholds)
        self.changed()

    def watch(self, *, address: str = "", operator: bool = False) -> asyncio.Queue[None]:
        return self.watchers.watch(address=address, operator=operator)

    def unwatch(self, queue: asyncio.Queue[None]) -> None:
        self.watchers.unwatch(queue)

    def changed(self) -> None:
        self.watchers.changed()
