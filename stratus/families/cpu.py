"""What this CPU runs natively, and how Stratus finds out: the flags behind each precision.

A lower-precision child is only worth serving where the hardware runs its arithmetic
natively (INT8 dot products: VNNI/AMX on x86, the dot-product extension on ARM; FP16
arithmetic: AVX512-FP16/AMX-FP16, ARMv8.2 half precision): :func:`this_hardware` reads that
from ``/proc/cpuinfo``, from the kernel's HWCAP words on aarch64, or from
``STRATUS_CPU_FLAGS``; :mod:`stratus.families.precision` chooses among a family's variants
with it. Pure apart from reading those flags; imports no runtime.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

# CPU flags (as /proc/cpuinfo spells them) that give native arithmetic for a precision.
_X86_INT8: Final = ("avx512_vnni", "avx512vnni", "avx_vnni", "avxvnni", "amx_int8")
_X86_FP16: Final = ("avx512_fp16", "avx512fp16", "amx_fp16")
_ARM_INT8: Final = ("asimddp",)
_ARM_FP16: Final = ("fphp", "asimdhp")
_ARM_MACHINES: Final = ("aarch64", "arm64")
# By precision, then by architecture: the flags that make it native (what the choice reads).
NATIVE_FLAGS: Final[Mapping[str, Mapping[str, tuple[str, ...]]]] = {
    "INT8": {"x86": _X86_INT8, "ARM": _ARM_INT8},
    "FP16": {"x86": _X86_FP16, "ARM": _ARM_FP16},
}


def native_on(precision: str) -> str:
    """The CPUs that run ``precision`` natively, in words: where an agent would choose a child
    of that precision (FP32: every CPU)."""
    by_arch = NATIVE_FLAGS.get(precision.upper())
    if by_arch is None:
        return "every CPU"
    return "; ".join(f"{arch} CPUs with {_either(flags)}" for arch, flags in by_arch.items())


def _either(names: tuple[str, ...]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """The precisions this CPU runs natively (FP32 always) and the flags that say so.

    ``machine``, ``model``, ``flags`` and ``flags_from`` travel in the agent's Hello, so the
    router can show what each agent runs on and why it chose what it serves: ``flags`` are
    the ones the choice turned on (or, with none, the basic ones it looked for)."""

    precisions: frozenset[str]
    reason: str
    machine: str = ""
    model: str = ""
    flags: tuple[str, ...] = ()
    flags_from: str = ""  # "hwcap", "/proc/cpuinfo" or STRATUS_CPU_FLAGS

    def native(self, precision: str) -> bool:
        return precision.upper() in self.precisions


def hardware_precisions(
    flags: Iterable[str] | None = None,
    machine: str | None = None,
    *,
    model: str = "",
    flags_from: str = "",
) -> Hardware:
    """Native precisions from CPU flags (this CPU's, see :func:`machine_flags`, when not given).

    Deliberately not OpenVINO's ``OPTIMIZATION_CAPABILITIES``: it lists INT8 on any AVX2
    CPU, where INT8 is emulated and no faster than FP32.
    """
    arch = (machine if machine is not None else platform.machine()).lower()
    if flags is None:
        flags, flags_from = machine_flags(arch)
    found = {f.lower() for f in flags}
    arm = arch in _ARM_MACHINES
    int8 = sorted(found & set(_ARM_INT8 if arm else _X86_INT8))
    fp16 = sorted(found & set(_ARM_FP16 if arm else _X86_FP16))
    precisions = {"FP32"} | ({"INT8"} if int8 else set()) | ({"FP16"} if fp16 else set())
    used = [*int8, *fp16] or sorted(found & {"avx2", "f16c", "avx512f", "neon", "asimd", "fma"})
    if int8 or fp16:
        reason = f"cpu flags: {', '.join(used)}"
    else:
        reason = f"no native int8/fp16 on this CPU ({', '.join(used) or arch or 'unknown'})"
    return Hardware(
        precisions=frozenset(precisions),
        reason=reason,
        machine=arch,
        model=model,
        flags=tuple(used),
        flags_from=flags_from,
    )


# Stands in for the CPU's own flags (comma-separated, as /proc/cpuinfo spells them): for a
# container that hides them, and to run the precision choice of another CPU on this one.
CPU_FLAGS_VARIABLE: Final = "STRATUS_CPU_FLAGS"


def this_hardware(environ: Mapping[str, str] | None = None) -> Hardware:
    """This machine's native precisions: from ``STRATUS_CPU_FLAGS`` where it is set (read
    when called, never at import), else from the CPU's own flags."""
    flags = (os.environ if environ is None else environ).get(CPU_FLAGS_VARIABLE)
    if flags is None:
        return hardware_precisions(model=cpu_model())
    listed = [f.strip() for f in flags.split(",") if f.strip()]
    return hardware_precisions(flags=listed, model=cpu_model(), flags_from=CPU_FLAGS_VARIABLE)


