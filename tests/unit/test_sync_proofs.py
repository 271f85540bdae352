"""Rollout-sync proofs: one label, one exact tuple of fields, a one-sided window, once (security2 N6)."""

from __future__ import annotations

import hashlib
import hmac
import re
import struct
import time
from types import SimpleNamespace

import pytest

from stratus.serving import sync_proofs
from stratus.serving.sync_proofs import (
    MAX_AGE_MS,
    MAX_AHEAD_MS,
    SYNC_ANSWER,
    SYNC_REQUEST,
    SeenNonces,
    proof_holds,
    sync_proof,
)

TOKEN = "peer-secret-0123456789"


def now_ms() -> int:
    return int(time.time() * 1000)


def test_a_proof_covers_its_token_label_and_every_field() -> None:
    proof = sync_proof(TOKEN, SYNC_REQUEST, "router-a", '{"plans": []}', "")
    assert proof_holds(TOKEN, SYNC_REQUEST, proof, "router-a", '{"plans": []}', "")
    assert TOKEN not in proof
    assert not proof_holds("other-secret-0123456789", SYNC_REQUEST, proof, "router-a", '{"plans": []}', "")
    assert not proof_holds(TOKEN, SYNC_REQUEST, proof, "router-a", '{"plans": [1]}', "")  # tampered
    assert not proof_holds(
        TOKEN, SYNC_ANSWER, proof, "router-a", '{"plans": []}', ""
    )  # reflected as an answer
    assert not proof_holds(TOKEN, SYNC_REQUEST, TOKEN, "router-a", "{}", "")  # the raw token is no proof
    assert not proof_holds(TOKEN, SYNC_REQUEST, "v1:" + proof[3:], "router-a", '{"plans": []}', "")


def test_fields_cannot_shift_across_a_boundary_and_keep_the_proof() -> None:
    """With fields joined by NUL, ("a\\x00b", "c") and ("a", "b\\x00c") had one proof."""
    proof = sync_proof(TOKEN, SYNC_REQUEST, "a\x00b", "c")
    assert proof_holds(TOKEN, SYNC_REQUEST, proof, "a\x00b", "c")
    assert not proof_holds(TOKEN, SYNC_REQUEST, proof, "a", "b\x00c")
    assert not proof_holds(TOKEN, SYNC_REQUEST, proof, "a\x00b", "c", "")  # nor gain an empty one


def test_the_window_is_a_minute_back_and_five_seconds_ahead() -> None:
    def made(offset_ms: int) -> bool:
        return proof_holds(
            TOKEN, SYNC_REQUEST, sync_proof(TOKEN, SYNC_REQUEST, "r", at_ms=now_ms() + offset_ms), "r"
        )

    assert made(-(MAX_AGE_MS - 1000)) and made(MAX_AHEAD_MS - 1000)
    assert not made(-(MAX_AGE_MS + 1000))  # too old: a replay
    assert not made(MAX_AHEAD_MS + 1000)  # dated ahead: it would outlive the window


def test_a_checker_takes_each_nonce_once() -> None:
    seen = SeenNonces()
    proof = sync_proof(TOKEN, SYNC_REQUEST, "r", "{}")
    assert proof_holds(TOKEN, SYNC_REQUEST, proof, "r", "{}", seen=seen)
    assert not proof_holds(TOKEN, SYNC_REQUEST, proof, "r", "{}", seen=seen)  # replayed
    assert proof_holds(TOKEN, SYNC_REQUEST, sync_proof(TOKEN, SYNC_REQUEST, "r", "{}"), "r", "{}", seen=seen)
    assert sync_proof(TOKEN, SYNC_REQUEST, "r") != sync_proof(TOKEN, SYNC_REQUEST, "r")  # a fresh nonce each
    forged = sync_proof("wrong-secret-0123456789", SYNC_REQUEST, "r", nonce="n1")
    assert not proof_holds(TOKEN, SYNC_REQUEST, forged, "r", seen=seen)
    assert proof_holds(TOKEN, SYNC_REQUEST, sync_proof(TOKEN, SYNC_REQUEST, "r", nonce="n1"), "r", seen=seen)


