"""KServe's Python model server (gRPC v2) serving a cloud variant of digits on ONNX Runtime.

Run with the Python of the KServe environment (scripts/foreign_env.py sets it up):

    python kserve_server.py --model FILE.onnx --name digits-large --grpc-port P --http-port H

KServe's gRPC server has ModelInfer but no ModelStreamInfer (nor RepositoryIndex); its
HTTP port serves /metrics (``request_predict_seconds_count`` counts predictions). KServe
binds every interface; here both of its servers are bound to 127.0.0.1 instead (nothing
else about them changes). Prints ``READY 127.0.0.1:P`` once the model is ready.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import grpc
import kserve
import numpy as np
import onnxruntime as ort
import uvicorn
from common import LOOPBACK, announce_when_ready, arguments
from kserve import InferOutput, InferRequest, InferResponse


class Digits(kserve.Model):  # type: ignore[misc]
    """One ONNX file; the tensors are named and typed as the Stratus family names them."""

    def __init__(self, name: str, path: Path) -> None:
        super().__init__(name)
        self.path = path
        self.session: ort.InferenceSession | None = None

    def load(self) -> bool:
        self.session = ort.InferenceSession(str(self.path), providers=["CPUExecutionProvider"])
        self.ready = True
        return True

    def get_input_types(self) -> list[dict[str, Any]]:
        return [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}]

    def get_output_types(self) -> list[dict[str, Any]]:
        return [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 10]}]

    async def predict(
        self, payload: InferRequest, headers: dict[str, str] | None = None, response_headers: Any = None
    ) -> InferResponse:
        assert self.session is not None
        x = payload.inputs[0].as_numpy().astype(np.float32)
        y = self.session.run(None, {"input": x})[0]
        out = InferOutput(name="probabilities", shape=list(y.shape), datatype="FP32")
        out.set_data_from_numpy(y, binary_data=True)
        return InferResponse(model_name=self.name, infer_outputs=[out], response_id=payload.id)


def bind_to_loopback() -> None:
    """KServe listens on [::] (gRPC) and 0.0.0.0 (HTTP); this test server stays on loopback."""
    real_server = grpc.aio.server

    def loopback_server(*args: Any, **kwargs: Any) -> Any:
        server = real_server(*args, **kwargs)
        add = server.add_insecure_port
        server.add_insecure_port = lambda address: add(address.replace("[::]", LOOPBACK))
        return server

    grpc.aio.server = loopback_server
    real_config = uvicorn.Config

    class LoopbackConfig(real_config):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, "host": LOOPBACK})

    uvicorn.Config = LoopbackConfig


def main() -> int:
    args = arguments("KServe's model server on one ONNX file", metrics_port=False).parse_args()
    bind_to_loopback()
    model = Digits(args.name, args.model)
    model.load()
    threading.Thread(
        target=announce_when_ready,
        args=(args.http_port, args.grpc_port, args.name),
        kwargs={"alive": lambda: True},
        daemon=True,
        name="announce-ready",
    ).start()
    kserve.ModelServer(http_port=args.http_port, grpc_port=args.grpc_port, workers=1).start([model])
    return 0


if __name__ == "__main__":
    sys.exit(main())
