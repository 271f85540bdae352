"""What OpenAI clients rely on, through a real fleet serving arith on every tier (a device
agent on llama.cpp, an edge agent on OpenVINO GenAI, a cloud gateway generating itself):
``usage``, ``stop``, a list of prompts, and sampling, each honoured by whichever tier
answers; and the same settings over the Open Inference Protocol, as Triton's vLLM backend
takes them (request parameters, or a ``sampling_parameters`` input), honoured or refused.

Token counts are checked against the models' own tokenizer (llama.cpp's, read here from
the GGUF file), never copied from an answer; texts are compared one path against another."""

from __future__ import annotations

import json
import math
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import openai
import pytest

from stratus.convert import codec
from stratus.devtools.launcher import free_port
from stratus.serving.channels import open_sync_channel
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

from .cluster import MODELS, Cluster, ready_count, wait_until
from .test_llm import LLM_MODELS, oip_request

PROMPTS = ["37+48=", "12+5=", "90-45="]
# Where an answer comes from: each tier alone, and a climb through all three to the cloud.
ON: dict[str, dict[str, Any]] = {
    "device": {"max_tier": "device", "min_confidence": 0.0},
    "edge": {"min_tier": "edge", "max_tier": "edge", "min_confidence": 0.0},
    "cloud": {"min_tier": "cloud"},
}
CLIMB: dict[str, Any] = {"min_confidence": 1.0}


@dataclass
class Fleet:
    router: str
    openai_url: str

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.openai_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    cluster = Cluster(tmp_path_factory.mktemp("openai-fields") / "logs")
    try:
        cloud = cluster.cloud().address
        api = f"127.0.0.1:{free_port()}"
        router = cluster.router("--cloud", cloud, "--openai", api).address
        cluster.agent("device-1", router, *LLM_MODELS)
        cluster.agent("edge-1", router, *LLM_MODELS, tier="edge")
        wait_until(lambda: ready_count(router) == 2 and cloud_serves(api), timeout_s=90)
        yield Fleet(router=router, openai_url=f"http://{api}/v1")
    finally:
        cluster.stop_all()


