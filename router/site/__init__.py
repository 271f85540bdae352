"""A site's shared state: what every router of a site must agree on, in one store with
revisions and watches, as KServe, llm-d and Dynamo keep desired state (Kubernetes objects,
etcd, NATS JetStream) instead of replicating it themselves.

:class:`SiteState` is the contract: ``get``; ``put`` with compare-and-swap on the entry's
revision; ``delete``; ``history``; ``entries`` under a prefix; and ``watch``, every entry
under a prefix and then every change to one, in revision order. Two backends implement it
(:func:`open_site_state`): ``file:PATH`` for a lone router (the embedded default: one file,
written whole and atomically) and ``nats://HOST:PORT`` (a JetStream key-value bucket), which
many routers share.

The request path never waits on the store: routers keep what they watched in memory and
serve from it; only an operator's change (a rollout, a threshold push, a drain) waits for
its ``put``, and is refused with UNAVAILABLE naming the store while it cannot be reached, or
with FAILED_PRECONDITION naming the revision it lost to when another change came first.

Keys are dot-separated words of ``[A-Za-z0-9_-]`` (NATS's key alphabet without ``/``
and ``=``): ``rollout.digits.device``, ``drain.device-1``.
"""

from __future__ import annotations

import abc
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Final

from stratus.errors import Conflict, Unavailable

KEY_PATTERN: Final = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")
# The most bytes one entry may hold: a rollout's record with its history is a few KiB; NATS's
# default max payload is 1 MiB.
MAX_VALUE_BYTES: Final = 256 * 1024


class StoreConflict(Conflict):
    """A compare-and-swap lost: the entry is at another revision than the one the change read."""

    def __init__(self, message: str, *, key: str, expected: int, current: int) -> None:
        super().__init__(message)
        self.key, self.expected, self.current = key, expected, current


class StoreUnavailable(Unavailable):
    """The store cannot be reached (or did not answer in time); the message names it."""


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One revision of one key. ``revision`` orders every change of the whole store (NATS's
    stream sequence; the file's own counter); ``deleted`` marks a delete (``value`` empty)."""

    key: str
    value: bytes
    revision: int
    at: float  # seconds since the epoch, when the store took it
    deleted: bool = False


def check_key(key: str) -> str:
    if not KEY_PATTERN.fullmatch(key) or len(key) > 256:
        raise ValueError(f"{key!r} is not a site-state key (dot-separated words of A-Z a-z 0-9 _ -)")
    return key


class SiteState(abc.ABC):
    """The store every router of a site reads and writes. Every method may raise
    StoreUnavailable; ``put`` and ``delete`` may raise StoreConflict."""

    url: str  # as given, without credentials: what errors and `fleet status` name
    # Whether many routers may share it (NATS): only then is there a site to register in and a
    # judge lease to hold; a file is one router's alone.
    shared: bool = False

    @abc.abstractmethod
    async def start(self) -> None:
        """Connect (or load). A store unreachable at start is not fatal: it raises nothing,
        ``connected`` is false, and the backend keeps trying in the background."""

    @abc.abstractmethod
    async def close(self) -> None: ...

    @property
    @abc.abstractmethod
    def connected(self) -> bool: ...

    @abc.abstractmethod
    def describe(self) -> str:
        """One line for `fleet status`: the URL, and connected, or unreachable since when and why."""

    @abc.abstractmethod
    async def get(self, key: str) -> Entry | None:
        """The key's latest revision, None if it has none or was deleted."""

    @abc.abstractmethod
    async def put(self, key: str, value: bytes, *, expected: int | None = None) -> Entry:
        """Write ``value``; with ``expected``, only if the key's latest revision is that one (0:
        only if the key has none, or was deleted), else StoreConflict naming the current one."""

    @abc.abstractmethod
    async def delete(self, key: str, *, expected: int | None = None) -> None:
        """Delete the key (its history stays), with ``expected`` as ``put`` takes it."""

    @abc.abstractmethod
    async def history(self, key: str) -> list[Entry]:
        """The key's revisions kept, oldest first (deletes included)."""

    @abc.abstractmethod
    async def entries(self, prefix: str) -> list[Entry]:
        """The latest revision of every live key under ``prefix`` (``rollout.`` or ``""``)."""

    @abc.abstractmethod
    def watch(self, prefix: str) -> AsyncIterator[Entry]:
        """Every live entry under ``prefix``, then each change as it is made, in revision
        order, across reconnects (after one, what changed meanwhile comes first; a revision
        already given is never given again). Ends only when the store is closed."""


def unavailable(url: str, what: str, why: object) -> StoreUnavailable:
    return StoreUnavailable(f"the site state store {url} cannot be reached ({why}): {what} was not made")


__all__ = [
    "MAX_VALUE_BYTES",
    "Entry",
    "SiteState",
    "StoreConflict",
    "StoreUnavailable",
    "check_key",
    "unavailable",
]
