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
import contextlib
import itertools
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from router.backends.agent import AgentWork, WorkSettings
from router.backends.base import Backend, Classified, Generated, OnChunk
from router.index import AgentIndex, line_key
from router.policy import FleetSnapshot
from stratus.convert.fleet import latency_from_wire, thresholds_from_wire
from stratus.convert.hardware import describe as describe_hardware
from stratus.convert.hardware import from_hello as hardware_from_hello
from stratus.convert.tensors import Tensors
from stratus.errors import (
    ConfigError,
    DeadlineExceeded,
    InvalidInput,
    NotFound,
    Overloaded,
    PermissionDenied,
)
from stratus.families.audit import check_family_info
from stratus.obs.metrics import RouterMetrics
from stratus.obs.stats import LatencySummary, LatencyWindow, RateMeter, ServiceCurve, SizeWindow
from stratus.sched.batching import DEFAULT_MAX_DELAY_S
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import inference_pb2 as pb

log = logging.getLogger("stratus.registry")

MISSED_HEARTBEATS = 3
# A lost agent stays listed (state lost) this long, then is forgotten.
FORGET_LOST_S = 600.0
# What one Hello may declare, and what the router keeps of it: ids and names are client
# text (logged, listed, echoed), declared sizes steer how much work an agent is sent.
NAME = re.compile(r"[A-Za-z0-9._:@-]{1,128}")
VERSION = re.compile(r"[A-Za-z0-9.+_-]{0,64}")  # a PEP 440 version ("0.1.0", "0.2.0rc1+g3f2a"), or none
MAX_UPTIME_S = 100 * 365 * 86400.0  # past it (or NaN, or negative) a Hello's uptime is not believed
MAX_VARIANTS_PER_AGENT = 64  # a shipped agent has 6; 256 let one Hello hold 77 kB of names
MAX_FAMILIES_PER_HELLO = 64
MAX_CAPACITY = 1024
MAX_QUEUE_LIMIT = 4096
MAX_BATCH = 1024
# Lost agents kept for status beyond this many: the oldest are forgotten first.
MAX_LOST = 4096
# Fleet.Watch calls open at once (each holds a stream and is sent the fleet's status).
MAX_WATCHERS = 64
# Longest a Reload call waits for its agent (the caller chooses less, never more).
MAX_RELOAD_WAIT_S = 600.0


def shown_state(handle: AgentHandle) -> str:
    """The state status and metrics report: a gone agent that drained first has ``left``."""
    return "left" if handle.state == State.LOST and handle.left else handle.state


class State:
    READY = "ready"
    DRAINING = "draining"
    LOST = "lost"


def pace_for(agents: int, *, base_s: float, max_per_s: float) -> float:
    """The heartbeat interval for a fleet of ``agents``: ``base_s`` doubled until the whole
    fleet sends at most ``max_per_s`` heartbeats a second (steps, so it rarely changes)."""
    pace = base_s
    while agents / pace > max_per_s:
        pace *= 2
    return pace


