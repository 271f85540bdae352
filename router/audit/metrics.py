"""The audits as Prometheus reads them at each scrape (``stratus_router_audit_*``)."""

from __future__ import annotations

from router.audit.agreement import Estimate, total
from router.audit.auditor import Auditor
from stratus.obs.metrics import Metric, gauge


def audit_levels(auditor: Auditor) -> list[Metric]:
    """What Prometheus reads at each scrape: per (family, tier, variant), the live agreement
    with its Wilson bounds and the audits behind it; per (family, tier), the calibrated line."""
    grouped: dict[tuple[str, str, str], list[Estimate]] = {}
    for key, estimate in auditor.book.estimates().items():
        grouped.setdefault((key.family, key.tier.label, key.variant), []).append(estimate)
    rows = [(list(labels), total(estimates)) for labels, estimates in sorted(grouped.items())]
    labels = ["family", "tier", "variant"]
    calibrated = [
        ([name, tier.label], line)
        for name, info in sorted(auditor.registry.families.items())
        for tier, line in sorted(auditor.calibrated_lines(info).items())
    ]
    return [
        gauge("stratus_router_audit_agreement", "Share of audited items a tier answered as the top tier did, "
              "over the audit window.", labels, [(k, e.agreement) for k, e in rows]),
        gauge("stratus_router_audit_agreement_lower", "Lower bound of the audit agreement's 95% Wilson interval.",
              labels, [(k, e.interval[0]) for k, e in rows]),
        gauge("stratus_router_audit_agreement_upper", "Upper bound of the audit agreement's 95% Wilson interval.",
              labels, [(k, e.interval[1]) for k, e in rows]),
        gauge("stratus_router_audit_window_audits", "Audits behind the agreement estimate (the window's).",
              labels, [(k, float(e.audits)) for k, e in rows]),
        gauge("stratus_router_audit_calibrated_agreement", "A tier's agreement with the top tier on the "
              "calibration split ([tier_accuracy] in family.toml), where audits ask that top tier.",
              ["family", "tier"], calibrated),
    ]  # fmt: skip
