"""What the router captures for the device to learn next (issue 20 §4): ``--capture DIR``.

The auditor (router/audit/auditor.py) already holds, for an audited item and for an item that
climbed to the top tier, its inputs (or its prompt) and every tier's answer. This hook turns
such an item into a :class:`~stratus.obs.capture.CapturedItem` and hands it to the
:class:`~stratus.obs.capture.CaptureWriter`, which writes Parquet on a thread of its own: the hook
never waits on a disk, and an item the writer cannot take is dropped and counted.

Capture is off unless asked for, and then only for the families named (``--capture-families``):
inputs may be sensitive, so a family is never captured by default.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from stratus import datatypes
from stratus.convert.inference import InferRequest
from stratus.convert.tensors import Tensors, top1
from stratus.convert.text import read_generation
from stratus.errors import ConfigError
from stratus.obs.capture import CapturedItem, CaptureLimits, CaptureWriter, TierAnswer
from stratus.obs.metrics import RouterMetrics
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import inference_pb2 as pb

if TYPE_CHECKING:
    from router.audit.climbs import CascadeView
    from router.audit.sampling import Audit, Reference
    from router.cascade.common import Answer
    from router.cascade.generate import Generation

AUDIT: Final = "audit"
ESCALATED: Final = "escalated"
JUDGED: Final = "judged"  # a provisional answer the cloud judged once back (router/offline/judge.py)
UNKNOWN_CONFIDENCE: Final = math.nan  # a top tier that did not say how sure it was
PROMPT_LIMIT: Final = 1 << 20  # read_generation's max_tokens bound; the prompt was checked on arrival


@dataclass(frozen=True, kw_only=True)
class CaptureSettings:
    """``--capture DIR`` with the families it may write (required: capture is opt-in)."""

    folder: Path
    families: frozenset[str]
    limits: CaptureLimits = field(default_factory=CaptureLimits)

    def __post_init__(self) -> None:
        if not self.families:
            raise ConfigError("--capture needs --capture-families F1,F2: inputs may be sensitive, so "
                              "no family is captured unless it is named")  # fmt: skip
        limits = self.limits
        if (
            min(limits.max_file_bytes, limits.max_total_bytes, limits.queue_items) < 1
            or limits.max_file_age_s <= 0
        ):
            raise ConfigError(
                "--capture-max-bytes, --capture-file-bytes and --capture-file-age-s must be positive"
            )


@dataclass(frozen=True, kw_only=True)
class CaptureOptions:
    """``--capture`` and its flags as the router's settings (``[router.capture]`` in a config
    file, ``STRATUS_ROUTER_CAPTURE_*``): checked at once, resolved by :meth:`resolved`."""

    folder: Path | None = None
    families: str = ""  # comma-separated
    max_bytes: int = 1 << 30
    file_bytes: int = 64 << 20
    file_age_s: float = 300.0

    def __post_init__(self) -> None:
        self.resolved()  # a bad combination stops the router before it serves

    def resolved(self) -> CaptureSettings | None:
        names = [name.strip() for name in self.families.split(",") if name.strip()]
        limits = CaptureLimits(
            max_file_bytes=self.file_bytes, max_file_age_s=self.file_age_s, max_total_bytes=self.max_bytes
        )
        return capture_settings(self.folder, names, limits)


def capture_settings(
    folder: Path | None, families: Sequence[str], limits: CaptureLimits
) -> CaptureSettings | None:
    """``--capture`` and its flags: None when off; families are named with it, and only with it."""
    if folder is None:
        if families:
            raise ConfigError("--capture-families needs --capture DIR (the folder to write to)")
        return None
    return CaptureSettings(folder=folder, families=frozenset(families), limits=limits)


class CaptureHook:
    """Builds captured items from what the auditor holds and offers them to the writer."""

    def __init__(self, settings: CaptureSettings, metrics: RouterMetrics | None = None) -> None:
        self.families = settings.families
        self._metrics = metrics
        self.writer = CaptureWriter(settings.folder, settings.limits, on_drop=self._dropped)

    def wants(self, family: str) -> bool:
        return family in self.families

    async def close(self) -> None:
        """Drain: what is queued is written and the open file renamed into sight."""
        await asyncio.to_thread(self.writer.close)

    # -- classifier items ------------------------------------------------------------------
    def audited(self, audit: Audit, reference: Reference) -> None:
        """One row per audited item: the lower tier's answer and the top tier's."""
        assert audit.inputs is not None
        for row, (label, confidence) in enumerate(zip(audit.classes, audit.confidences, strict=True)):
            lower = TierAnswer(tier=audit.key.tier.label, variant=audit.key.variant, agent=audit.key.agent,
                               confidence=confidence, label=label)  # fmt: skip
            top = _top_answer(audit, reference, row)
            inputs = item_arrays(audit.inputs, row)
            self._offer(CapturedItem(family=audit.key.family, source=AUDIT, inputs=inputs, answers=[lower, top],
                                     top=top, request_id=audit.request_id))  # fmt: skip

    def escalated(self, view: CascadeView, top: Tier, output: str) -> None:
        """One row per item that climbed to the top tier: each answer it got on the way."""
        classes = {id(answer): top1(answer.outputs, output) for answer in view.answers}
        for item, path in _climbs(view, top).items():
            rows = [_answer(answer, row, classes[id(answer)]) for answer, row in path]
            if rows[-1].label is None:
                continue
            inputs = item_arrays(view.job.inputs, item)
            self._offer(CapturedItem(family=view.job.family, source=ESCALATED, inputs=inputs, answers=rows,
                                     top=rows[-1], request_id=view.job.id))  # fmt: skip

    def judged(self, record: fpb.DeferredRequest, cloud: Sequence[fpb.ProvisionalAnswer]) -> None:
        """One row per judged item: each answer it got on its way up, and the cloud's (the label)."""
        if not self.wants(record.family):
            return
        inputs = Tensors.from_request(record.inputs)
        for row, (item, theirs) in enumerate(zip(record.items, cloud, strict=True)):
            answers = [_provisional(a) for a in (*item.answers, theirs)]
            self._offer(CapturedItem(family=record.family, source=JUDGED, inputs=item_arrays(inputs, row),
                                     answers=answers, top=answers[-1], request_id=record.request_id))  # fmt: skip

    # -- generative items ------------------------------------------------------------------
    def audited_text(self, audit: Audit, reference: Reference) -> None:
        assert audit.prompt is not None
        key = audit.key
        lower = TierAnswer(tier=key.tier.label, variant=key.variant, agent=key.agent,
                           confidence=audit.confidences[0], text=audit.text)  # fmt: skip
        top = _top_answer(audit, reference, 0)
        self._offer(CapturedItem(family=key.family, source=AUDIT, inputs={}, answers=[lower, top], top=top,
                                 request_id=audit.request_id, prompt=prompt_of(audit.prompt)))  # fmt: skip

    def escalated_text(
        self, family: str, prompt: pb.ModelInferRequest, result: Generation, climbed: Iterable[Generation]
    ) -> None:
        answers = [_generated(g) for g in climbed if g.tier < result.tier and g.finish_reason != "cancelled"]
        if answers:
            top = _generated(result)
            self._offer(CapturedItem(family=family, source=ESCALATED, inputs={}, answers=[*answers, top], top=top,
                                     request_id=prompt.id, prompt=prompt_of(prompt)))  # fmt: skip

    # -- the hand-over -----------------------------------------------------------------------
    def _offer(self, item: CapturedItem) -> None:
        if self.writer.offer(item) and self._metrics is not None:
            self._metrics.captured.labels(item.family, item.source).inc()

    def _dropped(self, family: str, reason: str) -> None:  # on the writer's thread, or in offer
        if self._metrics is not None:
            self._metrics.capture_dropped.labels(family, reason).inc()


