"""What an agent's Hello says about the models loaded here: each family served (written by
``stratus.convert.fleet.family_to_wire``, beside the reader a router uses), each variant
(runtime, precision, line, why it was chosen), and the families that could not be loaded,
in fleet.proto's types; and what its heartbeats say (a LoadReport, which
``stratus.convert.fleet.heartbeat_to_wire`` writes)."""

from __future__ import annotations

import platform
import socket
from dataclasses import dataclass

from stratus import __version__
from stratus.convert.fleet import family_to_wire, wire_tier
from stratus.convert.hardware import to_wire as hardware_to_wire
from stratus.execution.generators import LocalGenerators
from stratus.execution.local_models import LocalModels
from stratus.obs.stats import LoadReport
from stratus.tiers import Tier
from stratus.wire import fleet_pb2

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


def hello(models: LocalModels, who: Introduction, *, uptime_s: float) -> fleet_pb2.Hello:
    """The Hello that registers ``models`` with a router (and announces them again after a reload)."""
    return fleet_pb2.Hello(
        agent_id=who.agent_id,
        tier=wire_tier(who.tier),
        host=socket.gethostname(),
        hardware=f"{platform.machine()} {models.hardware.model}".strip(),
        hardware_info=hardware_to_wire(models.hardware),
        runtimes=sorted({info.runtime for info in variants_info(models)}),
        variants=variants_info(models),
        capacity=who.capacity,
        token=who.token,
        version=__version__,
        families=families_info(models),
        queue_limit=who.queue_limit,
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


def families_info(models: LocalModels) -> list[fleet_pb2.FamilyInfo]:
    served = {models.variants[name].family for name in models.served}
    generative = list(models.generators.families.values()) if models.generators is not None else []
    return [
        *map(family_to_wire, generative),
        *[family_to_wire(f) for f in models.families.values() if f.name in served],
    ]


def variants_info(models: LocalModels) -> list[fleet_pb2.VariantInfo]:
    infos = []
    for name in sorted(models.served):
        described = models.runners[name].describe()
        infos.append(
            fleet_pb2.VariantInfo(
                name=name,
                family=models.variants[name].family,
                runtime=described.runtime,
                device=described.device,
                precision=models.variants[name].precision,
                compute=described.compute,
                dynamic_batch=described.dynamic_batch,
                max_batch=models.max_batch(name),
                chosen_because=models.reasons.get(name, ""),
                line=models.variants[name].parent or name,
                current=name in models.current,
            )
        )
    if models.generators is not None:
        infos += _generator_infos(models.generators)
    return infos


def unavailable_info(models: LocalModels) -> list[fleet_pb2.FamilyUnavailable]:
    return [  # bounded: a Hello is checked against a size limit at the router
        fleet_pb2.FamilyUnavailable(family=n.family, variant=n.variant, reason=n.reason[:_REASON_CHARS])
        for n in models.unavailable_families().values()
    ]


def _generator_infos(generators: LocalGenerators) -> list[fleet_pb2.VariantInfo]:
    return [
        fleet_pb2.VariantInfo(
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

