"""Audit rows: per sampled item, what every tier it visited said, labelled with the top tier's answer.

Calibrate chooses thresholds by simulating the cascade over rows that hold *every* lower tier's
confidence and answer on the same item (``stratus.families.suggest.cascade``). An
audit's agreement alone (one tier's answer against the top's) cannot feed it, so the auditor
also keeps such rows, from the same unbiased draw: an item that settled below the top tier is
a row once the top tier's answer comes back; an item that climbed to the top tier anyway is
one at once (drawn with the same share), since it carries both answers. With the top tier's
answer as the label, ``stratus fleet thresholds --suggest`` runs calibrate's own chooser on
them. A row whose item skipped a tier below the top (settled on the device of a three-tier
family) lacks that tier: the suggestion uses only rows that hold every tier below the top.

A generative family's rows hold no text: each tier's answer says only whether it agreed with
the top tier's by the family's comparator (``[audit] compare``), which is what calibrate needs,
and what an operator reading the rows may see without seeing a prompt.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Final

from stratus.families.suggest import AuditRow, TierAnswer
from stratus.tiers import Tier

# Rows kept per family (the oldest go first), and how old one may be: the window audits use.
MAX_ROWS: Final = 5000
MAX_ROW_AGE_S: Final = 3600.0


class RowBook:
    """Each family's latest rows, bounded by count and age."""

    def __init__(
        self,
        *,
        max_rows: int = MAX_ROWS,
        max_age_s: float = MAX_ROW_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._rows: dict[str, deque[AuditRow]] = {}
        self._max_rows = max_rows
        self._max_age_s = max_age_s
        self._clock = clock

    def add(self, family: str, lower: tuple[TierAnswer, ...], top: Tier, label: int) -> None:
        kept = self._rows.setdefault(family, deque(maxlen=self._max_rows))
        kept.append(AuditRow(lower=lower, top=top, label=label, at=self._clock()))

    def rows(self, family: str) -> list[AuditRow]:
        kept = self._rows.get(family)
        if kept is None:
            return []
        oldest = self._clock() - self._max_age_s
        while kept and kept[0].at < oldest:
            kept.popleft()
        return list(kept)
