"""An agent as a backend: the queue in front of it and the Work on its AgentLink.

:class:`AgentWork` is the transport half of an agent the router holds: its outbox (what
its AgentLink stream writes), the Work it was sent and waits on, the generations whose
Chunks it relays, and the :class:`~stratus.sched.batching.Batcher` that merges requests into
Work while the agent is busy. The agent's identity, state and estimates stay on its
handle (:class:`router.fleet.registry.AgentHandle`), which answers the policy; the handle's
``classify`` and ``generate`` come here. Membership (joining, heartbeats, losing) is the
registry's; it tells this side when the link is gone (:meth:`AgentWork.fail`).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from router.backends.base import Classified, Generated, OnChunk, Ran
from stratus.convert.tensors import Tensors
from stratus.convert.work import WorkResult
from stratus.datatypes import numpy_dtype
from stratus.errors import DeadlineExceeded, Unavailable
from stratus.families.generation import Chunk
from stratus.obs.stats import LatencyWindow
from stratus.sched.batching import Batch, Batcher, BatchKey, split_counts
from stratus.serving.channels import MAX_WORK_BYTES, check_fits
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import inference_pb2 as pb

log = logging.getLogger("stratus.registry")

# Messages that may wait for an agent's stream before the agent counts as not reading.
MAX_OUTBOX = 4096


@dataclass(frozen=True, kw_only=True)
class Part:
    """One request's items, waiting for an agent: checked raw tensors and their deadline."""

    inputs: Tensors
    deadline: float  # on the registry's clock
    queued_at: float = 0.0  # on the registry's clock: when it began to wait for the agent


@dataclass(frozen=True, kw_only=True)
class PartAnswer:
    """An agent's answer for one request's items."""

    outputs: Tensors
    confidences: tuple[float, ...]
    variant: str
    batch_size: int
    queue_ms: float = 0.0  # waiting here for the agent, then at the agent for a slot
    service_ms: float = 0.0  # the agent running the batch that held these items


# How long a Work may go unanswered before its requests try elsewhere (AgentHandle.patience_ms):
# this many times what the router has measured such a batch to take, and never less than the
# floor. An agent that takes Work and answers none (security2 N3's black hole) then costs each
# request this, not the whole of its budget.
PATIENCE_FACTOR: Final = 10.0
PATIENCE_FLOOR_MS: Final = 1000.0


class LinkedAgent(Protocol):
    """What the Work side reads of the agent's handle: who it is, how big, what it costs."""

    @property
    def id(self) -> str: ...
    @property
    def capacity(self) -> int: ...
    @property
    def queue_limit(self) -> int: ...
    @property
    def limit(self) -> int: ...
    @property
    def rtt_ms(self) -> float: ...
    @property
    def lost(self) -> bool: ...
    @property
    def link_ms(self) -> LatencyWindow: ...
    def variant_for(self, model: str) -> str: ...
    def max_batch(self, model: str) -> int: ...
    def cost_ms(self, model: str, items: int) -> float: ...
    def patience_ms(self, model: str, items: int) -> float: ...
    def precision_of(self, variant: str) -> str: ...
    def compute_of(self, variant: str) -> str: ...
    def learn(self, ran: Ran, round_trip_ms: float) -> None: ...
    def served(self, *, saturated: bool) -> None: ...
    def missed(self) -> None: ...


@dataclass(frozen=True, kw_only=True)
class WorkSettings:
    """What every agent's Work side shares, from the registry."""

    clock: Callable[[], float]
    ids: Iterator[int]  # Work ids, unique across the router (they show in both sides' logs)
    max_batch_delay_s: float
    on_batch: Callable[[int], None] = lambda items: None  # the batch-size metric
    on_stuck: Callable[[str], None] = lambda reason: None  # the agent stopped reading its link
    # Whether a variant's requests could be answered by another agent or the cloud: only then is
    # a Work bounded by the agent's patience (an agent alone with its family is waited for, slow
    # or not, for the whole budget: there is nowhere better to go).
    elsewhere: Callable[[str], bool] = lambda variant: False


