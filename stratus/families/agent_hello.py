"""What an agent says of itself when it links to a router (its Hello), as values: who it is, on
which tier and hardware, the variants it serves and how each runs there, the families it
describes, and those it could not load. Read from the wire once, at the router's door
(:func:`stratus.convert.hello.hello_from_wire`, which bounds every field); the registry, its
handles and the fleet's status keep these, never the message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stratus.families.description import FamilyDescription
from stratus.tiers import Tier


@dataclass(frozen=True, kw_only=True)
class VariantServed:
    """One variant an agent serves: how it runs there (runtime, device, precision it computes
    in, its batch), why the agent chose it, and the FP32 line it belongs to."""

    name: str
    family: str
    runtime: str = ""
    device: str = ""
    precision: str = ""
    compute: str = ""  # the precision it computes in, as the runtime read it back
    dynamic_batch: bool = False
    max_batch: int = 0
    chosen_because: str = ""
    line: str = ""  # the FP32 variant it was made from (itself for an FP32 one)
    current: bool = False  # its line is the tier's current one (else a rollout candidate)
    kv_cache: str = ""  # a generative variant's KV-cache precision


@dataclass(frozen=True, kw_only=True)
class FamilyUnavailable:
    """A family an agent could not serve (its files failed to load, or the router refused its
    description), and why."""

    family: str
    variant: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class HardwareSaid:
    """The hardware an agent runs on, as its precision choice read it: for operators."""

    machine: str = ""
    cpu_model: str = ""
    flags: tuple[str, ...] = ()
    flags_from: str = ""  # where the flags were read ("hwcap", "cpuinfo", "STRATUS_CPU_FLAGS")
    precisions: tuple[str, ...] = ()  # those it runs natively, fastest first


@dataclass(frozen=True, kw_only=True)
class AgentHello:
    """One Hello: the agent, its tier and declared sizes (clamped by the registry, which trusts
    only what it measures), what it serves and how, and what it could not load."""

    agent_id: str
    tier: Tier
    host: str = ""
    hardware: HardwareSaid = field(default_factory=HardwareSaid)
    runtimes: tuple[str, ...] = ()
    variants: tuple[VariantServed, ...] = ()
    capacity: int = 0  # runtime calls at once, as declared
    queue_limit: int = 0  # Work that may wait beyond those, as declared
    token: str = ""
    version: str = ""
    families: tuple[FamilyDescription, ...] = ()
    unavailable: tuple[FamilyUnavailable, ...] = ()
    uptime_s: float = 0.0
