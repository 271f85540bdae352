"""The cloud gateway in front of real vLLM: the same text and log-probabilities as vLLM
gives directly, whole or streamed; vLLM's refusals and absence as Stratus statuses."""

from __future__ import annotations

import json
import math
import urllib.request
from typing import Any

import grpc
import numpy as np
import pytest

from stratus.convert import codec
from stratus.convert.parameters import Served, parameter_value, set_parameter
from stratus.families.generation import FINAL, FINISH_REASON, TOKEN_LOGPROBS, TOKEN_MARGINS
from stratus.serving.channels import open_sync_channel
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc
from tests.integration.cluster import wait_until
from tests.integration.vllm.direct import Gateway, Vllm, completion, completion_error

pytestmark = pytest.mark.vllm

PROMPTS = ["37+48=", "5+9="]
MAX_TOKENS = 4  # arith's own max_tokens: the gateway refuses more
# Far more tokens than the server's 512-token context, whatever the tokenizer merges.
TOO_LONG = "".join(f"{a}+{(a * 37) % 100}=" for a in range(100, 700))


def generation_request(
    model: str, prompt: str, *, max_tokens: int, stream: bool = False
) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, id=f"p-{prompt[:8]}")
    codec.encode_request_inputs(request, {"text_input": np.array([prompt.encode()], dtype=object)})
    set_parameter(request.parameters, "max_tokens", max_tokens)
    if stream:
        set_parameter(request.parameters, "stream", True)
    return request


def params(message: pb.ModelInferResponse) -> dict[str, Any]:
    return {key: parameter_value(value) for key, value in message.parameters.items()}


def text_of(message: pb.ModelInferResponse) -> str:
    return bytes(codec.decode_response_outputs(message)["text_output"][0]).decode()


def direct(vllm: Vllm, prompt: str) -> dict[str, Any]:
    choice: dict[str, Any] = completion(vllm.url, vllm.model, prompt, max_tokens=MAX_TOKENS)["choices"][0]
    return choice


def margins(choice: dict[str, Any]) -> list[float | None]:
    out: list[float | None] = []
    for top in choice["logprobs"]["top_logprobs"]:
        values = sorted(top.values(), reverse=True)
        out.append(math.exp(values[0]) - math.exp(values[1]) if len(values) > 1 else None)
    return out


def stream(address: str, request: pb.ModelInferRequest) -> list[pb.ModelStreamInferResponse]:
    with open_sync_channel(address) as channel:
        return list(pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter([request]), timeout=60))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_model_infer_gives_vllms_text_and_logprobs(vllm: Vllm, gateway: Gateway, prompt: str) -> None:
    expected = direct(vllm, prompt)
    with open_sync_channel(gateway.address) as channel:
        response = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            generation_request(vllm.family, prompt, max_tokens=MAX_TOKENS), timeout=60
        )
    assert text_of(response) == expected["text"]
    got = params(response)
    logprobs = expected["logprobs"]["token_logprobs"]
    assert json.loads(got[TOKEN_LOGPROBS]) == pytest.approx(logprobs, abs=1e-5)
    assert json.loads(got[TOKEN_MARGINS]) == pytest.approx(margins(expected), abs=1e-5)
    assert got[FINISH_REASON] == expected["finish_reason"]
    assert isinstance(got["stratus.queue"], int)
    served = Served.read(response.parameters)
    assert served.variant == vllm.model
    assert served.confidence == pytest.approx(math.exp(sum(logprobs) / len(logprobs)), abs=1e-4)


def test_model_stream_infer_streams_vllms_text_chunk_by_chunk(vllm: Vllm, gateway: Gateway) -> None:
    prompt = PROMPTS[0]
    expected = direct(vllm, prompt)
    messages = stream(
        gateway.address, generation_request(vllm.model, prompt, max_tokens=MAX_TOKENS, stream=True)
    )
    assert all(not m.error_message for m in messages), [m.error_message for m in messages]
    responses = [m.infer_response for m in messages]
    assert len(responses) > 1  # streamed, not answered whole
    assert [params(r).get(FINAL, False) for r in responses] == [False] * (len(responses) - 1) + [True]
    assert "".join(text_of(r) for r in responses) == expected["text"]
    logprobs = [lp for r in responses for lp in json.loads(params(r)[TOKEN_LOGPROBS])]
    assert logprobs == pytest.approx(expected["logprobs"]["token_logprobs"], abs=1e-5)
    assert params(responses[-1])[FINISH_REASON] == expected["finish_reason"]
    assert {r.id for r in responses} == {f"p-{prompt[:8]}"}


def with_settings(request: pb.ModelInferRequest, settings: dict[str, Any]) -> pb.ModelInferRequest:
    """The request with Triton's ``sampling_parameters`` input."""
    codec.encode_request_inputs(
        request, {"sampling_parameters": np.array([json.dumps(settings).encode()], dtype=object)}
    )
    return request


