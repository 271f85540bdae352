"""Every write of a ``family.toml``, so its layout is known in one place.

``stratus models calibrate`` rewrites one in place: its thresholds and the calibration record
beside them, the rest of the file kept, and never a file that would no longer load.
``stratus models import`` writes a new family's whole config, or an existing one's with the
variant appended (and its tier's ``[current]`` entry where missing)."""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path

from stratus.families.confidence import PASS_ALL
from stratus.families.repository import load_family_text_check
from stratus.families.spec import CalibrationRecord, FamilySpec, TensorSpec, VariantSpec
from stratus.tiers import Tier


def write_thresholds(
    path: Path, thresholds: Mapping[Tier, float], calibration: CalibrationRecord | None = None
) -> None:
    """Replace the ``[thresholds]`` table of a family config, and the ``[calibration]`` table
    that says what they gave (dropped when ``calibration`` is None: it would describe other
    thresholds), keeping the rest of the file."""
    text = _without_table(path.read_text(encoding="utf-8"), "calibration")
    body = "".join(_threshold_line(tier, value) for tier, value in sorted(thresholds.items()))
    if calibration is not None:
        body += "\n" + _calibration_table(calibration)
    section = re.compile(r"^\[thresholds\]\n(?:(?!\[).*\n?)*", re.MULTILINE)
    if section.search(text):
        text = section.sub(lambda _: "[thresholds]\n" + body + "\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n[thresholds]\n" + body
    load_family_text_check(path, text)
    path.write_text(text, encoding="utf-8")


def _threshold_line(tier: Tier, value: float) -> str:
    """``device = 0.9312``; a ``PASS_ALL`` threshold says what it does, for whoever reads the file."""
    said = f"  # above 1: the {tier.label} tier answers nothing, every request passes it up" if value >= PASS_ALL else ""
    return f"{tier.label} = {value:.4f}{said}\n"


def _calibration_table(record: CalibrationRecord) -> str:
    return (
        "# Written with [thresholds] by `stratus models calibrate`: what they gave on the split they\n"
        "# were chosen on. The router exports cloud_share (stratus_router_family_calibrated_cloud_share).\n"
        "[calibration]\n"
        f"goal = {_toml_string(record.goal)}\n"
        f"data = {_toml_string(record.data)}\n"
        f"accuracy = {record.accuracy:.4f}\n"
        f"cloud_share = {record.cloud_share:.4f}\n"
    )


def _toml_string(text: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in escaped) + '"'


def _without_table(text: str, name: str) -> str:
    """``text`` without the table ``[name]`` and the comment lines just above it."""
    table = re.compile(rf"(?:^#.*\n)*^\[{name}\]\n(?:(?![\[#]).*\n?)*", re.MULTILINE)
    return table.sub("", text, count=1)


# -- what an import writes -------------------------------------------------------------


def _quoted(text: str) -> str:
    """A TOML basic string (JSON's escapes are valid TOML)."""
    return json.dumps(text)


def _tensor_tables(kind: str, specs: Sequence[TensorSpec]) -> list[str]:
    lines = []
    for spec in specs:
        shape = ", ".join(str(d) for d in spec.shape)
        lines += [
            f"[[{kind}]]",
            f"name = {_quoted(spec.name)}",
            f'datatype = "{spec.datatype}"',
            f"shape = [{shape}]",
            "",
        ]
    return lines


def variant_block(variant: VariantSpec, source: Path, refused: Mapping[str, str] | None = None) -> str:
    comments = [
        f"# Imported from {source.name} by `stratus models import`.",
        *(f"# {runtime} cannot run it: {why}" for runtime, why in (refused or {}).items()),
    ]
    return _block(comments, variant)


def child_block(child: VariantSpec, how: str) -> str:
    """A lower-precision child's table, under a comment saying how it was made from its parent."""
    return _block([f"# {how}"], child)


def _block(comments: Sequence[str], variant: VariantSpec) -> str:
    files = ", ".join(f"{fmt} = {_quoted(path.name)}" for fmt, path in variant.files.items())
    runtimes = ", ".join(_quoted(r) for r in variant.runtimes)
    return "\n".join(
        [
            *comments,
            "[[variants]]",
            f"name = {_quoted(variant.name)}",
            f'tier = "{variant.tier.label}"',
            f'precision = "{variant.precision}"',
            *([f"parent = {_quoted(variant.parent)}"] if variant.parent else []),
            *([f"temperature = {variant.temperature:g}"] if variant.temperature != 1.0 else []),
            f"files = {{ {files} }}",
            *([f"runtimes = [{runtimes}]"] if variant.runtimes else []),
            "",
        ]
    )


def new_family_text(
    family: FamilySpec, variant: VariantSpec, source: Path, why: str, refused: Mapping[str, str]
) -> str:
    spec = family.confidence
    lines = [
        f"# The {family.name} family, created by `stratus models import` from {source.name}.",
        f"# Thresholds: `stratus models calibrate {family.name} --data FILE.npz --target-accuracy A`;",
        "# a tier without one answers whatever reaches it.",
        "",
        "[family]",
        f"name = {_quoted(family.name)}",
        f"description = {_quoted(f'Imported from {source.name}.')}",
        "# How much held-out accuracy an INT8/FP16 child may lose against its FP32 parent (absolute);",
        "# `stratus models import` keeps no child that loses more, and agents never serve one.",
        f"max_accuracy_drop = {family.max_accuracy_drop:g}",
        "",
        *_tensor_tables("inputs", family.inputs),
        *_tensor_tables("outputs", family.outputs),
        "[confidence]",
        "# output: the model's first [batch, classes] output. apply_softmax: true when it holds logits,",
        f"# false when it holds probabilities ({why}).",
        f"output = {_quoted(spec.output)}",
        f'method = "{spec.method.value}"',
        f"apply_softmax = {'true' if spec.apply_softmax else 'false'}",
        "",
        "# Each tier's escalation threshold, written by `stratus models calibrate`.",
        "[thresholds]",
        "",
        "[current]",
        "# Each tier's current variant: served unless a request pins another variant by name or a",
        "# rollout sends part of the tier's traffic to a candidate.",
        f"{variant.tier.label} = {_quoted(variant.name)}",
        "",
        variant_block(variant, source, refused),
    ]
    return "\n".join(lines)


def extended_text(
    text: str, family: FamilySpec, variant: VariantSpec, source: Path, refused: Mapping[str, str]
) -> str:
    """The family's config with the variant appended, and its tier's ``[current]`` entry
    written where the file does not name one (a tier's only variant is current implicitly;
    a second one needs the choice written down)."""
    explicit = tomllib.loads(text).get("current", {})
    if variant.tier.label not in explicit:
        chosen = family.current.get(variant.tier, variant.name)
        text = with_current_entry(text, variant.tier, chosen)
    return text.rstrip("\n") + "\n\n" + variant_block(variant, source, refused)


def with_current_entry(text: str, tier: Tier, name: str) -> str:
    """``text`` with ``tier = "name"`` in its ``[current]`` table (created before the first
    ``[thresholds]`` or ``[[variants]]`` header when missing); the rest kept as it is."""
    lines = text.splitlines(keepends=True)
    entry = f"{tier.label} = {_quoted(name)}\n"
    headers = [i for i, line in enumerate(lines) if line.lstrip().startswith("[")]
    table = next((i for i in headers if _header(lines[i]) == "[current]"), None)
    if table is None:
        at = next((i for i in headers if _header(lines[i]) in ("[thresholds]", "[[variants]]")), len(lines))
        block = [
            "# Each tier's current variant (written by `stratus models import`).\n",
            "[current]\n",
            entry,
            "\n",
        ]
        return "".join(lines[:at] + block + lines[at:])
    last = table
    for index in range(table + 1, len(lines)):
        if index in headers:
            break
        if "=" in lines[index] and not lines[index].lstrip().startswith("#"):
            last = index
    return "".join([*lines[: last + 1], entry, *lines[last + 1 :]])


def _header(line: str) -> str:
    return line.split("#", 1)[0].strip().replace(" ", "")
