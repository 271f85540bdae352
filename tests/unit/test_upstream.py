"""The cloud gateway's OpenAI-compatible upstream client and the data plane in front of it.

The server here is a test double written with aiohttp: it answers with the response shapes
and error codes vLLM's OpenAI API uses (checked against real vLLM by the integration tests
in tests/integration/vllm), so that parsing and every error mapping are tested quickly.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from cloud_gateway.generative import QUEUE, GenerativeModel, UpstreamDataPlane
from cloud_gateway.openai_wire import (
    SseDecoder,
    UpstreamLoad,
    chunk_from_choice,
    error_message,
    margin,
    parse_metrics,
    token_texts,
)
from cloud_gateway.upstream import OpenAIUpstream, UpstreamSettings, served_model
from stratus.convert import codec
from stratus.convert.inference import InferRequest, InferResult
from stratus.convert.parameters import Served, parameter_value, set_parameter
from stratus.errors import (
    ConfigError,
    DeadlineExceeded,
    InvalidInput,
    NotFound,
    Overloaded,
    StratusError,
    Unavailable,
)
from stratus.families.generation import (
    FINAL,
    FINISH_REASON,
    TOKEN_LOGPROBS,
    TOKEN_MARGINS,
    Chunk,
    GenerationParams,
    Token,
)
from stratus.obs.metrics import Metrics, ModelMetrics
from stratus.serving.servicer import DataPlane
from stratus.wire import inference_pb2 as pb

from .wired import Wired

# --- canned vLLM answers ------------------------------------------------------------------------

TOKENS = ["8", "5", "\n"]
LOGPROBS = [-0.1, -0.2, -0.05]
TOPS = [{"8": -0.1, "7": -2.5}, {"5": -0.2, "6": -1.8}, {"\n": -0.05, " ": -3.0}]


def completion(text: str = "85\n", finish: str = "stop") -> dict[str, Any]:
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "model": "arith-large",
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": {
                    "tokens": TOKENS,
                    "token_logprobs": LOGPROBS,
                    "top_logprobs": TOPS,
                    "text_offset": [0, 1, 2],
                },
                "finish_reason": finish,
            }
        ],
    }


def events() -> list[dict[str, Any]]:
    """vLLM streams one token per event; the last carries the finish reason."""
    out = []
    for i, token in enumerate(TOKENS):
        choice = {
            "index": 0,
            "text": token,
            "logprobs": {
                "tokens": [token],
                "token_logprobs": [LOGPROBS[i]],
                "top_logprobs": [TOPS[i]],
                "text_offset": [i],
            },
            "finish_reason": "length" if i == len(TOKENS) - 1 else None,
        }
        out.append({"id": "cmpl-1", "object": "text_completion", "choices": [choice]})
    return out


METRICS = """# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="arith-large"} 3.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="arith-large"} 2.0
vllm:num_requests_running_total 99.0
"""


@dataclass
class Fake:
    """What the fake server answers; tests change it between calls."""

    health: int = 200
    metrics: str = METRICS
    status: int = 200
    body: Any = field(default_factory=completion)
    stream: list[str] = field(default_factory=lambda: [*(json.dumps(e) for e in events()), "[DONE]"])
    delay_s: float = 0.0
    reset: bool = False
    received: list[dict[str, Any]] = field(default_factory=list)
    cancelled: int = 0  # handlers ended because their client went away

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "arith-large", "object": "model"}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.reset:
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        if self.status != 200:
            return web.json_response(self.body, status=self.status)
        if not body.get("stream"):
            return web.json_response(self.body)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for data in self.stream:
            await response.write(f"data: {data}\n\n".encode())
        return response


@asynccontextmanager
async def serving(fake: Fake) -> AsyncIterator[str]:
    runner = web.AppRunner(fake.app(), handler_cancellation=True)  # a client that gives up ends its handler
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def client(fake: Fake, **settings: Any) -> AsyncIterator[OpenAIUpstream]:
    async with serving(fake) as url:
        upstream = OpenAIUpstream(UpstreamSettings(url=url, model="arith-large", **settings))
        await upstream.start()
        try:
            yield upstream
        finally:
            await upstream.close()


def run(scenario: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    return asyncio.run(scenario())


PARAMS = GenerationParams(max_tokens=3, stop=("\n\n",))

# --- pure parts ---------------------------------------------------------------------------------


def test_margin_is_top1_minus_top2_in_probability() -> None:
    assert margin({"8": -0.1, "7": -2.5}) == pytest.approx(math.exp(-0.1) - math.exp(-2.5))
    assert margin({"7": -2.5, "8": -0.1, "x": -9.0}) == pytest.approx(math.exp(-0.1) - math.exp(-2.5))
    assert margin({"8": -0.1}) is None  # two ids that decode alike collapse into one key
    assert margin(None) is None


def test_token_texts_always_join_back_into_the_text() -> None:
    assert token_texts("85\n", ["8", "5", "\n"], [0, 1, 2], 3) == ["8", "5", "\n"]
    # vLLM: a special token is in the tokens, not in the text, and its offsets count it
    special = token_texts("664107", ["66", "<s>", "41", "07"], [0, 2, 5, 7], 4)
    assert special == ["66", "", "41", "07"]
    # a character whose bytes are split over two tokens: cut at the offsets
    assert token_texts("é!", ["bytes:\\xc3", "bytes:\\xa9", "!"], [0, 0, 1], 3) == ["", "é", "!"]
    assert token_texts("85", ["x", "y"], [17, 18], 2) == ["8", "5"]  # offsets that count the prompt
    assert token_texts("85", ["8", "5", "\n"], [0, 1, 2], 3) == ["8", "5", ""]  # a stop string cut
    assert token_texts("85", [], [], 2) == ["85", ""]  # nothing to go by: the first holds the text
    assert token_texts("", [], [], 0) == []


def test_a_choice_becomes_a_chunk_with_logprobs_and_margins() -> None:
    chunk = chunk_from_choice(completion()["choices"][0])
    assert chunk.text == "85\n"
    assert [t.logprob for t in chunk.tokens] == LOGPROBS
    assert chunk.tokens[0].margin == pytest.approx(math.exp(-0.1) - math.exp(-2.5))
    assert chunk.finish_reason == "stop"
    assert chunk_from_choice({"text": "", "finish_reason": None}) == Chunk(tokens=())
    assert chunk_from_choice({"text": "hi", "logprobs": None}).tokens == (Token(text="hi", logprob=0.0),)


def test_metrics_are_read_with_or_without_labels_and_summed_over_engines() -> None:
    assert parse_metrics(METRICS) == UpstreamLoad(waiting=3, running=2)
    plain = "vllm:num_requests_waiting 4\nvllm:num_requests_running 1.0 1700000000000\n"
    assert parse_metrics(plain) == UpstreamLoad(waiting=4, running=1)
    engines = 'vllm:num_requests_running{engine="0"} 1\nvllm:num_requests_running{engine="1"} 2\n'
    assert parse_metrics(engines).queue == 3
    assert parse_metrics("vllm:num_requests_waiting NaN\ngarbage{\n") == UpstreamLoad()
    assert parse_metrics("") == UpstreamLoad()


def test_sse_events_are_decoded_line_by_line() -> None:
    decoder = SseDecoder()
    lines = [
        ": keep-alive\n",
        'data: {"a":\n',
        "data: 1}\r\n",
        "\r\n",
        "event: x\n",
        "\n",
        "data:[DONE]\n",
        "\n",
    ]
    assert [d for line in lines if (d := decoder.feed(line)) is not None] == ['{"a":\n1}', "[DONE]"]


def test_error_bodies_give_the_servers_own_message() -> None:
    openai = {"error": {"message": "maximum context length is 512", "type": "BadRequestError", "code": 400}}
    assert error_message(json.dumps(openai).encode()) == "maximum context length is 512"
    assert error_message(json.dumps({"object": "error", "message": "old style", "code": 400})) == "old style"
    assert error_message(b"Internal Server Error") == "Internal Server Error"
    assert error_message(b"") == "(no message)"


def test_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="http"):
        UpstreamSettings(url="127.0.0.1:8000", model="m")
    assert UpstreamSettings(url="http://h:1/v1/", model="m").base == "http://h:1"


# --- against the fake server --------------------------------------------------------------------


def test_a_whole_completion_is_asked_greedily_with_top2_logprobs_and_stops_kept_in_the_text() -> None:
    fake = Fake()

    async def scenario() -> Chunk:
        async with client(fake) as upstream:
            return await upstream.complete("37+48=", PARAMS, timeout_s=5.0)

    chunk = run(scenario)
    assert chunk.text == "85\n" and chunk.finish_reason == "stop"
    assert [t.text for t in chunk.tokens] == TOKENS
    sent = fake.received[0]
    assert sent == {
        "model": "arith-large",
        "prompt": "37+48=",
        "max_tokens": 3,
        "temperature": 0.0,
        "logprobs": 2,
        "stream": False,
        "stop": ["\n\n"],
        "include_stop_str_in_output": True,  # the gateway cuts it, tokens and all
    }
    assert (chunk.prompt_tokens, chunk.completion_tokens) == (None, None)  # this answer has no usage


def test_sampling_settings_and_the_usage_travel_to_and_from_the_upstream() -> None:
    fake = Fake(
        body={**completion(), "usage": {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9}}
    )
    sampled = GenerationParams(max_tokens=3, temperature=0.7, top_p=0.9, seed=11)

    async def scenario() -> tuple[Chunk, list[Chunk]]:
        async with client(fake) as upstream:
            whole = await upstream.complete("37+48=", sampled, timeout_s=5.0)
            return whole, [c async for c in upstream.stream("37+48=", sampled, timeout_s=5.0)]

    usage = json.dumps({"id": "c", "choices": [], "usage": {"prompt_tokens": 6, "completion_tokens": 3}})
    fake.stream = [*(json.dumps(e) for e in events()), usage, "[DONE]"]
    whole, streamed = run(scenario)
    asked, streaming = fake.received
    assert {k: asked[k] for k in ("temperature", "top_p", "seed")} == {
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 11,
    }
    assert "stop" not in asked and "stream_options" not in asked
    assert streaming["stream_options"] == {"include_usage": True}
    assert (whole.prompt_tokens, whole.completion_tokens) == (6, 3)
    # the final chunk waits for the usage event that follows it, and carries its counts
    assert [(c.text, c.finish_reason, c.prompt_tokens) for c in streamed] == [
        ("8", None, None),
        ("5", None, None),
        ("\n", "length", 6),
    ]


def test_a_streamed_completion_yields_chunks_until_the_finish_reason() -> None:
    fake = Fake()

    async def scenario() -> list[Chunk]:
        async with client(fake) as upstream:
            chunks = [c async for c in upstream.stream("37+48=", PARAMS, timeout_s=5.0)]
            assert upstream.latency.count == 1
            return chunks

    chunks = run(scenario)
    assert [c.text for c in chunks] == TOKENS
    assert [c.finish_reason for c in chunks] == [None, None, "length"]
    assert [t.logprob for c in chunks for t in c.tokens] == LOGPROBS
    assert fake.received[0]["stream"] is True


def test_a_stream_that_ends_without_its_final_event_is_unavailable() -> None:
    fake = Fake(stream=[json.dumps(events()[0])])

    async def scenario() -> None:
        async with client(fake) as upstream:
            async for _ in upstream.stream("x", PARAMS, timeout_s=5.0):
                pass

    with pytest.raises(Unavailable, match="before its final event"):
        run(scenario)


def test_done_without_a_finish_reason_still_ends_with_a_final_chunk() -> None:
    usage = json.dumps({"id": "c", "choices": [], "usage": {"completion_tokens": 1}})
    fake = Fake(stream=[json.dumps(events()[0]), usage, "[DONE]"])

    async def scenario() -> list[Chunk]:
        async with client(fake) as upstream:
            return [c async for c in upstream.stream("x", PARAMS, timeout_s=5.0)]

    chunks = run(scenario)
    assert [(c.text, c.finish_reason) for c in chunks] == [("8", None), ("", "stop")]
    assert chunks[-1].completion_tokens == 1  # the usage seen, whatever came first


def test_events_after_the_final_one_are_read_but_not_yielded() -> None:
    usage = json.dumps({"id": "c", "choices": [], "usage": {"completion_tokens": 3}})
    late = json.dumps(events()[0])
    fake = Fake(stream=[*(json.dumps(e) for e in events()), usage, late, "[DONE]"])

    async def scenario() -> list[Chunk]:
        async with client(fake) as upstream:
            return [c async for c in upstream.stream("x", PARAMS, timeout_s=5.0)]

    assert [c.text for c in run(scenario)] == TOKENS


def test_an_error_event_in_the_middle_of_a_stream_is_raised_as_its_status() -> None:
    error = {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}
    fake = Fake(stream=[json.dumps(events()[0]), json.dumps(error)])

    async def scenario() -> list[str]:
        seen = []
        async with client(fake) as upstream:
            async for chunk in upstream.stream("x", PARAMS, timeout_s=5.0):
                seen.append(chunk.text)
        return seen

    with pytest.raises(Unavailable, match="engine died"):
        run(scenario)


@pytest.mark.parametrize(
    ("status", "kind"),
    [(400, InvalidInput), (404, NotFound), (429, Overloaded), (503, Overloaded), (500, Unavailable)],
)
@pytest.mark.parametrize("stream", [False, True])
def test_http_errors_carry_vllms_reason(status: int, kind: type[StratusError], stream: bool) -> None:
    reason = "This model's maximum context length is 512 tokens. However, you requested 900 tokens."
    fake = Fake(status=status, body={"error": {"message": reason, "type": "BadRequestError", "code": status}})

    async def scenario() -> None:
        async with client(fake) as upstream:
            if stream:
                async for _ in upstream.stream("x", PARAMS, timeout_s=5.0):
                    pass
            else:
                await upstream.complete("x", PARAMS, timeout_s=5.0)

    with pytest.raises(kind) as caught:
        run(scenario)
    assert reason in str(caught.value)


def test_a_slow_answer_is_deadline_exceeded() -> None:
    fake = Fake(delay_s=2.0)

    async def scenario() -> None:
        async with client(fake) as upstream:
            await upstream.complete("x", PARAMS, timeout_s=0.2)

    with pytest.raises(DeadlineExceeded):
        run(scenario)


def test_a_request_without_a_deadline_gets_the_settings_timeout() -> None:
    fake = Fake(delay_s=2.0)

    async def scenario() -> None:
        async with client(fake, timeout_s=0.2) as upstream:
            async for _ in upstream.stream("x", PARAMS, timeout_s=None):
                pass

    with pytest.raises(DeadlineExceeded):
        run(scenario)


def test_a_cancelled_caller_leaves_nothing_behind() -> None:
    fake = Fake(delay_s=5.0)

    async def scenario() -> None:
        async with client(fake) as upstream:
            task = asyncio.create_task(anext(aiter(upstream.stream("x", PARAMS, timeout_s=None))))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(100):  # the server sees the connection go, and ends the handler
                if fake.cancelled:
                    break
                await asyncio.sleep(0.02)
            assert fake.cancelled == 1, "the request went on upstream after its caller gave up"
            connector = upstream.session.connector
            assert connector is not None and not connector._acquired, "a connection is still held"
            assert upstream.healthy

    run(scenario)


def test_a_reset_connection_is_unavailable() -> None:
    fake = Fake(reset=True)

    async def scenario() -> None:
        async with client(fake) as upstream:
            await upstream.complete("x", PARAMS, timeout_s=5.0)

    with pytest.raises(Unavailable):
        run(scenario)


def test_a_refused_connection_is_unavailable_and_unhealthy_at_once() -> None:
    async def scenario() -> OpenAIUpstream:
        async with serving(Fake()) as url:
            upstream = OpenAIUpstream(UpstreamSettings(url=url, model="m", poll_interval_s=60.0))
            await upstream.start()
        assert upstream.healthy  # it was, when it started
        try:
            with pytest.raises(Unavailable, match="unreachable"):
                await upstream.complete("x", PARAMS, timeout_s=5.0)
            assert not upstream.healthy  # without waiting for the next poll
            await upstream.poll()
            assert not upstream.healthy and upstream.load == UpstreamLoad()
        finally:
            await upstream.close()
        return upstream

    run(scenario)


def test_health_and_load_are_polled() -> None:
    fake = Fake()

    async def scenario() -> None:
        async with client(fake, poll_interval_s=0.05) as upstream:
            assert upstream.healthy and upstream.load == UpstreamLoad(waiting=3, running=2)
            fake.health, fake.metrics = 503, "vllm:num_requests_waiting 7\n"
            await asyncio.sleep(0.3)
            assert not upstream.healthy
            fake.health = 200
            await asyncio.sleep(0.3)
            assert upstream.healthy and upstream.load == UpstreamLoad(waiting=7, running=0)

    run(scenario)


def test_the_served_model_is_the_first_listed() -> None:
    async def scenario() -> str:
        async with serving(Fake()) as url:
            return await served_model(url + "/v1")

    assert run(scenario) == "arith-large"


# --- the gateway's data plane over it -----------------------------------------------------------


class Local(DataPlane):
    """The gateway's local models, as far as delegation needs them."""

    def ready(self) -> bool:
        return True

    def model_ready(self, name: str) -> bool:
        return name == "digits"

    def model_metadata(self, name: str) -> pb.ModelMetadataResponse:
        if name != "digits":
            raise NotFound(name)
        return pb.ModelMetadataResponse(name=name, platform="onnxruntime")

    def model_config(self, name: str) -> pb.ModelConfig:
        return pb.ModelConfig(name=name)

    def model_names(self) -> list[str]:
        return ["digits", "digits-large"]

    async def infer(self, request: InferRequest, *, timeout_s: float | None) -> InferResult:
        return InferResult(model_name=request.model_name, id="local", outputs={})


