"""The model repository: one folder per family, each with a ``family.toml``.

A request names a *family* (``digits``) or one of its *variants* (``digits-large``). The
config says what goes in and out, how outputs become a confidence, each tier's escalation
threshold, and which files each variant ships in which format. A malformed config is
refused with a message naming the file, the key and the problem: a fleet that loads a
half-understood config would route on numbers nobody meant.

The specs a config becomes are in ``stratus.families.spec``; the ``[[variants]]`` and
``[current]`` tables are read in ``stratus.families.variant_table``, every value through
``stratus.families.toml_reader``; rewriting a config's thresholds is ``stratus.families.writer``.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from stratus import datatypes
from stratus.errors import ConfigError, NotFound
from stratus.families.audit import parse_audit, parse_tier_accuracy
from stratus.families.confidence import ConfidenceMethod, threshold_problem
from stratus.families.generation import TEXT_INPUT, TEXT_OUTPUT, GenerationMethod
from stratus.families.offline import parse_offline
from stratus.families.spec import (
    CalibrationRecord,
    ConfidenceSpec,
    FamilySpec,
    GenerationSpec,
    TensorSpec,
    VariantSpec,
)
from stratus.families.toml_reader import TableReader
from stratus.families.variant_table import read_current, read_variants
from stratus.tiers import Tier

CONFIG_NAME: Final = "family.toml"
KINDS: Final = ("classifier", "generative")
# The top-level tables a family.toml may hold.
TABLES: Final = {
    "family", "inputs", "outputs", "confidence", "thresholds", "calibration", "variants", "current", "generation",
}  # fmt: skip


@dataclass(frozen=True)
class ModelRepository:
    """Every family found under one folder."""

    root: Path
    families: Mapping[str, FamilySpec] = field(default_factory=dict)

    @classmethod
    def load(cls, root: Path | str) -> ModelRepository:
        root = Path(root)
        if not root.is_dir():
            raise ConfigError(f"{root}: model repository folder does not exist")
        families = {}
        for path in sorted(root.glob(f"*/{CONFIG_NAME}")):
            family = load_family(path)
            if family.name in families:
                raise ConfigError(f"{path}: family '{family.name}' is also defined elsewhere in {root}")
            families[family.name] = family
        if not families:
            raise ConfigError(f"{root}: no */{CONFIG_NAME} found")
        repository = cls(root, families)
        repository._check_unique_variants()
        return repository

    def _check_unique_variants(self) -> None:
        seen: dict[str, str] = {}
        for family in self.families.values():
            for variant in family.variants:
                if variant.name in seen or variant.name in self.families:
                    raise ConfigError(f"{family.source}: variant name '{variant.name}' is not unique")
                seen[variant.name] = family.name

    def family(self, name: str) -> FamilySpec:
        try:
            return self.families[name]
        except KeyError:
            raise NotFound(f"unknown model '{name}'; known families: {sorted(self.families)}") from None

    def variant(self, name: str) -> VariantSpec:
        for family in self.families.values():
            for variant in family.variants:
                if variant.name == name:
                    return variant
        raise NotFound(f"unknown variant '{name}'")

    def resolve(self, model_name: str) -> tuple[FamilySpec, VariantSpec | None]:
        """A request's model name as (family, pinned variant or None)."""
        if model_name in self.families:
            return self.families[model_name], None
        variant = self.variant(model_name) if self._has_variant(model_name) else None
        if variant is None:
            known = sorted([*self.families, *(v.name for f in self.families.values() for v in f.variants)])
            raise NotFound(f"unknown model '{model_name}'; known models: {known}")
        return self.families[variant.family], variant

    def _has_variant(self, name: str) -> bool:
        return any(v.name == name for f in self.families.values() for v in f.variants)


