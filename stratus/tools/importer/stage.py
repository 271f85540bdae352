"""Placing the files, writing the config, verifying: every file an import creates is
claimed first and removed again if the import is refused, and every file it replaces
(``family.toml``, ``verified.toml``) is put back."""

from __future__ import annotations

import dataclasses
import importlib
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from stratus.errors import ConfigError, InvalidInput
from stratus.families.cpu import this_hardware
from stratus.families.precision import record_path, variant_files
from stratus.families.repository import CONFIG_NAME, load_family
from stratus.families.spec import FamilySpec, VariantSpec
from stratus.families.writer import child_block, extended_text, new_family_text
from stratus.runtimes import (
    available_runtimes,
)
from stratus.tiers import Tier
from stratus.tools.calibrate import labelled_data
from stratus.tools.datasets import Split
from stratus.tools.importer import children
from stratus.tools.importer.interfaces import (
    Interface,
    _first_reason,
    _openvino_interface,
    external_data_files,
)
from stratus.tools.importer.options import ImportOptions, ImportResult
from stratus.tools.importer.staging import _Staged
from stratus.tools.importer.trial import Runtimes, _fit_temperature, _output_kind, _probe_family
from stratus.tools.lower_precision import save_ir
from stratus.tools.verify.classifier import (
    bundled_held_out,
    excluded_runtimes,
    synthetic_inputs,
    verify_family,
)
from stratus.tools.verify.report import VerifyReport, VerifyRow, format_report

SUFFIXES: Final = {"onnx": ".onnx", "tflite": ".tflite", "openvino": ".xml"}


@dataclass(frozen=True, kw_only=True)
class _Plan:
    """What is imported, checked: the file, its format and tensors, where it goes."""

    source: Path
    fmt: str
    tier: Tier
    name: str
    interface: Interface
    existing: FamilySpec | None
    runtimes: Runtimes
    taken: Mapping[str, str] = dataclasses.field(default_factory=dict)  # names in use -> their family


@dataclass(frozen=True, kw_only=True)
class _Prepared:
    """The FP32 variant placed, its output kind and temperature found: what the config says."""

    variant: VariantSpec
    probe: FamilySpec  # the family as it will read, with only the new variant
    labelled: labelled_data.LabelledData | None
    original: str | None  # family.toml before the import (None: a new family)
    why: str  # why its output counts as logits or probabilities
    notes: list[str]
    warnings: list[str]


@dataclass(frozen=True, kw_only=True)
class _Verified:
    """What verify kept: the children within tolerance, and the report on them and the parent."""

    children: tuple[VariantSpec, ...]
    report: VerifyReport
    measured_on: str | None
    notes: list[str]


def _import(plan: _Plan, staged: _Staged, options: ImportOptions, cache: Path) -> ImportResult:
    ready = _prepare(plan, staged, options, cache)
    made = _children(plan, staged, options, ready, cache)
    verified = _write_and_verify(plan, staged, ready, made, cache)
    _commit(staged.folder / f".{CONFIG_NAME}.import", staged.folder / CONFIG_NAME, ready.original)
    staged.keep()
    return _result(plan, options, ready, made, verified, folder=staged.folder)


def _prepare(plan: _Plan, staged: _Staged, options: ImportOptions, cache: Path) -> _Prepared:
    staged.mkdir()
    convert = options.convert and "openvino" in plan.runtimes.accepted
    files, notes = _place_files(plan, staged, convert=convert)
    notes += _runtime_notes(plan.runtimes, convert=options.convert)
    variant = VariantSpec(
        name=plan.name,
        family=options.family,
        tier=plan.tier,
        precision="FP32",
        files=files,
        runtimes=plan.runtimes.recorded,
    )
    probe = _probe_family(options, plan.interface, variant, plan.existing, staged.folder)
    labelled = labelled_data.load_npz(probe, options.data) if options.data is not None else None
    existing = plan.existing
    original = existing.source.read_text(encoding="utf-8") if existing is not None else None
    logits, why = _output_kind(probe, variant, options.logits, labelled, cache)
    _check_output_kind(plan, logits, why)
    probe = dataclasses.replace(probe, confidence=dataclasses.replace(probe.confidence, apply_softmax=logits))
    variant, fitted, warnings = _fit_temperature(probe, variant, labelled, cache)
    if fitted:
        notes.append(fitted)
    probe = dataclasses.replace(probe, variants=(variant,))
    return _Prepared(
        variant=variant,
        probe=probe,
        labelled=labelled,
        original=original,
        why=why,
        notes=notes,
        warnings=warnings,
    )


def _children(
    plan: _Plan, staged: _Staged, options: ImportOptions, ready: _Prepared, cache: Path
) -> children.Made:
    """The INT8 and FP16 children, where they can be made honestly; else a note saying why."""
    calibration = children.calibration_of(ready.probe, ready.labelled)
    why = children.why_none(plan.fmt, options.children, calibration)
    if why is not None or calibration is None:
        return children.Made(notes=(why,) if why else ())
    source = children.Source(
        parent=ready.variant,
        family=ready.probe,
        labelled=ready.labelled,
        calibration=calibration[0],
        calibration_name=calibration[1],
        taken=plan.taken,
    )
    return children.make_children(source, staged, cache)


