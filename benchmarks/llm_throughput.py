"""Generations per second of one generative runtime at 1, 4 and 8 generations at once.

In process, on the arith held-out prompts (greedy, up to 4 tokens each): each
(variant, runtime) here is loaded once, and N threads share the prompts. OpenVINO GenAI
steps concurrent generations together as one batch; llama.cpp takes them one at a time.

Each figure is the median of ``--rounds`` rounds, the thread counts alternating within a
round, since this machine's speed drifts.

    python benchmarks/llm_throughput.py [--prompts 400] [--threads 1,4,8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stratus.families.generation import GenerationParams  # noqa: E402
from stratus.families.repository import ModelRepository  # noqa: E402
from stratus.runtimes import GENERATORS, load_generator  # noqa: E402
from stratus.runtimes.base import LoadOptions  # noqa: E402
from stratus.runtimes.generative import GenerativeRunner  # noqa: E402
from stratus.tools.arith import arith_splits  # noqa: E402

PARAMS = GenerationParams(max_tokens=4)


def timed(model: GenerativeRunner, prompt: str) -> float:
    started = time.perf_counter()
    model.generate(prompt, PARAMS, lambda token: True)
    return (time.perf_counter() - started) * 1000.0


def measure(model: GenerativeRunner, prompts: list[str], threads: int) -> tuple[float, float]:
    """(generations per second, median ms per generation) with ``threads`` at once."""
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        latencies = list(pool.map(lambda p: timed(model, p), prompts))
    return len(prompts) / (time.perf_counter() - started), statistics.median(latencies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=400)
    parser.add_argument("--threads", default="1,4,8")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    counts = [int(n) for n in args.threads.split(",")]
    prompts = [p for p, _ in arith_splits().held_out[: args.prompts]]
    repository = ModelRepository.load(ROOT / "models")
    family = repository.family("arith")
    header = f"{'variant':<18}{'runtime':<16}" + "".join(f"{f'{n} at once':>22}" for n in counts)
    print(f"{len(prompts)} held-out arith prompts; generations/s (median ms each)\n")
    print(header)
    print("-" * len(header))
    for name in ("arith-small", "arith-medium", "arith-large-fp16"):
        variant = repository.variant(name)
        for runtime, cls in GENERATORS.items():
            if not cls.availability().available:
                continue
            options = LoadOptions(tier=variant.tier, cache_dir=Path("/nonexistent"))
            model = load_generator(family, variant, options, runtimes=[runtime])
            measure(model, prompts[:20], 1)  # warm
            rounds = [[measure(model, prompts, n) for n in counts] for _ in range(args.rounds)]
            cells = [
                (statistics.median(r[i][0] for r in rounds), statistics.median(r[i][1] for r in rounds))
                for i in range(len(counts))
            ]
            print(f"{name:<18}{runtime:<16}" + "".join(f"{rate:>14.1f} ({ms:>5.2f})" for rate, ms in cells))
            model.close()


if __name__ == "__main__":
    main()
