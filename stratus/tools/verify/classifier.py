"""``stratus models verify``: every variant in every runtime here, on the held-out split.

A variant must give the same answer whichever runtime serves it: the router may send the
same request to a TFLite device today and an OpenVINO one tomorrow. So each variant runs
in every (runtime, format) it ships that this machine can run, and the runtimes are
compared, with a check that fits the precision:

* FP32 arithmetic: outputs agree within ``TOLERANCE`` (1e-4, absolute, on probabilities);
* FP16: within ``FP16_TOLERANCE`` (5e-3): FP16 keeps about three significant digits, and
  one runtime may compute in FP16 while another widens the FP16 weights to FP32;
* bf16 arithmetic (a runtime that computes so here, whatever the file's precision): within
  ``BF16_TOLERANCE`` and the same top-1 answer on ``INT8_AGREEMENT`` of the items;
* INT8: top-1 answers agree on at least ``INT8_AGREEMENT`` of the items: each runtime
  rounds activations its own way (LiteRT's own ranges, ONNX Runtime's and OpenVINO's
  QDQ kernels), so probabilities differ by a few 1/256 steps, but answers must not.

Each row says the arithmetic its runtime computes in here, read from the runtime after
loading (:attr:`RuntimeDescription.compute`), and is judged by it and by its peers' (the
looser of each pair), never by what was asked: OpenVINO asked for f16 on a CPU without FP16
arithmetic computes in bf16.

A lower-precision variant is also compared with its FP32 parent: held-out accuracy drop
and top-1 agreement. One that loses more than the family's ``max_accuracy_drop`` is
reported as outside tolerance; that is a correct finding, not a failure, and such a
variant is never served (see :mod:`stratus.families.precision`). The verdict fails only when a
runtime errs or runtimes disagree. ``record=True`` writes each family's verification
record; without it, a missing or stale record is reported.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from stratus.datatypes import Array, numpy_dtype
from stratus.errors import ConfigError
from stratus.families.precision import (
    VariantRecord,
    VerificationRecord,
    file_sha256,
    load_verification,
    record_path,
    variant_files,
    write_verification,
)
from stratus.families.spec import FamilySpec, VariantSpec
from stratus.runtimes import RUNNERS, Choice, LoadOptions, ModelRunner, available_runtimes, open_runner
from stratus.tools.datasets import Split, dataset_for
from stratus.tools.verify.report import VerifyReport, VerifyRow

LATENCY_RUNS = {1: 25, 32: 10}


@dataclass
class _Run:
    """One runtime's outputs and timings for a variant."""

    choice: Choice
    output: Array | None = None
    latency_ms: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    compute: str = ""  # the arithmetic the runtime computes it in here


def _all_choices(variant: VariantSpec, usable: set[str]) -> list[Choice]:
    return [
        Choice(runtime=name, format=fmt, path=variant.files[fmt])
        for name, runner in RUNNERS.items()
        if name in usable and variant.allows(name)
        for fmt in runner.formats
        if fmt in variant.files
    ]


def excluded_runtimes(family: FamilySpec, usable: set[str]) -> dict[str, str]:
    """The runtimes here that read a variant's files but that its ``runtimes`` leave out:
    skipped, and the report says so (``models import`` wrote why as a comment above it)."""
    return {
        f"{name} for {variant.name}": f"not among its runtimes ({', '.join(variant.runtimes)}; "
        f"{family.source})"
        for variant in family.variants
        for name, runner in RUNNERS.items()
        if name in usable and not variant.allows(name) and set(runner.formats) & set(variant.files)
    }


def bundled_held_out(family: FamilySpec) -> Split | None:
    """The held-out split of a shipped family's bundled data; None for any other family."""
    try:
        return dataset_for(family.name).held_out
    except ConfigError:
        return None


# Where a family's labelled held-out examples come from (None: it has none).
DataSource = Callable[[FamilySpec], Split | None]


def _median_ms(runner: ModelRunner, inputs: dict[str, Array], runs: int) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        runner.infer(inputs)
        times.append((time.perf_counter() - started) * 1000.0)
    return statistics.median(times)