def prompt_request(prompt: str = "37+48=", model: str = "arith", **parameters: Any) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, id="r1")
    codec.encode_request_inputs(request, {"text_input": np.array([prompt.encode()], dtype=object)})
    for key, value in parameters.items():
        set_parameter(request.parameters, key, value)
    return request


def params(message: pb.ModelInferResponse) -> dict[str, Any]:
    return {key: parameter_value(value) for key, value in message.parameters.items()}


def text_of(message: pb.ModelInferResponse) -> str:
    return bytes(codec.decode_response_outputs(message)["text_output"][0]).decode()


@asynccontextmanager
async def plane(fake: Fake, recorder: ModelMetrics | None = None) -> AsyncIterator[Any]:
    """The gateway's plane, driven with protobuf as its servicer drives it."""
    async with client(fake) as upstream:
        model = GenerativeModel(family="arith", variant="arith-large", max_tokens=5)
        yield Wired(UpstreamDataPlane(upstream, model, local=Local(), name="cloud-test", recorder=recorder))


def test_infer_answers_the_whole_text_with_confidence_logprobs_and_queue() -> None:
    fake = Fake()

    async def scenario() -> pb.ModelInferResponse:
        async with plane(fake) as gateway:
            return await gateway.infer(prompt_request(max_tokens=3), timeout_s=5.0)

    response = run(scenario)
    assert response.id == "r1" and response.model_name == "arith"
    assert text_of(response) == "85\n"
    got = params(response)
    assert json.loads(got[TOKEN_LOGPROBS]) == LOGPROBS
    assert got[FINISH_REASON] == "stop"
    assert got[QUEUE] == 5
    served = Served.read(response.parameters)
    assert served.confidence == pytest.approx(math.exp(sum(LOGPROBS) / 3))
    assert served.variant == "arith-large" and served.agent == "cloud-test"
    assert fake.received[0]["max_tokens"] == 3


