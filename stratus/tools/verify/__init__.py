"""``stratus models verify``: every variant in every runtime here, on held-out data, for
classifier families (:mod:`.classifier`) and generative ones (:mod:`.generative`); what it
reports is in :mod:`.report`."""

from __future__ import annotations

import tempfile
from pathlib import Path

from stratus.families.repository import ModelRepository
from stratus.families.spec import FamilySpec
from stratus.runtimes import available_runtimes
from stratus.tools.verify.classifier import (
    DataSource,
    _or_synthetic,
    _write_record,
    bundled_held_out,
    excluded_runtimes,
    record_state,
    verify_family,
)
from stratus.tools.verify.generative import (
    bundled_prompts_held_out,
    usable_generators,
    verify_generative_family,
)
from stratus.tools.verify.report import VerifyReport, VerifyRow


def verify(
    repository: ModelRepository,
    *,
    cache_dir: Path | None = None,
    record: bool = False,
    data: DataSource = bundled_held_out,
) -> VerifyReport:
    """Verify every family; with ``record``, (re)write each family's verification record.

    ``data`` gives a family's labelled held-out examples, or None: such a family is run on
    synthetic inputs instead (agreement, size and latency; accuracy is not measured).
    """
    availability = available_runtimes()
    usable = {name for name, status in availability.items() if status.available}
    skipped = {name: status.reason for name, status in availability.items() if not status.available}
    rows: list[VerifyRow] = []
    records: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="stratus-verify-") as scratch:
        cache = cache_dir or Path(scratch)
        for family in repository.families.values():
            if family.generative:
                rows += _verify_generative(family, cache, skipped)
                continue
            family_rows = verify_family(family, _or_synthetic(family, data(family)), usable, cache)
            skipped.update(excluded_runtimes(family, usable))
            rows += family_rows
            records[family.name] = _write_record(family, family_rows) if record else record_state(family)
    return VerifyReport(rows=tuple(rows), skipped=skipped, records=records)


def _verify_generative(family: FamilySpec, cache: Path, skipped: dict[str, str]) -> list[VerifyRow]:
    """A generative family on its bundled held-out prompts, in every generative runtime here."""
    usable, unusable = usable_generators()
    skipped.update(unusable)
    prompts = bundled_prompts_held_out(family)
    if prompts is None:
        skipped[f"family {family.name}"] = "no labelled prompts ship with it (only arith's do)"
        return []
    rows = verify_generative_family(family, prompts, usable, cache)
    for variant in family.variants:
        if not any(row.name == variant.name for row in rows):
            skipped[f"variant {variant.name}"] = (
                f"no generative runtime here reads its files ({', '.join(sorted(variant.files))}); "
                "vLLM serves a Hugging Face folder"
            )
    return rows
