"""A generative family's requests as the router's data plane takes them, apart from their
admission (the plane's) and their climb (:mod:`router.cascade.generate`): the route a name
must resolve to, an OIP request read as the text cascade takes it, and what a generation
tells the observer beyond its answer (when its first text reached the client; each tier's
tokens, answered or discarded, and time).

:class:`router.dataplane.RouterDataPlane` admits and climbs both kinds of request alike;
these are the generative kind's alone and touch none of the plane's state (pure functions
of what they are handed), so the plane reads as the one door both kinds go through.
"""

from __future__ import annotations

from collections.abc import Callable

from router.cascade.generate import Generation, Sink
from router.catalog import Catalog, Route
from router.observer import RouterObserver
from stratus.convert.inference import InferRequest, TextRequest
from stratus.convert.text import text_request
from stratus.errors import NotFound
from stratus.families.generation import Chunk


def generative_route(catalog: Catalog, name: str) -> Route:
    """The route of a generative family's name; NotFound for any other name."""
    try:
        route = catalog.route(name)
    except NotFound:
        route = None
    if route is None or route.generative is None:
        raise NotFound(f"'{name}' is not a generative model this fleet serves")
    return route


def text_request_of(request: InferRequest, route: Route) -> TextRequest:
    """An OIP request for a generative family, read as the cascade takes it."""
    info = route.generative
    assert info is not None  # a generative route's
    return text_request(request, route.family, info.max_tokens)


def timing_first_text(
    sink: Sink, observer: RouterObserver, clock: Callable[[], float], family: str, started: float
) -> Sink:
    """``sink``, noting when the first text reaches it (``started`` and ``clock``: one clock's)."""
    seen = False

    async def timed(chunk: Chunk) -> None:
        nonlocal seen
        if not seen and chunk.text:
            seen = True
            observer.first_text(family, clock() - started)
        await sink(chunk)

    return timed


def count_generation(observer: RouterObserver, family: str, result: Generation) -> None:
    """Tokens each tier made, answered or discarded; escalations and each tier's time."""
    for tier, made in result.generated.items():
        answered = len(result.tokens) if tier is result.tier else 0
        for fate, count in (("answered", answered), ("discarded", made - answered)):
            observer.tokens(family, tier, fate, count)
    for tier, ms in result.timings_ms.items():
        observer.tier_time(family, tier, ms)
