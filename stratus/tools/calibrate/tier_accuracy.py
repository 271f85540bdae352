"""What ``stratus models calibrate`` records of each tier for the audits: of the calibration
split's items the thresholds settle on each tier, how many, the share right and the share the
top tier answered alike (family.toml's ``[tier_accuracy]``, read by stratus.families.audit)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from stratus.families.audit import TABLE, TierCalibration
from stratus.families.repository import load_family_text_check
from stratus.tiers import Tier


class Scored(Protocol):
    """One tier's scores on the calibration split (calibrate's TierScores)."""

    @property
    def tier(self) -> Tier: ...
    @property
    def confidence(self) -> np.ndarray[Any, Any]: ...
    @property
    def correct(self) -> np.ndarray[Any, Any]: ...
    @property
    def answers(self) -> np.ndarray[Any, Any] | None: ...


def tier_figures(scores: Sequence[Scored], thresholds: Sequence[float]) -> dict[Tier, TierCalibration]:
    """For each tier, the items the cascade settles there at ``thresholds`` (every tier's
    but the top's, bottom first): how many, the share right, and the share answered as the
    top tier answers them. Agreement needs each tier's answers (``TierScores.answers``). A
    tier that settles nothing is left out: no figure is better than one measured on nothing."""
    pending = np.ones(len(scores[0].correct), dtype=bool)
    top = scores[-1].answers
    figures = {}
    for index, tier in enumerate(scores):
        last = index == len(scores) - 1
        settled = pending.copy() if last else pending & (tier.confidence >= thresholds[index])
        pending &= ~settled
        if not settled.any():
            continue
        agreement = None
        if not last and top is not None and tier.answers is not None:
            agreement = float((tier.answers[settled] == top[settled]).mean())
        figures[tier.tier] = TierCalibration(
            accuracy=float(tier.correct[settled].mean()), agreement=agreement, items=int(settled.sum())
        )
    return figures


def describe_figures(figures: Mapping[Tier, TierCalibration]) -> list[str]:
    """One line per tier, as ``models calibrate`` prints them (and writes them: rounded down)."""
    lines = []
    for tier, f in sorted(figures.items()):
        agreement = f", agreement with the top tier {_floor(f.agreement)}" if f.agreement is not None else ""
        lines.append(
            f"settled on {tier.label:<7}{f.items:>6} items, accuracy {_floor(f.accuracy)}{agreement}"
        )
    return lines


def write_tier_accuracy(path: Path, figures: Mapping[Tier, TierCalibration]) -> None:
    """Replace (or append) the ``[tier_accuracy]`` table of a family config, with its comment,
    keeping the rest of the file; the result is parsed before it is written."""
    text = path.read_text(encoding="utf-8")
    section = re.compile(rf"(?:^#.*\n)*^\[{TABLE}\]\n(?:(?![\[#]).*\n?)*", re.MULTILINE)
    text = section.sub("", text, count=1).rstrip("\n") + "\n\n" + _table(figures)
    load_family_text_check(path, text)
    path.write_text(text, encoding="utf-8")


def _table(figures: Mapping[Tier, TierCalibration]) -> str:
    rows = []
    for tier, f in sorted(figures.items()):
        agreement = f", agreement = {_floor(f.agreement)}" if f.agreement is not None else ""
        rows.append(f"{tier.label} = {{ accuracy = {_floor(f.accuracy)}{agreement}, items = {f.items} }}\n")
    return (
        "# Per tier, of the calibration split's items its thresholds settle there (written by\n"
        "# `stratus models calibrate`): the share right and the share the top tier answered alike.\n"
        "# `stratus fleet accuracy` judges the live audits against agreement.\n"
        f"[{TABLE}]\n" + "".join(rows)
    )


def _floor(value: float) -> str:
    """Four decimals, rounded down: a recorded figure never claims more than was measured."""
    return f"{math.floor(value * 10_000) / 10_000:.4f}"
