"""What an agent's Hello says about the models loaded here (an AgentHello: each family served,
as described to a router; each variant, its runtime, precision, line and why it was chosen;
the families that could not be loaded), and what its heartbeats say (a LoadReport): values,
which ``stratus.convert.hello.hello_to_wire`` and ``stratus.convert.fleet.heartbeat_to_wire``
write, beside the readers a router uses."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from stratus import __version__
from stratus.convert.hardware import said_of
from stratus.execution.generators import LocalGenerators
from stratus.execution.local_models import LocalModels
from stratus.families.agent_hello import AgentHello, FamilyUnavailable, VariantServed
from stratus.families.description import FamilyDescription, described
from stratus.obs.stats import LoadReport
from stratus.tiers import Tier

# The most of a load failure's reason an agent's Hello carries.
_REASON_CHARS = 1000


@dataclass(frozen=True, kw_only=True)
class Introduction:
    """What a Hello says of the one serving, beside its models: an agent's own settings, or
    a router's for the tier it serves in its own process."""

    agent_id: str
    tier: Tier
    capacity: int  # runtime calls at once
    queue_limit: int  # Work that may wait beyond those running
    token: str = ""


def hello(models: LocalModels, who: Introduction, *, uptime_s: float) -> AgentHello:
    """The Hello that registers ``models`` with a router (and announces them again after a
    reload); :func:`stratus.convert.hello.hello_to_wire` writes it."""
    variants = variants_info(models)
    return AgentHello(
        agent_id=who.agent_id,
        tier=who.tier,
        host=socket.gethostname(),
        hardware=said_of(models.hardware),
        runtimes=tuple(sorted({info.runtime for info in variants})),
        variants=variants,
        capacity=who.capacity,
        queue_limit=who.queue_limit,
        token=who.token,
        version=__version__,
        families=families_info(models),
        unavailable=unavailable_info(models),
        uptime_s=uptime_s,
    )


def heartbeat(models: LocalModels, *, in_flight: int, reported: dict[str, int], received: int) -> LoadReport:
    """Load, and latency only for the variants that ran since this link's last heartbeat
    (``reported``: samples per variant then, updated here)."""
    latency = {}
    for name, window in models.latency.items():
        if reported.get(name) == window.count:
            continue
        reported[name] = window.count
        latency[name] = window.summary()
    return LoadReport(
        in_flight=in_flight, queue_length=models.batcher.waiting_items, latency=latency, received=received
    )


def families_info(models: LocalModels) -> tuple[FamilyDescription, ...]:
    served = {models.variants[name].family for name in models.served}
    generative = list(models.generators.families.values()) if models.generators is not None else []
    return (
        *map(described, generative),
        *[described(f) for f in models.families.values() if f.name in served],
    )


def variants_info(models: LocalModels) -> tuple[VariantServed, ...]:
    infos = []
    for name in sorted(models.served):
        said = models.runners[name].describe()
        infos.append(
            VariantServed(
                name=name,
                family=models.variants[name].family,
                runtime=said.runtime,
                device=said.device,
                precision=models.variants[name].precision,
                compute=said.compute,
                dynamic_batch=said.dynamic_batch,
                max_batch=models.max_batch(name),
                chosen_because=models.reasons.get(name, ""),
                line=models.variants[name].parent or name,
                current=name in models.current,
            )
        )
    if models.generators is not None:
        infos += _generator_infos(models.generators)
    return tuple(infos)


def unavailable_info(models: LocalModels) -> tuple[FamilyUnavailable, ...]:
    return tuple(  # bounded: a Hello is checked against a size limit at the router
        FamilyUnavailable(family=n.family, variant=n.variant, reason=n.reason[:_REASON_CHARS])
        for n in models.unavailable_families().values()
    )


def _generator_infos(generators: LocalGenerators) -> list[VariantServed]:
    return [
        VariantServed(
            name=name,
            family=variant.family,
            runtime=generators.runners[name].runtime,
            device="CPU",
            precision=variant.precision,
            kv_cache=generators.runners[name].kv_cache_precision,
            max_batch=1,
            chosen_because="generative"
            if generators.lines[name] == name
            else f"generative: the {variant.precision} file of {generators.lines[name]}",
            line=generators.lines[name],
            current=name in generators.current,
        )
        for name, variant in sorted(generators.variants.items())
    ]
