"""Check the built ``arith`` family against its runtimes, and simulate the cascade.

Not part of the build; three steps, each in the environment that has its runtime::

    .venv-vllm/bin/python models/check_llm.py reference --json /tmp/arith.json
    .venv/bin/python      models/check_llm.py openvino  --json /tmp/arith.json
    .venv-vllm/bin/python models/check_llm.py vllm      --json /tmp/arith.json

``reference`` decodes the calibration and held-out prompts greedily with transformers for
every variant, reports exact-match accuracy, how well each confidence measure separates
right from wrong answers (AUROC, and accuracy/coverage at a few thresholds), simulates
the device -> edge -> cloud cascade with thresholds chosen on calibration, and saves the
per-prompt tokens and log-probabilities. ``openvino`` runs the GGUF files in OpenVINO
GenAI's ``ContinuousBatchingPipeline`` and ``vllm`` serves ``arith-large`` with vLLM's
OpenAI server; both compare tokens and log-probabilities with the saved reference.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from stratus.tools.arith import arith_splits, grade  # noqa: E402

FAMILY = HERE / "arith"
VARIANTS = ("arith-small", "arith-medium", "arith-large")
GGUF_VARIANTS = ("arith-small", "arith-medium")
MEASURES = ("mean_logprob", "min_logprob", "first_margin", "first_prob", "sequence_prob")
COMPARED = 20  # prompts compared token by token with each runtime
MAX_TOKENS = 4
EOS_ID = 1


# ---------------------------------------------------------------------------------------------
# confidence and scoring (plain numpy)
# ---------------------------------------------------------------------------------------------


def measure(entry: dict[str, Any], name: str) -> float:
    """An answer's confidence in [0, 1] from its per-token log-probabilities (</s> included)."""
    logprobs = entry["logprobs"]
    if name == "mean_logprob":
        return math.exp(sum(logprobs) / len(logprobs))
    if name == "min_logprob":
        return math.exp(min(logprobs))
    if name == "first_margin":
        return float(entry["margins"][0])
    if name == "sequence_prob":  # the probability of the whole answer: not in stratus.families.generation (yet)
        return math.exp(sum(logprobs))
    return math.exp(logprobs[0])  # first_prob: what first_margin falls back to without alternatives


def auroc(scores: np.ndarray, right: np.ndarray) -> float:
    """Probability that a right answer scores above a wrong one (ties count half)."""
    pos, neg = scores[right], scores[~right]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    greater = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(greater / (len(pos) * len(neg)))


def coverage_table(scores: np.ndarray, right: np.ndarray) -> str:
    """Accuracy of the answers kept at a few confidence thresholds, and the share kept."""
    cells = []
    for threshold in (0.5, 0.7, 0.8, 0.9, 0.95):
        kept = scores >= threshold
        accuracy = right[kept].mean() if kept.any() else float("nan")
        cells.append(f">={threshold}: keep {kept.mean():.2f} acc {accuracy:.3f}")
    return "; ".join(cells)


def cascade(
    conf: dict[str, np.ndarray], right: dict[str, np.ndarray], t_device: float, t_edge: float
) -> tuple[float, float, float]:
    """Accuracy, share answered at the edge, share reaching the cloud."""
    at_device = conf["arith-small"] >= t_device
    at_edge = ~at_device & (conf["arith-medium"] >= t_edge)
    at_cloud = ~at_device & ~at_edge
    answer_right = np.where(
        at_device, right["arith-small"], np.where(at_edge, right["arith-medium"], right["arith-large"])
    )
    return float(answer_right.mean()), float(at_edge.mean()), float(at_cloud.mean())


def choose_thresholds(
    conf: dict[str, np.ndarray], right: dict[str, np.ndarray], max_cloud: float = 1 / 3
) -> tuple[float, float]:
    """On calibration: the fewest prompts to the cloud at the large model's accuracy or better;
    failing that, the best accuracy with at most ``max_cloud`` reaching the cloud."""
    grid = {
        v: np.unique(np.concatenate([np.quantile(conf[v], np.linspace(0, 1, 101)), [1.01]]))
        for v in ("arith-small", "arith-medium")
    }
    target = right["arith-large"].mean()
    best: tuple[float, ...] | None = None
    fallback: tuple[float, ...] | None = None
    for t_device in grid["arith-small"]:
        for t_edge in grid["arith-medium"]:
            accuracy, _, cloud = cascade(conf, right, t_device, t_edge)
            if accuracy >= target and (best is None or (cloud, -accuracy) < (best[0], -best[1])):
                best = (cloud, accuracy, t_device, t_edge)
            if cloud <= max_cloud and (fallback is None or accuracy > fallback[1]):
                fallback = (cloud, accuracy, t_device, t_edge)
    chosen = best if best is not None and best[0] <= max_cloud else fallback
    assert chosen is not None
    return float(chosen[2]), float(chosen[3])


