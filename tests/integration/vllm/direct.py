"""vLLM asked directly, as the gateway asks it: what the gateway's answers must equal."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Vllm:
    server: Any  # vllm_env.VllmServer
    model: str  # the served model's name
    family: str

    @property
    def url(self) -> str:
        return str(self.server.url)


@dataclass(frozen=True)
class Gateway:
    address: str
    metrics_url: str


def completion(
    url: str, model: str, prompt: str, *, max_tokens: int, timeout_s: float = 30.0, **fields: Any
) -> Any:
    """Ask vLLM directly, as the gateway does: greedy (unless ``fields`` say otherwise),
    top-2 log-probabilities."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 2,
        **fields,
    }
    request = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def completion_error(url: str, model: str, prompt: str, *, max_tokens: int) -> tuple[int, str]:
    """The HTTP status and message vLLM refuses a request with."""
    try:
        completion(url, model, prompt, max_tokens=max_tokens)
    except urllib.error.HTTPError as exc:
        body = json.loads(exc.read())
        error = body.get("error", body)
        return exc.code, str(error["message"])
    raise AssertionError("vLLM accepted the request")
