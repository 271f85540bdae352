"""What the fleet under test serves on this hardware, so tests hold on any CPU.

Agents, the cloud gateway and the SDK serve each FP32 line in the fastest precision the
CPU runs natively (or that ``STRATUS_CPU_FLAGS`` says it does; ``make test`` runs the
precision-sensitive tests a second time as the other kind of CPU). The routing tests are
about routing: they ask here which child that is, from the same rule and record, and the
tolerances follow from that child's precision. The choice itself is tested with fixed
flags in ``tests/unit/test_precision.py``.
"""

from __future__ import annotations

import functools

import numpy as np

from stratus.families.cpu import this_hardware
from stratus.families.precision import choose_variant, load_verification
from stratus.families.repository import ModelRepository
from stratus.families.spec import VariantSpec
from stratus.tools.verify.report import FP16_TOLERANCE

from .cluster import MODELS

# How far a row of probabilities may sum from 1: FP32 keeps about 7 digits; FP16 about 3
# per value; an INT8 LiteRT softmax is quantised in steps of 1/256, each value rounded by up
# to half a step (ten classes).
SUM_TOLERANCE = {"FP32": 1e-5, "FP16": 1e-2, "INT8": 10 * 0.5 / 256 + 1e-6}
# How far one item's probabilities may move when it runs in a batch of another size: not at
# all in FP32; an FP16 kernel may accumulate in another order (verify's FP16 tolerance); an
# INT8 one by a quantisation step.
BATCH_TOLERANCE = {"FP32": 0.0, "FP16": FP16_TOLERANCE, "INT8": 1 / 256}


@functools.cache
def _repository() -> ModelRepository:
    return ModelRepository.load(MODELS)


@functools.cache
def served_for(line: str) -> VariantSpec:
    """The variant served for FP32 variant ``line`` on this hardware."""
    repository = _repository()
    variant = repository.variant(line)
    family = repository.family(variant.family)
    choice = choose_variant(
        family, variant.tier, hardware=this_hardware(), record=load_verification(family), line=variant
    )
    return choice.variant


def sum_tolerance(*lines: str) -> float:
    """The loosest tolerance among what serves these lines."""
    return max(SUM_TOLERANCE[served_for(line).precision] for line in lines)


def lower_precision() -> bool:
    """Whether this hardware serves any digits line below FP32 (INT8 or FP16 children)."""
    return any(served_for(line).precision != "FP32" for line in ("digits-small", "digits-medium", "digits-large"))


def unsure_rows(x: np.ndarray, count: int) -> np.ndarray:
    """The ``count`` rows of ``x`` that digits-small (FP32, ONNX Runtime) is least sure of.

    ``min_confidence=1.0`` climbs only while a tier is less than certain; an INT8 softmax is
    quantised, and reads exactly 1.0 on many easy digits. These rows are unsure on every tier
    in every precision, so they climb as far as the fleet lets them."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(MODELS / "digits" / "digits-small.onnx"))
    probabilities = session.run(None, {"input": x.astype(np.float32)})[0]
    return x[np.argsort(probabilities.max(axis=1))[:count]]