def item_arrays(tensors: Tensors, item: int) -> dict[str, np.ndarray[Any, Any]]:
    """One item's tensors, without the batch dimension (as the client sent them)."""
    arrays = {}
    for tensor in tensors.take([item]).tensors:
        dtype = datatypes.numpy_dtype(tensor.datatype)
        arrays[tensor.name] = np.frombuffer(tensor.data, dtype=dtype).reshape(tensor.item_shape)
    return arrays


def prompt_of(request: pb.ModelInferRequest) -> str | None:
    try:
        return read_generation(InferRequest.from_wire(request), request.model_name, PROMPT_LIMIT)[0]
    except Exception:  # checked on arrival; an audit's copy that does not read keeps no prompt
        return None


def _top_answer(audit: Audit, reference: Reference, row: int) -> TierAnswer:
    confidence = reference.confidences[row] if row < len(reference.confidences) else UNKNOWN_CONFIDENCE
    label = reference.classes[row] if reference.classes else None
    text = reference.text if audit.prompt is not None else None
    return TierAnswer(tier=audit.top.label, variant=reference.variant, agent=reference.agent,
                      confidence=confidence, label=label, text=text)  # fmt: skip


def _climbs(view: CascadeView, top: Tier) -> dict[int, list[tuple[Answer, int]]]:
    """Per item that settled on the top tier after a lower answer, each (answer, row) in order."""
    paths: dict[int, list[tuple[Answer, int]]] = {}
    for answer, items in zip(view.answers, view.sent, strict=False):
        for row, item in enumerate(items):
            paths.setdefault(item, []).append((answer, row))
    return {
        item: path
        for item, path in paths.items()
        if len(path) > 1 and view.best[item][0] is path[-1][0] and path[-1][0].tier == top
    }


def _answer(answer: Answer, row: int, classes: np.ndarray[Any, Any] | None) -> TierAnswer:
    label = int(classes[row]) if classes is not None else None
    return TierAnswer(tier=answer.tier.label, variant=answer.variant, agent=answer.agent,
                      confidence=answer.confidences[row], label=label)  # fmt: skip


def _provisional(answer: fpb.ProvisionalAnswer) -> TierAnswer:
    return TierAnswer(tier=answer.tier, variant=answer.variant, agent=answer.agent, confidence=answer.confidence,
                      label=answer.label)  # fmt: skip


def _generated(answer: Generation) -> TierAnswer:
    return TierAnswer(tier=answer.tier.label, variant=answer.variant, agent=answer.agent,
                      confidence=answer.confidence, text=answer.text)  # fmt: skip
