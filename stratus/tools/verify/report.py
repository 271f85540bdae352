"""What ``stratus models verify`` reports: one row per (variant, runtime, format), the
tolerances that decide whether a variant's runtimes agree, and the table it prints.

Classifier rows (:mod:`stratus.tools.verify.classifier`) and generative ones
(:mod:`stratus.tools.verify.generative`) are both :class:`VerifyRow`; this module imports
neither, so each imports it without importing the other.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

TOLERANCE = 1e-4
FP16_TOLERANCE = 5e-3
# bf16 keeps 8 bits of mantissa (about 2.4 significant digits): a softmax computed in it lies
# up to a few 1e-2 from the same file's in f32 (4.1e-2 measured on defects-medium-fp16, AMD
# Zen 4), so its runtimes must also agree on the answer, as INT8's do.
BF16_TOLERANCE = 6.25e-2
INT8_AGREEMENT = 0.99
# The largest output difference two runtimes may show, by the arithmetic they compute in
# (RuntimeDescription.compute); a pair is judged by the looser of its two.
COMPUTE_TOLERANCE = {"f32": TOLERANCE, "f16": FP16_TOLERANCE, "bf16": BF16_TOLERANCE}
TEXT_AGREEMENT = 0.99  # generative, by default: 1 - the family's max_accuracy_drop (see verify.generative)


@dataclass(frozen=True, kw_only=True)
class VerifyRow:
    """One (variant, runtime, format): how right, how close to its parent, how big, how fast."""

    name: str
    tier: str
    precision: str
    runtime: str
    format: str
    accuracy: float | None
    max_abs_diff: float  # largest output difference against the variant's other runtimes
    runtime_agreement: float  # lowest top-1 agreement with the variant's other runtimes
    parent: str | None = None
    agreement: float | None = None  # top-1 agreement with the FP32 parent
    accuracy_drop: float | None = None  # parent's accuracy minus this one's
    within_tolerance: bool = True
    size_kib: float = 0.0
    latency_ms: dict[str, float] = field(default_factory=dict)  # {"b1": .., "b32": ..}, medians
    error: str | None = None
    kind: str = "classifier"  # or "generative": agreement is judged on what a client would get
    # Generative: the share of prompts the runtimes must serve alike, and how far this
    # runtime's accuracy lies below the best runtime's for the same file (at most the
    # family's max_accuracy_drop; see stratus.tools.verify.generative).
    required_agreement: float = TEXT_AGREEMENT
    accuracy_gap: float | None = None
    max_accuracy_gap: float = 0.01
    kv_cache: str = ""  # a generative runtime's KV-cache precision as loaded here
    # The arithmetic this runtime computes the variant in here (RuntimeDescription.compute),
    # and that of the runtimes it is compared with: the tolerance follows them, not the file.
    compute: str = ""
    peer_computes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def runtimes_agree(self) -> bool:
        if self.kind == "generative":
            gap_ok = self.accuracy_gap is None or self.accuracy_gap <= self.max_accuracy_gap + 1e-9
            return self.runtime_agreement >= self.required_agreement - 1e-9 and gap_ok
        if self.precision == "INT8":
            return self.runtime_agreement >= INT8_AGREEMENT
        if "bf16" in (self.compute, *self.peer_computes) and self.runtime_agreement < INT8_AGREEMENT:
            return False
        return self.max_abs_diff <= self.tolerance

    @property
    def tolerance(self) -> float:
        """The largest output difference allowed against the other runtimes: that of the
        loosest arithmetic among them and this one (an FP16 file is never held to f32's,
        even where every runtime widens it, as each may not on another CPU)."""
        computes = [c for c in (self.compute, *self.peer_computes) if c in COMPUTE_TOLERANCE]
        floor = FP16_TOLERANCE if self.precision == "FP16" else TOLERANCE
        return max([floor, *(COMPUTE_TOLERANCE[c] for c in computes)])

    @property
    def failed(self) -> bool:
        """A real problem: the file does not run, or runtimes give different answers."""
        return self.error is not None or not self.runtimes_agree

    @property
    def status(self) -> str:
        if self.error is not None:
            return self.error
        if not self.runtimes_agree and self.kind == "generative":
            if self.runtime_agreement < self.required_agreement - 1e-9:
                return (
                    f"runtimes disagree: served alike on {self.runtime_agreement:.1%} of prompts "
                    f"< {self.required_agreement:.1%}"
                )
            return (
                f"runtimes disagree: accuracy {self.accuracy_gap or 0.0:.3f} below another runtime's "
                f"> {self.max_accuracy_gap:.3f}"
            )
        if not self.runtimes_agree:
            return "runtimes disagree"
        if not self.within_tolerance:
            return f"outside tolerance (drop {self.accuracy_drop or 0.0:.4f})"
        return f"ok (kv cache {self.kv_cache})" if self.kv_cache else "ok"


@dataclass(frozen=True, kw_only=True)
class VerifyReport:
    rows: tuple[VerifyRow, ...]
    skipped: dict[str, str]
    records: dict[str, str] = field(default_factory=dict)  # family -> state of its record

    @property
    def ok(self) -> bool:
        return bool(self.rows) and not any(r.failed for r in self.rows)


def _cell(value: float | None, pattern: str) -> str:
    return format(value, pattern) if value is not None else "-"


def format_report(report: VerifyReport) -> str:
    header = (
        f"{'variant':<21}{'tier':<7}{'prec':<6}{'computes':<10}{'runtime':<15}{'format':<9}{'accuracy':>9}{'drop':>8}"
        f"{'agree':>8}{'KiB':>7}{'b1 ms':>8}{'b32 ms':>8}{'max|diff|':>10}{'rt-agree':>9}  status"
    )
    lines = [header, "-" * len(header)]
    for row in report.rows:
        lines.append(
            f"{row.name:<21}{row.tier:<7}{row.precision:<6}{row.compute or '-':<10}{row.runtime:<15}{row.format:<9}"
            f"{_cell(row.accuracy, '.4f'):>9}{_cell(row.accuracy_drop, '.4f'):>8}{_cell(row.agreement, '.4f'):>8}"
            f"{row.size_kib:>7.1f}{_cell(row.latency_ms.get('b1'), '.3f'):>8}{_cell(row.latency_ms.get('b32'), '.3f'):>8}"
            f"{row.max_abs_diff:>10.2e}{row.runtime_agreement:>9.4f}  {row.status}"
        )
    lines += [f"skipped {runtime}: {reason}" for runtime, reason in report.skipped.items()]
    lines += [f"record of {family}: {state}" for family, state in report.records.items()]
    outside = sorted({r.name for r in report.rows if not r.within_tolerance and not r.failed})
    if outside:
        lines.append(f"outside tolerance (reported, never served): {', '.join(outside)}")
    lines.append(
        f"verdict: {'PASS' if report.ok else 'FAIL'} (runtimes of a variant agree, by the arithmetic each "
        f"computes in here: f32 within {TOLERANCE:g}, f16 (or an FP16 file) within {FP16_TOLERANCE:g}, bf16 within "
        f"{BF16_TOLERANCE:g} and top-1 on >= {INT8_AGREEMENT:.0%} of items, INT8 top-1 on >= {INT8_AGREEMENT:.0%} "
        f"of items; generative: the same "
        f"escalation decision, and the same text where accepted, on >= 1 - max_accuracy_drop of prompts, "
        f"and accuracy within max_accuracy_drop of the best runtime's)"
    )
    return "\n".join(lines)
