"""TensorRT: an engine built from the variant's ONNX file, cached, with pooled I/O buffers.

Written to the facts in ``shared/GPU.md`` (TensorRT 10 and 11): explicit-batch networks,
one optimization profile for the dynamic batch dimension, ``execute_async_v3`` with
tensor addresses, and device memory through cuda-python's ``cuda.bindings.runtime``.
Engines do not move across TensorRT versions or GPUs, so the cache key holds the
TensorRT version, the GPU's name and compute capability, the profile and the ONNX hash.

Everything that does not touch the GPU (cache key, profile shapes, builder option
mapping, buffer sizes) is a pure function here and unit-tested on CPU machines.
"""

from __future__ import annotations

import hashlib
import importlib
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from stratus.datatypes import Array, numpy_dtype
from stratus.errors import InvalidInput, ModelLoadError, RuntimeUnavailable
from stratus.families.spec import TensorSpec
from stratus.runtimes.base import GRAPH_COMPUTE, Availability, ModelRunner, RuntimeDescription
from stratus.runtimes.ort import file_digest

WORKSPACE_BYTES = 1 << 30


@dataclass(frozen=True, kw_only=True)
class BatchProfile:
    """The dynamic-batch optimization profile: smallest, most common, largest batch."""

    min_batch: int = 1
    opt_batch: int = 8
    max_batch: int = 64

    def __post_init__(self) -> None:
        if not 1 <= self.min_batch <= self.opt_batch <= self.max_batch:
            raise ValueError(f"profile needs 1 <= min <= opt <= max, got {self}")

    def shapes(self, spec: TensorSpec) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(min, opt, max) shapes for ``IOptimizationProfile.set_shape``."""
        return tuple(  # type: ignore[return-value]
            tuple(batch if d == -1 else d for d in spec.shape)
            for batch in (self.min_batch, self.opt_batch, self.max_batch)
        )


@dataclass(frozen=True, kw_only=True)
class GpuIdentity:
    name: str
    compute_capability: tuple[int, int]


def engine_cache_key(
    *, trt_version: str, gpu: GpuIdentity, profile: BatchProfile, onnx_digest: str, precision: str
) -> str:
    """A file-name-safe key that changes whenever a cached engine would be invalid."""
    major, minor = gpu.compute_capability
    parts = "|".join(
        [
            trt_version,
            gpu.name,
            f"sm{major}{minor}",
            f"b{profile.min_batch}-{profile.opt_batch}-{profile.max_batch}",
            onnx_digest,
            precision,
        ]
    )
    return f"trt{trt_version}-sm{major}{minor}-{hashlib.sha256(parts.encode()).hexdigest()[:24]}"


def builder_flag_names(*, trt_major: int, precision: str) -> tuple[str, ...]:
    """Builder flags for a precision.

    TensorRT 10 takes FP16 as a builder flag. TensorRT 11 networks are strongly typed:
    the precision comes from the ONNX graph itself (an FP16 copy or Q/DQ nodes), and the
    precision flags are gone, so none are set. INT8 always comes from Q/DQ nodes in the
    graph (the calibrator API is deprecated in 10 and removed in 11).
    """
    if precision not in ("FP32", "FP16", "INT8"):
        raise InvalidInput(f"TensorRT: unknown precision '{precision}'")
    if trt_major >= 11 or precision == "FP32":
        return ()
    if precision == "FP16":
        return ("FP16",)
    return ("INT8",)


def buffer_bytes(spec: TensorSpec, batch: int) -> int:
    """Bytes a tensor needs at ``batch``: the pool allocates each tensor once, at max batch."""
    shape = tuple(batch if d == -1 else d for d in spec.shape)
    return math.prod(shape) * numpy_dtype(spec.datatype, tensor=spec.name).itemsize


def _check(result: Any, what: str) -> Any:
    """cuda-python calls return ``(err, *values)``; raise on a non-zero error."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise ModelLoadError(f"TensorRT: {what} failed with CUDA error {int(err)}")
    return values[0] if len(values) == 1 else tuple(values)


def _cuda_runtime() -> Any:
    return importlib.import_module("cuda.bindings.runtime")


def _tensorrt() -> Any:
    return importlib.import_module("tensorrt")


def gpu_identity(cudart: Any, device: int = 0) -> GpuIdentity:
    props = _check(cudart.cudaGetDeviceProperties(device), "cudaGetDeviceProperties")
    name = props.name.decode() if isinstance(props.name, bytes) else str(props.name)
    return GpuIdentity(name=name.strip("\x00 "), compute_capability=(props.major, props.minor))


class _DeviceBuffers:
    """Device memory for every I/O tensor, sized for the profile's max batch, reused."""

    def __init__(self, cudart: Any, sizes: Mapping[str, int]) -> None:
        self._cudart = cudart
        self.pointers = {
            name: _check(cudart.cudaMalloc(size), f"cudaMalloc({name})") for name, size in sizes.items()
        }
        self.stream = _check(cudart.cudaStreamCreate(), "cudaStreamCreate")

    def free(self) -> None:
        for pointer in self.pointers.values():
            self._cudart.cudaFree(pointer)
        self._cudart.cudaStreamDestroy(self.stream)


