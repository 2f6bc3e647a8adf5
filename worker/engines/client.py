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
``finish_reason`` set (and ``usage`` when the engine sent it); the first delta yielded
carries ``meta`` (engine id, cached prefix tokens, from the ``x-engine-id`` /
``x-prefix-cache-hit-tokens`` headers or the mock's ``"tokenrelay"`` field). When the
consumer stops early (``aclose``, leaving ``aclosing``, task cancelled) the upstream
connection is closed, not returned to the pool, so the engine aborts the request.
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
caller gives one, and the client itself stops reading after ``max_tokens`` content
chunks (engines send about one token per chunk) or ``max_reply_bytes`` of text, closes
the connection (the engine aborts the request) and ends the stream with
``finish_reason`` ``"length"``: an engine that ignores ``max_tokens`` (or never stops)
cannot make a turn, or the reply stored in history, unbounded.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

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
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None = None


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


_EXTRA: Final = ("tool_calls", "reasoning_content", "reasoning")


def _extra(delta: object, choice: Mapping[str, Any]) -> dict[str, Any] | None:
    """A delta's (or a whole answer's message's) parts besides text, and the logprobs."""
    out = {k: v for k in _EXTRA if isinstance(delta, Mapping) and (v := delta.get(k))}
    if choice.get("logprobs"):
        out["logprobs"] = choice["logprobs"]
    return out or None


def chat_completions_url(engine_url: str) -> str:
    """``http://h:p`` or ``http://h:p/v1`` or the full endpoint -> the full endpoint."""
    base = engine_url.rstrip("/")
    if base.endswith("/chat/completions"):
        return base
    if base.endswith("/v1"):
        return base + "/chat/completions"
    return base + "/v1/chat/completions"


def _int(v: object) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        try:
            return int(v)
        except ValueError:
            return None
    return None


def _float(v: object) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    try:
        return float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _meta_from_headers(url: str, resp: aiohttp.ClientResponse) -> EngineMeta:
    h = resp.headers
    return EngineMeta(
        engine_url=url,
        status=resp.status,
        engine_id=h.get("x-engine-id"),
        cached_tokens=_int(h.get("x-prefix-cache-hit-tokens")),
        prompt_tokens=_int(h.get("x-prompt-tokens")),
        prefill_s=_float(h.get("x-prefill-s")),
    )


def _merge_meta(meta: EngineMeta, obj: Mapping[str, Any]) -> EngineMeta:
    """Fill what headers did not say from a chunk (its id, the mock's extra field)."""
    extra = obj.get("tokenrelay")
    extra = extra if isinstance(extra, Mapping) else {}
    rid = obj.get("id")
    return replace(
        meta,
        engine_id=meta.engine_id if meta.engine_id is not None else extra.get("engine_id"),
        cached_tokens=meta.cached_tokens
        if meta.cached_tokens is not None
        else _int(extra.get("cached_tokens")),
        prompt_tokens=meta.prompt_tokens
        if meta.prompt_tokens is not None
        else _int(extra.get("prompt_tokens")),
        prefill_s=meta.prefill_s if meta.prefill_s is not None else _float(extra.get("prefill_s")),
        response_id=meta.response_id or (rid if isinstance(rid, str) else None),
    )


def _usage(obj: object) -> Usage | None:
    if not isinstance(obj, Mapping):
        return None
    details = obj.get("prompt_tokens_details")
    cached = _int(details.get("cached_tokens")) if isinstance(details, Mapping) else None
    return Usage(_int(obj.get("prompt_tokens")), _int(obj.get("completion_tokens")), cached)


def _error_object(obj: Mapping[str, Any]) -> tuple[int, str] | None:
    """(status, message) if ``obj`` is an OpenAI/vLLM error object, else None."""
    err: object = obj.get("error")
    if err is None and obj.get("object") == "error":
        err = obj
    if err is None:
        return None
    if isinstance(err, Mapping):
        code = _int(err.get("code"))
        message = str(err.get("message") or err.get("type") or "engine error")
    else:
        code, message = None, str(err)
    status = code if code is not None and 400 <= code <= 599 else 500
    return status, message


def _retry_after(resp: aiohttp.ClientResponse) -> float | None:
    value = _float(resp.headers.get("Retry-After"))
    return value if value is not None and value >= 0 else None


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
    ) -> None:
        self._session = session
        self.connect_timeout_s = connect_timeout_s
        self.first_token_timeout_s = first_token_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.include_usage = include_usage
        self.max_reply_bytes = max_reply_bytes

    async def stream_chat(
        self,
        engine_url: str,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        max_tokens: int | None = None,
        *,
        extra_body: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> AsyncGenerator[Delta, None]:
        """Stream one chat completion; see the module docstring for the contract."""
        url = chat_completions_url(engine_url)
        body: dict[str, Any] = {"model": model, "messages": list(messages), "stream": True}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if self.include_usage:
            body["stream_options"] = {"include_usage": True}
        if extra_body:
            body.update(extra_body)
        loop = asyncio.get_running_loop()
        first_deadline = loop.time() + self.first_token_timeout_s
        resp = await self._open(url, body, headers, first_deadline)
        completed = False
        try:
            meta = _meta_from_headers(url, resp)
            if resp.status != 200:
                raise await self._http_error(url, resp)
            ctype = resp.headers.get("Content-Type", "").lower()
            if ctype.startswith("application/json"):
                async for d in self._whole(url, resp, meta, first_deadline):
                    yield d
            else:
                cut: list[bool] = []
                async for d in self._events(url, resp, meta, first_deadline, max_tokens, cut):
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
            raise EngineTimeout("first_token", self.first_token_timeout_s, engine_url=url) from None
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
        message = f"engine answered HTTP {resp.status}"
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            obj = None
        if isinstance(obj, Mapping) and (found := _error_object(obj)) is not None:
            message = f"{message}: {found[1]}"
        elif text.strip():
            message = f"{message}: {text.strip()[:200]}"
        return EngineHTTPError(
            resp.status, text, message=message, retry_after_s=_retry_after(resp), engine_url=url
        )

    async def _whole(
        self, url: str, resp: aiohttp.ClientResponse, meta: EngineMeta, deadline: float
    ) -> AsyncGenerator[Delta, None]:
        try:
            async with asyncio.timeout_at(deadline):
                raw = await resp.read()
        except TimeoutError:
            raise EngineTimeout("first_token", self.first_token_timeout_s, engine_url=url) from None
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
        meta = _merge_meta(meta, obj)
        first: EngineMeta | None = meta
        if (extra := _extra(message, choices[0])) is not None:  # tool calls, reasoning
            yield Delta("", meta=first, extra=extra)
            first = None
        if isinstance(content, str) and content:
            yield Delta(content, meta=first)
            meta_out = None
        else:
            meta_out = first
        reason = finish if isinstance(finish, str) and finish else "stop"
        yield Delta("", reason, meta_out, _usage(obj.get("usage")))

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
            status, message = found
            raise EngineStreamError(status, data, message=message, engine_url=url)
        return obj

    async def _events(
        self,
        url: str,
        resp: aiohttp.ClientResponse,
        meta: EngineMeta,
        first_deadline: float,
        max_tokens: int | None,
        cut: list[bool],
    ) -> AsyncGenerator[Delta, None]:
        """The stream's deltas; appends to ``cut`` when it stops at a bound (see above)."""
        loop = asyncio.get_running_loop()
        chunks = nbytes = 0
        decoder = SSEDecoder()
        pending_meta: EngineMeta | None = meta
        got_first = False
        finish: str | None = None
        usage: Usage | None = None
        done = eof = False
        while not done and not eof:
            if got_first:
                phase, limit, deadline = "idle", self.idle_timeout_s, loop.time()
                deadline += self.idle_timeout_s
            else:
                phase, limit, deadline = "first_token", self.first_token_timeout_s, first_deadline
            try:
                async with asyncio.timeout_at(deadline):
                    chunk = await resp.content.readany()
            except TimeoutError:
                raise EngineTimeout(phase, limit, engine_url=url) from None
            except (aiohttp.ClientError, ConnectionError) as exc:
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
                if pending_meta is not None:
                    pending_meta = _merge_meta(pending_meta, obj)
                usage = _usage(obj.get("usage")) or usage
                choices = obj.get("choices")
                if choices is None or choices == []:
                    continue
                if not isinstance(choices, list) or not isinstance(choices[0], Mapping):
                    raise EngineProtocolError(
                        f"bad 'choices' in a chunk from {url}", engine_url=url
                    )
                got_first = True  # engines send the first choice chunk after prefill
                choice = choices[0]
                delta = choice.get("delta")
                content = delta.get("content") if isinstance(delta, Mapping) else None
                reason = choice.get("finish_reason")
                if isinstance(reason, str) and reason:
                    finish = reason
                if (extra := _extra(delta, choice)) is not None:
                    yield Delta("", meta=pending_meta, extra=extra)  # tool calls, reasoning
                    pending_meta = None
                if isinstance(content, str) and content:
                    room = self.max_reply_bytes - nbytes
                    data = content.encode()
                    if len(data) > room:  # keep whole characters within the byte bound
                        content = data[:room].decode("utf-8", "ignore")
                    if content:
                        yield Delta(content, meta=pending_meta)
                        pending_meta = None
                    chunks += 1
                    nbytes += len(content.encode())
                    if finish is None and (
                        len(data) > room
                        or nbytes >= self.max_reply_bytes
                        or (max_tokens is not None and chunks >= max_tokens)
                    ):
                        cut.append(True)
                        yield Delta("", "length", pending_meta, usage)
                        return
        if finish is None:
            if not done:
                raise EngineProtocolError(
                    f"stream from {url} ended without finish_reason or [DONE]", engine_url=url
                )
            finish = "stop"
        yield Delta("", finish, pending_meta, usage)
