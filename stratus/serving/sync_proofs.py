"""Proofs of the peer token over a rollout sync, never the token itself.

A proof is ``v2:MS:NONCE:HMAC``: an HMAC-SHA256 under the peer token of a label saying which
way the message goes, the time, a random nonce and every field of the message, each prefixed
with its length. The first version joined the fields with NUL bytes and no label (security2 N6):
fields could shift across a separator and keep their proof, an answer's proof checked as a
request's, and a captured proof replayed for two minutes (a window of +-60 s). Now a proof holds
for one label and one exact tuple of fields, from 60 s before to 5 s after the checker's clock,
and once: a checker with :class:`SeenNonces` refuses a nonce it has taken.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from typing import Final

# Which way a proof's message goes: a request's proof never checks as an answer's, or back.
SYNC_REQUEST: Final = "stratus rollout sync request"
SYNC_ANSWER: Final = "stratus rollout sync answer"
VERSION: Final = "v2"
# How old a proof may be, and how far ahead of the checker's clock (clocks of one site agree
# to well within a second under NTP; a proof from the future must not outlive the window).
MAX_AGE_MS: Final = 60_000
MAX_AHEAD_MS: Final = 5_000
# Nonces a checker remembers: one sync a second from each of 1,000 peers for the window.
MAX_SEEN: Final = 65_536


def sync_proof(
    token: str, label: str, *parts: str, at_ms: int | None = None, nonce: str | None = None
) -> str:
    """A proof of ``token`` over ``label`` and ``parts``, made now (or at ``at_ms``)."""
    at = int(time.time() * 1000) if at_ms is None else at_ms
    once = secrets.token_hex(16) if nonce is None else nonce
    return f"{VERSION}:{at}:{once}:{_digest(token, label, str(at), once, *parts)}"


def proof_holds(token: str, label: str, proof: str, *parts: str, seen: SeenNonces | None = None) -> bool:
    """Whether ``proof`` is :func:`sync_proof` of ``label`` and ``parts`` under ``token``, made
    inside the window; with ``seen``, also that its nonce was never taken before (then taken)."""
    try:
        version, at, nonce, digest = proof.split(":", 3)
        at_ms = int(at)
    except ValueError:
        return False
    now_ms = time.time() * 1000
    if version != VERSION or not now_ms - MAX_AGE_MS <= at_ms <= now_ms + MAX_AHEAD_MS or not nonce:
        return False
    # compare_digest raises TypeError on a str that is not ASCII (anyone may send one)
    if not (digest.isascii() and hmac.compare_digest(digest, _digest(token, label, at, nonce, *parts))):
        return False
    return seen is None or seen.first_time(nonce, at_ms)


def _digest(token: str, *fields: str) -> str:
    mac = hmac.new(token.encode(), digestmod=hashlib.sha256)
    for field in fields:
        data = field.encode()
        mac.update(len(data).to_bytes(8, "big"))
        mac.update(data)
    return mac.hexdigest()


class SeenNonces:
    """The nonces of proofs taken inside the window, oldest first; a nonce is taken once."""

    def __init__(self, most: int = MAX_SEEN) -> None:
        self._most = most
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> its proof's time (ms)

    def first_time(self, nonce: str, at_ms: float) -> bool:
        self._forget(time.time() * 1000 - MAX_AGE_MS - MAX_AHEAD_MS)
        if nonce in self._seen:
            return False
        if len(self._seen) >= self._most:  # a flood of proven syncs: forget the oldest first
            self._seen.popitem(last=False)
        self._seen[nonce] = at_ms
        return True

    def _forget(self, before_ms: float) -> None:
        while self._seen:
            nonce, at_ms = next(iter(self._seen.items()))
            if at_ms >= before_ms:
                return
            del self._seen[nonce]

    def __len__(self) -> int:
        return len(self._seen)