def _write_and_verify(
    plan: _Plan, staged: _Staged, ready: _Prepared, made: children.Made, cache: Path
) -> _Verified:
    """The config written beside the old one with the variant and its children, verified:
    refused where the FP32 variant fails; a child outside tolerance is dropped (its files
    removed); then the family's record staged, and the config rewritten without the dropped."""
    scratch = staged.scratch()
    scratch.write_text(_config_text(plan, ready, made.children, made.how), encoding="utf-8")
    split, measured_on = _held_out(ready.probe, ready.labelled)
    family = load_family(scratch)
    line = [plan.name, *(c.name for c in made.children)]
    report = _verify(family, line, split, cache, plan.runtimes.refused)
    parent_rows = [r for r in report.rows if r.name == plan.name]
    if not parent_rows or any(r.failed for r in parent_rows):
        hint = " (--no-convert keeps only the file's own format)" if len(ready.variant.files) > 1 else ""
        raise ConfigError(
            f"{plan.source}: verify failed, nothing was imported{hint}:\n{format_report(report)}"
        )
    kept, notes = children.judged(family, made.children, report.rows)
    for dropped in (c for c in made.children if c not in kept):
        staged.discard(variant_files(family, family.variant(dropped.name)).values())
    if len(kept) < len(made.children):
        scratch.write_text(_config_text(plan, ready, kept, made.how), encoding="utf-8")
        family = load_family(scratch)
    line = [plan.name, *(c.name for c in kept)]
    rows = [r for r in report.rows if r.name in line]
    records = _stage_record(staged, family, line, rows)
    final = _verify_report(family, line, rows, plan.runtimes.refused, records)
    return _Verified(children=tuple(kept), report=final, measured_on=measured_on, notes=notes)


def _config_text(plan: _Plan, ready: _Prepared, kept: Sequence[VariantSpec], how: Mapping[str, str]) -> str:
    """The family's config: the old one (or a new one) with the variant and its children."""
    existing, original, refusals = plan.existing, ready.original, plan.runtimes.refused
    if existing is not None and original is not None:
        text = extended_text(original, existing, ready.variant, plan.source, refusals)
    else:
        text = new_family_text(ready.probe, ready.variant, plan.source, ready.why, refusals)
    return "\n".join([text, *(child_block(child, how[child.name]) for child in kept)])


def _stage_record(
    staged: _Staged, family: FamilySpec, line: Sequence[str], rows: Sequence[VerifyRow]
) -> dict[str, str]:
    """``verified.toml`` written with the line's entries (put back if the import is refused)."""
    text = children.record_text(family, line, rows)
    if text is None:
        return {}
    path = record_path(family)
    staged.replace(path, text)
    return {family.name: f"written: {path}"}


def _result(
    plan: _Plan,
    options: ImportOptions,
    ready: _Prepared,
    made: children.Made,
    verified: _Verified,
    *,
    folder: Path,
) -> ImportResult:
    existing = plan.existing
    notes, warnings = [*ready.notes, *made.notes, *verified.notes], [*ready.warnings, *made.warnings]
    current = existing is None or plan.tier not in existing.current
    if existing is not None and not current:
        notes.append(
            f"the {plan.tier.label} tier's current variant stays {existing.current[plan.tier]}; {plan.name} is "
            "served only when pinned by name (or as a rollout candidate) until [current] names it"
        )
    family = load_family(folder / CONFIG_NAME)
    if plan.tier is not Tier.CLOUD and plan.tier not in family.thresholds:
        warnings.append(_no_threshold(family.name, plan.tier))
    variant = family.variant(plan.name)
    return ImportResult(
        family=family,
        variant=variant,
        new_family=existing is None,
        current=current,
        notes=tuple(notes),
        report=verified.report,
        labelled=verified.measured_on,
        warnings=tuple(warnings),
        children=tuple(family.variant(c.name) for c in verified.children),
        serving=tuple(children.serving(family, variant, options.hardware or this_hardware())),
    )


def _no_threshold(family: str, tier: Tier) -> str:
    """A tier with no threshold settles every answer (nothing above it is ever asked), silently
    unless said here, with the command that chooses one."""
    return (
        f"the {tier.label} tier has no threshold yet: every {tier.label} answer is final and nothing "
        f"climbs to a tier above, until `stratus models calibrate {family} --target-accuracy 0.97 "
        f"--data FILE.npz` chooses one (or `stratus fleet thresholds {family} --apply {tier.label}=0.9` "
        "sets one on a running fleet)"
    )


def _runtime_notes(runtimes: Runtimes, *, convert: bool) -> list[str]:
    """What the command says about runtimes: those skipped and why, what family.toml records."""
    notes = [
        f"skipped {runtime}: it cannot run the file: {reason}" for runtime, reason in runtimes.refused.items()
    ]
    if "openvino" in runtimes.refused and convert:
        notes.append("no OpenVINO IR: OpenVINO cannot run the file")
    if runtimes.chosen:
        notes += [f"not checked here: {runtime} ({reason})" for runtime, reason in runtimes.unchecked.items()]
    if runtimes.recorded:
        notes.append(f"served by {', '.join(runtimes.recorded)} only (runtimes in family.toml)")
    return notes


