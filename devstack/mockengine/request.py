"""The mock engine's request: a chat-completions body parsed and checked (pure, no I/O).

Used by :mod:`devstack.mockengine.server`: ``req = parse_chat(raw, model, max_tokens)``,
``reply_seed(header)``; both raise :class:`RequestError` (status, message, parameter),
which the server answers in OpenAI's error shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from devstack.mockengine import parts as mp
from worker.engines.client import REPLY_SEED_HEADER

__all__ = ["ChatRequest", "RequestError", "parse_chat", "reply_seed"]


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


@dataclass(frozen=True, slots=True)
class ChatRequest:
    model: str
    messages: list[Mapping[str, object]]
    stream: bool
    max_tokens: int
    include_usage: bool
    seed: int | None = None  # X-Reply-Seed
    body: dict[str, Any] = field(default_factory=dict)  # the options: tools, stop, ...


def parse_chat(raw: bytes, model: str, max_tokens_default: int) -> ChatRequest:
    """A chat-completions body, checked as an OpenAI-compatible server checks it (the
    mock's own refusals of options it cannot honour included); :class:`RequestError`
    with the status, message and parameter otherwise."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RequestError(400, f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError(400, "body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(400, f"messages[{i}] needs a string 'role'", "messages")
        if not isinstance(m.get("content"), str | list) and not m.get("tool_calls"):
            raise RequestError(400, f"messages[{i}] needs 'content'", "messages")
    model = body.get("model", model)
    if not isinstance(model, str):
        raise RequestError(400, "'model' must be a string", "model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "'stream' must be a boolean", "stream")
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    if max_tokens is None:
        max_tokens = max_tokens_default
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise RequestError(400, "'max_tokens' must be a positive integer", "max_tokens")
    opts = body.get("stream_options")
    include_usage = isinstance(opts, dict) and opts.get("include_usage") is True
    if (no := mp.refused(body)) is not None:
        raise RequestError(400, *no)
    return ChatRequest(model, messages, stream, max_tokens, include_usage, body=body)


def reply_seed(value: str) -> int:
    """The ``X-Reply-Seed`` header's integer; 400 for anything else."""
    try:
        if len(value) > 20:
            raise ValueError(value)
        return int(value, 10)
    except ValueError:
        raise RequestError(400, f"{REPLY_SEED_HEADER} must be an integer") from None