def test_generate_streams_one_response_per_chunk_the_last_final() -> None:
    fake = Fake()

    async def scenario() -> list[pb.ModelInferResponse]:
        async with plane(fake) as gateway:
            return [r async for r in gateway.generate(prompt_request(model="arith-large"), timeout_s=None)]

    responses = run(scenario)
    assert "".join(text_of(r) for r in responses) == "85\n"
    finals = [params(r).get(FINAL, False) for r in responses]
    assert finals == [False, False, True]
    last = params(responses[-1])
    assert last[FINISH_REASON] == "length" and last[QUEUE] == 5
    assert all(r.id == "r1" for r in responses)
    first_margin = json.loads(params(responses[0])[TOKEN_MARGINS])[0]
    assert first_margin == pytest.approx(math.exp(-0.1) - math.exp(-2.5), abs=1e-6)
    assert Served.read(responses[-1].parameters).confidence == pytest.approx(math.exp(sum(LOGPROBS) / 3))
    assert fake.received[0]["max_tokens"] == 5  # the family's default


@pytest.mark.parametrize(
    ("request_", "match"),
    [
        (pb.ModelInferRequest(model_name="arith"), "takes the input 'text_input'"),
        (
            prompt_request(max_tokens=1.5),
            "'max_tokens' must be an integer between 1 and 5 for 'arith', not 1.5",
        ),
        (prompt_request(max_tokens=0), "'max_tokens' must be an integer between 1 and 5"),
        (prompt_request(temperature=9.0), "'temperature' must be a number from 0 to 2"),
        (prompt_request(top_k=5), "'top_k' is not supported"),
    ],
)
def test_bad_generative_requests_are_refused_before_the_upstream_is_asked(
    request_: pb.ModelInferRequest, match: str
) -> None:
    fake = Fake()

    async def scenario() -> None:
        async with plane(fake) as gateway:
            with pytest.raises(InvalidInput, match=match):
                await gateway.infer(request_, timeout_s=5.0)
            with pytest.raises(InvalidInput, match=match):
                gateway.generate(request_, timeout_s=None)

    run(scenario)
    assert fake.received == []


