"""Inference runtimes behind one contract, and the order in which they are chosen.

Choosing a runtime for a variant follows a fixed, documented preference per hardware and
tier, over the formats the variant ships; an agent may override it with its own order
(``--runtimes``). A runtime that cannot run here is skipped with its reason kept, so an
agent that ends up with nothing can say exactly why.

==========================  ============================================================
where                       preference (runtime/format)
==========================  ============================================================
a CUDA GPU is visible       tensorrt/onnx, onnxruntime/onnx, openvino/openvino,
                            openvino/onnx, litert/tflite
device tier, CPU only       litert/tflite, openvino/openvino, onnxruntime/onnx,
                            openvino/onnx
edge or cloud tier, CPU     openvino/openvino, onnxruntime/onnx, openvino/onnx,
                            litert/tflite
==========================  ============================================================
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from stratus.errors import ModelLoadError, NotFound, RuntimeUnavailable, StratusError
from stratus.families.spec import FamilySpec, VariantSpec
from stratus.runtimes.base import (
    Availability,
    LoadFailure,
    LoadOptions,
    ModelRunner,
    RuntimeDescription,
    warmed_up,
)
from stratus.runtimes.chat_template import chat_template_of
from stratus.runtimes.generative import GenerativeRunner
from stratus.runtimes.litert import LiteRtRunner
from stratus.runtimes.llama_cpp_rt import LlamaCppRunner
from stratus.runtimes.openvino_genai_rt import OpenVinoGenAiRunner
from stratus.runtimes.openvino_rt import OpenVinoRunner
from stratus.runtimes.ort import OnnxRuntimeRunner
from stratus.runtimes.tensorrt_rt import TensorRtRunner
from stratus.tiers import Tier

RUNNERS: dict[str, type[ModelRunner]] = {
    cls.runtime: cls for cls in (LiteRtRunner, OpenVinoRunner, OnnxRuntimeRunner, TensorRtRunner)
}

_GPU_ORDER = (
    ("tensorrt", "onnx"),
    ("onnxruntime", "onnx"),
    ("openvino", "openvino"),
    ("openvino", "onnx"),
    ("litert", "tflite"),
)
_DEVICE_ORDER = (
    ("litert", "tflite"),
    ("openvino", "openvino"),
    ("onnxruntime", "onnx"),
    ("openvino", "onnx"),
)
_SERVER_ORDER = (
    ("openvino", "openvino"),
    ("onnxruntime", "onnx"),
    ("openvino", "onnx"),
    ("litert", "tflite"),
)


@dataclass(frozen=True, kw_only=True)
class Choice:
    runtime: str
    format: str
    path: Path


def preference(*, tier: Tier, gpu: bool) -> tuple[tuple[str, str], ...]:
    """The default (runtime, format) order for a tier on this kind of hardware."""
    if gpu:
        return _GPU_ORDER
    return _DEVICE_ORDER if tier is Tier.DEVICE else _SERVER_ORDER


def available_runtimes() -> dict[str, Availability]:
    """Every runtime's availability; this imports them all (``models verify`` wants that)."""
    return {name: availability_of(name) for name in RUNNERS}


@functools.cache
def availability_of(runtime: str) -> Availability:
    """One runtime's availability, judged once per process; only this runtime is imported."""
    return RUNNERS[runtime].availability()


def candidates(
    variant: VariantSpec, *, tier: Tier, gpu: bool, runtimes: Sequence[str] | None = None
) -> list[Choice]:
    """Every (runtime, file) that could serve the variant, best first.

    ``runtimes`` overrides the order: only those runtimes, in that order (it may also name
    generative runtimes, which classifiers ignore; naming none of theirs leaves none). A
    variant that names its own ``runtimes`` (family.toml) is offered to those alone.
    """
    order = preference(tier=tier, gpu=gpu)
    if runtimes is not None:
        unknown = [r for r in runtimes if r not in RUNNERS and r not in GENERATORS]
        if unknown:
            raise NotFound(f"unknown runtime(s) {unknown}; known: {sorted({*RUNNERS, *GENERATORS})}")
        order = tuple((r, f) for r in runtimes if r in RUNNERS for f in RUNNERS[r].formats)
    return [
        Choice(runtime=r, format=f, path=variant.files[f])
        for r, f in order
        if f in variant.files and variant.allows(r)
    ]


def load_runner(
    family: FamilySpec,
    variant: VariantSpec,
    options: LoadOptions,
    *,
    runtimes: Sequence[str] | None = None,
    availability: dict[str, Availability] | None = None,
    failures: list[LoadFailure] | None = None,
) -> ModelRunner:
    """Load a variant in the best runtime that works here, warmed up and ready.

    Runtimes are tried in order and imported only when reached: a device agent that runs
    LiteRT never loads OpenVINO or ONNX Runtime (tens of MB of memory each). A runtime that
    refuses the file (or fails its warm-up) is noted in ``failures`` and the next is tried:
    one CPU plugin's refusal must not take down a process that another runtime can serve.
    """

    def status_of(runtime: str) -> Availability | None:
        if availability is not None:
            return availability.get(runtime)
        return availability_of(runtime) if runtime in RUNNERS else None

    gpu = _gpu_present(runtimes, status_of)
    reasons = []
    refused = False
    for choice in candidates(variant, tier=options.tier, gpu=gpu, runtimes=runtimes):
        status = status_of(choice.runtime)
        if status is None or not status.available:
            reasons.append(f"{choice.runtime}: {status.reason if status else 'unknown'}")
            continue
        try:
            return _opened_and_warm(family, variant, choice, options)
        except ModelLoadError as exc:
            refused = True
            reasons.append(str(exc))
            if failures is not None:
                failures.append(LoadFailure(variant=variant.name, runtime=choice.runtime, reason=str(exc)))
    none = "no file in a usable format" + (
        f" for its runtimes ({', '.join(variant.runtimes)}, family.toml)" if variant.runtimes else ""
    )
    message = f"no runtime can serve variant '{variant.name}' here: {'; '.join(reasons) or none}"
    raise ModelLoadError(message) if refused else RuntimeUnavailable(message)