def cloud_serves(api: str) -> bool:
    """The cloud answers arith (its link is up) when asked for it alone."""
    body = json.dumps({"model": "arith", "prompt": "1+1=", "max_tokens": 1, "stratus": {"min_tier": "cloud"}})
    request = urllib.request.Request(
        f"http://{api}/v1/completions", data=body.encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return bool(response.status == 200)
    except OSError:
        return False


Count = Callable[[str], int]


@pytest.fixture(scope="module")
def count() -> Iterator[Count]:
    """Tokens of a text by the arith models' own tokenizer."""
    import llama_cpp

    vocabulary = llama_cpp.Llama(
        str(MODELS / "arith" / "arith-large-fp16.gguf"), vocab_only=True, verbose=False
    )
    yield lambda text: len(vocabulary.tokenize(text.encode(), add_bos=False, special=False))
    vocabulary.close()


def counts(usage: Any) -> dict[str, int]:
    return {key: getattr(usage, key) for key in ("prompt_tokens", "completion_tokens", "total_tokens")}


def complete(fleet: Fleet, prompt: str | list[str], stratus: dict[str, Any], **fields: Any) -> Any:
    return fleet.client().completions.create(
        model="arith", prompt=prompt, max_tokens=4, extra_body={"stratus": stratus}, **fields
    )


def extra(answer: Any) -> dict[str, Any]:
    return dict((answer.model_extra or {})["stratus"])


def test_usage_is_the_answering_tiers_own_count_and_the_climb_is_in_the_stratus_object(
    fleet: Fleet, count: Count
) -> None:
    for prompt in PROMPTS:
        for tier, options in [*ON.items(), ("cloud", CLIMB)]:
            answer = complete(fleet, prompt, options)
            choice, usage = answer.choices[0], answer.usage
            assert extra(answer)["tier"] == tier
            ended = 1 if choice.finish_reason == "stop" else 0  # the end-of-text token, generated too
            assert (usage.prompt_tokens, usage.completion_tokens) == (
                count(prompt),
                count(choice.text) + ended,
            )
            assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        climbed = extra(answer)
        assert climbed["path"] == ["device", "edge", "cloud"]
        assert set(climbed["tokens"]) == {"device", "edge", "cloud"}  # what the whole climb cost
        assert climbed["tokens"]["cloud"] == usage.completion_tokens
    chat = fleet.client().chat.completions.create(
        model="arith", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=1
    )
    assert chat.usage is not None
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (count(PROMPTS[0]), 1)


def sse(fleet: Fleet, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The events of a streamed answer, as the server wrote them (before any SDK reads them)."""
    request = urllib.request.Request(
        f"{fleet.openai_url}/completions",
        data=json.dumps({"model": "arith", "max_tokens": 4, "stream": True, **body}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        lines = [line.decode().strip() for line in response]
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_include_usage_ends_a_stream_with_the_counts_and_nulls_them_before(
    fleet: Fleet, count: Count
) -> None:
    for options in (ON["device"], CLIMB):
        whole = complete(fleet, PROMPTS[0], options)
        events = sse(
            fleet, {"prompt": PROMPTS[0], "stream_options": {"include_usage": True}, "stratus": options}
        )
        *chunks, last = events
        assert all("usage" in c and c["usage"] is None for c in chunks)
        assert last["choices"] == [] and last["usage"] == counts(whole.usage)
        assert "".join(c["choices"][0]["text"] for c in chunks) == whole.choices[0].text
        plain = sse(fleet, {"prompt": PROMPTS[0], "stratus": options})
        assert all("usage" not in c for c in plain) and all(c["choices"] for c in plain)
    streamed = fleet.client().completions.create(
        model="arith", prompt=PROMPTS[1], max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    final = list(streamed)[-1]
    assert final.usage is not None and final.usage.prompt_tokens == count(PROMPTS[1])


def test_stop_ends_the_answer_at_its_first_occurrence_whole_and_streamed_on_every_tier(
    fleet: Fleet, count: Count
) -> None:
    client = fleet.client()
    for tier, options in ON.items():
        full = complete(fleet, "37+48=", options, logprobs=1)
        text = full.choices[0].text
        assert len(text) == 2, (tier, text)  # "85" (or what this tier answers): two tokens
        for stop, kept in ((text[1], text[0]), (["x", text], ""), ("9", text)):
            whole = complete(fleet, "37+48=", options, logprobs=1, stop=stop)
            choice = whole.choices[0]
            assert (choice.text, choice.finish_reason) == (kept, "stop"), (tier, stop)
            streamed = list(complete(fleet, "37+48=", options, stop=stop, stream=True))
            assert "".join(c.choices[0].text for c in streamed) == kept
            assert streamed[-1].choices[0].finish_reason == "stop"
            # judged on the tokens kept: the first token's, as the full answer scored it
            logprobs = choice.logprobs.token_logprobs
            assert logprobs == pytest.approx(
                full.choices[0].logprobs.token_logprobs[: len(logprobs)], abs=1e-6
            )
            confidence = math.exp(sum(logprobs) / len(logprobs)) if logprobs else 0.0
            assert extra(whole)["confidence"] == pytest.approx(confidence, abs=1e-5)
        cut = complete(fleet, "37+48=", options, stop=text[1])
        assert cut.usage.completion_tokens == count(text)  # the stop's token was generated, then cut
    chat = client.chat.completions.create(
        model="arith", messages=[{"role": "user", "content": "37+48="}], max_tokens=4, stop=["5"],
        extra_body={"stratus": ON["device"]},
    )  # fmt: skip
    assert (
        chat.choices[0].message.content == complete(fleet, "37+48=", ON["device"], stop="5").choices[0].text
    )


def test_a_list_of_prompts_gets_one_choice_each_climbing_on_its_own(fleet: Fleet, count: Count) -> None:
    alone = [complete(fleet, p, {}) for p in PROMPTS]
    listed = complete(fleet, PROMPTS, {})
    assert [c.index for c in listed.choices] == [0, 1, 2]
    assert [c.text for c in listed.choices] == [a.choices[0].text for a in alone]
    served = [dict((c.model_extra or {})["stratus"]) for c in listed.choices]
    assert [(s["tier"], s["path"]) for s in served] == [(extra(a)["tier"], extra(a)["path"]) for a in alone]
    assert listed.usage.prompt_tokens == sum(count(p) for p in PROMPTS)
    assert listed.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    events = sse(fleet, {"prompt": PROMPTS, "stream_options": {"include_usage": True}})
    texts = [
        "".join(c["choices"][0]["text"] for c in events[:-1] if c["choices"][0]["index"] == i)
        for i in range(3)
    ]
    assert texts == [a.choices[0].text for a in alone]
    closings = [c["choices"][0] for c in events[:-1] if c["choices"][0]["finish_reason"] is not None]
    assert sorted(c["index"] for c in closings) == [0, 1, 2] and all("stratus" in c for c in closings)
    assert events[-1]["usage"] == counts(listed.usage)
    for prompt, words in (
        ([1, 2, 3], "token-id prompts"),
        ([[1, 2]], "token-id prompts"),
        ([], "non-empty list"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            complete(fleet, prompt, {})  # type: ignore[arg-type]
        assert refused.value.body["param"] == "prompt" and words in refused.value.body["message"]  # type: ignore[index]


def test_n_choices_per_prompt_each_generated_on_its_own_and_counted_once(fleet: Fleet, count: Count) -> None:
    """``n`` choices of each prompt, numbered prompt by prompt (OpenAI's order). Greedy ones
    are alike; sampled from a seed they differ from one another and repeat as a whole; the
    prompt's tokens count once. Streamed, each choice has its own index and closing chunk."""
    greedy = complete(fleet, PROMPTS[:2], ON["device"], n=2)
    assert [c.index for c in greedy.choices] == [0, 1, 2, 3]
    alone = [complete(fleet, p, ON["device"]).choices[0].text for p in PROMPTS[:2]]
    assert [c.text for c in greedy.choices] == [alone[0], alone[0], alone[1], alone[1]]
    assert greedy.usage.prompt_tokens == count(PROMPTS[0]) + count(PROMPTS[1])
    sampled = {"temperature": 2.0, "top_p": 1.0, "seed": 11}
    drawn = complete(fleet, "zz", ON["device"], n=4, **sampled)
    again = complete(fleet, "zz", ON["device"], n=4, **sampled)
    texts = [c.text for c in drawn.choices]
    assert texts == [c.text for c in again.choices]  # each choice from its own seed: repeatable
    assert len(set(texts)) > 1, texts  # and not all one draw
    assert drawn.usage.prompt_tokens == count("zz")
    events = sse(fleet, {"prompt": PROMPTS[0], "n": 2, "stratus": ON["device"]})
    closings = [c["choices"][0] for c in events if c["choices"][0]["finish_reason"] is not None]
    assert sorted(c["index"] for c in closings) == [0, 1]
    for n, words in ((0, "at least 1"), (33, "at most 32")):
        with pytest.raises(openai.BadRequestError) as refused:
            complete(fleet, PROMPTS[0], {}, n=n)
        assert refused.value.body["param"] == "n" and words in refused.value.body["message"]  # type: ignore[index]


def test_sampling_is_honoured_by_every_tier_reproducibly_from_a_seed(fleet: Fleet) -> None:
    for tier, options in ON.items():
        greedy = complete(fleet, "zz", options).choices[0].text

        def sampled(seed: int, options: dict[str, Any] = options, **fields: Any) -> Any:
            return complete(fleet, "zz", options, temperature=2.0, seed=seed, logprobs=1, **fields)

        draws = {seed: sampled(seed) for seed in range(6)}
        texts = {seed: d.choices[0].text for seed, d in draws.items()}
        assert sampled(0).choices[0].text == texts[0] and sampled(1).choices[0].text == texts[1], tier
        assert len(set(texts.values())) > 1, (tier, texts)  # the seed changes the draw
        differing = [seed for seed, text in texts.items() if text != greedy]
        assert differing, (tier, texts)
        for seed in differing[:2]:  # the same draw, but only the top token is left to draw from
            assert sampled(seed, top_p=1e-6).choices[0].text == greedy
        for draw in draws.values():  # the confidence is of the sampled tokens' own log-probabilities
            logprobs = draw.choices[0].logprobs.token_logprobs
            assert extra(draw)["confidence"] == pytest.approx(
                math.exp(sum(logprobs) / len(logprobs)), abs=1e-5
            )
            assert extra(draw)["tier"] == tier


def infer(fleet: Fleet, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
    with open_sync_channel(fleet.router) as channel:
        return pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)


def with_sampling(prompt: str, settings: dict[str, Any], **parameters: Any) -> pb.ModelInferRequest:
    """A request as Triton's vLLM backend takes one: the prompt, and its settings as JSON."""
    request = oip_request(prompt, **parameters)
    codec.encode_request_inputs(
        request, {"sampling_parameters": np.array([json.dumps(settings).encode()], dtype=object)}
    )
    return request


def text_of(response: pb.ModelInferResponse) -> str:
    return str(codec.decode_response_outputs(response)["text_output"][0].decode())


def test_the_open_inference_protocol_honours_tritons_sampling_parameters(fleet: Fleet, count: Count) -> None:
    import tritonclient.grpc as triton

    device: dict[str, Any] = {"stratus.max_tier": "device", "stratus.min_confidence": 0.0}
    cut = infer(fleet, with_sampling("37+48=", {"stop": ["5"], "max_tokens": 4}, **device))
    assert text_of(cut) == complete(fleet, "37+48=", ON["device"], stop="5").choices[0].text
    assert cut.parameters["stratus.finish_reason"].string_param == "stop"
    as_parameter = infer(fleet, oip_request("37+48=", stop="5", **device))
    assert text_of(as_parameter) == text_of(cut)
    seeded = {"temperature": 2.0, "seed": 4, "max_tokens": 4}
    drawn = complete(fleet, "zz", ON["device"], temperature=2.0, seed=4).choices[0].text
    assert text_of(infer(fleet, with_sampling("zz", seeded, **device))) == drawn
    assert text_of(infer(fleet, oip_request("zz", temperature=2.0, seed=4, max_tokens=4, **device))) == drawn
    whole = infer(fleet, oip_request("37+48=", **device))
    assert whole.parameters["stratus.prompt_tokens"].int64_param == count("37+48=")
    assert whole.parameters["stratus.completion_tokens"].int64_param == count(text_of(whole)) + 1
    streamed = oip_request("37+48=", **device)  # stream as Triton's BOOL input, sent raw as tritonclient does
    codec.encode_request_inputs(
        streamed, {"stream": np.array([True]), "exclude_input_in_output": np.array([True])}
    )
    with open_sync_channel(fleet.router) as channel:
        chunks = list(
            pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter([streamed]), timeout=30)
        )
    assert len(chunks) > 1 and chunks[-1].infer_response.parameters["triton_final_response"].bool_param
    assert "".join(text_of(c.infer_response) for c in chunks) == text_of(whole)
    client = triton.InferenceServerClient(fleet.router)  # tritonclient, as against Triton
    prompt = triton.InferInput("text_input", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([b"37+48="], dtype=object))
    settings = triton.InferInput("sampling_parameters", [1], "BYTES")
    settings.set_data_from_numpy(np.array([json.dumps({"stop": ["5"]}).encode()], dtype=object))
    result = client.infer("arith", [prompt, settings], parameters=device)
    assert result.as_numpy("text_output")[0].decode() == text_of(cut)


def test_the_open_inference_protocol_refuses_what_it_does_not_honour_by_name(fleet: Fleet) -> None:
    echoing = oip_request("1+1=")  # Triton's default off the stream: the prompt before the answer
    codec.encode_request_inputs(echoing, {"exclude_input_in_output": np.array([False])})
    refused = [
        (with_sampling("1+1=", {"top_k": 5}), "'top_k' is not supported"),
        (with_sampling("1+1=", {"speed": "fast"}), "'speed' is not a sampling parameter"),
        (with_sampling("1+1=", {"stop": "5"}, stop="6"), "'stop' is given twice"),
        (with_sampling("1+1=", {"temperature": 9}), "'temperature' must be a number from 0 to 2"),
        (oip_request("1+1=", repetition_penalty=1.2), "'repetition_penalty' is not supported"),
        (oip_request("1+1=", seed=1.5), "'seed' must be an int64"),
        (echoing, "'exclude_input_in_output' false is not supported"),
        (oip_request(""), "'text_input' is empty: a generation needs a prompt"),  # not a runtime's assertion
    ]
    with open_sync_channel(fleet.router) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for request, words in refused:
            with pytest.raises(grpc.RpcError) as error:
                stub.ModelInfer(request, timeout=30)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in str(
                error.value.details()
            )
            set_stream = oip_request("1+1=", stream=True)
            request.parameters["stream"].CopyFrom(set_stream.parameters["stream"])
            streamed = list(stub.ModelStreamInfer(iter([request]), timeout=30))
            assert len(streamed) == 1 and words in streamed[0].error_message
        assert text_of(stub.ModelInfer(oip_request("1+1=", max_tokens=4), timeout=30))  # still answering
