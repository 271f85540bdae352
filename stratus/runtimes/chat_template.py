"""A generative variant's chat template, read from its GGUF file and rendered as Hugging Face
``transformers`` renders one, so a conversation becomes the prompt its model was trained on.

The template (``tokenizer.chat_template``) is Jinja2, run in an ``ImmutableSandboxedEnvironment``
(it reads what it is given, never calls out or changes it) with ``trim_blocks``,
``lstrip_blocks``, ``loopcontrols``, the ``tojson`` filter and the ``raise_exception`` and
``strftime_now`` globals, as transformers sets them; it is given ``messages``,
``add_generation_prompt`` (true: the answer is the assistant's next turn), and ``bos_token``
and ``eos_token``, the texts of the GGUF's BOS and EOS tokens ("" where it names none). A
template that does not compile fails the variant's load (ModelLoadError naming the file); one
that raises while rendering (``raise_exception("roles must alternate")``, an undefined name
used, a sandbox refusal) refuses the request (InvalidInput saying what the template said).
Jinja2 is imported only where a GGUF carries a template.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Final

from stratus.errors import InvalidInput, ModelLoadError
from stratus.families.chat import Message
from stratus.runtimes.gguf import GgufValue, read_header

TEMPLATE_KEY: Final = "tokenizer.chat_template"
TOKENS_KEY: Final = "tokenizer.ggml.tokens"
BOS_KEY: Final = "tokenizer.ggml.bos_token_id"
EOS_KEY: Final = "tokenizer.ggml.eos_token_id"
MAX_RENDERED_BYTES: Final = 1 << 20  # a rendered prompt, as any prompt (MAX_PROMPT_BYTES)


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template and the special tokens it is given."""

    source: str
    bos_token: str = ""
    eos_token: str = ""
    origin: str = "the chat template"  # names it in errors: the file it came from
    _compiled: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compiled", _compile(self.source, self.origin))

    def render(self, messages: Sequence[Message]) -> str:
        """The conversation as the model's prompt; InvalidInput where the template refuses it."""
        try:
            text = self._compiled.render(
                messages=[m.as_dict() for m in messages],
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except Exception as exc:  # a template's own raise_exception, or any error it runs into
            raise InvalidInput(
                f"{self.origin} refused the conversation: {type(exc).__name__}: {exc}"
            ) from None
        if not isinstance(text, str) or not text:
            raise InvalidInput(f"{self.origin} rendered the conversation as an empty prompt")
        if len(text) * 4 > MAX_RENDERED_BYTES and len(text.encode("utf-8")) > MAX_RENDERED_BYTES:
            raise InvalidInput(f"{self.origin} rendered a prompt over {MAX_RENDERED_BYTES} bytes")
        return text


def chat_template_of(path: Path) -> ChatTemplate | None:
    """The chat template a GGUF file carries, with its BOS and EOS texts; None where it has none."""
    metadata = read_header(path).metadata
    source = metadata.get(TEMPLATE_KEY)
    if source is None or source == "":
        return None
    if not isinstance(source, str):
        raise ModelLoadError(f"{path}: '{TEMPLATE_KEY}' is not a string")
    tokens = metadata.get(TOKENS_KEY)
    return ChatTemplate(
        source,
        bos_token=_token_text(tokens, metadata.get(BOS_KEY)),
        eos_token=_token_text(tokens, metadata.get(EOS_KEY)),
        origin=f"the chat template of {path.name}",
    )


def _token_text(tokens: GgufValue | None, index: GgufValue | None) -> str:
    """A special token's text, by its id in the vocabulary ("" where either is missing)."""
    if not isinstance(tokens, list) or not isinstance(index, int) or not 0 <= index < len(tokens):
        return ""
    text = tokens[index]
    return text if isinstance(text, str) else ""


def _compile(source: str, origin: str) -> Any:
    """The template compiled in transformers' sandboxed environment."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:
        raise ModelLoadError(
            f"{origin} needs Jinja2, which is not installed ({exc}): the 'llm' extra"
        ) from None

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelLoadError(f"{origin} does not compile (line {exc.lineno}): {exc.message}") from None


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson``: non-ASCII kept (Jinja2's own escapes HTML characters)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(pattern: str) -> str:
    return datetime.now().strftime(pattern)