class AgentWork:
    """One agent's outbox, the Work out on its link, and the queue in front of it."""

    def __init__(self, agent: LinkedAgent, settings: WorkSettings) -> None:
        self.agent = agent
        self.settings = settings
        self.outbox: asyncio.Queue[fpb.RouterMessage | None] = asyncio.Queue()
        self.pending: dict[str, asyncio.Future[WorkResult]] = {}
        self.chunks: dict[str, OnChunk] = {}  # generations, by Work id
        self.batcher = self._batcher()

    def _batcher(self) -> Batcher[Part, PartAnswer]:
        """The queue in front of one agent.

        At most two Works per slot are out at once: one running and one ready behind it,
        so the agent never idles between batches while everything else waits here, where
        it can still merge into bigger batches (fewer messages, fewer runtime calls).
        """
        agent = self.agent
        return Batcher(
            self._send,
            slots=agent.capacity,
            depth=agent.capacity + min(agent.capacity, max(0, agent.queue_limit)),
            max_batch=lambda key: min(agent.max_batch(key.variant), items_that_fit(key)),
            max_delay_s=self.settings.max_batch_delay_s,
            queue_limit=max(1, agent.limit),
            name=f"agent {agent.id}",
            clock=self.settings.clock,
        )

    @property
    def in_flight(self) -> int:
        """Items waiting here for the agent, or sent to it and not yet answered (a
        generation counts as one item while it runs)."""
        return self.batcher.items + len(self.chunks)

    # -- the backend's two questions ------------------------------------------------------
    async def classify(
        self, items: Tensors, *, model: str, outputs: Sequence[str], request_id: str, budget_ms: float
    ) -> Classified:
        part = await self.submit(items, variant=model, outputs=outputs, budget_ms=budget_ms)
        return Classified(
            agent=self.agent.id,
            variant=part.variant,
            outputs=part.outputs,
            confidences=part.confidences,
            precision=self.agent.precision_of(part.variant),
            compute=self.agent.compute_of(part.variant),
            queue_ms=part.queue_ms,
            compute_ms=part.service_ms,
        )

    async def generate(self, request: pb.ModelInferRequest, on_chunk: OnChunk, *, budget_ms: float) -> Generated:
        result = await self.generation(request, budget_ms=budget_ms, on_chunk=on_chunk)
        return Generated(
            agent=self.agent.id,
            variant=result.variant,
            said=result.said,
            confidence=result.confidence if result.confidences else None,
            precision=self.agent.precision_of(result.variant),
        )

    # -- sending --------------------------------------------------------------------------
    async def submit(self, inputs: Tensors, *, variant: str, outputs: Sequence[str], budget_ms: float) -> PartAnswer:
        """Queue items for the agent (maybe merged with others) and wait for their answer.

        The items leave the queue by their slack: the latest moment a batch holding them
        can still start and finish inside the budget, as this agent's estimates say.
        """
        agent = self.agent
        check_fits(inputs.nbytes, f"a Work of {inputs.items} items")
        self._check_reading()
        now = self.settings.clock()
        deadline = now + budget_ms / 1000.0
        run_ms = agent.rtt_ms + agent.cost_ms(variant, inputs.items)
        key = inputs.batch_key(agent.variant_for(variant), outputs)
        return await self.batcher.submit(
            key,
            Part(inputs=inputs, deadline=deadline, queued_at=now),
            size=inputs.items,
            latest_start=deadline - run_ms / 1000.0,
            timeout_s=budget_ms / 1000.0,
        )

    async def generation(self, request: pb.ModelInferRequest, *, budget_ms: float, on_chunk: OnChunk) -> WorkResult:
        """One generative Work, not batched: its Chunks go to ``on_chunk`` as they arrive,
        then its Result. Cancelling the caller sends Cancel, which stops the agent's runtime."""
        agent = self.agent
        self._check_reading()
        request_id = f"g{next(self.settings.ids)}"
        message = fpb.RouterMessage()
        message.work.request_id = request_id
        message.work.request.CopyFrom(request)
        message.work.request.model_name = agent.variant_for(request.model_name)
        message.work.budget_ms = budget_ms
        check_fits(message.ByteSize(), "this generation's Work")
        self.chunks[request_id] = on_chunk
        try:
            sent = self.settings.clock()
            result = await self._exchange(request_id, message, budget_ms, "finish")
        finally:
            self.chunks.pop(request_id, None)
        agent.link_ms.add(max(0.0, (self.settings.clock() - sent) * 1000.0 - result.service_ms))
        if result.error is not None:
            raise result.error
        return result

    async def _send(self, batch: Batch[Part, PartAnswer]) -> list[PartAnswer]:
        """One Work for a batch: send, wait for its Result (or the last member's deadline), split."""
        request_id = f"r{next(self.settings.ids)}"
        message = fpb.RouterMessage()  # built in place: a message passed to a constructor is copied
        work = message.work
        work.request_id = request_id
        request = work.request
        request.model_name = batch.key.variant
        request.id = request_id
        for name in batch.key.outputs:
            request.outputs.add(name=name)
        Tensors.join([p.inputs for p in batch.payloads]).write_request(request)
        sent = self.settings.clock()
        budget_ms = max(1.0, (max(p.deadline for p in batch.payloads) - sent) * 1000.0)
        work.budget_ms = budget_ms
        check_fits(message.ByteSize(), f"a Work of {batch.size} items")  # never one the link cannot carry
        self.settings.on_batch(batch.size)
        saturated = self.batcher.outstanding >= self.batcher.slots
        patience_ms = self.agent.patience_ms(batch.key.variant, batch.size)
        if patience_ms < budget_ms and self.settings.elsewhere(batch.key.variant):  # rest of budget: elsewhere
            result = await self._exchange(request_id, message, patience_ms, "answer", patience=True)
        else:
            result = await self._exchange(request_id, message, budget_ms, "answer")
        self.learnt(result, (self.settings.clock() - sent) * 1000.0, saturated=saturated)
        waited_ms = [(sent - p.queued_at) * 1000.0 for p in batch.payloads]
        return split_result(self.agent.id, result, batch.sizes, waited_ms)

    async def _exchange(
        self, request_id: str, message: fpb.RouterMessage, budget_ms: float, what: str, *, patience: bool = False
    ) -> WorkResult:
        """Put one Work on the link and wait for its Result; on the deadline or when the
        caller gives up, a Cancel follows it. ``patience``: ``budget_ms`` is the agent's
        patience (AgentHandle.patience_ms), shorter than the requests' own budgets."""
        if self.agent.lost:  # its link is gone: nothing put on it would ever be answered
            raise Unavailable(f"agent {self.agent.id} was lost before its Work could be sent")
        future: asyncio.Future[WorkResult] = asyncio.get_running_loop().create_future()
        self.pending[request_id] = future
        self.outbox.put_nowait(message)
        try:
            async with asyncio.timeout(budget_ms / 1000.0):
                return await future
        except TimeoutError:
            self._cancel(request_id)
            self.missed()
            if not patience:
                raise DeadlineExceeded(f"agent {self.agent.id} did not {what} within {budget_ms:.1f} ms") from None
            late = DeadlineExceeded(
                f"agent {self.agent.id} did not {what} within {budget_ms:.1f} ms ({PATIENCE_FACTOR:g} times "
                f"what it has shown such a batch takes, at least {PATIENCE_FLOOR_MS:g} ms)"
            )
            self.batcher.fail_waiting(late)  # what waits behind this Work tries elsewhere too
            raise late from None
        except asyncio.CancelledError:  # every member gave up
            self._cancel(request_id)
            raise
        finally:
            self.pending.pop(request_id, None)

    def learnt(self, ran: Ran, round_trip_ms: float, *, saturated: bool) -> None:
        """What an answer in time teaches: the agent's costs, and maybe one more trusted slot."""
        self.agent.learn(ran, round_trip_ms)
        self.agent.served(saturated=saturated)
        self._fit_slots()

    def missed(self) -> None:
        """The agent let a Work's budget run out: it is trusted with fewer at once."""
        self.agent.missed()
        self._fit_slots()

    def _fit_slots(self) -> None:
        capacity = self.agent.capacity
        if capacity != self.batcher.slots:
            self.batcher.resize(slots=capacity, depth=capacity + min(capacity, max(0, self.agent.queue_limit)))

    def _cancel(self, request_id: str) -> None:
        self.outbox.put_nowait(fpb.RouterMessage(cancel=fpb.Cancel(request_id=request_id)))

    # -- what else the link carries ---------------------------------------------------------
    def ask_reload(self) -> None:
        """The agent reloads its models folder, then says hello again (or why it could not)."""
        self.outbox.put_nowait(fpb.RouterMessage(reload=fpb.Reload()))

    def ask_drain(self, reason: str) -> None:
        """The agent finishes what it holds, takes no more, and says it is draining."""
        self.outbox.put_nowait(fpb.RouterMessage(drain=fpb.Drain(reason=reason)))

    def set_pace(self, heartbeat_interval_s: float) -> None:
        """The agent beats at this interval from now on (the fleet's size sets it)."""
        self.outbox.put_nowait(fpb.RouterMessage(pace=fpb.Pace(heartbeat_interval_s=heartbeat_interval_s)))

    def _check_reading(self) -> None:
        if self.outbox.qsize() >= MAX_OUTBOX:
            self.settings.on_stuck(f"not reading its link ({MAX_OUTBOX} messages waiting)")
            raise Unavailable(f"agent {self.agent.id} is not reading its link")

    # -- what comes back on the link ---------------------------------------------------------
    def result(self, result: WorkResult) -> bool:
        """Hand a Result to the Work waiting on it; False when none is (finished, or unknown)."""
        future = self.pending.pop(result.request_id, None)
        if future is None:
            log.debug("result for unknown or finished request %s from %s", result.request_id, self.agent.id)
            return False
        if not future.done():
            future.set_result(result)
        return True

    def chunk(self, request_id: str, chunk: Chunk) -> None:
        """Hand a generation's tokens to the request waiting on them (none: it finished)."""
        deliver = self.chunks.get(request_id)
        if deliver is not None:
            deliver(chunk)

    def fail(self, reason: str) -> None:
        """The link is gone: every Work out and every request queued fails over at once."""
        error = Unavailable(f"agent {self.agent.id} {reason}")
        for future in self.pending.values():
            if not future.done():
                future.set_exception(error)
        self.pending.clear()
        self.batcher.fail_waiting(error)


