"""The generative cascade against the cloud alone, on the arith held-out prompts.

Starts vLLM (from .venv-vllm, set up by `make vllm-env`) on `arith-large`, a cloud gateway
in front of it (`--openai-upstream`), a router with the OpenAI API, a device agent and an
edge agent (OpenVINO GenAI on the GGUF files). Then sends every held-out prompt through
the OpenAI API, one at a time, on two paths: the cascade (`model: arith`) and the cloud
alone (`stratus.min_tier: cloud`). Per path: accuracy, the share that reached the cloud,
median and p99 latency, and tokens generated on each tier (cancelled generations included).

    python benchmarks/llm_cascade.py [--prompts 300]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import openai  # noqa: E402
import vllm_env  # noqa: E402

from stratus.arith import arith_splits, grade  # noqa: E402
from stratus.demo import launch_agent, wait_for_agents  # noqa: E402
from stratus.launcher import free_port, launch  # noqa: E402

QUIET = ["--log-level", "WARNING"]


def run_path(client: openai.OpenAI, prompts: list[tuple[str, str]], **stratus: object) -> dict[str, object]:
    right, latencies = 0, []
    reached: Counter[str] = Counter()
    tokens: Counter[str] = Counter()
    for prompt, _ in prompts:
        started = time.perf_counter()
        answer = client.completions.create(
            model="arith", prompt=prompt, max_tokens=4, extra_body={"stratus": stratus}
        )
        latencies.append((time.perf_counter() - started) * 1000.0)
        served = (answer.model_extra or {})["stratus"]
        right += grade(prompt, answer.choices[0].text)
        reached[served["tier"]] += 1
        for tier, count in served.get("tokens", {}).items():
            tokens[tier] += count
    count = len(prompts)
    return {
        "accuracy": right / count,
        "cloud_share": reached["cloud"] / count,
        "p50_ms": statistics.median(latencies),
        "p99_ms": sorted(latencies)[min(count - 1, int(0.99 * count))],
        "tokens": dict(tokens),
        "answered_on": dict(reached),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=300, help="held-out prompts per path")
    args = parser.parse_args()
    vllm_env.ensure()
    prompts = [(e.prompt, e.answer) for e in arith_splits().held_out[: args.prompts]]
    models = ROOT / "models"
    with tempfile.TemporaryDirectory() as scratch:
        logs = Path(scratch)
        vllm = vllm_env.start(
            models / "arith" / "arith-large", name="arith-large", log_path=logs / "vllm.log"
        )
        launched = []
        try:
            cloud = launch(
                ["cloud", "--listen", f"127.0.0.1:{free_port()}", "--models", str(models),
                 "--openai-upstream", vllm.url, "--upstream-model", "arith-large", "--upstream-family", "arith", *QUIET],
                role="cloud", log_dir=logs,
            )  # fmt: skip
            api = f"127.0.0.1:{free_port()}"
            router = launch(
                ["router", "--listen", "127.0.0.1:0", "--cloud", cloud.address, "--openai", api, "--no-advertise", *QUIET],
                role="router", log_dir=logs,
            )  # fmt: skip
            launched = [cloud, router]
            launched += [
                launch_agent(models, router.address, name, logs, tier=tier)
                for name, tier in (("device-1", "device"), ("edge-1", "edge"))
            ]
            wait_for_agents(router.address, 2)
            client = openai.OpenAI(base_url=f"http://{api}/v1", api_key="unused", max_retries=0)
            run_path(client, prompts[:5], min_tier="cloud")  # warm every tier once
            run_path(client, prompts[:5])
            results = {
                "cascade": run_path(client, prompts),
                "cloud only": run_path(client, prompts, min_tier="cloud"),
            }
        finally:
            for process in reversed(launched):
                process.stop()
            vllm.stop()
    print(f"{len(prompts)} held-out arith prompts, one at a time, through the OpenAI API\n")
    header = f"{'path':<12}{'accuracy':>10}{'to cloud':>10}{'p50 ms':>9}{'p99 ms':>9}  tokens by tier / answered on"
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        print(
            f"{name:<12}{r['accuracy']:>10.4f}{r['cloud_share']:>10.1%}{r['p50_ms']:>9.1f}{r['p99_ms']:>9.1f}"
            f"  {r['tokens']} / {r['answered_on']}"
        )


if __name__ == "__main__":
    main()
