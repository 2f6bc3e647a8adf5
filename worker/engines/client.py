"""Streaming client for OpenAI-compatible ``/v1/chat/completions`` engines.

Works with vLLM, SGLang, Ollama, the llama.cpp server and ``devstack.mockengine.server``.
aiohttp errors are converted here, at the boundary, into ``worker.engines.errors``.

Order of use::

    client = EngineClient(session, connect_timeout_s=2, first_token_timeout_s=30,
                          idle_timeout_s=15)
    async with contextlib.aclosing(client.stream_chat(url, model, messages, 256)) as s:
        async for delta in s:
            ...  # delta.meta on the first one, delta.finish_reason on the last one

``stream_chat`` yields zero or more text deltas and then exactly one final delta with
``finish_reason`` set; the first delta yielded carries ``meta`` (engine id, cached
prefix tokens, where the engine says them up front: the mock's headers and first
chunk), the final one ``usage``: everything the engine reported anywhere in its answer
(headers, a chunk's ``usage`` with ``prompt_tokens_details.cached_tokens``, llama-server's
``timings`` with ``cache_n``/``prompt_n``; :mod:`worker.engines.report`), None only when
the engine said nothing. When the consumer stops early (``aclose``, leaving
``aclosing``, task cancelled) the upstream connection is closed, not returned to the
pool, so the engine aborts the request.
Timeouts: ``connect_timeout_s`` for the TCP connect, ``first_token_timeout_s`` from
the call to the first chunk with choices (headers, queueing and prefill included; the
role-only or reasoning chunk that engines send after prefill counts), ``idle_timeout_s``
for any gap between bytes after that (SSE keep-alive comments count as bytes).
A 200 answer with a JSON body (a server that ignored ``stream``) is accepted as a
single delta.

``headers`` go with the request: the turn runner sends :data:`REPLY_SEED_HEADER` (the
turn number) with a turn that regenerates another. A real engine ignores it (its
sampling already makes another reply; a ``seed`` field in the body would make a vLLM
request take its slower per-request sampler); the mock engine, whose reply is a
function of the prompt, mixes it in, so a regenerate there says something else too.

Bounds, whatever the engine does: the request always carries ``max_tokens`` when the
caller gives one, so the engine ends the reply itself; after ``max_tokens`` chunks of
the reply (text, a tool call's argument deltas or reasoning: engines send at most one
token per chunk, and a call's markup none) the reply is complete for the caller,
and the client reads on, yielding no more text, to the engine's own end for its report
(real engines send usage and timings in the last chunk), at most ``drain_s`` seconds
and ``drain_chunks`` chunks, then closes the connection (the engine aborts). Past
``max_reply_bytes`` of text, arguments and reasoning it closes at once. Either way the
stream ends with ``finish_reason`` ``"length"``: an engine that ignores ``max_tokens``
(or never stops) cannot make a turn, or the reply stored in history, unbounded.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import orjson

from relay.protocol.sse_reader import SSEDecoder, SSEError
from worker.engines.errors import (
    EngineHTTPError,
    EngineProtocolError,
    EngineStreamError,
    EngineTimeout,
    EngineUnavailable,
)
from worker.engines.report import (
    Report,
    chunk_parts,
    chunk_report,
    header_report,
    parts_bytes,
    to_float,
    to_int,
)

__all__ = [
    "REPLY_SEED_HEADER",
    "Delta",
    "EngineClient",
    "EngineMeta",
    "Usage",
    "chat_completions_url",
]

REPLY_SEED_HEADER = "X-Reply-Seed"  # an integer: another reply to the same prompt

_ERROR_BODY_LIMIT = 64 * 1024
_ERROR_TEXT = 1000  # of a non-JSON error body, kept in the error (clean_reason shortens it)


@dataclass(frozen=True, slots=True)
class EngineMeta:
    """What the engine told us about this request (``None`` where it did not say)."""

    engine_url: str
    status: int
    engine_id: str | None = None
    cached_tokens: int | None = None
    prompt_tokens: int | None = None
    prefill_s: float | None = None
    response_id: str | None = None


@dataclass(frozen=True, slots=True)
class Usage:
    """The request's tokens as the engine reported them anywhere in its answer
    (:mod:`worker.engines.report`); ``computed_tokens`` the prompt tokens it prefilled,
    ``prefill_s``/``decode_s`` its own time for each phase (None: not said)."""

    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None = None
    computed_tokens: int | None = None
    prefill_s: float | None = None
    decode_s: float | None = None


@dataclass(frozen=True, slots=True)
class Delta:
    """A piece of the reply; the last one has ``finish_reason``. ``extra``: what the
    chunk's delta carried besides text, as the engine sent it (``tool_calls``,
    ``reasoning_content`` or ``reasoning``) and the choice's ``logprobs``."""

    text: str
    finish_reason: str | None = None
    meta: EngineMeta | None = None
    usage: Usage | None = None
    extra: dict[str, Any] | None = None