def items_that_fit(key: BatchKey) -> int:
    """How many items of this shape one Work may carry: the batcher never merges past it
    (600 KB images at --max-batch 32 would otherwise make a Work no link carries)."""
    per_item = sum(
        math.prod(shape) * numpy_dtype(datatype).itemsize
        for _, datatype, shape in key.inputs
        if datatype != "BYTES"
    )
    return max(1, MAX_WORK_BYTES // per_item) if per_item else MAX_WORK_BYTES


def split_result(
    agent: str, result: WorkResult, sizes: Sequence[int], waited_ms: Sequence[float] = ()
) -> list[PartAnswer]:
    """A Work's Result, back into one answer (or one error) per merged request, in order;
    ``waited_ms``: how long each request waited here before the Work left."""
    if result.error is not None:
        raise result.error
    outputs = result.outputs
    total = sum(sizes)
    if outputs.items != total or (not outputs.splittable and len(sizes) > 1):
        raise Unavailable(f"agent {agent} answered {outputs.items} items for a batch of {total}")
    confidences = result.item_confidences(total)
    return [
        PartAnswer(
            outputs=outputs.rows(start, stop),
            confidences=confidences[start:stop],
            variant=result.variant,
            batch_size=result.batch_size,
            queue_ms=max(0.0, waited) + result.queue_ms,
            service_ms=result.service_ms,
        )
        for (start, stop), waited in zip(
            split_counts(total, sizes), list(waited_ms) or [0.0] * len(sizes), strict=True
        )
    ]
