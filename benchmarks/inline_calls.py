"""What one small runtime call costs here, and whether LocalModels runs it on the event loop.

The unit test (tests/unit/test_local.py) checks the switch with a threshold no call can miss;
this prints the figure it used to assert: digits-small's p90 call time in each runtime, and
whether that is under the default ``inline_below_ms`` (so the agent runs it inline).

    python benchmarks/inline_calls.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stratus.convert import codec  # noqa: E402
from stratus.convert.inference import InferRequest  # noqa: E402
from stratus.execution.loading import LocalSettings  # noqa: E402
from stratus.execution.local_models import LocalModels  # noqa: E402
from stratus.families.repository import ModelRepository  # noqa: E402
from stratus.wire import inference_pb2 as pb  # noqa: E402


def measure(runtime: str, calls: int, cache: Path) -> tuple[float, bool]:
    settings = LocalSettings(variants=["digits-small"], runtimes=[runtime], cache_dir=cache, precision="fp32")
    models = LocalModels(ModelRepository.load(ROOT / "models"), settings)
    message = pb.ModelInferRequest(model_name="digits-small")
    codec.encode_request_inputs(message, {"input": np.zeros((1, 64), np.float32)})
    request = InferRequest.from_wire(message)

    async def ask() -> None:
        for _ in range(calls):
            await models.answer(request)

    try:
        asyncio.run(ask())
        return models.latency["digits-small"].percentile(90, last=calls), "digits-small" in models.running.inline
    finally:
        models.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    print(f"{'runtime':<14}{'p90 ms':>10}{'inline':>8}   (inline below {LocalSettings().inline_below_ms} ms)")
    with tempfile.TemporaryDirectory() as cache:
        for runtime in ("onnxruntime", "litert", "openvino"):
            p90, inline = measure(runtime, args.calls, Path(cache))
            print(f"{runtime:<14}{p90:>10.3f}{inline!s:>8}")


if __name__ == "__main__":
    main()
