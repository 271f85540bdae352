"""The OpenAI API's request bodies, read and checked: the prompts, a chat's messages, the
generation's settings (:mod:`stratus.families.sampling`, the same rules as over the Open
Inference Protocol), the ``stream_options``, Stratus's own ``stratus`` options, and each
prompt as the Open Inference Protocol request the cascade takes. Whatever is not honoured is
refused by name (``param``).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Mapping
from typing import Any, Final

from stratus.convert.inference import TextRequest
from stratus.convert.parameters import PREFIX, RequestOptions
from stratus.errors import InvalidInput
from stratus.families.chat import MAX_MESSAGES, Message, check_conversation, last_user_message
from stratus.families.generation import MAX_TOKENS, GenerationParams
from stratus.families.sampling import SETTINGS, UNSUPPORTED, FieldError, settings_from

_OPTIONS: Final = {"budget_ms": float, "min_confidence": float, "max_tier": str, "min_tier": str}
# What both endpoints honour (besides the sampling SETTINGS); ``user`` and ``metadata`` only
# tag a request at OpenAI too (abuse reports, stored completions), so taking them changes
# no answer.
_TAKEN: Final = frozenset(
    {
        "model",
        "max_completion_tokens",
        "stream",
        "stream_options",
        "logprobs",
        "n",
        "stratus",
        "user",
        "metadata",
    }
) | frozenset(SETTINGS)
_TAKEN_ONLY_BY: Final = {False: frozenset({"prompt"}), True: frozenset({"messages", "top_logprobs"})}
# Fields of OpenAI's API, or vLLM's extensions of it, that Stratus does not honour, with the
# values that ask for nothing: each refused by name when it asks for something else, never
# silently ignored (a client counting on JSON mode, tools or top_k would get a plain answer).
_UNSUPPORTED: Final[dict[str, tuple[Any, ...]]] = {
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "best_of": (1, None),
    "echo": (False, None),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),  # with no tools, both ask for text
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "parallel_tool_calls": (None, True, False),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "store": (None, False),
    "service_tier": (None, "auto", "default"),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None, []),
    "guided_grammar": (None,),
    "guided_whitespace_pattern": (None,),
    "guided_decoding_backend": (None,),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "priority": (None, 0),
    "truncate_prompt_tokens": (None,),
    "return_tokens_as_token_ids": (None, False),
    **{name: values for name, values in UNSUPPORTED.items() if name not in _TAKEN},
}
# The most prompts one completion request may list: each climbs on its own, holding a router slot.
MAX_PROMPTS: Final = 32


def check_fields(body: Mapping[str, Any], *, chat: bool) -> None:
    """Every field of the body is one Stratus honours, or one it does not (whose value
    settings_of checks asks for nothing); anything else is refused by name (``param``), as
    OpenAI refuses an argument it does not recognise."""
    taken = _TAKEN | _TAKEN_ONLY_BY[chat]
    for field in body:
        if field in taken or field in _UNSUPPORTED:  # the latter: settings_of's, by value
            continue
        elsewhere = "/v1/completions" if chat else "/v1/chat/completions"
        where = f"; it belongs to {elsewhere}" if field in _TAKEN_ONLY_BY[not chat] else ""
        raise FieldError(
            field, f"unrecognized field '{field[:64]}'{where}; this endpoint takes {', '.join(sorted(taken))}"
        )
    _check_logprobs(body, chat=chat)


def refuse_unsupported(body: Mapping[str, Any]) -> None:
    """A field Stratus does not honour, at a value asking for something, is refused by name."""
    for field, defaults in _UNSUPPORTED.items():
        if field in body and not _asks_nothing(body[field], defaults):
            listed = " or ".join(json.dumps(d) for d in defaults)
            raise FieldError(field, f"'{field}' is not supported by Stratus; leave it out or at {listed}")


def _asks_nothing(value: Any, defaults: tuple[Any, ...]) -> bool:
    """Whether ``value`` is one of ``defaults``: numbers by value (1.0 is 1), booleans only as
    booleans (True is not the 1 of ``n``)."""
    return any(_same(value, default) for default in defaults)


def _same(value: Any, default: Any) -> bool:
    if isinstance(value, bool) or isinstance(default, bool):
        return type(value) is type(default) and value == default
    number, wanted = _numeric(value), _numeric(default)
    if number is not None and wanted is not None:
        return number == wanted
    return type(value) is type(default) and bool(value == default)


def _numeric(value: Any) -> float | None:
    """A JSON number as a float; None for anything else (booleans included)."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _check_logprobs(body: Mapping[str, Any], *, chat: bool) -> None:
    """``logprobs`` turns on the chosen tokens' log-probabilities; alternatives (chat's
    ``top_logprobs``, a completion's ``logprobs`` above 1) are not returned, so not taken."""
    logprobs = body.get("logprobs")
    if chat and logprobs is not None and not isinstance(logprobs, bool):
        raise FieldError("logprobs", "'logprobs' must be true or false")
    if not chat and logprobs is not None and not isinstance(logprobs, bool | int):
        raise FieldError("logprobs", "'logprobs' must be 0 or 1 (the chosen tokens' log-probabilities)")
    count = _numeric(logprobs)
    if not chat and count is not None and not 0 <= count <= 1:
        raise FieldError(
            "logprobs",
            "'logprobs' above 1 asks for alternatives, which Stratus does not return: 0 or 1 (the chosen tokens)",
        )
    top = body.get("top_logprobs")
    if chat and top is not None and _numeric(top) != 0:
        raise FieldError(
            "top_logprobs", "'top_logprobs' asks for alternatives, which Stratus does not return: 0"
        )


