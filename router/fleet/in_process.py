"""The tier a router serves in its own process (``--local-tier``): one more agent of that tier
beside the remote ones, linked through memory instead of a gRPC stream.

Why this shape: the agent's handle, the Batcher in front of it, the policy's estimates,
rollouts, audits, drains and metrics all read an :class:`~router.fleet.agent_handle.AgentHandle`
fed by a Hello, heartbeats and Results. Feeding the same messages through two queues keeps
every one of them as it is for remote agents, and takes the second process and its gRPC hop
out of the answer (issue 37): a request answered here crosses one Python process. The
messages are protobuf objects handed over by reference, never serialized; the models run on
the executor threads of :class:`~stratus.execution.local_models.LocalModels` (on the event loop only
for a model that takes under 0.2 ms, where the hand-over would cost more than the call).

One exception, for speed: a classifier's batch (:class:`InProcessWork`) goes from the Batcher in
front of the agent straight to the models as arrays over the request's own bytes, and its
outputs come back as tensors, with no Work or Result message built and read in between
(issue 37 §3), and runs at once: that Batcher formed the batch and holds its slot, so the
models' own batcher is not asked again. Generations, cancels, drains, reloads and heartbeats
keep the messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from router.backends.agent import AgentWork, LinkedAgent, Part, PartAnswer, WorkSettings
from router.backends.base import RanHere
from router.fleet.agent_handle import AgentHandle, State
from router.fleet.registry import FleetRegistry
from stratus.convert.errors import error_label
from stratus.convert.fleet import chunk_from_wire, heartbeat_from_wire, heartbeat_to_wire
from stratus.convert.hello import hello_from_wire, hello_to_wire
from stratus.convert.tensors import Tensors
from stratus.convert.work import result_from_wire
from stratus.datatypes import Array
from stratus.errors import DeadlineExceeded, StratusError
from stratus.execution.describe import Introduction, heartbeat, hello
from stratus.execution.local_models import LocalModels
from stratus.execution.running import LocalRun
from stratus.execution.work import serve_work
from stratus.sched.batching import Batch, split_counts
from stratus.wire import fleet_pb2 as fpb

log = logging.getLogger("stratus.router")

# The identity the registry holds the in-process agent by: no credential can name it (a
# certificate's is "cert:...", a token's "token:...", a pool's "pool:..."), so no remote
# agent can take its id over.
IDENTITY = "in-process"
# After the registry lost the link (it missed heartbeats while the loop was stalled), how long
# before the agent registers again.
RELINK_S = 0.5


class InProcessWork(AgentWork):
    """The router's own agent's Work side: batches run on the models here, not sent on a link."""

    def __init__(self, agent: LinkedAgent, settings: WorkSettings, models: LocalModels) -> None:
        super().__init__(agent, settings)
        self.models = models
        self.running = 0  # batches on the models now (the heartbeat's in_flight counts them)

    async def _send(self, batch: Batch[Part, PartAnswer]) -> list[PartAnswer]:
        """As a linked agent's Work would: within the latest deadline of the batch's members,
        learnt from, counted in the same metrics; each member's rows and confidences back."""
        key = batch.key
        clock = self.settings.clock
        sent = clock()
        budget_ms = max(1.0, (max(p.deadline for p in batch.payloads) - sent) * 1000.0)
        self.settings.on_batch(batch.size)
        inputs = Tensors.join([p.inputs for p in batch.payloads]).arrays()
        saturated = self.batcher.outstanding >= self.batcher.slots
        ran = await self._run(key.variant, inputs, key.outputs, budget_ms)
        learnt = RanHere(ran.variant.name, ran.batch_size, ran.service_ms, ran.queue_ms)
        self.learnt(learnt, (clock() - sent) * 1000.0, saturated=saturated)
        outputs = Tensors.from_arrays(ran.outputs)
        return [
            PartAnswer(
                outputs=outputs.rows(start, stop),
                confidences=ran.confidences[start:stop],
                variant=ran.variant.name,
                batch_size=ran.batch_size,
                queue_ms=(sent - part.queued_at) * 1000.0 + ran.queue_ms,
                service_ms=ran.service_ms,
            )
            for (start, stop), part in zip(split_counts(batch.size, batch.sizes), batch.payloads, strict=True)
        ]

    async def _run(
        self, variant: str, inputs: dict[str, Array], outputs: tuple[str, ...], budget_ms: float
    ) -> LocalRun:
        self.running += 1
        outcome = "ok"
        try:
            if self.models.runs_inline(variant):  # to its end on this loop: no timer fires meanwhile
                return await self.models.run(variant, inputs, outputs, batched=True)
            async with asyncio.timeout(budget_ms / 1000.0):
                return await self.models.run(variant, inputs, outputs, batched=True)
        except TimeoutError:
            outcome = "deadline_exceeded"
            self.missed()
            raise DeadlineExceeded(
                f"agent {self.agent.id} did not answer within {budget_ms:.1f} ms"
            ) from None
        except StratusError as exc:
            outcome = error_label(exc)
            raise
        finally:
            self.running -= 1
            self.models.count(outcome, variant)


