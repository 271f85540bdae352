"""The corrections an SDK client reads from its routers (``Fleet.Corrections``), across them.

A router lost midway is left for the next one the client knows, from the last correction
seen on; none is given twice (the corrections at the boundary of ``since`` are remembered,
at most ``MAX_SEEN``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from edge_agent.sdk_follow import FOLLOW_TIMEOUT_S, UNREACHED
from edge_agent.sdk_routers import Metadata, Routers
from stratus.errors import ConfigError
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc

MAX_SEEN = 10_000  # corrections remembered to give none twice after moving to another router


async def read_corrections(
    routers: Routers, metadata: Metadata, *, family: str | None = None, since_unix: float = 0.0, follow: bool = True
) -> AsyncIterator[fpb.Correction]:
    """The provisional answers the cloud later disagreed with (``stratus.provisional`` answers
    name their ``stratus.request_id``; each correction names it and the item): those judged
    since ``since_unix``, then, with ``follow``, each new one as the router makes it. A router
    lost midway is left for the next one the SDK knows, from the last correction seen on
    (none is given twice). Corrections are kept by the router that answered provisionally."""
    seen: set[tuple[str, int, float]] = set()
    since = since_unix
    while True:
        addresses = await routers.ato_try()
        if not addresses:
            raise ConfigError("no router to read corrections from (the SDK was made with router=None)")
        for address in addresses:
            stub = fpb_grpc.FleetStub(routers.achannel(address))
            request = fpb.CorrectionsRequest(family=family or "", since_unix=since, follow=follow)
            try:
                async for correction in stub.Corrections(request, metadata=metadata or None):
                    key = (correction.request_id, correction.item, correction.judged_unix)
                    if key not in seen:
                        seen.add(key)
                        since = max(since, correction.judged_unix)
                        if len(seen) > MAX_SEEN:  # only those at the boundary can come again
                            seen = {k for k in seen if k[2] >= since}
                        yield correction
                if not follow:
                    return
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in UNREACHED:
                    raise
                routers.failed(address)
        await asyncio.sleep(FOLLOW_TIMEOUT_S)