def _run(family: FamilySpec, variant: VariantSpec, choice: Choice, x: Array, cache: Path) -> _Run:
    """Outputs on the whole split, then batch-1 and batch-32 latency (warm, medians)."""
    runner = open_runner(family, variant, choice, LoadOptions(tier=variant.tier, cache_dir=cache))
    name = family.inputs[0].name
    try:
        runner.warmup()
        output = runner.infer({name: x})[family.confidence.output]
        latency = {
            f"b{size}": _median_ms(runner, {name: np.resize(x, (size, *x.shape[1:]))}, runs)
            for size, runs in LATENCY_RUNS.items()
        }
        return _Run(choice, output, latency, compute=runner.describe().compute)
    finally:
        runner.close()


def _run_all(
    family: FamilySpec, variant: VariantSpec, data: Split, usable: set[str], cache: Path
) -> list[_Run]:
    runs = []
    for choice in _all_choices(variant, usable):
        try:
            runs.append(_run(family, variant, choice, data.x, cache))
        except Exception as exc:  # a verify run reports every failure, per row, whatever raised it
            runs.append(_Run(choice, error=f"{type(exc).__name__}: {exc}"))
    return runs


def _top1_agreement(a: Array, b: Array) -> float:
    return float((a.argmax(axis=1) == b.argmax(axis=1)).mean()) if len(a) else 1.0


def _size_kib(choice: Choice) -> float:
    parts = [choice.path, choice.path.with_suffix(".bin")] if choice.format == "openvino" else [choice.path]
    return sum(p.stat().st_size for p in parts if p.is_file()) / 1024.0


@dataclass(frozen=True)
class _Parent:
    """The FP32 parent's outputs by runtime, and its accuracy, for its children's rows."""

    outputs: dict[str, Array]
    accuracy: float | None


def _row(
    family: FamilySpec,
    variant: VariantSpec,
    run: _Run,
    runs: Sequence[_Run],
    data: Split,
    *,
    parent: _Parent | None,
) -> VerifyRow:
    output = run.output
    others = [r.output for r in runs if r.output is not None]
    accuracy = float((output.argmax(axis=1) == data.y).mean()) if output is not None and len(data.y) else None
    agreement, drop = _against_parent(output, run.choice.runtime, accuracy, parent)
    return VerifyRow(
        name=variant.name,
        tier=variant.tier.label,
        precision=variant.precision,
        runtime=run.choice.runtime,
        format=run.choice.format,
        accuracy=accuracy,
        max_abs_diff=max((float(np.abs(output - o).max()) for o in others), default=0.0)
        if output is not None
        else 0.0,
        runtime_agreement=min((_top1_agreement(output, o) for o in others), default=1.0)
        if output is not None
        else 1.0,
        parent=variant.parent,
        agreement=agreement,
        accuracy_drop=drop,
        within_tolerance=drop is None or drop <= family.max_accuracy_drop + 1e-9,
        size_kib=_size_kib(run.choice),
        latency_ms=run.latency_ms,
        error=run.error,
        compute=run.compute,
        peer_computes=tuple(r.compute for r in runs if r is not run and r.output is not None),
    )


def _against_parent(
    output: Array | None, runtime: str, accuracy: float | None, parent: _Parent | None
) -> tuple[float | None, float | None]:
    """(top-1 agreement, accuracy drop) against the parent in the same runtime where it ran.

    Without labels, the disagreement with the parent stands in for the drop: it bounds it.
    """
    if parent is None or output is None or not parent.outputs:
        return None, None
    reference = parent.outputs.get(runtime, next(iter(parent.outputs.values())))
    agreement = _top1_agreement(output, reference)
    if accuracy is None or parent.accuracy is None:
        return agreement, 1.0 - agreement
    return agreement, max(0.0, parent.accuracy - accuracy)


def verify_family(family: FamilySpec, data: Split, usable: set[str], cache: Path) -> list[VerifyRow]:
    """Every variant of a family; parents before children, as ``family.toml`` lists them."""
    rows: list[VerifyRow] = []
    parents: dict[str, _Parent] = {}
    for variant in sorted(family.variants, key=lambda v: v.parent is not None):
        runs = _run_all(family, variant, data, usable, cache)
        parent = parents.get(variant.parent) if variant.parent else None
        variant_rows = [_row(family, variant, run, runs, data, parent=parent) for run in runs]
        rows += variant_rows
        if variant.parent is None:
            accuracies = [r.accuracy for r in variant_rows if r.accuracy is not None]
            outputs = {r.choice.runtime: r.output for r in runs if r.output is not None}
            parents[variant.name] = _Parent(outputs, min(accuracies) if accuracies else None)
    return rows


