"""An agent's hardware on the wire: what its Hello says it runs on, and how operators read it.

One place converts :class:`stratus.families.precision.Hardware` to ``HardwareInfo`` (the agent) and
bounds what arrives (the router): a Hello comes from a stranger, and these strings end up in
log lines and in every status, so each is cut to printable ASCII and a fixed length first.
"""

from __future__ import annotations

import re
from typing import Final

from stratus.families.agent_hello import HardwareSaid
from stratus.families.cpu import Hardware
from stratus.families.precision import BY_SPEED
from stratus.wire import fleet_pb2 as fpb

MAX_TEXT: Final = 128
MAX_FLAGS: Final = 32
_FLAG: Final = re.compile(r"[a-z0-9_]{1,32}")
_UNPRINTABLE: Final = re.compile(r"[^\x20-\x7e]")


def said_of(hardware: Hardware) -> HardwareSaid:
    """What an agent says of the hardware its precision choice read: its precisions, fastest first."""
    return HardwareSaid(
        machine=hardware.machine,
        cpu_model=hardware.model,
        flags=tuple(hardware.flags),
        flags_from=hardware.flags_from,
        precisions=tuple(p for p in BY_SPEED if hardware.native(p)),
    )


def to_wire(said: HardwareSaid) -> fpb.HardwareInfo:
    """The hardware as a Hello (an agent's, :func:`said_of` its probe) or status (as a router read it) says it."""
    return fpb.HardwareInfo(
        machine=said.machine,
        cpu_model=said.cpu_model,
        flags=said.flags,
        flags_from=said.flags_from,
        precisions=said.precisions,
    )


def from_hello(hello: fpb.Hello) -> HardwareSaid:
    """The Hello's hardware, bounded; from the plain ``hardware`` string ("aarch64 ...") where
    an older agent sent no ``hardware_info``. Never refuses: a CPU's name is no reason to turn
    an agent away, so what is out of bounds is cut or dropped instead."""
    info = hello.hardware_info
    if not hello.HasField("hardware_info"):
        return HardwareSaid(machine=_text(hello.hardware.split(" ")[0]))
    return HardwareSaid(
        machine=_text(info.machine),
        cpu_model=_text(info.cpu_model),
        flags=tuple(f for f in info.flags[:MAX_FLAGS] if _FLAG.fullmatch(f)),
        flags_from=_text(info.flags_from),
        precisions=tuple(p for p in BY_SPEED if p in info.precisions),
    )


def describe(info: fpb.HardwareInfo | HardwareSaid) -> str:
    """One line: "aarch64 Cortex-A76, native int8 fp16 (hwcap: asimddp, asimdhp)"."""
    head = " ".join(part for part in (info.machine or "unknown", info.cpu_model) if part)
    lower = [p.lower() for p in info.precisions if p != "FP32"]
    native = f"native {' '.join(lower)}" if lower else "fp32 only"
    flags = (
        f" ({info.flags_from + ': ' if info.flags_from else ''}{', '.join(info.flags)})" if info.flags else ""
    )
    return f"{head}, {native}{flags}"


def _text(value: str) -> str:
    return _UNPRINTABLE.sub("?", value[:MAX_TEXT])
