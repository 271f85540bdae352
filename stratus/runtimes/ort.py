"""ONNX Runtime: full graph optimization, with the optimized graph cached on disk."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import logging
import os
import platform
import stat
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from stratus.datatypes import Array
from stratus.runtimes.base import GRAPH_COMPUTE, Availability, ModelRunner, RuntimeDescription

log = logging.getLogger("stratus.runtimes")


def _onnxruntime() -> Any:
    return importlib.import_module("onnxruntime")


def file_digest(path: Path, *, full: bool = False) -> str:
    """A content hash (16 hex digits, or all 64): cache entries follow the file, not its name
    or mtime."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return digest if full else digest[:16]


def machine_digest() -> str:
    """This CPU's identity: an optimized graph may hold kernels for its instruction set."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            model += next((line for line in cpuinfo if line.startswith(("model name", "flags"))), "")
    except OSError:
        pass
    return hashlib.sha256(model.encode()).hexdigest()[:8]


def _digest_path(cached: Path) -> Path:
    return cached.with_name(cached.name + ".sha256")


def private_folder(path: Path) -> bool:
    """Make ``path`` (mode 0700) and say whether it is this user's alone: a real folder, owned by
    this user, that no group or other user may write. Only then is a graph cached in it: the
    digest beside a cached graph shows a torn write, not a swap by whoever can write the folder
    (security2 N17), so the folder itself must be ours."""
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        found = path.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(found.st_mode) and found.st_uid == os.geteuid() and not found.st_mode & 0o022


def _intact(cached: Path) -> bool:
    """A cached graph is loaded only while it is the file this process's kind wrote: its
    SHA-256 matches the one written beside it (a crash or a full disk mid-write leaves a
    graph that does not)."""
    try:
        return _digest_path(cached).read_text(encoding="utf-8").strip() == file_digest(cached, full=True)
    except OSError:
        return False


_warned: set[Path] = set()


def _warn_shared(cache: Path) -> None:
    if cache not in _warned:
        _warned.add(cache)
        log.warning(
            "%s is not this user's alone (another owner, or others may write it): ONNX Runtime "
            "graphs are optimized at every start and not cached there",
            cache,
        )


def is_probability_map(onnx_type: str) -> bool:
    """Whether an output is a ZipMap's: a sequence of {class: probability} maps, one per item
    (``seq(map(int64,tensor(float)))``), as skl2onnx exports a classifier by default."""
    return onnx_type.replace(" ", "").startswith("seq(map(") and onnx_type.endswith(",tensor(float)))")


def dense_probabilities(maps: Sequence[Mapping[Any, float]], *, classes: int) -> Array:
    """A ZipMap's per-item maps as a dense FP32 [items, classes] array, columns in the
    order of the class labels (sorted: scikit-learn's ``classes_`` and ``predict_proba``
    order; ``models import`` refuses a ZipMap whose labels are not sorted)."""
    if not maps:
        return np.zeros((0, classes), dtype=np.float32)
    labels = sorted(maps[0])
    return np.array([[item[c] for c in labels] for item in maps], dtype=np.float32)


class OnnxRuntimeRunner(ModelRunner):
    runtime: ClassVar[str] = "onnxruntime"
    formats: ClassVar[tuple[str, ...]] = ("onnx",)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        ort = _onnxruntime()
        self._session = self._open(ort)
        self._output_names = [o.name for o in self._session.get_outputs()]
        # ZipMap outputs, with their width as the family declares it ([-1, classes]).
        widths = {spec.name: spec.shape[-1] for spec in self.outputs}
        self._maps = {
            o.name: widths.get(o.name, 0) for o in self._session.get_outputs() if is_probability_map(o.type)
        }

    def _open(self, ort: Any) -> Any:
        """Load the cached optimized graph when present; otherwise optimize and cache it.

        The cache key holds the ONNX hash and the ORT version, since an optimized graph
        may use kernels of the version and machine that wrote it.
        """
        cache = self.options.cache_dir / "onnxruntime"
        cached = (
            cache / f"{self.path.stem}-{file_digest(self.path)}-ort{ort.__version__}-{machine_digest()}.onnx"
        )
        options = ort.SessionOptions()
        # Fatal only: the "hardware specific optimizations" warning is why the key holds the
        # CPU, and a failed run's error comes back as the exception's message; ORT's own copy
        # on stderr would break the one-line error of `models import`.
        options.log_severity_level = 4
        options.intra_op_num_threads = self.options.threads_per_inference
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if not private_folder(cache):
            _warn_shared(cache)
            return ort.InferenceSession(str(self.path), options, providers=["CPUExecutionProvider"])
        if _intact(cached):
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            return ort.InferenceSession(str(cached), options, providers=["CPUExecutionProvider"])
        # Written in a folder of its own (a random name, mode 0700: no name planted in the cache,
        # a symlink among them, is followed), then moved into place with its digest beside it: a
        # crash, or two agents sharing a cache, never leaves a half-written graph to load.
        with tempfile.TemporaryDirectory(dir=cache, prefix=".scratch-") as scratch_folder:
            scratch = Path(scratch_folder) / cached.name
            options.optimized_model_filepath = str(scratch)
            session = ort.InferenceSession(str(self.path), options, providers=["CPUExecutionProvider"])
            with contextlib.suppress(OSError):
                _digest_path(cached).write_text(file_digest(scratch, full=True), encoding="utf-8")
                os.replace(scratch, cached)
        return session

    @classmethod
    def availability(cls) -> Availability:
        try:
            _onnxruntime()
        except ImportError as exc:
            return Availability(available=False, reason=f"onnxruntime is not installed ({exc})")
        return Availability(available=True)

    def infer(self, batch: Mapping[str, Array]) -> dict[str, Array]:
        # InferenceSession.run is thread-safe and copies its outputs into fresh arrays.
        results = self._session.run(self._output_names, dict(batch))
        return {
            name: dense_probabilities(value, classes=self._maps[name])
            if name in self._maps
            else np.asarray(value)
            for name, value in zip(self._output_names, results, strict=True)
        }

    def describe(self) -> RuntimeDescription:
        return RuntimeDescription(
            runtime=self.runtime,
            device="CPU",
            precisions=(self.variant.precision,),
            dynamic_batch=True,
            compute=GRAPH_COMPUTE[self.variant.precision],
        )
