"""What a family's files say about audits: ``[audit]`` and ``[tier_accuracy]`` in family.toml.

``[audit]`` (optional) sets how many of the answers that settle below the family's top tier the
router also asks of that tier, in the background, to estimate each tier's live accuracy::

    [audit]
    share = 0.05        # default: the router's --audit-share
    max_per_s = 20      # default: the router's --audit-max-per-s
    compare = "number"  # top1 (classifiers), exact or number (generative); default top1 / exact
    auto = "target_accuracy 0.98"  # a goal for `--auto-thresholds families`; default none

``[tier_accuracy]`` is written by ``stratus models calibrate`` (never by hand): for each tier,
of the calibration split's items the chosen thresholds settle there, the share right, the share
the top tier answered alike, and how many items that was. The live estimate is an agreement with
the top tier, so it is judged against ``agreement``; ``accuracy`` is shown beside it::

    [tier_accuracy]
    device = { accuracy = 0.9712, agreement = 0.9856, items = 243 }

Both travel to the router in the agents' Hellos (``FamilyInfo.audit``, ``FamilyInfo.calibrated``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from stratus.errors import InvalidInput
from stratus.families.toml_reader import TableReader
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb

TOP1: Final = "top1"
EXACT: Final = "exact"
NUMBER: Final = "number"
CLASSIFIER_COMPARES: Final = (TOP1,)
GENERATIVE_COMPARES: Final = (EXACT, NUMBER)
# A family may ask for at most this many audits a second (each costs a top-tier call).
MAX_AUDITS_PER_S: Final = 10_000.0
TABLE: Final = "tier_accuracy"


@dataclass(frozen=True, kw_only=True)
class AuditSpec:
    """``[audit]``: None where the router's own setting applies."""

    share: float | None = None
    max_per_s: float | None = None
    compare: str = ""
    # The goal the router's threshold controller steps toward, where the router lets families
    # choose (``--auto-thresholds families``): "target_accuracy A" or "max_escalation S".
    auto: str = ""


@dataclass(frozen=True, kw_only=True)
class TierCalibration:
    """One tier's line of ``[tier_accuracy]``; ``agreement`` is None on the top tier."""

    accuracy: float
    agreement: float | None
    items: int


def parse_audit(reader: TableReader, data: Mapping[str, Any], *, generative: bool) -> AuditSpec:
    table = reader.get(data, "audit", dict, "", {})
    reader.unknown_keys(table, {"share", "max_per_s", "compare", "auto"}, "audit")
    share = reader.get(table, "share", float, "audit", None)
    if share is not None and not 0.0 <= share <= 1.0:
        raise reader.fail("audit.share", f"{share} must lie between 0 and 1")
    rate = reader.get(table, "max_per_s", float, "audit", None)
    if rate is not None and not 0.0 <= rate <= MAX_AUDITS_PER_S:
        raise reader.fail("audit.max_per_s", f"{rate} must lie between 0 and {MAX_AUDITS_PER_S:g}")
    compares = GENERATIVE_COMPARES if generative else CLASSIFIER_COMPARES
    compare = reader.choice(table, "compare", compares, "audit") if "compare" in table else ""
    auto = reader.get(table, "auto", str, "audit", "")
    if auto and (problem := goal_problem(auto)) is not None:
        raise reader.fail("audit.auto", problem)
    return AuditSpec(share=share, max_per_s=rate, compare=compare, auto=auto)


GOALS: Final = ("target_accuracy", "max_escalation")


def goal_problem(goal: str) -> str | None:
    """Why ``goal`` is not "target_accuracy A" or "max_escalation S" with a share (None: it is)."""
    name, _, value = goal.partition(" ")
    try:
        share = float(value)
    except ValueError:
        share = math.nan
    if name not in GOALS or not 0.0 <= share <= 1.0:
        return f"{goal[:40]!r} is not 'target_accuracy A' or 'max_escalation S' with a share between 0 and 1"
    return None


def parse_tier_accuracy(reader: TableReader, data: Mapping[str, Any]) -> dict[Tier, TierCalibration]:
    table = reader.get(data, TABLE, dict, "", {})
    figures = {}
    for key in table:
        where = f"{TABLE}.{key}"
        try:
            tier = Tier.parse(key)
        except InvalidInput:
            raise reader.fail(where, f"'{key}' is not one of device, edge, cloud") from None
        entry = reader.get(table, key, dict, TABLE)
        reader.unknown_keys(entry, {"accuracy", "agreement", "items"}, where)
        figures[tier] = TierCalibration(
            accuracy=_share(reader, entry, "accuracy", where),
            agreement=_share(reader, entry, "agreement", where) if "agreement" in entry else None,
            items=_count(reader, entry, where),
        )
    return figures


def _share(reader: TableReader, table: Mapping[str, Any], key: str, where: str) -> float:
    value: float = reader.get(table, key, float, where)
    if not 0.0 <= value <= 1.0:
        raise reader.fail(f"{where}.{key}", f"{value} must lie between 0 and 1")
    return value


def _count(reader: TableReader, table: Mapping[str, Any], where: str) -> int:
    value: int = reader.get(table, "items", int, where)
    if value < 0:
        raise reader.fail(f"{where}.items", f"{value} must not be negative")
    return value


# ---------------------------------------------------------------------------------------------
# On the wire: what an agent's Hello says, and what the router accepts of it
# ---------------------------------------------------------------------------------------------


def calibration_info(figures: TierCalibration) -> fpb.TierCalibration:
    info = fpb.TierCalibration(accuracy=figures.accuracy, items=figures.items)
    if figures.agreement is not None:
        info.agreement = figures.agreement
    return info


def check_family_info(agent: str, family: fpb.FamilyInfo) -> None:
    """Refuse a Hello whose audit settings or calibrated figures are out of range (NaN too):
    they steer how many top-tier calls the router makes, and what it alerts on."""
    audit = family.audit
    where = f"Hello from {agent}: family {family.name[:40]!r}"
    if audit.HasField("share") and not 0.0 <= audit.share <= 1.0:
        raise InvalidInput(f"{where}: audit share {audit.share} must lie between 0 and 1")
    if audit.HasField("max_per_s") and not 0.0 <= audit.max_per_s <= MAX_AUDITS_PER_S:
        raise InvalidInput(f"{where}: audit max_per_s {audit.max_per_s} must lie between 0 and 10000")
    if audit.compare not in ("", *CLASSIFIER_COMPARES, *GENERATIVE_COMPARES):
        raise InvalidInput(f"{where}: audit compare {audit.compare[:20]!r} is not top1, exact or number")
    if audit.auto and (problem := goal_problem(audit.auto)) is not None:
        raise InvalidInput(f"{where}: audit auto {problem}")
    for tier, figures in family.calibrated.items():
        if tier not in ("device", "edge", "cloud"):
            raise InvalidInput(f"{where}: calibrated figures for {tier[:20]!r}, not a tier")
        shares = [figures.accuracy, *([figures.agreement] if figures.HasField("agreement") else [])]
        if not all(0.0 <= share <= 1.0 for share in shares):
            raise InvalidInput(f"{where}: calibrated {tier} figures must lie between 0 and 1")