def record_family(
    family: FamilySpec, *, cache_dir: Path, data: DataSource = bundled_held_out
) -> VerifyReport:
    """Verify one family and write its record: the last step of ``models/build/``."""
    availability = available_runtimes()
    usable = {name for name, status in availability.items() if status.available}
    rows = verify_family(family, _or_synthetic(family, data(family)), usable, cache_dir)
    skipped = {name: status.reason for name, status in availability.items() if not status.available}
    skipped.update(excluded_runtimes(family, usable))
    return VerifyReport(rows=tuple(rows), skipped=skipped, records={family.name: _write_record(family, rows)})


def _or_synthetic(family: FamilySpec, data: Split | None) -> Split:
    return data if data is not None else synthetic_inputs(family)


def synthetic_inputs(family: FamilySpec, count: int = 64, *, seed: int = 0) -> Split:
    """Inputs drawn from the first input's spec with a fixed seed, and no labels.

    Families without labelled data are still checked for agreement between runtimes, size
    and latency. Floats are uniform in [0, 1), integers uniform in [0, 10), booleans fair.
    """
    spec = family.inputs[0]
    shape = tuple(count if d == -1 else d for d in spec.shape)
    dtype = numpy_dtype(spec.datatype, tensor=spec.name)
    rng = np.random.default_rng(seed)
    if dtype == np.float32:
        x: Array = rng.random(shape, dtype=np.float32)
    elif dtype.kind == "f":
        x = rng.random(shape).astype(dtype)
    elif dtype.kind == "b":
        x = rng.random(shape) < 0.5
    else:
        x = rng.integers(0, 10, shape).astype(dtype)
    return Split(x, np.empty(0, dtype=np.int64))


# ---------------------------------------------------------------------------------------------
# The verification record
# ---------------------------------------------------------------------------------------------


def build_record(family: FamilySpec, rows: Sequence[VerifyRow]) -> VerificationRecord:
    """Deterministic figures only (no timings): the lowest over runtimes, and file hashes."""
    entries = {}
    for variant in family.variants:
        mine = [r for r in rows if r.name == variant.name]
        drop = max((r.accuracy_drop for r in mine if r.accuracy_drop is not None), default=0.0)
        entries[variant.name] = VariantRecord(
            name=variant.name,
            precision=variant.precision,
            parent=variant.parent,
            sha256={name: file_sha256(path) for name, path in sorted(variant_files(family, variant).items())},
            accuracy=_lowest(r.accuracy for r in mine),
            accuracy_drop=drop,
            agreement=_lowest(r.agreement for r in mine) if variant.parent else 1.0,
            within_tolerance=bool(mine) and all(r.within_tolerance and not r.failed for r in mine),
            runtimes=tuple(sorted({r.runtime for r in mine if r.error is None})),
        )
    return VerificationRecord(
        family=family.name,
        max_accuracy_drop=family.max_accuracy_drop,
        variants=entries,
        source=record_path(family),
    )


def _lowest(values: Iterable[float | None]) -> float:
    """The worst figure over runtimes; NaN when none was measured (no labels, or errors)."""
    return min((v for v in values if v is not None), default=float("nan"))


def _write_record(family: FamilySpec, rows: Sequence[VerifyRow]) -> str:
    write_verification(build_record(family, rows))
    return f"written: {record_path(family)}"


def record_state(family: FamilySpec) -> str:
    """Whether the committed record still describes these files: fresh, missing or stale."""
    record = load_verification(family)
    if record is None:
        return f"missing: {record_path(family)} (run `stratus models verify --record`)"
    stale = [
        problem
        for variant in family.variants
        if (problem := record.problem(family, variant)) and not problem.startswith("outside tolerance")
    ]
    if stale:
        return f"stale: {'; '.join(stale)} (run `stratus models verify --record`)"
    return f"fresh: {record_path(family)}"
