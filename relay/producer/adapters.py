"""Whole streams into one turn, in one call: any ``AsyncIterable[str]`` (LangChain's and
LangGraph's ``astream`` of text), the ``openai`` SDK's chat-completion chunk stream and
its Responses stream events, and LangChain's message chunks (``AIMessageChunk``, alone
or as LangGraph's ``(chunk, metadata)`` pairs). Duck-typed on the SDK's objects (no
import of ``openai`` or ``langchain``). Every part a stream carries goes into the turn
(:mod:`relay.producer.parts`): reasoning (``reasoning_content`` / ``reasoning``, the
Responses API's reasoning and its summaries), tool calls with their argument deltas,
sources (the Responses API's URL citations); a call whose arguments never came is sent
as ``{}``.

Each adapter writes the deltas, ends the turn with ``done`` (the usage and finish reason
the stream reported) and returns the terminal frame's offset. When the turn is told to
stop (:meth:`relay.producer.turn.Turn.stopped`) the source is closed (its ``aclose``:
the upstream request ends) and the turn ends: ``done`` with ``finish_reason``
"cancelled" for a client's stop, ``error`` ``no viewers`` when nobody watches, nothing
when the lock was lost. A source that raises ends the turn with ``error`` and the
exception propagates.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Any

from relay.broker.errors import RelayError
from relay.producer.base import CANCELLED, StopReason, Usage
from relay.producer.turn import Turn
from relay.protocol.parts import PartError

__all__ = [
    "ChatParts",
    "pipe",
    "pipe_chat_completion",
    "pipe_langchain",
    "pipe_responses",
    "pipe_text",
]


@dataclass(slots=True)
class _End:
    usage: Usage | None = None
    finish_reason: str | None = "stop"
    failed: str | None = None  # the stream reported a failure (Responses' error events)


def _get(obj: Any, name: str) -> Any:
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def chat_usage(u: Any) -> Usage | None:
    """An OpenAI ``CompletionUsage`` (chat completions) as :class:`Usage`."""
    if u is None:
        return None
    details = _get(u, "prompt_tokens_details")
    return Usage(
        prompt_tokens=_int(_get(u, "prompt_tokens")),
        completion_tokens=_int(_get(u, "completion_tokens")),
        total_tokens=_int(_get(u, "total_tokens")),
        cached_tokens=_int(_get(details, "cached_tokens")) if details is not None else None,
    )


def responses_usage(u: Any) -> Usage | None:
    """An OpenAI ``ResponseUsage`` (Responses API) as :class:`Usage`."""
    if u is None:
        return None
    details = _get(u, "input_tokens_details")
    return Usage(
        prompt_tokens=_int(_get(u, "input_tokens")),
        completion_tokens=_int(_get(u, "output_tokens")),
        total_tokens=_int(_get(u, "total_tokens")),
        cached_tokens=_int(_get(details, "cached_tokens")) if details is not None else None,
    )


class _Calls:
    """Tool calls streamed by index (chat completions' ``delta.tool_calls``, LangChain's
    ``tool_call_chunks``): the first chunk of an index names the call (its id, else
    ``call_<index>``) and the tool; argument deltas before the name are held."""

    def __init__(self, turn: Turn) -> None:
        self.turn = turn
        self.ids: dict[int, str] = {}
        self.names: dict[int, str] = {}
        self.held: dict[int, list[str]] = {}
        self.sent: dict[str, bool] = {}  # call id -> any argument sent

    def chunk(self, index: int, cid: Any, name: Any, args: Any) -> None:
        if index not in self.ids and isinstance(cid, str) and cid:
            self.ids[index] = cid
        if index not in self.names and isinstance(name, str) and name:
            self.names[index] = name
            call = self.ids.setdefault(index, f"call_{index}")
            self.turn.tool_call_start(call, name)
            self.sent[call] = False
            for held in self.held.pop(index, []):
                self._args(call, held)
        if isinstance(args, str) and args:
            if index in self.names:
                self._args(self.ids[index], args)
            else:
                self.held.setdefault(index, []).append(args)

    def _args(self, call: str, args: str) -> None:
        self.turn.tool_call_delta(call, args)
        self.sent[call] = True

    def end(self) -> None:
        for call, sent in self.sent.items():
            p = self.turn.parts.get("tool-call", call)
            if p is not None and not p.done:
                if not sent:
                    self.turn.tool_call_delta(call, "{}")
                self.turn.tool_call_end(call)


class ChatParts:
    """A chat-completion chunk's delta parts besides text into a turn: ``feed`` each
    delta's ``tool_calls`` (by index) and ``reasoning_content`` / ``reasoning`` (a mapping
    as the engine sent it), ``end`` when the stream finished (a call with no arguments is
    sent as ``{}``). Raises :class:`relay.protocol.parts.PartError` on what would corrupt
    the reply (arguments that are not JSON, at ``end``)."""

    def __init__(self, turn: Turn) -> None:
        self.turn = turn
        self._calls = _Calls(turn)

    def feed(self, delta: Any, *, text: str = "") -> None:
        """One delta: its reasoning, then ``text`` (its content, written here when
        given), then its tool-call chunks."""
        thought = _get(delta, "reasoning_content") or _get(delta, "reasoning")
        if isinstance(thought, str) and thought:
            self.turn.reasoning(thought)
        if text:
            self.turn.write(text)
        for tc in _get(delta, "tool_calls") or ():
            fn = _get(tc, "function")
            self._calls.chunk(_get(tc, "index") or 0, _get(tc, "id"), _get(fn, "name"),
                              _get(fn, "arguments"))  # fmt: skip

    def end(self) -> None:
        self.turn.end_reasoning()
        self._calls.end()


async def _consume_text(turn: Turn, source: AsyncIterable[str], end: _End) -> None:
    async for text in source:
        turn.write(text)


async def _consume_chat(turn: Turn, source: AsyncIterable[Any], end: _End) -> None:
    parts = ChatParts(turn)
    async for chunk in source:
        usage = _get(chunk, "usage")
        if usage is not None:
            end.usage = chat_usage(usage)
        for choice in _get(chunk, "choices") or ():
            if (_get(choice, "index") or 0) != 0:
                continue  # n > 1: the first choice is the turn's reply
            delta = _get(choice, "delta")
            content = _get(delta, "content")
            parts.feed(delta, text=content if isinstance(content, str) else "")
            reason = _get(choice, "finish_reason")
            if isinstance(reason, str):
                end.finish_reason = reason
    parts.end()


def _block_text(block: Any, *names: str) -> str:
    for n in names:
        v = _get(block, n)
        if isinstance(v, str):
            return v
    return ""


async def _consume_langchain(turn: Turn, source: AsyncIterable[Any], end: _End) -> None:
    calls = _Calls(turn)
    async for item in source:
        chunk = item[0] if isinstance(item, tuple) and item else item
        extra = _get(chunk, "additional_kwargs") or {}
        thought = _get(extra, "reasoning_content")
        if isinstance(thought, str) and thought:
            turn.reasoning(thought)
        content = _get(chunk, "content")
        if isinstance(content, str) and content:
            turn.write(content)
        elif isinstance(content, list):  # content blocks: text and reasoning / thinking
            for block in content:
                if isinstance(block, str):
                    if block:
                        turn.write(block)
                elif _get(block, "type") in ("reasoning", "thinking"):
                    if t := _block_text(block, "reasoning", "thinking", "text"):
                        turn.reasoning(t)
                elif _get(block, "type") == "text" and (t := _block_text(block, "text")):
                    turn.write(t)
        for tc in _get(chunk, "tool_call_chunks") or ():
            calls.chunk(_get(tc, "index") or 0, _get(tc, "id"), _get(tc, "name"),
                        _get(tc, "args"))  # fmt: skip
        um = _get(chunk, "usage_metadata")
        if um is not None:
            end.usage = Usage(prompt_tokens=_int(_get(um, "input_tokens")),
                              completion_tokens=_int(_get(um, "output_tokens")),
                              total_tokens=_int(_get(um, "total_tokens")))  # fmt: skip
        reason = _get(_get(chunk, "response_metadata") or {}, "finish_reason")
        if isinstance(reason, str):
            end.finish_reason = reason
    calls.end()


class _Items:
    """The Responses API's output items: function calls by item id (their part id is the
    call's ``call_id``), reasoning and its summaries."""

    def __init__(self, turn: Turn) -> None:
        self.turn = turn
        self.calls: dict[str, str] = {}  # item id -> call id
        self.sent: dict[str, bool] = {}

    def added(self, item: Any) -> None:
        if _get(item, "type") == "function_call":
            iid = str(_get(item, "id") or _get(item, "call_id"))
            call = str(_get(item, "call_id") or iid)
            self.calls[iid] = call
            self.sent[call] = False
            self.turn.tool_call_start(call, str(_get(item, "name") or ""))

    def args(self, iid: Any, delta: Any) -> None:
        call = self.calls.get(str(iid))
        if call is None:
            raise PartError(f"function call arguments for item {iid!r}, never added")
        if isinstance(delta, str) and delta:
            self.turn.tool_call_delta(call, delta)
            self.sent[call] = True

    def call_done(self, iid: Any, arguments: Any) -> None:
        call = self.calls.get(str(iid))
        if call is None:
            return
        p = self.turn.parts.get("tool-call", call)
        if p is None or p.done:
            return
        if not self.sent[call]:
            self.turn.tool_call_delta(call, arguments if isinstance(arguments, str) and
                                      arguments else "{}")  # fmt: skip
        self.turn.tool_call_end(call)

    def reasoning(self, pid: str, delta: Any, *, summary: bool = False) -> None:
        if isinstance(delta, str) and delta:
            self.turn.reasoning(delta, pid=pid, summary=summary)

    def reasoning_done(self, pid: str) -> None:
        p = self.turn.parts.get("reasoning", pid)
        if p is not None and not p.done:
            self.turn.part_end("reasoning", pid)
            self.turn.forget_reasoning(pid)