def prompts_of(prompt: Any) -> list[str]:
    """A completion's prompts: one string, or a list of up to MAX_PROMPTS strings."""
    if isinstance(prompt, str):
        return [_non_empty(prompt)]
    listed = prompt if isinstance(prompt, list) and prompt else None
    if listed is not None and all(isinstance(p, str) for p in listed):
        for one in listed:
            _non_empty(one)
        if len(listed) > MAX_PROMPTS:
            raise FieldError(
                "prompt", f"'prompt' lists {len(listed)} prompts; at most {MAX_PROMPTS} are taken"
            )
        return listed
    if listed is not None and (_token_ids(listed) or all(_token_ids(p) for p in listed)):
        raise FieldError("prompt", "token-id prompts are not supported by Stratus: send the text")
    raise FieldError("prompt", "'prompt' must be a string or a non-empty list of strings")


def messages_of(listed: Any) -> tuple[Message, ...]:
    """A chat's whole conversation, in order: each message's role (system, user or
    assistant), its content (a string, or a list of text parts, joined by newlines as vLLM
    joins them; an assistant's may be null) and its name; checked as every front checks one,
    and with a last user message to generate from where a model has no chat template."""
    if not isinstance(listed, list) or not listed:
        raise FieldError("messages", "'messages' must be a non-empty list")
    if len(listed) > MAX_MESSAGES:
        raise FieldError(
            "messages", f"'messages' holds {len(listed)} messages; at most {MAX_MESSAGES} are taken"
        )
    messages = tuple(_message(index, item) for index, item in enumerate(listed))
    check_conversation(messages, param="messages")
    if not last_user_message(messages):
        raise FieldError("messages", "the last user message is empty: a generation needs a prompt")
    return messages


def _message(index: int, item: Any) -> Message:
    """One OpenAI message; a key other than role, content and name is taken only where it
    asks for nothing (an answer's ``tool_calls: []`` sent back), else refused by name."""
    where = f"messages[{index}]"
    if not isinstance(item, dict) or not isinstance(item.get("role"), str):
        raise FieldError("messages", f"{where} must be an object with a string 'role'")
    for key, value in item.items():
        if key not in ("role", "content", "name") and not _empty(value):
            raise FieldError("messages", f"{where} has '{str(key)[:32]}', which Stratus does not take")
    name = item.get("name")
    if name is not None and not isinstance(name, str):
        raise FieldError("messages", f"{where}.name must be a string")
    return Message(role=item["role"], content=_content(where, item["role"], item.get("content")), name=name)


