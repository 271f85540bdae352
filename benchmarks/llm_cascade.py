"""The generative cascade against the cloud alone, on the arith held-out prompts, with two
kinds of cloud: vLLM, and the cloud gateway generating by itself on a CPU.

Starts vLLM (from .venv-vllm, set up by `make vllm-env`) on `arith-large`, a cloud gateway
in front of it (`--openai-upstream`), a second cloud gateway that runs `arith-large` itself
(OpenVINO GenAI on its F16 GGUF child), a router with the OpenAI API in front of each, and a
device agent and an edge agent linked to both routers (their default runtimes: llama.cpp on
the device where installed, OpenVINO GenAI on the edge). Then sends every held-out prompt
through the OpenAI API, one at a time, on each path: the cascade (`model: arith`) and the
cloud alone (`stratus.min_tier: cloud`), and again streamed, for the time to the first text.
Per path: accuracy, the share that reached the cloud, median and p99 latency, median time to
first text when streamed, tokens generated on each tier (cancelled generations included),
and the slowest requests with the tiers they took.

    python benchmarks/llm_cascade.py [--prompts 300]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import openai  # noqa: E402
import vllm_env  # noqa: E402

from stratus.cli.demo import launch_agent, wait_for_agents  # noqa: E402
from stratus.devtools.launcher import Launched, free_port, launch  # noqa: E402
from stratus.tools.arith import arith_splits, grade  # noqa: E402

QUIET = ["--log-level", "WARNING"]


@dataclass
class PathResult:
    accuracy: float
    cloud_share: float
    p50_ms: float
    p99_ms: float
    first_text_ms: float
    tokens: dict[str, int]
    answered_on: dict[str, int]
    slowest: list[tuple[float, str]] = field(default_factory=list)


def run_path(client: openai.OpenAI, prompts: list[tuple[str, str]], **stratus: object) -> PathResult:
    right, latencies, first_text = 0, [], []
    reached: Counter[str] = Counter()
    tokens: Counter[str] = Counter()
    paths: list[tuple[float, str]] = []
    for prompt, _ in prompts:
        started = time.perf_counter()
        answer = client.completions.create(
            model="arith", prompt=prompt, max_tokens=4, extra_body={"stratus": stratus}
        )
        elapsed = (time.perf_counter() - started) * 1000.0
        latencies.append(elapsed)
        served = (answer.model_extra or {})["stratus"]
        right += grade(prompt, answer.choices[0].text)
        reached[served["tier"]] += 1
        paths.append((elapsed, ">".join(served["path"])))
        for tier, count in served.get("tokens", {}).items():
            tokens[tier] += count
        first_text.append(_first_text_ms(client, prompt, stratus))
    count = len(prompts)
    return PathResult(
        accuracy=right / count,
        cloud_share=reached["cloud"] / count,
        p50_ms=statistics.median(latencies),
        p99_ms=sorted(latencies)[min(count - 1, int(0.99 * count))],
        first_text_ms=statistics.median(first_text),
        tokens=dict(tokens),
        answered_on=dict(reached),
        slowest=sorted(paths, reverse=True)[:3],
    )


def _first_text_ms(client: openai.OpenAI, prompt: str, stratus: dict[str, object]) -> float:
    """Milliseconds until a streamed answer's first text arrives."""
    started = time.perf_counter()
    stream = client.completions.create(
        model="arith", prompt=prompt, max_tokens=4, stream=True, extra_body={"stratus": stratus}
    )
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = (time.perf_counter() - started) * 1000.0
    return first if first is not None else (time.perf_counter() - started) * 1000.0


def start_fleet(models: Path, logs: Path, vllm_url: str) -> tuple[list[Launched], dict[str, str]]:
    """Two clouds, a router with the OpenAI API in front of each, agents linked to both."""
    launched: list[Launched] = []
    apis: dict[str, str] = {}
    clouds = {
        "vLLM": [
            "--openai-upstream",
            vllm_url,
            "--upstream-model",
            "arith-large",
            "--upstream-family",
            "arith",
        ],
        "CPU": [],
    }
    routers = []
    for kind, flags in clouds.items():
        cloud = launch(
            ["cloud", "--listen", f"127.0.0.1:{free_port()}", "--models", str(models), *flags, *QUIET],
            role=f"cloud-{kind}", log_dir=logs,
        )  # fmt: skip
        apis[kind] = f"127.0.0.1:{free_port()}"
        router = launch(
            ["router", "--listen", "127.0.0.1:0", "--cloud", cloud.address, "--openai", apis[kind], "--no-advertise", *QUIET],
            role=f"router-{kind}", log_dir=logs,
        )  # fmt: skip
        launched += [cloud, router]
        routers.append(router.address)
    both = ",".join(routers)
    launched += [
        launch_agent(models, both, name, logs, tier=tier)
        for name, tier in (("device-1", "device"), ("edge-1", "edge"))
    ]
    for router in routers:
        wait_for_agents(router, 2)
    return launched, apis


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=300, help="held-out prompts per path")
    args = parser.parse_args()
    vllm_env.ensure()
    prompts = [(e.prompt, e.answer) for e in arith_splits().held_out[: args.prompts]]
    models = ROOT / "models"
    results: dict[str, PathResult] = {}
    with tempfile.TemporaryDirectory() as scratch:
        logs = Path(scratch)
        vllm = vllm_env.start(
            models / "arith" / "arith-large", name="arith-large", log_path=logs / "vllm.log"
        )
        launched: list[Launched] = []
        try:
            launched, apis = start_fleet(models, logs, vllm.url)
            for kind, api in apis.items():
                client = openai.OpenAI(base_url=f"http://{api}/v1", api_key="unused", max_retries=0)
                run_path(client, prompts[:5], min_tier="cloud")  # warm every tier once
                run_path(client, prompts[:5])
                results[f"cascade, {kind} cloud"] = run_path(client, prompts)
                results[f"{kind} cloud only"] = run_path(client, prompts, min_tier="cloud")
        finally:
            for process in reversed(launched):
                process.stop()
            vllm.stop()
    report(len(prompts), results)


def report(count: int, results: dict[str, PathResult]) -> None:
    print(f"{count} held-out arith prompts, one at a time, through the OpenAI API\n")
    header = (
        f"{'path':<20}{'accuracy':>9}{'to cloud':>10}{'p50 ms':>8}{'p99 ms':>8}{'1st text':>9}"
        "  tokens by tier / answered on"
    )
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        print(
            f"{name:<20}{r.accuracy:>9.4f}{r.cloud_share:>10.1%}{r.p50_ms:>8.1f}{r.p99_ms:>8.1f}"
            f"{r.first_text_ms:>9.1f}  {r.tokens} / {r.answered_on}"
        )
    print("\nslowest requests (ms, path):")
    for name, r in results.items():
        print(f"  {name:<20}" + "; ".join(f"{ms:.1f} {path}" for ms, path in r.slowest))


if __name__ == "__main__":
    main()