def test_usage_stop_and_sampling_reach_vllm_and_come_back_as_vllm_gives_them(
    vllm: Vllm, gateway: Gateway
) -> None:
    prompt = PROMPTS[0]
    plain = completion(vllm.url, vllm.model, prompt, max_tokens=MAX_TOKENS)
    text = plain["choices"][0]["text"]
    with open_sync_channel(gateway.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        def ask(settings: dict[str, Any]) -> pb.ModelInferResponse:
            request = generation_request(vllm.family, prompt, max_tokens=MAX_TOKENS)
            return stub.ModelInfer(with_settings(request, settings) if settings else request, timeout=60)

        whole = ask({})
        stop = text[1] if len(text) > 1 else text
        cut = ask({"stop": [stop]})
        seeded = {"temperature": 1.5, "seed": 3}
        drawn = [ask(seeded), ask(seeded)]
    counts = (plain["usage"]["prompt_tokens"], plain["usage"]["completion_tokens"])
    assert (params(whole)["stratus.prompt_tokens"], params(whole)["stratus.completion_tokens"]) == counts
    final = stream(
        gateway.address, generation_request(vllm.family, prompt, max_tokens=MAX_TOKENS, stream=True)
    )[-1]
    assert params(final.infer_response)["stratus.prompt_tokens"] == counts[0]  # the usage event's, streamed
    direct_cut = completion(vllm.url, vllm.model, prompt, max_tokens=MAX_TOKENS, stop=[stop])["choices"][0]
    assert text_of(cut) == direct_cut["text"] == text[: text.index(stop)]
    assert params(cut)[FINISH_REASON] == "stop"
    direct_draw = completion(vllm.url, vllm.model, prompt, max_tokens=MAX_TOKENS, **seeded)["choices"][0]
    assert [text_of(d) for d in drawn] == [direct_draw["text"]] * 2
    logprobs = json.loads(params(drawn[0])[TOKEN_LOGPROBS])
    assert logprobs == pytest.approx(direct_draw["logprobs"]["token_logprobs"], abs=1e-5)


def test_a_prompt_over_the_context_is_invalid_with_vllms_reason(vllm: Vllm, gateway: Gateway) -> None:
    status, reason = completion_error(vllm.url, vllm.model, TOO_LONG, max_tokens=MAX_TOKENS)
    assert status == 400
    with open_sync_channel(gateway.address) as channel, pytest.raises(grpc.RpcError) as caught:
        pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            generation_request(vllm.family, TOO_LONG, max_tokens=MAX_TOKENS), timeout=60
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason in str(caught.value.details())
    [message] = stream(
        gateway.address, generation_request(vllm.family, TOO_LONG, max_tokens=MAX_TOKENS, stream=True)
    )
    assert message.error_message.startswith("INVALID_ARGUMENT:") and reason in message.error_message


def test_the_gateway_exports_vllms_queue(vllm: Vllm, gateway: Gateway) -> None:
    with open_sync_channel(gateway.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ServerReady(pb.ServerReadyRequest(), timeout=5).ready
        assert stub.ModelReady(pb.ModelReadyRequest(name=vllm.family), timeout=5).ready
        index = stub.RepositoryIndex(pb.RepositoryIndexRequest(ready=True), timeout=5)
        metadata = stub.ModelMetadata(pb.ModelMetadataRequest(name=vllm.family), timeout=5)
    assert {vllm.family, vllm.model} <= {m.name for m in index.models}
    assert [(t.name, t.datatype) for t in metadata.inputs] == [("text_input", "BYTES")]
    with urllib.request.urlopen(gateway.metrics_url, timeout=5) as response:
        exported = response.read().decode()
    assert 'stratus_upstream_requests{state="waiting"}' in exported
    assert 'stratus_upstream_requests{state="running"}' in exported


def gateway_stops_serving(gateway: Gateway, vllm: Vllm) -> None:
    """Stop vLLM under a gateway that is ready: it turns not ready, and says UNAVAILABLE.
    Run by test_cascade_vllm's one test that stops vLLM (the session has one vLLM; a test
    that found it already stopped could not see it go)."""
    with open_sync_channel(gateway.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        wait_until(lambda: stub.ServerReady(pb.ServerReadyRequest(), timeout=5).ready, timeout_s=30.0)
        assert vllm.server.alive(), "vLLM was stopped before this test"
        vllm.server.stop()
        wait_until(lambda: not stub.ServerReady(pb.ServerReadyRequest(), timeout=5).ready, timeout_s=5.0)
        assert not stub.ModelReady(pb.ModelReadyRequest(name=vllm.family), timeout=5).ready
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(generation_request(vllm.family, PROMPTS[0], max_tokens=MAX_TOKENS), timeout=30)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    [message] = stream(
        gateway.address, generation_request(vllm.family, PROMPTS[0], max_tokens=2, stream=True)
    )
    assert message.error_message.startswith("UNAVAILABLE:")
