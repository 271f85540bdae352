"""Stratus's own request and response fields, carried in the protocol's ``parameters`` maps.

Requests may carry ``stratus.budget_ms`` (double), ``stratus.min_confidence`` (double),
``stratus.max_tier`` and ``stratus.min_tier`` (string: device, edge or cloud). Responses
carry ``stratus.tier``, ``stratus.agent``, ``stratus.variant`` (the variant that ran, a lower-precision
child where the hardware chose one), ``stratus.precision`` (its FP32, FP16 or INT8),
``stratus.compute_precision`` (the arithmetic its runtime really computed in: ``f32``, ``f16``,
``bf16``, ``int8``, ``int8+f16``; a CPU without FP16 arithmetic may compute FP16 weights in f32),
``stratus.confidence``,
``stratus.path`` (tiers visited, ``device>edge>cloud``), ``stratus.degraded`` and
``stratus.timings_ms`` (per tier, ``device=0.41,edge=0.83``), and ``stratus.item_tiers``
(the tier that answered each item of the batch, in order: ``device,cloud,device``;
``stratus.tier`` is the highest of them), and ``stratus.reason`` where items were answered
below their tier's threshold without climbing (no tier above serves the family: then the
answer is also degraded; or ``stratus.max_tier`` kept them: then it is not). ``stratus.queue_ms``
and ``stratus.compute_ms`` (doubles) say where the request's time went where it was measured: waiting
for a slot (the router's queue for an agent, the agent's or the gateway's own), and running in a
runtime (the batches that held its items), summed over the tiers it ran on; every server's
ModelStatistics adds them up as Triton's ``queue`` and ``compute_infer``. Parameters of the wrong type
are refused by name, since a budget silently ignored is a promise silently broken. A generative
request's conversation (``stratus.messages``) and an answer's ``stratus.chat_template`` are
:mod:`stratus.families.chat`'s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from stratus.datatypes import ParameterValue
from stratus.errors import InvalidInput, NotFound
from stratus.tiers import Tier
from stratus.wire import inference_pb2 as pb

PREFIX = "stratus."
BUDGET_MS = "stratus.budget_ms"
MIN_CONFIDENCE = "stratus.min_confidence"
MAX_TIER = "stratus.max_tier"
MIN_TIER = "stratus.min_tier"
# A bool: the response carries the router's decision record (``stratus.decision``, JSON).
EXPLAIN = "stratus.explain"
KNOWN_REQUEST = (BUDGET_MS, MIN_CONFIDENCE, MAX_TIER, MIN_TIER, EXPLAIN)
# The longest budget a request may ask for: every request holds a router slot, queue places
# and perhaps a cloud slot until it is answered or its budget is spent.
MAX_BUDGET_MS = 600_000.0

TIER = "stratus.tier"
AGENT = "stratus.agent"
VARIANT = "stratus.variant"
PRECISION = "stratus.precision"
COMPUTE_PRECISION = "stratus.compute_precision"
CONFIDENCE = "stratus.confidence"
PATH = "stratus.path"
DEGRADED = "stratus.degraded"
TIMINGS = "stratus.timings_ms"
ITEM_TIERS = "stratus.item_tiers"
REASON = "stratus.reason"
QUEUE_MS = "stratus.queue_ms"
COMPUTE_MS = "stratus.compute_ms"
# Offline-first (router/offline): an answer given while the cloud was away, whose unsure items
# are kept for the cloud to judge, carries ``stratus.provisional`` (bool) and the id its
# correction will name (``stratus.request_id``: the client's request id, else one the router made).
PROVISIONAL = "stratus.provisional"
REQUEST_ID = "stratus.request_id"
# The decision record asked for with ``stratus.explain`` (router/offline/decisions.py), as JSON.
DECISION = "stratus.decision"
# Where models run (an agent's --serve endpoint, the cloud gateway): items in the batch
# this request ran in, its own and those of requests merged with it.
BATCH_SIZE = "stratus.batch_size"

# Every Stratus model has one version: a family's variants are models of their own, by name
# (``digits-large``), not versions of the family. "" asks for the latest, as in Triton.
MODEL_VERSION = "1"
# ModelConfig parameters (string values): the variant a name runs as on a server that runs
# models (``stratus.variant``, as in answers); on a router, a family's variants that may be
# pinned, comma-separated, and the line each tier serves it with by default (a promoted
# rollout's candidate, else its agents' current variant): ``stratus.current.device``.
CONFIG_VARIANTS = "stratus.variants"
CONFIG_CURRENT = "stratus.current."
# ... and each tier's escalation threshold in force there (a fleet-wide push, else the agents'),
# which the SDK judges its own answers by.
CONFIG_THRESHOLD = "stratus.threshold."



def parameter_value(parameter: pb.InferParameter) -> ParameterValue | None:
    choice = parameter.WhichOneof("parameter_choice")
    if choice is None:
        return None
    value: ParameterValue = getattr(parameter, choice)
    return value


def values_of(parameters: Mapping[str, pb.InferParameter]) -> dict[str, ParameterValue | None]:
    """A protobuf parameters map as Python values (None for one sent with no value set)."""
    return {key: parameter_value(value) for key, value in parameters.items()}


# The field each Python type is written to, by exact type: a response carries a dozen
# parameters, and a lookup costs a third of the isinstance chain it saves (issue 37 §3).
_PARAMETER_FIELDS: Final = {bool: "bool_param", int: "int64_param", float: "double_param", str: "string_param"}


def set_parameter(parameters: Mapping[str, pb.InferParameter], key: str, value: ParameterValue) -> None:
    """Write one typed parameter into a protobuf parameters map."""
    field = _PARAMETER_FIELDS.get(type(value))
    if field is None:  # a subclass (numpy's float64 is a float): bool before int, as bool is one
        kind = next((kind for kind in _PARAMETER_FIELDS if isinstance(value, kind)), str)
        field = _PARAMETER_FIELDS[kind]
    setattr(parameters[key], field, value)  # protobuf map: creates the entry


@dataclass(frozen=True, kw_only=True)
class RequestOptions:
    """What a client asked of the router, parsed and checked."""

    budget_ms: float | None = None
    min_confidence: float | None = None
    max_tier: Tier = Tier.CLOUD
    min_tier: Tier = Tier.DEVICE
    explain: bool = False

    def __post_init__(self) -> None:
        """The same bounds whoever builds the options: the router from a request's
        parameters, the SDK from its caller's arguments."""
        budget, confidence = self.budget_ms, self.min_confidence
        if budget is not None and not 0 < budget <= MAX_BUDGET_MS:
            raise InvalidInput(
                f"parameter '{BUDGET_MS}' must lie in (0, {MAX_BUDGET_MS:g}] ms, got {budget:g}"
            )
        if confidence is not None and not 0.0 <= confidence <= 1.0:
            raise InvalidInput(f"parameter '{MIN_CONFIDENCE}' must lie between 0 and 1, got {confidence}")
        if self.min_tier > self.max_tier:
            raise InvalidInput(
                f"'{MIN_TIER}' ({self.min_tier.label}) is above '{MAX_TIER}' ({self.max_tier.label})"
            )

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, pb.InferParameter]) -> RequestOptions:
        return cls.from_values(values_of(parameters))

    @classmethod
    def from_values(cls, parameters: Mapping[str, ParameterValue | None]) -> RequestOptions:
        if not parameters:  # most requests: the defaults, made once (they are frozen)
            return _DEFAULT_OPTIONS
        unknown = [k for k in parameters if k.startswith(PREFIX) and k not in KNOWN_REQUEST]
        if unknown:
            raise InvalidInput(
                f"unknown request parameter(s) {sorted(unknown)}; known: {list(KNOWN_REQUEST)}"
            )
        return cls(
            budget_ms=_number(parameters, BUDGET_MS),
            min_confidence=_number(parameters, MIN_CONFIDENCE),
            max_tier=_tier(parameters, MAX_TIER, Tier.CLOUD),
            min_tier=_tier(parameters, MIN_TIER, Tier.DEVICE),
            explain=_flag(parameters, EXPLAIN),
        )

    def write(self, parameters: Mapping[str, pb.InferParameter]) -> None:
        """The inverse of ``from_parameters``, for clients (the SDK, benchmarks)."""
        if self.budget_ms is not None:
            set_parameter(parameters, BUDGET_MS, float(self.budget_ms))
        if self.min_confidence is not None:
            set_parameter(parameters, MIN_CONFIDENCE, float(self.min_confidence))
        if self.max_tier is not Tier.CLOUD:
            set_parameter(parameters, MAX_TIER, self.max_tier.label)
        if self.min_tier is not Tier.DEVICE:
            set_parameter(parameters, MIN_TIER, self.min_tier.label)
        if self.explain:
            set_parameter(parameters, EXPLAIN, True)


