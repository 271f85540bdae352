"""OpenVINO: reads ONNX or IR; LATENCY hint on devices, THROUGHPUT on edge servers."""

from __future__ import annotations

import importlib
import queue
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from stratus.datatypes import Array
from stratus.runtimes.base import Availability, ModelRunner, RuntimeDescription
from stratus.tiers import Tier


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
        config = {
            "PERFORMANCE_HINT": performance_hint(self.options.tier),
            "INFERENCE_NUM_THREADS": self.options.threads_per_inference,
            "INFERENCE_PRECISION_HINT": "f32" if self.variant.precision == "FP32" else "f16",
        }
        self._compiled = core.compile_model(read_model(self.path), "CPU", config)
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
            runtime=self.runtime, device="CPU", precisions=(self.variant.precision,), dynamic_batch=True
        )
