"""What a generative request asks of its generation, read and checked once for every front.

The same five settings arrive three ways, under the names vLLM gives them: as fields of an
OpenAI body, as Open Inference Protocol request parameters, or as the JSON object of Triton's
vLLM-backend input ``sampling_parameters`` (BYTES, shape [1]). Each is honoured or refused by
name, never ignored:

* ``max_tokens``: 1 up to the family's limit (the family's limit when absent);
* ``stop``: up to 4 strings (one string as a parameter; a list in JSON or an OpenAI body);
  generation ends at the first, which is not part of the answer;
* ``temperature`` (0 to 2; 0, the default, decodes greedily), ``top_p`` (above 0, up to 1)
  and ``seed`` (an int64: the same seed, prompt and variant on the same runtime sample the
  same answer).

vLLM's other sampling settings (penalties, ``top_k``, ``n``, ``logprobs``...) are refused
unless at their defaults; a key of ``sampling_parameters`` that is none of these is refused
too. A key given both as a parameter and in ``sampling_parameters`` must agree.

The tiers are sent the checked settings (:func:`sampling_object`): ``max_tokens`` as a
parameter, as always, and, only when a request asks for more than that, all of them in a
``sampling_parameters`` input, which a Triton vLLM backend in the cloud reads as well.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, Final

from stratus.datatypes import ParameterValue
from stratus.errors import InvalidInput
from stratus.families.generation import MAX_TOKENS, GenerationParams

SAMPLING_PARAMETERS: Final = "sampling_parameters"
STOP: Final = "stop"
TEMPERATURE: Final = "temperature"
TOP_P: Final = "top_p"
SEED: Final = "seed"
SETTINGS: Final = (MAX_TOKENS, STOP, TEMPERATURE, TOP_P, SEED)
MAX_STOPS: Final = 4  # OpenAI's limit
MAX_STOP_CHARS: Final = 256
MAX_TEMPERATURE: Final = 2.0
MAX_SETTINGS_BYTES: Final = 4096  # of a sampling_parameters object
_INT64: Final = 1 << 63

# vLLM's sampling settings that Stratus does not honour, and the values that ask for nothing.
UNSUPPORTED: Final[dict[str, tuple[Any, ...]]] = {
    "n": (1,),
    "best_of": (1, None),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),
    "top_k": (0, -1),
    "min_p": (0,),
    "min_tokens": (0,),
    "ignore_eos": (False,),
    "stop_token_ids": (None, []),
    "logprobs": (None,),
    "prompt_logprobs": (None,),
    "logit_bias": (None, {}),
    "bad_words": (None, []),
    "allowed_token_ids": (None, []),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "detokenize": (True,),
    "structured_outputs": (None,),
    "guided_decoding": (None,),
    "lora_name": (None, ""),
    "use_beam_search": (False,),
    "length_penalty": (1,),
    "early_stopping": (False,),
}


class FieldError(InvalidInput):
    """A bad setting, named in ``param`` (OpenAI's error field) as well as in the message."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def settings_from(values: Mapping[str, Any], *, limit: int, model: str) -> GenerationParams:
    """The settings among ``values`` (an OpenAI body, a ``sampling_parameters`` object), checked."""
    for key, defaults in UNSUPPORTED.items():
        if key in values and not _is_default(values[key], defaults):
            raise FieldError(key, f"'{key}' is not supported by Stratus; leave it out or at {defaults[0]!r}")
    return GenerationParams(
        max_tokens=check_max_tokens(values.get(MAX_TOKENS, limit), limit, model),
        stop=_stops(values.get(STOP)),
        temperature=_number(values, TEMPERATURE, 0.0, low=0.0, high=MAX_TEMPERATURE),
        top_p=_number(values, TOP_P, 1.0, low=0.0, high=1.0, low_open=True),
        seed=_seed(values.get(SEED)),
    )


def read_settings(
    parameters: Mapping[str, ParameterValue | None], sampling: bytes | None, *, limit: int, model: str
) -> GenerationParams:
    """An OIP request's settings: its parameters and its ``sampling_parameters`` JSON, if any."""
    given = {k: parameters[k] for k in (*SETTINGS, *UNSUPPORTED) if k in parameters}
    if sampling is not None:
        for key, value in _sampling_object(sampling).items():
            if key in given and given[key] != value:
                raise FieldError(
                    key, f"'{key}' is given twice (a parameter and in {SAMPLING_PARAMETERS}), differently"
                )
            given[key] = value
    return settings_from(given, limit=limit, model=model)


def sampling_object(params: GenerationParams) -> dict[str, Any] | None:
    """What the tiers are sent in ``sampling_parameters``: every setting, where a request asks
    for more than ``max_tokens`` (which always travels as a parameter too); else None."""
    extra: dict[str, Any] = {}
    if params.stop:
        extra[STOP] = list(params.stop)
    if params.sampled:
        extra |= {TEMPERATURE: params.temperature, TOP_P: params.top_p}
        if params.seed is not None:
            extra[SEED] = params.seed
    return {MAX_TOKENS: params.max_tokens, **extra} if extra else None


def read_json(raw: str | bytes, name: str, *, limit: int, kind: type, shape: str) -> Any:
    """``raw`` (a request's input or parameter) parsed as JSON of type ``kind``, each refusal
    naming ``name``; over ``limit`` bytes (a string's characters, which are no more) it is
    refused before it is parsed."""
    if len(raw) > limit:
        raise FieldError(name, f"'{name}' is over {limit} bytes")
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        raise FieldError(name, f"'{name}' is not JSON") from None
    if not isinstance(value, kind):
        raise FieldError(name, f"'{name}' must be {shape}")
    return value


def _sampling_object(raw: bytes) -> dict[str, Any]:
    values: dict[str, Any] = read_json(
        raw, SAMPLING_PARAMETERS, limit=MAX_SETTINGS_BYTES, kind=dict, shape="a JSON object"
    )
    unknown = sorted(set(values) - set(SETTINGS) - set(UNSUPPORTED))
    if unknown:
        raise FieldError(
            unknown[0],
            f"'{unknown[0][:64]}' is not a sampling parameter Stratus knows; known: {list(SETTINGS)}",
        )
    return values


def _is_default(value: Any, defaults: tuple[Any, ...]) -> bool:
    """``value`` is one of ``defaults`` (True is not 1 here, nor 0 False)."""
    return any(
        value is d if isinstance(d, bool) or d is None else value == d and not isinstance(value, bool)
        for d in defaults
    )


def check_max_tokens(value: Any, limit: int, model: str) -> int:
    """``max_tokens`` as an integer from 1 to the family's limit, or a FieldError naming it."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise FieldError(
            MAX_TOKENS,
            f"'{MAX_TOKENS}' must be an integer between 1 and {limit} for '{model}', not {value!r:.40}",
        )
    return value


def _stops(value: Any) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value if value is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise FieldError(STOP, f"'{STOP}' must be a string or a list of strings")
    stops = [s for s in stops if s]
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise FieldError(
            STOP, f"'{STOP}' takes at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters"
        )
    return tuple(dict.fromkeys(stops))


def _number(
    values: Mapping[str, Any], key: str, default: float, *, low: float, high: float, low_open: bool = False
) -> float:
    value = values.get(key, default)
    if value is None:
        return default
    number = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan
    if not (low < number if low_open else low <= number) or not number <= high:
        bounds = f"{'above' if low_open else 'from'} {low:g} {'up ' if low_open else ''}to {high:g}"
        raise FieldError(key, f"'{key}' must be a number {bounds}, not {value!r:.40}")
    return number


def _seed(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not -_INT64 <= value < _INT64:
        raise FieldError(SEED, f"'{SEED}' must be an int64, not {value!r:.40}")
    return value