def machine_flags(machine: str) -> tuple[set[str], str]:
    """This CPU's flags, and where they were read. On aarch64 Linux from the kernel's HWCAP
    words (what ``/proc/cpuinfo`` prints its Features from, and what an emulator such as QEMU
    sets for the CPU it emulates, where it may pass the host's x86 cpuinfo through); else, or
    when HWCAP says nothing, from ``/proc/cpuinfo``."""
    if machine in _ARM_MACHINES:
        hwcap = arm_hwcap_flags()
        if hwcap:
            return set(hwcap), "hwcap"
    return cpu_flags(), "/proc/cpuinfo"


def cpu_flags(path: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The first processor's flags (x86 ``flags``, ARM ``Features``); empty when unreadable."""
    for key, value in _cpuinfo_fields(path):
        if key in ("flags", "features"):
            return set(value.split())
    return set()


# The names Linux gives the aarch64 HWCAP and HWCAP2 bits, in bit order (arch/arm64/include/
# uapi/asm/hwcap.h; /proc/cpuinfo spells them the same). Later HWCAP2 bits are left out.
_HWCAP: Final = (
    "fp", "asimd", "evtstrm", "aes", "pmull", "sha1", "sha2", "crc32", "atomics", "fphp", "asimdhp",
    "cpuid", "asimdrdm", "jscvt", "fcma", "lrcpc", "dcpop", "sha3", "sm3", "sm4", "asimddp", "sha512",
    "sve", "asimdfhm", "dit", "uscat", "ilrcpc", "flagm", "ssbs", "sb", "paca", "pacg",
)  # fmt: skip
_HWCAP2: Final = (
    "dcpodp", "sve2", "sveaes", "svepmull", "svebitperm", "svesha3", "svesm4", "flagm2", "frint",
    "svei8mm", "svef32mm", "svef64mm", "svebf16", "i8mm", "bf16",
)  # fmt: skip
_AT_HWCAP: Final = 16
_AT_HWCAP2: Final = 26


def arm_hwcap_flags(getauxval: Callable[[int], int] | None = None) -> list[str]:
    """The aarch64 features the kernel (or the emulator) reports in the auxiliary vector, by
    their cpuinfo names; empty where ``getauxval`` is missing or says nothing (not Linux)."""
    read = getauxval or _libc_getauxval()
    if read is None:
        return []
    return decode_hwcap(read(_AT_HWCAP), read(_AT_HWCAP2))


def decode_hwcap(hwcap: int, hwcap2: int = 0) -> list[str]:
    """Feature names of the set bits, HWCAP's first."""
    return [n for bit, n in enumerate(_HWCAP) if hwcap >> bit & 1] + [
        n for bit, n in enumerate(_HWCAP2) if hwcap2 >> bit & 1
    ]


def _libc_getauxval() -> Callable[[int], int] | None:
    import ctypes

    try:
        function = ctypes.CDLL(None).getauxval
    except (AttributeError, OSError):
        return None
    function.argtypes, function.restype = [ctypes.c_ulong], ctypes.c_ulong
    return lambda kind: int(function(kind))


# Arm Ltd. (implementer 0x41) CPU parts as /proc/cpuinfo gives them: ARM kernels print no
# model name.
_ARM_PARTS: Final = {
    "0xd03": "Cortex-A53", "0xd04": "Cortex-A35", "0xd05": "Cortex-A55", "0xd07": "Cortex-A57",
    "0xd08": "Cortex-A72", "0xd09": "Cortex-A73", "0xd0a": "Cortex-A75", "0xd0b": "Cortex-A76",
    "0xd0c": "Neoverse-N1", "0xd0d": "Cortex-A77", "0xd41": "Cortex-A78", "0xd40": "Neoverse-V1",
    "0xd49": "Neoverse-N2", "0xd4f": "Neoverse-V2",
}  # fmt: skip


def cpu_model(path: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's name for an operator: x86 ``model name``, or an ARM core from its part number;
    empty when cpuinfo says neither."""
    fields = dict(reversed(list(_cpuinfo_fields(path))))  # the first processor's, where repeated
    if fields.get("model name"):
        return fields["model name"]
    part = fields.get("cpu part", "").lower()
    if fields.get("cpu implementer", "").lower() == "0x41" and part in _ARM_PARTS:
        return _ARM_PARTS[part]
    return fields.get("hardware") or fields.get("model", "")


def _cpuinfo_fields(path: Path) -> Iterator[tuple[str, str]]:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            yield key.strip().lower(), value.strip()


# ---------------------------------------------------------------------------------------------
# The verification record
# ---------------------------------------------------------------------------------------------
