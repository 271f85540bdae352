"""A rollout's plan: the record every router of a site follows (family, tier, candidate, steps,
margins, state, history), bounded wherever it comes from (an operator, the site's store), and
its JSON. How a plan is applied, judged and changed is :mod:`router.rollout.plans`'s."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final

from router.rollout.judge import Margins
from stratus.errors import ConfigError, InvalidInput
from stratus.tiers import Tier

RUNNING: Final = "running"
COMPLETE: Final = "complete"
PROMOTED: Final = "promoted"
ROLLED_BACK: Final = "rolled_back"
ABORTED: Final = "aborted"
STATES: Final = (RUNNING, COMPLETE, PROMOTED, ROLLED_BACK, ABORTED)
DEFAULT_STEPS: Final = (5.0, 25.0, 50.0, 100.0)
# Audits of each arm a step waits for: enough that 20 points of agreement lost show at once.
DEFAULT_MIN_AUDITS: Final = 50
MAX_MIN_AUDITS: Final = 100_000
# Bounds on a rollout record, wherever it comes from (an operator, the site's store).
MAX_STEPS: Final = 20
MAX_HISTORY: Final = 50
MAX_TEXT: Final = 1000
MAX_REVISION: Final = 2**53  # a revision past it could never be followed by a higher one exactly


@dataclass(frozen=True, kw_only=True)
class Plan:
    """One rollout's persisted state: what it is, where it stands, and why."""

    family: str
    tier: Tier
    candidate: str
    steps: tuple[float, ...] = DEFAULT_STEPS
    min_requests: int = 100
    min_audits: int = DEFAULT_MIN_AUDITS  # of each arm per step, where a tier above audits it
    shadow: float = 0.0  # percent of the current variant's requests mirrored to the candidate
    margins: Margins = field(default_factory=Margins)
    state: str = RUNNING
    step: int = 0
    reason: str = "started"
    revision: int = 1
    updated: float = 0.0  # unix time of the last change, where it was made
    origin: str = ""  # the router that made the last change
    history: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        """Every record, whether an operator's or the site's store's, is checked as a new
        rollout is: a bad one (``step`` past its steps, a 15 MiB history) used to make every
        request of the family fail INTERNAL, and spread to the other routers."""
        check_steps(self.steps)
        if not 0 <= self.step < len(self.steps):
            raise InvalidInput(f"rollout step {self.step} is outside its {len(self.steps)} steps")
        if self.tier is Tier.CLOUD:
            raise InvalidInput("the cloud tier has no rollouts")
        if self.min_requests < 1 or not 0 <= self.shadow <= 100:
            raise InvalidInput("min_requests must be at least 1 and shadow a percent between 0 and 100")
        if not 0 <= self.min_audits <= MAX_MIN_AUDITS:
            raise InvalidInput(f"min_audits must lie between 0 and {MAX_MIN_AUDITS}")
        if not 1 <= self.revision <= MAX_REVISION or len(self.history) > MAX_HISTORY:
            raise InvalidInput(
                f"rollout revision {self.revision} or history of {len(self.history)} is out of bounds"
            )
        texts = (self.family, self.candidate, self.origin, self.reason, *self.history)
        if any(len(text) > MAX_TEXT for text in texts):
            raise InvalidInput(f"a rollout record's names and reasons are at most {MAX_TEXT} characters")

    @property
    def key(self) -> tuple[str, Tier]:
        return (self.family, self.tier)

    @property
    def share(self) -> float:
        """Percent of the tier's requests for the family that go to the candidate now."""
        if self.state in (RUNNING, COMPLETE):
            return self.steps[self.step]
        return 100.0 if self.state == PROMOTED else 0.0

    @property
    def judging(self) -> bool:
        return self.state == RUNNING and self.step < len(self.steps) - 1

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["tier"] = self.tier.label
        data["steps"] = list(self.steps)
        data["history"] = list(self.history)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        try:
            return cls(
                family=str(data["family"]),
                tier=Tier.parse(str(data["tier"])),
                candidate=str(data["candidate"]),
                steps=tuple(float(s) for s in data["steps"]),
                min_requests=int(data["min_requests"]),
                min_audits=int(data.get("min_audits", DEFAULT_MIN_AUDITS)),
                shadow=float(data.get("shadow", 0.0)),
                margins=Margins(**data.get("margins", {})),
                state=_state(str(data["state"])),
                step=int(data["step"]),
                reason=str(data.get("reason", "")),
                revision=int(data["revision"]),
                updated=float(data.get("updated", 0.0)),
                origin=str(data.get("origin", "")),
                history=tuple(str(h) for h in data.get("history", ())),
            )
        except (KeyError, TypeError, ValueError, InvalidInput) as exc:
            raise ConfigError(f"a rollout record is malformed: {type(exc).__name__}: {exc}") from None


def _state(text: str) -> str:
    if text not in STATES:
        raise ValueError(f"unknown rollout state '{text}'")
    return text


def check_steps(steps: Sequence[float]) -> tuple[float, ...]:
    """Shares in percent, rising, each in (0, 100], at most MAX_STEPS of them."""
    values = tuple(float(s) for s in steps)
    if not values or len(values) > MAX_STEPS:
        raise InvalidInput(f"a rollout needs 1 to {MAX_STEPS} steps, not {len(values)}")
    if any(not 0 < s <= 100 for s in values) or list(values) != sorted(set(values)):
        raise InvalidInput(f"steps {list(values)} must rise strictly, each above 0 and at most 100")
    return values