def test_other_models_go_to_the_local_plane_and_everything_is_listed() -> None:
    async def scenario() -> None:
        async with plane(Fake()) as gateway:
            assert (
                await gateway.infer(pb.ModelInferRequest(model_name="digits"), timeout_s=1.0)
            ).id == "local"
            assert gateway.model_names() == ["arith", "arith-large", "digits", "digits-large"]
            assert gateway.model_ready("arith") and gateway.model_ready("digits")
            assert gateway.model_metadata("digits").platform == "onnxruntime"
            meta = gateway.model_metadata("arith")
            assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
                ("text_input", "BYTES", [1])
            ]
            assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == [
                ("text_output", "BYTES", [-1])
            ]
            with pytest.raises(InvalidInput, match="does not generate"):
                gateway.generate(pb.ModelInferRequest(model_name="digits"), timeout_s=None)
            [family] = gateway.levels()
            assert {s.labels["state"]: s.value for s in family.samples} == {"waiting": 3, "running": 2}

    run(scenario)


def test_readiness_follows_the_upstreams_health() -> None:
    fake = Fake(health=503)

    async def scenario() -> None:
        async with plane(fake) as gateway:
            assert not gateway.ready() and not gateway.model_ready("arith")
            assert gateway.model_ready("digits")
            fake.health = 200
            await gateway.upstream.poll()
            assert gateway.ready() and gateway.model_ready("arith")

    run(scenario)


