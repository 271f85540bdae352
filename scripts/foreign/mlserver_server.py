"""MLServer serving a cloud variant of digits through a custom runtime on ONNX Runtime.

Run with the Python of the MLServer environment (scripts/foreign_env.py sets it up):

    python mlserver_server.py --model FILE.onnx --name digits-large --grpc-port P
                              --http-port H --metrics-port M --workdir DIR

Writes MLServer's settings.json and the model's model-settings.json into DIR and runs
``mlserver start DIR`` (a child in this process group), on 127.0.0.1 only, with no worker
pool; prints ``READY 127.0.0.1:P`` once the model is ready and ends with it. Its /metrics
(``model_infer_request_success``) counts requests.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from common import announce_when_ready, arguments

TENSORS = {
    "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}],
    "outputs": [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 10]}],
}


def main() -> int:
    parser = arguments("MLServer on one ONNX file", metrics_port=True)
    parser.add_argument("--workdir", type=Path, required=True)
    args = parser.parse_args()
    model_dir = args.workdir / args.name
    model_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(__file__).with_name("mlserver_runtime.py"), args.workdir / "mlserver_runtime.py")
    settings = {
        "host": "127.0.0.1",
        "http_port": args.http_port,
        "grpc_port": args.grpc_port,
        "metrics_port": args.metrics_port,
        "parallel_workers": 0,
        "load_models_at_startup": True,
    }
    (args.workdir / "settings.json").write_text(json.dumps(settings))
    model_settings = {
        "name": args.name,
        "implementation": "mlserver_runtime.OnnxRuntimeModel",
        "parameters": {"uri": str(args.model.resolve())},
        **TENSORS,
    }
    (model_dir / "model-settings.json").write_text(json.dumps(model_settings))
    mlserver = Path(sys.executable).with_name("mlserver")
    child = subprocess.Popen([str(mlserver), "start", str(args.workdir)], cwd=args.workdir)
    signal.signal(signal.SIGTERM, lambda *_: child.terminate())
    announce_when_ready(args.http_port, args.grpc_port, args.name, alive=lambda: child.poll() is None)
    return child.wait()


if __name__ == "__main__":
    sys.exit(main())