def load_family(path: Path) -> FamilySpec:
    """Parse and validate one ``family.toml``."""
    reader = TableReader(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    reader.unknown_keys(data, TABLES | {"audit", "tier_accuracy", "privacy", "offline"}, "")
    head = reader.get(data, "family", dict, "")
    name = reader.get(head, "name", str, "family")
    reader.unknown_keys(head, {"name", "description", "max_accuracy_drop", "kind"}, "family")
    kind = reader.choice(head, "kind", KINDS, "family") if "kind" in head else "classifier"
    if kind == "generative":
        return _generative_family(reader, data, head, name, path)
    outputs = _tensors(reader, data, "outputs")
    confidence = _confidence(reader, data, outputs)
    variants = read_variants(reader, data, name, path.parent)
    return FamilySpec(
        name=name,
        description=reader.get(head, "description", str, "family", ""),
        inputs=_tensors(reader, data, "inputs"),
        outputs=outputs,
        confidence=confidence,
        thresholds=_thresholds(reader, data),
        variants=variants,
        source=path,
        max_accuracy_drop=_fraction(reader, head, "max_accuracy_drop", "family", 0.01),
        current=read_current(reader, data, variants),
        calibration=_calibration(reader, data),
        audit=parse_audit(reader, data, generative=False),
        tier_accuracy=parse_tier_accuracy(reader, data),
        escalate=_escalate(reader, data),
        offline=parse_offline(reader, data, generative=False),
    )


def _generative_family(
    reader: TableReader, data: Mapping[str, Any], head: Mapping[str, Any], name: str, path: Path
) -> FamilySpec:
    """Prompts in (``text_input``), text out (``text_output``), as Triton's vLLM backend names
    them; the confidence comes from token log-probabilities."""
    table = reader.get(data, "generation", dict, "")
    reader.unknown_keys(table, {"max_tokens", "stop", "context"}, "generation")
    context = reader.get(table, "context", int, "generation", 512)
    max_tokens = reader.get(table, "max_tokens", int, "generation")
    if max_tokens < 1:
        raise reader.fail("generation.max_tokens", f"{max_tokens} must be at least 1")
    stop = reader.get(table, "stop", list, "generation", [])
    if not all(isinstance(s, str) and s for s in stop):
        raise reader.fail("generation.stop", "must list non-empty strings")
    confidence = reader.get(data, "confidence", dict, "")
    reader.unknown_keys(confidence, {"method"}, "confidence")
    method = reader.choice(confidence, "method", tuple(m.value for m in GenerationMethod), "confidence")
    variants = read_variants(reader, data, name, path.parent, generative=True)
    if any(v.runtimes for v in variants):
        raise reader.fail("variants.runtimes", "is for classifier variants; generative ones choose by format")
    text_in = TensorSpec(name=TEXT_INPUT, datatype="BYTES", shape=(-1,))
    text_out = TensorSpec(name=TEXT_OUTPUT, datatype="BYTES", shape=(-1,))
    return FamilySpec(
        name=name,
        description=reader.get(head, "description", str, "family", ""),
        inputs=(text_in,),
        outputs=(text_out,),
        # Not used to score text; kept so code that reads any family's spec reads this one.
        confidence=ConfidenceSpec(
            output=TEXT_OUTPUT, method=ConfidenceMethod.MAX_SOFTMAX, apply_softmax=False
        ),
        thresholds=_thresholds(reader, data),
        variants=variants,
        source=path,
        max_accuracy_drop=_fraction(reader, head, "max_accuracy_drop", "family", 0.01),
        current=read_current(reader, data, variants),
        calibration=_calibration(reader, data),
        generation=GenerationSpec(
            max_tokens=max_tokens, stop=tuple(stop), method=GenerationMethod(method), context=context
        ),
        audit=parse_audit(reader, data, generative=True),
        tier_accuracy=parse_tier_accuracy(reader, data),
        escalate=_escalate(reader, data),
        offline=parse_offline(reader, data, generative=True),
    )


def _escalate(reader: TableReader, data: Mapping[str, Any]) -> bool:
    """``[privacy] escalate``: false keeps the family's inputs on the site (never the cloud's)."""
    table = reader.get(data, "privacy", dict, "", {})
    reader.unknown_keys(table, {"escalate"}, "privacy")
    escalate: bool = reader.get(table, "escalate", bool, "privacy", True)
    return escalate


def _fraction(reader: TableReader, table: Mapping[str, Any], key: str, where: str, default: Any = ...) -> float:
    """A share or a probability: a float in [0, 1]."""
    value: float = reader.get(table, key, float, where, default)
    if not (0.0 <= value <= 1.0) or math.isnan(value):
        raise reader.fail(f"{where}.{key}", f"{value} must lie between 0 and 1")
    return value


def _tensors(reader: TableReader, data: Mapping[str, Any], key: str) -> tuple[TensorSpec, ...]:
    items = reader.get(data, key, list, "")
    if not items:
        raise reader.fail(key, "must list at least one tensor")
    specs = []
    for index, item in enumerate(items):
        where = f"{key}[{index}]"
        if not isinstance(item, dict):
            raise reader.fail(where, "must be a table")
        shape = reader.get(item, "shape", list, where)
        if not all(isinstance(d, int) and (d > 0 or d == -1) for d in shape):
            raise reader.fail(f"{where}.shape", f"{shape}: dimensions must be positive, or -1 for the batch")
        specs.append(
            TensorSpec(
                name=reader.get(item, "name", str, where),
                datatype=reader.choice(item, "datatype", datatypes.DATATYPES, where),
                shape=tuple(shape),
            )
        )
    return tuple(specs)


def _confidence(reader: TableReader, data: Mapping[str, Any], outputs: tuple[TensorSpec, ...]) -> ConfidenceSpec:
    table = reader.get(data, "confidence", dict, "")
    output = reader.get(table, "output", str, "confidence")
    if output not in {o.name for o in outputs}:
        raise reader.fail("confidence.output", f"'{output}' is not one of the family's outputs")
    method = reader.choice(table, "method", tuple(m.value for m in ConfidenceMethod), "confidence")
    return ConfidenceSpec(
        output=output,
        method=ConfidenceMethod(method),
        apply_softmax=reader.get(table, "apply_softmax", bool, "confidence", False),
    )


def _thresholds(reader: TableReader, data: Mapping[str, Any]) -> dict[Tier, float]:
    table = reader.get(data, "thresholds", dict, "", {})
    thresholds = {}
    for key in table:
        value = reader.get(table, key, float, "thresholds")
        problem = threshold_problem(value)
        if problem is not None:
            raise reader.fail(f"thresholds.{key}", problem)
        thresholds[reader.tier(key, f"thresholds.{key}")] = value
    return thresholds


def _calibration(reader: TableReader, data: Mapping[str, Any]) -> CalibrationRecord | None:
    """The ``[calibration]`` table calibrate writes with the thresholds, if there is one."""
    if "calibration" not in data:
        return None
    table = reader.get(data, "calibration", dict, "")
    reader.unknown_keys(table, {"goal", "data", "accuracy", "cloud_share"}, "calibration")
    return CalibrationRecord(
        goal=reader.get(table, "goal", str, "calibration"),
        data=reader.get(table, "data", str, "calibration"),
        accuracy=_fraction(reader, table, "accuracy", "calibration"),
        cloud_share=_fraction(reader, table, "cloud_share", "calibration"),
    )


def load_family_text_check(path: Path, text: str) -> None:
    """Parse ``text`` as ``path`` would be parsed, so a rewrite never leaves a broken file."""
    scratch = path.with_name(f".{path.name}.check")
    scratch.write_text(text, encoding="utf-8")
    try:
        load_family(scratch)
    finally:
        scratch.unlink()
