"""The site state store of a lone router (``file:PATH``), its lease, and how a URL opens a store.

The contract's own tests (tests/site_contract.py) run here against the file; NATS runs the
same ones in tests/integration/test_site_store.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from router.site import Entry, SiteState, StoreUnavailable
from router.site import file as site_file
from router.site.file import FileSiteState
from router.site.lease import Lease, LeaseRecord
from router.site.nats_config import credentials_of, servers_of
from router.site.open import open_site_state
from stratus.errors import ConfigError
from tests.site_contract import SiteStateContract


class TestFileContract(SiteStateContract):
    @pytest.fixture(autouse=True)
    def _place(self, tmp_path: Path) -> None:
        self.path = tmp_path / "site.json"

    def make(self) -> SiteState:
        return FileSiteState(self.path, history=self.HISTORY)


async def _opened(path: Path) -> FileSiteState:
    store = FileSiteState(path)
    await store.start()
    return store


def test_the_file_is_whole_after_each_change_and_no_scratch_file_is_left(tmp_path: Path) -> None:
    path = tmp_path / "site.json"

    async def main() -> None:
        store = await _opened(path)
        try:
            first = await store.put("rollout.a", b"\x00\xffbinary")
            assert json.loads(path.read_text())["revision"] == first.revision
            await store.delete("rollout.a")
            document = json.loads(path.read_text())
            assert [row["deleted"] for row in document["keys"]["rollout.a"]] == [False, True]
        finally:
            await store.close()

    asyncio.run(main())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site.json"]


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"{not json",
        b'{"format": 2, "revision": 1, "keys": {}}',
        b'{"format": 1, "revision": 1, "keys": {"bad key": []}}',
        # a revision above the store's counter: revisions would repeat after a restart
        b'{"format": 1, "revision": 1, "keys": {"a": [{"revision": 5, "at": 1.0, "deleted": false, "value": ""}]}}',
        b'{"format": 1, "revision": 9, "keys": {"a": [{"revision": 5, "at": 1.0, "deleted": false, "value": "!"}]}}',
    ],
)
def test_a_file_that_cannot_be_read_back_is_refused_by_name_and_left_as_it_is(
    tmp_path: Path, content: bytes
) -> None:
    path = tmp_path / "site.json"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=str(path)):
        asyncio.run(_opened(path))
    assert path.read_bytes() == content


def test_a_missing_folder_is_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        asyncio.run(_opened(tmp_path / "nowhere" / "site.json"))


def test_a_write_that_fails_changes_nothing_and_names_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "site.json"

    def full(target: Path, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    async def main() -> None:
        store = await _opened(path)
        try:
            kept = await store.put("rollout.a", b"1")
            monkeypatch.setattr(site_file, "write_atomically", full)
            with pytest.raises(StoreUnavailable, match=f"file:{path}.*No space left.*the put of rollout.a"):
                await store.put("rollout.a", b"2", expected=kept.revision)
            assert await store.get("rollout.a") == kept
            monkeypatch.undo()
            after = await store.put("rollout.a", b"2", expected=kept.revision)
            assert after.revision == kept.revision + 1  # the failed one took no revision
        finally:
            await store.close()

    asyncio.run(main())


def test_a_store_not_started_or_closed_refuses_naming_itself(tmp_path: Path) -> None:
    async def main() -> None:
        store = FileSiteState(tmp_path / "site.json")
        with pytest.raises(StoreUnavailable, match="not open"):
            await store.get("a")
        await store.start()
        assert store.connected and "0 live keys" in store.describe()
        await store.close()
        assert not store.connected
        with pytest.raises(StoreUnavailable, match=f"file:{tmp_path}"):
            await store.put("a", b"x")

    asyncio.run(main())


# -- opening a store by URL --------------------------------------------------------------


def test_a_url_opens_its_kind_of_store(tmp_path: Path) -> None:
    assert isinstance(open_site_state(f"file:{tmp_path}/s.json"), FileSiteState)
    assert open_site_state(f"file://{tmp_path}/s.json").path == tmp_path / "s.json"  # type: ignore[attr-defined]
    from router.site.nats import NatsSiteState

    nats = open_site_state("nats://10.0.0.1:4222,10.0.0.2")
    assert isinstance(nats, NatsSiteState) and not nats.connected and "unreachable" in nats.describe()


@pytest.mark.parametrize("url", ["redis://admin:hunter2@db:6379", "nats:/x", "etcd://h:2379", "", "hunter2"])
def test_any_other_url_is_refused_with_the_two_forms_and_no_secret(url: str) -> None:
    with pytest.raises(ConfigError, match=r"file:PATH.*nats://HOST:PORT") as refused:
        open_site_state(url)
    assert "hunter2" not in str(refused.value)


def test_a_file_store_takes_no_tls_or_credentials(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nats://"):
        open_site_state(f"file:{tmp_path}/s.json", creds=tmp_path / "c")


@pytest.mark.parametrize("url", ["nats://router:hunter2@h:4222", "nats://h:4222,tok3n-hunter2@h2:4222"])
def test_a_nats_url_with_a_secret_is_refused_without_echoing_it(url: str) -> None:
    with pytest.raises(ConfigError, match="put them in a file") as refused:
        servers_of(url)
    assert "hunter2" not in str(refused.value)


def test_a_nats_url_names_one_or_more_servers() -> None:
    assert servers_of("nats://a:4222,b:4223") == ["nats://a:4222", "nats://b:4223"]
    assert servers_of("nats://a,nats://b:1") == ["nats://a:4222", "nats://b:1"]
    assert servers_of("tls://a:4443") == ["tls://a:4443"]
    for bad in ("nats://a:0", "nats://a:x", "nats://:4222", "nats://", "http://a:1"):
        with pytest.raises(ConfigError):
            servers_of(bad)


def test_a_credentials_file_holds_a_user_and_password_a_token_or_is_a_creds_file(tmp_path: Path) -> None:
    pair, token, empty, jwt = (tmp_path / name for name in ("pair", "token", "empty", "user.creds"))
    pair.write_text("\nrouter:pa:ss\n")
    token.write_text("s3cret\n")
    empty.write_text("\n")
    jwt.write_text("-----BEGIN NATS USER JWT-----\neyJ0\n------END NATS USER JWT------\n")
    got = credentials_of(pair)
    assert (got.user, got.password, got.token) == ("router", "pa:ss", None) and "pa:ss" not in repr(got)
    assert credentials_of(token).token == "s3cret"
    with pytest.raises(ConfigError, match=f"{empty} is empty"):
        credentials_of(empty)
    with pytest.raises(ConfigError, match="cannot be read"):
        credentials_of(tmp_path / "missing")
    try:
        assert credentials_of(jwt).creds_file == str(jwt)
    except ConfigError as refused:  # nats-py reads a JWT with nkeys, an extra of its own
        assert "pip install nkeys" in str(refused)


# -- the lease, on a fake clock ----------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


class Interleaving(FileSiteState):
    """A file store whose reads yield to the loop, so that two lease steps read before either writes."""

    async def get(self, key: str) -> Entry | None:
        entry = await super().get(key)
        await asyncio.sleep(0)
        return entry


class Unreachable(FileSiteState):
    """A file store that can be cut off, as a NATS server can."""

    down = False

    async def get(self, key: str) -> Entry | None:
        if self.down:
            raise StoreUnavailable("the site state store file:x cannot be reached (cut off)")
        return await super().get(key)


def _run_leases(path: Path, body, *, store_type: type[FileSiteState] = FileSiteState) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        clock = Clock()
        store = store_type(path, clock=clock)
        await store.start()
        try:
            await body(store, clock)
        finally:
            await store.close()

    asyncio.run(main())


def test_one_holder_at_a_time_and_a_takeover_only_after_the_ttl(tmp_path: Path) -> None:
    async def body(store: FileSiteState, clock: Clock) -> None:
        a, b = (Lease(store, "lease.judge", name, ttl_s=9.0, clock=clock) for name in ("a", "b"))
        assert await a.step() == pytest.approx(3.0) and a.held
        wait = await b.step()
        assert not b.held and 0 < wait <= 3.0
        for _ in range(10):  # a renews every ttl/3: b never gets it
            clock.now += 3.0
            await a.step()
            await b.step()
            assert a.held and not b.held
        clock.now += 8.9  # a stops renewing: b waits out the whole ttl
        await b.step()
        assert a.held and not b.held
        clock.now += 0.2
        assert not a.held  # by a's own clock, before b has even looked
        await b.step()
        assert b.held and not a.held
        await a.step()  # a comes back: b holds it now
        assert b.held and not a.held
        record = LeaseRecord.decode((await store.get("lease.judge")).value)  # type: ignore[union-attr]
        assert (record.holder, record.until) == ("b", clock.now + 9.0)

    _run_leases(tmp_path / "site.json", body)


def test_two_takers_at_once_cannot_both_win(tmp_path: Path) -> None:
    async def body(store: FileSiteState, clock: Clock) -> None:
        a, b, c = (Lease(store, "lease.judge", name, ttl_s=6.0, clock=clock) for name in "abc")
        await a.step()
        clock.now += 6.0
        await asyncio.gather(b.step(), c.step())
        assert [b.held, c.held].count(True) == 1 and not a.held
        holder = LeaseRecord.decode((await store.get("lease.judge")).value).holder  # type: ignore[union-attr]
        assert holder == ("b" if b.held else "c")

    _run_leases(tmp_path / "site.json", body, store_type=Interleaving)


def test_a_release_hands_over_at_once(tmp_path: Path) -> None:
    async def body(store: FileSiteState, clock: Clock) -> None:
        changes: list[bool] = []
        a = Lease(store, "lease.judge", "a", ttl_s=30.0, clock=clock, on_change=changes.append)
        b = Lease(store, "lease.judge", "b", ttl_s=30.0, clock=clock)
        await a.step()
        await b.step()
        await a.release()
        assert not a.held and changes == [True, False]
        await b.step()  # the clock has not moved
        assert b.held
        await a.release()  # held by b now: a's release must not delete b's record
        assert LeaseRecord.decode((await store.get("lease.judge")).value).holder == "b"  # type: ignore[union-attr]

    _run_leases(tmp_path / "site.json", body)


def test_a_holder_cut_off_from_the_store_drops_the_lease_at_its_own_until(tmp_path: Path) -> None:
    async def body(store: Unreachable, clock: Clock) -> None:
        changes: list[bool] = []
        a = Lease(store, "lease.judge", "a", ttl_s=9.0, clock=clock, on_change=changes.append)
        await a.step()
        store.down = True
        clock.now += 3.0
        assert await a.step() == pytest.approx(3.0) and a.held  # renewal failed, until not passed
        clock.now += 5.0
        assert await a.step() == pytest.approx(1.0) and a.held  # next look at its until
        clock.now += 1.0
        await a.step()
        assert not a.held and changes == [True, False]

    _run_leases(tmp_path / "site.json", body, store_type=Unreachable)


def test_a_record_nobody_could_have_written_is_taken_over(tmp_path: Path) -> None:
    async def body(store: FileSiteState, clock: Clock) -> None:
        await store.put("lease.judge", b"not json")
        a = Lease(store, "lease.judge", "a", ttl_s=9.0, clock=clock)
        await a.step()
        assert a.held

    _run_leases(tmp_path / "site.json", body)


def test_run_keeps_the_lease_and_a_stop_hands_it_over_at_once(tmp_path: Path) -> None:
    """Real time, a short ttl: the successor follows the key, so it takes over on the release
    long before its own next look (ttl/3 away)."""

    async def main() -> None:
        store = await _opened(tmp_path / "site.json")
        a = Lease(store, "lease.judge", "a", ttl_s=3.0)
        b = Lease(store, "lease.judge", "b", ttl_s=3.0)
        runs = [asyncio.create_task(a.run())]
        try:
            while not a.held:
                await asyncio.sleep(0.01)
            runs.append(asyncio.create_task(b.run()))
            await asyncio.sleep(0.1)
            assert a.held and not b.held
            runs[0].cancel()
            stopped = asyncio.get_running_loop().time()
            await asyncio.gather(runs[0], return_exceptions=True)
            while not b.held:
                await asyncio.sleep(0.01)
                assert asyncio.get_running_loop().time() - stopped < 0.5
        finally:
            for run in runs:
                run.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
            await store.close()

    asyncio.run(main())
