"""Offline-first: provisional answers while the cloud is away, judged when it returns.

When a classifier request's climb stops below the cloud because the cloud cannot be reached
(its breaker open, its link down, or no time left in the budget for it), and the family's
files say ``[offline] defer = true``, the request's unsure items are kept (:mod:`.store`)
with what each tier answered them, and the answer goes back *provisional*: still the best
one the site had (degraded, as before), now with ``stratus.provisional = true`` and the
``stratus.request_id`` its correction will name. Once the cloud is back, the judge
(:mod:`.judge`) sends the kept items at the lowest priority and records a correction
(:mod:`.corrections`) for each provisional answer the cloud disagrees with; applications read
them by request id (``stratus fleet corrections``, ``Fleet.Corrections``, the SDK's
``Client.corrections()``). Every request may also leave a decision record (:mod:`.decisions`).

:class:`Offline` is what the router holds of all this: the cascade asks it to :meth:`defer`,
the router starts and stops it with the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from prometheus_client.core import Metric

from router.cloud.pool import CloudTier
from router.offline.corrections import CorrectionLog, CorrectionSink, FileCorrections
from router.offline.decisions import Decision, as_row, decision_schema
from router.offline.judge import Judge, LabelSink
from router.offline.provisional import UnsureClimb, cloud_was_needed, provisional_items, provisional_reason
from router.offline.store import DeferredStore, LocalDeferredStore, new_key
from stratus.families.description import FamilyDescription
from stratus.obs.capture import CaptureLimits, CaptureWriter, RowFormat
from stratus.obs.metrics import Metrics, RouterMetrics, gauge
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import inference_pb2 as pb

log = logging.getLogger("stratus.router.offline")

# Of the cloud's capacity (a link's 256 calls in flight: 2 judging calls at once). Measured with
# benchmarks/offline.py on 2 cores, the live p99 while a backlog was judged rose from 6.5 ms (the
# cloud's return alone) to 8.4 ms at 0.01, 12.5 ms at 0.02 and 25.5 ms at 0.1.
DEFAULT_ADJUDICATE_SHARE: Final = 0.01
KEPT: Final = "kept"


@dataclass(frozen=True, kw_only=True)
class OfflineSettings:
    """The router's side of offline-first (its flags)."""

    state_dir: Path | None = None  # --state-dir: deferred requests and corrections, kept across restarts
    adjudicate_share: float = DEFAULT_ADJUDICATE_SHARE  # --adjudicate-share
    decision_log: Path | None = None  # --decision-log DIR: decision records as Parquet
    decision_log_share: float = 0.0  # --decision-log-share: of the requests not provisional


class OfflineMetrics:
    """What was deferred, judged and dropped (counters of RouterMetrics); the backlog's gauges,
    collected at scrape time."""

    def __init__(
        self,
        metrics: Metrics,
        recorder: RouterMetrics,
        store: DeferredStore,
        describe: Callable[[str], FamilyDescription | None],
    ) -> None:
        self.recorder = recorder
        self._store = store
        self._describe = describe
        metrics.collect_with(self._collect)

    def deferred(self, family: str, outcome: str) -> None:
        self.recorder.deferred.labels(family, outcome).inc()

    def judged(self, family: str, tier: str, verdict: str, items: int) -> None:
        self.recorder.judged.labels(family, tier, verdict).inc(items)

    def deferred_dropped(self, family: str, reason: str, items: int) -> None:
        self.recorder.deferred_dropped.labels(family, reason).inc(items)

    def _collect(self) -> Iterable[Metric]:
        now = time.time()
        backlog = self._store.outstanding()
        yield gauge("stratus_router_deferred_items", "Deferred items waiting for the cloud to judge them.",
                    ["family"], [([f], items) for f, (items, _) in backlog.items()])  # fmt: skip
        yield gauge("stratus_router_deferred_oldest_age_seconds", "Age of the oldest deferred item not judged yet.",
                    ["family"], [([f], now - oldest) for f, (_, oldest) in backlog.items() if oldest is not None])  # fmt: skip
        bounds = [(f, self._describe(f)) for f in backlog]
        yield gauge("stratus_router_deferred_max_age_seconds", "The family's [offline] max_age_s: older items expire.",
                    ["family"], [([f], i.offline.max_age_s) for f, i in bounds if i is not None])  # fmt: skip


class _NoMetrics:
    def judged(self, family: str, tier: str, verdict: str, items: int) -> None:
        pass

    def deferred_dropped(self, family: str, reason: str, items: int) -> None:
        pass