async def _consume_responses(turn: Turn, source: AsyncIterable[Any], end: _End) -> None:
    items = _Items(turn)
    async for event in source:
        kind = _get(event, "type")
        if kind == "response.output_text.delta":
            delta = _get(event, "delta")
            if isinstance(delta, str) and delta:
                turn.write(delta)
        elif kind == "response.output_item.added":
            items.added(_get(event, "item"))
        elif kind == "response.function_call_arguments.delta":
            items.args(_get(event, "item_id"), _get(event, "delta"))
        elif kind == "response.function_call_arguments.done":
            items.call_done(_get(event, "item_id"), _get(event, "arguments"))
        elif kind == "response.output_item.done":
            item = _get(event, "item")
            if _get(item, "type") == "function_call":
                items.call_done(_get(item, "id") or _get(item, "call_id"),
                                _get(item, "arguments"))  # fmt: skip
        elif kind in ("response.reasoning_text.delta", "response.reasoning.delta"):
            items.reasoning(str(_get(event, "item_id")), _get(event, "delta"))
        elif kind == "response.reasoning_text.done":
            items.reasoning_done(str(_get(event, "item_id")))
        elif kind == "response.reasoning_summary_text.delta":
            pid = f"{_get(event, 'item_id')}-summary-{_get(event, 'summary_index') or 0}"
            items.reasoning(pid, _get(event, "delta"), summary=True)
        elif kind == "response.reasoning_summary_text.done":
            items.reasoning_done(f"{_get(event, 'item_id')}-summary-"
                                 f"{_get(event, 'summary_index') or 0}")  # fmt: skip
        elif kind == "response.output_text.annotation.added":
            note = _get(event, "annotation")
            if _get(note, "type") == "url_citation" and isinstance(_get(note, "url"), str):
                title = _get(note, "title")
                turn.source(_get(note, "url"), title=title if isinstance(title, str) else None)
        elif kind in ("response.completed", "response.incomplete", "response.failed"):
            response = _get(event, "response")
            end.usage = responses_usage(_get(response, "usage"))
            if kind == "response.incomplete":
                details = _get(response, "incomplete_details")
                end.finish_reason = str(_get(details, "reason") or "incomplete")
            elif kind == "response.failed":
                err = _get(response, "error")
                end.failed = str(_get(err, "message") or "the response failed")
        elif kind == "error":
            end.failed = str(_get(event, "message") or "the response failed")
    if items.calls and end.finish_reason == "stop":
        end.finish_reason = "tool_calls"  # as chat completions says it