def _check_output_kind(plan: _Plan, logits: bool, why: str) -> None:
    """A family's variants all give logits, or all probabilities: one config reads them."""
    family = plan.existing
    if family is None or logits == family.confidence.apply_softmax:
        return
    kind = {True: "logits", False: "probabilities"}
    raise ConfigError(
        f"{plan.source}: gives {kind[logits]} ({why}), but family '{family.name}' takes "
        f"{kind[family.confidence.apply_softmax]} (confidence.apply_softmax in {family.source})"
    )


def _place_files(plan: _Plan, staged: _Staged, *, convert: bool) -> tuple[dict[str, Path], list[str]]:
    """Copy the file (an IR with its .bin) and convert it to OpenVINO IR where possible."""
    source, fmt = plan.source, plan.fmt
    target = staged.claim(staged.folder / f"{plan.name}{SUFFIXES[fmt]}")
    files = {fmt: target}
    if fmt == "openvino":
        shutil.copyfile(source.with_suffix(".bin"), staged.claim(target.with_suffix(".bin")))
    external = external_data_files(source) if fmt == "onnx" else []
    if external:  # one file: what the agents' runtimes and the cache digest expect of a variant
        onnx = importlib.import_module("onnx")
        onnx.save_model(onnx.load(str(source)), str(target), save_as_external_data=False)
        shown = ", ".join(p.name for p in external)
        notes = [f"copied {source} with its external data ({shown}) into one file, {target}"]
    else:
        shutil.copyfile(source, target)
        notes = [f"copied {source} to {target}"]
    if fmt == "openvino" or not convert:
        return files, notes
    xml = staged.claim(staged.folder / f"{plan.name}.xml")
    staged.claim(xml.with_suffix(".bin"))
    try:
        save_ir(target, xml, fp16=False)
    except Exception as exc:  # a model OpenVINO cannot convert still serves in its own runtime
        if fmt == "onnx":
            raise ConfigError(f"{source}: OpenVINO cannot convert it: {_first_reason(str(exc))}") from None
        return files, [*notes, f"no OpenVINO IR: OpenVINO cannot convert it ({_first_reason(str(exc))})"]
    converted = _openvino_interface(xml)
    if converted != plan.interface:
        raise ConfigError(f"{source}: its OpenVINO IR has other tensors ({converted}) than the file")
    files["openvino"] = xml
    return files, [*notes, f"converted to OpenVINO IR: {xml} (+ .bin, FP32 weights)"]


def _held_out(
    family: FamilySpec, labelled: labelled_data.LabelledData | None
) -> tuple[Split | None, str | None]:
    """What verify measures accuracy on: the report part of --data, else a shipped family's
    bundled held-out split (when it fits the input), else nothing (synthetic inputs)."""
    if labelled is not None:
        return labelled.report, f"{labelled.report_name} (the report part of --data)"
    bundled = bundled_held_out(family)
    try:
        if bundled is not None:
            family.inputs[0].check(bundled.x)
            return bundled, f"the bundled held-out split of '{family.name}' ({len(bundled)} examples)"
    except InvalidInput:
        pass
    return None, None


def _verify(
    family: FamilySpec, line: Sequence[str], data: Split | None, cache: Path, refused: Mapping[str, str]
) -> VerifyReport:
    """The new variant and its children in every runtime here that may serve them (labelled
    data, or synthetic inputs), each child against the variant; those skipped say why."""
    usable = {n for n, status in available_runtimes().items() if status.available}
    only = dataclasses.replace(family, variants=tuple(family.variant(name) for name in line))
    rows = verify_family(only, data if data is not None else synthetic_inputs(family), usable, cache)
    return _verify_report(family, line, rows, refused, {})


def _verify_report(
    family: FamilySpec,
    line: Sequence[str],
    rows: Sequence[VerifyRow],
    refused: Mapping[str, str],
    records: dict[str, str],
) -> VerifyReport:
    availability = available_runtimes()
    usable = {n for n, status in availability.items() if status.available}
    only = dataclasses.replace(family, variants=tuple(family.variant(name) for name in line))
    skipped = {n: status.reason for n, status in availability.items() if not status.available}
    skipped.update(excluded_runtimes(only, usable))
    skipped.update(
        {f"{runtime} for {line[0]}": f"it cannot run the file: {why}" for runtime, why in refused.items()}
    )
    return VerifyReport(rows=tuple(rows), skipped=skipped, records=records)


def _commit(scratch: Path, config: Path, original: str | None) -> None:
    """Replace ``config`` by the checked text, unless someone changed it meanwhile."""
    now = config.read_text(encoding="utf-8") if config.exists() else None
    if now != original:
        raise ConfigError(f"{config} changed while importing; nothing was imported, try again")
    os.replace(scratch, config)
