"""LiteRT (TFLite): ``ai_edge_litert`` first, ``tflite_runtime`` as the fallback.

``tflite-runtime`` 2.14 imports under numpy 2 but fails when an Interpreter is built, so
availability is judged by building one, not by importing.
"""

from __future__ import annotations

import importlib
import queue
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from stratus.datatypes import Array
from stratus.runtimes.base import GRAPH_COMPUTE, Availability, ModelRunner, RuntimeDescription

_MODULES = ("ai_edge_litert.interpreter", "tflite_runtime.interpreter")


def interpreter_class() -> Any:
    """The first importable Interpreter class, or ImportError listing what was tried."""
    problems = []
    for name in _MODULES:
        try:
            return importlib.import_module(name).Interpreter
        except ImportError as exc:
            problems.append(f"{name}: {exc}")
    raise ImportError("; ".join(problems))


class _Interpreter:
    """One interpreter and the batch size its inputs are currently sized for."""

    def __init__(self, interpreter: Any) -> None:
        self.interpreter = interpreter
        self.batch: int | None = None
        self.inputs = {d["name"]: d["index"] for d in interpreter.get_input_details()}
        self.outputs = {d["name"]: d["index"] for d in interpreter.get_output_details()}

    def resize(self, batch: int) -> None:
        """Resize the dynamic batch dimension; only when it changes, as it reallocates."""
        if batch == self.batch:
            return
        for detail in self.interpreter.get_input_details():
            shape = list(detail["shape_signature"])
            shape[0] = batch
            self.interpreter.resize_tensor_input(detail["index"], shape, strict=False)
        self.interpreter.allocate_tensors()
        self.batch = batch


class LiteRtRunner(ModelRunner):
    runtime: ClassVar[str] = "litert"
    formats: ClassVar[tuple[str, ...]] = ("tflite",)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        make = interpreter_class()
        self._pool: queue.SimpleQueue[_Interpreter] = queue.SimpleQueue()
        for _ in range(self.options.concurrency):
            interpreter = make(model_path=str(self.path), num_threads=self.options.threads_per_inference)
            self._pool.put(_Interpreter(interpreter))

    @classmethod
    def availability(cls) -> Availability:
        try:
            interpreter_class()
        except ImportError as exc:
            return Availability(available=False, reason=f"no LiteRT interpreter ({exc})")
        return Availability(available=True)

    def infer(self, batch: Mapping[str, Array]) -> dict[str, Array]:
        slot = self._pool.get()
        try:
            size = next(iter(batch.values())).shape[0]
            slot.resize(size)
            for name, array in batch.items():
                slot.interpreter.set_tensor(slot.inputs[name], np.ascontiguousarray(array))
            slot.interpreter.invoke()
            # get_tensor copies out of the interpreter's arena, so results outlive the next call.
            return {name: slot.interpreter.get_tensor(index) for name, index in slot.outputs.items()}
        finally:
            self._pool.put(slot)

    def describe(self) -> RuntimeDescription:
        return RuntimeDescription(
            runtime=self.runtime,
            device="CPU",
            precisions=(self.variant.precision,),
            dynamic_batch=True,
            compute=GRAPH_COMPUTE[self.variant.precision],
        )
