"""Generation's pure parts: confidence from token log-probabilities, the running judgement
that cancels a hopeless answer early, chunks on the wire, the cut at stop strings,
generative family configs, and the OpenAI body's checks."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from router.api.openai.requests import (
    check_fields,
    choice_params,
    choices_of,
    options_of,
    prompts_of,
    settings_of,
    text_request,
)
from stratus.convert import codec
from stratus.convert.inference import InferRequest, TextRequest
from stratus.convert.parameters import RequestOptions
from stratus.convert.text import prompt_request, read_generation
from stratus.errors import ConfigError, InvalidInput
from stratus.families.generation import (
    FINISH_REASON,
    TOKEN_LOGPROBS,
    Chunk,
    GenerationMethod,
    GenerationParams,
    RunningConfidence,
    StopCut,
    Token,
    confidence_of,
)
from stratus.families.repository import load_family
from stratus.families.sampling import FieldError
from stratus.tiers import Tier
from stratus.wire import inference_pb2 as pb


def tokens(*logprobs: float, margin: float | None = None) -> list[Token]:
    return [
        Token(text=str(i), logprob=lp, margin=margin if i == 0 else None) for i, lp in enumerate(logprobs)
    ]


def test_each_method_reads_the_log_probabilities_its_own_way() -> None:
    answer = tokens(-0.1, -2.0, -0.3, margin=0.42)
    assert confidence_of(answer, GenerationMethod.MEAN_LOGPROB) == pytest.approx(math.exp(-2.4 / 3))
    assert confidence_of(answer, GenerationMethod.MIN_LOGPROB) == pytest.approx(math.exp(-2.0))
    assert confidence_of(answer, GenerationMethod.FIRST_MARGIN) == pytest.approx(0.42)
    # no alternatives known: the first token's own probability stands in for the margin
    assert confidence_of(tokens(-0.5), GenerationMethod.FIRST_MARGIN) == pytest.approx(math.exp(-0.5))
    assert confidence_of([], GenerationMethod.MEAN_LOGPROB) == 0.0


def test_a_minimum_below_the_threshold_is_hopeless_at_once_a_mean_never_early() -> None:
    running = RunningConfidence(GenerationMethod.MIN_LOGPROB)
    running.add(tokens(-0.05))
    assert not running.hopeless(0.5)
    running.add([Token(text="x", logprob=-3.0)])  # probability 0.05: the minimum never rises again
    assert running.hopeless(0.5)
    mean = RunningConfidence(GenerationMethod.MEAN_LOGPROB)
    mean.add(tokens(-5.0, -5.0))
    assert mean.value < 0.01 and not mean.hopeless(0.5)  # more sure tokens could still lift it
    first = RunningConfidence(GenerationMethod.FIRST_MARGIN)
    first.add(tokens(-0.1, margin=0.1))
    assert first.hopeless(0.2) and not first.hopeless(0.05)


def test_chunks_travel_as_parameters_and_come_back() -> None:
    chunk = Chunk(
        tokens=(Token(text="8", logprob=-0.25, margin=0.5), Token(text="5", logprob=-0.125)),
        finish_reason="stop",
    )
    params = chunk.parameters()
    assert json.loads(params[TOKEN_LOGPROBS]) == [-0.25, -0.125] and params[FINISH_REASON] == "stop"
    back = Chunk.from_parts(chunk.text, params, final=True)
    assert back.text == "85" and [t.logprob for t in back.tokens] == [-0.25, -0.125]
    assert [t.margin for t in back.tokens] == [0.5, None] and back.finish_reason == "stop"


GENERATIVE = """
[family]
name = "arith"
kind = "generative"

[generation]
max_tokens = 4
stop = ["\\n"]

[confidence]
method = "min_logprob"

[current]
device = "arith-small"

