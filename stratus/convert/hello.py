"""An agent's Hello ⇄ :class:`~stratus.families.agent_hello.AgentHello`, bounded as it is read:
the one codec of the Hello, which an agent writes and a router reads.

A Hello comes from a stranger until its credential is checked; its ids and names end up in
logs, status and metrics labels, so :func:`check_hello_bounds` holds them to a plain charset
of bounded length, and its counts to a bound (the security review's F12), before the router
keeps anything of it. :func:`hello_from_wire` then reads the whole Hello into values once:
its families as descriptions, its hardware cut to what status shows.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Final

from stratus.convert.fleet import family_from_wire, family_to_wire, thresholds_from_wire, wire_tier
from stratus.convert.hardware import from_hello as hardware_from_hello
from stratus.convert.hardware import to_wire as hardware_to_wire
from stratus.errors import InvalidInput
from stratus.families.agent_hello import AgentHello, FamilyUnavailable, VariantServed
from stratus.families.audit import check_family_info
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb

NAME: Final = re.compile(r"[A-Za-z0-9._:@-]{1,128}")
VERSION: Final = re.compile(r"[A-Za-z0-9.+_-]{0,64}")  # a PEP 440 version ("0.1.0", "0.2.0rc1+g3f2a"), or none
MAX_VARIANTS_PER_AGENT: Final = 64  # a shipped agent has 6; 256 let one Hello hold 77 kB of names
MAX_FAMILIES_PER_HELLO: Final = 64


def check_hello_bounds(hello: fpb.Hello) -> None:
    """Refuse a Hello whose names or counts are past what the router keeps (INVALID_ARGUMENT):
    ids and names are a plain charset, 128 characters at most, so a log line or a status
    cannot be forged or flooded through them."""
    if not NAME.fullmatch(hello.agent_id):
        raise InvalidInput(f"Hello.agent_id {hello.agent_id[:40]!r} must be 1-128 of A-Z a-z 0-9 . _ : @ -")
    if not VERSION.fullmatch(hello.version):
        raise InvalidInput(
            f"Hello from {hello.agent_id}: version {hello.version[:40]!r} must be 0-64 of A-Z a-z 0-9 . + _ -"
        )
    if len(hello.variants) > MAX_VARIANTS_PER_AGENT or len(hello.families) > MAX_FAMILIES_PER_HELLO:
        raise InvalidInput(
            f"Hello from {hello.agent_id}: {len(hello.variants)} variants and {len(hello.families)} families; "
            f"at most {MAX_VARIANTS_PER_AGENT} and {MAX_FAMILIES_PER_HELLO}"
        )
    for family in hello.families:
        check_family_info(hello.agent_id, family)
        thresholds_from_wire(family.thresholds, f"Hello from {hello.agent_id}: family {family.name[:40]!r}")
    names = [v.name for v in hello.variants] + [v.family for v in hello.variants] + [f.name for f in hello.families]
    bad = next((name for name in names if not NAME.fullmatch(name)), None)
    if bad is not None:
        raise InvalidInput(
            f"Hello from {hello.agent_id}: model name {bad[:40]!r} must be 1-128 of A-Z a-z 0-9 . _ : @ -"
        )
    for family in hello.families:
        share = family.calibrated_cloud_share
        if family.HasField("calibrated_cloud_share") and not 0.0 <= share <= 1.0:  # NaN fails too
            raise InvalidInput(
                f"Hello from {hello.agent_id}: family {family.name}'s calibrated_cloud_share {share} "
                "must lie between 0 and 1"
            )
    if hello.tier == fpb.TIER_UNSPECIFIED:
        raise InvalidInput(f"Hello from {hello.agent_id}: tier is unspecified")
    if not hello.variants:
        raise InvalidInput(f"Hello from {hello.agent_id}: no variants")


def hello_from_wire(hello: fpb.Hello) -> AgentHello:
    """The Hello, bounded (:func:`check_hello_bounds`), as values."""
    check_hello_bounds(hello)
    return AgentHello(
        agent_id=hello.agent_id,
        tier=Tier.from_wire(hello.tier),
        host=hello.host,
        hardware=hardware_from_hello(hello),
        runtimes=tuple(hello.runtimes),
        variants=tuple(variant_from_wire(v) for v in hello.variants),
        capacity=hello.capacity,
        queue_limit=hello.queue_limit,
        token=hello.token,
        version=hello.version,
        families=tuple(family_from_wire(f) for f in hello.families),
        unavailable=tuple(FamilyUnavailable(**_fields(FamilyUnavailable, u)) for u in hello.unavailable),
        uptime_s=hello.uptime_s,
    )


def variant_from_wire(info: fpb.VariantInfo) -> VariantServed:
    return VariantServed(**_fields(VariantServed, info))


def hello_to_wire(hello: AgentHello) -> fpb.Hello:
    """What :func:`hello_from_wire` reads back (and ``hardware`` in words, for an older router)."""
    return fpb.Hello(
        agent_id=hello.agent_id,
        tier=wire_tier(hello.tier),
        host=hello.host,
        hardware=f"{hello.hardware.machine} {hello.hardware.cpu_model}".strip(),
        hardware_info=hardware_to_wire(hello.hardware),
        runtimes=hello.runtimes,
        variants=[variant_to_wire(v) for v in hello.variants],
        capacity=hello.capacity,
        queue_limit=hello.queue_limit,
        token=hello.token,
        version=hello.version,
        families=[family_to_wire(f) for f in hello.families],
        unavailable=[fpb.FamilyUnavailable(**_fields(FamilyUnavailable, u)) for u in hello.unavailable],
        uptime_s=hello.uptime_s,
    )


def variant_to_wire(variant: VariantServed) -> fpb.VariantInfo:
    return fpb.VariantInfo(**_fields(VariantServed, variant))


def _fields(value_type: type[Any], source: object) -> dict[str, Any]:
    """``value_type``'s fields as ``source`` holds them: the value types name each field as
    their message does (VariantServed as VariantInfo, FamilyUnavailable as its message)."""
    return {f.name: getattr(source, f.name) for f in dataclasses.fields(value_type)}

