"""The Responses API's request body, checked: pure.

``POST /v1/responses`` as :mod:`worker.fronts.responses.http` serves it: ``input`` (a
string, or message items: ``{"role", "content"}`` with ``type: "message"`` or none, the
content a string or ``input_text`` / ``output_text`` parts), ``instructions``,
``max_output_tokens``, ``stream``, ``background``, ``store``, ``metadata`` (at most 16
string pairs, keys <= 64 and values <= 512 characters, as OpenAI bounds them),
``previous_response_id`` and ``conversation`` (a ``conv_<session>`` id, or
``{"id": ...}``; not both).

Tools: function tools (``{"type": "function", "name", "parameters"?, "description"?,
"strict"?}``), ``tool_choice`` (``"auto"``, ``"none"``, ``"required"`` or ``{"type":
"function", "name"}``), ``parallel_tool_calls``, and ``temperature`` / ``top_p``, are
translated to the chat-completions shape the engine gets and checked by every front's one
checker (:func:`worker.fronts.options.engine_options`); a built-in tool (``web_search``,
``file_search``, ...) is refused by name: the engine runs no tool. An agent continues
after running the calls with ``function_call_output`` items (``{"call_id", "output"}``,
the tool's result, sent to the engine as a ``role: tool`` message after the calls) and,
when it sends the whole conversation itself, the ``function_call`` items it was given
(the assistant's ``tool_calls``); ``reasoning`` items it passes back are accepted and not
sent (an earlier turn's reasoning is not part of the prompt). The last input items are
the turn's new input: the user's message, or the tools' results (and then, possibly, a
user's message). ``text.format`` (``text``, ``json_object``, or ``json_schema`` with
``name``, ``schema``, ``description``?, ``strict``?) is the engine's ``response_format``
(an engine that cannot take it refuses the response: 400 ``engine_bad_request`` with its
reason). Anything else OpenAI defines for reasoning or sampling is refused by
name rather than ignored, so a client never believes a setting took effect. Too much
text is 400 ``context_length_exceeded`` (what OpenAI answers).

Order of use: :func:`parse_responses` (raises :class:`~worker.fronts.errors.WireError`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from worker.chat.prompt import NewInput, new_input
from worker.fronts.errors import WireError
from worker.fronts.options import engine_options

__all__ = ["ResponsesRequest", "parse_responses"]

_ROLES: Final = frozenset(("user", "assistant", "system", "developer"))
_TEXT_PARTS: Final = frozenset(("input_text", "output_text", "text"))
_KNOWN: Final = frozenset((
    "model", "input", "instructions", "max_output_tokens", "stream", "background", "store",
    "metadata", "previous_response_id", "conversation", "user", "stream_options",
    "parallel_tool_calls", "truncation", "text", "tool_choice", "tools", "service_tier",
    "temperature", "top_p",
))  # fmt: skip
_FUNCTION_KEYS: Final = frozenset(("type", "name", "parameters", "description", "strict"))
_MAX_ITEMS: Final = 1024
_ITEMS: Final = ("message", "function_call", "function_call_output", "reasoning")


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    model: str
    messages: list[dict[str, Any]]  # the input items as chat messages, the new input last
    instructions: str | None
    max_tokens: int
    max_output_tokens: int | None
    stream: bool = False
    background: bool = False
    store: bool = True
    metadata: dict[str, str] = field(default_factory=dict)
    previous_response_id: str | None = None
    conversation: str | None = None
    options: dict[str, Any] = field(default_factory=dict)  # the engine's: tools, sampling
    tools: list[dict[str, Any]] = field(default_factory=list)  # as the request gave them
    tool_choice: object = None

    @property
    def new(self) -> NewInput:
        """The earlier items and the new input (:func:`worker.chat.prompt.new_input`)."""
        found = new_input(self.messages)
        assert found is not None  # parse_responses refused any other
        return found

    @property
    def tool_results(self) -> list[dict[str, Any]]:
        """The tools' results of the new input (before the user's message, or last)."""
        return self.new.results

    @property
    def message(self) -> str:
        """The user's message of the new input ("" when it is the tools' results alone)."""
        return self.new.message

    @property
    def earlier(self) -> list[dict[str, Any]]:
        """The input items before the new input."""
        return self.new.earlier

    def params(self) -> dict[str, Any]:
        """What the turn's ``meta`` frame carries of the request (the response object's
        fields, the same from any pod)."""
        out: dict[str, Any] = {
            "model": self.model, "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens, "metadata": self.metadata,
            "previous_response_id": self.previous_response_id, "background": self.background,
            "store": self.store,
        }  # fmt: skip
        if self.tools:
            out["tools"] = self.tools
        if self.tool_choice is not None:
            out["tool_choice"] = self.tool_choice
        for k in ("parallel_tool_calls", "temperature", "top_p"):
            if k in self.options:
                out[k] = self.options[k]
        return out


def _text(content: object, where: str, name: str = "content") -> str:
    at = f"{where}.{name}"
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise WireError(400, f"{at} must be a string or a list of text parts", param=at)
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            raise WireError(400, f"{at}[{j}]: only text parts are supported", param=at)
        text = part.get("text")
        if not isinstance(text, str):
            raise WireError(400, f"{at}[{j}] needs a string 'text'", param=at)
        out.append(text)
    return "".join(out)


def _call(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``function_call`` item as a chat-completions tool call."""
    fields = {k: item.get(k) for k in ("call_id", "name", "arguments")}
    if not all(isinstance(v, str) and v for v in fields.values()):
        raise WireError(400, f"{where}: a function_call needs 'call_id', 'name' and "
                        "'arguments' (strings)", param=where)  # fmt: skip
    fn = {"name": fields["name"], "arguments": fields["arguments"]}
    return {"id": fields["call_id"], "type": "function", "function": fn}