def test_seen_nonces_are_bounded_and_forget_what_left_the_window() -> None:
    seen = SeenNonces(most=3)
    old = now_ms() - MAX_AGE_MS - MAX_AHEAD_MS - 1000
    assert seen.first_time("old", old)
    assert seen.first_time("a", now_ms()) and len(seen) == 1  # "old" was past the window
    assert seen.first_time("b", now_ms()) and seen.first_time("c", now_ms()) and len(seen) == 3
    assert seen.first_time("d", now_ms()) and len(seen) == 3  # full: the oldest goes
    assert not seen.first_time("d", now_ms())
    assert seen.first_time("a", now_ms())  # forgotten to make room


NOW_S = 1_700_000_000.0  # a fixed clock, so the window's edges can be hit exactly
NOW_MS = int(NOW_S * 1000)


@pytest.fixture
def fixed_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sync_proofs, "time", SimpleNamespace(time=lambda: NOW_S))


def test_a_proof_is_the_documented_hmac_so_other_routers_can_check_it() -> None:
    """v2:MS:NONCE:HMAC-SHA256 over label, time, nonce and fields, each after its length as
    8 bytes big-endian: a router of another build must compute the same proof."""
    mac = hmac.new(TOKEN.encode(), digestmod=hashlib.sha256)
    for data in (SYNC_REQUEST, "1234", "n0nce", "router-a", ""):
        mac.update(struct.pack(">Q", len(data.encode())) + data.encode())
    expected = f"v2:1234:n0nce:{mac.hexdigest()}"
    assert sync_proof(TOKEN, SYNC_REQUEST, "router-a", "", at_ms=1234, nonce="n0nce") == expected


def test_a_fresh_nonce_is_128_random_bits_and_a_given_one_is_kept() -> None:
    nonce = sync_proof(TOKEN, SYNC_REQUEST, "r").split(":")[2]
    assert re.fullmatch(r"[0-9a-f]{32}", nonce), nonce
    assert sync_proof(TOKEN, SYNC_REQUEST, "r", nonce="n1").split(":")[2] == "n1"


@pytest.mark.usefixtures("fixed_clock")
def test_the_window_includes_its_edges() -> None:
    def made(at_ms: int) -> bool:
        return proof_holds(TOKEN, SYNC_REQUEST, sync_proof(TOKEN, SYNC_REQUEST, "r", at_ms=at_ms), "r")

    assert made(NOW_MS - MAX_AGE_MS) and made(NOW_MS + MAX_AHEAD_MS)
    assert not made(NOW_MS - MAX_AGE_MS - 1) and not made(NOW_MS + MAX_AHEAD_MS + 1)


@pytest.mark.usefixtures("fixed_clock")
def test_a_nonce_is_remembered_as_long_as_its_proof_could_be_replayed() -> None:
    """A proof 59 s old still holds, so its nonce must still be known: else it replays."""
    proof = sync_proof(TOKEN, SYNC_REQUEST, "r", at_ms=NOW_MS - MAX_AGE_MS + 1000)
    seen = SeenNonces()
    assert proof_holds(TOKEN, SYNC_REQUEST, proof, "r", seen=seen)
    assert not proof_holds(TOKEN, SYNC_REQUEST, proof, "r", seen=seen)


@pytest.mark.usefixtures("fixed_clock")
def test_a_nonce_at_the_edge_of_what_is_remembered_is_kept() -> None:
    """Forgotten only once strictly older than the window and its slack (65 s)."""
    seen = SeenNonces()
    edge = NOW_MS - MAX_AGE_MS - MAX_AHEAD_MS
    assert seen.first_time("edge", edge)
    assert not seen.first_time("edge", edge)
    older = SeenNonces()
    assert older.first_time("older", edge - 1)
    assert older.first_time("older", edge - 1)  # already forgotten: past any proof's window


def test_a_proof_whose_digest_is_not_ascii_is_refused_not_raised() -> None:
    """compare_digest raises TypeError on non-ASCII text: that escaped proof_holds and ended the
    router's peer-sync task for good (found by the mutation helper). It is a plain refusal now."""
    forged = f"v2:{now_ms()}:{'n' * 32}:\u00e9" + "0" * 63
    assert proof_holds("peer-secret-0123456789", SYNC_REQUEST, forged, "r") is False
