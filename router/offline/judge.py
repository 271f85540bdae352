"""Judging: deferred requests sent to the cloud once it is back, at the lowest priority.

A task of the router's own looks at the store every ``POLL_S`` (and at once when something is
deferred): while the cloud takes calls, it sends the oldest deferred requests, each as the
cloud would have been asked it (its unsure items), and compares the cloud's top-1 class with
each item's provisional answer. An item the cloud answers otherwise is a correction
(router/offline/corrections.py); every verdict is counted per family and tier; the cloud's
answers go to capture as labels (``--capture``, source ``judged``). The request is removed
from the store only once its corrections are kept.

**Live requests first.** The judge takes only the cloud's spare room, and at most
``--adjudicate-share`` of it: a judging call is sent only while the cloud's calls in flight
(live escalations, audits and judging together) stay under that share of its capacity, so
a burst of live escalations finds the room they had before the outage. A judging call that
fails (the cloud gone again, overloaded, too slow) leaves the request in the store, and the
judge waits a poll before trying again; one the cloud refuses for what it is (an unknown
model, a shape it no longer takes) is dropped and counted, since asking again cannot help.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from typing import Final, Protocol

from router.backends.cloud import CloudBackend, gateway_backends
from router.cloud.pool import CloudTier
from router.offline.corrections import CorrectionLog
from router.offline.store import DeferredStore
from router.policy import spare
from stratus.cancellation import CancelWatch
from stratus.convert.tensors import Tensors, top1
from stratus.errors import DeadlineExceeded, Overloaded, StratusError, Unavailable
from stratus.families.description import FamilyDescription
from stratus.families.offline import DEFAULT_MAX_AGE_S
from stratus.wire import fleet_pb2 as fpb

log = logging.getLogger("stratus.router.offline")

POLL_S: Final = 1.0
JUDGE_BUDGET_MS: Final = 10_000.0  # a judging call may take this long: nobody waits on it
AGREED: Final = "agreed"
CORRECTED: Final = "corrected"
# Why a deferred request left the store without a verdict (the dropped counter's reason).
EXPIRED: Final = "expired"
REFUSED: Final = "refused_by_cloud"
NO_LONGER: Final = "family_changed"  # its description has no outputs to judge by


class JudgeObserver(Protocol):
    def judged(self, family: str, tier: str, verdict: str, items: int) -> None: ...
    def deferred_dropped(self, family: str, reason: str, items: int) -> None: ...


class LabelSink(Protocol):
    def judged(self, record: fpb.DeferredRequest, cloud: list[fpb.ProvisionalAnswer]) -> None: ...


class Judge:
    """The background worker described above."""

    def __init__(
        self,
        store: DeferredStore,
        corrections: CorrectionLog,
        *,
        cloud: Callable[[], CloudTier | None],
        describe: Callable[[str], FamilyDescription | None],
        share: float,
        observer: JudgeObserver,
        labels: LabelSink | None = None,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self.store = store
        self.corrections = corrections
        self._cloud = cloud
        self._describe = describe
        self._rng = rng or random.Random()
        self.share = share
        self.observer = observer
        self.labels = labels
        self._clock = clock
        self.judging: dict[str, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self._backoff_until = 0.0

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        cancels = CancelWatch()  # a store on nats-py may swallow the cancel that ends this loop
        while True:
            cancels.check()
            await self._expire()
            await self._send()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_S):  # not wait_for: see stratus/cancellation.py
                    await self._wake.wait()
            self._wake.clear()

    async def close(self) -> None:
        for task in list(self.judging.values()):
            task.cancel()
        for task in list(self.judging.values()):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def room(self) -> int:
        """Judging calls that may start now (see the module's docstring)."""
        cloud = self._cloud()
        if cloud is None or not cloud.available or self._clock() < self._backoff_until or self.share <= 0:
            return 0
        limit = max(1.0, cloud.capacity * self.share)
        return max(0, int(limit - cloud.in_flight))

    async def _send(self) -> None:
        room = self.room()
        if not room:
            return
        # a family no agent describes now (after a restart, until they link again) waits
        families = frozenset(f for f in self.store.families() if self._describe(f) is not None)
        for record in await self.store.claim(room, families):
            task = asyncio.create_task(self._judge(record), name="stratus-judge")
            self.judging[record.key] = task
            task.add_done_callback(self._finished(record.key))

    def _finished(self, key: str) -> Callable[[asyncio.Task[None]], None]:
        return lambda _task: self._done(key)

    def _done(self, key: str) -> None:
        self.judging.pop(key, None)
        self._wake.set()  # room may have opened: send the next one without waiting a poll

    async def _expire(self) -> None:
        ages = {}
        for family in self.store.families():
            info = self._describe(family)  # a family no agent describes now: the default bound
            ages[family] = info.offline.max_age_s if info is not None else DEFAULT_MAX_AGE_S
        for kept in self.store.expired(self._clock(), ages):
            await self.store.remove(kept.key)
            self.observer.deferred_dropped(kept.family, EXPIRED, kept.items)

    async def _drop(self, record: fpb.DeferredRequest, reason: str) -> None:
        await self.store.remove(record.key)
        self.observer.deferred_dropped(record.family, reason, len(record.items))

    async def _judge(self, record: fpb.DeferredRequest) -> None:
        left = False
        try:
            left = await self._judged(record)
        finally:
            if not left:  # not judged now (or cancelled): claimable again later
                await self.store.release(record.key)

    async def _judged(self, record: fpb.DeferredRequest) -> bool:
        """Judge one claimed request: True once it left the store (judged or dropped)."""
        info = self._describe(record.family)
        cloud = self._cloud()
        if info is None or cloud is None:  # its agents gone again meanwhile: later
            return False
        if not info.outputs:
            await self._drop(record, NO_LONGER)
            return True
        try:
            answered = await self._gateway(cloud, record.model).classify(
                Tensors.from_request(record.inputs),
                model=record.model,
                outputs=(),
                request_id=record.request_id,
                budget_ms=JUDGE_BUDGET_MS,
            )
        except (Unavailable, Overloaded, DeadlineExceeded) as exc:
            self._backoff_until = self._clock() + POLL_S
            log.debug("judging %s waits: %s", record.key, exc)
            return False
        except StratusError as exc:
            log.warning(
                "the cloud refused to judge deferred request %s (%s): %s", record.key, record.family, exc
            )
            await self._drop(record, REFUSED)
            return True
        classes = top1(answered.outputs, info.outputs[0].name)
        if classes is None or len(classes) != len(record.items):
            log.warning("the cloud's answer to deferred request %s holds no classes to judge by", record.key)
            await self._drop(record, REFUSED)
            return True
        cloud_answers = [
            fpb.ProvisionalAnswer(
                tier="cloud",
                variant=answered.variant,
                agent=answered.agent,
                label=int(label),
                confidence=float(answered.confidences[row]),
            )
            for row, label in enumerate(classes)
        ]
        await self.corrections.add(self._verdicts(record, cloud_answers))
        if self.labels is not None:
            self.labels.judged(record, cloud_answers)
        await self.store.remove(record.key)
        return True

    def _gateway(self, cloud: CloudTier, model: str) -> CloudBackend:
        """A gateway serving ``model`` with a free slot (the policy's spare choice)."""
        gateway = spare(gateway_backends(cloud, model), self._rng)
        if gateway is None:
            raise Unavailable(f"no gateway of cloud {cloud.address} serving {model!r} has a free slot")
        return gateway

    def _verdicts(
        self, record: fpb.DeferredRequest, cloud: list[fpb.ProvisionalAnswer]
    ) -> list[fpb.Correction]:
        """Each item's verdict counted; the corrections, for the items the cloud answers otherwise."""
        judged_at = self._clock()
        made = []
        for item, theirs in zip(record.items, cloud, strict=True):
            mine = item.answers[-1]
            verdict = AGREED if mine.label == theirs.label else CORRECTED
            self.observer.judged(record.family, mine.tier, verdict, 1)
            if verdict == CORRECTED:
                made.append(fpb.Correction(
                    request_id=record.request_id, family=record.family, item=item.index, provisional=mine,
                    cloud=theirs, provisional_unix=record.created_unix, judged_unix=judged_at, router=record.router,
                ))  # fmt: skip
        return made
