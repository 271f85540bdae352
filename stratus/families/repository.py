"""The model repository: one folder per family, each with a ``family.toml``.

A request names a *family* (``digits``) or one of its *variants* (``digits-large``). The
config says what goes in and out, how outputs become a confidence, each tier's escalation
threshold, and which files each variant ships in which format. A malformed config is
refused with a message naming the file, the key and the problem: a fleet that loads a
half-understood config would route on numbers nobody meant.

The specs a config becomes are in ``stratus.families.spec``; rewriting a config's thresholds
is ``stratus.families.writer``.
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from stratus import datatypes
from stratus.errors import ConfigError, InvalidInput, NotFound
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
from stratus.tiers import Tier

CONFIG_NAME: Final = "family.toml"
# "hf" is a folder in the Hugging Face layout (config.json, *.safetensors, tokenizer files).
FORMATS: Final = ("tflite", "onnx", "openvino", "gguf", "hf")
KINDS: Final = ("classifier", "generative")
PRECISIONS: Final = ("FP32", "FP16", "INT8")
# The classifier runtimes a variant's ``runtimes`` key may name (``stratus.runtimes.RUNNERS``).
RUNTIMES: Final = ("litert", "openvino", "onnxruntime", "tensorrt")
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


class _Reader:
    """Typed access to a parsed TOML table, with errors that name file and key."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.path}: key '{key}': {problem}")

    def get(self, table: Mapping[str, Any], key: str, kind: type, where: str, default: Any = ...) -> Any:
        full = f"{where}.{key}" if where else key
        if key not in table:
            if default is ...:
                raise self.fail(full, "is missing")
            return default
        value = table[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.fail(full, f"must be a {kind.__name__}, not {type(value).__name__}")
        return value

    def choice(self, table: Mapping[str, Any], key: str, choices: tuple[str, ...], where: str) -> str:
        value: str = self.get(table, key, str, where)
        if value not in choices:
            raise self.fail(
                f"{where}.{key}" if where else key, f"'{value}' is not one of {', '.join(choices)}"
            )
        return value

    def unknown_keys(self, table: Mapping[str, Any], allowed: set[str], where: str) -> None:
        for key in table:
            if key not in allowed:
                raise self.fail(f"{where}.{key}" if where else key, "is not a known setting")


def load_family(path: Path) -> FamilySpec:
    """Parse and validate one ``family.toml``."""
    reader = _Reader(path)
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
    variants = _variants(reader, data, name, path.parent)
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
        current=_current(reader, data, variants),
        calibration=_calibration(reader, data),
        audit=parse_audit(reader, data, generative=False),
        tier_accuracy=parse_tier_accuracy(reader, data),
        escalate=_escalate(reader, data),
        offline=parse_offline(reader, data, generative=False),
    )


def _generative_family(
    reader: _Reader, data: Mapping[str, Any], head: Mapping[str, Any], name: str, path: Path
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
    variants = _variants(reader, data, name, path.parent, generative=True)
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
        current=_current(reader, data, variants),
        calibration=_calibration(reader, data),
        generation=GenerationSpec(
            max_tokens=max_tokens, stop=tuple(stop), method=GenerationMethod(method), context=context
        ),
        audit=parse_audit(reader, data, generative=True),
        tier_accuracy=parse_tier_accuracy(reader, data),
        escalate=_escalate(reader, data),
        offline=parse_offline(reader, data, generative=True),
    )


def _escalate(reader: _Reader, data: Mapping[str, Any]) -> bool:
    """``[privacy] escalate``: false keeps the family's inputs on the site (never the cloud's)."""
    table = reader.get(data, "privacy", dict, "", {})
    reader.unknown_keys(table, {"escalate"}, "privacy")
    escalate: bool = reader.get(table, "escalate", bool, "privacy", True)
    return escalate


