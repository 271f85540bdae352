"""Which precision of a family an agent serves: what the CPU runs natively, within tolerance.

A family ships, per tier, an FP32 variant and lower-precision children (INT8, FP16) built
from it. A child is only worth serving where the hardware runs its arithmetic natively
(INT8 dot products: VNNI/AMX on x86, the dot-product extension on ARM; FP16 arithmetic:
AVX512-FP16/AMX-FP16, ARMv8.2 half precision) and where it was measured to lose no more
held-out accuracy than the family allows (``max_accuracy_drop``).

Agents hold no labelled data, so that measurement travels as a committed *verification
record* beside ``family.toml`` (``verified.toml``, written by ``models/build/`` and
``stratus models verify --record``): per variant, each file's SHA-256, the held-out
accuracy, the drop against its parent, the top-1 agreement with it and whether it is within
tolerance. A lower-precision variant with no record, a stale one (a file's hash differs) or
one outside tolerance is never chosen; FP32 needs no record.

What the CPU runs natively is read in :mod:`stratus.families.cpu`. Everything here is pure
apart from reading the record's files, and imports neither scikit-learn nor any runtime.
"""

from __future__ import annotations

import enum
import hashlib
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from stratus.errors import ConfigError, NotFound
from stratus.families.cpu import Hardware
from stratus.families.spec import FamilySpec, VariantSpec
from stratus.tiers import Tier

RECORD_NAME: Final = "verified.toml"
# Fewer bits first: without measurements, that is the order of expected speed.
BY_SPEED: Final = ("INT8", "FP16", "FP32")


class Precision(enum.StrEnum):
    """A precision an operator may pin (``--precision``); a str, as the variants' records spell
    it in upper case."""

    FP32 = "fp32"
    FP16 = "fp16"
    INT8 = "int8"


@dataclass(frozen=True, kw_only=True)
class VariantRecord:
    """What ``models verify`` measured for one variant (lowest over the runtimes it ran in)."""

    name: str
    precision: str
    parent: str | None
    sha256: Mapping[str, str]  # file name (relative to the family folder) -> hex digest
    accuracy: float
    accuracy_drop: float
    agreement: float  # top-1 agreement with the parent; 1.0 for FP32
    within_tolerance: bool
    runtimes: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class VerificationRecord:
    family: str
    max_accuracy_drop: float
    variants: Mapping[str, VariantRecord]
    source: Path

    def problem(self, family: FamilySpec, variant: VariantSpec) -> str | None:
        """Why this record cannot vouch for ``variant`` now, or None when it can."""
        entry = self.variants.get(variant.name)
        if entry is None:
            return f"no record of {variant.name} in {self.source.name}"
        if entry.parent != variant.parent or entry.precision != variant.precision:
            return f"record of {variant.name} is stale (its parent or precision changed)"
        changed = _changed_files(family, variant, entry) or self._parent_changed(family, variant)
        if changed:
            return f"record of {variant.name} is stale ({changed} changed since it was verified)"
        if entry.accuracy_drop > family.max_accuracy_drop + 1e-9:
            return f"outside tolerance: drop {entry.accuracy_drop:.3f} > {family.max_accuracy_drop:.3f}"
        return None

    def _parent_changed(self, family: FamilySpec, variant: VariantSpec) -> str | None:
        """A child's drop was measured against its parent's files: those must not move either."""
        if variant.parent is None:
            return None
        entry = self.variants.get(variant.parent)
        if entry is None:
            return f"parent {variant.parent}"
        return _changed_files(family, family.variant(variant.parent), entry)


def _changed_files(family: FamilySpec, variant: VariantSpec, entry: VariantRecord) -> str | None:
    for path in variant.files.values():
        for part in _artifact_files(path):
            name = part.relative_to(family.folder).as_posix()
            if entry.sha256.get(name) != file_sha256(part):
                return name
    return None


