"""The generative path end to end, without the cloud: a router serving the OpenAI API and the
Open Inference Protocol, a device agent and an edge agent generating with OpenVINO GenAI.

What each tier answers comes from the models themselves (greedy decoding); the tests check
where answers come from, that nothing a higher tier replaced is ever shown, that streamed
and whole answers agree, and every refusal's status and message."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openai
import pytest

from stratus.convert import codec
from stratus.convert.parameters import Served, set_parameter
from stratus.devtools.launcher import free_port
from stratus.serving.channels import open_sync_channel
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

from .cluster import MODELS, Cluster, fleet_status, ready_count, wait_until
from .test_metrics import count, samples, scrape
from .test_metrics import value as sample_value

LLM_MODELS = ["--models", str(MODELS)]
PROMPTS = ["37+48=", "12+5=", "90-45=", "7+8=", "66-6="]


@dataclass
class LlmFleet:
    router: str
    openai_url: str
    device_metrics: str

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.openai_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlmFleet]:
    cluster = Cluster(tmp_path_factory.mktemp("llm") / "logs")
    try:
        api, metrics = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        # every settled answer audited: the generative rows test reads them
        router = cluster.router("--openai", api, "--audit-share", "1", "--audit-max-per-s", "10000").address
        cluster.agent("device-1", router, *LLM_MODELS, "--metrics", metrics)
        cluster.agent("edge-1", router, *LLM_MODELS, tier="edge")
        wait_until(lambda: ready_count(router) == 2, timeout_s=60)
        yield LlmFleet(router=router, openai_url=f"http://{api}/v1", device_metrics=metrics)
    finally:
        cluster.stop_all()


def complete(fleet: LlmFleet, prompt: str, **stratus: object) -> tuple[str, dict[str, object]]:
    answer = fleet.client().completions.create(
        model="arith", prompt=prompt, max_tokens=4, extra_body={"stratus": stratus}
    )
    extra = answer.model_extra or {}
    return answer.choices[0].text, extra["stratus"]


def test_models_lists_the_generative_family_and_its_variants(llm: LlmFleet) -> None:
    names = {m.id for m in llm.client().models.list().data}
    assert {"arith", "arith-small", "arith-medium"} <= names
    assert "digits" not in names  # a classifier does not generate


def test_devices_generate_with_llama_cpp_edges_with_openvino_genai_and_they_agree(
    llm: LlmFleet, tmp_path: Path
) -> None:
    pytest.importorskip("llama_cpp", reason="the llama extra is not installed (make llama-env)")
    runtimes = {a.id: set(a.runtimes) for a in fleet_status(llm.router).agents}
    generative = {"llama_cpp", "openvino_genai"}
    assert {name: found & generative for name, found in runtimes.items()} == {
        "device-1": {"llama_cpp"},
        "edge-1": {"openvino_genai"},
    }
    on_llama = [complete(llm, p, min_confidence=0.0, max_tier="device")[0] for p in PROMPTS]
    cluster = Cluster(tmp_path / "logs")
    try:  # the same device model on OpenVINO GenAI, in a fleet of its own
        router = cluster.router().address
        cluster.agent("ov-device", router, *LLM_MODELS, "--runtimes", "litert,openvino_genai")
        wait_until(lambda: ready_count(router) == 1, timeout_s=60)
        assert [set(a.runtimes) & generative for a in fleet_status(router).agents] == [{"openvino_genai"}]
        with open_sync_channel(router) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            on_openvino = [
                codec.decode_response_outputs(stub.ModelInfer(oip_request(p), timeout=30))["text_output"][
                    0
                ].decode()
                for p in PROMPTS
            ]
    finally:
        cluster.stop_all()
    assert on_openvino == on_llama


def test_a_confident_answer_stays_on_the_device_an_unsure_one_climbs(llm: LlmFleet) -> None:
    for prompt in PROMPTS:
        text, sure = complete(llm, prompt, min_confidence=0.0)
        assert (sure["tier"], sure["path"], sure["degraded"]) == ("device", ["device"], False)
        direct, _ = complete(llm, prompt, min_confidence=0.0, max_tier="device")
        assert text == direct
        _, unsure = complete(llm, prompt, min_confidence=1.0)
        assert (unsure["tier"], unsure["path"]) == ("edge", ["device", "edge"])  # the top here: final
        assert unsure["degraded"] is True  # no tier above edge serves arith: unsure, never silently
        assert set(unsure["timings_ms"]) == {"device", "edge"}
        _, capped = complete(llm, prompt, min_confidence=1.0, max_tier="device")
        assert capped["tier"] == "device" and capped["degraded"] is False


def test_streamed_answers_equal_whole_ones_and_hold_what_was_replaced(llm: LlmFleet) -> None:
    client = llm.client()
    for prompt in PROMPTS:
        for min_confidence in (0.0, 1.0):
            whole, served = complete(llm, prompt, min_confidence=min_confidence)
            stream = client.completions.create(
                model="arith",
                prompt=prompt,
                max_tokens=4,
                stream=True,
                extra_body={"stratus": {"min_confidence": min_confidence}},
            )
            chunks = list(stream)
            assert "".join(c.choices[0].text for c in chunks) == whole
            final = chunks[-1]
            assert final.choices[0].finish_reason in ("stop", "length")
            assert (final.model_extra or {})["stratus"]["tier"] == served["tier"]
    # a held device answer never leaks: what an escalated stream shows is the edge's alone
    edge_only, _ = complete(llm, PROMPTS[0], min_tier="edge")
    escalated = client.completions.create(
        model="arith",
        prompt=PROMPTS[0],
        max_tokens=4,
        stream=True,
        extra_body={"stratus": {"min_confidence": 1.0}},
    )
    assert "".join(c.choices[0].text for c in escalated) == edge_only


def test_chat_and_a_pinned_variant(llm: LlmFleet) -> None:
    client = llm.client()
    chat = client.chat.completions.create(
        model="arith", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=4,
        extra_body={"stratus": {"min_confidence": 0.0}},
    )  # fmt: skip
    text, _ = complete(llm, PROMPTS[0], min_confidence=0.0)
    assert chat.choices[0].message.content == text
    # The shipped GGUFs carry no chat template: the last user message alone, and the answer says so.
    turns = [{"role": "user", "content": "12+"}, {"role": "assistant", "content": ""}, {"role": "user", "content": PROMPTS[0]}]  # fmt: skip
    told = client.chat.completions.create(model="arith", messages=turns, max_tokens=4, extra_body={"stratus": {"min_confidence": 0.0}})  # type: ignore[arg-type]  # fmt: skip
    said = (told.model_extra or {})["stratus"]
    assert told.choices[0].message.content == text and told.usage is not None and told.usage.prompt_tokens == chat.usage.prompt_tokens  # type: ignore[union-attr]  # fmt: skip
    assert said["chat_template"] is False and "the earlier messages were not seen" in said["note"]
    assert "chat_template" not in (complete(llm, PROMPTS[0])[1])  # a completion has no conversation
    pinned = client.completions.create(model="arith-medium", prompt=PROMPTS[0], max_tokens=4, logprobs=1)
    assert (pinned.model_extra or {})["stratus"]["variant"] == "arith-medium"
    assert pinned.choices[0].logprobs is not None and all(
        lp <= 0 for lp in pinned.choices[0].logprobs.token_logprobs
    )


def oip_request(prompt: str, model: str = "arith", **parameters: object) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, id="t1")
    codec.encode_request_inputs(request, {"text_input": np.array([prompt.encode()], dtype=object)})
    for key, parameter in parameters.items():
        set_parameter(request.parameters, key, parameter)  # type: ignore[arg-type]
    return request


def test_the_open_inference_protocol_answers_text_whole_and_streamed(llm: LlmFleet) -> None:
    import tritonclient.grpc as triton

    text, _ = complete(llm, PROMPTS[1], min_confidence=0.0)
    client = triton.InferenceServerClient(llm.router)
    prompt = triton.InferInput("text_input", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([PROMPTS[1].encode()], dtype=object))
    result = client.infer("arith", [prompt], parameters={"stratus.min_confidence": 0.0, "max_tokens": 4})
    assert result.as_numpy("text_output")[0].decode() == text
    served = Served.read(result.get_response().parameters)
    assert served.tier.label == "device"
    with open_sync_channel(llm.router) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        request = oip_request(PROMPTS[1], stream=True, max_tokens=4)
        set_parameter(request.parameters, "stratus.min_confidence", 0.0)
        responses = list(stub.ModelStreamInfer(iter([request]), timeout=30))
    assert all(not r.error_message for r in responses)
    finals = [r.infer_response.parameters["triton_final_response"].bool_param for r in responses]
    assert finals[-1] and not any(finals[:-1])
    streamed = "".join(
        codec.decode_response_outputs(r.infer_response)["text_output"][0].decode() for r in responses
    )
    assert streamed == text


def post(url: str, body: bytes) -> tuple[int, dict[str, object]]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_bad_requests_get_openai_errors_and_lose_nothing(llm: LlmFleet) -> None:
    url = f"{llm.openai_url}/completions"
    good = {"model": "arith", "prompt": "1+1=", "max_tokens": 2}
    cases = [
        (b"{not json", 400, "not valid JSON"),
        (json.dumps({**good, "model": "letters"}).encode(), 404, "'letters' does not exist"),
        (json.dumps({**good, "max_tokens": 0}).encode(), 400, "between 1 and"),
        (json.dumps({**good, "max_tokens": 10_000}).encode(), 400, "between 1 and"),
        (
            json.dumps({**good, "temperature": 2.5}).encode(),
            400,
            "'temperature' must be a number from 0 to 2",
        ),
        (json.dumps({**good, "prompt": "1+" * 400 + "1="}).encode(), 400, "context"),
        (json.dumps({**good, "stratus": {"max_tier": "moon"}}).encode(), 400, "moon"),
        (json.dumps({**good, "stratus": {"speed": 1}}).encode(), 400, "unknown 'stratus' option"),
    ]
    for body, status, words in cases:
        code, answer = post(url, body)
        error = answer["error"]
        assert code == status and words in error["message"], (body[:60], code, answer)  # type: ignore[index]
    # What Stratus does not honour, or a value out of range, is refused by name (OpenAI's `param`).
    for field, value in (("top_p", 0), ("seed", 1.5), ("stop", ["a", "b", "c", "d", "e"]), ("presence_penalty", 0.5),
                         ("stream_options", {"include_usage": True}), ("temperature", -1), ("n", 0),
                         ("prompt", [1, 2, 3]), ("prompt", [])):  # fmt: skip
        code, answer = post(url, json.dumps({**good, field: value}).encode())
        assert code == 400 and answer["error"]["param"] == field, (field, answer)  # type: ignore[index]
    # Fields OpenAI's API or vLLM's take that Stratus does not honour (JSON mode, tools, vLLM's
    # sampling extras, guided decoding) and unknown ones: refused by name, never ignored.
    chat_url, chat = f"{llm.openai_url}/chat/completions", {"model": "arith", "messages": [{"role": "user", "content": "1+1="}], "max_tokens": 2}  # fmt: skip
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    for where, body, field, value in (
        (chat_url, chat, "response_format", {"type": "json_object"}), (chat_url, chat, "tools", [tool]),
        (url, good, "top_k", 5), (url, good, "min_p", 0.1), (url, good, "repetition_penalty", 1.2),
        (url, good, "guided_json", {"type": "object"}), (url, good, "ignore_eos", True),
        (chat_url, chat, "top_logprobs", 2), (url, good, "logprobs", 3), (url, good, "frobnicate", 1),
        (url, good, "messages", []), (chat_url, chat, "prompt", "1+1="),
    ):  # fmt: skip
        code, answer = post(where, json.dumps({**body, field: value}).encode())
        assert code == 400 and answer["error"]["param"] == field, (field, answer)  # type: ignore[index]
    for where, body, field, default in (
        (url, good, "top_p", 1), (url, good, "seed", None), (url, good, "stop", []), (url, good, "presence_penalty", 0),
        (chat_url, chat, "response_format", {"type": "text"}), (chat_url, chat, "tools", []),
        (url, good, "top_k", -1), (url, good, "repetition_penalty", 1.0), (chat_url, chat, "top_logprobs", 0),
        (url, good, "user", "someone"),
    ):  # fmt: skip
        code, answer = post(where, json.dumps({**body, field: default}).encode())
        assert code == 200, (field, answer)  # the default asks for nothing Stratus lacks
    code, answer = post(url, json.dumps(good).encode())  # the router still answers
    assert code == 200 and answer["choices"]
    base = llm.openai_url.removesuffix("/v1")
    for path, status in (("/health", 200), ("/v1/models/arith", 200), ("/v1/models/letters", 404)):
        try:
            with urllib.request.urlopen(f"{base}{path}", timeout=10) as response:
                got, payload = response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            got, payload = error.code, json.loads(error.read())
        assert got == status, (path, payload)
    assert payload["error"]["type"] == "not_found_error"


def test_a_client_that_goes_away_cancels_the_generation_on_the_agent(llm: LlmFleet, tmp_path: Path) -> None:
    cluster = Cluster(tmp_path / "logs")
    try:  # a device that takes 300 ms per token, and a router that knows only it
        api = f"127.0.0.1:{free_port()}"
        metrics = f"127.0.0.1:{free_port()}"
        router = cluster.router("--openai", api).address
        cluster.agent("slow-device", router, *LLM_MODELS, "--metrics", metrics, "--emulate-slow-ms", "300")
        wait_until(lambda: ready_count(router) == 1, timeout_s=60)
        body = json.dumps({"model": "arith", "prompt": "37+48=", "max_tokens": 4, "stream": True}).encode()
        request = urllib.request.Request(
            f"http://{api}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:  # closed even on failure
            first = response.readline()  # the first token's event, then hang up
        assert first.startswith(b"data: ")
        small = {"family": "arith", "variant": "arith-small"}
        counted = lambda: count(samples(scrape(metrics)), "stratus_work_total", **small, outcome="cancelled")  # noqa: E731
        wait_until(lambda: counted() == 1, timeout_s=10)
        # cancelled, not finished: the slow device never completed the generation
        after = samples(scrape(metrics))
        assert count(after, "stratus_work_total", **small, outcome="ok") == 0
        # the tokens it made before the Cancel reached it are counted, and their time
        assert sample_value(after, "stratus_generation_duration_seconds_count", **small) == 1
        assert sample_value(after, "stratus_generation_tokens_total", **small) >= 1
    finally:
        cluster.stop_all()


def test_the_device_agent_times_each_generation_and_counts_its_tokens(llm: LlmFleet) -> None:
    """Per generative variant, as the agent saw them: one first token, one wait for a slot
    and one generation per prompt; as many tokens as the router says the device made."""
    small = {"family": "arith", "variant": "arith-small"}
    before = samples(scrape(llm.device_metrics))
    made = [complete(llm, p, min_confidence=0.0, max_tier="device")[1]["tokens"] for p in PROMPTS]
    after = samples(scrape(llm.device_metrics))

    def grew(name: str, **labels: str) -> float:
        return sample_value(after, name, **labels) - count(before, name, **labels)

    assert grew("stratus_work_total", **small, outcome="ok") == len(PROMPTS)
    assert grew("stratus_generation_tokens_total", **small) == sum(m["device"] for m in made)  # type: ignore[index]
    for histogram in ("first_token", "queue", "duration"):
        assert grew(f"stratus_generation_{histogram}_seconds_count", **small) == len(PROMPTS), histogram
    first = grew("stratus_generation_first_token_seconds_sum", **small)
    assert 0 < first < grew("stratus_generation_duration_seconds_sum", **small) + grew(
        "stratus_generation_queue_seconds_sum", **small
    )  # the first token comes before the last, counted from arrival
    assert sample_value(after, "stratus_generation_waiting", **small) == 0  # levels, read at the scrape
    assert sample_value(after, "stratus_generation_running", **small) == 0


def test_the_demo_grades_generated_answers_through_the_router(llm: LlmFleet) -> None:
    from stratus.cli.demo import through_generation

    report = through_generation(llm.router, MODELS, count=20)
    assert report is not None and report.requests == 20
    # no cloud serves arith here: the edge's answers below its threshold come back degraded (the
    # demo's own fleet has a cloud, where they climb); the sure ones do not
    assert 0 < report.degraded < report.requests
    assert sum(report.tiers.values()) == pytest.approx(1.0) and report.tiers["cloud"] == 0.0
    assert report.accuracy >= 0.7  # the edge model alone gets 0.94 of held-out prompts right


def test_generative_audit_rows_feed_the_suggestion(llm: LlmFleet) -> None:
    """Audits keep a row per prompt: the device's confidence and whether its text agreed with
    the edge's (the top here), and no text; ``fleet thresholds arith --suggest`` chooses on
    them what calibrate's chooser does."""
    import subprocess
    import sys

    from stratus.tools.arith import arith_splits
    from stratus.tools.calibrate.from_audits import suggest
    from stratus.wire import fleet_pb2 as fpb
    from stratus.wire import fleet_pb2_grpc as fpb_grpc

    from .cluster import wait_until

    def rows() -> list[fpb.AuditRow]:
        with open_sync_channel(llm.router) as channel:
            request = fpb.ThresholdsRequest(family="arith", include_rows=True)
            return list(fpb_grpc.FleetStub(channel).Thresholds(request, timeout=10).rows)

    prompts = [prompt for prompt, _ in arith_splits().held_out]
    for start in range(0, len(prompts), 25):  # until the suggestion's minimum is kept
        with llm.client() as client:
            for prompt in prompts[start : start + 25]:
                client.completions.create(model="arith", prompt=prompt, max_tokens=4)
        if len(rows()) >= 220:
            break
    counts = [len(rows())]

    def steady() -> bool:
        counts.append(len(rows()))
        return counts[-1] == counts[-2]

    wait_until(steady, timeout_s=30, interval_s=1.0)
    kept = rows()
    assert len(kept) >= 200 and {r.top_tier for r in kept} == {"edge"}
    assert all([a.tier for a in r.tiers] == ["device"] and r.tiers[0].HasField("agrees") for r in kept)
    agreed = sum(r.tiers[0].agrees for r in kept)
    assert 0 < agreed < len(kept)  # the small model is sometimes right, sometimes not
    done = subprocess.run(
        [sys.executable, "-m", "stratus.cli", "fleet", "thresholds", "arith", "--router", llm.router,
         "--suggest", "--target-accuracy", "0.95", "--json"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    expected = suggest(kept, target_accuracy=0.95).thresholds
    assert shown["audit_rows"] == len(kept)
    assert shown["suggested"] == {tier.label: value for tier, value in expected.items()}
