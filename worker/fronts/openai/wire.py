"""The OpenAI chat-completions wire format, as pure functions (no I/O).

What the gateway (:mod:`worker.fronts.openai.http`) needs to speak OpenAI to any client:
parse and bound a ``POST /v1/chat/completions`` body, build the streamed
``chat.completion.chunk`` objects and the whole ``chat.completion`` (error bodies in
OpenAI's shape: :func:`relay.service.errors.error_body`).

Order of use: :func:`parse_request` (raises :class:`worker.fronts.errors.WireError`,
answered with its status) -> per delta :func:`chunk` -> :func:`usage_chunk` when asked ->
``data: [DONE]``; or :func:`completion` for ``stream: false`` (its tool calls, reasoning
and logprobs folded in with :func:`gather`). Every option of the request reaches the
engine (tools, ``tool_choice``, ``parallel_tool_calls``, ``response_format``, logprobs,
``seed``, ``stop``, sampling: checked by every front's one checker,
:func:`worker.fronts.options.engine_options`) or is refused by name; an assistant's
``tool_calls`` and a tool's result stay in the messages.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from worker.fronts.errors import WireError
from worker.fronts.options import PASS_THROUGH, engine_options

__all__ = [
    "PASS_THROUGH",
    "ChatRequest",
    "PartDeltas",
    "WireError",
    "chunk",
    "completion",
    "gather",
    "new_id",
    "parse_request",
    "usage",
    "usage_chunk",
]

ROLES: Final = frozenset(("system", "developer", "user", "assistant", "tool"))
# Read by the gateway itself; any other field is refused by name, never ignored.
_OWN: Final = frozenset((
    "model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens",
    "n", "user",
))  # fmt: skip
_MAX_MESSAGES: Final = 1024


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A checked request: ``messages`` (text, and an assistant's ``tool_calls`` and a
    tool's ``tool_call_id`` kept), the bounded ``max_tokens``, the engine's ``options``."""

    model: str
    messages: list[dict[str, Any]]
    stream: bool
    include_usage: bool
    max_tokens: int
    user: str | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def system(self) -> str | None:
        """The leading system (or developer) prompt, which names the routing prefix."""
        if self.messages and self.messages[0]["role"] in ("system", "developer"):
            return str(self.messages[0]["content"])
        return None

    @property
    def conversation(self) -> list[dict[str, Any]]:
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


def _tool_calls(value: object, i: int) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``: each ``{"id", "type": "function",
    "function": {"name", "arguments"}}`` with strings."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(value, list) or not value:
        raise WireError(400, f"{where} must be a non-empty array", param=where)
    for j, c in enumerate(value):
        fn = c.get("function") if isinstance(c, dict) else None
        if not (
            isinstance(c, dict)
            and isinstance(c.get("id"), str)
            and isinstance(fn, dict)
            and isinstance(fn.get("name"), str)
            and isinstance(fn.get("arguments"), str)
        ):
            raise WireError(400, f"{where}[{j}] needs 'id' and 'function' with 'name' and "
                            "'arguments' (strings)", param=where)  # fmt: skip
    return [
        {"id": c["id"], "type": "function",
         "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
        for c in value
    ]  # fmt: skip


def _messages(raw: object, max_chars: int) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise WireError(400, "'messages' must be a non-empty array", param="messages")
    if len(raw) > _MAX_MESSAGES:
        raise WireError(400, f"at most {_MAX_MESSAGES} messages", param="messages")
    out: list[dict[str, Any]] = []
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
        msg: dict[str, Any] = {"role": str(role), "content": text}
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], i)
            total += sum(len(c["function"]["arguments"]) for c in msg["tool_calls"])
        if role == "tool":
            cid = m.get("tool_call_id")
            if not isinstance(cid, str) or not cid:
                raise WireError(400, f"messages[{i}].tool_call_id: a tool's result names its "
                                "call", param=f"messages[{i}].tool_call_id")  # fmt: skip
            msg["tool_call_id"] = cid
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if total > max_chars:
            raise WireError(413, f"the messages hold more than {max_chars} characters",
                            code="context_length_exceeded", param="messages")  # fmt: skip
        out.append(msg)
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
    options = engine_options(body, _OWN)
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
    cid: str, model: str, text: Sequence[str], finish_reason: str | None, use: Mapping[str, Any],
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """A whole ``chat.completion``; ``extra``: the message's ``tool_calls`` and
    ``reasoning_content`` (:func:`gather`) and the choice's ``logprobs``."""
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    choice: dict[str, Any] = {"index": 0, "message": message,
                              "finish_reason": finish_reason or "stop"}  # fmt: skip
    for k, v in (extra or {}).items():
        if k == "logprobs":
            choice["logprobs"] = v
        else:
            message[k] = v
    if message.get("tool_calls") and not message["content"]:
        message["content"] = None
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": dict(use),
    }


def gather(into: dict[str, Any], extra: Mapping[str, Any]) -> None:
    """Fold one delta's ``extra`` (tool-call chunks by ``index``, reasoning text,
    logprobs) into a whole message's ``into``."""
    for k, v in extra.items():
        if k in ("reasoning_content", "reasoning") and isinstance(v, str):
            into["reasoning_content"] = into.get("reasoning_content", "") + v
        elif k == "logprobs" and isinstance(v, dict):
            lp = into.setdefault("logprobs", {"content": []})
            lp["content"] += v.get("content") or []
        elif k == "tool_calls" and isinstance(v, list):
            calls = into.setdefault("tool_calls", [])
            for n, tc in enumerate(v):
                if not isinstance(tc, dict):
                    continue
                i = tc.get("index", n) if isinstance(tc.get("index", n), int) else n
                while len(calls) <= i:
                    calls.append({"id": "", "type": "function",
                                  "function": {"name": "", "arguments": ""}})  # fmt: skip
                fn = tc.get("function") or {}
                if isinstance(tc.get("id"), str):
                    calls[i]["id"] = tc["id"]
                if isinstance(fn.get("name"), str):
                    calls[i]["function"]["name"] = fn["name"]
                if isinstance(fn.get("arguments"), str):
                    calls[i]["function"]["arguments"] += fn["arguments"]


class PartDeltas:
    """A turn's ``part`` frames as chat-completion ``delta`` objects: reasoning as
    ``reasoning_content``, a tool call's ``start`` as its first ``tool_calls`` chunk (its
    ``index``, ``id``, ``name``), its argument deltas by that index; other parts (results,
    sources, data, a call's ``end``) have no delta in this wire (None)."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}

    @property
    def calls(self) -> int:
        return len(self.index)

    def delta(self, meta: Mapping[str, Any], text: str) -> dict[str, Any] | None:
        part, pid, phase = meta.get("part"), str(meta.get("id")), meta.get("phase")
        if part == "reasoning" and phase == "delta" and text:
            return {"reasoning_content": text}
        if part != "tool-call":
            return None
        if phase == "start":
            n = self.index.setdefault(pid, len(self.index))
            fn = {"name": str(meta.get("name", "")), "arguments": ""}
            return {"tool_calls": [{"index": n, "id": pid, "type": "function", "function": fn}]}
        if phase == "delta" and text and pid in self.index:
            return {"tool_calls": [{"index": self.index[pid], "function": {"arguments": text}}]}
        return None
