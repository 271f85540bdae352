"""The one contract every inference runtime fills.

A :class:`ModelRunner` is a variant loaded into one runtime: built (and loaded) by its
constructor, warmed up once before it serves, then ``infer`` on whole batches from a
bounded executor's threads. Runners guard their own thread safety (a pool of interpreters
or infer requests), never share or mutate the caller's arrays, and describe themselves so
agents can tell the router what they run.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Final, Protocol, TypeVar

import numpy as np

from stratus.datatypes import Array, numpy_dtype
from stratus.errors import ModelLoadError
from stratus.families.spec import TensorSpec, VariantSpec
from stratus.tiers import Tier


@dataclass(frozen=True, kw_only=True)
class RuntimeDescription:
    """What an agent reports about a loaded variant."""

    runtime: str
    device: str
    precisions: tuple[str, ...]
    dynamic_batch: bool
    # A generative runtime's KV-cache precision as loaded ("f32", "f16", "bf16", "default"),
    # which the CPU's kernels may force below the weights' precision; empty for classifiers.
    kv_cache: str = ""
    # The arithmetic the runtime really runs the variant in, read from the runtime after
    # loading where it says ("f32", "f16", "bf16"; "int8" for integer kernels with float
    # layers in f32, "int8+f16" where those run in f16): a plugin may compute FP16 weights in
    # bf16 on a CPU without FP16 arithmetic, which the variant's own precision cannot show.
    compute: str = ""


# The arithmetic of a runtime that runs a graph in the element types it was saved with
# (ONNX Runtime and LiteRT on a CPU: integer kernels for a quantized graph, with its float
# layers in f32; an FP16 graph's tensors in f16, where a kernel without f16 widens and rounds).
GRAPH_COMPUTE: Final = {"FP32": "f32", "FP16": "f16", "INT8": "int8"}


def int8_compute(float_arithmetic: str) -> str:
    """An INT8 variant's arithmetic: integer kernels, and its float layers in ``float_arithmetic``."""
    return "int8" if float_arithmetic == "f32" else f"int8+{float_arithmetic}"


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """How to load: for which tier (it picks latency or throughput modes), where to cache,
    and how many threads may run inference at once (the executor's width)."""

    tier: Tier
    cache_dir: Path
    concurrency: int = 1
    threads_per_inference: int = 1

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.threads_per_inference < 1:
            raise ValueError("concurrency and threads_per_inference must be at least 1")


@dataclass(frozen=True, kw_only=True)
class LoadFailure:
    """One runtime that was tried for a variant and refused it (the next one is tried)."""

    variant: str
    runtime: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class Availability:
    available: bool
    reason: str = ""


class ModelRunner(abc.ABC):
    """A variant loaded into one runtime."""

    runtime: ClassVar[str]
    formats: ClassVar[tuple[str, ...]]

    def __init__(
        self,
        *,
        variant: VariantSpec,
        path: Path,
        inputs: tuple[TensorSpec, ...],
        outputs: tuple[TensorSpec, ...],
        options: LoadOptions,
    ) -> None:
        self.variant = variant
        self.path = path
        self.inputs = inputs
        self.outputs = outputs
        self.options = options

    @classmethod
    @abc.abstractmethod
    def availability(cls) -> Availability:
        """Whether this runtime can run on this machine, and if not, why."""

    @abc.abstractmethod
    def infer(self, batch: Mapping[str, Array]) -> dict[str, Array]:
        """Run one batch; blocking, thread-safe, returns arrays the caller owns."""

    @abc.abstractmethod
    def describe(self) -> RuntimeDescription: ...

    def warmup(self, batch_sizes: tuple[int, ...] = (1, 8)) -> None:
        """Run zero batches of typical sizes so the first real request pays no setup cost."""
        for size in batch_sizes:
            outputs = self.infer({spec.name: zeros_for(spec, size) for spec in self.inputs})
            check_outputs(self.outputs, outputs, size)

    def close(self) -> None:  # noqa: B027 - optional hook, most runtimes need nothing
        """Release what the runtime holds (device memory, sessions)."""


class _Warms(Protocol):
    def warmup(self) -> None: ...

    def close(self) -> None: ...


Warms = TypeVar("Warms", bound=_Warms)


def warmed_up(runner: Warms, runtime: str, path: Path) -> Warms:
    """``runner`` once its warm-up has run; a warm-up that fails is the runtime refusing the
    file (ModelLoadError), so the caller tries the next runtime."""
    try:
        runner.warmup()
    except Exception as exc:
        runner.close()
        raise ModelLoadError(f"{runtime} cannot run {path}: {exc}") from exc
    return runner


def check_outputs(specs: tuple[TensorSpec, ...], outputs: Mapping[str, Array], batch: int) -> None:
    """Refuse outputs that do not fit the family's specs (a runtime that computes an empty
    or misshapen tensor instead of failing, as OpenVINO does for an impossible Reshape)."""
    for spec in specs:
        got = outputs.get(spec.name)
        if got is None:
            continue
        wanted = tuple(batch if d == -1 else d for d in spec.shape)
        if tuple(got.shape) != wanted:
            raise ValueError(
                f"output '{spec.name}' has shape {list(got.shape)} for a batch of {batch}; "
                f"the model's config says {list(spec.shape)}"
            )


def zeros_for(spec: TensorSpec, batch: int) -> Array:
    """A zero input of the spec's shape, with ``batch`` for the -1 dimension."""
    shape = tuple(batch if d == -1 else d for d in spec.shape)
    return np.zeros(shape, dtype=numpy_dtype(spec.datatype, tensor=spec.name))