class InProcessAgent:
    """The router's own agent: registered like a remote one, answering Work in this process."""

    def __init__(
        self,
        registry: FleetRegistry,
        models: LocalModels,
        who: Introduction,
        *,
        drain_timeout_s: float = 20.0,
    ) -> None:
        self.registry = registry
        self.models = models
        self.who = who
        self.drain_timeout_s = drain_timeout_s
        self.handle: AgentHandle | None = None
        # What the agent side says, to the router side: Results, Chunks, heartbeats, Hellos.
        self.outbox: asyncio.Queue[fpb.AgentMessage | None] = asyncio.Queue()
        self.work: dict[str, asyncio.Task[None]] = {}  # by the router's Work id
        self._reported: dict[str, int] = {}  # latency samples per variant at the last heartbeat
        self._received = 0  # RouterMessages taken, as a remote agent counts them
        self._interval = registry.heartbeat_s
        self._beat_now = asyncio.Event()
        self._started = time.monotonic()
        self._linked = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._reloads: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Register, and keep registered until :meth:`close` (the first Hello before returning)."""
        self._task = asyncio.create_task(self._stay_linked(), name=f"stratus-in-process-{self.who.agent_id}")
        await self._linked.wait()

    @property
    def in_flight(self) -> int:
        """Work running here: generations and other messages' Work, and batches run directly."""
        work = self.handle.work if self.handle is not None else None
        return len(self.work) + (work.running if isinstance(work, InProcessWork) else 0)

    def _hello(self) -> fpb.Hello:
        """Written and read as a remote agent's is, so the fleet sees it described alike."""
        return hello_to_wire(hello(self.models, self.who, uptime_s=time.monotonic() - self._started))

    async def _stay_linked(self) -> None:
        while not self._closing:
            try:
                handle = self.registry.register(
                    hello_from_wire(self._hello()),
                    peer="in-process",
                    identity=IDENTITY,
                    work=lambda agent, settings: InProcessWork(agent, settings, self.models),
                )
            except Exception:  # the registry refused its own tier: say why, and try again
                log.exception("the in-process %s agent could not register", self.who.tier.label)
                self._linked.set()
                await asyncio.sleep(RELINK_S * 10)
                continue
            self.handle = handle
            self._received = 0
            self._linked.set()
            if self.registry.site_mark(handle.id) == "drained":  # drained site-wide before it linked
                self.registry.drain(handle.id)
            await self._serve(handle)
            if self._closing or handle.state != State.LOST:
                return  # closed, or the router itself ended its agents' links (it is stopping)
            log.warning("the in-process agent %s was lost; registering again", handle.id)
            await asyncio.sleep(RELINK_S)

    async def _serve(self, handle: AgentHandle) -> None:
        """Both directions and the heartbeats, until the registry ends the link."""
        tasks = [
            asyncio.create_task(self._to_agent(handle), name="stratus-in-process-work"),
            asyncio.create_task(self._to_router(handle), name="stratus-in-process-answers"),
            asyncio.create_task(self._heartbeats(), name="stratus-in-process-heartbeat"),
        ]
        try:
            await tasks[0]  # ends when the registry closes the handle's outbox (lost, or closing)
        finally:
            for task in tasks[1:]:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for task in self.work.values():  # its Work failed over with the handle
                task.cancel()

    async def _to_agent(self, handle: AgentHandle) -> None:
        """What the router sends its agents, taken here as a remote agent takes it off its link."""
        outbox = handle.work.outbox
        while (message := await outbox.get()) is not None:
            handle.sent += 1
            self._received += 1
            self._take(message)

    def _take(self, message: fpb.RouterMessage) -> None:
        kind = message.WhichOneof("kind")
        if kind == "work":
            self._accept(message.work)
        elif kind == "cancel":
            task = self.work.get(message.cancel.request_id)
            if task is not None:
                task.cancel()
        elif kind == "pace":
            self._interval = message.pace.heartbeat_interval_s or self._interval
            self._beat_now.set()
        elif kind == "drain":
            reason = message.drain.reason or "drained"
            self.outbox.put_nowait(fpb.AgentMessage(draining=fpb.Draining(reason=reason)))
        elif kind == "reload":
            self._start_reload()

    def _accept(self, work: fpb.Work) -> None:
        request_id = work.request_id
        task = asyncio.create_task(
            serve_work(self.models, self.who.agent_id, work, self.outbox), name=f"stratus-work-{request_id}"
        )
        self.work[request_id] = task
        task.add_done_callback(lambda _: self.work.pop(request_id, None))

    async def _to_router(self, handle: AgentHandle) -> None:
        registry = self.registry
        handlers: dict[str, Callable[[fpb.AgentMessage], None]] = {
            "result": lambda m: registry.result(handle, result_from_wire(m.result, f"agent {handle.id}")),
            "chunk": lambda m: registry.chunk(handle, m.chunk.request_id, chunk_from_wire(m.chunk)),
            "heartbeat": lambda m: registry.heartbeat(handle, heartbeat_from_wire(m.heartbeat)),
            "draining": lambda m: registry.draining(handle),
            "hello": lambda m: registry.reannounce(handle, hello_from_wire(m.hello)),
            "reload_failed": lambda m: registry.reload_failed(handle, m.reload_failed.message),
        }
        while (message := await self.outbox.get()) is not None:
            kind = message.WhichOneof("kind")
            try:
                handlers[kind or ""](message)
            except Exception:  # one bad answer must not end the tier
                log.exception("the in-process agent %s: its %s was not taken", handle.id, kind)

    async def _heartbeats(self) -> None:
        """At the registry's pace, as a remote agent's: load, and what its latency learnt."""
        while True:
            self._beat_now.clear()
            report = heartbeat(
                self.models, in_flight=self.in_flight, reported=self._reported, received=self._received
            )
            self.outbox.put_nowait(fpb.AgentMessage(heartbeat=heartbeat_to_wire(report)))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._interval):
                    await self._beat_now.wait()

    def _start_reload(self) -> None:
        """An operator's Reload: load what changed in the models folder, then say Hello again."""
        if self._reloads:
            return  # one at a time; the running one reads the folder as it is now
        task = asyncio.create_task(self._reload(), name="stratus-in-process-reload")
        self._reloads.add(task)
        task.add_done_callback(self._reloads.discard)

    async def _reload(self) -> None:
        try:
            await self.models.reload()
        except Exception as exc:  # the old variants keep serving
            log.error(
                "the in-process agent's reload failed; still serving %s: %s", sorted(self.models.served), exc
            )
            self.outbox.put_nowait(fpb.AgentMessage(reload_failed=fpb.ReloadFailed(message=str(exc)[:1000])))
            return
        self.outbox.put_nowait(fpb.AgentMessage(hello=self._hello()))

    async def close(self) -> None:
        """Drain: no new Work, finish what it holds (up to the drain timeout), leave, unload."""
        self._closing = True
        handle = self.handle
        if handle is not None:
            self.registry.draining(handle)
            if self.work:
                await asyncio.wait(list(self.work.values()), timeout=self.drain_timeout_s)
            self.registry.lose(handle, "the router is stopping")
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for task in self._reloads:
            task.cancel()
        await asyncio.gather(*self._reloads, return_exceptions=True)
        self.models.close()