def _artifact_files(path: Path) -> list[Path]:
    """A format's files on disk: an OpenVINO IR is its ``.xml`` and its ``.bin``."""
    weights = path.with_suffix(".bin")
    return [path, weights] if path.suffix == ".xml" and weights.is_file() else [path]


def variant_files(family: FamilySpec, variant: VariantSpec) -> dict[str, Path]:
    """Every file of a variant, by name relative to the family folder (for hashing, sizing)."""
    return {
        part.relative_to(family.folder).as_posix(): part
        for path in variant.files.values()
        for part in _artifact_files(path)
    }


def file_sha256(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return "unreadable"


def record_path(family: FamilySpec | Path) -> Path:
    folder = family.folder if isinstance(family, FamilySpec) else Path(family)
    return folder / RECORD_NAME


def load_verification(family: FamilySpec | Path) -> VerificationRecord | None:
    """The family's committed record, or None when there is none.

    ``family`` is a loaded family or its folder. A malformed record is a ConfigError: it
    would otherwise silently turn every lower precision off.
    """
    path = record_path(family)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the verification record: {exc}") from None
    try:
        return _parse_record(data, path)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: malformed verification record ({type(exc).__name__}: {exc})") from None


def _parse_record(data: Mapping[str, Any], path: Path) -> VerificationRecord:
    head = data["family"]
    variants = {}
    for name, table in data.get("variants", {}).items():
        variants[name] = VariantRecord(
            name=name,
            precision=str(table["precision"]),
            parent=table.get("parent"),
            sha256={str(k): str(v) for k, v in table["sha256"].items()},
            accuracy=float(table["accuracy"]),
            accuracy_drop=float(table["accuracy_drop"]),
            agreement=float(table["agreement"]),
            within_tolerance=bool(table["within_tolerance"]),
            runtimes=tuple(str(r) for r in table.get("runtimes", ())),
        )
    return VerificationRecord(
        family=str(head["name"]),
        max_accuracy_drop=float(head["max_accuracy_drop"]),
        variants=variants,
        source=path,
    )


def format_record(record: VerificationRecord) -> str:
    """The record as TOML, in a fixed order with rounded figures, so rewrites diff cleanly."""
    lines = [
        "# Written by models/build/ and `stratus models verify --record`; do not edit by hand.",
        "# Held-out figures are the lowest over the runtimes listed; agents trust a lower-precision",
        "# variant only while every file hash below still matches (see stratus/families/precision.py).",
        "",
        "[family]",
        f'name = "{record.family}"',
        f"max_accuracy_drop = {record.max_accuracy_drop:.4f}",
    ]
    for entry in record.variants.values():
        lines += ["", f'[variants."{entry.name}"]', f'precision = "{entry.precision}"']
        lines += [f'parent = "{entry.parent}"'] if entry.parent else []
        lines += [
            f"accuracy = {entry.accuracy:.4f}",
            f"accuracy_drop = {entry.accuracy_drop:.4f}",
            f"agreement = {entry.agreement:.4f}",
            f"within_tolerance = {'true' if entry.within_tolerance else 'false'}",
            "runtimes = [" + ", ".join(f'"{r}"' for r in entry.runtimes) + "]",
            f'[variants."{entry.name}".sha256]',
            *(f'"{name}" = "{digest}"' for name, digest in sorted(entry.sha256.items())),
        ]
    return "\n".join(lines) + "\n"


def write_verification(record: VerificationRecord) -> None:
    record.source.write_text(format_record(record), encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# The choice
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PrecisionChoice:
    variant: VariantSpec
    reason: str


def choose_variant(
    family: FamilySpec,
    tier: Tier,
    *,
    hardware: Hardware,
    record: VerificationRecord | None,
    override: str | None = None,
    measured_ms: Mapping[str, float] | None = None,
    line: VariantSpec | None = None,
) -> PrecisionChoice:
    """The variant of ``tier`` to serve: the fastest that is native here and within tolerance.

    The choice is among one *line*: an FP32 variant and the lower-precision variants made
    from it; by default the tier's current variant. Fastest is the lowest ``measured_ms``
    (by variant name) when given, else fewer bits. ``override`` ("fp32", "fp16", "int8")
    forces a precision even where it is not native, but never a variant the record does
    not vouch for.
    """
    candidates = _line_variants(family, tier, line)
    if override is not None:
        return _forced(family, tier, candidates, override.strip().upper(), record)
    trusted, reasons = [], []
    for variant in candidates:
        problem = _trust_problem(family, variant, record)
        # a line's own root (FP32, or a generative model shipped in FP16) is its reference
        if problem is None and (variant.parent is None or hardware.native(variant.precision)):
            trusted.append(variant)
        elif variant.precision != "FP32":
            reasons.append(problem or f"{variant.precision.lower()} not native")
    if not trusted:
        raise NotFound(f"family '{family.name}' has no usable {tier.label} variant: {'; '.join(reasons)}")
    best = min(trusted, key=lambda v: _speed_key(v, measured_ms))
    return PrecisionChoice(variant=best, reason=_why(family, best, hardware, record, reasons))


def _line_variants(family: FamilySpec, tier: Tier, line: VariantSpec | None) -> list[VariantSpec]:
    if not family.variants_for(tier):
        raise NotFound(f"family '{family.name}' has no {tier.label} variant")
    return list(family.line_of(line or family.current_variant(tier)))


def _trust_problem(family: FamilySpec, variant: VariantSpec, record: VerificationRecord | None) -> str | None:
    """Why a variant may not be served on accuracy grounds; a line's root is the reference."""
    if variant.parent is None:
        return None
    if record is None:
        return f"{variant.name}: no verification record ({RECORD_NAME})"
    problem = record.problem(family, variant)
    return f"{variant.name}: {problem}" if problem else None


def _speed_key(variant: VariantSpec, measured_ms: Mapping[str, float] | None) -> tuple[float, int]:
    rank = BY_SPEED.index(variant.precision)
    if measured_ms is not None and variant.name in measured_ms:
        return measured_ms[variant.name], rank
    return (float("inf") if measured_ms else 0.0), rank


def _forced(
    family: FamilySpec,
    tier: Tier,
    candidates: list[VariantSpec],
    precision: str,
    record: VerificationRecord | None,
) -> PrecisionChoice:
    if precision not in BY_SPEED:
        raise ConfigError(f"--precision '{precision.lower()}' is not one of fp32, fp16, int8")
    matching = [v for v in candidates if v.precision == precision]
    if not matching:
        raise NotFound(f"family '{family.name}' has no {precision} variant on the {tier.label} tier")
    problems = [_trust_problem(family, v, record) for v in matching]
    for variant, problem in zip(matching, problems, strict=True):
        if problem is None:
            return PrecisionChoice(variant=variant, reason=f"{precision.lower()}: forced by --precision")
    raise ConfigError(
        f"--precision {precision.lower()} refused for '{family.name}': {'; '.join(map(str, problems))}"
    )


def _why(
    family: FamilySpec,
    chosen: VariantSpec,
    hardware: Hardware,
    record: VerificationRecord | None,
    passed_over: list[str],
) -> str:
    """One sentence: the precision, why the hardware allows it, and the accuracy it costs."""
    label = chosen.precision.lower()
    if chosen.precision == "FP32":
        if passed_over and hardware.precisions != {"FP32"}:
            return f"{label}: {'; '.join(passed_over)}"
        return f"{label}: {hardware.reason}" if hardware.precisions == {"FP32"} else f"{label}: fastest here"
    entry = record.variants[chosen.name] if record is not None else None
    drop = f", drop {entry.accuracy_drop:.3f} ≤ {family.max_accuracy_drop:.3f}" if entry else ""
    return f"{label}: native ({hardware.reason}){drop}"
