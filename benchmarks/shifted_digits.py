"""Traffic for the capture loop (README, "What the device should learn next"): scikit-learn's
digits seen through a camera that changed (darker, noisier), one item per request, and where each
was answered.

    python benchmarks/shifted_digits.py --router 127.0.0.1:8001 --part first   # what gets captured
    python benchmarks/shifted_digits.py --router 127.0.0.1:8001 --part second  # items never captured

The 1,797 images are scaled by ``--gain`` (0.45: under-exposed), get Gaussian noise (``--noise``,
none by default; a fixed seed) and are cut in two halves; it prints the items answered per tier,
the cloud share, and the accuracy against the true labels.
"""

from __future__ import annotations

import argparse
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from stratus.convert import codec
from stratus.convert.parameters import Served
from stratus.serving.channels import open_sync_channel
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

SEED = 0


def shifted_digits(gain: float, noise: float, part: str) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    rng = np.random.default_rng(SEED)
    x = np.clip(x / 16.0 * gain + rng.normal(0.0, noise, x.shape), 0.0, 1.0).astype(np.float32)
    order = rng.permutation(len(x))
    half = order[: len(x) // 2] if part == "first" else order[len(x) // 2 :]
    return x[half], y[half].astype(np.int64)


def ask(stub: pb_grpc.GRPCInferenceServiceStub, row: np.ndarray, name: str) -> tuple[str, int]:
    request = pb.ModelInferRequest(model_name="digits", id=name)
    codec.encode_request_inputs(request, {"input": row[None, :]})
    response = stub.ModelInfer(request, timeout=10)
    answer = int(codec.decode_response_outputs(response)["probabilities"].argmax())
    return Served.read(response.parameters).tier.label, answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--router", default="127.0.0.1:8001")
    parser.add_argument("--part", choices=("first", "second"), default="first")
    parser.add_argument("--gain", type=float, default=0.45, help="what the camera's pixels are scaled by")
    parser.add_argument("--noise", type=float, default=0.0, help="the noise's standard deviation (pixels in [0, 1])")
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args()
    x, y = shifted_digits(args.gain, args.noise, args.part)
    with open_sync_channel(args.router) as channel, ThreadPoolExecutor(args.clients) as pool:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        results = list(pool.map(lambda n: ask(stub, x[n], f"{args.part}-{n}"), range(len(x))))
    tiers = Counter(tier for tier, _ in results)
    correct = sum(answer == label for (_, answer), label in zip(results, y, strict=True))
    print(f"{'items':>6} {'device':>7} {'edge':>6} {'cloud':>6} {'cloud share':>12} {'accuracy':>9}")
    print(f"{len(x):>6} {tiers['device']:>7} {tiers['edge']:>6} {tiers['cloud']:>6} "
          f"{tiers['cloud'] / len(x):>12.1%} {correct / len(x):>9.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
