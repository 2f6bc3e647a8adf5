"""An OpenAI-compatible gateway on the worker: cache-affine routing with no session API.

``POST /v1/chat/completions`` (stream and non-stream, OpenAI's wire format with
``usage``) goes through the same prefix-aware bounded-load router as chat turns (the
routing key is the system prompt's digest + the conversation's head, so requests that
share a prefix land on the engine that holds it), waits up to ``admit_wait_s`` for an
engine slot, and streams from the engine; ``GET /v1/models`` lists the served model.
Any OpenAI client works: ``OpenAI(base_url="http://worker:8000/v1", api_key=KEY)``.

With ``X-Session-Id: <sid>`` (or ``"user": "session:<sid>"``) the request runs as a turn
of that session, watched by its other screens (:mod:`worker.fronts.openai.session`).

Auth: ``Authorization: Bearer <key>`` with one of the worker's gateway keys
(``--gateway-key``, compared in constant time). A worker started with
``--insecure-no-auth`` serves everyone; a worker with auth and no gateway key answers
401 with the reason (the gateway is off rather than open).

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400/404/413
for the request (:mod:`worker.fronts.openai.wire`), 401, 429 + ``Retry-After`` when every
engine is full, 502 for an engine's error answer, 503 when no engine is reachable or the
worker drains, 504 when the engine times out. An error after the stream started is one
``data: {"error": ...}`` event, and the stream ends without ``[DONE]``.

Every request holds exactly one lease, released when the engine is done with it, on
every path (client gone included: the upstream response is closed and the engine aborts).

Order of use: ``handlers()`` when the app is built (registered on the route table);
``app[GATEWAY] = Gateway(...)`` at startup (``worker.api`` does both).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Final

import orjson
from aiohttp import web

from relay.protocol import sse
from relay.protocol.keys import InvalidSessionId, parse_session
from relay.service.errors import error_body
from relay.service.register import Handler
from worker.engines.errors import (
    PROMPT_TOO_LONG,
    EngineError,
    EngineHTTPError,
    EngineTimeout,
    EngineUnavailable,
)
from worker.fronts.base import GATEWAY, Gateway, GatewayConfig
from worker.fronts.base import error_response as _error
from worker.fronts.errors import WireError
from worker.fronts.openai import session as gateway_session
from worker.fronts.openai.wire import (
    ChatRequest,
    chunk,
    completion,
    gather,
    new_id,
    parse_request,
    usage,
    usage_chunk,
)
from worker.routing.lease import AllEnginesFull, Lease, release_once

SESSION_HEADER = gateway_session.SESSION_HEADER

__all__ = ["GATEWAY", "Gateway", "GatewayConfig", "handlers"]

log = logging.getLogger(__name__)
_SSE_HEADERS: Final = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


def _engine_wire_error(exc: EngineError) -> WireError:
    if isinstance(exc, EngineTimeout):
        return WireError(504, "the engine timed out", kind="api_error", code="engine_timeout")
    if isinstance(exc, EngineUnavailable):
        return WireError(503, "no engine could be reached", kind="api_error",
                         code="engine_unavailable")  # fmt: skip
    if exc.code == PROMPT_TOO_LONG:  # OpenAI's own code for it
        return WireError(400, exc.public_reason, code="context_length_exceeded")
    if isinstance(exc, EngineHTTPError) and exc.status == 400:
        return WireError(400, f"the engine refused the request: {exc.message}"[:500],
                         code="engine_bad_request")  # fmt: skip
    return WireError(502, "the engine answered with an error", kind="api_error",
                     code="engine_error")  # fmt: skip


async def models(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    refused = gw.authorized(request.headers.get("Authorization"))
    if refused is not None:
        return _error(refused)
    body = {
        "object": "list",
        "data": [{"id": gw.cfg.model, "object": "model", "created": 0, "owned_by": "tokenrelay"}],
    }
    return web.json_response(body, dumps=lambda o: orjson.dumps(o).decode())


async def chat_completions(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    header_sid = request.headers.get(SESSION_HEADER) or None
    # auth before the body is read: the session's own token (header), a gateway key, or a
    # session's write token that the body's `user` must then name
    token_sid: str | None = None
    if header_sid is not None:
        try:
            header_sid = parse_session(header_sid)
        except InvalidSessionId as exc:
            return _error(WireError(400, f"bad session id: {exc}", param="session"))
        refused = gateway_session.authorize(gw, request, header_sid)
    else:
        refused = gw.authorized(request.headers.get("Authorization"))
        if refused is not None and gw.access is not None:
            token_sid = gw.access.token_session(request)
    if refused is not None and token_sid is None:
        return _error(refused)
    body = await gw.create_body(request)
    if isinstance(body, web.Response):
        return body
    try:
        req = parse_request(
            body,
            model=gw.cfg.model,
            default_max_tokens=gw.cfg.default_max_tokens,
            max_tokens_limit=gw.cfg.max_tokens_limit,
            max_chars=gw.cfg.max_chars,
        )
        sid = gateway_session.session_of(request, req)
    except WireError as exc:
        return _error(exc)
    if token_sid is not None and sid is None:  # a session's token, for no session: no key
        return _error(refused or WireError(401, "send a gateway key"))
    if sid is not None and header_sid is None:  # the `user` form: the session's write token
        wrong = gateway_session.authorize(gw, request, sid)
        if wrong is not None:
            return _error(wrong)
    if sid is not None:
        return await gateway_session.complete(request, gw, req, sid)
    try:
        lease = await gw.lease(req)
    except AllEnginesFull as exc:
        retry = str(max(1, math.ceil(exc.retry_after_s)))
        return _error(WireError(429, f"every engine is busy ({exc.reason}); retry",
                                kind="rate_limit_error", code="engines_full"),
                      {"Retry-After": retry})  # fmt: skip
    with lease:  # released on leaving, unless the engine path released it first
        if req.stream:
            return await _stream(request, gw, req, lease)
        return await _whole(gw, req, lease)


async def _whole(gw: Gateway, req: ChatRequest, lease: Lease) -> web.Response:
    text: list[str] = []
    extra: dict[str, Any] = {}  # tool calls, reasoning, logprobs
    finish: str | None = None
    prompt_tokens = cached = completion_tokens = None
    stream = gw.engine.stream_chat(
        lease.engine.url, req.model, req.messages, req.max_tokens, extra_body=req.options,
        first_token_timeout_s=gw.first_token_timeout_s(lease.engine.id),
    )  # fmt: skip
    try:
        async for d in stream:
            if d.meta is not None and prompt_tokens is None:
                prompt_tokens, cached = d.meta.prompt_tokens, d.meta.cached_tokens
            if d.text:
                text.append(d.text)
            if d.extra:
                gather(extra, d.extra)
            if d.usage is not None:
                prompt_tokens = d.usage.prompt_tokens or prompt_tokens
                completion_tokens = d.usage.completion_tokens
                cached = d.usage.cached_tokens if d.usage.cached_tokens is not None else cached
            if d.finish_reason is not None:
                finish = d.finish_reason
    except EngineError as exc:
        return _error(_engine_wire_error(exc))
    finally:
        await stream.aclose()
        release_once(lease)
    use = usage(prompt_tokens, completion_tokens or len(text), cached)
    body = completion(new_id(), req.model, text, finish, use, extra)
    return web.Response(body=orjson.dumps(body), content_type="application/json",
                        headers={"X-Engine-Id": lease.engine.id})  # fmt: skip


def _event(obj: dict[str, Any]) -> bytes:
    return sse.event(orjson.dumps(obj))


def _extra_chunk(cid: str, created: int, model: str, extra: dict[str, Any]) -> dict[str, Any]:
    delta = {k: v for k, v in extra.items() if k != "logprobs"}
    out = chunk(cid, created, model, delta, None)
    if "logprobs" in extra:
        out["choices"][0]["logprobs"] = extra["logprobs"]
    return out


async def _stream(
    request: web.Request, gw: Gateway, req: ChatRequest, lease: Lease
) -> web.StreamResponse:
    cid, created = new_id(), int(time.time())
    resp: web.StreamResponse | None = None
    n = 0
    prompt_tokens = cached = completion_tokens = None
    stream = gw.engine.stream_chat(
        lease.engine.url, req.model, req.messages, req.max_tokens, extra_body=req.options,
        first_token_timeout_s=gw.first_token_timeout_s(lease.engine.id),
    )  # fmt: skip
    try:
        async for d in stream:
            if resp is None:  # the engine answered: from here on errors go in the stream
                resp = web.StreamResponse(headers={**_SSE_HEADERS, "X-Engine-Id": lease.engine.id})
                await resp.prepare(request)
                first = {"role": "assistant", "content": ""}
                await resp.write(_event(chunk(cid, created, req.model, first, None)))
            if d.meta is not None and prompt_tokens is None:
                prompt_tokens, cached = d.meta.prompt_tokens, d.meta.cached_tokens
            if d.usage is not None:
                prompt_tokens = d.usage.prompt_tokens or prompt_tokens
                completion_tokens = d.usage.completion_tokens
                cached = d.usage.cached_tokens if d.usage.cached_tokens is not None else cached
            if d.extra:  # tool-call chunks and reasoning as the engine sent them
                await resp.write(_event(_extra_chunk(cid, created, req.model, d.extra)))
            if d.text:
                n += 1
                await resp.write(_event(chunk(cid, created, req.model, {"content": d.text}, None)))
            if d.finish_reason is not None:
                await resp.write(_event(chunk(cid, created, req.model, {}, d.finish_reason)))
    except EngineError as exc:
        wire = _engine_wire_error(exc)
        if resp is None:
            return _error(wire)
        await resp.write(_event(error_body(wire.message, wire.kind, wire.code)))
        return resp
    except (ConnectionResetError, OSError):
        log.debug("gateway client left mid-stream")  # the engine request is closed below
        return resp or web.StreamResponse()
    finally:
        await stream.aclose()
        release_once(lease)
    if resp is None:  # an engine that ended without a single delta
        return _error(WireError(502, "the engine sent no answer", kind="api_error",
                                code="engine_error"))  # fmt: skip
    if req.include_usage:
        use = usage(prompt_tokens, completion_tokens or n, cached)
        await resp.write(_event(usage_chunk(cid, created, req.model, use)))
    await resp.write(sse.DONE)
    await resp.write_eof()
    return resp


def handlers() -> dict[str, Handler]:
    """The gateway's handlers, by their names in relay/service/routes.py."""
    return {"openai.chat": chat_completions, "openai.models": models}