def test_an_answer_past_the_body_cap_is_unavailable_not_held(monkeypatch: pytest.MonkeyPatch) -> None:
    from cloud_gateway import upstream as upstream_module

    monkeypatch.setattr(upstream_module, "MAX_BODY_BYTES", 4096)
    fake = Fake(body={**completion(), "padding": "x" * 10_000})

    async def scenario() -> None:
        async with client(fake) as upstream:
            await upstream.complete("37+48=", PARAMS, timeout_s=5.0)

    with pytest.raises(Unavailable, match="answered more than 4096 bytes"):
        run(scenario)


def test_an_event_that_never_ends_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    from cloud_gateway import openai_wire

    monkeypatch.setattr(openai_wire, "MAX_EVENT_BYTES", 1000)
    decoder = openai_wire.SseDecoder()
    with pytest.raises(Unavailable, match="an event of more than 1000 bytes"):
        for _ in range(100):
            decoder.feed("data: " + "x" * 50)
    assert openai_wire.SseDecoder().feed("data: " + "x" * 50) is None  # one line is fine


def test_a_stream_with_more_tokens_than_asked_is_unavailable() -> None:
    many = [json.dumps(e) for e in events()] * 3  # 9 tokens for max_tokens 3
    fake = Fake(stream=[*(e.replace('"length"', "null") for e in many), "[DONE]"])

    async def scenario() -> None:
        async with client(fake) as upstream:
            async for _ in upstream.stream("x", PARAMS, timeout_s=5.0):
                pass

    with pytest.raises(Unavailable, match="upstream sent 5 tokens for max_tokens 3"):
        run(scenario)


