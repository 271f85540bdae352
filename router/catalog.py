"""What a model name asks of the fleet: the one place the router's names are resolved.

Agents serve families and their variants (the registry); the cloud serves models of its own
(its catalog). :class:`Catalog` merges the two, and :meth:`Catalog.route` answers once per
request what the planes would otherwise ask four to six times: the family, the variant the
name pins, the description its tensors are checked against, generative or not, and the
family its metrics count it under.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from router.cloud.models import family_of
from router.cloud.pool import CloudTier
from router.fleet.registry import FleetRegistry
from stratus.errors import NotFound, PermissionDenied
from stratus.families.description import FamilyDescription

# What NOT_FOUND lists, at most, in characters of names: its message travels in gRPC
# metadata (8 KiB by default), which a fleet of thousands of names would pass.
MAX_LISTED_CHARS = 1024


@dataclass(frozen=True, slots=True)
class Route:
    """A model name resolved: ``family`` as the fleet names it (a model only the cloud serves
    is a family of its own), ``pinned`` the variant the name asks for exactly, ``description``
    what the family's agents (else the cloud) say of it, ``label`` its metrics' family."""

    family: str
    pinned: str | None
    description: FamilyDescription | None
    label: str

    @property
    def generative(self) -> FamilyDescription | None:
        """The description, when the name is a generative family's."""
        info = self.description
        return info if info is not None and info.generative else None

    @property
    def classifier(self) -> FamilyDescription | None:
        """The description, when it is a classifier's (its tensors are checked)."""
        info = self.description
        return info if info is not None and not info.generative else None


class Catalog:
    """The names agents and the cloud serve, merged; ``cloud`` gives the router's cloud tier
    as it is now (it is set after the plane is built, and again on a reload)."""

    def __init__(self, registry: FleetRegistry, cloud: Callable[[], CloudTier | None]) -> None:
        self.registry = registry
        self._cloud = cloud

    @property
    def cloud(self) -> CloudTier | None:
        """The router's cloud tier as it is now (None: no cloud)."""
        return self._cloud()

    def route(self, name: str) -> Route:
        """What ``name`` asks for; NotFound (listing every name that works) or PermissionDenied
        (a cloud model of a family kept on the site) where it asks for nothing it may have."""
        family, pinned = self.family_of(name)
        info = self.registry.family(family)
        cloud = self._cloud()
        if info is None and cloud is not None:  # served by the cloud alone
            info = cloud.generative.get(family) or cloud.described.get(family)
        return Route(family=family, pinned=pinned, description=info, label=self._label(family, cloud))

    def _label(self, family: str, cloud: CloudTier | None) -> str:
        """A variant counts under its family, whether agents serve it or only the cloud does
        (``digits-large``: "digits"), never as a family of its own."""
        if family in self.registry.families or cloud is None:
            return family
        return family_of(family, self.registry.families, cloud.named) or family

    def escalates(self, model: str) -> bool:
        """Whether ``model``'s items may leave the site for the cloud: not those of a family whose
        files say ``[privacy] escalate = false`` (its variants, and the cloud's models of it, too)."""
        family = self.registry.index.family_of(model)
        if family is None:
            cloud = self._cloud()
            named = cloud.named if cloud is not None else ()
            family = family_of(model, self.registry.families, named) or model
        info = self.registry.family(family)
        return info is None or info.escalate

    def cloud_serves(self, model: str) -> bool:
        """The cloud serves ``model`` and may be sent its items (up or down)."""
        cloud = self._cloud()
        return cloud is not None and cloud.models.get(model, False) and self.escalates(model)

    def names(self) -> tuple[list[str], list[str]]:
        """(families, every other name that works), each sorted: what NOT_FOUND lists."""
        families = set(self.registry.families)
        others = set(self.registry.index.models())
        cloud = self._cloud()
        if cloud is not None:
            others |= {name for name, ok in cloud.models.items() if ok}
        return sorted(families), sorted(others - families)

    def knows(self, name: str) -> bool:
        try:
            return self._resolve(name) is not None
        except PermissionDenied:  # a name that exists, refused to this caller
            return True

    def family_of(self, name: str) -> tuple[str, str | None]:
        """(family, pinned variant or None); NotFound listing every name that works (families first)."""
        resolved = self._resolve(name)
        if resolved is None:
            families, variants = self.names()
            raise NotFound(f"unknown model {name[:128]!r}; the fleet serves {listing([*families, *variants])}")
        return resolved

    def _resolve(self, name: str) -> tuple[str, str | None] | None:
        """(family, pinned variant or None), or None when no agent nor the cloud knows ``name``."""
        if name in self.registry.families:
            return name, None
        family = self.registry.index.family_of(name)
        if family is not None:
            return family, name
        cloud = self._cloud()
        if cloud is not None and cloud.models.get(name):
            if not self.escalates(name):  # the cloud's model of a family kept on the site
                raise PermissionDenied(
                    f"{name[:128]!r} runs on the cloud, and its family keeps its inputs on the site "
                    "([privacy] escalate = false): ask the family by its name"
                )
            return name, None
        return None

    def description(self, family: str) -> FamilyDescription | None:
        """What describes ``family`` (as :meth:`family_of` names it): its agents' description,
        else, for a model only the cloud serves, the cloud's own metadata of it."""
        info = self.registry.family(family)
        cloud = self._cloud()
        if info is None and cloud is not None:
            info = cloud.described.get(family)
        return info

    def generative(self, name: str) -> FamilyDescription | None:
        """The family's description when ``name`` is a generative family (or one of its variants)."""
        try:
            family, _ = self.family_of(name)
        except NotFound:
            return None
        info = self.registry.family(family)
        cloud = self._cloud()
        if info is None and cloud is not None:
            info = cloud.generative.get(family)  # served by the cloud alone
        return info if info is not None and info.generative else None


def listing(names: Sequence[str], most_chars: int = MAX_LISTED_CHARS) -> str:
    """Names for an error message, in order, while they fit in ``most_chars``; then how many
    more there are, and where to find them all."""
    shown: list[str] = []
    size = 0
    for name in names:
        size += len(name) + 2
        if size > most_chars:
            break
        shown.append(name)
    if len(shown) == len(names):
        return f"[{', '.join(shown)}]"
    more = f"and {len(names) - len(shown)} more (RepositoryIndex lists them all)"
    return f"[{', '.join([*shown, more])}]"
