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

    @contextlib.contextmanager
    def hold(self, peer: str, items: int = 1) -> Iterator[None]:
        """One of the client's request places, and ``items`` of its item places, while a request runs."""
        client = client_of(peer)
        refusal = "requests in flight here, the most one client may; wait for answers before sending more"
        items_refusal = (
            "items in requests in flight here, the most one client may; wait for answers before sending more"
        )
        with (
            _place(self.held, client, self.per_client, refusal),
            # a shape's dimension 0 is not checked yet: a negative one must not free others' places
            _place(self.items, client, self.items_per_client, items_refusal, weight=max(1, items)),
        ):
            yield


@contextlib.contextmanager
def _place(table: dict[str, int], client: str, most: int, refusal: str, *, weight: int = 1) -> Iterator[int]:
    """``weight`` of ``client``'s places in ``table`` while the block runs (yields how many it held
    before); Overloaded when that would take it past ``most`` (0: no limit). A client holding
    nothing always gets its places, so that one request larger than the limit is not refused forever."""
    count = table.get(client, 0)
    if most > 0 and count and count + weight > most:
        raise Overloaded(f"this client has {count} {refusal}")
    table[client] = count + weight
    try:
        yield count
    finally:
        left = table[client] - weight
        if left:
            table[client] = left
        else:
            del table[client]