def _fraction(reader: _Reader, table: Mapping[str, Any], key: str, where: str, default: Any = ...) -> float:
    """A share or a probability: a float in [0, 1]."""
    value: float = reader.get(table, key, float, where, default)
    if not (0.0 <= value <= 1.0) or math.isnan(value):
        raise reader.fail(f"{where}.{key}", f"{value} must lie between 0 and 1")
    return value


def _tensors(reader: _Reader, data: Mapping[str, Any], key: str) -> tuple[TensorSpec, ...]:
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


def _confidence(reader: _Reader, data: Mapping[str, Any], outputs: tuple[TensorSpec, ...]) -> ConfidenceSpec:
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


def _thresholds(reader: _Reader, data: Mapping[str, Any]) -> dict[Tier, float]:
    table = reader.get(data, "thresholds", dict, "", {})
    thresholds = {}
    for key in table:
        value = reader.get(table, key, float, "thresholds")
        problem = threshold_problem(value)
        if problem is not None:
            raise reader.fail(f"thresholds.{key}", problem)
        thresholds[_tier(reader, key, f"thresholds.{key}")] = value
    return thresholds


def _calibration(reader: _Reader, data: Mapping[str, Any]) -> CalibrationRecord | None:
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


def _tier(reader: _Reader, text: str, key: str) -> Tier:
    try:
        return Tier.parse(text)
    except InvalidInput:
        raise reader.fail(key, f"'{text}' is not one of device, edge, cloud") from None


def _variants(
    reader: _Reader, data: Mapping[str, Any], family: str, folder: Path, *, generative: bool = False
) -> tuple[VariantSpec, ...]:
    items = reader.get(data, "variants", list, "")
    if not items:
        raise reader.fail("variants", "must list at least one variant")
    variants = [_variant(reader, item, f"variants[{i}]", family, folder) for i, item in enumerate(items)]
    names = [v.name for v in variants]
    for name in names:
        if names.count(name) > 1:
            raise reader.fail("variants", f"variant '{name}' is listed more than once")
    by_name = {v.name: v for v in variants}
    for index, variant in enumerate(variants):
        _check_parent(reader, f"variants[{index}].parent", variant, by_name, generative=generative)
    return tuple(variants)


def _check_parent(
    reader: _Reader, key: str, variant: VariantSpec, by_name: Mapping[str, VariantSpec], *, generative: bool
) -> None:
    """A lower-precision variant is judged against its FP32 parent, so the pair must match.

    A generative family may ship a root in lower precision (a GGUF file in F16 is the model
    as trained and exported; nothing wider exists to compare it with)."""
    if variant.precision == "FP32":
        if variant.parent is not None:
            raise reader.fail(key, "an FP32 variant has no parent")
        return
    if variant.parent is None and generative:
        return
    if variant.parent is None:
        raise reader.fail(key, f"is missing: every {variant.precision} variant names its FP32 parent")
    parent = by_name.get(variant.parent)
    if parent is None:
        raise reader.fail(key, f"'{variant.parent}' is not a variant of this family")
    if parent.precision != "FP32":
        raise reader.fail(key, f"'{parent.name}' is {parent.precision}, not FP32")
    if parent.tier is not variant.tier:
        raise reader.fail(
            key, f"'{parent.name}' is on the {parent.tier.label} tier, not {variant.tier.label}"
        )