def test_the_gateway_cuts_the_upstreams_answer_at_a_stop_string_streamed_and_whole() -> None:
    """vLLM keeps the stop string in the text when asked to: the gateway cuts it there, the
    stop's tokens and all, and the confidence is of the tokens kept."""
    fake = Fake()
    usage = json.dumps({"id": "c", "choices": [], "usage": {"prompt_tokens": 6, "completion_tokens": 3}})
    fake.stream = [*(json.dumps(e) for e in events()), usage, "[DONE]"]
    request = pb.ModelInferRequest(model_name="arith", id="r1")
    codec.encode_request_inputs(
        request,
        {
            "text_input": np.array([b"37+48="], dtype=object),
            "sampling_parameters": np.array([json.dumps({"stop": ["5"]}).encode()], dtype=object),
        },
    )

    async def scenario() -> tuple[pb.ModelInferResponse, list[pb.ModelInferResponse]]:
        async with plane(fake) as gateway:
            whole = await gateway.infer(request, timeout_s=5.0)
            return whole, [r async for r in gateway.generate(request, timeout_s=None)]

    whole, streamed = run(scenario)
    assert fake.received[0]["stop"] == ["5"] and fake.received[0]["include_stop_str_in_output"] is True
    assert text_of(whole) == "8" and params(whole)[FINISH_REASON] == "stop"
    assert "".join(map(text_of, streamed)) == "8" and params(streamed[-1])[FINISH_REASON] == "stop"
    for answer in (whole, streamed[-1]):
        assert Served.read(answer.parameters).confidence == pytest.approx(math.exp(LOGPROBS[0]))
    assert params(streamed[-1])["stratus.prompt_tokens"] == 6
    assert (
        params(streamed[-1])["stratus.completion_tokens"] == 3
    )  # the upstream's count: the stop's token too