@dataclass(eq=False)
class AgentHandle:
    """One agent as the router sees it: who it is, its state, its estimates.

    It is a backend (:class:`router.backends.base.Backend`) like the cloud: what the policy
    reads (its estimates are kept current as results arrive, not recomputed per request),
    and what the cascades ask. Its ``work`` (:class:`router.backends.agent.AgentWork`) is
    the transport: the outbox its AgentLink stream writes, the Work out on the link, and
    the batcher that merges requests into Work while it is busy.
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
    identity: str = "anonymous"  # the credential that holds the id (stratus.serving.auth)
    left: bool = False  # gone after draining (a goodbye), as status and metrics report it
    operator_drained: bool = False  # drained by Fleet.Drain, so Fleet.Undrain may take it back
    # What it runs on (machine, CPU, the flags its precision choice read), bounded.
    hardware: fpb.HardwareInfo = field(default_factory=fpb.HardwareInfo)
    version: str = ""  # its Stratus version, as its Hello said
    started: float | None = None  # when its process started, on the registry's clock; None: not said
    state: str = State.READY
    last_heartbeat: float = 0.0
    lost_at: float = 0.0
    reported_queue: int = 0
    latency: dict[str, LatencySummary] = field(default_factory=dict)  # per variant, as its heartbeats said
    curves: dict[str, ServiceCurve] = field(default_factory=dict)  # per variant
    link_ms: LatencyWindow = field(default_factory=LatencyWindow)  # round trip less the agent's time
    completions: RateMeter = field(default_factory=RateMeter)
    batch_sizes: SizeWindow = field(default_factory=SizeWindow)  # items per batch it ran
    sent: int = 0  # RouterMessages written to the link, the Welcome included
    last_received: int = 0  # the agent's read count at its previous heartbeat
    unread_beats: int = 0  # consecutive heartbeats with messages unread and no reading progress

    # Families it could not load (no runtime there opened their files), as its Hello said.
    unavailable: tuple[fpb.FamilyUnavailable, ...] = ()
    reloads: list[asyncio.Future[str]] = field(default_factory=list)  # waiting for its next Hello
    work: AgentWork = field(init=False, repr=False)  # its transport: set by the registry as it joins

    def __post_init__(self) -> None:
        self.announce(self.variants)

    def announce(self, variants: dict[str, fpb.VariantInfo]) -> None:
        """What the agent serves: said by its Hello, and again by a Hello after a reload.

        A family's requests go to its current variant; each line (current or not) is also
        reachable by its line key, for a rollout's share. An agent older than lines (no
        ``line`` set) serves every variant as current, as it always did.
        """
        self.variants = variants
        self._variant_of: dict[str, str] = {}
        self._families = {name: info.family for name, info in variants.items()}
        names = set(variants)
        for name, info in variants.items():
            if info.family and (info.current or not info.line):
                self._variant_of[info.family] = name
                names.add(info.family)
            if info.line:
                self._variant_of[line_key(info.line)] = name
                names.add(line_key(info.line))
            if info.line and info.line not in variants:
                # The FP32 name answers for whichever precision this agent's hardware chose,
                # so clients that pin "digits-medium" keep working on an INT8 agent.
                self._variant_of[info.line] = name
                self._families[info.line] = info.family
                names.add(info.line)
        self._model_names = frozenset(names)
        self._max_batch = {name: min(max(1, info.max_batch), MAX_BATCH) for name, info in variants.items()}
        self._limit = (self.capacity + self.queue_limit) * max(self._max_batch.values(), default=1)

    @property
    def variant_families(self) -> Mapping[str, str]:
        """Each variant it serves, and each FP32 line it serves through a child, by family."""
        return self._families

    @property
    def model_names(self) -> frozenset[str]:
        return self._model_names

    @property
    def ready(self) -> bool:
        return self.state == State.READY

    @property
    def in_flight(self) -> int:
        return self.work.in_flight

    @property
    def lost(self) -> bool:
        return self.state == State.LOST

    @property
    def limit(self) -> int:
        """Items the router may hold for it: its slots and queue, each a Work of up to a batch."""
        return self._limit

    @property
    def rtt_ms(self) -> float:
        """The link's share of a round trip: what the agent did not spend queueing or running."""
        return max(0.05, self.link_ms.mean_ms or 0.5)

    def variant_for(self, model: str) -> str:
        """The variant this agent runs for a family (or the variant itself)."""
        return self._variant_of.get(model, model)

    def precision_of(self, variant: str) -> str:
        info = self.variants.get(variant)
        return (info.precision or "FP32") if info is not None else ""

    def max_batch(self, model: str) -> int:
        return self._max_batch.get(self._variant_of.get(model, model), 1)

    def cost_ms(self, model: str, items: int) -> float:
        """Expected time to run a batch of ``items``: learnt per batch size, else the heartbeat's mean."""
        variant = self.variant_for(model)
        curve = self.curves.get(variant)
        if curve is not None and curve.known:
            return curve.estimate(items)
        reported = self.latency.get(variant)
        return (reported.mean_ms if reported is not None and reported.mean_ms > 0 else 1.0) * max(1, items)

    def learn(self, result: fpb.Result, round_trip_ms: float) -> None:
        """What a Result teaches: the batch's service time by its size, and the link's cost."""
        if result.batch_size > 0:
            self.batch_sizes.add(result.batch_size)
        if result.batch_size > 0 and result.service_ms > 0:
            self.curves.setdefault(result.variant, ServiceCurve()).add(result.batch_size, result.service_ms)
        self.link_ms.add(max(0.0, round_trip_ms - result.service_ms - result.queue_ms))

    def update_latency(self, estimates: Iterable[fpb.LatencyEstimate]) -> None:
        """Merge what changed (for status, and as the estimate before any Result); read into
        figures, as a kept sub-message would keep its whole heartbeat alive."""
        for estimate in estimates:
            if estimate.variant in self.variants:  # another name is nothing it serves
                self.latency[estimate.variant] = latency_from_wire(estimate)

    async def classify(
        self, items: Tensors, *, model: str, outputs: Sequence[str], request_id: str, budget_ms: float
    ) -> Classified:
        """Queue the items for this agent (maybe merged into one Work with others')."""
        return await self.work.classify(
            items, model=model, outputs=outputs, request_id=request_id, budget_ms=budget_ms
        )

    async def generate(self, request: pb.ModelInferRequest, on_chunk: OnChunk, *, budget_ms: float) -> Generated:
        return await self.work.generate(request, on_chunk, budget_ms=budget_ms)


