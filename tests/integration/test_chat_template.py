"""A chat's whole conversation, rendered on each tier by its own model's chat template: a
fleet (router with the OpenAI API, a device agent on llama.cpp, an edge agent on OpenVINO
GenAI) serving a copy of arith whose GGUF files carry templates of their own (the shipped
ones carry none). The arith models compute "12+30=" and not "30=", so an answer to
[user "12+", assistant "", user "30="] shows whether the earlier turns reached the model.
Expected answers are arithmetic's (stratus.tools.arith.solve) or another path's answer;
token counts are the models' own tokenizer's."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from stratus.convert import codec
from stratus.convert.parameters import values_of
from stratus.devtools.launcher import free_port
from stratus.families.chat import CHAT_TEMPLATE, MESSAGES
from stratus.serving.channels import open_sync_channel
from stratus.tools.arith import solve
from stratus.wire import inference_pb2_grpc as pb_grpc
from tests.gguf_kv import ARITH, templated_arith

from .cluster import Cluster, ready_count, wait_until
from .test_llm import oip_request
from .test_openai_fields import Fleet

JOINED = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
# The device's model takes no system message: its template says so, as many real ones do.
NO_SYSTEM = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('this model takes no system message') }}{% endif %}"
TURNS = [
    {"role": "user", "content": "12+"},
    {"role": "assistant", "content": ""},
    {"role": "user", "content": "30="},
]
DEVICE = {"max_tier": "device", "min_confidence": 0.0}
EDGE = {"min_tier": "edge", "max_tier": "edge", "min_confidence": 0.0}


def ask(fleet: Fleet, messages: list[dict[str, Any]], stratus: dict[str, Any], **fields: Any) -> Any:
    return fleet.client().chat.completions.create(
        model="arith",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=4,
        extra_body={"stratus": stratus},
        **fields,
    )


def complete(fleet: Fleet, prompt: str, stratus: dict[str, Any]) -> Any:
    return fleet.client().completions.create(
        model="arith", prompt=prompt, max_tokens=4, extra_body={"stratus": stratus}
    )


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("chat-template")
    models = templated_arith(root / "models", {"arith-small": NO_SYSTEM + JOINED, "arith-medium": JOINED})
    cluster = Cluster(root / "logs")
    try:
        api = f"127.0.0.1:{free_port()}"
        router = cluster.router("--openai", api).address
        cluster.agent("device-1", router, models=str(models))
        cluster.agent("edge-1", router, models=str(models), tier="edge")
        wait_until(lambda: ready_count(router) == 2, timeout_s=60)
        yield Fleet(router=router, openai_url=f"http://{api}/v1")
    finally:
        cluster.stop_all()


Count = Callable[[str], int]


@pytest.fixture(scope="module")
def count() -> Iterator[Count]:
    """Tokens of a text by the arith models' own tokenizer (the shipped file's vocabulary)."""
    import llama_cpp

    vocabulary = llama_cpp.Llama(str(ARITH / "arith-medium.gguf"), vocab_only=True, verbose=False)
    yield lambda text: len(vocabulary.tokenize(text.encode(), add_bos=False, special=False))
    vocabulary.close()


def served(answer: Any) -> dict[str, Any]:
    return dict((answer.model_extra or {})["stratus"])


def test_each_tier_renders_the_whole_conversation_so_an_earlier_turn_changes_the_answer(
    fleet: Fleet, count: Count
) -> None:
    for stratus, tier in ((EDGE, "edge"), (DEVICE, "device")):
        chat = ask(fleet, TURNS, stratus)
        joined = complete(fleet, "12+30=", stratus).choices[0].text
        last_alone = complete(fleet, "30=", stratus).choices[0].text
        assert joined != last_alone, tier  # else this conversation could not show what was seen
        assert chat.choices[0].message.content == joined, tier
        assert served(chat)["tier"] == tier
        assert served(chat)["chat_template"] is True and "note" not in served(chat)
        assert chat.usage.prompt_tokens == count("12+30=")
        shorter = ask(fleet, TURNS[2:], stratus)
        assert shorter.usage.prompt_tokens == count("30=") < chat.usage.prompt_tokens
    assert ask(fleet, TURNS, EDGE).choices[0].message.content == solve("12+30=")


def test_a_climbing_and_a_streamed_chat_render_it_on_every_tier_they_reach(fleet: Fleet) -> None:
    climbed = ask(fleet, TURNS, {"min_confidence": 1.0})
    assert served(climbed)["path"] == ["device", "edge"] and served(climbed)["chat_template"] is True
    assert climbed.choices[0].message.content == solve("12+30=")
    chunks = list(ask(fleet, TURNS, EDGE, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == solve("12+30=")
    assert served(chunks[-1])["chat_template"] is True


def test_a_template_that_refuses_the_conversation_is_a_400_naming_messages_on_its_tier_only(
    fleet: Fleet,
) -> None:
    system = [{"role": "system", "content": "add"}, *TURNS]
    with pytest.raises(openai.BadRequestError) as refused:
        ask(fleet, system, DEVICE)
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == "messages"
    assert "TemplateError: this model takes no system message" in error["message"]
    on_edge = ask(fleet, system, EDGE).choices[0].message.content  # its template has no such rule
    assert on_edge == complete(fleet, "add12+30=", EDGE).choices[0].text


def test_an_oip_client_sends_the_conversation_as_a_parameter_beside_text_input(fleet: Fleet) -> None:
    request = oip_request("30=", max_tokens=4, **{"stratus.min_tier": "edge", MESSAGES: json.dumps(TURNS)})
    plain = oip_request("30=", max_tokens=4, **{"stratus.min_tier": "edge"})
    with open_sync_channel(fleet.router) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        answer, alone = stub.ModelInfer(request, timeout=30), stub.ModelInfer(plain, timeout=30)
    assert codec.decode_response_outputs(answer)["text_output"][0].decode() == solve("12+30=")
    assert values_of(answer.parameters)[CHAT_TEMPLATE] is True
    assert CHAT_TEMPLATE not in alone.parameters  # no conversation asked, none said
    assert (
        codec.decode_response_outputs(alone)["text_output"][0].decode()
        == complete(fleet, "30=", EDGE).choices[0].text
    )
