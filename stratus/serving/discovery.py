"""Finding the router on the local network with zeroconf (mDNS/DNS-SD).

The router advertises ``_stratus._tcp.local.``; agents and the SDK started with
``--router auto`` browse for it. Both sides run on the caller's event loop through
zeroconf's asyncio API, with no thread of their own beyond what zeroconf starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from zeroconf import IPVersion, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from stratus import __version__
from stratus.errors import ConfigError, Unavailable

SERVICE_TYPE = "_stratus._tcp.local."
# ``dns:NAME:PORT``, or gRPC's own ``dns:///NAME:PORT``: every address NAME resolves to (a
# Kubernetes headless Service).
DNS_PREFIX = "dns:"


@dataclass(frozen=True)
class DnsTarget:
    """A name to resolve again and again, and the port every address it gives listens on."""

    name: str
    port: int


def dns_target(spec: str, flag: str = "--router") -> DnsTarget | None:
    """``spec`` read as a DNS name, or None when it is not one (``host:port`` lists, ``auto``).

    Both spellings users meet are taken: ``dns:NAME:PORT`` and gRPC's ``dns:///NAME:PORT``
    (what ``--cloud`` and most Kubernetes guides write). ``dns://SERVER/NAME:PORT`` asks gRPC
    for a resolver of its own, which Stratus does not run: refused, as is a missing port, so
    a mistyped name stops the process at start instead of linking to nothing."""
    if not spec.startswith(DNS_PREFIX):
        return None
    rest = spec.removeprefix(DNS_PREFIX)
    if rest.startswith("//") and not rest.startswith("///"):
        raise ConfigError(
            f"{flag} {spec!r}: a DNS server of its own (dns://SERVER/...) is not supported; "
            "give dns:///NAME:PORT, resolved by this machine's resolver"
        )
    name, sep, port = rest.removeprefix("///").rpartition(":")
    if not sep or not name or "/" in name or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{flag} {spec!r} is not dns:///NAME:PORT (or dns:NAME:PORT)")
    return DnsTarget(name.strip("[]"), int(port))


async def resolve_all(name: str, port: int) -> list[str]:
    """Every IPv4/IPv6 address ``name`` resolves to, as ``host:port`` (one per router pod)."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    hosts = sorted({str(info[4][0]) for info in infos})
    return [f"[{h}]:{port}" if ":" in h else f"{h}:{port}" for h in hosts]


async def addresses_of(spec: str) -> list[str]:
    """``host:port[,host:port...]`` as listed, or a DNS spec resolved now."""
    target = dns_target(spec)
    if target is not None:
        return await resolve_all(target.name, target.port)
    return [a.strip() for a in spec.split(",") if a.strip()]


def server_name_of(spec: str) -> str | None:
    """The name a DNS spec's addresses answer to: each is dialled by IP, and its TLS
    certificate is checked against NAME (pod IPs are never known in advance)."""
    target = dns_target(spec)
    return target.name if target is not None else None


def _interfaces(host: str) -> Sequence[str] | None:
    """Loopback stays on loopback; any other host advertises on every interface."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    return [host] if address.is_loopback else None


class Advertisement:
    """The router's zeroconf record, registered until ``close``."""

    def __init__(self, *, name: str, host: str, port: int) -> None:
        self._zeroconf = AsyncZeroconf(interfaces=_interfaces(host) or "all", ip_version=IPVersion.V4Only)
        advertised = (
            host if host not in ("0.0.0.0", "", "[::]") else socket.gethostbyname(socket.gethostname())
        )
        self.info = AsyncServiceInfo(
            SERVICE_TYPE,
            f"{name}.{SERVICE_TYPE}",
            addresses=[socket.inet_aton(advertised)],
            port=port,
            properties={"version": __version__},
        )

    async def start(self) -> None:
        # Registering returns the task that goes on announcing the record for a while.
        self._announcing = asyncio.ensure_future(await self._zeroconf.async_register_service(self.info))

    async def close(self) -> None:
        """Stop announcing, say goodbye, close: no zeroconf task outlives the loop."""
        self._announcing.cancel()
        await asyncio.gather(self._announcing, return_exceptions=True)
        goodbye = await self._zeroconf.async_unregister_service(self.info)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(3.0):
                await goodbye
        await self._zeroconf.async_close()


# How long a look listens after the first router answers: zeroconf's browser asks again about
# a second after its first question, and a router whose first answer was lost or late (a busy
# machine) answers that one. At 0.5 s, such a router waited for the agent's next look.
SETTLE_S: Final = 1.5


async def discover(*, timeout_s: float = 5.0, interface: str | None = "127.0.0.1") -> str:
    """The first router found, as ``host:port``; Unavailable when none answers in time.

    ``interface`` limits the browse to one address (loopback by default, for a router on
    this machine); pass None to browse on every interface.
    """
    return (await discover_all(timeout_s=timeout_s, settle_s=0.0, interface=interface))[0]


async def discover_all(
    *, timeout_s: float = 5.0, settle_s: float = SETTLE_S, interface: str | None = "127.0.0.1"
) -> list[str]:
    """Every router that answers: wait for the first (Unavailable after ``timeout_s``), then
    ``settle_s`` more for the others. Each name seen by then is resolved, at once and each
    within a second: resolving them one after another let a busy machine spend the settle
    window on the first and drop the others (an agent then found a router a look later,
    REDISCOVER_S on)."""
    zeroconf = AsyncZeroconf(interfaces=[interface] if interface else "all", ip_version=IPVersion.V4Only)
    names: asyncio.Queue[str] = asyncio.Queue()

    def on_change(zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change is ServiceStateChange.Added:
            names.put_nowait(name)

    browser = AsyncServiceBrowser(zeroconf.zeroconf, [SERVICE_TYPE], handlers=[on_change])
    resolving: list[asyncio.Task[str | None]] = []
    arrival: asyncio.Task[str] | None = None
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (left := deadline - loop.time()) > 0:
            arrival = arrival or asyncio.create_task(names.get())
            waiting = [arrival, *(task for task in resolving if not task.done())]
            await asyncio.wait(waiting, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if arrival.done():
                resolving.append(asyncio.create_task(_resolve(zeroconf.zeroconf, arrival.result())))
                arrival = None
            if any(task.done() and task.result() for task in resolving):  # one router found: settle
                deadline = min(deadline, loop.time() + settle_s)
        addresses = await asyncio.gather(*resolving)
    finally:
        for task in [*resolving, *([arrival] if arrival is not None else [])]:
            task.cancel()
        await browser.async_cancel()
        await zeroconf.async_close()
    found = list(dict.fromkeys(address for address in addresses if address))
    if not found:
        raise Unavailable(f"no Stratus router answered on {SERVICE_TYPE} within {timeout_s:g} s")
    return found


async def _resolve(zeroconf: Zeroconf, name: str) -> str | None:
    """``host:port`` of a router's advertised name (None: it did not answer within a second)."""
    info = AsyncServiceInfo(SERVICE_TYPE, name)
    if not await info.async_request(zeroconf, 1000):
        return None
    addresses = info.parsed_addresses(IPVersion.V4Only)
    return f"{addresses[0]}:{info.port}" if addresses and info.port else None
