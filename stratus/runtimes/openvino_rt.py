"""OpenVINO: reads ONNX or IR; LATENCY hint on devices, THROUGHPUT on edge servers."""

from __future__ import annotations

import importlib
import logging
import queue
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from stratus.datatypes import Array
from stratus.runtimes.base import Availability, ModelRunner, RuntimeDescription, int8_compute
from stratus.tiers import Tier

_log = logging.getLogger(__name__)


def _openvino() -> Any:
    return importlib.import_module("openvino")


def read_model(path: Path) -> Any:
    """The model, read by the one frontend its format has (IR for ``.xml``, else ONNX).

    ``Core.read_model`` tries every frontend on a file that does not parse, and TensorFlow's
    writes its own parse errors to stderr ("E0000 ... text_format.cc ... GraphDef") after
    abseil's "All log messages before absl::InitializeLog()": lines from outside Stratus's
    log for a model that Stratus's log already says failed, and why (which this says better).
    """
    frontend = importlib.import_module("openvino.frontend").FrontEndManager()
    chosen = frontend.load_by_framework("ir" if path.suffix == ".xml" else "onnx")
    return chosen.convert(chosen.load(str(path)))


def performance_hint(tier: Tier) -> str:
    """A device answers one request fast; an edge server keeps many in flight."""
    return "LATENCY" if tier is Tier.DEVICE else "THROUGHPUT"


def precision_hint(precision: str, capabilities: Collection[str]) -> str:
    """The ``INFERENCE_PRECISION_HINT`` to compile a variant with: f16 for a lower-precision
    child (FP16 weights, or an INT8 graph's float layers) only where the plugin computes f16
    natively (``FP16`` among its ``OPTIMIZATION_CAPABILITIES``), else f32.

    Asked for f16 where the CPU lacks FP16 arithmetic, the CPU plugin does not refuse: it
    compiles in bf16 where the CPU has BF16 (AMD Zen 4), and an FP16 child then answers up
    to 4e-2 away from ONNX Runtime's on the same file. f32 keeps the child's answers its
    file's (the FP16 weights widen exactly), and the choice of precision (stratus.families.
    precision) does not serve an FP16 child there anyway unless an operator forces it.
    """
    return "f16" if precision != "FP32" and "FP16" in capabilities else "f32"


def compiled_precision(compiled: Any) -> str:
    """The precision the compiled model really computes in ("f32", "f16", "bf16"), as the
    plugin reports it after compiling, whatever was asked."""
    return str(compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name())


def output_names(ports: Sequence[Any], wanted: Sequence[str]) -> list[str]:
    """Each output port's name as the family calls it.

    After compilation a port may carry several names (a fused ``Identity`` keeps the name
    of the tensor before it, ``out_activations_result``, beside the graph output's,
    ``probabilities``); ``get_any_name()`` returns either. A port is named by whichever of
    its names the family lists, else by any of them.
    """
    names = []
    for port in ports:
        own = port.get_names()
        names.append(next((name for name in wanted if name in own), None) or port.get_any_name())
    return names


class OpenVinoRunner(ModelRunner):
    runtime: ClassVar[str] = "openvino"
    formats: ClassVar[tuple[str, ...]] = ("openvino", "onnx")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        ov = _openvino()
        core = ov.Core()
        cache = self.options.cache_dir / "openvino"
        cache.mkdir(parents=True, exist_ok=True)
        core.set_property({"CACHE_DIR": str(cache)})
        self.capabilities = tuple(core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"))
        self.asked = precision_hint(self.variant.precision, self.capabilities)
        config = {
            "PERFORMANCE_HINT": performance_hint(self.options.tier),
            "INFERENCE_NUM_THREADS": self.options.threads_per_inference,
            "INFERENCE_PRECISION_HINT": self.asked,
        }
        self._compiled = core.compile_model(read_model(self.path), "CPU", config)
        self.computes = compiled_precision(self._compiled)
        if self.computes != self.asked:
            _log.warning(
                "openvino compiles %s in %s, not the %s asked (CPU plugin capabilities: %s)",
                self.variant.name,
                self.computes,
                self.asked,
                ", ".join(self.capabilities),
            )
        self._output_names = output_names(self._compiled.outputs, [o.name for o in self.outputs])
        # An InferRequest serves one thread at a time: keep one per executor thread.
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for _ in range(self.options.concurrency):
            self._requests.put(self._compiled.create_infer_request())

    @classmethod
    def availability(cls) -> Availability:
        try:
            _openvino()
        except ImportError as exc:
            return Availability(available=False, reason=f"openvino is not installed ({exc})")
        return Availability(available=True)

    def infer(self, batch: Mapping[str, Array]) -> dict[str, Array]:
        request = self._requests.get()
        try:
            # share_inputs=False: OpenVINO would otherwise read (and may write) our arrays.
            request.infer(dict(batch), share_inputs=False)
            return {
                name: np.array(request.get_output_tensor(index).data, copy=True)
                for index, name in enumerate(self._output_names)
            }
        finally:
            self._requests.put(request)

    def describe(self) -> RuntimeDescription:
        return RuntimeDescription(
            runtime=self.runtime,
            device="CPU",
            precisions=(self.variant.precision,),
            dynamic_batch=True,
            compute=int8_compute(self.computes) if self.variant.precision == "INT8" else self.computes,
        )