[[variants]]
name = "arith-small"
tier = "device"
precision = "FP16"
files = { gguf = "arith-small.gguf" }
"""


@pytest.fixture
def generative(tmp_path: Path) -> Path:
    (tmp_path / "arith-small.gguf").write_bytes(b"GGUF")
    path = tmp_path / "family.toml"
    path.write_text(GENERATIVE)
    return path


def test_a_generative_family_reads_with_its_text_tensors_and_limits(generative: Path) -> None:
    family = load_family(generative)
    assert family.generation is not None and family.generative
    assert (family.generation.max_tokens, family.generation.stop) == (4, ("\n",))
    assert family.generation.method is GenerationMethod.MIN_LOGPROB
    assert [(t.name, t.datatype) for t in family.inputs] == [("text_input", "BYTES")]
    assert family.variant("arith-small").precision == "FP16"  # a root in FP16 needs no parent


@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        ('method = "min_logprob"', 'method = "max_softmax"', "confidence.method"),
        ("max_tokens = 4", "max_tokens = 0", "must be at least 1"),
        ('stop = ["\\n"]', "stop = [1]", "non-empty strings"),
        ('gguf = "arith-small.gguf"', 'hf = "arith-small"', "not a Hugging Face model folder"),
    ],
)
def test_generative_configs_are_refused_precisely(generative: Path, old: str, new: str, problem: str) -> None:
    generative.write_text(GENERATIVE.replace(old, new))
    with pytest.raises(ConfigError, match=problem):
        load_family(generative)


def openai_request(body: dict[str, object], limit: int = 4) -> TextRequest:
    return text_request("arith", "1+1=", settings_of(body, "arith", limit), options_of(body))


def wire_form(request: TextRequest) -> pb.ModelInferRequest:
    """What the tiers are sent for it."""
    return prompt_request(request.model_name, request.id, request.prompt, request.params)


def test_the_openai_body_becomes_a_checked_request_whose_wire_form_reads_back_the_same() -> None:
    body = {"max_tokens": 3, "stratus": {"min_confidence": 0.9, "max_tier": "edge"}}
    request = openai_request(body)
    assert (request.prompt, request.params.max_tokens) == ("1+1=", 3)
    assert request.options == RequestOptions(min_confidence=0.9, max_tier=Tier.EDGE)
    wire = wire_form(request)
    assert codec.decode_request_inputs(wire)["text_input"][0] == b"1+1="
    assert wire.parameters["max_tokens"].int64_param == 3
    assert [t.name for t in wire.inputs] == ["text_input"]  # nothing more asked: today's wire form
    sampled = {"max_tokens": 2, "stop": ["\n", "9"], "temperature": 0.7, "top_p": 0.5, "seed": -3}
    prompt, params = read_generation(InferRequest.from_wire(wire_form(openai_request(sampled))), "arith", 4)
    assert prompt == "1+1="
    assert params == GenerationParams(max_tokens=2, stop=("\n", "9"), temperature=0.7, top_p=0.5, seed=-3)
    for bad, param, words in [
        ({"max_tokens": 5}, "max_tokens", "between 1 and 4"),
        ({"max_tokens": True}, "max_tokens", "between 1 and 4"),
        ({"temperature": 2.5}, "temperature", "from 0 to 2"),
        ({"temperature": "hot"}, "temperature", "from 0 to 2"),
        ({"top_p": 0}, "top_p", "above 0 up to 1"),
        ({"seed": 1.5}, "seed", "int64"),
        ({"seed": 1 << 63}, "seed", "int64"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4 strings"),
        ({"stop": [1]}, "stop", "a string or a list of strings"),
        ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ]:
        with pytest.raises(FieldError, match=words) as refused:
            openai_request(bad)
        assert refused.value.param == param
    for bad, words in [
        ({"stratus": {"budget_ms": "fast"}}, "must be a number"),
        ({"stratus": []}, "must be an object"),
    ]:
        with pytest.raises(InvalidInput, match=words):
            openai_request(bad)


@pytest.mark.parametrize(
    ("chat", "field", "value", "words"),
    [
        (True, "response_format", {"type": "json_object"}, 'leave it out or at null or {"type": "text"}'),
        (True, "tools", [{"type": "function"}], "'tools' is not supported by Stratus"),
        (True, "tool_choice", "required", "'tool_choice' is not supported"),
        (False, "top_k", 5, "leave it out or at 0 or -1"),
        (False, "min_p", 0.1, "'min_p' is not supported"),
        (False, "repetition_penalty", 1.2, "leave it out or at 1"),
        (False, "guided_json", {"type": "object"}, "'guided_json' is not supported"),
        (False, "ignore_eos", True, "leave it out or at false"),
        (True, "top_logprobs", 2, "does not return: 0"),
        (True, "logprobs", 1, "must be true or false"),
        (False, "logprobs", 3, "0 or 1 (the chosen tokens)"),
        (False, "logprobs", "yes", "must be 0 or 1"),
        (False, "frobnicate", 1, "unrecognized field 'frobnicate'; this endpoint takes"),
        (False, "messages", [], "it belongs to /v1/chat/completions"),
        (True, "prompt", "1+1=", "it belongs to /v1/completions"),
        (False, "top_logprobs", 0, "unrecognized field 'top_logprobs'"),  # chat's alone
    ],
)
def test_openai_fields_not_honoured_are_refused_by_name(chat: bool, field: str, value: object, words: str) -> None:
    body = {"model": "arith", ("messages" if chat else "prompt"): [] if chat else "1+1=", field: value}
    with pytest.raises(FieldError, match=re.escape(words)) as refused:
        check_fields(body, chat=chat)
        settings_of(body, "arith", 4)
    assert refused.value.param == field


@pytest.mark.parametrize(
    ("chat", "fields"),
    [
        (True, {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "top_logprobs": 0}),
        (True, {"logprobs": True, "parallel_tool_calls": False, "store": False, "user": "u-1", "metadata": {}}),
        (False, {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "ignore_eos": False, "n": 1.0}),
        (False, {"logprobs": 1, "echo": False, "best_of": 1, "guided_json": None, "max_completion_tokens": 2}),
        (False, {"max_tokens": 2, "stop": ["\n"], "temperature": 0.5, "top_p": 0.9, "seed": 3, "stream": False}),
    ],
)
def test_openai_fields_at_values_that_ask_for_nothing_are_taken(chat: bool, fields: dict[str, object]) -> None:
    body = {"model": "arith", ("messages" if chat else "prompt"): [] if chat else "1+1=", **fields}
    check_fields(body, chat=chat)
    assert settings_of(body, "arith", 4).max_tokens in (2, 4)


def test_n_choices_per_prompt_are_bounded_and_each_draws_from_its_own_seed() -> None:
    assert choices_of({}, 3) == 1 and choices_of({"n": 4}, 8) == 4 and choices_of({"n": 2.0}, 1) == 2
    for n, prompts, words in [
        (0, 1, "at least 1"),
        (True, 1, "a whole number"),
        (1.5, 1, "a whole number"),
        ("2", 1, "a whole number"),
        (17, 2, "asks for 34 choices; at most 32"),
    ]:
        with pytest.raises(FieldError, match=words) as refused:
            choices_of({"n": n}, prompts)
        assert refused.value.param == "n"
    seeded = GenerationParams(max_tokens=2, temperature=0.7, seed=(1 << 63) - 2)
    assert [choice_params(seeded, c).seed for c in range(3)] == [(1 << 63) - 2, (1 << 63) - 1, -(1 << 63)]
    unseeded = GenerationParams(max_tokens=2, temperature=0.7)
    assert choice_params(unseeded, 5) is unseeded  # each draw its own anyway


def test_usage_counts_a_prompts_tokens_once_whatever_its_choices() -> None:
    from router.api.openai.replies import usage
    from router.cascade.generate import Generation

    def generated(prompt_tokens: int, completion_tokens: int) -> Generation:
        return Generation(
            text="x" * completion_tokens,
            tokens=(),
            tier=Tier.DEVICE,
            agent="d1",
            variant="arith-small",
            confidence=1.0,
            finish_reason="stop",
            path=(Tier.DEVICE,),
            timings_ms={},
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
        )

    # two prompts of 5 and 7 tokens, two choices each
    results = [generated(5, 1), generated(5, 2), generated(7, 3), generated(7, 4)]
    assert usage(results, 2) == {"prompt_tokens": 12, "completion_tokens": 10, "total_tokens": 22}


def test_an_empty_prompt_is_refused_at_the_door_on_both_fronts() -> None:
    for prompt in ("", ["1+1=", ""]):
        with pytest.raises(FieldError, match="'prompt' is empty") as refused:
            prompts_of(prompt)
        assert refused.value.param == "prompt"
    empty = InferRequest.from_wire(prompt_request("arith", "t", "", GenerationParams(max_tokens=2)))
    with pytest.raises(InvalidInput, match="'text_input' is empty: a generation needs a prompt"):
        read_generation(empty, "arith", 4)
    assert prompts_of(["1+1=", " "]) == ["1+1=", " "]  # a space is a prompt


def test_the_cloud_link_knows_a_text_model_and_its_max_tokens_from_its_description() -> None:
    from router.cloud.catalog import UNDECLARED_MAX_TOKENS, _max_tokens
    from router.cloud.models import generates as _generates
    from stratus.convert.text import generative_config, generative_metadata
    from stratus.wire import inference_pb2 as pb

    assert _generates(generative_metadata("arith", "openvino_genai"))
    tensor = pb.ModelMetadataResponse.TensorMetadata
    classifier = pb.ModelMetadataResponse(
        name="digits",
        inputs=[tensor(name="pixels", datatype="FP32", shape=[-1, 64])],
        outputs=[tensor(name="probabilities", datatype="FP32", shape=[-1, 10])],
    )
    assert not _generates(classifier)
    assert _max_tokens(generative_config("arith", "vllm", 4)) == 4
    assert _max_tokens(pb.ModelConfig(name="other")) == UNDECLARED_MAX_TOKENS
    garbled = pb.ModelConfig(parameters={"max_tokens": pb.ModelParameter(string_value="many")})
    assert _max_tokens(garbled) == UNDECLARED_MAX_TOKENS


def cut_stream(stops: list[str], pieces: list[str]) -> tuple[list[str], list[str], bool]:
    """What a StopCut releases after each piece (one token each), and at the end."""
    cut = StopCut(stops)
    released = ["".join(t.text for t in cut.feed([Token(text=p, logprob=-0.5)])) for p in pieces]
    return released, [t.text for t in cut.finish()], cut.stopped


def test_text_that_may_begin_a_stop_string_is_held_until_settled() -> None:
    # "4" could begin "48": held; "9" settles it (no stop), so both go out together
    assert cut_stream(["48"], ["1", "4", "9", "5"]) == (["1", "", "49", "5"], [], False)
    # the stop split over two tokens: "4" held, then "48" found; neither shown, nor what follows
    assert cut_stream(["48"], ["1", "4", "8", "7"]) == (["1", "", "", ""], [], True)
    # a held tail that the stream ends on is released at the end
    assert cut_stream(["48"], ["1", "4"]) == (["1", ""], ["4"], False)
    # the stop inside one token: the token's text is cut there and the token kept
    assert cut_stream(["\n"], ["12", "3\nX", "Y"]) == (["12", "3", ""], [], True)
    # the earliest stop of several wins; a stop at the very start keeps nothing
    assert cut_stream(["9", "23"], ["1", "2", "3", "9"]) == (["1", "", "", ""], [], True)
    assert cut_stream(["ab"], ["ab", "c"]) == (["", ""], [], True)
    # no stops: everything at once
    assert cut_stream([], ["1", "2"]) == (["1", "2"], [], False)


def test_a_stop_spanning_many_tokens_holds_only_what_could_begin_it() -> None:
    cut = StopCut(["<end>"])
    shown = [
        t.text
        for piece in ["a", "<", "e", "x", "<", "en", "d>", "z"]
        for t in cut.feed([Token(text=piece, logprob=0.0)])
    ]
    assert shown == ["a", "<", "e", "x"] and cut.stopped  # "<ex" could not begin "<end>": released


def test_the_confidence_of_a_cut_answer_is_of_the_tokens_kept() -> None:
    cut = StopCut(["5"])
    kept = [*cut.feed(tokens(-0.1)), *cut.feed([Token(text="5", logprob=-3.0)]), *cut.feed(tokens(-2.0))]
    assert [t.logprob for t in kept] == [-0.1]
    assert confidence_of(kept, GenerationMethod.MIN_LOGPROB) == pytest.approx(math.exp(-0.1))


def test_the_router_cuts_a_tier_that_ignores_a_stop_string_and_judges_what_it_kept() -> None:
    """A foreign cloud may generate past a stop string: the router's own cut shows none of
    it, counts every token the tier made, and judges the confidence on the tokens kept."""
    from router.cascade.generate import _Arriving

    answer = _Arriving(running=RunningConfidence(GenerationMethod.MIN_LOGPROB), cut=StopCut(["48"]))
    pieces = [("1", -0.1), ("4", -0.2), ("8", -3.0), ("7", -4.0)]
    shown = [t for text, lp in pieces for t in answer.add([Token(text=text, logprob=lp)])]
    shown += answer.finish()
    assert [t.text for t in shown] == ["1"] and answer.text == "1"
    assert answer.made == 4
    # judged on "1" alone: not the -3.0 of the stop's token, nor the -4.0 after it
    assert answer.running.value == pytest.approx(math.exp(-0.1))