# ---------------------------------------------------------------------------------------------
# reference: transformers
# ---------------------------------------------------------------------------------------------


def reference(path: Path, family: Path) -> None:
    import torch
    from transformers import LlamaForCausalLM

    sys.path.insert(0, str(HERE))
    from llm_decode import greedy, make_tokenizer

    torch.set_num_threads(1)
    tokenizer = make_tokenizer()
    splits = arith_splits()
    saved: dict[str, Any] = {}
    for split in ("calibration", "held_out"):
        examples = getattr(splits, split)
        saved[split] = {"prompts": [p for p, _ in examples]}
        for variant in VARIANTS:
            model = LlamaForCausalLM.from_pretrained(family / variant, dtype=torch.float32).eval()
            started = time.monotonic()
            generated = greedy(model, tokenizer, saved[split]["prompts"])
            seconds = time.monotonic() - started
            saved[split][variant] = [
                {
                    "text": g.text,
                    "ids": list(g.ids),
                    "logprobs": list(g.logprobs),
                    "margins": list(g.margins),
                    "right": grade(p, g.text),
                }
                for p, g in zip(saved[split]["prompts"], generated, strict=True)
            ]
            print(f"[{split}] {variant}: greedy on {len(examples)} prompts in {seconds:.1f} s", flush=True)
    path.write_text(json.dumps(saved))
    report(saved)


def report(saved: dict[str, Any]) -> None:
    for split in ("calibration", "held_out"):
        print(f"\n== {split} ({len(saved[split]['prompts'])} prompts)")
        for variant in VARIANTS:
            entries = saved[split][variant]
            right = np.array([e["right"] for e in entries])
            finished = np.mean([e["ids"][-1] == EOS_ID for e in entries])
            print(f"{variant}: exact-match accuracy {right.mean():.3f} (ended with </s>: {finished:.3f})")
            for name in MEASURES:
                scores = np.array([measure(e, name) for e in entries])
                print(f"    {name:13s} AUROC {auroc(scores, right):.3f}  {coverage_table(scores, right)}")
    for name in MEASURES:
        simulate(saved, name)


def simulate(saved: dict[str, Any], name: str) -> None:
    conf, right = {}, {}
    for split in ("calibration", "held_out"):
        conf[split] = {v: np.array([measure(e, name) for e in saved[split][v]]) for v in VARIANTS}
        right[split] = {v: np.array([e["right"] for e in saved[split][v]]) for v in VARIANTS}
    t_device, t_edge = choose_thresholds(conf["calibration"], right["calibration"])
    print(
        f"\ncascade with {name}: thresholds device {t_device:.4f} edge {t_edge:.4f} (chosen on calibration)"
    )
    for split in ("calibration", "held_out"):
        accuracy, edge, cloud = cascade(conf[split], right[split], t_device, t_edge)
        large = right[split]["arith-large"].mean()
        device = (conf[split]["arith-small"] >= t_device).mean()
        print(
            f"    {split:11s}: accuracy {accuracy:.3f} (large alone {large:.3f}); "
            f"device {device:.2f} edge {edge:.2f} cloud {cloud:.2f}"
        )


# ---------------------------------------------------------------------------------------------
# OpenVINO GenAI (GGUF)
# ---------------------------------------------------------------------------------------------


def openvino(path: Path, family: Path) -> None:
    """The GGUF files in ContinuousBatchingPipeline: once with the CPU plugin's default KV cache
    (u8-compressed here) and once with an f32 one."""
    saved = json.loads(path.read_text())["held_out"]
    picks = _spread(len(saved["prompts"]), COMPARED)
    for variant in GGUF_VARIANTS:
        for properties in ({}, {"KV_CACHE_PRECISION": "f32"}):
            prompts = [saved["prompts"][i] for i in picks]
            got, text = _openvino_run(family / f"{variant}.gguf", properties, prompts)
            _compare(f"{variant} {properties or 'default'}", [saved[variant][i] for i in picks], got)
        print(f"    decoded text of the first: {text!r} (reference {saved[variant][picks[0]]['text']!r})")


