"""The fleet registry: every agent that said Hello, its state, and its pending work.

Owned by the router's event loop (no locks): the AgentLink servicer registers agents and
feeds their heartbeats and results in; the data plane submits Work and reads snapshots;
the Fleet service reads status and watches changes. An agent whose stream breaks, or
that misses three heartbeats, is marked lost at once and every request it held fails
over (the data plane retries it elsewhere).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from router.policy import AgentView
from stratus.errors import DeadlineExceeded, NotFound, Unavailable
from stratus.stats import LatencyWindow
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


@dataclass
class AgentHandle:
    """One agent as the router sees it; its outbox feeds its AgentLink stream."""

    id: str
    tier: Tier
    host: str
    peer: str
    runtimes: tuple[str, ...]
    variants: dict[str, fpb.VariantInfo]
    families: frozenset[str]
    capacity: int
    queue_limit: int
    connected_at: float
    outbox: asyncio.Queue[fpb.RouterMessage | None] = field(default_factory=asyncio.Queue)
    state: str = State.READY
    last_heartbeat: float = 0.0
    reported_queue: int = 0
    latency: dict[str, fpb.LatencyEstimate] = field(default_factory=dict)
    round_trip: LatencyWindow = field(default_factory=LatencyWindow)
    pending: dict[str, asyncio.Future[fpb.Result]] = field(default_factory=dict)
    completions: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=2048))
    sent: int = 0  # RouterMessages written to the link, the Welcome included
    last_received: int = 0  # the agent's read count at its previous heartbeat
    unread_beats: int = 0  # consecutive heartbeats with messages unread and no reading progress

    def view(self) -> AgentView:
        service = {}
        for variant, estimate in self.latency.items():
            service[variant] = estimate.mean_ms
            family = self.variants[variant].family if variant in self.variants else None
            if family:
                service[family] = estimate.mean_ms
        # Observed round trip minus service time is the link and queue cost.
        overhead = max(0.1, (self.round_trip.mean_ms or 0.5) - min(service.values(), default=0.0))
        return AgentView(
            id=self.id,
            tier=self.tier,
            families=self.families,
            variants=frozenset(self.variants),
            ready=self.state == State.READY,
            in_flight=len(self.pending),
            capacity=self.capacity,
            limit=self.capacity + self.queue_limit,
            service_ms=service,
            rtt_ms=overhead,
        )

    def requests_per_s(self, now: float, window_s: float = 10.0) -> float:
        recent = [t for t in self.completions if now - t <= window_s]
        if not recent:
            return 0.0
        return len(recent) / max(min(window_s, now - self.connected_at), 1e-3)

    def fail_pending(self, reason: str) -> None:
        for future in self.pending.values():
            if not future.done():
                future.set_exception(Unavailable(f"agent {self.id} {reason}"))
        self.pending.clear()


class FleetRegistry:
    def __init__(self, *, heartbeat_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.heartbeat_s = heartbeat_s
        self._clock = clock
        self.agents: dict[str, AgentHandle] = {}
        self.families: dict[str, fpb.FamilyInfo] = {}
        self._ids = itertools.count(1)
        self._watchers: set[asyncio.Queue[None]] = set()

    def now(self) -> float:
        return self._clock()

    def register(self, hello: fpb.Hello, peer: str) -> AgentHandle:
        """Admit an agent; an id already linked is replaced (it reconnected before we noticed)."""
        previous = self.agents.get(hello.agent_id)
        if previous is not None and previous.state != State.LOST:
            log.warning("agent %s reconnected from %s; dropping its old link", hello.agent_id, peer)
            self.lose(previous, "replaced by a new link")
        variants = {v.name: v for v in hello.variants}
        handle = AgentHandle(
            id=hello.agent_id,
            tier=tier_of(hello.tier),
            host=hello.host,
            peer=peer,
            runtimes=tuple(hello.runtimes),
            variants=variants,
            families=frozenset(v.family for v in hello.variants),
            capacity=max(1, hello.capacity),
            queue_limit=hello.queue_limit,
            connected_at=self.now(),
            last_heartbeat=self.now(),
        )
        for family in hello.families:
            self.families[family.name] = family
        self.agents[handle.id] = handle
        log.info(
            "agent %s joined: tier %s, variants %s, from %s",
            handle.id,
            handle.tier.label,
            sorted(variants),
            peer,
        )
        self.changed()
        return handle

    def heartbeat(self, handle: AgentHandle, beat: fpb.Heartbeat) -> None:
        handle.last_heartbeat = self.now()
        self._check_reading(handle, beat.received)
        handle.reported_queue = beat.queue_length
        handle.latency = {estimate.variant: estimate for estimate in beat.latency}

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

    def result(self, handle: AgentHandle, result: fpb.Result) -> None:
        future = handle.pending.pop(result.request_id, None)
        if future is None:
            log.debug("result for unknown or finished request %s from %s", result.request_id, handle.id)
            return
        handle.completions.append(self.now())
        if not future.done():
            future.set_result(result)

    def draining(self, handle: AgentHandle) -> None:
        if handle.state == State.READY:
            handle.state = State.DRAINING
            log.info("agent %s is draining", handle.id)
            self.changed()

    def lose(self, handle: AgentHandle, reason: str) -> None:
        """The agent's link is gone: fail over its requests at once."""
        if self.agents.get(handle.id) is not handle or handle.state == State.LOST:
            return
        handle.state = State.LOST
        handle.fail_pending(reason)
        handle.outbox.put_nowait(None)
        log.warning("agent %s lost: %s", handle.id, reason)
        self.changed()

    def check_heartbeats(self) -> None:
        """Mark silent agents lost; forget agents lost for longer than FORGET_LOST_S."""
        limit = MISSED_HEARTBEATS * self.heartbeat_s
        for handle in list(self.agents.values()):
            silent = self.now() - handle.last_heartbeat
            if handle.state != State.LOST and silent > limit:
                self.lose(handle, f"missed {MISSED_HEARTBEATS} heartbeats")
            elif handle.state == State.LOST and silent > FORGET_LOST_S:
                del self.agents[handle.id]
                self.changed()

    def drain(self, agent_id: str) -> AgentHandle:
        handle = self.agents.get(agent_id)
        if handle is None or handle.state == State.LOST:
            raise NotFound(f"no linked agent '{agent_id}'")
        handle.outbox.put_nowait(fpb.RouterMessage(drain=fpb.Drain(reason="drained by operator")))
        self.draining(handle)
        return handle

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

    def views(self) -> tuple[AgentView, ...]:
        """Every known agent; lost and draining ones are not ready, but their tier still exists."""
        return tuple(h.view() for h in self.agents.values())

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
