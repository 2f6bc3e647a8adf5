"""A prompt's messages from a session's stored history: pure (no I/O).

The history keeps one entry per message (:mod:`worker.chat.store`): the user's, a tool's
result (``role: tool`` with its ``tool_call_id``: what a client sent back after running a
call), and each reply with its ``parts`` when it had any. The engine gets them in the
chat-completions shape it expects:

- a reply with tool calls is the assistant message with its text as ``content`` and the
  finished calls as ``tool_calls`` (``{"id", "type": "function", "function": {"name",
  "arguments"}}``, the arguments as the JSON text the engine wrote);
- a tool result among a reply's parts (a producer that ran the tool itself) ends that
  assistant message and follows it as ``{"role": "tool", "tool_call_id", "content"}``;
  text after it starts the next assistant message, as a multi-step agent's reply reads;
- a tool entry is that same tool message (left out when its call is not in the history:
  the history's bound dropped it);
- reasoning, sources, usage and data parts are not sent back (chat templates drop an
  earlier turn's reasoning; the others are the application's, not the model's).

Order of use: :func:`history_messages` on the stored entries (:meth:`SessionStore.load`
does it for :class:`worker.chat.store.History`); :func:`as_entry` for a chat message a
client sent that is stored as it is (the Responses API's earlier input items);
:func:`new_input` for the turn a client's messages ask for (the fronts that take a
conversation: the Responses API, a chat completion tied to a session).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["NewInput", "as_entry", "history_messages", "new_input", "tool_message"]


def tool_message(call_id: str, content: str) -> dict[str, Any]:
    """A tool's result as the engine gets it."""
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _reply(content: str, parts: list[Any]) -> list[dict[str, Any]]:
    """A stored reply with parts, as the assistant and tool messages it stands for."""
    out: list[dict[str, Any]] = []
    text: list[str] = []
    calls: list[dict[str, Any]] = []

    def flush() -> None:
        if text or calls:
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
            if calls:
                msg["tool_calls"] = list(calls)
            out.append(msg)
            text.clear()
            calls.clear()

    for p in parts:
        if not isinstance(p, Mapping) or not isinstance(p.get("text"), str):
            continue
        kind, pid = p.get("type"), p.get("id")
        if kind == "text":
            text.append(p["text"])
        elif kind == "tool-call" and isinstance(pid, str) and p.get("done", True) is not False:
            fn = {"name": str(p.get("name", "")), "arguments": p["text"] or "{}"}
            calls.append({"id": pid, "type": "function", "function": fn})
        elif kind == "tool-result" and isinstance(pid, str):
            flush()
            out.append(tool_message(pid, p["text"]))
    flush()
    return out or [{"role": "assistant", "content": content}]


def history_messages(entries: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The stored entries (each with a string ``content``) as the engine's messages. A
    tool's result whose call is not among them (the history's bound dropped the oldest
    messages, the call's reply among them) is left out: the engine would refuse it, and
    every later turn with it."""
    out: list[dict[str, Any]] = []
    for e in entries:
        role, content = str(e.get("role", "user")), str(e.get("content", ""))
        parts = e.get("parts")
        if role == "tool":
            call = e.get("tool_call_id")
            if isinstance(call, str) and call:
                out.append(tool_message(call, content))
        elif role == "assistant" and isinstance(parts, list) and parts:
            out += _reply(content, parts)
        else:
            out.append({"role": role, "content": content})
    called: set[str] = set()
    kept = []
    for m in out:
        called |= {c["id"] for c in m.get("tool_calls", ())}
        if m["role"] != "tool" or m["tool_call_id"] in called:
            kept.append(m)
    return kept


def as_entry(message: Mapping[str, Any]) -> dict[str, Any]:
    """A chat message as the history stores it (the inverse of :func:`history_messages`):
    an assistant's ``tool_calls`` become its ``parts`` (after its text), a tool's result
    keeps its ``tool_call_id``."""
    entry: dict[str, Any] = {"role": str(message["role"]), "content": str(message["content"])}
    if message.get("role") == "tool":
        entry["tool_call_id"] = str(message.get("tool_call_id", ""))
    calls = message.get("tool_calls")
    if message.get("role") == "assistant" and isinstance(calls, list) and calls:
        parts: list[dict[str, Any]] = [{"type": "text", "text": entry["content"]}]
        parts = parts if entry["content"] else []
        parts += [
            {"type": "tool-call", "id": c["id"], "name": c["function"]["name"],
             "text": c["function"]["arguments"]}
            for c in calls
        ]  # fmt: skip
        entry["parts"] = parts
    return entry


@dataclass(frozen=True, slots=True)
class NewInput:
    """What a conversation sent by a client asks of its turn: ``earlier`` messages, then
    the new input: the tools' ``results`` (``role: tool`` messages) and the user's
    ``message`` ("" when the results are all: the turn continues after the tools)."""

    earlier: list[dict[str, Any]]
    results: list[dict[str, Any]]
    message: str


def new_input(messages: Sequence[dict[str, Any]]) -> NewInput | None:
    """The new input of ``messages``: its last message, the user's with some text, and
    the tools' results just before it; or its last tools' results. None: the
    conversation ends with neither (an assistant's message, a blank user's)."""
    if not messages:
        return None
    last = messages[-1]
    message = ""
    end = len(messages)
    if last.get("role") == "user":
        message = str(last.get("content", ""))
        if not message.strip():
            return None
        end -= 1
    elif last.get("role") != "tool":
        return None
    start = end
    while start > 0 and messages[start - 1].get("role") == "tool":
        start -= 1
    return NewInput(list(messages[:start]), list(messages[start:end]), message)
