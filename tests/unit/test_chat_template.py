"""Chat templates as transformers renders them: the conversation in order, the generation
prompt asked for, the GGUF's own BOS and EOS texts, Jinja2's block trimming; a template that
raises, reaches past its sandbox or compiles not at all is a clear Stratus error, never a
traceback; a GGUF without a template has none (its variant keeps the last user message)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stratus.errors import InvalidInput, ModelLoadError
from stratus.families.chat import Message
from stratus.runtimes.chat_template import ChatTemplate, chat_template_of
from stratus.runtimes.gguf import read_header
from tests.gguf_kv import ARITH, with_strings

CONVERSATION = (
    Message(role="system", content="S"),
    Message(role="user", content="12+"),
    Message(role="assistant", content=""),
    Message(role="user", content="30=", name="ann"),
)
# A template shaped like the common ones: turn markers, a BOS first, EOS after each answer.
TURNS = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}\n"
    "{% else %}<{{ m['role'] }}{% if m.name %} {{ m.name }}{% endif %}>{{ m['content'] }}\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_a_template_renders_the_whole_conversation_with_the_special_tokens_it_is_given() -> None:
    template = ChatTemplate(TURNS, bos_token="<s>", eos_token="</s>")
    assert template.render(CONVERSATION) == "<s><system>S\n<user>12+\n</s>\n<user ann>30=\n<assistant>"


def test_blocks_are_trimmed_as_transformers_trims_them() -> None:
    """trim_blocks drops the newline after a block tag; lstrip_blocks the indent before one."""
    source = "{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.content }};\n    {% endif %}\n{% endfor %}"
    assert ChatTemplate(source).render(CONVERSATION) == "12+;\n30=;\n"


def test_tojson_keeps_non_ascii_and_loop_controls_work() -> None:
    source = "{% for m in messages %}{% if m.role == 'assistant' %}{% break %}{% endif %}{{ m | tojson }}{% endfor %}"
    rendered = ChatTemplate(source).render((Message(role="user", content="é<"), *CONVERSATION[2:]))
    assert rendered == '{"role": "user", "content": "é<"}'


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ("{{ raise_exception('roles must alternate') }}", "TemplateError: roles must alternate"),
        ("{{ messages[9].content }}", "UndefinedError"),
        ("{{ messages.append(1) }}", "SecurityError"),  # the sandbox: a template cannot change its input
        (
            "{{ ''.__class__.__mro__ }}",
            "SecurityError: access to attribute '__class__'",
        ),  # nor reach Python's internals
        ("{{ 1 // 0 }}", "ZeroDivisionError"),
        ("{% if false %}x{% endif %}", "rendered the conversation as an empty prompt"),
    ],
)
def test_a_template_that_fails_to_render_refuses_the_request_saying_what_it_said(
    source: str, words: str
) -> None:
    with pytest.raises(InvalidInput, match=words) as refused:
        ChatTemplate(source, origin="the chat template of m.gguf").render(CONVERSATION)
    assert str(refused.value).startswith("the chat template of m.gguf ")


def test_a_rendered_prompt_past_the_bound_is_refused() -> None:
    with pytest.raises(InvalidInput, match="rendered a prompt over 1048576 bytes"):
        ChatTemplate("{% for i in range(70000) %}{{ messages[1].content * 6 }}{% endfor %}").render(
            CONVERSATION
        )


def test_a_template_that_does_not_compile_fails_the_load_naming_its_line() -> None:
    with pytest.raises(ModelLoadError, match=r"of m\.gguf does not compile \(line 2\)"):
        ChatTemplate("ok\n{% for m in messages %}", origin="the chat template of m.gguf")


def test_a_gguf_without_a_template_has_none_and_one_with_it_gives_its_own_bos_and_eos(tmp_path: Path) -> None:
    shipped = ARITH / "arith-small.gguf"
    assert chat_template_of(shipped) is None
    target = tmp_path / "templated.gguf"
    with_strings(shipped, target, {"tokenizer.chat_template": "{{ bos_token }}|{{ eos_token }}"})
    template = chat_template_of(target)
    assert template is not None
    metadata = read_header(shipped).metadata
    tokens = metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, list)
    bos, eos = metadata["tokenizer.ggml.bos_token_id"], metadata["tokenizer.ggml.eos_token_id"]
    assert isinstance(bos, int) and isinstance(eos, int)
    assert template.render(CONVERSATION) == f"{tokens[bos]}|{tokens[eos]}"
    assert "templated.gguf" in template.origin


def test_a_template_that_is_not_a_string_fails_the_load(tmp_path: Path) -> None:
    import struct

    shipped = ARITH / "arith-small.gguf"
    target = tmp_path / "odd.gguf"
    with_strings(shipped, target, {"tokenizer.chat_template": "x"})
    data = bytearray(target.read_bytes())
    key = b"tokenizer.chat_template"
    at = data.index(key) + len(key)
    data[at : at + 4] = struct.pack("<I", 4)  # its type now uint32 (the string's length's low bytes follow)
    target.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"'tokenizer\.chat_template' is not a string"):
        chat_template_of(target)
