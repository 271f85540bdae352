"""The cloud tier as several gateways: one link to each.

One channel to a Kubernetes Service's ClusterIP sticks to one pod for as long as its
connection lives, so the replicas an autoscaler adds get nothing. The pool instead keeps a
:class:`~router.cloud.link.CloudLink` (its own channel, stream and circuit breaker) per gateway.
Each gateway is a backend of the cloud tier (:mod:`router.backends.cloud`), chosen per call by
the routing policy as agents are: the less busy of two drawn at random, within the budget, and
another one after a gateway fails the call. The pool finds the gateways, follows DNS, and sums
them up for status; it chooses nothing.

Where the gateways are comes from ``--cloud``:

* ``HOST:PORT``: one gateway (as before the pool).
* ``A:PORT,B:PORT,...``: a fixed list.
* ``dns:///NAME:PORT`` (or ``dns:NAME:PORT``): every address ``NAME`` resolves to, resolved
  again every ``DNS_REFRESH_S`` (a headless Service lists each ready pod). TLS certificates
  are then checked against ``NAME``, not the pod's address.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from router.cloud.link import UNMEASURED_MS, CloudLink, LinkState
from router.cloud.models import NamedModel
from stratus.convert.work import Reloaded
from stratus.errors import ConfigError, Unavailable
from stratus.families.description import FamilyDescription
from stratus.obs.stats import LatencyWindow
from stratus.serving.discovery import dns_target

log = logging.getLogger("stratus.router.cloud")

DNS_REFRESH_S = 15.0  # how soon a new cloud pod gets traffic, at the latest
DNS_RETRY_S = 1.0  # while a name resolves to nothing

_Value = TypeVar("_Value")
Resolver = Callable[[str, int], Awaitable[list[str]]]


class CloudTier(Protocol):
    """What the data plane and the fleet service use of the cloud: a link or a pool."""

    address: str

    @property
    def available(self) -> bool: ...
    @property
    def server(self) -> str: ...
    @property
    def transport(self) -> str: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def latency(self) -> LatencyWindow: ...
    @property
    def wire_names(self) -> dict[str, str]: ...
    @property
    def variants(self) -> dict[str, str]: ...
    @property
    def models(self) -> dict[str, bool]: ...
    @property
    def generative(self) -> dict[str, FamilyDescription]: ...
    @property
    def described(self) -> dict[str, FamilyDescription]: ...
    @property
    def named(self) -> tuple[NamedModel, ...]: ...
    @property
    def predicted_ms(self) -> float: ...
    @property
    def status(self) -> str: ...
    @property
    def circuit(self) -> str: ...
    @property
    def capacity(self) -> int: ...  # calls it may hold at once (audits measure their room by it)
    def gateways(self) -> Sequence[CloudLink]:
        """Each gateway's link, which the policy chooses among (router.backends.cloud)."""
        ...
    def start(self) -> None: ...
    async def close(self) -> None: ...
    async def reload(self, *, timeout_s: float) -> Reloaded: ...
    async def learn_now(self) -> None: ...


@dataclass(frozen=True, kw_only=True)
class CloudTarget:
    """``--cloud`` read: fixed gateways, or a DNS name to resolve (with its port)."""

    addresses: tuple[str, ...] = ()
    dns_name: str | None = None
    dns_port: int = 0

    @classmethod
    def parse(cls, spec: str) -> CloudTarget:
        spec = spec.strip()
        named = dns_target(spec, "--cloud")
        if named is not None:
            return cls(dns_name=named.name, dns_port=named.port)
        addresses = tuple(part.strip() for part in spec.split(",") if part.strip())
        if not addresses:
            raise ConfigError(f"--cloud {spec!r} names no gateway: give HOST:PORT, a list, or dns:///NAME:PORT")
        for address in addresses:
            _host_port(address, spec)
        return cls(addresses=addresses)


