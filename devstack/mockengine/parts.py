"""What the mock engine answers besides text: reasoning and tool calls, deterministically,
and the request options it honours or refuses by name. Pure.

- **Tool calls**: a request with ``tools`` (and ``tool_choice`` not ``"none"``) whose last
  message is not a tool's result is answered with tool calls and no text (finish
  ``tool_calls``): every tool offered, up to three (only the first with
  ``parallel_tool_calls`` false; only the named one with ``tool_choice`` naming a
  function), each with the arguments ``{"query": <the last user message, at most 48
  characters>}`` streamed in pieces of 6 characters, its id made from the prompt. After a
  tool's result the engine answers in text as always.
- **Reasoning**: with ``tools`` or ``reasoning_effort``, the reply starts with a
  ``reasoning_content`` (the convention of vLLM, llama.cpp and DeepSeek) of a few words
  about the question and what it will do.
- **Options**: ``stop`` cuts the text before the first stop string (finish ``stop``);
  ``seed``, ``temperature``, ``top_p`` and the penalties are accepted (the reply does not
  depend on them: it is a function of the prompt); ``logprobs``, ``top_logprobs`` and a
  ``response_format`` other than text are refused by name (400): this engine cannot; so
  is a tool's result that answers no preceding assistant's ``tool_calls`` (as OpenAI).

Order of use: :func:`refused` on the request body (a reason and the parameter, or None),
then :func:`plan` for the reasoning and the calls, :func:`cut_at_stop` on the text; the
streamed chunks' ``delta`` objects from :func:`deltas`, a whole answer's ``message`` from
:func:`message`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from worker.routing.tokens import message_text

__all__ = ["Call", "Plan", "cut_at_stop", "deltas", "message", "plan", "refused"]

MAX_CALLS: Final = 3
ARG_PIECE: Final = 6


@dataclass(frozen=True, slots=True)
class Call:
    id: str
    name: str
    arguments: str

    def pieces(self) -> list[str]:
        a = self.arguments
        return [a[i : i + ARG_PIECE] for i in range(0, len(a), ARG_PIECE)]


@dataclass(frozen=True, slots=True)
class Plan:
    reasoning: list[str] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)


def refused(body: Mapping[str, Any]) -> tuple[str, str] | None:
    """Why this engine cannot answer ``body`` (a sentence and the parameter), or None."""
    for name in ("logprobs", "top_logprobs"):
        if body.get(name) not in (None, False, 0):
            return f"this engine does not support '{name}'", name
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        return "this engine supports only 'response_format' {'type': 'text'}", "response_format"
    tools = body.get("tools")
    if tools is not None and not _tool_names(tools):
        return "'tools' must be a list of functions, each with a 'name'", "tools"
    called: set[object] = set()
    for i, m in enumerate(body.get("messages") or ()):
        if isinstance(m, dict) and m.get("role") == "assistant":
            called |= {c.get("id") for c in m.get("tool_calls") or () if isinstance(c, dict)}
        elif (
            isinstance(m, dict) and m.get("role") == "tool" and m.get("tool_call_id") not in called
        ):
            return (f"messages[{i}]: a tool's result must answer a preceding assistant "
                    "message's tool_calls", "messages")  # fmt: skip
    return None


def _tool_names(tools: object) -> list[str]:
    if not isinstance(tools, list):
        return []
    names = []
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            return []
        names.append(name)
    return names


def _last_user(messages: Sequence[Mapping[str, object]]) -> str:
    for m in reversed(messages):
        if m.get("role") == "user":
            return message_text(m.get("content"))
    return ""


def plan(body: Mapping[str, Any], messages: Sequence[Mapping[str, object]],
         tokens: Sequence[str]) -> Plan:  # fmt: skip
    """The reasoning and the tool calls of the reply to ``body`` (see the module
    docstring)."""
    names = _tool_names(body.get("tools"))
    choice = body.get("tool_choice", "auto")
    question = " ".join(_last_user(messages).split())[:48]
    calls: list[Call] = []
    after_tool = bool(messages) and messages[-1].get("role") == "tool"
    if names and choice != "none" and not after_tool:
        if isinstance(choice, dict):
            fn = choice.get("function")
            wanted = fn.get("name") if isinstance(fn, dict) else None
            names = [n for n in names if n == wanted] or names[:1]
        elif body.get("parallel_tool_calls") is False:
            names = names[:1]
        digest = hashlib.blake2b("\x00".join(tokens).encode("utf-8", "surrogatepass"),
                                 digest_size=6).hexdigest()  # fmt: skip
        calls = [
            Call(f"call_{digest}_{i}", name, json.dumps({"query": question}))
            for i, name in enumerate(names[:MAX_CALLS])
        ]
    reasoning: list[str] = []
    if names or body.get("reasoning_effort") is not None:
        doing = f"I will call {', '.join(c.name for c in calls)}." if calls else "I will answer."
        words = f"The user asks: {question or 'nothing'}. {doing}".split(" ")
        reasoning = [w if i == 0 else " " + w for i, w in enumerate(words)]
    return Plan(reasoning, calls)


def cut_at_stop(pieces: list[str], finish: str, stop: object) -> tuple[list[str], str]:
    """``pieces`` cut before the first of the ``stop`` strings (a string or a list of up
    to four), finish ``stop``; unchanged when none occurs."""
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    stops = [s for s in stops if isinstance(s, str) and s]
    text = "".join(pieces)
    at = min((i for s in stops if (i := text.find(s)) >= 0), default=-1)
    if at < 0:
        return pieces, finish
    out: list[str] = []
    size = 0
    for p in pieces:
        if size + len(p) > at:
            if at - size > 0:
                out.append(p[: at - size])
            break
        out.append(p)
        size += len(p)
    return out, "stop"


def deltas(pieces: Sequence[str], todo: Plan) -> list[dict[str, Any]]:
    """The streamed chunks' ``delta`` objects, one per token: reasoning, text, then each
    call (its first chunk names it, the next ones carry its arguments)."""
    out: list[dict[str, Any]] = [{"reasoning_content": r} for r in todo.reasoning]
    out += [{"content": p} for p in pieces]
    for n, c in enumerate(todo.calls):
        fn = {"name": c.name, "arguments": ""}
        out.append({"tool_calls": [{"index": n, "id": c.id, "type": "function", "function": fn}]})
        out += [{"tool_calls": [{"index": n, "function": {"arguments": a}}]} for a in c.pieces()]
    return out


def message(pieces: Sequence[str], todo: Plan) -> dict[str, Any]:
    """A whole answer's ``message``."""
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(pieces)}
    if todo.reasoning:
        msg["reasoning_content"] = "".join(todo.reasoning)
    if todo.calls:
        msg["content"] = None
        msg["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in todo.calls
        ]
    return msg