class TensorRtRunner(ModelRunner):
    runtime: ClassVar[str] = "tensorrt"
    formats: ClassVar[tuple[str, ...]] = ("onnx",)
    profile = BatchProfile()

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        availability = self.availability()
        if not availability.available:
            raise RuntimeUnavailable(f"TensorRT: {availability.reason}")
        self._trt = _tensorrt()
        self._cudart = _cuda_runtime()
        self._logger = self._trt.Logger(self._trt.Logger.WARNING)
        self._gpu = gpu_identity(self._cudart)
        self._engine = self._load_or_build()
        # One context and buffer set per executor thread: a context runs one batch at a time.
        self._slots: list[tuple[Any, _DeviceBuffers]] = []
        self._free = threading.Semaphore(self.options.concurrency)
        self._lock = threading.Lock()
        sizes = {s.name: buffer_bytes(s, self.profile.max_batch) for s in (*self.inputs, *self.outputs)}
        for _ in range(self.options.concurrency):
            self._slots.append((self._engine.create_execution_context(), _DeviceBuffers(self._cudart, sizes)))

    @classmethod
    def availability(cls) -> Availability:
        try:
            _tensorrt()
            cudart = _cuda_runtime()
        except ImportError as exc:
            return Availability(available=False, reason=f"tensorrt or cuda-python is not installed ({exc})")
        try:
            count = _check(cudart.cudaGetDeviceCount(), "cudaGetDeviceCount")
        except ModelLoadError as exc:
            return Availability(available=False, reason=str(exc))
        if count < 1:
            return Availability(available=False, reason="no CUDA device is visible")
        return Availability(available=True)

    def _cache_path(self) -> Path:
        key = engine_cache_key(
            trt_version=self._trt.__version__,
            gpu=self._gpu,
            profile=self.profile,
            onnx_digest=file_digest(self.path),
            precision=self.variant.precision,
        )
        folder = self.options.cache_dir / "tensorrt"
        folder.mkdir(parents=True, exist_ok=True)
        return folder / f"{self.path.stem}-{key}.engine"

    def _load_or_build(self) -> Any:
        runtime = self._trt.Runtime(self._logger)
        cached = self._cache_path()
        if cached.is_file():
            engine = runtime.deserialize_cuda_engine(cached.read_bytes())
            if engine is not None:
                return engine
        serialized = self._build()
        cached.write_bytes(serialized)
        engine = runtime.deserialize_cuda_engine(serialized)
        if engine is None:
            raise ModelLoadError(f"TensorRT: could not deserialize the engine built from {self.path}")
        return engine

    def _build(self) -> bytes:
        trt = self._trt
        builder = trt.Builder(self._logger)
        network = builder.create_network(0)
        parser = trt.OnnxParser(network, self._logger)
        if not parser.parse_from_file(str(self.path)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise ModelLoadError(f"TensorRT: cannot parse {self.path}: {errors}")
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, WORKSPACE_BYTES)
        major = int(trt.__version__.split(".")[0])
        for flag in builder_flag_names(trt_major=major, precision=self.variant.precision):
            config.set_flag(getattr(trt.BuilderFlag, flag))
        profile = builder.create_optimization_profile()
        for spec in self.inputs:
            profile.set_shape(spec.name, *self.profile.shapes(spec))
        config.add_optimization_profile(profile)
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise ModelLoadError(f"TensorRT: building an engine from {self.path} failed")
        return bytes(serialized)

    def _take_slot(self) -> tuple[Any, _DeviceBuffers]:
        self._free.acquire()
        with self._lock:
            return self._slots.pop()

    def _return_slot(self, slot: tuple[Any, _DeviceBuffers]) -> None:
        with self._lock:
            self._slots.append(slot)
        self._free.release()

    def infer(self, batch: Mapping[str, Array]) -> dict[str, Array]:
        size = next(iter(batch.values())).shape[0]
        if size > self.profile.max_batch:
            raise InvalidInput(
                f"TensorRT: batch {size} exceeds the engine's maximum {self.profile.max_batch}"
            )
        slot = self._take_slot()
        try:
            return self._run(slot, batch, size)
        finally:
            self._return_slot(slot)

    def _run(
        self, slot: tuple[Any, _DeviceBuffers], batch: Mapping[str, Array], size: int
    ) -> dict[str, Array]:
        context, buffers = slot
        cudart = self._cudart
        h2d, d2h = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        for spec in self.inputs:
            host = np.ascontiguousarray(batch[spec.name])
            context.set_input_shape(spec.name, host.shape)
            _check(
                cudart.cudaMemcpyAsync(
                    buffers.pointers[spec.name], host.ctypes.data, host.nbytes, h2d, buffers.stream
                ),
                "cudaMemcpyAsync",
            )
        for name, pointer in buffers.pointers.items():
            context.set_tensor_address(name, pointer)
        if not context.execute_async_v3(buffers.stream):
            raise ModelLoadError("TensorRT: execute_async_v3 failed")
        results = {}
        for spec in self.outputs:
            shape = tuple(size if d == -1 else d for d in spec.shape)
            host = np.empty(shape, dtype=numpy_dtype(spec.datatype, tensor=spec.name))
            _check(
                cudart.cudaMemcpyAsync(
                    host.ctypes.data, buffers.pointers[spec.name], host.nbytes, d2h, buffers.stream
                ),
                "cudaMemcpyAsync",
            )
            results[spec.name] = host
        _check(cudart.cudaStreamSynchronize(buffers.stream), "cudaStreamSynchronize")
        return results

    def describe(self) -> RuntimeDescription:
        return RuntimeDescription(
            runtime=self.runtime,
            device=self._gpu.name,
            precisions=(self.variant.precision,),
            dynamic_batch=True,
            compute=GRAPH_COMPUTE[self.variant.precision],  # its builder flags, or the typed graph
        )

    def close(self) -> None:
        for _, buffers in self._slots:
            buffers.free()
        self._slots.clear()
