"""``dns:NAME:PORT``: every address a name resolves to, one router each."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from stratus.errors import ConfigError
from stratus.serving.discovery import DnsTarget, addresses_of, dns_target, resolve_all, server_name_of


class TwoRouterLoop(asyncio.SelectorEventLoop):
    """A loop whose resolver answers as a Kubernetes headless Service with two pods would:
    one IPv4 and one IPv6 address, each listed twice (once per socket type asked)."""

    asked: list[tuple[str, int]]

    async def getaddrinfo(self, host: Any, port: Any, **kwargs: Any) -> list[Any]:  # type: ignore[override]
        self.asked.append((host, port))
        v4 = (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.7", port))
        v6 = (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::8", port, 0, 0))
        return [v6, v4, v4, v6]


def run_on_two_routers(coroutine: Any) -> tuple[Any, list[tuple[str, int]]]:
    loop = TwoRouterLoop()
    loop.asked = []
    try:
        return loop.run_until_complete(coroutine), loop.asked
    finally:
        loop.close()


def test_resolve_all_gives_each_address_once_ipv6_in_brackets() -> None:
    found, asked = run_on_two_routers(resolve_all("routers.stratus.svc", 7070))
    assert found == ["10.0.0.7:7070", "[fd00::8]:7070"]
    assert asked == [("routers.stratus.svc", 7070)]


def test_a_dns_spec_resolves_now_and_a_list_is_taken_as_listed() -> None:
    found, _ = run_on_two_routers(addresses_of("dns:routers.stratus.svc:7070"))
    assert found == ["10.0.0.7:7070", "[fd00::8]:7070"]
    listed, asked = run_on_two_routers(addresses_of(" a:1, b:2 ,"))
    assert (listed, asked) == (["a:1", "b:2"], [])


@pytest.mark.parametrize(
    ("spec", "name", "port"),
    [
        ("dns:routers.stratus.svc:7070", "routers.stratus.svc", 7070),
        ("dns:///routers.stratus.svc:7070", "routers.stratus.svc", 7070),  # gRPC's spelling
        ("dns:///[fd00::8]:7070", "fd00::8", 7070),
    ],
)
def test_both_dns_spellings_name_the_same_target(spec: str, name: str, port: int) -> None:
    assert dns_target(spec) == DnsTarget(name, port)
    assert server_name_of(spec) == name


def test_gRPCs_spelling_resolves_like_the_short_one() -> None:
    """``dns:///NAME:PORT`` used to be resolved as the name ``///NAME``: nothing, forever."""
    found, asked = run_on_two_routers(addresses_of("dns:///routers.stratus.svc:7070"))
    assert found == ["10.0.0.7:7070", "[fd00::8]:7070"]
    assert asked == [("routers.stratus.svc", 7070)]


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("dns://8.8.8.8/routers:7070", "a DNS server of its own (dns://SERVER/...) is not supported"),
        ("dns:///routers", "is not dns:///NAME:PORT"),
        ("dns:routers:port", "is not dns:///NAME:PORT"),
        ("dns:///:7070", "is not dns:///NAME:PORT"),
        ("dns:///a/b:7070", "is not dns:///NAME:PORT"),
        ("dns:routers:70000", "is not dns:///NAME:PORT"),
    ],
)
def test_a_malformed_dns_spec_is_refused_naming_the_flag(spec: str, says: str) -> None:
    with pytest.raises(ConfigError, match=r"^--cloud ") as refused:
        dns_target(spec, "--cloud")
    assert says in str(refused.value) and repr(spec) in str(refused.value)


@pytest.mark.parametrize("spec", ["auto", "a:1,b:2", "routers:7070"])
def test_a_spec_that_is_not_dns_is_none(spec: str) -> None:
    assert dns_target(spec) is None


def test_one_look_finds_every_advertised_router_when_resolving_each_is_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    """Real zeroconf on loopback: four routers advertised, each name taking 0.6 s to resolve (a
    busy machine). Zeroconf's browser hears most of them at its second question, about a second
    after the first answer: resolved one after another, the settle window ran out before the
    fourth; resolved at once, one look finds all four."""
    from zeroconf.asyncio import AsyncServiceInfo

    from stratus.serving.discovery import Advertisement, discover_all

    resolve = AsyncServiceInfo.async_request

    async def slow(self: AsyncServiceInfo, *args: Any, **kwargs: Any) -> bool:
        await asyncio.sleep(0.6)
        return await resolve(self, *args, **kwargs)

    monkeypatch.setattr(AsyncServiceInfo, "async_request", slow)

    async def look() -> list[str]:
        ads = [Advertisement(name=f"slow-{port}", host="127.0.0.1", port=port) for port in (41001, 41002, 41003, 41004)]
        for ad in ads:
            await ad.start()
        try:
            return await discover_all(timeout_s=10.0)
        finally:
            for ad in ads:
                await ad.close()

    found = asyncio.run(look())
    assert {f"127.0.0.1:{port}" for port in (41001, 41002, 41003, 41004)} <= set(found), found
