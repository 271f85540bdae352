"""A family.toml's ``[[variants]]`` and ``[current]`` tables: each variant's files, tier,
precision, runtimes and FP32 parent, checked against each other, and the variant each tier
serves. :func:`stratus.families.repository.load_family` reads the rest of the file.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from stratus.families.spec import VariantSpec
from stratus.families.toml_reader import TableReader
from stratus.tiers import Tier

# "hf" is a folder in the Hugging Face layout (config.json, *.safetensors, tokenizer files).
FORMATS: Final = ("tflite", "onnx", "openvino", "gguf", "hf")
PRECISIONS: Final = ("FP32", "FP16", "INT8")
# The classifier runtimes a variant's ``runtimes`` key may name (``stratus.runtimes.RUNNERS``).
RUNTIMES: Final = ("litert", "openvino", "onnxruntime", "tensorrt")


def read_variants(
    reader: TableReader, data: Mapping[str, Any], family: str, folder: Path, *, generative: bool = False
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
    reader: TableReader, key: str, variant: VariantSpec, by_name: Mapping[str, VariantSpec], *, generative: bool
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


def read_current(reader: TableReader, data: Mapping[str, Any], variants: tuple[VariantSpec, ...]) -> dict[Tier, str]:
    """Each tier's current variant: named in ``[current]``, or the tier's only FP32 variant.

    A tier with two FP32 variants and no choice is refused: serving whichever came first in
    the file would let an edit's ordering decide what the fleet runs.
    """
    table = reader.get(data, "current", dict, "", {})
    by_name = {v.name: v for v in variants}
    current: dict[Tier, str] = {}
    for key in table:
        tier = reader.tier(key, f"current.{key}")
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


def _variant(reader: TableReader, item: Any, where: str, family: str, folder: Path) -> VariantSpec:
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
        tier=reader.tier(reader.get(item, "tier", str, where), f"{where}.tier"),
        precision=reader.choice(item, "precision", PRECISIONS, where) if "precision" in item else "FP32",
        files=files,
        parent=reader.get(item, "parent", str, where, None),
        temperature=_temperature(reader, item, where),
        runtimes=_variant_runtimes(reader, item, where),
    )


def _variant_runtimes(reader: TableReader, item: Mapping[str, Any], where: str) -> tuple[str, ...]:
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


def _temperature(reader: TableReader, item: Mapping[str, Any], where: str) -> float:
    value: float = reader.get(item, "temperature", float, where, 1.0)
    if not (0.0 < value < math.inf):
        raise reader.fail(f"{where}.temperature", f"{value} must be a positive number")
    return value
