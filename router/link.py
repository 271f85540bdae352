"""The AgentLink service: one bidirectional stream per agent.

The first message must be a Hello; the router answers Welcome, then writes the agent's
outbox (Work, Cancel, Drain) while a reader task takes Heartbeats, Results and Draining.
Whatever ends the stream (the agent closing it, a broken connection, a malformed
message), the agent is marked lost at once and its pending requests fail over.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator
from typing import Any

from router.registry import AgentHandle, FleetRegistry
from stratus import __version__
from stratus.errors import InvalidInput, Unauthenticated
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc

log = logging.getLogger("stratus.link")


class AgentLinkServicer(fpb_grpc.AgentLinkServicer):
    def __init__(self, registry: FleetRegistry, *, token: str = "") -> None:
        self._registry = registry
        self._token = token

    async def Connect(
        self, request_iterator: AsyncIterator[fpb.AgentMessage], context: Any
    ) -> AsyncIterator[fpb.RouterMessage]:
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("kind") != "hello":
            raise InvalidInput("the first message on an AgentLink must be a Hello")
        _check_hello(first.hello)
        if self._token and not hmac.compare_digest(first.hello.token.encode(), self._token.encode()):
            log.warning(
                "refused agent %r from %s: missing or wrong token", first.hello.agent_id, context.peer()
            )
            raise Unauthenticated("the fleet token is missing or wrong")
        handle = self._registry.register(first.hello, peer=context.peer())
        reader = asyncio.create_task(self._read(handle, request_iterator), name=f"stratus-link-{handle.id}")
        try:
            yield fpb.RouterMessage(
                welcome=fpb.Welcome(
                    agent_id=handle.id,
                    heartbeat_interval_s=self._registry.heartbeat_s,
                    router_version=__version__,
                )
            )
            handle.sent = 1
            while (message := await handle.outbox.get()) is not None:
                yield message
                handle.sent += 1
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            self._registry.lose(handle, "link closed")

    async def _read(self, handle: AgentHandle, messages: AsyncIterator[fpb.AgentMessage]) -> None:
        reason = "link closed by the agent"
        try:
            async for message in messages:
                kind = message.WhichOneof("kind")
                if kind == "heartbeat":
                    self._registry.heartbeat(handle, message.heartbeat)
                elif kind == "result":
                    self._registry.result(handle, message.result)
                elif kind == "draining":
                    self._registry.draining(handle)
                else:
                    reason = f"unexpected {kind or 'empty'} message after Hello"
                    break
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            reason = f"link broke: {type(exc).__name__}: {exc}"
        log.info("agent %s: %s", handle.id, reason)
        self._registry.lose(handle, reason)


def _check_hello(hello: fpb.Hello) -> None:
    if not hello.agent_id:
        raise InvalidInput("Hello.agent_id is empty")
    if hello.tier == fpb.TIER_UNSPECIFIED:
        raise InvalidInput(f"Hello from {hello.agent_id}: tier is unspecified")
    if not hello.variants:
        raise InvalidInput(f"Hello from {hello.agent_id}: no variants")
