"""A CPU-only cloud: the gateway runs the generative family's large variant itself (through
its FP16 GGUF file, on OpenVINO GenAI) with no vLLM, and streams what it generates.

Answers are graded against arithmetic itself (stratus.tools.arith.solve), never against what a
model said before; where text is compared, it is one path's answer against another's."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest

from stratus.convert import codec
from stratus.convert.parameters import Served
from stratus.devtools.launcher import free_port
from stratus.families.repository import ModelRepository
from stratus.serving.channels import open_sync_channel
from stratus.tools.arith import solve
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

from .cluster import MODELS, Cluster, ready_count, wait_until
from .test_llm import LLM_MODELS, oip_request
from .test_metrics import count, samples, scrape

PROMPTS = ["37+48=", "90-45=", "66+27=", "81-19=", "45+45="]


@dataclass
class CloudFleet:
    router: str
    cloud: str
    openai_url: str
    router_metrics: str

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.openai_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CloudFleet]:
    cluster = Cluster(tmp_path_factory.mktemp("llm-cloud") / "logs")
    try:
        cloud = cluster.cloud().address
        api, metrics = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        router = cluster.router("--cloud", cloud, "--openai", api, "--metrics", metrics).address
        cluster.agent("device-1", router, *LLM_MODELS)
        wait_until(lambda: ready_count(router) == 1, timeout_s=60)
        yield CloudFleet(router=router, cloud=cloud, openai_url=f"http://{api}/v1", router_metrics=metrics)
    finally:
        cluster.stop_all()


def streamed(stub: pb_grpc.GRPCInferenceServiceStub, prompt: str) -> list[pb.ModelInferResponse]:
    responses = list(stub.ModelStreamInfer(iter([oip_request(prompt, stream=True)]), timeout=30))
    assert all(not r.error_message for r in responses), [r.error_message for r in responses]
    return [r.infer_response for r in responses]


def text_of(response: pb.ModelInferResponse) -> str:
    return str(codec.decode_response_outputs(response)["text_output"][0].decode())


def test_the_gateway_serves_the_large_variant_whole_and_streamed(fleet: CloudFleet) -> None:
    with open_sync_channel(fleet.cloud) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        index = stub.RepositoryIndex(pb.RepositoryIndexRequest(ready=True), timeout=5)
        assert {"arith", "arith-large"} <= {m.name for m in index.models}
        metadata = stub.ModelMetadata(pb.ModelMetadataRequest(name="arith"), timeout=5)
        assert (metadata.platform, metadata.versions) == ("openvino_genai", ["1"])
        config = stub.ModelConfig(pb.ModelConfigRequest(name="arith"), timeout=5).config
        assert config.parameters["stratus.variant"].string_value == "arith-large-fp16"
        assert [(t.name, t.datatype) for t in metadata.inputs] == [("text_input", "BYTES")]
        right = 0
        for prompt in PROMPTS:
            whole = stub.ModelInfer(oip_request(prompt), timeout=30)
            chunks = streamed(stub, prompt)
            assert "".join(map(text_of, chunks)) == text_of(whole)
            finals = [c.parameters["triton_final_response"].bool_param for c in chunks]
            assert finals[-1] and not any(finals[:-1])
            assert sum(1 for c in chunks if text_of(c)) >= 2  # token by token, not one message
            served = Served.read(chunks[-1].parameters)
            assert (served.tier.label, served.variant) == ("cloud", "arith-large-fp16")
            right += text_of(whole) == solve(prompt)
        pinned = stub.ModelInfer(oip_request(PROMPTS[0], model="arith-large"), timeout=30)
        assert text_of(pinned) == solve(PROMPTS[0])
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(oip_request(PROMPTS[0], max_tokens=99), timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_tokens" in str(refused.value.details())
    assert right >= 4  # the large model is right on 98% of held-out prompts


def test_an_unsure_answer_climbs_to_the_cloud_which_streams_through(fleet: CloudFleet) -> None:
    client = fleet.client()
    before = samples(scrape(fleet.router_metrics))
    answered = 0
    for prompt in PROMPTS[:3]:
        whole = client.completions.create(
            model="arith", prompt=prompt, max_tokens=4, extra_body={"stratus": {"min_confidence": 1.0}}
        )
        extra = (whole.model_extra or {})["stratus"]
        assert (extra["tier"], extra["path"], extra["degraded"]) == ("cloud", ["device", "cloud"], False)
        stream = client.completions.create(
            model="arith",
            prompt=prompt,
            max_tokens=4,
            stream=True,
            extra_body={"stratus": {"min_confidence": 1.0}},
        )
        chunks = list(stream)
        pieces = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
        assert "".join(pieces) == whole.choices[0].text
        assert len(pieces) >= 2  # the cloud's tokens arrive as it makes them
        assert (chunks[-1].model_extra or {})["stratus"]["tier"] == "cloud"
        answered += 2 * (extra["tokens"]["cloud"])  # the whole answer, then the streamed one
    after = samples(scrape(fleet.router_metrics))

    def grew(name: str, **labels: str) -> float:
        return count(after, name, family="arith", **labels) - count(before, name, family="arith", **labels)

    # every device answer was held and climbed past; what the cloud made is what was answered
    assert grew("stratus_router_generated_tokens_total", tier="device", fate="discarded") >= 6
    assert grew("stratus_router_generated_tokens_total", tier="device", fate="answered") == 0
    assert grew("stratus_router_generated_tokens_total", tier="cloud", fate="answered") == answered
    assert grew("stratus_router_escalations_total", from_tier="device", to_tier="cloud", reason="unsure") == 6
    assert grew("stratus_router_first_text_seconds_count") == 3  # the streamed requests


def test_a_client_that_goes_away_cancels_the_generation_in_the_cloud(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path / "logs")
    try:  # a cloud that takes 300 ms per token, straight from the router
        metrics = f"127.0.0.1:{free_port()}"
        cloud = cluster.cloud("--metrics", metrics, "--emulate-slow-ms", "300").address
        api = f"127.0.0.1:{free_port()}"
        router = cluster.router("--cloud", cloud, "--openai", api).address
        wait_until(lambda: ready_of(api), timeout_s=30)
        with open_sync_channel(router) as channel:  # the family as the cloud describes it
            metadata = pb_grpc.GRPCInferenceServiceStub(channel).ModelMetadata(
                pb.ModelMetadataRequest(name="arith"), timeout=5
            )
            config = pb_grpc.GRPCInferenceServiceStub(channel).ModelConfig(
                pb.ModelConfigRequest(name="arith"), timeout=5
            )
        assert [(t.name, t.datatype) for t in metadata.inputs] == [("text_input", "BYTES")]
        family = ModelRepository.load(MODELS).family("arith")
        assert family.generation is not None
        assert config.config.parameters["max_tokens"].string_value == str(family.generation.max_tokens)
        body = json.dumps({"model": "arith", "prompt": "37+48=", "max_tokens": 4, "stream": True}).encode()
        request = urllib.request.Request(
            f"http://{api}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:  # closed even on failure
            first = response.readline()  # the first token's event, then hang up
        assert first.startswith(b"data: ") and b'"tier": "cloud"' not in first
        large = {"family": "arith", "variant": "arith-large-fp16"}  # the cloud line's GGUF child runs here
        counted = lambda: count(samples(scrape(metrics)), "stratus_work_total", **large, outcome="cancelled")  # noqa: E731
        wait_until(lambda: counted() == 1, timeout_s=10)
        assert count(samples(scrape(metrics)), "stratus_work_total", **large, outcome="ok") == 0
        # the cloud timed the generation it stopped: its first token (which the client read) and its run
        timed = lambda: count(samples(scrape(metrics)), "stratus_generation_duration_seconds_count", **large)  # noqa: E731
        wait_until(lambda: timed() == 1, timeout_s=10)
        assert count(samples(scrape(metrics)), "stratus_generation_first_token_seconds_count", **large) == 1
    finally:
        cluster.stop_all()


def ready_of(api: str) -> bool:
    """The router lists arith once its cloud link is up."""
    try:
        with urllib.request.urlopen(f"http://{api}/v1/models", timeout=2) as response:
            return "arith" in {m["id"] for m in json.loads(response.read())["data"]}
    except OSError:
        return False