class Offline:
    """The deferred store, the corrections, the judge and the decision log of one router."""

    def __init__(
        self,
        settings: OfflineSettings,
        *,
        router: str,
        cloud: Callable[[], CloudTier | None],
        describe: Callable[[str], FamilyDescription | None],
        metrics: tuple[Metrics, RouterMetrics] | None = None,
        labels: LabelSink | None = None,
        store: DeferredStore | None = None,
        sink: CorrectionSink | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings
        self.router = router
        state = settings.state_dir
        if store is None and state is None:
            raise ValueError("deferred requests need --state-dir (or a site store) to be kept in")
        self.store = store or LocalDeferredStore(state / "deferred")  # type: ignore[operator]
        self.corrections = CorrectionLog(
            sink or (FileCorrections(state / "corrections.jsonl") if state else None)
        )
        self.metrics = OfflineMetrics(*metrics, self.store, describe) if metrics is not None else None
        observer = self.metrics or _NoMetrics()
        self.judge = Judge(self.store, self.corrections, cloud=cloud, describe=describe,
                           share=settings.adjudicate_share, observer=observer, labels=labels)  # fmt: skip
        self._describe = describe
        self._rng = rng or random.Random()
        self._task: asyncio.Task[None] | None = None
        self.decisions: CaptureWriter | None = None
        if settings.decision_log is not None:
            rows = RowFormat(prefix="decisions", schema=decision_schema, row=as_row)
            self.decisions = CaptureWriter(settings.decision_log, CaptureLimits(), rows=rows)

    async def start(self) -> None:
        await self.store.start()
        await self.corrections.start()
        self._task = asyncio.create_task(self.judge.run(), name="stratus-judge-loop")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.judge.close()
        await self.corrections.close()
        await self.store.close()
        if self.decisions is not None:
            await asyncio.to_thread(self.decisions.close)

    def defers(self, family: str) -> FamilyDescription | None:
        """The family's description when its files ask for deferral."""
        info = self._describe(family)
        return info if info is not None and info.offline.defer and info.escalate else None

    async def defer_unsure(self, climb: UnsureClimb, cloud: CloudTier | None) -> tuple[str, bool, str] | None:
        """Keep a climb's unsure items for the cloud to judge, where it stopped below a cloud that
        could not answer and the family asks for it ([offline] defer): (the request id the
        answer names, whether it is provisional, its stratus.reason); None: not for deferral."""
        job = climb.job
        info = self.defers(job.family)
        if (
            info is None
            or job.pinned is not None
            or not info.outputs
            or not cloud_was_needed(cloud, job.model, climb.state)
        ):
            return None
        items = provisional_items(climb.answers, climb.sent, climb.pending, info.outputs[0].name)
        if not items:
            return None
        request_id = job.id or made_request_id()
        inputs = pb.ModelInferRequest(model_name=job.model, id=request_id)
        job.inputs.take([item.index for item in items]).write_request(inputs)
        refused = await self.defer(info, request_id=request_id, model=job.model, inputs=inputs, items=items)
        tier = max(climb.path, default=Tier.DEVICE)
        status = cloud.status if cloud is not None else "none"
        reason = provisional_reason(status, len(items), tier, request_id=request_id, refused=refused)
        return request_id, refused is None, reason

    async def defer(
        self,
        info: FamilyDescription,
        *,
        request_id: str,
        model: str,
        inputs: pb.ModelInferRequest,
        items: Sequence[fpb.DeferredItem],
    ) -> str | None:
        """Keep a request's unsure items for the cloud to judge: None once kept durably, else why not."""
        created = time.time()
        record = fpb.DeferredRequest(key=new_key(created), request_id=request_id, family=info.name, model=model,
                                     created_unix=created, router=self.router, inputs=inputs, items=items)  # fmt: skip
        refused = await self.store.keep(record, info.offline)
        if self.metrics is not None:
            self.metrics.deferred(info.name, refused or KEPT)
        if refused is None:
            self.judge.wake()
        return refused

    def log_decision(self, *, provisional: bool, record: Callable[[], Decision]) -> None:
        """Every provisional request's record, and the share asked for of the rest; a record is
        built only once it is to be written."""
        if self.decisions is None:
            return
        if provisional or self._rng.random() < self.settings.decision_log_share:
            self.decisions.offer(record())


def made_request_id() -> str:
    """A request id for a provisional answer whose client sent none."""
    return f"stratus-{uuid.uuid4().hex}"
