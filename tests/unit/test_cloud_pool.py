"""The cloud tier as several gateways: reading --cloud, each gateway a backend the policy
chooses among (two random choices, passing over one down or failed), DNS changes."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from router.backends.cloud import gateway_backends
from router.cloud.link import CloudLink
from router.cloud.pool import CloudPool, CloudTarget, resolve_addresses
from router.policy import Attempt, FleetSnapshot, NoTarget, choose
from stratus.errors import ConfigError
from stratus.tiers import Tier


class CannedLink(CloudLink):
    """A link that connects at once, serving digits (no gateway behind it)."""

    def __init__(self, address: str, server_name: str | None = None) -> None:
        super().__init__(address, server_name=server_name)
        self.server_name = server_name
        self.busy = 0  # calls it pretends to hold besides the ones made here
        self.closed = False

    @property
    def in_flight(self) -> int:
        return self.busy

    def start(self) -> None:
        self.state = "connected"
        self.models = {"digits": True}

    async def close(self) -> None:
        self.closed = True


def pool_of(spec: str, **kwargs: object) -> tuple[CloudPool, dict[str, CannedLink]]:
    made: dict[str, CannedLink] = {}

    def make(address: str, server_name: str | None) -> CloudLink:
        made[address] = CannedLink(address, server_name)
        return made[address]

    return CloudPool(spec, make, **kwargs), made  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spec", "addresses", "name", "port"),
    [
        ("cloud:8002", ("cloud:8002",), None, 0),
        ("a:1, b:2,c:3", ("a:1", "b:2", "c:3"), None, 0),
        ("dns:///stratus-cloud.site.svc:8002", (), "stratus-cloud.site.svc", 8002),
        ("dns:stratus-cloud:8002", (), "stratus-cloud", 8002),
        ("[::1]:8002", ("[::1]:8002",), None, 0),
    ],
)
def test_cloud_spec_is_read(spec: str, addresses: tuple[str, ...], name: str | None, port: int) -> None:
    target = CloudTarget.parse(spec)
    assert (target.addresses, target.dns_name, target.dns_port) == (addresses, name, port)


@pytest.mark.parametrize("spec", ["", ",", "cloud", "cloud:port", "a:1,b", "dns:///cloud", "cloud:70000"])
def test_a_bad_cloud_spec_is_a_config_error(spec: str) -> None:
    with pytest.raises(ConfigError, match="--cloud"):
        CloudTarget.parse(spec)


def choice(pool: CloudPool, rng: random.Random, *, exclude: frozenset[str] = frozenset()) -> str | NoTarget:
    """The gateway the routing policy sends a 'digits' escalation to (by address), or why none."""
    snapshot = FleetSnapshot(pools={Tier.CLOUD: gateway_backends(pool, "digits")}, tiers=frozenset({Tier.CLOUD}))
    target = choose(Attempt(model="digits", remaining_ms=None, exclude=exclude), snapshot, rng)
    return target if isinstance(target, NoTarget) else target.candidate.link.address


def test_sequential_calls_spread_evenly_over_the_gateways() -> None:
    pool, _ = pool_of("a:1,b:2,c:3")
    pool.start()
    rng = random.Random(7)
    spread = Counter(choice(pool, rng) for _ in range(600))
    assert set(spread) == {"a:1", "b:2", "c:3"}
    assert all(120 <= n <= 280 for n in spread.values()), spread  # 200 each on average


def test_the_less_busy_of_two_is_chosen() -> None:
    pool, links = pool_of("a:1,b:2")
    pool.start()
    links["a:1"].busy = 5
    rng = random.Random(7)
    assert {choice(pool, rng) for _ in range(50)} == {"b:2"}


def test_a_gateway_that_lacks_the_model_or_is_down_is_passed_over() -> None:
    pool, links = pool_of("a:1,b:2,c:3")
    pool.start()
    links["a:1"].models = {"other": True}
    links["b:2"].state = "down"
    rng = random.Random(7)
    assert {choice(pool, rng) for _ in range(50)} == {"c:3"}
    links["c:3"].state = "down"  # up, a:1 lacks the model: it is not asked (it would say NOT_FOUND)
    none = choice(pool, rng)
    assert isinstance(none, NoTarget) and "cloud tier serving 'digits' is not ready now" in none.reason


def test_a_gateway_that_failed_a_call_is_passed_over_for_the_rest_of_its_climb() -> None:
    pool, _ = pool_of("a:1,b:2")
    pool.start()
    rng = random.Random(7)
    assert {choice(pool, rng, exclude=frozenset({"cloud@a:1"})) for _ in range(20)} == {"b:2"}
    none = choice(pool, rng, exclude=frozenset({"cloud@a:1", "cloud@b:2"}))
    assert isinstance(none, NoTarget) and "nothing in the fleet" in none.reason


def test_each_gateway_is_one_backend_for_as_long_as_its_link_lives() -> None:
    pool, links = pool_of("a:1,b:2")
    pool.start()
    first = gateway_backends(pool, "digits")
    assert [b.id for b in first] == ["cloud@a:1", "cloud@b:2"]
    assert all(a is b for a, b in zip(first, gateway_backends(pool, "digits"), strict=True))  # none built per request
    links["b:2"].models = {}
    assert [b.id for b in gateway_backends(pool, "digits")] == ["cloud@a:1"]


def test_status_and_circuit_summarise_the_gateways() -> None:
    pool, links = pool_of("a:1,b:2,c:3")
    pool.start()
    assert pool.status == "connected" and pool.circuit == "closed"
    links["b:2"].state = "down"
    assert pool.status == "2/3 gateways connected" and pool.circuit == "closed"
    links["a:1"].state = links["c:3"].state = "down"
    assert pool.circuit == "open" and not pool.available
    single, _ = pool_of("a:1")
    single.start()
    assert single.status == "connected"


def test_dns_adds_new_gateways_and_retires_gone_ones() -> None:
    later = ["10.0.0.2:8002", "10.0.0.3:8002"]
    answers: list[list[str] | OSError] = [["10.0.0.1:8002", "10.0.0.2:8002"], later, OSError("no DNS")]

    async def resolve(name: str, port: int) -> list[str]:
        assert (name, port) == ("cloud.svc", 8002)
        answer = answers.pop(0) if answers else later
        if isinstance(answer, OSError):
            raise answer
        return answer

    pool, links = pool_of("dns:///cloud.svc:8002", resolve=resolve, refresh_s=0.01)

    async def scenario() -> tuple[list[str], list[str]]:
        pool.start()
        await asyncio.sleep(0.1)  # several refreshes, the failing one among them
        now = sorted(pool.links)
        await pool.close()
        return now, sorted(a for a, link in links.items() if link.closed)

    now, closed = asyncio.run(scenario())
    assert now == ["10.0.0.2:8002", "10.0.0.3:8002"]  # a failed lookup kept what it had
    assert sorted(links) == ["10.0.0.1:8002", "10.0.0.2:8002", "10.0.0.3:8002"]
    assert all(link.server_name == "cloud.svc" for link in links.values())  # TLS checks the name
    assert closed == sorted(links)  # the retired one closed when idle, the rest at close()


def test_a_real_name_resolves_to_its_addresses() -> None:
    found = asyncio.run(resolve_addresses("localhost", 8002))
    assert "127.0.0.1:8002" in found
    assert all(a.endswith(":8002") for a in found)
