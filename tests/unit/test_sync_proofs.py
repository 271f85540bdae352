"""Rollout-sync proofs: one label, one exact tuple of fields, a one-sided window, once (security2 N6)."""

from __future__ import annotations

import time

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
    assert not proof_holds(TOKEN, SYNC_ANSWER, proof, "router-a", '{"plans": []}', "")  # reflected as an answer
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
        return proof_holds(TOKEN, SYNC_REQUEST, sync_proof(TOKEN, SYNC_REQUEST, "r", at_ms=now_ms() + offset_ms), "r")

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
