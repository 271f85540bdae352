"""`fleet thresholds --suggest` reads every router's audit rows of a site, each router once."""

from __future__ import annotations

import grpc
import pytest

from stratus.cli.thresholds import site_rows, thresholds_json, thresholds_table
from stratus.wire import fleet_pb2 as fpb


def reply(router_id: str, rows: int, site_routers: str = "") -> fpb.ThresholdsReply:
    return fpb.ThresholdsReply(
        family="digits",
        router_id=router_id,
        site_routers=site_routers,
        rows=[fpb.AuditRow(top_tier="cloud", label=index) for index in range(rows)],
    )


class Down(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection refused"


def test_the_routers_each_lists_are_read_once_each_by_router_id() -> None:
    site = {  # a lists itself and b; b lists a and c; c lists nobody
        "127.0.0.1:1": reply("a", 3, "127.0.0.1:1,127.0.0.1:2"),
        "127.0.0.1:2": reply("b", 5, "127.0.0.1:1,127.0.0.1:3"),
        "127.0.0.1:3": reply("c", 7),
    }
    asked: list[str] = []

    def fetch(address: str, name: str | None) -> fpb.ThresholdsReply:
        asked.append(address)
        return site[address]

    read = site_rows(site["127.0.0.1:1"], fetch)
    assert read.routers == ["a", "b", "c"] and len(read.rows) == 3 + 5 + 7
    assert asked == ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]  # each address dialled once
    assert read.unreachable == []


def test_a_router_that_does_not_answer_is_named_and_the_rest_are_read() -> None:
    def fetch(address: str, name: str | None) -> fpb.ThresholdsReply:
        if address.endswith(":2"):
            raise Down()
        return reply("c", 4)

    read = site_rows(reply("a", 2, "127.0.0.1:2,127.0.0.1:3"), fetch)
    assert read.routers == ["a", "c"] and len(read.rows) == 6
    assert read.unreachable == ["127.0.0.1:2: UNAVAILABLE: connection refused"]
    shown = thresholds_table(reply("a", 2), {"device": 0.9}, site=read)
    assert "(suggested on 6 audit rows of 2 routers: a, c)" in shown
    assert "(router of the site not read: 127.0.0.1:2: UNAVAILABLE: connection refused)" in shown


def test_a_router_alone_in_its_site_is_read_alone() -> None:
    def fetch(address: str, name: str | None) -> fpb.ThresholdsReply:
        pytest.fail(f"nothing to dial, yet {address} was")

    read = site_rows(reply("a", 9), fetch)
    assert (read.routers, len(read.rows)) == (["a"], 9)
    assert "(suggested on 9 audit rows of this router)" in thresholds_table(reply("a", 9), {"device": 0.9}, site=read)


def test_after_a_push_the_change_is_read_from_what_the_push_replaced() -> None:
    """Once --suggest --apply has pushed, the thresholds in force are the suggestion's: each
    tier's change is against the thresholds before the push, not "none"."""
    before = fpb.ThresholdsReply(family="defects", in_force={"device": 0.9931, "edge": 0.9305})
    after = fpb.ThresholdsReply(family="defects", in_force={"device": 1.0, "edge": 0.9305})
    suggested = {"device": 1.0, "edge": 0.9305}
    shown = thresholds_table(after, suggested, before=before)
    assert "change from before the push" in shown
    rows = {line.split()[0]: line for line in shown.splitlines() if line.startswith(("device", "edge"))}
    assert rows["device"].endswith("more escalation") and rows["edge"].endswith("none")
    assert thresholds_table(after, suggested).splitlines()[2].endswith("change")  # no push: against in force


def test_a_suggestion_s_notes_are_shown_and_carried_in_json() -> None:
    shown = fpb.ThresholdsReply(family="defects", in_force={"device": 0.99})
    note = "the device tier passes every request up (1.0001): 3 of its 200 audited answers disagreed"
    table = thresholds_table(shown, {"device": 1.0001}, notes=(note,))
    assert f"note: {note}" in table.splitlines()
    assert thresholds_json(shown, {"device": 1.0001}, notes=(note,))["notes"] == [note]
    assert thresholds_json(shown)["notes"] == []