def chat_completions_url(engine_url: str) -> str:
    """``http://h:p`` or ``http://h:p/v1`` or the full endpoint -> the full endpoint."""
    base = engine_url.rstrip("/")
    if base.endswith("/chat/completions"):
        return base
    if base.endswith("/v1"):
        return base + "/chat/completions"
    return base + "/v1/chat/completions"


def _meta_from_headers(url: str, resp: aiohttp.ClientResponse) -> EngineMeta:
    r = header_report(resp.headers)
    return EngineMeta(
        engine_url=url,
        status=resp.status,
        engine_id=r.engine_id,
        cached_tokens=r.cached_tokens,
        prompt_tokens=r.prompt_tokens,
        prefill_s=r.prefill_s,
    )


def _merge_meta(meta: EngineMeta, obj: Mapping[str, Any], said: Report) -> EngineMeta:
    """Fill what the headers did not say from what the stream said so far (``said``)
    and the chunk's id."""
    rid = obj.get("id")
    return replace(
        meta,
        engine_id=meta.engine_id if meta.engine_id is not None else said.engine_id,
        cached_tokens=meta.cached_tokens if meta.cached_tokens is not None else said.cached_tokens,
        prompt_tokens=meta.prompt_tokens if meta.prompt_tokens is not None else said.prompt_tokens,
        prefill_s=meta.prefill_s if meta.prefill_s is not None else said.prefill_s,
        response_id=meta.response_id or (rid if isinstance(rid, str) else None),
    )


def _usage(report: Report) -> Usage | None:
    """The final delta's usage: everything the engine said, wherever (None: nothing)."""
    if report.empty:
        return None
    return Usage(
        report.prompt_tokens,
        report.completion_tokens,
        report.cached_tokens,
        computed_tokens=report.computed_tokens,
        prefill_s=report.prefill_s,
        decode_s=report.decode_s,
    )


def _error_object(obj: Mapping[str, Any]) -> tuple[int, str, str] | None:
    """(status, message, type) if ``obj`` is an OpenAI/vLLM/llama.cpp error object."""
    err: object = obj.get("error")
    if err is None and obj.get("object") == "error":
        err = obj
    if err is None:
        return None
    kind = ""
    if isinstance(err, Mapping):
        code = to_int(err.get("code"))
        message = str(err.get("message") or err.get("type") or "engine error")
        kind = str(err.get("type") or "")
    else:
        code, message = None, str(err)
    status = code if code is not None and 400 <= code <= 599 else 500
    return status, message, kind


def _retry_after(resp: aiohttp.ClientResponse) -> float | None:
    return to_float(resp.headers.get("Retry-After"))


