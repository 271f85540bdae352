"""The site state store of a lone router (``file:PATH``).

The contract's own tests (tests/site_contract.py) run here against the file."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from router.site import SiteState, StoreUnavailable
from router.site import file as site_file
from router.site.file import FileSiteState
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
