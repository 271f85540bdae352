"""NVIDIA Triton (through PyTriton) serving a cloud variant of digits on ONNX Runtime.

Run with the Python of the Triton environment (scripts/foreign_env.py sets it up):

    python triton_server.py --model FILE.onnx --name digits-large --grpc-port P --http-port H
                            [--access-token SECRET [--restrict-all]]

Triton's dynamic batcher merges requests; ONNX Runtime answers each batch. With an access
token, Triton restricts its model-repository, statistics (and other admin) protocols to
callers that send it (header ``triton-grpc-protocol-triton-access-token``), as PyTriton
does by default; with ``--restrict-inference``, inference and model-config too, as a
hardened deployment does (health and metadata stay open: PyTriton waits on them itself). Prints ``READY 127.0.0.1:P`` once the
model is ready; SIGTERM stops it.
"""

from __future__ import annotations

import signal
import sys
from typing import Any

import numpy as np
import onnxruntime as ort
from common import announce, arguments
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import DEFAULT_PROTECTED_ENDPOINTS, Triton, TritonConfig, TritonSecurityConfig

HARDENED = ("inference", "model-config")


def main() -> int:
    parser = arguments("NVIDIA Triton (PyTriton) on one ONNX file", metrics_port=True)
    parser.add_argument("--access-token", default=None)
    parser.add_argument("--restrict-inference", action="store_true")
    args = parser.parse_args()
    session = ort.InferenceSession(str(args.model), providers=["CPUExecutionProvider"])
    input_name = session.get_inputs()[0].name
    output_name = session.get_outputs()[0].name

    @batch
    def infer(**inputs: np.ndarray) -> dict[str, Any]:
        return {output_name: session.run(None, {input_name: inputs[input_name]})[0]}

    config = TritonConfig(
        grpc_address="127.0.0.1",
        grpc_port=args.grpc_port,
        http_address="127.0.0.1",
        http_port=args.http_port,
        metrics_address="127.0.0.1",
        metrics_port=args.metrics_port,
        allow_gpu_metrics=False,
    )
    security = None
    if args.access_token:
        restricted = [*DEFAULT_PROTECTED_ENDPOINTS, *HARDENED] if args.restrict_inference else None
        security = TritonSecurityConfig(access_token=args.access_token, restricted_endpoints=restricted)
    with Triton(config=config, security_config=security) as triton:
        triton.bind(
            model_name=args.name,
            infer_func=infer,
            inputs=[Tensor(name=input_name, dtype=np.float32, shape=(64,))],
            outputs=[Tensor(name=output_name, dtype=np.float32, shape=(10,))],
            config=ModelConfig(max_batch_size=64, batcher=DynamicBatcher(max_queue_delay_microseconds=500)),
            strict=True,
        )
        signal.signal(signal.SIGTERM, lambda *_: triton.stop())
        triton.run()  # returns once the model is loaded and ready
        announce(args.grpc_port)
        triton.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
