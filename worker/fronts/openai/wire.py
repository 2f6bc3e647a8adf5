"""The OpenAI chat-completions wire format, as pure functions (no I/O).

What the gateway (:mod:`worker.fronts.openai.http`) needs to speak OpenAI to any client:
parse and bound a ``POST /v1/chat/completions`` body, build the streamed
``chat.completion.chunk`` objects and the whole ``chat.completion`` (error bodies in
OpenAI's shape: :func:`relay.service.errors.error_body`).

Order of use: :func:`parse_request` (raises :class:`worker.fronts.errors.WireError`,
answered with its status) -> per delta :func:`chunk` -> :func:`usage_chunk` when asked ->
``data: [DONE]``; or :func:`completion` for ``stream: false``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from worker.fronts.errors import WireError

__all__ = [
    "PASS_THROUGH",
    "ChatRequest",
    "WireError",
    "chunk",
    "completion",
    "new_id",
    "parse_request",
    "usage",
    "usage_chunk",
]

ROLES: Final = frozenset(("system", "developer", "user", "assistant", "tool"))
# Sampling options forwarded to the engine unchanged when the client sets them.
PASS_THROUGH: Final = (
    "temperature",
    "top_p",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "n",
)
_MAX_MESSAGES: Final = 1024


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A checked request: text-only ``messages``, the bounded ``max_tokens``."""

    model: str
    messages: list[dict[str, str]]
    stream: bool
    include_usage: bool
    max_tokens: int
    user: str | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def system(self) -> str | None:
        """The leading system (or developer) prompt, which names the routing prefix."""
        if self.messages and self.messages[0]["role"] in ("system", "developer"):
            return self.messages[0]["content"]
        return None

    @property
    def conversation(self) -> list[dict[str, str]]:
        return self.messages[1:] if self.system is not None else self.messages


def _content(value: object, i: int) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise WireError(400, f"messages[{i}].content: only text parts are supported",
                                param=f"messages[{i}].content")  # fmt: skip
            text = part.get("text")
            if not isinstance(text, str):
                raise WireError(400, f"messages[{i}].content: a text part needs 'text'",
                                param=f"messages[{i}].content")  # fmt: skip
            parts.append(text)
        return "".join(parts)
    if value is None:
        return ""
    raise WireError(400, f"messages[{i}].content must be a string or a list of text parts",
                    param=f"messages[{i}].content")  # fmt: skip


def _messages(raw: object, max_chars: int) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise WireError(400, "'messages' must be a non-empty array", param="messages")
    if len(raw) > _MAX_MESSAGES:
        raise WireError(400, f"at most {_MAX_MESSAGES} messages", param="messages")
    out: list[dict[str, str]] = []
    total = 0
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise WireError(400, f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise WireError(400, f"messages[{i}].role must be one of {sorted(ROLES)}",
                            param=f"messages[{i}].role")  # fmt: skip
        text = _content(m.get("content"), i)
        total += len(text)
        if total > max_chars:
            raise WireError(413, f"the messages hold more than {max_chars} characters",
                            code="context_length_exceeded", param="messages")  # fmt: skip
        out.append({"role": str(role), "content": text})
    return out


def _int_field(body: Mapping[str, Any], name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise WireError(400, f"'{name}' must be an integer", param=name)
    return v


def parse_request(
    body: object, *, model: str, default_max_tokens: int, max_tokens_limit: int, max_chars: int
) -> ChatRequest:
    """Check a decoded request body against the served ``model`` and the bounds.

    ``max_tokens`` (or ``max_completion_tokens``) must be in ``1..max_tokens_limit``;
    absent, ``default_max_tokens`` is sent: the engine never generates without a bound.
    """
    if not isinstance(body, dict):
        raise WireError(400, "the body must be a JSON object")
    asked = body.get("model")
    if asked is not None and not isinstance(asked, str):
        raise WireError(400, "'model' must be a string", param="model")
    if asked and asked != model:
        raise WireError(404, f"the model '{asked}' does not exist; this gateway serves "
                        f"'{model}' (GET /v1/models)", code="model_not_found",
                        param="model")  # fmt: skip
    messages = _messages(body.get("messages"), max_chars)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise WireError(400, "'stream' must be a boolean", param="stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise WireError(400, "'stream_options' must be an object", param="stream_options")
    mt = _int_field(body, "max_completion_tokens")
    if mt is None:
        mt = _int_field(body, "max_tokens")
    if mt is not None and not 1 <= mt <= max_tokens_limit:
        raise WireError(400, f"'max_tokens' must be between 1 and {max_tokens_limit}",
                        param="max_tokens")  # fmt: skip
    if body.get("n") not in (None, 1):
        raise WireError(400, "only n=1 is supported", param="n")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise WireError(400, "'user' must be a string", param="user")
    options = {k: body[k] for k in PASS_THROUGH if k in body and k != "n"}
    return ChatRequest(
        model=model,
        messages=messages,
        stream=stream,
        include_usage=bool(opts.get("include_usage", False)),
        max_tokens=mt if mt is not None else min(default_max_tokens, max_tokens_limit),
        user=user,
        options=options,
    )


def new_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage(prompt_tokens: int | None, completion_tokens: int, cached: int | None) -> dict[str, Any]:
    p = prompt_tokens or 0
    out: dict[str, Any] = {
        "prompt_tokens": p,
        "completion_tokens": completion_tokens,
        "total_tokens": p + completion_tokens,
    }
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def chunk(
    cid: str, created: int, model: str, delta: Mapping[str, Any], finish_reason: str | None
) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": dict(delta), "finish_reason": finish_reason}],
    }


def usage_chunk(cid: str, created: int, model: str, use: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
        "usage": dict(use),
    }


def completion(
    cid: str, model: str, text: Sequence[str], finish_reason: str | None, use: Mapping[str, Any]
) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "".join(text)},
                "finish_reason": finish_reason or "stop",
            }
        ],
        "usage": dict(use),
    }