_DEFAULT_OPTIONS: Final = RequestOptions()


def held_reason(max_tier: Tier, items: int, tier: Tier) -> str:
    """``stratus.reason`` when ``stratus.max_tier`` kept unsure items on ``tier`` (not degraded:
    the client asked for it); the router and the SDK say it alike."""
    return f"{MAX_TIER}={max_tier.label}: {items} item(s) below the {tier.label} threshold were not sent higher"


def unanswered_reason(items: int, tier: Tier, why: str) -> str:
    """``stratus.reason`` of an answer degraded because the tiers above failed its unsure items
    (the cloud away, overloaded, too slow for the budget; no router reached, for the SDK): how
    many stayed, where, and the last error met. The router and the SDK say it alike."""
    return f"{items} item(s) below the {tier.label} threshold got no answer from a tier above: {why}"


def _number(parameters: Mapping[str, ParameterValue | None], key: str) -> float | None:
    if key not in parameters:
        return None
    value = parameters[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(f"parameter '{key}' must be a double, got {type(value).__name__}")
    if not math.isfinite(value):
        raise InvalidInput(f"parameter '{key}' must be finite, got {value}")
    return float(value)


def _flag(parameters: Mapping[str, ParameterValue | None], key: str) -> bool:
    if key not in parameters:
        return False
    value = parameters[key]
    if not isinstance(value, bool):
        raise InvalidInput(f"parameter '{key}' must be a bool, got {type(value).__name__}")
    return value


def _tier(parameters: Mapping[str, ParameterValue | None], key: str, default: Tier) -> Tier:
    if key not in parameters:
        return default
    value = parameters[key]
    if not isinstance(value, str):
        raise InvalidInput(f"parameter '{key}' must be a string, got {type(value).__name__}")
    try:
        return Tier.parse(value)
    except InvalidInput as exc:
        raise InvalidInput(f"parameter '{key}': {exc}") from None


@dataclass(frozen=True, kw_only=True)
class Served:
    """How a request was answered: written into the response's parameters."""

    tier: Tier
    agent: str
    variant: str
    confidence: float
    path: Sequence[Tier]
    degraded: bool = False
    timings_ms: Mapping[Tier, float] | None = None
    item_tiers: Sequence[Tier] = ()
    precision: str = ""  # the answering variant's; empty where a foreign server did not say
    compute: str = ""  # the arithmetic its runtime computed in; empty where it is not known
    reason: str = ""  # why unsure items stayed where they were answered; empty when none did
    # Where the time went, where it was measured (None: not, e.g. a foreign cloud's share).
    queue_ms: float | None = None
    compute_ms: float | None = None
    # Answered while the cloud was away, its unsure items kept for the cloud to judge.
    provisional: bool = False
    request_id: str = ""  # written with a provisional answer: what its correction names

    def write(self, parameters: Mapping[str, pb.InferParameter]) -> None:
        for key, value in self.values().items():
            set_parameter(parameters, key, value)

    def values(self) -> dict[str, ParameterValue]:
        """The parameters that say how the request was answered, by key."""
        values: dict[str, ParameterValue] = {
            TIER: self.tier.label,
            AGENT: self.agent,
            VARIANT: self.variant,
        }
        if self.precision:
            values[PRECISION] = self.precision
        if self.compute:
            values[COMPUTE_PRECISION] = self.compute
        values[CONFIDENCE] = float(self.confidence)
        values[PATH] = ">".join(t.label for t in self.path)
        values[DEGRADED] = self.degraded
        if self.timings_ms:
            values[TIMINGS] = ",".join(f"{t.label}={ms:.3f}" for t, ms in self.timings_ms.items())
        if self.item_tiers:
            values[ITEM_TIERS] = ",".join(t.label for t in self.item_tiers)
        if self.reason:
            values[REASON] = self.reason
        for key, ms in ((QUEUE_MS, self.queue_ms), (COMPUTE_MS, self.compute_ms)):
            if ms is not None:
                values[key] = float(ms)
        if self.provisional:
            values[PROVISIONAL] = True
            values[REQUEST_ID] = self.request_id
        return values

    @classmethod
    def read(cls, parameters: Mapping[str, pb.InferParameter]) -> Served:
        """Parse a response's Stratus parameters (clients, tests)."""
        return cls.from_values(values_of(parameters))

    @classmethod
    def from_values(cls, parameters: Mapping[str, ParameterValue | None]) -> Served:
        """As :meth:`read`, from parameters already read (an ``InferResult``'s)."""

        def get(key: str) -> ParameterValue | None:
            return parameters.get(key)

        path = str(get(PATH) or "")
        timings = {}
        for item in str(get(TIMINGS) or "").split(","):
            if "=" in item:
                tier, ms = item.split("=", 1)
                timings[Tier.parse(tier)] = float(ms)
        return cls(
            tier=Tier.parse(str(get(TIER) or "cloud")),
            agent=str(get(AGENT) or ""),
            variant=str(get(VARIANT) or ""),
            confidence=float(get(CONFIDENCE) or 0.0),
            path=tuple(Tier.parse(p) for p in path.split(">") if p),
            degraded=bool(get(DEGRADED)),
            timings_ms=timings,
            item_tiers=tuple(Tier.parse(t) for t in str(get(ITEM_TIERS) or "").split(",") if t),
            precision=str(get(PRECISION) or ""),
            compute=str(get(COMPUTE_PRECISION) or ""),
            reason=str(get(REASON) or ""),
            queue_ms=reported_value(get(QUEUE_MS)),
            compute_ms=reported_value(get(COMPUTE_MS)),
            provisional=get(PROVISIONAL) is True,
            request_id=str(get(REQUEST_ID) or ""),
        )


def reported_ms(parameters: Mapping[str, pb.InferParameter], key: str) -> float | None:
    """A duration another server reported, as :func:`reported_value` reads it."""
    return reported_value(parameter_value(parameters[key]) if key in parameters else None)


def reported_value(value: ParameterValue | None) -> float | None:
    """A reported duration: anything but a number from 0 to the longest budget (no request
    runs longer) is none, so a peer's nonsense never reaches a statistic."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_BUDGET_MS:
        return None
    return float(value)


def check_version(name: str, version: str) -> None:
    """NOT_FOUND for a version other than the one every model has, naming it."""
    if version not in ("", MODEL_VERSION):
        raise NotFound(
            f"model '{name[:128]}' has no version {version[:32]!r}: every model here has one version, "
            f"'{MODEL_VERSION}' (a family's variants are models of their own, by name)"
        )