def _opened_and_warm(
    family: FamilySpec, variant: VariantSpec, choice: Choice, options: LoadOptions
) -> ModelRunner:
    """A runner that has answered its warm-up batches; a warm-up that fails is a refusal too."""
    return warmed_up(open_runner(family, variant, choice, options), choice.runtime, choice.path)


def _gpu_present(runtimes: Sequence[str] | None, status_of: Callable[[str], Availability | None]) -> bool:
    """Whether the GPU order applies: TensorRT works here (skipped when the agent's own
    runtime list leaves TensorRT out, so nothing is imported for it)."""
    if runtimes is not None and "tensorrt" not in runtimes:
        return False
    status = status_of("tensorrt")
    return status is not None and status.available


def open_runner(
    family: FamilySpec, variant: VariantSpec, choice: Choice, options: LoadOptions
) -> ModelRunner:
    """Load one specific (runtime, file) without warming up.

    Runtimes raise their own exception types for a bad file; they become ModelLoadError
    naming the runtime and the file, so callers handle one error whatever the runtime.
    """
    try:
        return RUNNERS[choice.runtime](
            variant=variant, path=choice.path, inputs=family.inputs, outputs=family.outputs, options=options
        )
    except StratusError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"{choice.runtime} cannot load {choice.path}: {exc}") from exc


GENERATORS: dict[str, type[GenerativeRunner]] = {
    cls.runtime: cls for cls in (OpenVinoGenAiRunner, LlamaCppRunner)
}
# Which runtime first, where both are installed: on a device, llama.cpp (a small library made
# for such machines, and it gives the top-2 margin); on edge servers and in the cloud,
# OpenVINO GenAI (its continuous-batching pipeline, tuned for server CPUs).
_GENERATIVE_DEVICE_ORDER: tuple[tuple[str, str], ...] = (("llama_cpp", "gguf"), ("openvino_genai", "gguf"))
_GENERATIVE_SERVER_ORDER: tuple[tuple[str, str], ...] = (("openvino_genai", "gguf"), ("llama_cpp", "gguf"))


def generative_order(tier: Tier) -> tuple[tuple[str, str], ...]:
    """(runtime, file format) pairs in the order a variant of ``tier`` tries them."""
    return _GENERATIVE_DEVICE_ORDER if tier is Tier.DEVICE else _GENERATIVE_SERVER_ORDER


def load_generator(
    family: FamilySpec,
    variant: VariantSpec,
    options: LoadOptions,
    *,
    runtimes: Sequence[str] | None = None,
    failures: list[LoadFailure] | None = None,
) -> GenerativeRunner:
    """A generative variant in the first runtime here that runs one of its files, warmed up.

    ``runtimes``: only the generative runtimes it names, in that order (others are ignored).
    A runtime that refuses the file is noted in ``failures`` and the next one is tried."""
    assert family.generation is not None
    reasons = []
    refused = False
    order = generative_order(variant.tier)
    if runtimes is not None:  # only those, in that order (a list of classifier runtimes: none)
        order = tuple(pair for r in runtimes for pair in order if pair[0] == r)
        if not order:
            raise NotFound(f"no generative runtime among the runtimes allowed here ({', '.join(runtimes)})")
    for runtime, fmt in order:
        if fmt not in variant.files:
            continue
        status = GENERATORS[runtime].availability()
        if not status.available:
            reasons.append(f"{runtime}: {status.reason}")
            continue
        try:
            return _warm_generator(GENERATORS[runtime], family, variant, variant.files[fmt], options)
        except ModelLoadError as exc:
            refused = True
            reasons.append(str(exc))
            if failures is not None:
                failures.append(LoadFailure(variant=variant.name, runtime=runtime, reason=str(exc)))
    if not reasons:
        raise NotFound(
            f"variant '{variant.name}' ships no file a generative runtime here reads ({sorted(variant.files)})"
        )
    message = f"no runtime can generate with '{variant.name}' here: {'; '.join(reasons)}"
    raise ModelLoadError(message) if refused else RuntimeUnavailable(message)


def _warm_generator(
    cls: type[GenerativeRunner], family: FamilySpec, variant: VariantSpec, path: Path, options: LoadOptions
) -> GenerativeRunner:
    """A runner that has generated its warm-up token; a failing warm-up is a refusal too."""
    assert family.generation is not None
    runner = cls(variant=variant, path=path, options=options, context=family.generation.context)
    try:  # after the runtime's own reading: a file it refuses says so in its words
        runner.chat = chat_template_of(path)
    except ModelLoadError:
        runner.close()
        raise
    return warmed_up(runner, cls.runtime, path)


__all__ = [
    "GENERATORS",
    "RUNNERS",
    "Availability",
    "Choice",
    "LoadFailure",
    "LoadOptions",
    "ModelRunner",
    "RuntimeDescription",
    "availability_of",
    "available_runtimes",
    "candidates",
    "generative_order",
    "load_generator",
    "load_runner",
    "open_runner",
    "preference",
]
