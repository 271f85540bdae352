"""What an import is asked to do (:class:`ImportOptions`), what it did (:class:`ImportResult`),
and the names it is given, checked against the repository's families and variants."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from stratus.errors import ConfigError, InvalidInput
from stratus.families.confidence import ConfidenceMethod
from stratus.families.cpu import Hardware
from stratus.families.repository import CONFIG_NAME, load_family
from stratus.families.spec import FamilySpec, VariantSpec
from stratus.tiers import Tier
from stratus.tools.verify.report import VerifyReport

NAME_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True, kw_only=True)
class ImportOptions:
    family: str
    tier: str
    variant: str | None = None
    root: Path = Path("models")
    # New family only: the confidence method (default max_softmax).
    method: ConfidenceMethod | None = None
    # True: the output is logits; False: probabilities; None: detect.
    logits: bool | None = None
    data: Path | None = None
    convert: bool = True
    cache_dir: Path | None = None
    # Only these runtimes may serve the variant (recorded in family.toml); None: every
    # runtime here that runs the file.
    runtimes: tuple[str, ...] | None = None
    # Build the INT8 and FP16 children (of an ONNX file, with labelled data at hand).
    children: bool = True
    # The CPU whose choice of precision the import reports; None: this one (this_hardware()).
    hardware: Hardware | None = None


@dataclass(frozen=True, kw_only=True)
class ImportResult:
    family: FamilySpec
    variant: VariantSpec
    new_family: bool
    current: bool
    notes: tuple[str, ...]
    report: VerifyReport
    labelled: str | None  # what verify measured accuracy on; None: synthetic inputs
    # What the user should act on (also printed to stderr): a temperature fitted at the edge
    # of its search grid, for one.
    warnings: tuple[str, ...] = ()
    # The lower-precision children kept (verified within the family's max_accuracy_drop).
    children: tuple[VariantSpec, ...] = ()
    # Which variant of the line an agent on this CPU would serve and why, and which CPUs
    # would choose each child.
    serving: tuple[str, ...] = ()


def _tier(text: str, source: Path) -> Tier:
    try:
        return Tier.parse(text)
    except InvalidInput:
        raise ConfigError(f"{source}: bad tier '{text}': expected one of device, edge, cloud") from None


@dataclass(frozen=True)
class _Names:
    """The families of a repository folder, and every name a new variant must not take."""

    families: Mapping[str, FamilySpec]
    used: Mapping[str, str]  # variant or family name -> the family that uses it

    @classmethod
    def scan(cls, root: Path) -> _Names:
        families = {}
        for path in sorted(root.glob(f"*/{CONFIG_NAME}")) if root.is_dir() else []:
            family = load_family(path)
            families[family.name] = family
        used = {v.name: f.name for f in families.values() for v in f.variants}
        return cls(families, {**used, **{name: name for name in families}})


def _check_names(
    source: Path, options: ImportOptions, variant: str, existing: FamilySpec | None, names: _Names
) -> None:
    for what, name in (("family", options.family), ("variant", variant)):
        if not NAME_PATTERN.fullmatch(name):
            raise ConfigError(f"{source}: bad {what} name '{name}': use letters, digits, '.', '_' and '-'")
    owner = names.used.get(variant)
    if owner is not None:
        whose = "a family's name" if owner == variant else f"a variant of family '{owner}'"
        raise ConfigError(
            f"{source}: variant name '{variant}' is already used ({whose}); choose another with --variant"
        )
    if existing is None and options.family in names.used:
        raise ConfigError(
            f"{source}: '{options.family}' is a variant of family '{names.used[options.family]}'; "
            "a new family needs a name of its own"
        )
    if existing is None and (options.root / options.family / CONFIG_NAME).exists():
        raise ConfigError(
            f"{source}: {options.root / options.family / CONFIG_NAME} already exists for another family"
        )
    if existing is not None and options.method is not None and options.method != existing.confidence.method:
        raise ConfigError(
            f"{source}: --method {options.method.value}: family '{existing.name}' already uses "
            f"{existing.confidence.method.value} ([confidence] in {existing.source})"
        )
