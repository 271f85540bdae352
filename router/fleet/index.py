"""Which agents serve which model on which tier, kept current as agents come and go.

The registry updates the index when an agent says Hello, drains, is lost or is forgotten;
a request reads it in constant time (the ready agents of one model on one tier, and the
tiers the model has) instead of scanning the fleet. Owned by the router's event loop.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Mapping, Sequence
from typing import Generic, Protocol, TypeVar, overload

from stratus.tiers import Tier


class Indexed(Protocol):
    """What the index needs of an agent: who it is, its tier, and what it serves."""

    @property
    def id(self) -> str: ...

    @property
    def tier(self) -> Tier: ...

    @property
    def variant_families(self) -> Mapping[str, str]:
        """Each variant it serves, with the family that variant belongs to."""
        ...

    @property
    def model_names(self) -> frozenset[str]:
        """The names it answers to: its variants, the families it serves a current variant
        of, and a line key (:func:`line_key`) for each line a rollout may send it."""
        ...


A = TypeVar("A", bound=Indexed)


class Pool(Sequence[A], Generic[A]):
    """A set of agents with O(1) add, remove and random access (swap-remove)."""

    def __init__(self) -> None:
        self._items: list[A] = []
        self._where: dict[str, int] = {}

    def add(self, agent: A) -> None:
        if agent.id not in self._where:
            self._where[agent.id] = len(self._items)
            self._items.append(agent)

    def remove(self, agent: A) -> None:
        position = self._where.pop(agent.id, None)
        if position is None:
            return
        last = self._items.pop()
        if position < len(self._items):
            self._items[position] = last
            self._where[last.id] = position

    def __len__(self) -> int:
        return len(self._items)

    @overload
    def __getitem__(self, index: int) -> A: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[A]: ...

    def __getitem__(self, index: int | slice) -> A | Sequence[A]:
        return self._items[index]

    def __iter__(self) -> Iterator[A]:
        return iter(self._items)

    def __contains__(self, agent: object) -> bool:
        return getattr(agent, "id", None) in self._where


def _models(agent: Indexed) -> frozenset[str]:
    return agent.model_names


# Line keys start with a character no model name may start with: they are never a name a
# client can ask for, only the router's own way to find agents serving a line.
LINE_PREFIX = "@"


def line_key(line: str) -> str:
    """The index key of the agents that serve ``line`` (an FP32 variant, in any precision)."""
    return LINE_PREFIX + line


class AgentIndex(Generic[A]):
    """Ready agents by (model, tier); listed agents counted by (model, tier).

    *Listed* agents are every agent the router still shows (ready, draining, or lost and
    not yet forgotten): their tiers are the tiers a model "has", which decides whether an
    unsure answer may climb. *Ready* agents are the ones a request may be sent to.
    """

    def __init__(self) -> None:
        self._ready: dict[str, dict[Tier, Pool[A]]] = {}
        self._listed: dict[str, collections.Counter[Tier]] = {}
        self._family: dict[str, str] = {}  # variant -> family, for variants listed now
        self._ready_ids: set[str] = set()

    # -- updates, from the registry ---------------------------------------------------
    def add(self, agent: A) -> None:
        """The agent joined: it is listed from now until it is forgotten."""
        self._family.update(agent.variant_families)
        for model in _models(agent):
            self._listed.setdefault(model, collections.Counter())[agent.tier] += 1

    def ready(self, agent: A) -> None:
        for model in _models(agent):
            self._ready.setdefault(model, {}).setdefault(agent.tier, Pool()).add(agent)
        self._ready_ids.add(agent.id)

    def unready(self, agent: A) -> None:
        """Draining or lost: no new work, though its tier still exists for its models."""
        for model in _models(agent):
            tiers = self._ready.get(model)
            pool = tiers.get(agent.tier) if tiers else None
            if pool is None:
                continue
            pool.remove(agent)
            if not pool:
                del tiers[agent.tier]  # type: ignore[union-attr]
        self._ready_ids.discard(agent.id)

    def forget(self, agent: A) -> None:
        self.unready(agent)
        for model in _models(agent):
            counts = self._listed.get(model)
            if counts is None:
                continue
            counts[agent.tier] -= 1
            if counts[agent.tier] <= 0:
                del counts[agent.tier]
            if not counts:
                del self._listed[model]
                self._family.pop(model, None)

    # -- reads, per request -----------------------------------------------------------
    def pools(self, model: str) -> Mapping[Tier, Sequence[A]]:
        """The ready agents serving ``model``, by tier (live: read it, do not keep it)."""
        return self._ready.get(model, {})

    def tiers(self, model: str) -> frozenset[Tier]:
        """Tiers with a listed agent serving ``model``, reachable now or not."""
        counts = self._listed.get(model)
        return frozenset(counts) if counts else frozenset()

    def listed(self, model: str) -> Mapping[Tier, int]:
        """How many listed agents serve ``model`` on each tier (live: read it, do not keep it)."""
        return self._listed.get(model) or {}

    def family_of(self, variant: str) -> str | None:
        return self._family.get(variant)

    def variants_of(self, family: str) -> list[str]:
        return sorted(v for v, f in self._family.items() if f == family)

    def models(self) -> list[str]:
        return sorted(m for m in self._listed if not m.startswith(LINE_PREFIX))

    def any_ready(self) -> bool:
        return bool(self._ready_ids)

    def serves(self, model: str) -> bool:
        """Some ready agent serves ``model`` now."""
        return bool(self._ready.get(model))