def _output(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``function_call_output`` item as the ``role: tool`` message of its call."""
    call = item.get("call_id")
    if not isinstance(call, str) or not call:
        raise WireError(400, f"{where}: a function_call_output needs its 'call_id'",
                        param=f"{where}.call_id")  # fmt: skip
    out = item.get("output")
    text = out if isinstance(out, str) else _text(out, where, "output")
    return {"role": "tool", "tool_call_id": call, "content": text}


def _items(raw: object) -> list[dict[str, Any]]:
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise WireError(400, "'input' must be a string or a non-empty array of items",
                        param="input")  # fmt: skip
    if len(raw) > _MAX_ITEMS:
        raise WireError(400, f"at most {_MAX_ITEMS} input items", param="input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if not isinstance(item, dict) or kind not in _ITEMS:
            raise WireError(400, f"{where}: input items of type {str(kind)[:40]!r} are not "
                            f"supported (only {', '.join(_ITEMS)})", param=where,
                            code="unsupported_parameter")  # fmt: skip
        if kind == "reasoning":
            continue  # an earlier turn's reasoning, passed back: not part of the prompt
        if kind == "function_call":  # the assistant's calls: one message with all of them
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(_call(item, where))
            continue
        if kind == "function_call_output":
            out.append(_output(item, where))
            continue
        role = item.get("role")
        if role not in _ROLES:
            raise WireError(400, f"{where}.role must be one of {sorted(_ROLES)}",
                            param=f"{where}.role")  # fmt: skip
        out.append({"role": str(role), "content": _text(item.get("content"), where)})
    return out


def _tools(raw: object) -> list[dict[str, Any]]:
    """The Responses API's function tools in the chat-completions shape; a built-in tool
    (or any other type) refused by name."""
    if not isinstance(raw, list):
        raise WireError(400, "'tools' must be a list of tools", param="tools")
    out = []
    for i, t in enumerate(raw):
        kind = t.get("type") if isinstance(t, dict) else None
        if not isinstance(t, dict) or kind != "function":
            raise WireError(400, f"tools[{i}]: the tool type {str(kind)[:40]!r} is not "
                            "supported: the engine runs no built-in tool; send function "
                            "tools ({'type': 'function', 'name', 'parameters'})",
                            param="tools", code="unsupported_parameter")  # fmt: skip
        extra = sorted(k for k in t if k not in _FUNCTION_KEYS)
        if extra:
            raise WireError(400, f"tools[{i}]: unsupported field {extra[0]!r} of a function "
                            "tool", param="tools", code="unsupported_parameter")  # fmt: skip
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(raw: object) -> object:
    """``tool_choice`` in the chat-completions shape (a wrong one is left for the checker
    to refuse); a built-in tool's choice refused by name."""
    if not isinstance(raw, dict):
        return raw
    kind = raw.get("type")
    if kind != "function":
        raise WireError(400, f"a tool_choice of type {str(kind)[:40]!r} is not supported: "
                        "'auto', 'none', 'required' or {'type': 'function', 'name'}",
                        param="tool_choice", code="unsupported_parameter")  # fmt: skip
    return {"type": "function", "function": {"name": raw.get("name")}}


_SCHEMA_KEYS: Final = ("name", "schema", "description", "strict")


def _response_format(raw: object) -> dict[str, Any] | None:
    """``text`` (``{"format": ...}``) as the chat-completions ``response_format`` (None for
    plain text); any other field or format refused by name, never dropped."""
    if not isinstance(raw, dict):
        raise WireError(400, "'text' must be an object", param="text")
    extra = sorted(k for k in raw if k != "format")
    if extra:
        raise WireError(400, f"text.{str(extra[0])[:40]} is not supported", param="text",
                        code="unsupported_parameter")  # fmt: skip
    fmt = raw.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema" or not isinstance(fmt, dict):
        raise WireError(400, f"text.format of type {str(kind)[:40]!r} is not supported: "
                        "'text', 'json_object' or 'json_schema'", param="text.format",
                        code="unsupported_parameter")  # fmt: skip
    if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), dict):
        raise WireError(400, "a json_schema text.format needs a 'name' and a 'schema' object",
                        param="text.format")  # fmt: skip
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in _SCHEMA_KEYS if k in fmt}}


def _options(body: Mapping[str, Any]) -> dict[str, Any]:
    """The engine's options of the request, translated and checked."""
    chat: dict[str, Any] = {}
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    for k in ("parallel_tool_calls", "temperature", "top_p"):
        if body.get(k) is not None:
            chat[k] = body[k]
    if body.get("text") is not None and (fmt := _response_format(body["text"])) is not None:
        chat["response_format"] = fmt
    return engine_options(chat)


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
    asked = body.get("model", model)
    if asked != model:
        raise WireError(404, f"the model {str(asked)[:80]!r} does not exist; this gateway "
                        f"serves {model!r}", param="model", code="model_not_found")  # fmt: skip
    items = _items(body.get("input"))
    instructions = _opt_str(body, "instructions")
    system = [m["content"] for m in items if m["role"] in ("system", "developer")]
    messages = [m for m in items if m["role"] not in ("system", "developer")]
    if new_input(messages) is None:
        raise WireError(400, "the last input item must be the user's message or a "
                        "function_call_output", param="input")  # fmt: skip
    total = len(instructions or "") + sum(
        len(m["content"]) + sum(len(c["function"]["arguments"]) for c in m.get("tool_calls", ()))
        for m in items
    )
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
        conversation=conv, options=_options(body),
        tools=list(body["tools"]) if body.get("tools") else [],
        tool_choice=body.get("tool_choice"),
    )  # fmt: skip
