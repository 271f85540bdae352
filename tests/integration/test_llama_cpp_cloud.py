"""An LLM cloud that no one here wrote: llama.cpp's own OpenAI-compatible server
(``python -m llama_cpp.server``, from ``llama-cpp-python[server]``) serving
models/arith/arith-large-fp16.gguf as ``arith-large``, behind ``stratus cloud
--openai-upstream``, with a router and a device agent in front.

What the answers must equal comes from the server itself, asked directly: its text and its
log-probabilities, as it gives them. The server has no ``/health``; the gateway reads its
readiness from ``/v1/models``, and since the upstream serves arith's cloud tier, the gateway
loads no arith model of its own.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from stratus.convert.parameters import parameter_value
from stratus.convert.text import prompt_request
from stratus.devtools.launcher import free_port
from stratus.families.generation import GenerationParams
from stratus.serving.channels import open_sync_channel
from stratus.wire import inference_pb2_grpc as pb_grpc

from .cluster import MODELS, Cluster, ready_count, wait_until

if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("uvicorn") is None:
    pytest.skip(
        "llama.cpp's server is not installed (make llama-env: llama-cpp-python[server])",
        allow_module_level=True,
    )

GGUF = MODELS / "arith" / "arith-large-fp16.gguf"
NAME = "arith-large"  # a variant of the repository: it serves arith's cloud tier
PROMPTS = ["37+48=", "91-19=", "3+4="]


@dataclass
class LlamaServer:
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def start(cls, log: Path, port: int | None = None) -> LlamaServer:
        port = port or free_port()
        command = [sys.executable, "-m", "llama_cpp.server", "--model", str(GGUF), "--model_alias", NAME]
        command += ["--host", "127.0.0.1", "--port", str(port), "--n_ctx", "512", "--n_threads", "1"]
        with log.open("ab") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        server = cls(process, port, log)
        wait_until(server.listing, timeout_s=60)
        return server

    def listing(self) -> bool:
        assert self.process.poll() is None, self.log.read_text()[-2000:]
        try:
            with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as response:
                return NAME in {m["id"] for m in json.loads(response.read())["data"]}
        except (urllib.error.URLError, ConnectionError):
            return False

    def complete(self, prompt: str) -> dict[str, object]:
        """The server asked directly, as the gateway asks it: greedy, top-2 log-probabilities."""
        body = {"model": NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 2}
        request = urllib.request.Request(
            self.url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            choice: dict[str, object] = json.loads(response.read())["choices"][0]
            return choice

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@dataclass
class Site:
    llama: LlamaServer
    cloud: str
    api: str
    cluster: Cluster

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://{self.api}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    logs = tmp_path_factory.mktemp("llama-cloud")
    site = Site(llama=LlamaServer.start(logs / "llama-server.log"), cloud="", api="", cluster=Cluster(logs))
    try:
        site.cloud = site.cluster.cloud("--openai-upstream", site.llama.url, "--upstream-model", NAME).address
        site.api = f"127.0.0.1:{free_port()}"
        router = site.cluster.router("--cloud", site.cloud, "--openai", site.api).address
        site.cluster.agent("device-1", router)
        wait_until(lambda: ready_count(router) == 1, timeout_s=60)
        yield site
    finally:
        site.cluster.stop_all()
        site.llama.stop()  # the server running now: a test may have replaced the first
        assert site.llama.process.poll() is not None


def ask(site: Site, prompt: str, **stratus: object) -> tuple[str, dict[str, object]]:
    answer = site.client().completions.create(model="arith", prompt=prompt, max_tokens=4, extra_body={"stratus": stratus})
    return answer.choices[0].text, (answer.model_extra or {})["stratus"]


def test_unsure_answers_climb_to_llama_cpp_and_come_back_as_it_gives_them(site: Site) -> None:
    for prompt in PROMPTS:
        direct = str(site.llama.complete(prompt)["text"])
        text, served = ask(site, prompt, min_confidence=1.0)
        assert (served["tier"], served["path"], served["degraded"]) == ("cloud", ["device", "cloud"], False)
        assert served["variant"] == NAME and text.strip() == direct.strip()
        streamed = site.client().completions.create(
            model="arith", prompt=prompt, max_tokens=4, stream=True, extra_body={"stratus": {"min_tier": "cloud"}}
        )
        assert "".join(c.choices[0].text for c in streamed).strip() == direct.strip()
    log = site.cluster.latest("cloud").log()
    assert "has no /health: /v1/models tells its health" in log
    assert "arith-large-fp16 loaded" not in log  # the upstream serves arith: nothing of it runs here


def test_the_gateway_passes_on_llama_cpps_log_probabilities(site: Site) -> None:
    direct = site.llama.complete("37+48=")
    logprobs = direct["logprobs"]
    assert isinstance(logprobs, dict)
    with open_sync_channel(site.cloud) as channel:
        response = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            prompt_request("arith", "t1", "37+48=", GenerationParams(max_tokens=4)), timeout=30
        )
    given = json.loads(str(parameter_value(response.parameters["stratus.token_logprobs"])))
    assert given == pytest.approx(logprobs["token_logprobs"], rel=0.05, abs=1e-6)
    assert parameter_value(response.parameters["stratus.variant"]) == NAME


def test_without_llama_cpp_answers_degrade_and_its_return_is_picked_up(site: Site) -> None:
    port = site.llama.port
    site.llama.process.send_signal(signal.SIGKILL)
    site.llama.process.wait()
    wait_until(lambda: ask(site, PROMPTS[0], min_confidence=1.0)[1]["degraded"] is True, timeout_s=20)
    text, served = ask(site, PROMPTS[0], min_confidence=1.0)
    assert served["tier"] == "device" and served["degraded"] is True and text
    site.llama = LlamaServer.start(site.llama.log, port=port)
    wait_until(lambda: ask(site, PROMPTS[0], min_confidence=1.0)[1]["tier"] == "cloud", timeout_s=30)
