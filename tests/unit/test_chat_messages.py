"""A chat's conversation as the OpenAI API reads it (roles, string or text-part contents, an
assistant's null), as it travels to the tiers (``stratus.messages`` beside ``text_input``)
and as a tier reads it back; every refusal names ``messages`` (``stratus.messages`` over the
Open Inference Protocol)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from router.api.openai.requests import messages_of
from stratus.convert import codec
from stratus.convert.inference import InferRequest
from stratus.convert.parameters import set_parameter
from stratus.convert.text import chat_templated, conversation_of, prompt_request, text_request
from stratus.errors import InvalidInput
from stratus.families.chat import (
    CHAT_TEMPLATE,
    MAX_CONVERSATION_BYTES,
    MAX_MESSAGES,
    MESSAGES,
    Message,
    conversation_json,
    last_user_message,
    read_conversation,
)
from stratus.families.generation import GenerationParams
from stratus.families.sampling import FieldError

TURNS = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "12+"},
    {"role": "assistant", "content": ""},
    {"role": "user", "content": "30="},
]


def test_the_whole_conversation_is_read_in_order_with_its_last_user_message_for_templateless_models() -> None:
    messages = messages_of(TURNS)
    assert [m.as_dict() for m in messages] == TURNS
    assert last_user_message(messages) == "30="


def test_text_parts_are_joined_by_newlines_an_assistants_null_is_empty_and_a_name_is_kept() -> None:
    parts = [{"type": "text", "text": "12"}, {"type": "text", "text": "+30="}]
    listed = [
        {"role": "user", "content": parts, "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [], "refusal": None},
        {"role": "user", "content": "again"},
    ]
    first, answer, last = messages_of(listed)
    assert first == Message(role="user", content="12\n+30=", name="ann")
    assert answer == Message(role="assistant", content="")
    assert last.content == "again"


@pytest.mark.parametrize(
    ("listed", "words"),
    [
        (None, "'messages' must be a non-empty list"),
        ([], "'messages' must be a non-empty list"),
        (["hi"], r"messages\[0\] must be an object with a string 'role'"),
        ([{"content": "hi"}], r"messages\[0\] must be an object with a string 'role'"),
        (
            [{"role": "tool", "content": "3"}, {"role": "user", "content": "x"}],
            r"messages\[0\] has role 'tool'",
        ),
        ([{"role": "developer", "content": "x"}], "the roles taken are"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "is a 'image_url' part",
        ),
        ([{"role": "user", "content": ["12+"]}], r"content\[0\] is not a content part"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "must be exactly"),
        ([{"role": "user", "content": [{"type": "text", "text": "x", "cache": 1}]}], "must be exactly"),
        ([{"role": "user", "content": []}], "a non-empty list of text parts"),
        ([{"role": "user", "content": None}], "must be a string or"),
        ([{"role": "user", "content": 5}], "must be a string or"),
        ([{"role": "user", "content": "x", "name": 3}], r"messages\[0\]\.name must be a string"),
        ([{"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]}], "has 'tool_calls'"),
        ([{"role": "system", "content": "x"}, {"role": "assistant", "content": "y"}], "has no user message"),
        (
            [{"role": "user", "content": "1+1="}, {"role": "user", "content": ""}],
            "the last user message is empty",
        ),
        ([{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1), f"at most {MAX_MESSAGES} are taken"),
        ([{"role": "user", "content": "é" * (MAX_CONVERSATION_BYTES // 2)}], "is over 1048576 bytes of JSON"),
    ],
)
def test_what_a_conversation_cannot_hold_is_refused_naming_messages(listed: Any, words: str) -> None:
    with pytest.raises(FieldError, match=words) as refused:
        messages_of(listed)
    assert refused.value.param == "messages"


def test_the_conversation_travels_beside_the_prompt_and_a_tier_reads_it_back() -> None:
    messages = messages_of(TURNS)
    request = prompt_request("arith", "r1", "30=", GenerationParams(max_tokens=4), messages)
    assert json.loads(request.parameters[MESSAGES].string_param) == TURNS
    arrived = InferRequest.from_wire(request)
    assert conversation_of(arrived) == messages
    assert text_request(arrived, "arith", 4).messages == messages
    assert MESSAGES not in prompt_request("arith", "r2", "30=", GenerationParams(max_tokens=4)).parameters


def test_an_oip_client_sends_a_conversation_as_a_parameter_beside_text_input() -> None:
    """As tritonclient would: ``parameters={"stratus.messages": ...}`` on a generate request."""
    wire = InferRequest.from_wire(_oip("30=", **{MESSAGES: json.dumps(TURNS), "stratus.max_tier": "edge"}))
    asked = text_request(wire, "arith", 4)
    assert (asked.prompt, [m.as_dict() for m in asked.messages]) == ("30=", TURNS)
    assert asked.options.max_tier.label == "edge"
    plain = text_request(InferRequest.from_wire(_oip("30=")), "arith", 4)
    assert plain.messages == ()


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (3, "must be a string"),
        ("[", "is not JSON"),
        ("[" * 100_000, "is not JSON"),
        ('{"role": "user"}', "must be a JSON array"),
        ('[{"role": "user", "content": "x", "tool_calls": []}]', "must be an object of 'role', 'content'"),
        ('[{"role": "user", "content": 3}]', "must have string 'role' and 'content'"),
        ('[{"role": "user", "content": "x", "name": 1}]', "must have string 'role' and 'content'"),
        ('[{"role": "tool", "content": "x"}]', r"stratus\.messages\[0\] has role 'tool'"),
        ("[]", "must be a non-empty list"),
        (json.dumps([{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)), f"at most {MAX_MESSAGES}"),
        (json.dumps([{"role": "user", "content": "x" * MAX_CONVERSATION_BYTES}]), "is over 1048576 bytes"),
    ],
)
def test_a_tier_refuses_a_malformed_conversation_naming_the_parameter(raw: object, words: str) -> None:
    with pytest.raises(FieldError, match=words) as refused:
        read_conversation(raw)
    assert refused.value.param == MESSAGES


def test_a_request_parameter_that_is_not_stratus_s_own_is_still_refused_beside_messages() -> None:
    parameters: dict[str, str | int] = {MESSAGES: conversation_json(messages_of(TURNS)), "stratus.x": 1}
    wire = InferRequest.from_wire(_oip("30=", **parameters))
    with pytest.raises(InvalidInput, match=r"unknown request parameter\(s\) \['stratus.x'\]"):
        text_request(wire, "arith", 4)


def test_an_answer_says_it_was_rendered_only_where_its_tier_said_so() -> None:
    assert chat_templated({CHAT_TEMPLATE: True}, asked=True) is True
    assert chat_templated({CHAT_TEMPLATE: False}, asked=True) is False
    assert chat_templated({}, asked=True) is False  # a tier that does not know the parameter
    assert chat_templated({CHAT_TEMPLATE: True}, asked=False) is None
    assert chat_templated({CHAT_TEMPLATE: "true"}, asked=True) is False  # only a boolean true says it


def _oip(prompt: str, **parameters: str | int) -> Any:
    from stratus.wire import inference_pb2 as pb

    request = pb.ModelInferRequest(model_name="arith", id="t1")
    codec.encode_request_inputs(request, {"text_input": np.array([prompt.encode()], dtype=object)})
    for key, value in parameters.items():
        set_parameter(request.parameters, key, value)
    return request
