"""Rewriting a ``family.toml`` in place (``stratus models calibrate``): its thresholds and
the calibration record beside them, the rest of the file kept, and never a file that would
no longer load."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from stratus.families.confidence import PASS_ALL
from stratus.families.repository import load_family_text_check
from stratus.families.spec import CalibrationRecord
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