def _host_port(address: str, spec: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--cloud {spec!r}: {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


async def resolve_addresses(name: str, port: int) -> list[str]:
    """Every TCP address ``name`` resolves to now, as ``HOST:PORT`` (IPv6 bracketed)."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    found = {str(info[4][0]) for info in infos}
    return sorted(_joined(host, port) for host in found)


def _joined(host: str, port: int) -> str:
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    return f"{host}:{port}"


class CloudPool:
    """Every cloud gateway ``--cloud`` names, as one cloud tier (see the module's docstring)."""

    def __init__(
        self,
        spec: str,
        make_link: Callable[[str, str | None], CloudLink],
        *,
        resolve: Resolver = resolve_addresses,
        refresh_s: float = DNS_REFRESH_S,
        named: Sequence[NamedModel] = (),
    ) -> None:
        self.address = spec
        self.target = CloudTarget.parse(spec)
        self._make_link = make_link
        self._resolve = resolve
        self._refresh_s = refresh_s
        self._named = tuple(named)
        self.links: dict[str, CloudLink] = {}
        self._retired: list[CloudLink] = []
        self._task: asyncio.Task[None] | None = None
        self._resolved_once = False

    # -- what the rest of the router reads ------------------------------------------------
    @property
    def available(self) -> bool:
        return any(link.available for link in self.links.values())

    @property
    def models(self) -> dict[str, bool]:
        """The models any gateway serves (a model one gateway lacks goes to the others)."""
        served: dict[str, bool] = {}
        for link in self.links.values():
            for name, ok in link.models.items():
                served[name] = served.get(name, False) or ok
        return served

    @property
    def generative(self) -> dict[str, FamilyDescription]:
        return self._merged(lambda link: link.generative)

    @property
    def named(self) -> tuple[NamedModel, ...]:
        """What ``--cloud-models`` named (the same for every gateway)."""
        return self._named

    @property
    def described(self) -> dict[str, FamilyDescription]:
        """Each name the cloud serves, as a gateway that serves it describes it."""
        return self._merged(lambda link: link.described)

    @property
    def predicted_ms(self) -> float:
        """The mean latency of the gateways measured so far (the next call goes to one)."""
        means = [mean for link in self.links.values() if (mean := link.latency.mean_ms)]
        return sum(means) / len(means) if means else UNMEASURED_MS

    @property
    def in_flight(self) -> int:
        return sum(link.in_flight for link in self.links.values())

    @property
    def server(self) -> str:
        """The gateways' servers ("stratus 0.1.0"); several only while a rolling update runs."""
        return ", ".join(sorted({link.server for link in self.links.values() if link.server}))

    @property
    def transport(self) -> str:
        return ", ".join(sorted({link.transport for link in self.links.values() if link.server}))

    @property
    def latency(self) -> LatencyWindow:
        """Every gateway's recent round trips, together (what `fleet status` shows)."""
        return LatencyWindow.merged([link.latency for link in self.links.values()])

    @property
    def wire_names(self) -> dict[str, str]:
        return self._merged(lambda link: link.wire_names)

    @property
    def variants(self) -> dict[str, str]:
        return self._merged(lambda link: link.variants)

    def _merged(self, part: Callable[[CloudLink], dict[str, _Value]]) -> dict[str, _Value]:
        """One mapping from every gateway's (they serve the same folder, bar a rolling update)."""
        merged: dict[str, _Value] = {}
        for link in self.links.values():
            merged.update(part(link))
        return merged

    @property
    def capacity(self) -> int:
        """Calls the gateways that take calls now may hold at once."""
        return sum(link.max_pending for link in self.links.values() if link.available)

    @property
    def status(self) -> str:
        """One gateway: its link's state. Several: ``connected`` when all are, else how many."""
        links = list(self.links.values())
        if not links:
            return "resolving" if not self._resolved_once else f"no gateway behind {self.target.dns_name}"
        if len(links) == 1:
            return links[0].status
        ready = sum(1 for link in links if link.status == LinkState.CONNECTED)
        return LinkState.CONNECTED if ready == len(links) else f"{ready}/{len(links)} gateways connected"

    @property
    def circuit(self) -> str:
        """The best breaker state over the gateways: closed while any gateway takes calls."""
        states = {link.circuit for link in self.links.values()}
        return next((s for s in ("closed", "half-open") if s in states), "open")

    def gateways(self) -> tuple[CloudLink, ...]:
        """Each gateway's link (the retired ones, finishing their calls, take no new ones)."""
        return tuple(self.links.values())

    # -- life -------------------------------------------------------------------------------
    def start(self) -> None:
        if self.target.dns_name is None:
            self._adopt(self.target.addresses)
            self._resolved_once = True
            return
        self._task = asyncio.create_task(self._follow_dns(), name="stratus-cloud-dns")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        links = [*self.links.values(), *self._retired]
        self.links, self._retired = {}, []
        await asyncio.gather(*(link.close() for link in links), return_exceptions=True)

    async def _follow_dns(self) -> None:
        assert self.target.dns_name is not None
        name, port = self.target.dns_name, self.target.dns_port
        failing = False
        while True:
            try:
                addresses = await self._resolve(name, port)
                failing = False
            except OSError as exc:
                if not failing:
                    log.warning("cloud %s: cannot resolve %s (%s); keeping %d gateways", self.address, name, exc,
                                len(self.links))  # fmt: skip
                failing, addresses = True, list(self.links)
            self._adopt(addresses)
            self._resolved_once = True
            await self._close_idle_retired()
            await asyncio.sleep(self._refresh_s if addresses else DNS_RETRY_S)

    def _adopt(self, addresses: Sequence[str]) -> None:
        """Links to gateways that appeared; those that went stop taking calls (and close once
        their calls are done: a pod going away finishes what it holds)."""
        wanted = set(addresses)
        for address in sorted(wanted - set(self.links)):
            link = self._make_link(address, self.target.dns_name)
            self.links[address] = link
            link.start()
            log.info("cloud %s: gateway %s added", self.address, address)
        for address in sorted(set(self.links) - wanted):
            self._retired.append(self.links.pop(address))
            log.info("cloud %s: gateway %s gone; it takes no new calls", self.address, address)

    async def _close_idle_retired(self) -> None:
        idle = [link for link in self._retired if link.in_flight == 0]
        self._retired = [link for link in self._retired if link.in_flight > 0]
        await asyncio.gather(*(link.close() for link in idle), return_exceptions=True)

    # -- reloads ----------------------------------------------------------------------------
    async def reload(self, *, timeout_s: float) -> Reloaded:
        """Every gateway reloads its models folder; ok only if each one did."""
        links = list(self.links.values())
        if not links:
            raise Unavailable(f"cloud {self.address} is {self.status}")
        if len(links) == 1:
            return await links[0].reload(timeout_s=timeout_s)
        tried = await asyncio.gather(*(link.reload(timeout_s=timeout_s) for link in links), return_exceptions=True)
        answers = [answer if isinstance(answer, Reloaded) else Reloaded(ok=False, message=str(answer)) for answer in tried]
        return Reloaded(
            ok=all(answer.ok for answer in answers),
            message="; ".join(f"{link.address}: {answer.message}" for link, answer in zip(links, answers, strict=True)),
            variants=tuple(sorted({v for answer in answers for v in answer.variants})),
        )

    async def learn_now(self) -> None:
        """Learn again from every gateway that is up (one that is down learns when back)."""
        await asyncio.gather(*(link.learn_now() for link in self.links.values() if link.state == LinkState.CONNECTED))