def _openvino_run(
    gguf: Path, properties: dict[str, str], prompts: Sequence[str]
) -> tuple[list[dict[str, Any]], str]:
    import openvino_genai as genai

    started = time.monotonic()
    scheduler = genai.SchedulerConfig()
    scheduler.cache_size = 1  # GB of KV cache
    pipe = genai.ContinuousBatchingPipeline(str(gguf), scheduler, "CPU", properties)
    loaded = time.monotonic() - started
    config = genai.GenerationConfig()
    config.max_new_tokens = MAX_TOKENS
    config.logprobs = 1  # fills generated_log_probs: the chosen tokens' only, no alternatives
    config.apply_chat_template = False
    started = time.monotonic()
    handles = [pipe.add_request(i, prompt, config) for i, prompt in enumerate(prompts)]
    while pipe.has_non_finished_requests():
        pipe.step()
    outputs = [h.read_all()[0] for h in handles]
    print(
        f"{gguf.name} {properties}: loaded in {loaded:.2f} s; {len(prompts)} prompts in "
        f"{(time.monotonic() - started) * 1000:.0f} ms; finish reason {outputs[0].finish_reason}"
    )
    got = [{"ids": list(o.generated_ids), "logprobs": list(o.generated_log_probs)} for o in outputs]
    return got, pipe.get_tokenizer().decode(outputs[0].generated_ids)


def _spread(count: int, wanted: int) -> list[int]:
    return sorted({int(i) for i in np.linspace(0, count - 1, wanted)})


def _compare(variant: str, expected: Sequence[dict[str, Any]], got: Sequence[dict[str, Any]]) -> None:
    same = sum(e["ids"] == g["ids"] for e, g in zip(expected, got, strict=True))
    gaps = [
        abs(a - b)
        for e, g in zip(expected, got, strict=True)
        if e["ids"] == g["ids"]
        for a, b in zip(e["logprobs"], g["logprobs"], strict=True)
    ]
    worst = max(gaps) if gaps else float("nan")
    print(f"    {variant}: same tokens on {same}/{len(expected)}; largest log-probability gap {worst:.2e}")
    for e, g in zip(expected, got, strict=True):
        if e["ids"] != g["ids"]:
            print(f"    differs: reference {e['ids']} {e['logprobs']} runtime {g['ids']} {g['logprobs']}")


# ---------------------------------------------------------------------------------------------
# vLLM (arith-large)
# ---------------------------------------------------------------------------------------------


def vllm(path: Path, family: Path) -> None:
    saved = json.loads(path.read_text())["held_out"]
    picks = _spread(len(saved["prompts"]), COMPARED)
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(family / "arith-large"),
        "--served-model-name", "arith-large", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
    ]  # fmt: skip
    started = time.monotonic()
    with open("/tmp/arith-vllm.log", "w") as log:
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_ready(port, server)
        print(f"vLLM ready after {time.monotonic() - started:.0f} s")
        got, times = [], []
        for i in picks:
            started = time.monotonic()
            got.append(_complete(port, saved["prompts"][i]))
            times.append(time.monotonic() - started)
        print(f"    first request {times[0]:.2f} s; later ones median {np.median(times[1:]) * 1000:.0f} ms")
        _compare("arith-large", [saved["arith-large"][i] for i in picks], got)
        margins = [
            abs(g["margin"] - saved["arith-large"][i]["margins"][0]) for g, i in zip(got, picks, strict=True)
        ]
        print(f"    first-token top-1 minus top-2 probability: largest gap {max(margins):.2e}")
        print(
            f"    text of the first: {got[0]['text']!r} (reference {saved['arith-large'][picks[0]]['text']!r})"
        )
    finally:
        server.terminate()
        server.wait(timeout=60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(port: int, server: subprocess.Popen[bytes], limit: float = 600) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError("vLLM exited; see /tmp/arith-vllm.log")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise RuntimeError("vLLM not ready in time")


def _complete(port: int, prompt: str) -> dict[str, Any]:
    body = {
        "model": "arith-large",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": 2,
        "return_tokens_as_token_ids": True,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        choice = json.load(response)["choices"][0]
    logprobs = choice["logprobs"]
    top = sorted(logprobs["top_logprobs"][0].values(), reverse=True)
    return {
        "text": choice["text"],
        "ids": [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]],
        "logprobs": logprobs["token_logprobs"],
        "margin": math.exp(top[0]) - math.exp(top[1]),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("step", choices=("reference", "report", "openvino", "vllm"))
    parser.add_argument("--json", type=Path, default=Path("/tmp/arith-reference.json"))
    parser.add_argument("--family", type=Path, default=FAMILY, help="the built family's directory")
    args = parser.parse_args(argv)
    if args.step == "reference":
        reference(args.json, args.family)
    elif args.step == "report":
        report(json.loads(args.json.read_text()))
    elif args.step == "openvino":
        openvino(args.json, args.family)
    else:
        vllm(args.json, args.family)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
