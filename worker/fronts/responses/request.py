"""The Responses API's request body, checked: pure.

``POST /v1/responses`` as :mod:`worker.fronts.responses.http` serves it: ``input`` (a
string, or message items: ``{"role", "content"}`` with ``type: "message"`` or none, the
content a string or ``input_text`` / ``output_text`` parts), ``instructions``,
``max_output_tokens``, ``stream``, ``background``, ``store``, ``metadata`` (at most 16
string pairs, keys <= 64 and values <= 512 characters, as OpenAI bounds them),
``previous_response_id`` and ``conversation`` (a ``conv_<session>`` id, or
``{"id": ...}``; not both). Anything else OpenAI defines for tools, reasoning or
sampling is refused by name rather than ignored, so a client never believes a setting
took effect. Too much text is 400 ``context_length_exceeded`` (what OpenAI answers).

Order of use: :func:`parse_responses` (raises :class:`~worker.fronts.errors.WireError`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from worker.fronts.errors import WireError

__all__ = ["ResponsesRequest", "parse_responses"]

_ROLES: Final = frozenset(("user", "assistant", "system", "developer"))
_TEXT_PARTS: Final = frozenset(("input_text", "output_text", "text"))
_KNOWN: Final = frozenset((
    "model", "input", "instructions", "max_output_tokens", "stream", "background", "store",
    "metadata", "previous_response_id", "conversation", "user", "stream_options",
    "parallel_tool_calls", "truncation", "text", "tool_choice", "tools", "service_tier",
))  # fmt: skip
_MAX_ITEMS: Final = 1024


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    model: str
    messages: list[dict[str, str]]  # the input items, the last one the user's
    instructions: str | None
    max_tokens: int
    max_output_tokens: int | None
    stream: bool = False
    background: bool = False
    store: bool = True
    metadata: dict[str, str] = field(default_factory=dict)
    previous_response_id: str | None = None
    conversation: str | None = None

    def params(self) -> dict[str, Any]:
        """What the turn's ``meta`` frame carries of the request (the response object's
        fields, the same from any pod)."""
        return {
            "model": self.model, "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens, "metadata": self.metadata,
            "previous_response_id": self.previous_response_id, "background": self.background,
            "store": self.store,
        }  # fmt: skip


def _text(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise WireError(400, f"{where}.content must be a string or a list of text parts",
                        param=f"{where}.content")  # fmt: skip
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            raise WireError(400, f"{where}.content[{j}]: only text parts are supported",
                            param=f"{where}.content")  # fmt: skip
        text = part.get("text")
        if not isinstance(text, str):
            raise WireError(400, f"{where}.content[{j}] needs a string 'text'",
                            param=f"{where}.content")  # fmt: skip
        out.append(text)
    return "".join(out)


def _items(raw: object) -> list[dict[str, str]]:
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise WireError(400, "'input' must be a string or a non-empty array of messages",
                        param="input")  # fmt: skip
    if len(raw) > _MAX_ITEMS:
        raise WireError(400, f"at most {_MAX_ITEMS} input items", param="input")
    out = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            raise WireError(400, f"{where}: only message items are supported", param=where)
        role = item.get("role")
        if role not in _ROLES:
            raise WireError(400, f"{where}.role must be one of {sorted(_ROLES)}",
                            param=f"{where}.role")  # fmt: skip
        out.append({"role": str(role), "content": _text(item.get("content"), where)})
    return out


def _metadata(raw: object) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or len(raw) > 16:
        raise WireError(400, "'metadata' must be an object of at most 16 pairs", param="metadata")
    for k, v in raw.items():
        if not isinstance(v, str) or len(k) > 64 or len(v) > 512:
            raise WireError(400, "metadata keys are <= 64 characters, values strings of <= 512",
                            param="metadata")  # fmt: skip
    return dict(raw)


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise WireError(400, f"'{name}' must be a boolean", param=name)
    return v


def _opt_str(body: Mapping[str, Any], name: str) -> str | None:
    v = body.get(name)
    if v is not None and not isinstance(v, str):
        raise WireError(400, f"'{name}' must be a string", param=name)
    return v


def parse_responses(
    body: object, *, model: str, default_max_tokens: int, max_tokens_limit: int, max_chars: int
) -> ResponsesRequest:
    """A ``POST /v1/responses`` body -> :class:`ResponsesRequest`, or :class:`WireError`."""
    if not isinstance(body, dict):
        raise WireError(400, "the body must be a JSON object")
    unknown = sorted(k for k in body if k not in _KNOWN)
    if unknown:
        raise WireError(400, f"unsupported parameter: {unknown[0]!r}", param=unknown[0],
                        code="unsupported_parameter")  # fmt: skip
    if body.get("tools"):
        raise WireError(400, "tools are not supported", param="tools", code="unsupported_parameter")
    asked = body.get("model", model)
    if asked != model:
        raise WireError(404, f"the model {str(asked)[:80]!r} does not exist; this gateway "
                        f"serves {model!r}", param="model", code="model_not_found")  # fmt: skip
    items = _items(body.get("input"))
    instructions = _opt_str(body, "instructions")
    system = [m["content"] for m in items if m["role"] in ("system", "developer")]
    messages = [m for m in items if m["role"] not in ("system", "developer")]
    if not messages or messages[-1]["role"] != "user" or not messages[-1]["content"].strip():
        raise WireError(400, "the last input item must be the user's message", param="input")
    total = sum(len(m["content"]) for m in items) + len(instructions or "")
    if total > max_chars:
        raise WireError(400, f"the input holds more than {max_chars} characters",
                        param="input", code="context_length_exceeded")  # fmt: skip
    mot = body.get("max_output_tokens")
    if mot is not None and (
        not isinstance(mot, int) or isinstance(mot, bool) or not 1 <= mot <= max_tokens_limit
    ):
        raise WireError(400, f"'max_output_tokens' must be an integer in [1, {max_tokens_limit}]",
                        param="max_output_tokens")  # fmt: skip
    previous = _opt_str(body, "previous_response_id")
    conv = body.get("conversation")
    if isinstance(conv, dict):
        conv = conv.get("id")
    if conv is not None and not isinstance(conv, str):
        raise WireError(400, "'conversation' must be a conversation id", param="conversation")
    if previous is not None and conv is not None:
        raise WireError(400, "send 'previous_response_id' or 'conversation', not both",
                        param="conversation")  # fmt: skip
    if instructions is None and system:
        instructions = "\n\n".join(system)
    stream, background = _flag(body, "stream", False), _flag(body, "background", False)
    return ResponsesRequest(
        model=model, messages=messages, instructions=instructions,
        max_tokens=mot if isinstance(mot, int) else default_max_tokens, max_output_tokens=mot,
        stream=stream, background=background, store=_flag(body, "store", True),
        metadata=_metadata(body.get("metadata")), previous_response_id=previous,
        conversation=conv,
    )  # fmt: skip
