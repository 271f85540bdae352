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
from stratus.serving.auth import Revocations, caller_certificate

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


class WrappingInterceptor(grpc.aio.ServerInterceptor):
    """Wraps each method's handler once (:meth:`wrap`) and reuses the wrapper for every later call."""

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
        self._wrapped[method] = self.wrap(method, found)
        return self._wrapped[method]

    def wrap(self, method: str, found: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
        return found


class ErrorInterceptor(WrappingInterceptor):
    """Every StratusError (and any other exception) a handler raises, as its gRPC status."""

    def wrap(self, method: str, found: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
        return self._wrap(found)

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



# Run before an inference call's behaviour: the status and message to refuse it with, or None.
Admit = Callable[[Any], tuple[grpc.StatusCode, str] | None]


def around(
    found: grpc.RpcMethodHandler[Any, Any], admit: Admit, enter: Callable[[], None], leave: Callable[[], None]
) -> grpc.RpcMethodHandler[Any, Any]:
    """``found`` with ``admit`` asked first (a refusal aborts the call before it runs), then
    ``enter`` and, however the call ends, ``leave``: for unary calls and async-generator streams,
    the two kinds the inference service has (any other handler is returned as it was)."""
    handler: Any = found
    codec = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        inner = handler.unary_unary

        async def unary(request: Any, context: Any) -> Any:
            # This frame keeps no reference to the request: an AbortError raised below chains
            # every frame it passes, and a refused 2 MB request would live as long (see above).
            handed = [request]
            del request
            if (refusal := admit(context)) is not None:
                handed.clear()
                await context.abort(*refusal)
            enter()
            try:
                return await inner(handed.pop(), context)
            finally:
                leave()

        return grpc.unary_unary_rpc_method_handler(unary, **codec)
    if handler.stream_stream and inspect.isasyncgenfunction(handler.stream_stream):
        streaming = handler.stream_stream

        async def stream(requests: Any, context: Any) -> AsyncIterator[Any]:
            if (refusal := admit(context)) is not None:
                await context.abort(*refusal)
            enter()
            try:
                async for response in streaming(requests, context):
                    yield response
            finally:
                leave()

        return grpc.stream_stream_rpc_method_handler(stream, **codec)
    return found


class InferenceInterceptor(WrappingInterceptor):
    """Wraps each inference method's handler once (:func:`around`); probes (``exempt``) and
    other services pass through untouched."""

    def __init__(self, *, prefix: str = "/inference.GRPCInferenceService/", exempt: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self._prefix = prefix
        self._exempt = exempt

    def wrap(self, method: str, found: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
        if not method.startswith(self._prefix) or method in self._exempt:
            return found
        return around(found, self.admit, self.enter, self.leave)

    def admit(self, context: Any) -> tuple[grpc.StatusCode, str] | None:
        return None

    def enter(self) -> None:
        pass

    def leave(self) -> None:
        pass


class InferenceShare(InferenceInterceptor):
    """At most ``limit`` calls of the inference service at once, out of the server's whole
    ``maximum_concurrent_rpcs``: the rest are kept for agents' links, operators' Fleet calls,
    liveness and health checks, which inference callers then cannot starve (security2 N1:
    silent streams once took every slot, and ServerLive, health, Status and Hellos were all
    refused). Past it, a new inference call is refused with RESOURCE_EXHAUSTED at once.
    ``exempt`` methods (ServerLive, ServerReady) are probes and are never counted."""

    def __init__(
        self, limit: int, *, prefix: str = "/inference.GRPCInferenceService/", exempt: frozenset[str] = frozenset()
    ) -> None:
        super().__init__(prefix=prefix, exempt=exempt)
        self.limit = limit
        self.held = 0

    def admit(self, context: Any) -> tuple[grpc.StatusCode, str] | None:
        if self.held < self.limit:
            return None
        return grpc.StatusCode.RESOURCE_EXHAUSTED, (
            f"this server runs {self.held} inference calls at once, the most it gives inference "
            "(the rest of its slots are kept for agents, operators and health checks); retry shortly"
        )

    def enter(self) -> None:
        self.held += 1

    def leave(self) -> None:
        self.held -= 1


class CallerRoles(InferenceInterceptor):
    """Under mutual TLS, inference only from callers whose certificate is one of ``roles`` (of
    the fleet's trust domain): the cloud gateway takes escalations from routers (and clients),
    not from any device whose key was stolen (security2 N9)."""

    def __init__(
        self, roles: frozenset[str], *, trust_domain: str = "stratus", exempt: frozenset[str] = frozenset()
    ) -> None:
        super().__init__(exempt=exempt)
        self._roles = roles
        self._trust_domain = trust_domain

    def admit(self, context: Any) -> tuple[grpc.StatusCode, str] | None:
        cert = caller_certificate(context, self._trust_domain)
        if cert is not None and cert.role in self._roles:
            return None
        shown = f"this one is {cert}" if cert else "this one has no Stratus identity of this fleet"
        return grpc.StatusCode.PERMISSION_DENIED, (
            f"inference here needs a {' or '.join(sorted(self._roles))} certificate; {shown}"
        )


class RevokedCallers(InferenceInterceptor):
    """Inference refused to a caller whose certificate is revoked (--revoked-certificates),
    though it chains to the fleet CA (security2 N12)."""

    def __init__(self, revoked: Revocations, *, exempt: frozenset[str] = frozenset()) -> None:
        super().__init__(exempt=exempt)
        self._revoked = revoked

    def admit(self, context: Any) -> tuple[grpc.StatusCode, str] | None:
        try:
            auth_context = context.auth_context() or {}
        except (AttributeError, RuntimeError):
            auth_context = {}
        why = self._revoked.why_revoked(auth_context)
        return None if why is None else (grpc.StatusCode.PERMISSION_DENIED, why)
