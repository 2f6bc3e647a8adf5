"""Whole streams into one turn, in one call: any ``AsyncIterable[str]`` (LangChain's and
LangGraph's ``astream`` of text), the ``openai`` SDK's chat-completion chunk stream and
its Responses stream events. Duck-typed on the SDK's objects (no import of ``openai``).

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

__all__ = ["pipe", "pipe_chat_completion", "pipe_responses", "pipe_text"]


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


async def _consume_text(turn: Turn, source: AsyncIterable[str], end: _End) -> None:
    async for text in source:
        turn.write(text)


async def _consume_chat(turn: Turn, source: AsyncIterable[Any], end: _End) -> None:
    async for chunk in source:
        usage = _get(chunk, "usage")
        if usage is not None:
            end.usage = chat_usage(usage)
        for choice in _get(chunk, "choices") or ():
            if (_get(choice, "index") or 0) != 0:
                continue  # n > 1: the first choice is the turn's reply
            content = _get(_get(choice, "delta"), "content")
            if isinstance(content, str) and content:
                turn.write(content)
            reason = _get(choice, "finish_reason")
            if isinstance(reason, str):
                end.finish_reason = reason


async def _consume_responses(turn: Turn, source: AsyncIterable[Any], end: _End) -> None:
    async for event in source:
        kind = _get(event, "type")
        if kind == "response.output_text.delta":
            delta = _get(event, "delta")
            if isinstance(delta, str) and delta:
                turn.write(delta)
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
        with contextlib.suppress(RelayError):
            await turn.error(f"the stream failed: {type(exc).__name__}", code="producer_error")
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
    return await turn.done(finish_reason=end.finish_reason, usage=end.usage)


async def pipe_text(turn: Turn, source: AsyncIterable[str]) -> int:
    """Every string of ``source`` as a delta, then ``done``."""
    return await _run(turn, source, _consume_text)


async def pipe_chat_completion(turn: Turn, stream: AsyncIterable[Any]) -> int:
    """The ``openai`` SDK's ``chat.completions.create(..., stream=True)``: each chunk's
    first choice's ``delta.content``; ``finish_reason`` and ``usage`` (ask for it with
    ``stream_options={"include_usage": True}``) into ``done``."""
    return await _run(turn, stream, _consume_chat)


async def pipe_responses(turn: Turn, stream: AsyncIterable[Any]) -> int:
    """The ``openai`` SDK's ``responses.create(..., stream=True)`` events:
    ``response.output_text.delta`` deltas; ``response.completed`` / ``.incomplete``
    (its reason as ``finish_reason``) usage into ``done``; ``response.failed`` and
    ``error`` events end the turn with ``error``."""
    return await _run(turn, stream, _consume_responses)


async def pipe(turn: Turn, source: AsyncIterable[Any]) -> int:
    """Whichever of the three ``source`` is, told by its first item."""
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
    if isinstance(_get(first, "type"), str):
        return await _run(turn, rest, _consume_responses)
    await turn.error("unknown stream item", code="producer_error")
    raise TypeError(f"cannot stream items of type {type(first).__name__}")
