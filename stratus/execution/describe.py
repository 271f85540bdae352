"""What an agent's Hello says about the models loaded here: each family (tensors,
thresholds, audits, calibration, cloud variants) and each variant (runtime, precision,
line, why it was chosen), and the families that could not be loaded, in fleet.proto's types."""

from __future__ import annotations

import platform
import socket
from dataclasses import dataclass
from typing import Any

from stratus import __version__
from stratus.convert.fleet import latency_to_wire, thresholds_to_wire, wire_tier
from stratus.convert.hardware import to_wire as hardware_to_wire
from stratus.execution.generators import LocalGenerators
from stratus.execution.models import LocalModels
from stratus.families.audit import calibration_info
from stratus.families.spec import FamilySpec
from stratus.serving.servicer import tensor_metadata
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


def heartbeat(
    models: LocalModels, *, in_flight: int, reported: dict[str, int], received: int
) -> fleet_pb2.Heartbeat:
    """Load, and latency only for the variants that ran since this link's last heartbeat
    (``reported``: samples per variant then, updated here)."""
    latency = []
    for name, window in models.latency.items():
        if reported.get(name) == window.count:
            continue
        reported[name] = window.count
        latency.append(latency_to_wire(name, window.summary()))
    return fleet_pb2.Heartbeat(
        in_flight=in_flight, queue_length=models.batcher.waiting_items, latency=latency, received=received
    )


def families_info(models: LocalModels) -> list[fleet_pb2.FamilyInfo]:
    served = {models.variants[name].family for name in models.served}
    generative = list(models.generators.families.values()) if models.generators is not None else []
    return [
        *map(_family_info, generative),
        *[family_info(f) for f in models.families.values() if f.name in served],
    ]


def family_info(family: FamilySpec) -> fleet_pb2.FamilyInfo:
    """A family as a Hello describes it (as a router's own copy of the models folder reads it too)."""
    if family.generative:
        return _family_info(family)
    return fleet_pb2.FamilyInfo(
        name=family.name,
        inputs=tensor_metadata(family.inputs),
        outputs=tensor_metadata(family.outputs),
        thresholds=thresholds_to_wire(family.thresholds),
        cloud_variants=cloud_variants(family),
        calibrated_cloud_share=calibrated_cloud_share(family),
        **family_info_fields(family),
    )


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


def _family_info(family: FamilySpec) -> fleet_pb2.FamilyInfo:
    """A generative family as the router needs it: its tensors, thresholds and limits."""
    assert family.generation is not None
    return fleet_pb2.FamilyInfo(
        name=family.name,
        inputs=tensor_metadata(family.inputs),
        outputs=tensor_metadata(family.outputs),
        thresholds=thresholds_to_wire(family.thresholds),
        kind="generative",
        confidence_method=family.generation.method.value,
        max_tokens=family.generation.max_tokens,
        stop=family.generation.stop,
        cloud_variants=cloud_variants(family),
        calibrated_cloud_share=calibrated_cloud_share(family),
        **family_info_fields(family),
    )


def calibrated_cloud_share(family: FamilySpec) -> float | None:
    """What calibrate recorded the thresholds send to the cloud; None (the field stays unset,
    and the router exports no baseline) for thresholds never calibrated."""
    return family.calibration.cloud_share if family.calibration is not None else None


def cloud_variants(family: FamilySpec) -> list[str]:
    """The family's cloud-tier variants, its current line first, then that line's children."""
    current = family.current.get(Tier.CLOUD)
    names = [v.name for v in family.variants_for(Tier.CLOUD)]
    return sorted(names, key=lambda n: (n != current, not n.startswith(f"{current}-"), n))


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


def family_info_fields(family: FamilySpec) -> dict[str, Any]:
    """The FamilyInfo fields for a family's audits and privacy (keyword arguments of its constructor)."""
    audit = fleet_pb2.AuditSettings(compare=family.audit.compare, auto=family.audit.auto)
    if family.audit.share is not None:
        audit.share = family.audit.share
    if family.audit.max_per_s is not None:
        audit.max_per_s = family.audit.max_per_s
    calibrated = {tier.label: calibration_info(f) for tier, f in family.tier_accuracy.items()}
    offline = family.offline
    settings = fleet_pb2.OfflineSettings(
        defer=offline.defer, max_items=offline.max_items, max_bytes=offline.max_bytes, max_age_s=offline.max_age_s
    )
    return {"audit": audit, "calibrated": calibrated, "keep_on_site": not family.escalate, "offline": settings}
