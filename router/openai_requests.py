"""The OpenAI API's request bodies, read and checked: the prompts, the generation's settings
(:mod:`stratus.families.sampling`, the same rules as over the Open Inference Protocol), the
``stream_options``, Stratus's own ``stratus`` options, and each prompt as the Open Inference
Protocol request the cascade takes. Whatever is not honoured is refused by name (``param``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any, Final

from stratus.convert.inference import TextRequest
from stratus.convert.parameters import PREFIX, RequestOptions
from stratus.errors import InvalidInput
from stratus.families.generation import MAX_TOKENS, GenerationParams
from stratus.families.sampling import SETTINGS, FieldError, settings_from

_OPTIONS: Final = {"budget_ms": float, "min_confidence": float, "max_tier": str, "min_tier": str}
# Fields OpenAI's API takes that Stratus does not honour: each refused when it asks for
# something other than its default, never silently ignored.
_UNSUPPORTED: Final = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "best_of": 1,
    "echo": False,
    "suffix": None,
    "logit_bias": None,
}
# The most prompts one completion request may list: each climbs on its own, holding a router slot.
MAX_PROMPTS: Final = 32


def refuse_unsupported(body: Mapping[str, Any]) -> None:
    for field, default in _UNSUPPORTED.items():
        value = body.get(field, default)
        if value == default or value in ({}, [], ""):
            continue
        raise FieldError(
            field, f"'{field}' is not supported by Stratus; leave it out or at {json.dumps(default)}"
        )


def prompts_of(prompt: Any) -> list[str]:
    """A completion's prompts: one string, or a list of up to MAX_PROMPTS strings."""
    if isinstance(prompt, str):
        return [prompt]
    listed = prompt if isinstance(prompt, list) and prompt else None
    if listed is not None and all(isinstance(p, str) for p in listed):
        if len(listed) > MAX_PROMPTS:
            raise FieldError(
                "prompt", f"'prompt' lists {len(listed)} prompts; at most {MAX_PROMPTS} are taken"
            )
        return listed
    if listed is not None and (_token_ids(listed) or all(_token_ids(p) for p in listed)):
        raise FieldError("prompt", "token-id prompts are not supported by Stratus: send the text")
    raise FieldError("prompt", "'prompt' must be a string or a non-empty list of strings")


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def settings_of(body: Mapping[str, Any], model: str, limit: int) -> GenerationParams:
    """The generation's settings from the body, checked as for every front."""
    if body.get("n", 1) != 1:
        raise FieldError("n", "'n' must be 1")
    refuse_unsupported(body)
    values = {key: body[key] for key in SETTINGS if key in body}
    if MAX_TOKENS not in values and "max_completion_tokens" in body:
        values[MAX_TOKENS] = body["max_completion_tokens"]
    return settings_from(values, limit=limit, model=model)


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
    model: str, prompt: str, params: GenerationParams, options: Mapping[str, float | str]
) -> TextRequest:
    """One prompt as the request the cascade takes: no protobuf is built for it."""
    return TextRequest(
        model_name=model,
        id=uuid.uuid4().hex[:16],
        prompt=prompt,
        params=params,
        options=RequestOptions.from_values(options),
    )


def _number(key: str, value: int | float) -> float:
    try:
        return float(value)
    except OverflowError:  # an integer past any double (10**400)
        raise InvalidInput(f"'stratus.{key}' is out of range") from None