Exported = dict[tuple[str, frozenset[tuple[str, str]]], float]


def exported(recorder: ModelMetrics) -> Exported:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in recorder.metrics.registry.collect()
        for sample in family.samples
    }


def arith(name: str, got: Exported, **labels: str) -> float:
    """The sample of the upstream's family and model (a missing one fails, not 0)."""
    return got[(name, frozenset({"family": "arith", "variant": "arith-large", **labels}.items()))]


def test_the_upstreams_generations_are_counted_and_timed_under_its_family_and_model() -> None:
    """A whole answer, a streamed one (its first token timed) and a refused request: each
    counted once in stratus_work_total, the 3 tokens of each answer in the token count."""
    recorder = ModelMetrics(Metrics())

    async def scenario() -> None:
        async with plane(Fake(), recorder) as gateway:
            await gateway.infer(prompt_request(max_tokens=3), timeout_s=5.0)
            [r async for r in gateway.generate(prompt_request(model="arith-large"), timeout_s=None)]
            with pytest.raises(InvalidInput):
                gateway.generate(prompt_request(max_tokens=0), timeout_s=None)

    run(scenario)
    got = exported(recorder)
    assert arith("stratus_work_total", got, outcome="ok") == 2
    assert arith("stratus_work_total", got, outcome="invalid_argument") == 1
    assert arith("stratus_generation_tokens_total", got) == 2 * len(TOKENS)
    assert arith("stratus_generation_duration_seconds_count", got) == 2
    assert arith("stratus_generation_first_token_seconds_count", got) == 1  # the streamed one only
    first = arith("stratus_generation_first_token_seconds_sum", got)
    assert 0 < first <= arith("stratus_generation_duration_seconds_sum", got)
    assert not any(name.startswith("stratus_generation_queue_seconds") and n for (name, _), n in got.items())


def test_an_upstream_failure_is_counted_as_its_status() -> None:
    recorder = ModelMetrics(Metrics())

    async def scenario() -> None:
        async with plane(Fake(status=429, body={"object": "error", "message": "busy"}), recorder) as gateway:
            with pytest.raises(StratusError):
                await gateway.infer(prompt_request(), timeout_s=5.0)
            with pytest.raises(StratusError):
                [r async for r in gateway.generate(prompt_request(), timeout_s=None)]

    run(scenario)
    got = exported(recorder)
    failed = [(dict(labels)["outcome"], n) for (name, labels), n in got.items() if name == "stratus_work_total"]
    assert failed == [("resource_exhausted", 2)]  # 429: vLLM is full
    assert arith("stratus_generation_duration_seconds_count", got) == 2  # timed, though nothing came
    assert not any(name == "stratus_generation_tokens_total" for name, _ in got)
