"""Placing the files, writing the config, verifying: every file an import creates is
claimed first and removed again if the import is refused."""

from __future__ import annotations

import dataclasses
import importlib
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from stratus.errors import ConfigError, InvalidInput
from stratus.families.repository import CONFIG_NAME, load_family
from stratus.families.spec import FamilySpec, VariantSpec
from stratus.runtimes import (
    available_runtimes,
)
from stratus.tiers import Tier
from stratus.tools.calibrate import labelled_data
from stratus.tools.datasets import Split
from stratus.tools.importer.family_toml import _extended_text, _new_family_text
from stratus.tools.importer.interfaces import (
    Interface,
    _first_reason,
    _openvino,
    _openvino_interface,
    external_data_files,
)
from stratus.tools.importer.options import ImportOptions, ImportResult
from stratus.tools.importer.probe import Runtimes, _fit_temperature, _output_kind, _probe_family
from stratus.tools.verify.classifier import (
    bundled_held_out,
    excluded_runtimes,
    synthetic_inputs,
    verify_family,
)
from stratus.tools.verify.report import VerifyReport, format_report

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


@dataclass
class _Staged:
    """What an import has created so far, removed again if it is refused."""

    folder: Path
    created: Path | None = None  # the topmost folder this import made
    paths: list[Path] = dataclasses.field(default_factory=list)

    def mkdir(self) -> None:
        missing = [p for p in (self.folder, *self.folder.parents) if not p.exists()]
        if missing:
            self.folder.mkdir(parents=True)
            self.created = missing[-1]

    def claim(self, path: Path) -> Path:
        if path.exists():
            raise ConfigError(f"{path} already exists; choose another variant name with --variant")
        self.paths.append(path)
        return path

    def scratch(self) -> Path:
        """Where the new config is checked; one a killed import left behind is replaced."""
        path = self.folder / f".{CONFIG_NAME}.import"
        path.unlink(missing_ok=True)
        return self.claim(path)

    def keep(self) -> None:
        """The import is committed: what it created now belongs to the family."""
        self.paths.clear()
        self.created = None

    def undo(self) -> None:
        for path in self.paths:
            path.unlink(missing_ok=True)
        if self.created is not None:
            shutil.rmtree(self.created, ignore_errors=True)


def _import(plan: _Plan, staged: _Staged, options: ImportOptions, cache: Path) -> ImportResult:
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
    refusals = plan.runtimes.refused
    if existing is not None and original is not None:
        text = _extended_text(original, existing, variant, plan.source, refusals)
    else:
        text = _new_family_text(probe, variant, plan.source, why, refusals)
    scratch = staged.scratch()
    scratch.write_text(text, encoding="utf-8")
    split, measured_on = _held_out(probe, labelled)
    report = _verify(load_family(scratch), plan.name, split, cache, refusals)
    if not report.ok:
        hint = " (--no-convert keeps only the file's own format)" if len(files) > 1 else ""
        raise ConfigError(
            f"{plan.source}: verify failed, nothing was imported{hint}:\n{format_report(report)}"
        )
    _commit(scratch, staged.folder / CONFIG_NAME, original)
    staged.keep()
    current = existing is None or plan.tier not in existing.current
    if existing is not None and not current:
        notes.append(
            f"the {plan.tier.label} tier's current variant stays {existing.current[plan.tier]}; {plan.name} is "
            "served only when pinned by name (or as a rollout candidate) until [current] names it"
        )
    family = load_family(staged.folder / CONFIG_NAME)
    if plan.tier is not Tier.CLOUD and plan.tier not in family.thresholds:
        warnings.append(_no_threshold(family.name, plan.tier))
    return ImportResult(
        family=family,
        variant=family.variant(plan.name),
        new_family=existing is None,
        current=current,
        notes=tuple(notes),
        report=report,
        labelled=measured_on,
        warnings=tuple(warnings),
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
        model = _openvino().Core().read_model(str(target))
        _openvino().save_model(model, str(xml), compress_to_fp16=False)
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
    family: FamilySpec, name: str, data: Split | None, cache: Path, refused: Mapping[str, str]
) -> VerifyReport:
    """The new variant in every runtime here that may serve it (labelled data, or synthetic
    inputs); those it skips say why."""
    availability = available_runtimes()
    usable = {n for n, status in availability.items() if status.available}
    only = dataclasses.replace(family, variants=(family.variant(name),))
    rows = verify_family(only, data if data is not None else synthetic_inputs(family), usable, cache)
    skipped = {n: status.reason for n, status in availability.items() if not status.available}
    skipped.update(excluded_runtimes(only, usable))
    skipped.update(
        {f"{runtime} for {name}": f"it cannot run the file: {why}" for runtime, why in refused.items()}
    )
    return VerifyReport(rows=tuple(rows), skipped=skipped)


def _commit(scratch: Path, config: Path, original: str | None) -> None:
    """Replace ``config`` by the checked text, unless someone changed it meanwhile."""
    now = config.read_text(encoding="utf-8") if config.exists() else None
    if now != original:
        raise ConfigError(f"{config} changed while importing; nothing was imported, try again")
    os.replace(scratch, config)