def _content(where: str, role: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":  # OpenAI's schema: an assistant's is optional
        return ""
    if isinstance(content, list) and content:
        return "\n".join(_text(f"{where}.content[{i}]", part) for i, part in enumerate(content))
    raise FieldError("messages", f"{where}.content must be a string or a non-empty list of text parts")


def _text(where: str, part: Any) -> str:
    """A content part's text: only ``{"type": "text", "text": ...}`` parts are taken."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind != "text":
        named = f"a '{str(kind)[:32]}' part" if isinstance(kind, str) else "not a content part"
        raise FieldError("messages", f"{where} is {named}; Stratus takes only text parts")
    if not isinstance(part.get("text"), str) or set(part) != {"type", "text"}:
        raise FieldError("messages", f"{where} must be exactly {{'type': 'text', 'text': a string}}")
    text: str = part["text"]
    return text


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, str | list | dict) and not value)


def _non_empty(prompt: str) -> str:
    """An empty prompt gives a runtime nothing to continue (OpenVINO GenAI fails an
    assertion on it): refused at the door, as vLLM refuses it."""
    if not prompt:
        raise FieldError("prompt", "'prompt' is empty: a generation needs a prompt")
    return prompt


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def settings_of(body: Mapping[str, Any], model: str, limit: int) -> GenerationParams:
    """The generation's settings from the body, checked as for every front."""
    refuse_unsupported(body)
    values = {key: body[key] for key in SETTINGS if key in body}
    if MAX_TOKENS not in values and "max_completion_tokens" in body:
        values[MAX_TOKENS] = body["max_completion_tokens"]
    return settings_from(values, limit=limit, model=model)


def choices_of(body: Mapping[str, Any], prompts: int) -> int:
    """``n``: choices per prompt, each generated (and climbing) on its own; at most
    MAX_PROMPTS choices in all, as a list of prompts."""
    n = body.get("n", 1)
    count = _numeric(n)
    if count is None or count != int(count) or count < 1:
        raise FieldError("n", "'n' must be a whole number of choices, at least 1")
    if int(count) * prompts > MAX_PROMPTS:
        raise FieldError(
            "n",
            f"'n' of {int(count)} for {prompts} prompt(s) asks for {int(count) * prompts} choices; at most {MAX_PROMPTS}",
        )
    return int(count)


def choice_params(params: GenerationParams, choice: int) -> GenerationParams:
    """The settings of one of a prompt's ``n`` choices: a seed given is the first choice's,
    and each next choice draws from the next seed (int64, wrapping), so n sampled choices
    differ and repeat; greedy choices are alike, as vLLM's are."""
    if params.seed is None or choice == 0:
        return params
    seed = (params.seed + choice + _HALF) % (2 * _HALF) - _HALF
    return dataclasses.replace(params, seed=seed)


_HALF: Final = 1 << 63


def usage_asked(body: Mapping[str, Any], stream: bool) -> bool:
    """Whether ``stream_options`` asks for a last chunk with the usage."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise FieldError("stream_options", "'stream_options' is only taken with 'stream': true")
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise FieldError("stream_options", "'stream_options' takes only 'include_usage' (true or false)")
    if options.get("continuous_usage_stats"):
        raise FieldError("stream_options", "'continuous_usage_stats' is not supported by Stratus")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise FieldError("stream_options", "'stream_options.include_usage' must be true or false")
    return include


def options_of(body: Mapping[str, Any]) -> dict[str, float | str]:
    """The body's ``stratus`` object, checked, as OIP parameter values."""
    options = body.get("stratus", {})
    if not isinstance(options, dict):
        raise InvalidInput("'stratus' must be an object")
    checked: dict[str, float | str] = {}
    for key, value in options.items():
        kind = _OPTIONS.get(key)
        if kind is None:
            raise InvalidInput(f"unknown 'stratus' option '{key}'; known: {sorted(_OPTIONS)}")
        if kind is float and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise InvalidInput(f"'stratus.{key}' must be a number")
        if kind is str and not isinstance(value, str):
            raise InvalidInput(f"'stratus.{key}' must be a string")
        checked[f"{PREFIX}{key}"] = _number(key, value) if kind is float else value
    return checked


def text_request(
    model: str,
    prompt: str,
    params: GenerationParams,
    options: Mapping[str, float | str],
    messages: tuple[Message, ...] = (),
) -> TextRequest:
    """One prompt (and a chat's conversation) as the request the cascade takes: no protobuf
    is built for it."""
    return TextRequest(
        model_name=model,
        id=uuid.uuid4().hex[:16],
        prompt=prompt,
        params=params,
        options=RequestOptions.from_values(options),
        messages=messages,
    )


def _number(key: str, value: int | float) -> float:
    try:
        return float(value)
    except OverflowError:  # an integer past any double (10**400)
        raise InvalidInput(f"'stratus.{key}' is out of range") from None
