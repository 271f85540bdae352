"""The fleet registry: every agent that said Hello, its state, and its pending work.

Owned by the router's event loop (no locks): the AgentLink servicer registers agents and
feeds their heartbeats and results in; the data plane submits Work and reads snapshots
from the index; the Fleet service reads status and watches changes. An agent whose
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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from router.index import AgentIndex
from router.policy import CloudView, FleetSnapshot
from stratus.errors import DeadlineExceeded, InvalidInput, NotFound, Unavailable
from stratus.stats import LatencyWindow, RateMeter
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import inference_pb2 as pb

log = logging.getLogger("stratus.registry")

MISSED_HEARTBEATS = 3
# A lost agent stays listed (state lost) this long, then is forgotten.
FORGET_LOST_S = 600.0
# Messages that may wait for an agent's stream before the agent counts as not reading.
MAX_OUTBOX = 4096
_TIERS: dict[int, Tier] = {fpb.TIER_DEVICE: Tier.DEVICE, fpb.TIER_EDGE: Tier.EDGE, fpb.TIER_CLOUD: Tier.CLOUD}


class State:
    READY = "ready"
    DRAINING = "draining"
    LOST = "lost"


def tier_of(value: int) -> Tier:
    if value not in _TIERS:
        raise ValueError(f"unknown tier {value}")
    return _TIERS[value]


def pace_for(agents: int, *, base_s: float, max_per_s: float) -> float:
    """The heartbeat interval for a fleet of ``agents``: ``base_s`` doubled until the whole
    fleet sends at most ``max_per_s`` heartbeats a second (steps, so it rarely changes)."""
    pace = base_s
    while agents / pace > max_per_s:
        pace *= 2
    return pace


@dataclass
class AgentHandle:
    """One agent as the router sees it; its outbox feeds its AgentLink stream.

    It is also what the policy reads (:class:`router.policy.Candidate`): its estimates
    are kept current as heartbeats and results arrive, not recomputed per request.
    """

    id: str
    tier: Tier
    host: str
    peer: str
    runtimes: tuple[str, ...]
    variants: dict[str, fpb.VariantInfo]
    capacity: int
    queue_limit: int
    heartbeat_s: float
    outbox: asyncio.Queue[fpb.RouterMessage | None] = field(default_factory=asyncio.Queue)
    state: str = State.READY
    last_heartbeat: float = 0.0
    lost_at: float = 0.0
    reported_queue: int = 0
    latency: dict[str, fpb.LatencyEstimate] = field(default_factory=dict)
    service_ms: dict[str, float] = field(default_factory=dict)  # per variant and per family
    round_trip: LatencyWindow = field(default_factory=LatencyWindow)
    pending: dict[str, asyncio.Future[fpb.Result]] = field(default_factory=dict)
    completions: RateMeter = field(default_factory=RateMeter)
    sent: int = 0  # RouterMessages written to the link, the Welcome included
    last_received: int = 0  # the agent's read count at its previous heartbeat
    unread_beats: int = 0  # consecutive heartbeats with messages unread and no reading progress

    @property
    def variant_families(self) -> Mapping[str, str]:
        return {name: info.family for name, info in self.variants.items()}

    @property
    def ready(self) -> bool:
        return self.state == State.READY

    @property
    def in_flight(self) -> int:
        return len(self.pending)

    @property
    def limit(self) -> int:
        return self.capacity + self.queue_limit

    @property
    def rtt_ms(self) -> float:
        """Observed round trip minus service time: the link and queue cost."""
        fastest = min(self.service_ms.values(), default=0.0)
        return max(0.1, (self.round_trip.mean_ms or 0.5) - fastest)

    def update_latency(self, estimates: Iterable[fpb.LatencyEstimate]) -> None:
        """Merge what changed; a family's service time is its variant's here."""
        for estimate in estimates:
            self.latency[estimate.variant] = estimate
            self.service_ms[estimate.variant] = estimate.mean_ms
            info = self.variants.get(estimate.variant)
            if info is not None and info.family:
                self.service_ms[info.family] = estimate.mean_ms

    def fail_pending(self, reason: str) -> None:
        for future in self.pending.values():
            if not future.done():
                future.set_exception(Unavailable(f"agent {self.id} {reason}"))
        self.pending.clear()


class FleetRegistry:
    def __init__(
        self,
        *,
        heartbeat_s: float = 1.0,
        max_heartbeats_per_s: float = 100.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.heartbeat_s = heartbeat_s
        self.max_heartbeats_per_s = max_heartbeats_per_s
        self.pace_s = heartbeat_s
        self._clock = clock
        self.agents: dict[str, AgentHandle] = {}
        self.families: dict[str, fpb.FamilyInfo] = {}
        self.index: AgentIndex[AgentHandle] = AgentIndex()
        self._linked = 0  # agents not lost
        self._ids = itertools.count(1)
        self._watchers: set[asyncio.Queue[None]] = set()

    def now(self) -> float:
        return self._clock()

    # -- joining and leaving -----------------------------------------------------------
    def register(self, hello: fpb.Hello, peer: str) -> AgentHandle:
        """Admit an agent; an id already linked is replaced (it reconnected before we noticed)."""
        self._check_families(hello)
        previous = self.agents.get(hello.agent_id)
        if previous is not None:
            if previous.state != State.LOST:
                log.warning("agent %s reconnected from %s; dropping its old link", hello.agent_id, peer)
                self.lose(previous, "replaced by a new link")
            self._forget(previous)
        handle = AgentHandle(
            id=hello.agent_id,
            tier=tier_of(hello.tier),
            host=hello.host,
            peer=peer,
            runtimes=tuple(hello.runtimes),
            variants={v.name: v for v in hello.variants},
            capacity=max(1, hello.capacity),
            queue_limit=hello.queue_limit,
            last_heartbeat=self.now(),
            heartbeat_s=self.pace_s,
        )
        for family in hello.families:
            self.families.setdefault(family.name, family)
        self.agents[handle.id] = handle
        self.index.add(handle)
        self.index.ready(handle)
        self._linked += 1
        log.info(
            "agent %s joined: tier %s, variants %s, from %s",
            handle.id,
            handle.tier.label,
            sorted(handle.variants),
            peer,
        )
        self._repace()
        self.changed()
        return handle

    def _check_families(self, hello: fpb.Hello) -> None:
        """Refuse an agent that describes a family (or a variant's family) unlike the agents
        serving it now: requests are checked and routed by one description of each family."""
        for family in hello.families:
            known = self.families.get(family.name)
            if known is None or known == family:
                continue
            if not self.index.serves(family.name):  # nobody serves the old description now
                del self.families[family.name]
                continue
            differs = [
                f for f in ("inputs", "outputs", "thresholds") if getattr(known, f) != getattr(family, f)
            ]
            raise InvalidInput(
                f"Hello from {hello.agent_id}: family '{family.name}' differs from the one ready agents "
                f"serve ({', '.join(differs)} differ); refused until they leave"
            )
        for variant in hello.variants:
            owner = self.index.family_of(variant.name)
            if owner is not None and owner != variant.family and self.index.serves(variant.name):
                raise InvalidInput(
                    f"Hello from {hello.agent_id}: variant '{variant.name}' belongs to family "
                    f"'{owner}' in this fleet, not '{variant.family}'"
                )

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
        handle.state = State.LOST
        handle.lost_at = self.now()
        self.index.unready(handle)
        self._linked -= 1
        handle.fail_pending(reason)
        handle.outbox.put_nowait(None)
        log.warning("agent %s lost: %s", handle.id, reason)
        self._repace()
        self.changed()

    def _forget(self, handle: AgentHandle) -> None:
        if self.agents.get(handle.id) is handle:
            del self.agents[handle.id]
            self.index.forget(handle)

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

    def drain(self, agent_id: str) -> AgentHandle:
        handle = self.agents.get(agent_id)
        if handle is None or handle.state == State.LOST:
            raise NotFound(f"no linked agent '{agent_id}'")
        handle.outbox.put_nowait(fpb.RouterMessage(drain=fpb.Drain(reason="drained by operator")))
        self.draining(handle)
        return handle

    # -- heartbeats and their pace -------------------------------------------------------
    def heartbeat(self, handle: AgentHandle, beat: fpb.Heartbeat) -> None:
        handle.last_heartbeat = self.now()
        self._check_reading(handle, beat.received)
        handle.reported_queue = beat.queue_length
        handle.update_latency(beat.latency)

    def _check_reading(self, handle: AgentHandle, received: int) -> None:
        """Drop a peer that keeps heartbeating but stops reading what it is sent.

        An agent reads its link as soon as messages arrive, however busy its models are,
        so messages left unread while its read count stands still for three heartbeats
        mean it is not reading at all.
        """
        unread = handle.sent - received
        stalled = unread > 0 and received == handle.last_received
        handle.unread_beats = handle.unread_beats + 1 if stalled else 0
        handle.last_received = received
        if handle.unread_beats >= MISSED_HEARTBEATS:
            self.lose(
                handle, f"not reading its link: {unread} messages unread for {MISSED_HEARTBEATS} heartbeats"
            )

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
            handle.outbox.put_nowait(message)
            handle.heartbeat_s = pace
            if not slower:  # time silence from the new pace, not from the old, longer gap
                handle.last_heartbeat = max(handle.last_heartbeat, now)

    # -- work ------------------------------------------------------------------------------
    def result(self, handle: AgentHandle, result: fpb.Result) -> None:
        future = handle.pending.pop(result.request_id, None)
        if future is None:
            log.debug("result for unknown or finished request %s from %s", result.request_id, handle.id)
            return
        handle.completions.add()
        if not future.done():
            future.set_result(result)

    async def submit(
        self, handle: AgentHandle, request: pb.ModelInferRequest, *, variant: str, budget_ms: float | None
    ) -> fpb.Result:
        """Send Work and wait for its Result, the agent's loss, or the budget's end."""
        if handle.outbox.qsize() >= MAX_OUTBOX:
            self.lose(handle, f"not reading its link ({MAX_OUTBOX} messages waiting)")
            raise Unavailable(f"agent {handle.id} is not reading its link")
        request_id = f"r{next(self._ids)}"
        future: asyncio.Future[fpb.Result] = asyncio.get_running_loop().create_future()
        handle.pending[request_id] = future
        work = fpb.Work(request_id=request_id, variant=variant, request=request, budget_ms=budget_ms or 0.0)
        sent = self.now()
        handle.outbox.put_nowait(fpb.RouterMessage(work=work))
        try:
            async with asyncio.timeout(budget_ms / 1000.0 if budget_ms else None):
                result = await future
        except TimeoutError:
            handle.outbox.put_nowait(fpb.RouterMessage(cancel=fpb.Cancel(request_id=request_id)))
            raise DeadlineExceeded(f"agent {handle.id} did not answer within {budget_ms:.1f} ms") from None
        except asyncio.CancelledError:
            handle.outbox.put_nowait(fpb.RouterMessage(cancel=fpb.Cancel(request_id=request_id)))
            raise
        finally:
            handle.pending.pop(request_id, None)
        handle.round_trip.add((self.now() - sent) * 1000.0)
        return result

    # -- reads -------------------------------------------------------------------------------
    def snapshot(self, model: str, cloud: CloudView | None) -> FleetSnapshot:
        """What the policy needs for one model: constant cost, whatever the fleet's size."""
        return FleetSnapshot(pools=self.index.pools(model), tiers=self.index.tiers(model), cloud=cloud)

    def family(self, name: str) -> fpb.FamilyInfo | None:
        return self.families.get(name)

    def thresholds(self, family: str) -> Mapping[Tier, float]:
        info = self.families.get(family)
        return {Tier.parse(k): v for k, v in info.thresholds.items()} if info else {}

    def watch(self) -> asyncio.Queue[None]:
        queue: asyncio.Queue[None] = asyncio.Queue(maxsize=1)
        self._watchers.add(queue)
        return queue

    def unwatch(self, queue: asyncio.Queue[None]) -> None:
        self._watchers.discard(queue)

    def changed(self) -> None:
        for queue in self._watchers:
            if queue.empty():
                queue.put_nowait(None)