def _current(reader: _Reader, data: Mapping[str, Any], variants: tuple[VariantSpec, ...]) -> dict[Tier, str]:
    """Each tier's current variant: named in ``[current]``, or the tier's only FP32 variant.

    A tier with two FP32 variants and no choice is refused: serving whichever came first in
    the file would let an edit's ordering decide what the fleet runs.
    """
    table = reader.get(data, "current", dict, "", {})
    by_name = {v.name: v for v in variants}
    current: dict[Tier, str] = {}
    for key in table:
        tier = _tier(reader, key, f"current.{key}")
        name = reader.get(table, key, str, "current")
        variant = by_name.get(name)
        if variant is None:
            raise reader.fail(f"current.{key}", f"'{name}' is not a variant of this family")
        if variant.tier is not tier:
            raise reader.fail(f"current.{key}", f"'{name}' is on the {variant.tier.label} tier")
        if variant.parent is not None:
            raise reader.fail(
                f"current.{key}",
                f"'{name}' is a {variant.precision} child; name its parent '{variant.parent}'",
            )
        current[tier] = name
    for tier in sorted({v.tier for v in variants}):
        roots = [v.name for v in variants if v.tier is tier and v.parent is None]
        if tier in current:
            continue
        if len(roots) != 1:
            raise reader.fail(
                f"current.{tier.label}", f"is missing: the {tier.label} tier has variants {', '.join(roots)}"
            )
        current[tier] = roots[0]
    return current


def _variant(reader: _Reader, item: Any, where: str, family: str, folder: Path) -> VariantSpec:
    if not isinstance(item, dict):
        raise reader.fail(where, "must be a table")
    reader.unknown_keys(
        item, {"name", "tier", "precision", "parent", "temperature", "files", "runtimes"}, where
    )
    name = reader.get(item, "name", str, where)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise reader.fail(f"{where}.name", f"'{name}' may hold only letters, digits, '.', '_' and '-'")
    files_table = reader.get(item, "files", dict, where)
    files = {}
    for fmt in files_table:
        if fmt not in FORMATS:
            raise reader.fail(f"{where}.files.{fmt}", f"unknown format; expected one of {', '.join(FORMATS)}")
        path = folder / reader.get(files_table, fmt, str, f"{where}.files")
        if not path.resolve().is_relative_to(folder.resolve()):  # "../x", "/etc/x", a link out
            raise reader.fail(f"{where}.files.{fmt}", f"{path} is outside the family folder {folder}")
        if fmt == "hf":
            if not (path / "config.json").is_file():
                raise reader.fail(
                    f"{where}.files.hf", f"{path} is not a Hugging Face model folder (no config.json)"
                )
        elif not path.is_file():
            raise reader.fail(f"{where}.files.{fmt}", f"file {path} does not exist")
        files[fmt] = path
    if not files:
        raise reader.fail(f"{where}.files", "must name at least one file")
    return VariantSpec(
        name=name,
        family=family,
        tier=_tier(reader, reader.get(item, "tier", str, where), f"{where}.tier"),
        precision=reader.choice(item, "precision", PRECISIONS, where) if "precision" in item else "FP32",
        files=files,
        parent=reader.get(item, "parent", str, where, None),
        temperature=_temperature(reader, item, where),
        runtimes=_variant_runtimes(reader, item, where),
    )


def _variant_runtimes(reader: _Reader, item: Mapping[str, Any], where: str) -> tuple[str, ...]:
    """A classifier variant's ``runtimes``: known names, no repeats, at least one."""
    if "runtimes" not in item:
        return ()
    names = reader.get(item, "runtimes", list, where)
    key = f"{where}.runtimes"
    if not names:
        raise reader.fail(key, "must name at least one runtime (leave it out to allow any)")
    for name in names:
        if name not in RUNTIMES:
            raise reader.fail(key, f"{name!r} is not one of {', '.join(RUNTIMES)}")
    if len(set(names)) != len(names):
        raise reader.fail(key, f"{names} names a runtime twice")
    return tuple(names)


def _temperature(reader: _Reader, item: Mapping[str, Any], where: str) -> float:
    value: float = reader.get(item, "temperature", float, where, 1.0)
    if not (0.0 < value < math.inf):
        raise reader.fail(f"{where}.temperature", f"{value} must be a positive number")
    return value


def load_family_text_check(path: Path, text: str) -> None:
    """Parse ``text`` as ``path`` would be parsed, so a rewrite never leaves a broken file."""
    scratch = path.with_name(f".{path.name}.check")
    scratch.write_text(text, encoding="utf-8")
    try:
        load_family(scratch)
    finally:
        scratch.unlink()
