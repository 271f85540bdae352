"""How much of a server one client may hold: requests and items in flight, streams open, and
how long a stream may stay silent. A client is a peer address without its port."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Final

from stratus.errors import Overloaded

# Requests one client (one peer address) may have in flight on a server at once, so that no
# single client takes every slot (a router's cloud link holds at most 512 at the cloud).
MAX_REQUESTS_PER_CLIENT: Final = 1024
# Items (dimension 0 of a request's first input) one client may have in flight on a router: its
# requests of 1,024 items each, 1,000 at a time with 600 s budgets, once held every agent's queue
# and the cloud's, and the other clients' requests waited past their deadlines (security F21).
# Sixteen requests of the most items a request may hold; a cloud gateway's client is a router.
MAX_ITEMS_PER_CLIENT: Final = 16_384
# ModelStreamInfer streams one client may hold open at once: a stream costs the server its
# slot and about 20 KiB whether it asks anything or not, and 20 connections x 1,000 silent
# streams from one address once took all 16,384 of a router's RPC slots (security2 N1).
MAX_STREAMS_PER_CLIENT: Final = 128
# Of those, the streams that may wait for their first request as long as they like (a
# router's escalation stream to the cloud stays silent until its first unsure item); past
# them, a stream that has sent no request in SILENT_STREAM_S is closed (DEADLINE_EXCEEDED).
IDLE_STREAMS_PER_CLIENT: Final = 8
SILENT_STREAM_S: Final = 10.0


def client_of(peer: str) -> str:
    """A gRPC peer without its port: ``ipv4:10.0.0.7:51234`` is client ``ipv4:10.0.0.7``."""
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.rsplit(":", 1)[0]
    return peer


class ClientLimits:
    """Requests in flight per client, and streams open per client; past ``per_client`` (or
    ``streams_per_client``) a client's new ones are refused with RESOURCE_EXHAUSTED while
    everyone else's go on. 0 turns a limit off."""

    def __init__(
        self,
        per_client: int = MAX_REQUESTS_PER_CLIENT,
        *,
        items_per_client: int = 0,
        streams_per_client: int = MAX_STREAMS_PER_CLIENT,
        idle_streams_per_client: int = IDLE_STREAMS_PER_CLIENT,
        silent_stream_s: float = SILENT_STREAM_S,
    ) -> None:
        self.per_client = per_client
        self.held: dict[str, int] = {}
        self.items_per_client = items_per_client
        self.items: dict[str, int] = {}
        self.streams_per_client = streams_per_client
        self.idle_streams_per_client = idle_streams_per_client
        self.silent_stream_s = silent_stream_s
        self.streams: dict[str, int] = {}

    @contextlib.contextmanager
    def stream(self, peer: str) -> Iterator[float | None]:
        """Hold one of the client's stream places while a stream is open; yields how long it
        may stay silent before its first request (None: as long as it likes)."""
        refusal = (
            "streams open here, the most one client may; send requests on the streams it has, or close some"
        )
        with _place(self.streams, client_of(peer), self.streams_per_client, refusal) as before:
            yield None if before < self.idle_streams_per_client else self.silent_stream_s

    def hold(self, peer: str, items: int = 1) -> Held:
        """One of the client's request places, and ``items`` of its item places, while a request
        runs (``with limits.hold(peer, items):``)."""
        # a shape's dimension 0 is not checked yet: a negative one must not free others' places
        return Held(self, client_of(peer), max(1, items))


_WAIT: Final = "the most one client may; wait for answers before sending more"
_REQUESTS_REFUSAL: Final = f"requests in flight here, {_WAIT}"
_ITEMS_REFUSAL: Final = f"items in requests in flight here, {_WAIT}"


class Held:
    """A request's places, taken on entry and given back on exit. A class, not a generator:
    every request enters one, and a generator's context manager costs three times as much."""

    __slots__ = ("_client", "_items", "_limits")

    def __init__(self, limits: ClientLimits, client: str, items: int) -> None:
        self._limits, self._client, self._items = limits, client, items

    def __enter__(self) -> None:
        limits, client = self._limits, self._client
        _take(limits.held, client, 1, limits.per_client, _REQUESTS_REFUSAL)
        try:
            _take(limits.items, client, self._items, limits.items_per_client, _ITEMS_REFUSAL)
        except Overloaded:
            _give(limits.held, client, 1)
            raise

    def __exit__(self, *exc: object) -> None:
        _give(self._limits.items, self._client, self._items)
        _give(self._limits.held, self._client, 1)


@contextlib.contextmanager
def _place(table: dict[str, int], client: str, most: int, refusal: str, *, weight: int = 1) -> Iterator[int]:
    """``weight`` of ``client``'s places in ``table`` while the block runs (yields how many it held
    before); Overloaded when that would take it past ``most`` (0: no limit)."""
    count = _take(table, client, weight, most, refusal)
    try:
        yield count
    finally:
        _give(table, client, weight)


def _take(table: dict[str, int], client: str, weight: int, most: int, refusal: str) -> int:
    """Take ``weight`` places (how many were held before), or refuse past ``most``. A client
    holding nothing always gets its places, so that one request larger than the limit is not
    refused forever."""
    count = table.get(client, 0)
    if most > 0 and count and count + weight > most:
        raise Overloaded(f"this client has {count} {refusal}")
    table[client] = count + weight
    return count


def _give(table: dict[str, int], client: str, weight: int) -> None:
    left = table[client] - weight
    if left:
        table[client] = left
    else:
        del table[client]
