"""OpenAI chat messages -> the processor's messages, plus a key per message that identifies a conversation.

A message's key is ``(role, parts)`` with ``("text", str)`` and ``("image", sha256 of the decoded pixels)`` parts:
two requests share a conversation prefix exactly when their first messages have equal keys (same texts, same
images, whichever way the image was sent).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import RequestError
from .images import ImageLoader

ROLES = ("system", "user", "assistant")
CONTENT_TYPES = ("text", "image_url")


@dataclass(frozen=True)
class ParsedMessage:
    key: tuple  # (role, ((kind, value), ...))
    message: dict  # {"role", "content": [{"type": "text"/"image", ...}]} for the processor's chat template


def assistant_message(answer: str) -> ParsedMessage:
    """The parsed form of an answer this server gave (what a client sends back as the assistant turn)."""
    return ParsedMessage(key=("assistant", (("text", answer),)),
                         message={"role": "assistant", "content": [{"type": "text", "text": answer}]})


def parse_messages(messages, loader: ImageLoader) -> list[ParsedMessage]:
    """Checks and converts ``body["messages"]``; raises `RequestError` naming the offending message / part."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of chat messages")
    parsed = [_message(i, m, loader) for i, m in enumerate(messages)]
    if parsed[-1].key[0] != "user":
        raise RequestError(f"messages[{len(parsed) - 1}]: the last message must have role 'user', "
                           f"got {parsed[-1].key[0]!r}")
    return parsed


def _message(index: int, message, loader: ImageLoader) -> ParsedMessage:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise RequestError(f"{where} must be an object with 'role' and 'content', got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise RequestError(f"{where}.role must be one of {list(ROLES)}, got {role!r}")
    for name in message:
        if name not in ("role", "content", "name"):
            raise RequestError(f"{where}: field {name!r} is not supported (tools / tool calls are not served); "
                               "allowed: role, content, name")
    content = message.get("content")
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if not isinstance(content, list) or not content:
        raise RequestError(f"{where}.content must be a non-empty string or list of content parts")
    parts, processor_parts = [], []
    for j, part in enumerate(content):
        part_where = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise RequestError(f"{part_where} must be an object with a 'type', got {type(part).__name__}")
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise RequestError(f"{part_where}.text must be a string, got {type(text).__name__}")
            parts.append(("text", text))
            processor_parts.append({"type": "text", "text": text})
        elif kind == "image_url":
            if role != "user":
                raise RequestError(f"{part_where}: images are allowed in user messages only, not in {role!r}")
            image_url = part.get("image_url")
            url = image_url.get("url") if isinstance(image_url, dict) else image_url
            detail = image_url.get("detail") if isinstance(image_url, dict) else None
            if detail not in (None, "auto"):
                raise RequestError(f"{part_where}.image_url.detail must be 'auto' (or absent): the model's "
                                   f"processor decides the resolution; got {detail!r}")
            image, digest = loader.load(url, f"{part_where}.image_url")
            parts.append(("image", digest))
            processor_parts.append({"type": "image", "image": image})
        else:
            raise RequestError(f"{part_where}.type {kind!r} is not supported; allowed: {list(CONTENT_TYPES)}")
    has_text = any(kind == "text" and value.strip() for kind, value in parts)
    if role != "assistant" and not has_text and not any(kind == "image" for kind, _ in parts):
        raise RequestError(f"{where}: the message is empty (no text, no image)")
    return ParsedMessage(key=(role, tuple(parts)), message={"role": role, "content": processor_parts})
