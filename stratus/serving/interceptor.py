"""Where Stratus errors become gRPC statuses: one interceptor for every server.

Servicers raise :mod:`stratus.errors`; this interceptor turns each into the status it
names, with its message (:mod:`stratus.convert.errors` converts errors for every wire).
Anything else is a bug: it is logged with its traceback and the peer gets INTERNAL naming
the exception, and the server keeps serving everyone else.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from stratus.convert.errors import status_of
from stratus.errors import StratusError

__all__ = ["ErrorInterceptor"]

log = logging.getLogger("stratus.status")


def _status_of(exc: Exception) -> tuple[grpc.StatusCode, str]:
    code, message = status_of(exc)
    if isinstance(exc, StratusError):
        return code, message
    log.exception("unexpected error serving a call")
    return code, f"internal error: {message}"


# Each wrapper aborts after its ``except`` block, with the request dropped: an abort raised
# while the error is handled chains the error, its traceback and every frame it holds (the
# parsed request among them) to the AbortError gRPC keeps in a reference cycle, so a refused
# 2 MB request stayed in memory until the next garbage collection (32 MB of RSS each).


def _wrap_unary(inner: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        try:
            return await inner(request, context)
        except (grpc.aio.AbortError, grpc.aio.UsageError):
            raise
        except Exception as exc:
            code, message = _status_of(exc)
        del request
        await context.abort(code, message)

    return unary


def _wrap_stream(inner: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    async def stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        try:
            async for item in inner(request, context):
                yield item
            return
        except (grpc.aio.AbortError, grpc.aio.UsageError):
            raise
        except Exception as exc:
            code, message = _status_of(exc)
        del request
        await context.abort(code, message)

    return stream


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Wraps each method's handler once and reuses the wrapper for every later call."""

    def __init__(self) -> None:
        self._wrapped: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method = handler_call_details.method
        if method in self._wrapped:
            return self._wrapped[method]
        found = await continuation(handler_call_details)
        if found is None:
            return None
        self._wrapped[method] = self._wrap(found)
        return self._wrapped[method]

    @staticmethod
    def _wrap(found: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
        handler: Any = found
        codec = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_wrap_unary(handler.unary_unary), **codec)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(_wrap_unary(handler.stream_unary), **codec)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(_wrap_streaming(handler.unary_stream), **codec)
        return grpc.stream_stream_rpc_method_handler(_wrap_streaming(handler.stream_stream), **codec)


def _wrap_streaming(inner: Callable[..., Any]) -> Callable[..., Any]:
    """A streaming handler is an async generator, or a coroutine that writes through its
    context (as grpc.health.v1's Watch is): wrap each as what it is."""
    return _wrap_stream(inner) if inspect.isasyncgenfunction(inner) else _wrap_unary(inner)


class InferenceShare(grpc.aio.ServerInterceptor):
    """At most ``limit`` calls of the inference service at once, out of the server's whole
    ``maximum_concurrent_rpcs``: the rest are kept for agents' links, operators' Fleet calls,
    liveness and health checks, which inference callers then cannot starve (security2 N1:
    silent streams once took every slot, and ServerLive, health, Status and Hellos were all
    refused). Past it, a new inference call is refused with RESOURCE_EXHAUSTED at once.
    ``exempt`` methods (ServerLive, ServerReady) are probes and are never counted."""

    def __init__(
        self, limit: int, *, prefix: str = "/inference.GRPCInferenceService/", exempt: frozenset[str] = frozenset()
    ) -> None:
        self.limit = limit
        self.held = 0
        self._prefix = prefix
        self._exempt = exempt
        self._wrapped: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method = handler_call_details.method
        if method in self._wrapped:
            return self._wrapped[method]
        found = await continuation(handler_call_details)
        if found is None or not method.startswith(self._prefix) or method in self._exempt:
            return found
        self._wrapped[method] = self._counted(found)
        return self._wrapped[method]

    def _full(self) -> str | None:
        if self.held < self.limit:
            return None
        return (
            f"this server runs {self.held} inference calls at once, the most it gives inference "
            "(the rest of its slots are kept for agents, operators and health checks); retry shortly"
        )

    def _counted(self, found: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
        handler: Any = found
        codec = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary(request: Any, context: Any) -> Any:
                if (full := self._full()) is not None:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, full)
                self.held += 1
                try:
                    return await inner(request, context)
                finally:
                    self.held -= 1

            return grpc.unary_unary_rpc_method_handler(unary, **codec)
        if handler.stream_stream and inspect.isasyncgenfunction(handler.stream_stream):
            streaming = handler.stream_stream

            async def stream(requests: Any, context: Any) -> AsyncIterator[Any]:
                if (full := self._full()) is not None:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, full)
                self.held += 1
                try:
                    async for response in streaming(requests, context):
                        yield response
                finally:
                    self.held -= 1

            return grpc.stream_stream_rpc_method_handler(stream, **codec)
        return found  # the inference service has no other kinds of method