class EngineClient:
    """Streams chat completions from OpenAI-compatible engines over one aiohttp session."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        connect_timeout_s: float = 3.0,
        first_token_timeout_s: float = 60.0,
        idle_timeout_s: float = 30.0,
        include_usage: bool = True,
        max_reply_bytes: int = 256 * 1024,
        drain_s: float = 2.0,
        drain_chunks: int = 16,
    ) -> None:
        self._session = session
        self.connect_timeout_s = connect_timeout_s
        self.first_token_timeout_s = first_token_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.include_usage = include_usage
        self.max_reply_bytes = max_reply_bytes
        self.drain_s = drain_s
        self.drain_chunks = drain_chunks

    async def stream_chat(
        self,
        engine_url: str,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        max_tokens: int | None = None,
        *,
        extra_body: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        first_token_timeout_s: float | None = None,
    ) -> AsyncGenerator[Delta, None]:
        """Stream one chat completion; see the module docstring for the contract.
        ``first_token_timeout_s``: this engine's own (a CPU engine's prefill takes
        minutes), else the client's."""
        url = chat_completions_url(engine_url)
        body: dict[str, Any] = {"model": model, "messages": list(messages), "stream": True}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if self.include_usage:
            body["stream_options"] = {"include_usage": True}
        if extra_body:
            body.update(extra_body)
        loop = asyncio.get_running_loop()
        first_s = first_token_timeout_s or self.first_token_timeout_s
        first_deadline = loop.time() + first_s
        resp = await self._open(url, body, headers, first_deadline, first_s)
        completed = False
        try:
            meta = _meta_from_headers(url, resp)
            if resp.status != 200:
                raise await self._http_error(url, resp)
            ctype = resp.headers.get("Content-Type", "").lower()
            if ctype.startswith("application/json"):
                async for d in self._whole(url, resp, meta, first_deadline, first_s):
                    yield d
            else:
                cut: list[bool] = []
                events = self._events(url, resp, meta, (first_deadline, first_s), max_tokens, cut)
                async for d in events:
                    yield d
                if cut:
                    return  # cut by us: ``completed`` stays False, the connection closes
            completed = True
        finally:
            if completed:
                resp.release()
            else:
                resp.close()  # drop the connection: the engine sees a disconnect and aborts

    async def _open(
        self,
        url: str,
        body: dict[str, Any],
        headers: Mapping[str, str] | None,
        deadline: float,
        first_s: float,
    ) -> aiohttp.ClientResponse:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s)
        hdrs = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        hdrs.update(headers or {})
        try:
            async with asyncio.timeout_at(deadline):
                return await self._session.post(
                    url, data=orjson.dumps(body), headers=hdrs, timeout=timeout
                )
        except aiohttp.ConnectionTimeoutError:
            raise EngineUnavailable(
                f"connect to {url} timed out after {self.connect_timeout_s:g}s", engine_url=url
            ) from None
        except aiohttp.ClientConnectionError as exc:
            raise EngineUnavailable(f"cannot reach {url}: {exc}", engine_url=url) from exc
        except TimeoutError:
            raise EngineTimeout("first_token", first_s, engine_url=url) from None
        except aiohttp.ClientError as exc:  # e.g. a malformed HTTP response
            raise EngineProtocolError(f"bad HTTP answer from {url}: {exc}", engine_url=url) from exc

    async def _http_error(self, url: str, resp: aiohttp.ClientResponse) -> EngineHTTPError:
        raw = b""
        try:
            async with asyncio.timeout(min(5.0, self.idle_timeout_s)):
                while len(raw) < _ERROR_BODY_LIMIT:
                    chunk = await resp.content.read(_ERROR_BODY_LIMIT - len(raw))
                    if not chunk:
                        break
                    raw += chunk
        except (TimeoutError, aiohttp.ClientError):
            pass
        text = raw.decode("utf-8", "replace")
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            obj = None
        said, kind = text.strip()[:_ERROR_TEXT], ""
        if isinstance(obj, Mapping) and (found := _error_object(obj)) is not None:
            said, kind = found[1], found[2]
        message = f"engine answered HTTP {resp.status}" + (f": {said}" if said else "")
        return EngineHTTPError(
            resp.status, text, message=message, retry_after_s=_retry_after(resp),
            engine_url=url, engine_message=said, engine_type=kind,
        )  # fmt: skip

    async def _whole(
        self,
        url: str,
        resp: aiohttp.ClientResponse,
        meta: EngineMeta,
        deadline: float,
        first_s: float,
    ) -> AsyncGenerator[Delta, None]:
        try:
            async with asyncio.timeout_at(deadline):
                raw = await resp.read()
        except TimeoutError:
            raise EngineTimeout("first_token", first_s, engine_url=url) from None
        except aiohttp.ClientError as exc:
            raise EngineUnavailable(
                f"connection to {url} lost: {exc}", engine_url=url, mid_stream=True
            ) from exc
        obj = self._json(url, raw.decode("utf-8", "replace"))
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
            raise EngineProtocolError(f"no choices in the answer of {url}", engine_url=url)
        message = choices[0].get("message")
        content = message.get("content") if isinstance(message, Mapping) else None
        finish = choices[0].get("finish_reason")
        said = header_report(resp.headers).merged(chunk_report(obj))
        meta = _merge_meta(meta, obj, said)
        first: EngineMeta | None = meta
        if (extra := chunk_parts(message, choices[0])) is not None:  # tool calls, reasoning
            yield Delta("", meta=first, extra=extra)
            first = None
        if isinstance(content, str) and content:
            yield Delta(content, meta=first)
            first = None
        reason = finish if isinstance(finish, str) and finish else "stop"
        yield Delta("", reason, first, _usage(said))

    def _json(self, url: str, data: str) -> Mapping[str, Any]:
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise EngineProtocolError(
                f"invalid JSON from {url}: {data[:200]!r}", engine_url=url
            ) from None
        if not isinstance(obj, Mapping):
            raise EngineProtocolError(f"expected a JSON object from {url}", engine_url=url)
        if (found := _error_object(obj)) is not None:
            status, message, kind = found
            raise EngineStreamError(
                status, data, message=message, engine_url=url, engine_message=message,
                engine_type=kind,
            )  # fmt: skip
        return obj

    async def _events(
        self,
        url: str,
        resp: aiohttp.ClientResponse,
        meta: EngineMeta,
        first: tuple[float, float],
        max_tokens: int | None,
        cut: list[bool],
    ) -> AsyncGenerator[Delta, None]:
        """The stream's deltas; appends to ``cut`` when it stops at a bound (see above).

        After ``max_tokens`` chunks of the reply the reply is complete for the caller, but
        the engine's report (usage, timings) comes in its last chunk: the rest of the
        stream is read without yielding text, bounded by ``drain_s`` and
        ``drain_chunks``, and cut past either (the engine, sent ``max_tokens``, ends
        itself one chunk later)."""
        loop = asyncio.get_running_loop()
        first_deadline, first_s = first
        chunks = nbytes = 0
        decoder = SSEDecoder()
        pending_meta: EngineMeta | None = meta
        said = header_report(resp.headers)
        got_first = False
        finish: str | None = None
        done = eof = False
        drain_until: float | None = None  # reading on for the report, text complete
        drained = 0
        while not done and not eof:
            if drain_until is not None:
                phase, limit = "drain", self.drain_s
                deadline = min(drain_until, loop.time() + self.idle_timeout_s)
            elif got_first:
                phase, limit, deadline = "idle", self.idle_timeout_s, loop.time()
                deadline += self.idle_timeout_s
            else:
                phase, limit, deadline = "first_token", first_s, first_deadline
            try:
                async with asyncio.timeout_at(deadline):
                    chunk = await resp.content.readany()
            except TimeoutError:
                if drain_until is not None:
                    break  # the text is whole: end it with what the engine said so far
                raise EngineTimeout(phase, limit, engine_url=url) from None
            except (aiohttp.ClientError, ConnectionError) as exc:
                if drain_until is not None:
                    break
                raise EngineUnavailable(
                    f"connection to {url} lost mid-stream: {exc}", engine_url=url, mid_stream=True
                ) from exc
            try:
                events = decoder.feed(chunk) if chunk else decoder.close()
            except SSEError as exc:
                raise EngineProtocolError(f"{url}: {exc}", engine_url=url) from exc
            eof = not chunk
            for ev in events:
                if ev.data.strip() == "[DONE]":
                    done = True
                    break
                obj = self._json(url, ev.data)
                said = said.merged(chunk_report(obj))
                if pending_meta is not None:
                    pending_meta = _merge_meta(pending_meta, obj, said)
                choices = obj.get("choices")
                if choices is None or choices == []:
                    continue
                if not isinstance(choices, list) or not isinstance(choices[0], Mapping):
                    raise EngineProtocolError(
                        f"bad 'choices' in a chunk from {url}", engine_url=url
                    )
                got_first = True  # engines send the first choice chunk after prefill
                choice = choices[0]
                reason = choice.get("finish_reason")
                if isinstance(reason, str) and reason and drain_until is None:
                    finish = reason
                if drain_until is not None:
                    drained += 1
                    if drained > self.drain_chunks:
                        eof = True  # an engine that ignores max_tokens: stop here
                        break
                    continue
                delta = choice.get("delta")
                content = delta.get("content") if isinstance(delta, Mapping) else None
                counted = False  # a chunk of the reply: text, a call's arguments, reasoning
                if (extra := chunk_parts(delta, choice)) is not None:
                    size = parts_bytes(extra)
                    if finish is None and nbytes + size > self.max_reply_bytes:
                        cut.append(True)  # past the byte bound: no drain, cut at once
                        yield Delta("", "length", pending_meta, _usage(said))
                        return
                    yield Delta("", meta=pending_meta, extra=extra)  # tool calls, reasoning
                    pending_meta = None
                    nbytes += size
                    counted = size > 0 or "tool_calls" in extra
                if isinstance(content, str) and content:
                    room = self.max_reply_bytes - nbytes
                    data = content.encode()
                    if len(data) > room:  # keep whole characters within the byte bound
                        content = data[:room].decode("utf-8", "ignore")
                    if content:
                        yield Delta(content, meta=pending_meta)
                        pending_meta = None
                    counted = True
                    nbytes += len(content.encode())
                    if finish is None and (len(data) > room or nbytes >= self.max_reply_bytes):
                        cut.append(True)  # past the byte bound: no drain, cut at once
                        yield Delta("", "length", pending_meta, _usage(said))
                        return
                chunks += counted
                if counted and finish is None and max_tokens is not None and chunks >= max_tokens:
                    finish = "length"
                    drain_until = loop.time() + self.drain_s
        if drain_until is not None and not done:
            cut.append(True)  # the engine did not end within the drain: close it
        elif finish is None:
            if not done:
                raise EngineProtocolError(
                    f"stream from {url} ended without finish_reason or [DONE]", engine_url=url
                )
            finish = "stop"
        yield Delta("", finish or "length", pending_meta, _usage(said))
