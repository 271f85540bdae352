"""What an audit is and how one is drawn: the audit policy (share, rate, the windows, the
cloud's spare share), the sampler that never passes a family's share or rate, the answers'
comparators, and the queued audit and the top tier's reference answer."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from router.audit.agreement import WINDOW_AUDITS, WINDOW_S, AuditKey
from stratus.convert.tensors import Tensors
from stratus.errors import ConfigError
from stratus.families.audit import EXACT, NUMBER
from stratus.families.suggest import TierAnswer
from stratus.tiers import Tier
from stratus.wire import inference_pb2 as pb

if TYPE_CHECKING:
    from router.cascade.common import Arm


@dataclass(frozen=True, kw_only=True)
class AuditPolicy:
    """The router's audit settings; a family's ``[audit]`` overrides share and max_per_s."""

    share: float = 0.01
    max_per_s: float = 10.0
    queue_limit: int = 256
    workers: int = 2
    # Audits go to the cloud only while fewer than this share of its capacity is in flight.
    cloud_spare: float = 0.25
    timeout_s: float = 5.0
    # An audit that waited longer than this is dropped: it would describe a stale fleet.
    max_wait_s: float = 10.0
    window_audits: int = WINDOW_AUDITS
    window_s: float = WINDOW_S

    def __post_init__(self) -> None:
        if not 0.0 <= self.share <= 1.0 or not 0.0 < self.cloud_spare <= 1.0:
            raise ConfigError("--audit-share and the cloud's spare share lie between 0 and 1")
        if self.max_per_s < 0 or self.queue_limit < 1 or self.workers < 1 or self.timeout_s <= 0:
            raise ConfigError("--audit-max-per-s must not be negative; audits need a queue and a worker")


class TokenBucket:
    """At most ``rate`` takes a second on average, ``max(1, rate)`` at once."""

    def __init__(self, rate: float, clock: Callable[[], float]) -> None:
        self.rate = rate
        self.burst = max(1.0, rate) if rate > 0 else 0.0
        self._tokens = self.burst
        self._clock = clock
        self._at = clock()

    def take(self) -> bool:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True


class Sampler:
    """Which items are audited: each with probability ``share``, and per family no more than
    its bucket lets through (the bucket follows a family's rate when it changes)."""

    def __init__(self, *, rng: random.Random, clock: Callable[[], float]) -> None:
        self._rng = rng
        self._clock = clock
        self._buckets: dict[str, TokenBucket] = {}

    def draw(self, family: str, share: float, max_per_s: float) -> bool:
        if share <= 0.0 or self._rng.random() >= share:
            return False
        bucket = self._buckets.get(family)
        if bucket is None or bucket.rate != max_per_s:
            bucket = self._buckets[family] = TokenBucket(max_per_s, self._clock)
        return bucket.take()


def same_text(lower: str, top: str) -> bool:
    return lower.strip() == top.strip()


def same_number(lower: str, top: str) -> bool:
    """Equal as numbers ("85" and "85.0"); text that is not a number must match exactly."""
    try:
        return math.isclose(float(lower.strip()), float(top.strip()), rel_tol=1e-9, abs_tol=1e-12)
    except ValueError:
        return same_text(lower, top)


COMPARATORS: Final[dict[str, Callable[[str, str], bool]]] = {EXACT: same_text, NUMBER: same_number}


@dataclass(frozen=True)
class WholeAnswer:
    """One tier's whole answer to a prompt, and how sure it was (a generative audit row's part)."""

    tier: Tier
    confidence: float
    text: str


@dataclass(frozen=True, kw_only=True)
class Audit:
    """One lower tier's answer waiting to be asked of the top tier: a classifier's items (with
    the classes the lower tier chose), or a prompt (with the text it gave)."""

    key: AuditKey
    top: Tier
    queued_at: float
    inputs: Tensors | None = None
    output: str = ""
    classes: tuple[int, ...] = ()
    confidences: tuple[float, ...] = ()  # the lower tier's, per item (for capture)
    prompt: pb.ModelInferRequest | None = None
    text: str = ""
    compare: str = EXACT
    # Per item, what each tier it visited said (router/audit/rows.py): a row once the top answers.
    visited: tuple[tuple[TierAnswer, ...], ...] = ()
    # A prompt's whole answers below the top (router/audit/climbs.py), for its row.
    said: tuple[WholeAnswer, ...] = ()
    # Set on a row's job alone: the top tier's text, already given. Nothing is audited then;
    # the missing tiers are asked for the row.
    reference_text: str | None = None
    request_id: str = ""
    # The rollout arm the answer was given for (router.cascade.classify.Arm), where a rollout's
    # step on its tier is judged: its outcome is that arm's evidence too.
    arm: Arm | None = None

    @property
    def items(self) -> int:
        return len(self.classes) if self.inputs is not None else 1


@dataclass(frozen=True, kw_only=True)
class Reference:
    """The top tier's answer to an audit: what is compared, and what capture keeps as the label."""

    variant: str
    agent: str
    confidences: tuple[float, ...]
    classes: tuple[int, ...] = ()
    text: str = ""
