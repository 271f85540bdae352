"""Thresholds suggested from the audit rows a router lists (fleet.proto's ``AuditRow``): the rows
read into values, then the domain's own chooser (``stratus/families/suggest.py``), which a router
runs on its own rows for ``--auto-thresholds``. ``stratus fleet thresholds --suggest`` reads rows
from every router of a site, so it starts from the wire."""

from __future__ import annotations

from collections.abc import Sequence

from stratus.convert.fleet import audit_row_from_wire
from stratus.families import suggest as search
from stratus.families.suggest import MIN_ROWS, Suggestion, TierScores
from stratus.wire import fleet_pb2 as fpb


def audit_scores(rows: Sequence[fpb.AuditRow], *, min_rows: int = MIN_ROWS) -> list[TierScores]:
    return search.audit_scores([audit_row_from_wire(r) for r in rows], min_rows=min_rows)


def suggest(
    rows: Sequence[fpb.AuditRow],
    *,
    target_accuracy: float | None = None,
    max_escalation: float | None = None,
    min_rows: int = MIN_ROWS,
) -> Suggestion:
    return search.suggest(
        [audit_row_from_wire(r) for r in rows],
        target_accuracy=target_accuracy,
        max_escalation=max_escalation,
        min_rows=min_rows,
    )
