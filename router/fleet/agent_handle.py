"""One agent as the router holds it: who it is, its state, what it serves, its estimates.

The handle is what the policy reads and the cascades ask (:class:`router.backends.base.Backend`);
its transport is its ``work`` (:class:`router.backends.agent.AgentWork`); the registry
(:mod:`router.fleet.registry`) creates both when the agent says Hello and changes the state.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from router.backends.agent import PATIENCE_FACTOR, PATIENCE_FLOOR_MS, AgentWork
from router.backends.base import Classified, Generated, OnChunk, Ran
from router.fleet.index import line_key
from stratus.convert.tensors import Tensors
from stratus.errors import DeadlineExceeded
from stratus.families.agent_hello import FamilyUnavailable, HardwareSaid, VariantServed
from stratus.obs.stats import LatencySummary, LatencyWindow, RateMeter, ServiceCurve, SizeWindow
from stratus.tiers import Tier
from stratus.wire import inference_pb2 as pb

# Most items one agent may say it runs as one batch (a Hello's max_batch is clamped to it).
MAX_BATCH = 1024
# Calls at once a newly linked agent is trusted with, at most, until it shows it serves more
# within budget (AgentHandle.served): a declared capacity bounded by what is measured.
FIRST_WINDOW = 4


class State(StrEnum):
    READY = "ready"
    DRAINING = "draining"
    LOST = "lost"
    LEFT = "left"  # shown only: a lost agent that drained first


def shown_state(handle: AgentHandle) -> State:
    """The state status and metrics report: a gone agent that drained first has ``left``."""
    return State.LEFT if handle.state == State.LOST and handle.left else handle.state


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
    variants: dict[str, VariantServed]
    # Calls at once the router trusts it with now: what its Hello declared (``declared``),
    # bounded by what it has been measured to serve (``window``, below; security2 N3).
    capacity: int
    queue_limit: int
    heartbeat_s: float
    identity: str = "anonymous"  # the credential that holds the id (stratus.serving.auth)
    left: bool = False  # gone after draining (a goodbye), as status and metrics report it
    operator_drained: bool = False  # drained by Fleet.Drain, so Fleet.Undrain may take it back
    # What it runs on (machine, CPU, the flags its precision choice read), bounded.
    hardware: HardwareSaid = field(default_factory=HardwareSaid)
    version: str = ""  # its Stratus version, as its Hello said
    started: float | None = None  # when its process started, on the registry's clock; None: not said
    state: State = State.READY
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
    unavailable: tuple[FamilyUnavailable, ...] = ()
    reloads: list[asyncio.Future[str]] = field(default_factory=list)  # waiting for its next Hello
    work: AgentWork = field(init=False, repr=False)  # its transport: set by the registry as it joins
    declared: int = 0  # the capacity its Hello declared (0: ``capacity`` as given)
    window: float = field(init=False, default=0.0)  # calls at once it has earned (AIMD)

    def __post_init__(self) -> None:
        self.declared = self.declared or self.capacity
        self.window = float(min(self.declared, FIRST_WINDOW))
        self.capacity = max(1, int(self.window))
        self.announce(self.variants)

    def served(self, *, saturated: bool) -> None:
        """A Work answered within its budget. Only one sent while every trusted slot was busy
        proves the agent serves that many at once: it earns a window's worth of answers one more
        slot (additive increase), up to what it declared. A capacity declared is a claim; a
        black hole declaring 1,024 would otherwise draw every request its way."""
        if saturated and self.window < self.declared:
            self.window = min(float(self.declared), self.window + 1.0 / self.window)
            self.capacity = max(1, int(self.window))

    def missed(self) -> None:
        """A Work it did not answer within its budget: half the slots (multiplicative decrease)."""
        self.window = max(1.0, self.window / 2.0)
        self.capacity = max(1, int(self.window))

    def not_reading(self, received: int, beats: int) -> int:
        """The messages left unread, once the agent's read count (``received``, from its
        heartbeat) has stood still with messages unread for ``beats`` heartbeats; else 0.

        An agent reads its link as soon as messages arrive, however busy its models are, so
        messages left unread while its count stands still mean it is not reading at all."""
        unread = self.sent - received
        stalled = unread > 0 and received == self.last_received
        self.unread_beats = self.unread_beats + 1 if stalled else 0
        self.last_received = received
        return unread if self.unread_beats >= beats else 0

    async def reload(self, timeout_s: float) -> str:
        """Ask the agent to reload and wait for its answer: "" or the problem. One Reload is on
        the link at a time: a caller that comes while one runs waits for the same answer."""
        waiter: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        if not self.reloads:
            self.work.ask_reload()
        self.reloads.append(waiter)
        try:
            async with asyncio.timeout(timeout_s):
                return await waiter
        except TimeoutError:
            raise DeadlineExceeded(f"agent {self.id} did not finish reloading within {timeout_s:.0f} s") from None
        finally:
            with contextlib.suppress(ValueError):  # a waiter that gave up is not kept
                self.reloads.remove(waiter)

    def settle_reloads(self, problem: str) -> None:
        """Every caller waiting for a reload is told how it went ("" or the problem)."""
        for waiter in self.reloads:
            if not waiter.done():
                waiter.set_result(problem)
        self.reloads.clear()

    def announce(self, variants: dict[str, VariantServed]) -> None:
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
        self._limit = (self.declared + self.queue_limit) * max(self._max_batch.values(), default=1)

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

    def compute_of(self, variant: str) -> str:
        """The arithmetic the agent's runtime computes ``variant`` in, as its Hello said."""
        info = self.variants.get(variant)
        return info.compute if info is not None else ""

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

    def patience_ms(self, model: str, items: int) -> float:
        """How long a Work of ``items`` may go unanswered before its requests try elsewhere.

        From what this router measured (the link, and batches of the variant it answered),
        never from what the agent reports: heartbeats cannot buy an agent more patience, as
        they cannot buy it more calls at once (``served``)."""
        curve = self.curves.get(self.variant_for(model))
        measured = self.rtt_ms + curve.estimate(items) if curve is not None and curve.known else 0.0
        return max(PATIENCE_FLOOR_MS, PATIENCE_FACTOR * measured)

    def learn(self, ran: Ran, round_trip_ms: float) -> None:
        """What an answer teaches: the batch's service time by its size, and the link's cost."""
        if ran.batch_size > 0:
            self.batch_sizes.add(ran.batch_size)
        if ran.batch_size > 0 and ran.service_ms > 0:
            self.curves.setdefault(ran.variant, ServiceCurve()).add(ran.batch_size, ran.service_ms)
        self.link_ms.add(max(0.0, round_trip_ms - ran.service_ms - ran.queue_ms))

    def update_latency(self, estimates: Mapping[str, LatencySummary]) -> None:
        """Merge what changed (for status, and as the estimate before any Result)."""
        for variant, summary in estimates.items():
            if variant in self.variants:  # another name is nothing it serves
                self.latency[variant] = summary

    async def classify(
        self, items: Tensors, *, model: str, outputs: Sequence[str], request_id: str, budget_ms: float
    ) -> Classified:
        """Queue the items for this agent (maybe merged into one Work with others')."""
        return await self.work.classify(
            items, model=model, outputs=outputs, request_id=request_id, budget_ms=budget_ms
        )

    async def generate(self, request: pb.ModelInferRequest, on_chunk: OnChunk, *, budget_ms: float) -> Generated:
        return await self.work.generate(request, on_chunk, budget_ms=budget_ms)
