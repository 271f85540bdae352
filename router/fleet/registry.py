"""The fleet registry: every agent that said Hello, its state, and the families they describe.

Owned by the router's event loop (no locks): the AgentLink servicer registers agents and
feeds their heartbeats and results in; the data plane reads snapshots from the index and
asks the agents there (each handle's Work goes through its own ``work``,
:mod:`router.backends.agent`); the Fleet service reads status and watches changes. An agent whose
stream breaks (HTTP/2 keepalive tells a dead or frozen peer within seconds), or that
misses three heartbeats, is marked lost at once and every request it held fails over.

Heartbeats cost the router a bounded rate: the interval the router asks for (the pace)
doubles each time the fleet would otherwise send more than ``max_heartbeats_per_s``.
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
from router.fleet.hello import Admission, check_hello_bounds, check_hello_variants, handle_from_hello
from router.fleet.index import AgentIndex
from router.fleet.watchers import Watchers
from router.policy import FleetSnapshot
from stratus.convert.hardware import describe as describe_hardware
from stratus.errors import (
    AlreadyHeld,
    ConfigError,
    InvalidInput,
    NotFound,
)
from stratus.families.description import FamilyDescription
from stratus.obs.metrics import RouterMetrics
from stratus.sched.batching import DEFAULT_MAX_DELAY_S
from stratus.serving.auth import POOL_PREFIX
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb

log = logging.getLogger("stratus.registry")

# What holds an agent's Work side: AgentWork for a linked agent; the router's own tier gives its
# own (router/fleet/in_process.py), which runs a classifier's batches without a message.
WorkMaker = Callable[[AgentHandle, WorkSettings], AgentWork]

MISSED_HEARTBEATS = 3
# A lost agent stays listed (state lost) this long, then is forgotten.
FORGET_LOST_S = 600.0
# Lost agents kept for status beyond this many: the oldest are forgotten first.
MAX_LOST = 4096
# Longest a Reload call waits for its agent (the caller chooses less, never more).
MAX_RELOAD_WAIT_S = 600.0


def pace_for(agents: int, *, base_s: float, max_per_s: float) -> float:
    """The heartbeat interval for a fleet of ``agents``: ``base_s`` doubled until the whole
    fleet sends at most ``max_per_s`` heartbeats a second (steps, so it rarely changes)."""
    pace = base_s
    while agents / pace > max_per_s:
        pace *= 2
    return pace


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
        self.max_heartbeats_per_s = max_heartbeats_per_s
        self.pace_s = heartbeat_s
        self._clock = clock
        self.agents: dict[str, AgentHandle] = {}
        self.book = FamilyBook()  # the families the agents describe, and thresholds pushed over them
        self.index: AgentIndex[AgentHandle] = AgentIndex()
        self._linked = 0  # agents not lost
        self._ids = itertools.count(1)
        self.watchers = Watchers()  # Fleet.Watch calls, told of each change
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
    def families(self) -> dict[str, FamilyDescription]:
        """Each family as this fleet serves it (a push's thresholds over its agents')."""
        return self.book.families

    # -- joining and leaving -----------------------------------------------------------
    def register(
        self, hello: fpb.Hello, peer: str, identity: str = "anonymous", *, work: WorkMaker = AgentWork
    ) -> AgentHandle:
        """Admit an agent. An id already linked is replaced only by the identity that holds it
        (the agent reconnected before we noticed); another identity is refused, so a stranger
        cannot knock an agent off its link (see :class:`stratus.serving.auth.RouterCredentials`)."""
        check_hello_bounds(hello)
        previous = self.agents.get(hello.agent_id)
        if previous is not None and previous.state != State.LOST and previous.identity != identity:
            raise AlreadyHeld(
                f"agent id {hello.agent_id!r} is linked by another identity; it is not replaced"
            )
        if identity.startswith(POOL_PREFIX):
            self.admission.check_pool(hello.agent_id, identity, previous)
        hello, described = self.admission.agreed(hello)
        if previous is not None:
            if previous.state != State.LOST:
                log.warning("agent %s reconnected from %s; dropping its old link", hello.agent_id, peer)
                self.lose(previous, "replaced by a new link")
            self._forget(previous)
        handle = handle_from_hello(hello, peer=peer, identity=identity, now=self.now(), heartbeat_s=self.pace_s)
        handle.work = work(handle, self._work_settings(handle))
        for family in described:
            if family.name not in self.families:
                self.book.learn(family)
        self.agents[handle.id] = handle
        self.index.add(handle)
        self.index.ready(handle)
        self._linked += 1
        log.info(
            "agent %s joined: tier %s, hardware %s, variants %s, from %s",
            handle.id,
            handle.tier.label,
            describe_hardware(handle.hardware),
            sorted(handle.variants),
            peer,
        )
        self._repace()
        self.changed()
        return handle

    def reannounce(self, handle: AgentHandle, hello: fpb.Hello) -> None:
        """A Hello on a live link: the agent reloaded and now serves what it says.

        Work already sent carries on (the agent keeps answering it); the index moves the
        agent to its new names at once. A Hello this fleet would refuse leaves the agent
        registered as it was, and says why, to the operator who asked for the reload.
        """
        if hello.agent_id != handle.id or Tier.from_wire(hello.tier) is not handle.tier:
            raise InvalidInput(f"a reload may not change the agent's name or tier ({handle.id})")
        ready = handle.ready
        self.index.forget(handle)  # its old names, so only other agents count in the check
        try:
            check_hello_bounds(hello)
            check_hello_variants(hello)
            hello, described = self.admission.agreed(hello)
        except InvalidInput as exc:
            self._readd(handle, ready)
            handle.settle_reloads(f"refused: {exc}")
            raise
        handle.announce({v.name: v for v in hello.variants})
        handle.unavailable = tuple(hello.unavailable)
        for family in described:
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

    def draining(self, handle: AgentHandle) -> None:
        if handle.state == State.READY:
            handle.state = State.DRAINING
            self.index.unready(handle)
            log.info("agent %s is draining", handle.id)
            self.changed()

    def lose(self, handle: AgentHandle, reason: str) -> None:
        """The agent's link is gone: fail over its requests at once."""
        if self.agents.get(handle.id) is not handle or handle.state == State.LOST:
            return
        handle.left = handle.state == State.DRAINING  # it said goodbye first: not a fault
        handle.state = State.LOST
        handle.lost_at = self.now()
        self.index.unready(handle)
        self._linked -= 1
        handle.work.fail(reason)
        handle.settle_reloads(f"agent lost: {reason}")
        handle.work.outbox.put_nowait(None)
        if handle.left:
            log.info("agent %s left (it drained first): %s", handle.id, reason)
        else:
            log.warning("agent %s lost: %s", handle.id, reason)
        self._forget_oldest_lost()
        self._repace()
        self.changed()

    def _forget(self, handle: AgentHandle) -> None:
        """Drop a lost agent, and the description of each family no listed agent serves now."""
        if self.agents.get(handle.id) is handle:
            del self.agents[handle.id]
            self.index.forget(handle)
            for family in {info.family for info in handle.variants.values()}:
                if not self.index.tiers(family) and not self.index.variants_of(family):
                    self.book.undescribe(family)

    def _forget_oldest_lost(self) -> None:
        """Keep at most MAX_LOST lost agents listed: agents that join and leave in bulk must
        not grow the router without bound."""
        lost = [h for h in self.agents.values() if h.state == State.LOST]
        for handle in sorted(lost, key=lambda h: h.lost_at)[: max(0, len(lost) - MAX_LOST)]:
            self._forget(handle)

    def check_heartbeats(self) -> None:
        """Mark silent agents lost; forget agents lost for longer than FORGET_LOST_S."""
        now = self.now()
        for handle in list(self.agents.values()):
            if handle.state != State.LOST:
                if now - handle.last_heartbeat > MISSED_HEARTBEATS * handle.heartbeat_s:
                    self.lose(handle, f"missed {MISSED_HEARTBEATS} heartbeats")
            elif now - handle.lost_at > FORGET_LOST_S:
                self._forget(handle)
                self.changed()

    def check_mark(self, agent_id: str, mark: str) -> AgentHandle:
        """The agent an operator's drain, undrain or forget names, if it may be done here:
        NotFound or ConfigError saying why not (asked before a site-wide mark is written)."""
        handle = self.agents.get(agent_id)
        if mark == "forgotten":
            if handle is None:
                raise NotFound(f"no agent '{agent_id}' is listed")
            if handle.state != State.LOST:
                raise ConfigError(f"agent {agent_id} is {handle.state}: only a lost or left agent is forgotten")
            return handle
        if handle is None or handle.state == State.LOST:
            raise NotFound(f"no linked agent '{agent_id}'")
        if mark == "ready" and (handle.state != State.DRAINING or not handle.operator_drained):
            raise ConfigError(
                f"agent {agent_id} is {handle.state}, not drained by an operator: nothing to take back"
            )
        return handle

    def drain(self, agent_id: str) -> AgentHandle:
        handle = self.check_mark(agent_id, "drained")
        handle.work.outbox.put_nowait(fpb.RouterMessage(drain=fpb.Drain(reason="drained by operator")))
        handle.operator_drained = True
        self.draining(handle)
        return handle

    def undrain(self, agent_id: str) -> AgentHandle:
        """An operator's Drain taken back; an agent draining because it is stopping stays so."""
        handle = self.check_mark(agent_id, "ready")
        handle.operator_drained = False
        handle.state = State.READY
        self.index.ready(handle)
        log.info("agent %s is ready again (undrained by an operator)", agent_id)
        self.changed()
        return handle

    def forget(self, agent_id: str) -> AgentHandle:
        """A lost or left agent dropped from the status now."""
        handle = self.check_mark(agent_id, "forgotten")
        self._forget(handle)
        self.changed()
        return handle

    # -- heartbeats and their pace -------------------------------------------------------
    def heartbeat(self, handle: AgentHandle, beat: fpb.Heartbeat) -> None:
        handle.last_heartbeat = self.now()
        if unread := handle.not_reading(beat.received, MISSED_HEARTBEATS):  # it heartbeats, yet reads nothing
            self.lose(handle, f"not reading its link: {unread} messages unread for {MISSED_HEARTBEATS} heartbeats")
        handle.reported_queue = beat.queue_length
        handle.update_latency(beat.latency)

    def _repace(self) -> None:
        """Tell every linked agent the new interval when the fleet's size crosses a step."""
        pace = pace_for(self._linked, base_s=self.heartbeat_s, max_per_s=self.max_heartbeats_per_s)
        if pace == self.pace_s:
            return
        log.info("fleet of %d agents: heartbeats every %.1f s (was %.1f s)", self._linked, pace, self.pace_s)
        slower, self.pace_s = pace > self.pace_s, pace
        message = fpb.RouterMessage(pace=fpb.Pace(heartbeat_interval_s=pace))
        now = self.now()
        for handle in self.agents.values():
            if handle.state == State.LOST:
                continue
            handle.work.outbox.put_nowait(message)
            handle.heartbeat_s = pace
            if not slower:  # time silence from the new pace, not from the old, longer gap
                handle.last_heartbeat = max(handle.last_heartbeat, now)

    # -- work ------------------------------------------------------------------------------
    def result(self, handle: AgentHandle, result: fpb.Result) -> None:
        if handle.work.result(result):
            handle.completions.add(max(1, len(result.confidences)))

    def chunk(self, handle: AgentHandle, chunk: fpb.Chunk) -> None:
        handle.work.chunk(chunk)

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
    def snapshot(self, model: str, cloud: Backend | None = None) -> FleetSnapshot[Backend]:
        """What the policy needs for one model, ``cloud`` with it when the cloud serves it:
        constant cost, whatever the fleet's size."""
        pools: Mapping[Tier, Sequence[Backend]] = self.index.pools(model)
        tiers = self.index.tiers(model)
        if cloud is not None:
            pools = {**pools, Tier.CLOUD: (cloud,)}
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
