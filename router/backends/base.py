"""What the router asks of any target, an agent or the cloud, and what comes back.

The policy reads a target's :class:`~router.policy.Candidate` side (tier, readiness, load,
latency estimates); the cascades and the auditor then ask it through :class:`Backend`,
without knowing which kind it is: no ``if cloud`` branch is left in either.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from router.policy import Candidate
from stratus.convert.tensors import Tensors
from stratus.datatypes import ParameterValue
from stratus.families.generation import Chunk
from stratus.wire import inference_pb2 as pb

# Called with each chunk of a generation as it arrives (on the router's loop; never blocks).
OnChunk = Callable[[Chunk], None]


class Ran(Protocol):
    """How a batch ran, as its answer says: a linked agent's Result, or the in-process tier's run."""

    @property
    def variant(self) -> str: ...

    @property
    def batch_size(self) -> int: ...

    @property
    def service_ms(self) -> float: ...

    @property
    def queue_ms(self) -> float: ...


@dataclass(slots=True)
class RanHere:
    """How a batch ran in this process (router/fleet/in_process.py): no message is built."""

    variant: str
    batch_size: int
    service_ms: float
    queue_ms: float


@dataclass(frozen=True, kw_only=True)
class Classified:
    """A target's answer for some items: one output row and one confidence per item."""

    agent: str  # who answered, as responses name it ("dev-1", "cloud@host:port")
    variant: str
    outputs: Tensors
    confidences: tuple[float, ...]
    said_confidence: bool = True  # False: the target named none (1.0 assumed: a foreign cloud)
    precision: str = ""
    compute: str = ""  # the arithmetic its runtime computed in, where the target says
    queue_ms: float = 0.0  # waiting for the target and inside it, as far as it says
    compute_ms: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Generated:
    """A target's whole generation (its text came as chunks) and what it said of it."""

    agent: str
    variant: str
    said: Mapping[str, ParameterValue | None]  # the final answer's parameters: finish reason, usage
    confidence: float | None  # the target's own, on the tokens it made; None: it named none
    precision: str = ""


class Backend(Candidate, Protocol):
    """A target requests are sent to."""

    async def classify(
        self, items: Tensors, *, model: str, outputs: Sequence[str], request_id: str, budget_ms: float
    ) -> Classified:
        """Run ``items`` (one request's, maybe batched with others) on ``model`` (a family, a
        variant or a line key); ``outputs``: the outputs asked for (empty: all)."""
        ...

    async def generate(self, request: pb.ModelInferRequest, on_chunk: OnChunk, *, budget_ms: float) -> Generated:
        """Generate for a checked prompt request, each chunk to ``on_chunk`` as it comes.
        Cancelling the caller stops the target's generation."""
        ...
