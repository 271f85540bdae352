"""Running the file before anything is written: which runtimes here open and warm it,
whether its output is logits or probabilities, and its temperature."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np

from stratus.datatypes import Array
from stratus.errors import ConfigError, InvalidInput
from stratus.families.confidence import TEMPERATURE_GRID, ConfidenceMethod, fit_temperature
from stratus.families.repository import CONFIG_NAME
from stratus.families.spec import ConfidenceSpec, FamilySpec, VariantSpec
from stratus.runtimes import (
    RUNNERS,
    Choice,
    LoadOptions,
    availability_of,
    load_runner,
    open_runner,
)
from stratus.runtimes.base import warmed_up
from stratus.tools.calibrate import labelled_data
from stratus.tools.datasets import Split, dataset_for
from stratus.tools.importer.interfaces import Interface, _first_reason
from stratus.tools.importer.options import ImportOptions, _tier
from stratus.tools.verify.classifier import (
    synthetic_inputs,
)

PROBE_ITEMS: Final = 16


@dataclass(frozen=True, kw_only=True)
class Runtimes:
    """Which runtimes here ran the file (opened and warmed up, as an agent would), which
    refused it and why, and whether ``--runtimes`` chose them."""

    accepted: tuple[str, ...]
    refused: Mapping[str, str]
    unchecked: Mapping[str, str]  # named with --runtimes but not available here
    chosen: bool

    @property
    def recorded(self) -> tuple[str, ...]:
        """The variant's ``runtimes`` in family.toml: what --runtimes said, else (when a
        runtime refused the file) the ones that ran it; empty: any runtime."""
        if self.chosen:
            return (*self.accepted, *self.unchecked)
        return self.accepted if self.refused else ()


def probe_runtimes(
    source: Path,
    *,
    fmt: str,
    interface: Interface,
    options: ImportOptions,
    folder: Path,
    existing: FamilySpec | None,
    cache: Path,
) -> Runtimes:
    """Open and warm the file in every runtime here that reads its format (or those of
    ``--runtimes``), as an agent would load it.

    A runtime that refuses it is skipped with its reason (OpenVINO has no ``ai.onnx.ml``
    operators, nor ZipMap's sequence outputs); the file is refused only when none runs it,
    or when one that ``--runtimes`` names refuses it."""
    readers = [name for name, runner in RUNNERS.items() if fmt in runner.formats]
    wanted = _wanted_runtimes(source, fmt, readers, options.runtimes)
    variant = VariantSpec(
        name="probe",
        family=options.family,
        tier=_tier(options.tier, source),
        precision="FP32",
        files={fmt: source},
    )
    family = _probe_family(options, interface, variant, existing, folder)
    accepted, refused, unchecked = [], {}, {}
    for runtime in wanted:
        status = availability_of(runtime)
        if not status.available:
            unchecked[runtime] = status.reason
            continue
        choice = Choice(runtime=runtime, format=fmt, path=source)
        try:
            opened = open_runner(family, variant, choice, LoadOptions(tier=variant.tier, cache_dir=cache))
            warmed_up(opened, runtime, source).close()
        except Exception as exc:  # each runtime raises its own types for a file it cannot run
            refused[runtime] = _first_reason(str(exc))
            continue
        accepted.append(runtime)
    chosen = options.runtimes is not None
    if refused and chosen:
        runtime, reason = next(iter(refused.items()))
        raise ConfigError(f"{source}: {runtime} (named by --runtimes) cannot run it: {reason}")
    if not accepted:
        why = "; ".join(f"{r}: {reason}" for r, reason in {**refused, **unchecked}.items())
        raise ConfigError(f"{source}: no runtime here can run it ({why or 'none reads ' + fmt})")
    return Runtimes(accepted=tuple(accepted), refused=refused, unchecked=unchecked, chosen=chosen)


def _wanted_runtimes(
    source: Path, fmt: str, readers: Sequence[str], given: Sequence[str] | None
) -> Sequence[str]:
    if given is None:
        return readers
    for runtime in given:
        if runtime not in RUNNERS:
            raise ConfigError(f"--runtimes: unknown runtime '{runtime}'; known: {', '.join(sorted(RUNNERS))}")
        if runtime not in readers:
            raise ConfigError(
                f"{source}: --runtimes {runtime}: it does not read {fmt} files (those do: {', '.join(readers)})"
            )
    if len(set(given)) != len(given):
        raise ConfigError(f"--runtimes {','.join(given)}: names a runtime twice")
    return given


def _probe_family(
    options: ImportOptions,
    interface: Interface,
    variant: VariantSpec,
    existing: FamilySpec | None,
    folder: Path,
) -> FamilySpec:
    """The family as it will read, in memory, with only the new variant: for checking the
    labelled data and running the model before any config is written."""
    if existing is not None:
        return dataclasses.replace(existing, variants=(variant,), current={variant.tier: variant.name})
    scores = interface.scores
    assert scores is not None  # read_interface refuses a file without one
    confidence = ConfidenceSpec(
        output=scores.name,
        method=options.method or ConfidenceMethod.MAX_SOFTMAX,
        apply_softmax=bool(options.logits),
    )
    return FamilySpec(
        name=options.family,
        description="",
        inputs=interface.inputs,
        outputs=interface.outputs,
        confidence=confidence,
        thresholds={},
        variants=(variant,),
        source=folder / CONFIG_NAME,
        current={variant.tier: variant.name},
    )


def _output_kind(
    family: FamilySpec,
    variant: VariantSpec,
    flag: bool | None,
    labelled: labelled_data.LabelledData | None,
    cache: Path,
) -> tuple[bool, str]:
    """(whether the output is logits, why we think so)."""
    if flag is not None:
        return flag, "--logits" if flag else "--probabilities"
    x = labelled.calibration.x[:PROBE_ITEMS] if labelled else synthetic_inputs(family, PROBE_ITEMS).x
    what = f"the first {len(x)} examples of --data" if labelled else f"{len(x)} synthetic inputs"
    runner = load_runner(family, variant, LoadOptions(tier=variant.tier, cache_dir=cache))
    try:
        output = runner.infer({family.inputs[0].name: x})[family.confidence.output].astype(np.float64)
    finally:
        runner.close()
    if looks_like_probabilities(output):
        return False, f"detected: its rows lie in [0, 1] and sum to 1 on {what}"
    return True, f"detected: its rows are not probabilities on {what}"


def _fit_temperature(
    family: FamilySpec, variant: VariantSpec, labelled: labelled_data.LabelledData | None, cache: Path
) -> tuple[VariantSpec, str, list[str]]:
    """The variant with its temperature fitted on a calibration split: the calibration part
    of --data, else a shipped family's bundled one; unchanged (1.0) without labels.

    Without it an imported variant would claim a confidence its siblings mean differently,
    and the tier's one threshold would escalate it more, or less, than it should."""
    split, what = (labelled.calibration, "the calibration part of --data") if labelled else (None, "")
    if split is None:
        split = _bundled_calibration(family)
        what = f"the bundled calibration split of '{family.name}'"
    if split is None:
        return variant, "", []
    runner = load_runner(family, variant, LoadOptions(tier=variant.tier, cache_dir=cache))
    try:
        scores = runner.infer({family.inputs[0].name: split.x})[family.confidence.output]
    finally:
        runner.close()
    temperature = fit_temperature(scores, split.y, apply_softmax=family.confidence.apply_softmax)
    warning = temperature_warning(variant.name, temperature, family.confidence.apply_softmax)
    fitted = dataclasses.replace(variant, temperature=temperature)
    return fitted, f"temperature {temperature:g}, fitted on {what}", [warning] if warning else []


def temperature_warning(variant: str, temperature: float, logits: bool) -> str:
    """A warning when a fitted temperature sits at the edge of the search grid: the best one
    may lie beyond it, and the variant's confidence does not mean what it says."""
    low, high = TEMPERATURE_GRID
    if low < temperature < high:
        return ""
    given, other = ("logits", "--probabilities") if logits else ("probabilities", "--logits")
    if temperature <= low:
        why = f"the model is under-confident (a random forest's vote shares are); the best fit may lie below {low:g}"
    else:
        why = f"the model is over-confident; the best fit may lie above {high:g}"
    return (
        f"{variant}: fitted temperature {temperature:g} is at the edge of its range [{low:g}, {high:g}]: {why}, "
        f"so its confidence is not a calibrated probability. Check that its output really is {given} "
        f"(else import it again with {other}); either way choose thresholds with "
        "`stratus models calibrate --data FILE.npz`, not by hand"
    )


def _bundled_calibration(family: FamilySpec) -> Split | None:
    try:
        split = dataset_for(family.name).calibration
        family.inputs[0].check(split.x)
    except (ConfigError, InvalidInput):
        return None
    return split


def looks_like_probabilities(output: Array) -> bool:
    """Every row in [0, 1] and summing to 1 (within 1e-3): a softmax is already applied."""
    return bool(
        np.all(output >= -1e-6)
        and np.all(output <= 1.0 + 1e-6)
        and np.allclose(output.sum(axis=-1), 1.0, atol=1e-3)
    )
