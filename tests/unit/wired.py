"""A data plane driven with wire messages, as the servicer drives it: tests that build
protobuf requests and read protobuf answers use this rather than converting at every call."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from stratus.convert.inference import InferRequest, InferResult
from stratus.serving.servicer import DataPlane
from stratus.wire import inference_pb2 as pb


class Wired:
    """``plane`` with ``infer`` and ``generate`` taking and giving protobuf; the rest as is."""

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane

    def __getattr__(self, name: str) -> Any:
        return getattr(self.plane, name)

    async def infer(self, request: pb.ModelInferRequest, *, timeout_s: float | None) -> pb.ModelInferResponse:
        result = await self.plane.infer(InferRequest.from_wire(request), timeout_s=timeout_s)
        return result.to_wire()

    def generate(
        self, request: pb.ModelInferRequest, *, timeout_s: float | None
    ) -> AsyncIterator[pb.ModelInferResponse]:
        """Refuses at once where the plane does (before the first answer is read)."""
        return _wired(self.plane.generate(InferRequest.from_wire(request), timeout_s=timeout_s))


async def _wired(results: AsyncIterator[InferResult]) -> AsyncIterator[pb.ModelInferResponse]:
    async for result in results:
        yield result.to_wire()