async def _run(turn: Turn, source: AsyncIterable[Any], consume: Any) -> int:
    end = _End()
    reader = asyncio.ensure_future(consume(turn, source, end))
    stop = asyncio.ensure_future(turn.stopped())
    try:
        await asyncio.wait({reader, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
    if not reader.done():  # told to stop: close the source (the upstream request ends)
        reader.cancel()
        with contextlib.suppress(BaseException):
            await reader
        aclose = getattr(source, "aclose", None) or getattr(source, "close", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                res = aclose()
                if asyncio.iscoroutine(res):
                    await res
    elif reader.exception() is not None:
        exc = reader.exception()
        assert exc is not None
        if isinstance(exc, RelayError) or turn.closed:
            if not turn.closed:
                await turn.close()
            raise exc
        why = f"the stream's parts: {exc}" if isinstance(exc, PartError) else (
            f"the stream failed: {type(exc).__name__}")  # fmt: skip
        with contextlib.suppress(RelayError):
            await turn.error(why, code="producer_error")
        raise exc
    reason = turn.stop_reason
    if reason is StopReason.LOCK_LOST:
        await turn.close()
        return 0
    if reason is StopReason.NO_VIEWERS:
        return await turn.error("no viewers", code="no_viewers")
    if reason is StopReason.CANCELLED:
        return await turn.done(finish_reason=CANCELLED, usage=end.usage)
    if end.failed is not None:
        return await turn.error(end.failed, code="producer_error")
    try:
        return await turn.done(finish_reason=end.finish_reason, usage=end.usage)
    except PartError as exc:  # an open call's arguments are not JSON: said, not stored
        await turn.error(f"the stream's parts: {exc}", code="producer_error")
        raise


async def pipe_text(turn: Turn, source: AsyncIterable[str]) -> int:
    """Every string of ``source`` as a delta, then ``done``."""
    return await _run(turn, source, _consume_text)


async def pipe_chat_completion(turn: Turn, stream: AsyncIterable[Any]) -> int:
    """The ``openai`` SDK's ``chat.completions.create(..., stream=True)``: each chunk's
    first choice's ``delta.content``, ``delta.reasoning_content`` (or ``reasoning``) and
    ``delta.tool_calls``; ``finish_reason`` and ``usage`` (ask for it with
    ``stream_options={"include_usage": True}``) into ``done``."""
    return await _run(turn, stream, _consume_chat)


async def pipe_responses(turn: Turn, stream: AsyncIterable[Any]) -> int:
    """The ``openai`` SDK's ``responses.create(..., stream=True)`` events:
    ``response.output_text.delta`` deltas, function calls (``output_item.added``,
    ``function_call_arguments.delta`` / ``.done``), reasoning text and summaries, URL
    citations as sources; ``response.completed`` / ``.incomplete``
    (its reason as ``finish_reason``) usage into ``done``; ``response.failed`` and
    ``error`` events end the turn with ``error``."""
    return await _run(turn, stream, _consume_responses)


async def pipe_langchain(turn: Turn, stream: AsyncIterable[Any]) -> int:
    """LangChain's ``astream`` of message chunks (``AIMessageChunk``: ``content`` as text
    or blocks, ``tool_call_chunks``, ``additional_kwargs.reasoning_content``,
    ``usage_metadata``), or LangGraph's ``stream_mode="messages"`` pairs."""
    return await _run(turn, stream, _consume_langchain)


def _is_langchain(item: Any) -> bool:
    if isinstance(item, tuple) and item:
        item = item[0]
    return _get(item, "tool_call_chunks") is not None or (
        _get(item, "content") is not None and _get(item, "additional_kwargs") is not None
    )


async def pipe(turn: Turn, source: AsyncIterable[Any]) -> int:
    """Whichever of the four ``source`` is, told by its first item."""
    it = aiter(source)
    try:
        first = await anext(it)
    except StopAsyncIteration:
        return await turn.done()

    async def again() -> AsyncIterator[Any]:
        yield first
        async for x in it:
            yield x

    rest = again()
    if isinstance(first, str):
        return await _run(turn, rest, _consume_text)
    if _get(first, "choices") is not None:
        return await _run(turn, rest, _consume_chat)
    if _is_langchain(first):
        return await _run(turn, rest, _consume_langchain)
    if isinstance(_get(first, "type"), str):
        return await _run(turn, rest, _consume_responses)
    await turn.error("unknown stream item", code="producer_error")
    raise TypeError(f"cannot stream items of type {type(first).__name__}")
