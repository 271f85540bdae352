"""The routers an SDK client escalates to, in the order to try them: the last that
answered first, one that failed lately at the back, and with ``auto`` every router zeroconf
finds. Holds one channel per router, for the synchronous and the asyncio paths."""

from __future__ import annotations

import asyncio
import time

import grpc

from stratus.errors import StratusError
from stratus.serving.channels import TlsSettings, open_channel, open_sync_channel, server_options
from stratus.serving.discovery import discover_all

# After a failed attempt to reach the router, answer locally for this long before retrying.
RETRY_ROUTER_AFTER_S = 5.0
Metadata = tuple[tuple[str, str], ...]  # what every call to a router carries (its client token)


class Routers:
    """The routers a client escalates to: the last that answered first, then the others.

    A router that fails a call goes to the back of the line for RETRY_ROUTER_AFTER_S; the
    call goes on to the next (an inference can be asked again), and only when none answers
    does the client return its own answer marked degraded. ``auto`` finds every router
    with zeroconf.
    """

    def __init__(self, router: str | None, *, discover_timeout_s: float, tls: TlsSettings) -> None:
        self.named = router  # as the client was given it: what a failure's message names
        self._auto = router == "auto"
        self._addresses = (
            [] if router in (None, "auto") else [a.strip() for a in router.split(",") if a.strip()]
        )
        self._discover_timeout_s = discover_timeout_s
        self._tls = tls
        self._skip_until: dict[str, float] = {}
        self._looked_until = 0.0
        self._channels: dict[str, grpc.Channel] = {}
        self._achannels: dict[str, grpc.aio.Channel] = {}

    def _ordered(self) -> list[str]:
        """Routers that have not failed lately first, then those that have, oldest failure first:
        a recent failure moves a router back, it never stops it from being tried at all."""
        now = time.monotonic()
        fresh = [a for a in self._addresses if self._skip_until.get(a, 0.0) <= now]
        stale = sorted((a for a in self._addresses if a not in fresh), key=lambda a: self._skip_until[a])
        return fresh + stale

    def fresh(self) -> list[str]:
        """Routers known now that have not failed lately (no look-up, no waiting)."""
        now = time.monotonic()
        return [a for a in self._addresses if self._skip_until.get(a, 0.0) <= now]

    def to_try(self) -> list[str]:
        if self._auto and not self._ordered() and time.monotonic() >= self._looked_until:
            self._found(asyncio.run(self._discover()))
        return self._ordered()

    async def ato_try(self) -> list[str]:
        if self._auto and not self._ordered() and time.monotonic() >= self._looked_until:
            self._found(await self._discover())
        return self._ordered()

    async def _discover(self) -> list[str]:
        try:
            return await discover_all(timeout_s=self._discover_timeout_s)
        except StratusError:
            return []

    def _found(self, addresses: list[str]) -> None:
        self._looked_until = time.monotonic() + RETRY_ROUTER_AFTER_S
        self._addresses = addresses
        self._skip_until.clear()

    def look_again(self) -> None:
        """With ``auto`` and no router found yet, browse again at the next call."""
        if self._auto and not self._addresses:
            self._looked_until = 0.0

    def failed(self, address: str) -> None:
        self._skip_until[address] = time.monotonic() + RETRY_ROUTER_AFTER_S

    def answered(self, address: str) -> None:
        if self._addresses and self._addresses[0] != address:
            self._addresses.remove(address)
            self._addresses.insert(0, address)

    def channel(self, address: str) -> grpc.Channel:
        if address not in self._channels:
            self._channels[address] = open_sync_channel(address, self._tls, server_options("router", self._tls))
        return self._channels[address]

    def achannel(self, address: str) -> grpc.aio.Channel:
        if address not in self._achannels:
            self._achannels[address] = open_channel(address, self._tls, extra_options=server_options("router", self._tls))
        return self._achannels[address]

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    async def aclose(self) -> None:
        for channel in self._achannels.values():
            await channel.close()
        self._achannels.clear()


def status_of(exc: grpc.RpcError) -> tuple[grpc.StatusCode | None, str]:
    """A failed call's code and details: the synchronous and the asyncio errors both have them
    (as methods), though only the first is typed a ``grpc.Call``."""
    code, details = getattr(exc, "code", None), getattr(exc, "details", None)
    return (code() if callable(code) else None), (str(details()) if callable(details) else str(exc))
