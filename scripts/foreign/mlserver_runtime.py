"""An MLServer runtime: one ONNX file answered by ONNX Runtime (mlserver has no ONNX runtime
of its own). Loaded by MLServer from model-settings.json (``implementation``)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class OnnxRuntimeModel(MLModel):  # type: ignore[misc]
    async def load(self) -> bool:
        uri = self.settings.parameters.uri
        self._session = ort.InferenceSession(uri, providers=["CPUExecutionProvider"])
        self._input = self._session.get_inputs()[0].name
        self._output = self._session.get_outputs()[0].name
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        x = NumpyCodec.decode_input(payload.inputs[0]).astype(np.float32)
        y = self._session.run(None, {self._input: x})[0]
        return InferenceResponse(
            model_name=self.name, id=payload.id, outputs=[NumpyCodec.encode_output(self._output, y)]
        )