class FleetRegistry:
    def __init__(
        self,
        *,
        heartbeat_s: float = 1.0,
        max_heartbeats_per_s: float = 100.0,
        max_batch_delay_s: float = DEFAULT_MAX_DELAY_S,
        clock: Callable[[], float] = time.monotonic,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.metrics = metrics
        self.heartbeat_s = heartbeat_s
        self.max_batch_delay_s = max_batch_delay_s
        self.max_heartbeats_per_s = max_heartbeats_per_s
        self.pace_s = heartbeat_s
        self._clock = clock
        self.agents: dict[str, AgentHandle] = {}
        self.families: dict[str, fpb.FamilyInfo] = {}
        self._thresholds: dict[str, Mapping[Tier, float]] = {}  # each family's, read at its Hello
        self.index: AgentIndex[AgentHandle] = AgentIndex()
        self._linked = 0  # agents not lost
        self._ids = itertools.count(1)
        self._watchers: set[asyncio.Queue[None]] = set()
        # Thresholds pushed fleet-wide (router/thresholds.py) win over the Hellos'; ``_own`` keeps
        # each family as its agents describe it, for when a push is reverted.
        self._pushed: dict[str, dict[str, float]] = {}
        self._own: dict[str, fpb.FamilyInfo] = {}

    def now(self) -> float:
        return self._clock()

    # -- joining and leaving -----------------------------------------------------------
    def register(self, hello: fpb.Hello, peer: str, identity: str = "anonymous") -> AgentHandle:
        """Admit an agent. An id already linked is replaced only by the identity that holds it
        (the agent reconnected before we noticed); another identity is refused, so a stranger
        cannot knock an agent off its link (see :class:`stratus.serving.auth.RouterCredentials`)."""
        check_hello_bounds(hello)
        previous = self.agents.get(hello.agent_id)
        if previous is not None and previous.state != State.LOST and previous.identity != identity:
            raise PermissionDenied(
                f"agent id {hello.agent_id!r} is linked by another identity; it is not replaced"
            )
        hello = self._agreed(hello)
        if previous is not None:
            if previous.state != State.LOST:
                log.warning("agent %s reconnected from %s; dropping its old link", hello.agent_id, peer)
                self.lose(previous, "replaced by a new link")
            self._forget(previous)
        handle = AgentHandle(
            id=hello.agent_id,
            tier=Tier.from_wire(hello.tier),
            host=hello.host,
            peer=peer,
            runtimes=tuple(hello.runtimes),
            variants={v.name: v for v in hello.variants},
            capacity=min(max(1, hello.capacity), MAX_CAPACITY),
            queue_limit=min(hello.queue_limit, MAX_QUEUE_LIMIT),
            last_heartbeat=self.now(),
            heartbeat_s=self.pace_s,
            unavailable=tuple(hello.unavailable),
            identity=identity,
            hardware=hardware_from_hello(hello),
            version=hello.version,
            started=self._started(hello),
        )
        handle.work = AgentWork(handle, self._work_settings(handle))
        for family in hello.families:
            if family.name not in self.families:
                self._learn(family)
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

    def _started(self, hello: fpb.Hello) -> float | None:
        """When the agent's process started, from the uptime its Hello gave (None: not given)."""
        uptime = hello.uptime_s
        return self.now() - uptime if 0 < uptime <= MAX_UPTIME_S else None

    def _agreed(self, hello: fpb.Hello) -> fpb.Hello:
        """The Hello without the families it describes unlike the ready agents serving them
        (those are listed as unavailable on this agent): requests are checked and routed by
        one description of each family, and an agent that disagrees on one still serves the
        others. A Hello left with no variant is refused, saying why."""
        conflicts = self._conflicts(hello)
        if not conflicts:
            return hello
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
        return kept

    def _conflicts(self, hello: fpb.Hello) -> dict[str, str]:
        """Each family this Hello describes (or claims a variant for) unlike the fleet, and why."""
        conflicts: dict[str, str] = {}
        for family in hello.families:
            known = self.families.get(family.name)
            if known is None or known == self._served(family):
                continue
            if not self.index.serves(family.name):  # nobody serves the old description now
                self._undescribe(family.name)
                self._own.pop(family.name, None)
                continue
            differs = [
                f
                for f in ("inputs", "outputs", "thresholds", "calibrated_cloud_share")
                if getattr(known, f) != getattr(family, f)
            ]
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
            _check_hello_variants(hello)
            hello = self._agreed(hello)
        except InvalidInput as exc:
            self._readd(handle, ready)
            self._settle_reloads(handle, f"refused: {exc}")
            raise
        handle.announce({v.name: v for v in hello.variants})
        handle.unavailable = tuple(hello.unavailable)
        for family in hello.families:
            self._learn(family)
        self._readd(handle, ready)
        log.info("agent %s reloaded: variants %s", handle.id, sorted(handle.variants))
        self._settle_reloads(handle, "")
        self.changed()

    def _readd(self, handle: AgentHandle, ready: bool) -> None:
        self.index.add(handle)
        if ready:
            self.index.ready(handle)

    def reload_failed(self, handle: AgentHandle, message: str) -> None:
        log.warning("agent %s could not reload: %r", handle.id, message[:500])
        self._settle_reloads(handle, message or "reload failed")

    @staticmethod
    def _settle_reloads(handle: AgentHandle, problem: str) -> None:
        for waiter in handle.reloads:
            if not waiter.done():
                waiter.set_result(problem)
        handle.reloads.clear()

    async def reload(self, agent_id: str, timeout_s: float) -> tuple[AgentHandle, str]:
        """Ask an agent to reload and wait for its answer: ("" or the problem)."""
        handle = self.agents.get(agent_id)
        if handle is None or handle.state == State.LOST:
            raise NotFound(f"no linked agent '{agent_id}'")
        waiter: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        if not handle.reloads:  # one Reload on the link at a time: later callers wait for it
            handle.work.outbox.put_nowait(fpb.RouterMessage(reload=fpb.Reload()))
        handle.reloads.append(waiter)
        try:
            async with asyncio.timeout(min(timeout_s, MAX_RELOAD_WAIT_S)):
                return handle, await waiter
        except TimeoutError:
            raise DeadlineExceeded(
                f"agent {agent_id} did not finish reloading within {timeout_s:.0f} s"
            ) from None
        finally:
            with contextlib.suppress(ValueError):  # a waiter that gave up is not kept
                handle.reloads.remove(waiter)

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
        self._settle_reloads(handle, f"agent lost: {reason}")
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
                    self._undescribe(family)

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

    def drain(self, agent_id: str) -> AgentHandle:
        handle = self.agents.get(agent_id)
        if handle is None or handle.state == State.LOST:
            raise NotFound(f"no linked agent '{agent_id}'")
        handle.work.outbox.put_nowait(fpb.RouterMessage(drain=fpb.Drain(reason="drained by operator")))
        handle.operator_drained = True
        self.draining(handle)
        return handle

    def undrain(self, agent_id: str) -> AgentHandle:
        """An operator's Drain taken back; an agent draining because it is stopping stays so."""
        handle = self.agents.get(agent_id)
        if handle is None or handle.state == State.LOST:
            raise NotFound(f"no linked agent '{agent_id}'")
        if handle.state != State.DRAINING or not handle.operator_drained:
            raise ConfigError(
                f"agent {agent_id} is {handle.state}, not drained by an operator: nothing to take back"
            )
        handle.operator_drained = False
        handle.state = State.READY
        self.index.ready(handle)
        log.info("agent %s is ready again (undrained by an operator)", agent_id)
        self.changed()
        return handle

    def forget(self, agent_id: str) -> AgentHandle:
        """A lost or left agent dropped from the status now."""
        handle = self.agents.get(agent_id)
        if handle is None:
            raise NotFound(f"no agent '{agent_id}' is listed")
        if handle.state != State.LOST:
            raise ConfigError(f"agent {agent_id} is {handle.state}: only a lost or left agent is forgotten")
        self._forget(handle)
        self.changed()
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
        )

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

    def family(self, name: str) -> fpb.FamilyInfo | None:
        return self.families.get(name)

    def override_thresholds(self, family: str, thresholds: Mapping[Tier, float]) -> None:
        """Serve ``family`` with ``thresholds`` from now on, whatever its agents' Hellos say
        (a tier not named keeps theirs; empty: their own again). Its calibrated cloud share no longer describes the
        thresholds in force, so the baseline is dropped while a push holds."""
        if thresholds:
            self._pushed[family] = {tier.label: value for tier, value in thresholds.items()}
        else:
            self._pushed.pop(family, None)
        own = self._own.get(family)
        if own is not None and family in self.families:
            self.describe(self._served(own))
        self.changed()

    def own_thresholds(self, family: str) -> Mapping[Tier, float]:
        """The thresholds the agents' Hellos gave ``family`` (the first ready agent's)."""
        own = self._own.get(family)
        return {Tier.parse(k): v for k, v in own.thresholds.items()} if own else {}

    def _learn(self, family: fpb.FamilyInfo) -> None:
        if family.name not in self._pushed or family.name not in self._own:
            self._own[family.name] = _detached(family)
        self.describe(self._served(family))

    def _served(self, family: fpb.FamilyInfo) -> fpb.FamilyInfo:
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

    def thresholds(self, family: str) -> Mapping[Tier, float]:
        return self._thresholds.get(family, {})

    def describe(self, family: fpb.FamilyInfo) -> None:
        """Route ``family`` by this description, its thresholds read once, here (a Hello's
        were checked by check_hello_bounds; InvalidInput for a key that names no tier)."""
        self.families[family.name] = _detached(family)
        self._thresholds[family.name] = thresholds_from_wire(family.thresholds, f"family {family.name!r}")

    def _undescribe(self, name: str) -> None:
        self.families.pop(name, None)
        self._thresholds.pop(name, None)

    def watch(self) -> asyncio.Queue[None]:
        """A queue told of each change; RESOURCE_EXHAUSTED past MAX_WATCHERS at once."""
        if len(self._watchers) >= MAX_WATCHERS:
            raise Overloaded(f"{len(self._watchers)} Watch calls are open, the most this router serves")
        queue: asyncio.Queue[None] = asyncio.Queue(maxsize=1)
        self._watchers.add(queue)
        return queue

    def unwatch(self, queue: asyncio.Queue[None]) -> None:
        self._watchers.discard(queue)

    def changed(self) -> None:
        for queue in self._watchers:
            if queue.empty():
                queue.put_nowait(None)


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


def _check_hello_variants(hello: fpb.Hello) -> None:
    if not hello.variants:
        raise InvalidInput(f"Hello from {hello.agent_id}: no variants")


def _detached(family: fpb.FamilyInfo) -> fpb.FamilyInfo:
    """A copy of a Hello's FamilyInfo: kept as is, a sub-message keeps its whole Hello alive."""
    kept = fpb.FamilyInfo()
    kept.CopyFrom(family)
    return kept
