"""A chat request's conversation, as it travels to every tier.

Each tier renders the conversation with its own model's chat template (tiers can run
different models, each trained on its own turn markers), so the router never renders it: it
sends the messages along. On the Open Inference Protocol they travel as the request parameter
``stratus.messages``, a JSON array of ``{"role", "content"}`` objects (``"name"`` too where
given), beside the usual ``text_input``, which stays the prompt of a variant whose model has
no chat template (the OpenAI API puts the last user message there) and of any server that
does not know the parameter (tritonclient's and Triton's generate usage is unchanged). A tier
that rendered the conversation says so in its answer: ``stratus.chat_template`` true.

Roles are OpenAI's ``system``, ``user`` and ``assistant``; contents are strings. A
conversation holds at most MAX_MESSAGES messages and MAX_CONVERSATION_BYTES of JSON, checked
before it is decoded; anything else is refused by name (``param``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from stratus.families.sampling import FieldError, read_json

MESSAGES: Final = "stratus.messages"  # request parameter: the conversation, JSON
CHAT_TEMPLATE: Final = "stratus.chat_template"  # response parameter: true where a template rendered it
ROLES: Final = ("system", "user", "assistant")
MAX_MESSAGES: Final = 1024
MAX_CONVERSATION_BYTES: Final = 1 << 20  # as a prompt's bound (MAX_PROMPT_BYTES)


@dataclass(frozen=True, kw_only=True)
class Message:
    """One turn of a conversation; ``name`` as OpenAI's optional participant name."""

    role: str
    content: str
    name: str | None = None

    def as_dict(self) -> dict[str, str]:
        """The message as a template (and the wire) sees it: only the keys it has."""
        base = {"role": self.role, "content": self.content}
        return base if self.name is None else {**base, "name": self.name}


def check_conversation(messages: Sequence[Message], *, param: str) -> str:
    """The conversation's JSON, checked: a known role on each message, a user message among
    them, and within MAX_MESSAGES and MAX_CONVERSATION_BYTES."""
    if not messages:
        raise FieldError(param, f"'{param}' must be a non-empty list of messages")
    if len(messages) > MAX_MESSAGES:
        raise FieldError(param, f"'{param}' holds {len(messages)} messages; at most {MAX_MESSAGES} are taken")
    for index, message in enumerate(messages):
        if message.role not in ROLES:
            raise FieldError(
                param, f"{param}[{index}] has role '{message.role[:32]}'; the roles taken are {list(ROLES)}"
            )
    if not any(m.role == "user" for m in messages):
        raise FieldError(param, f"'{param}' has no user message")
    encoded = conversation_json(messages)
    if len(encoded.encode("utf-8")) > MAX_CONVERSATION_BYTES:
        raise FieldError(param, f"'{param}' is over {MAX_CONVERSATION_BYTES} bytes of JSON")
    return encoded


def conversation_json(messages: Sequence[Message]) -> str:
    """What ``stratus.messages`` carries: compact JSON, non-ASCII text as itself."""
    return json.dumps([m.as_dict() for m in messages], ensure_ascii=False, separators=(",", ":"))


def read_conversation(raw: object) -> tuple[Message, ...]:
    """The conversation a ``stratus.messages`` parameter carries, checked as it was sent."""
    if not isinstance(raw, str):
        raise FieldError(MESSAGES, f"'{MESSAGES}' must be a string (a JSON array of messages)")
    shape = "a JSON array of messages"
    listed = read_json(raw, MESSAGES, limit=MAX_CONVERSATION_BYTES, kind=list, shape=shape)
    messages = tuple(_message(index, item) for index, item in enumerate(listed[: MAX_MESSAGES + 1]))
    check_conversation(messages, param=MESSAGES)
    return messages


def _message(index: int, item: Any) -> Message:
    """One wire message: exactly ``role`` and ``content`` strings, and maybe a ``name``."""
    where = f"{MESSAGES}[{index}]"
    if not isinstance(item, dict) or not set(item) <= {"role", "content", "name"}:
        raise FieldError(MESSAGES, f"{where} must be an object of 'role', 'content' and maybe 'name'")
    role, content, name = item.get("role"), item.get("content"), item.get("name")
    if not isinstance(role, str) or not isinstance(content, str) or not isinstance(name, str | None):
        raise FieldError(MESSAGES, f"{where} must have string 'role' and 'content' (and 'name', if any)")
    return Message(role=role, content=content, name=name)


def last_user_message(messages: Sequence[Message]) -> str:
    """The prompt of a variant without a chat template: the last user message's content."""
    return next(m.content for m in reversed(messages) if m.role == "user")
