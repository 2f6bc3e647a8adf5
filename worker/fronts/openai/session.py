"""The OpenAI gateway tied to a tokenrelay session: other screens watch the completion.

A ``POST /v1/chat/completions`` that names a session (header ``X-Session-Id: <sid>``, or
``"user": "session:<sid>"``) runs as one of that session's turns instead of a bare
engine request: the same lock (one turn at a time), router, presence and backlog, so
every screen on the session (relays, any reconnect) sees it stream, and the exchange is
appended to the session's history. The request's own ``messages`` are the prompt; they
end with the user's message, or with the tools' results (``role: tool``) of the reply
before, which are stored in the history with the turn. The
OpenAI answer is built from the turn's frames as they are published (the closed loop's
viewer, :mod:`worker.chat.direct`): ``token`` frames become content deltas, ``done`` the
finish (``usage`` from its meta), ``error`` an OpenAI error.

Auth: a completion tied to a session needs that session's ``write`` token as the bearer
(``OpenAI(api_key=<token>, default_headers={"X-Session-Id": sid})``, or the same token
with the ``user`` form); with the header it is checked before the body is read. A
gateway key never writes into a session (403 ``session_token_required``): the key is the
operator's for session-less completions, and a session's history and screens belong to
whoever holds its write token.

Order of use: :func:`session_of` on a parsed request; when it names one,
:func:`complete` answers it (``worker.fronts.openai.http`` does both).
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from aiohttp import web

from relay.broker.errors import RelayError
from relay.protocol import sse
from relay.protocol.auth import AuthError
from relay.protocol.keys import InvalidSessionId, parse_session
from relay.service.apikeys import check_api_key
from relay.service.errors import error_body
from worker.chat.direct import DirectViewer
from worker.chat.prompt import new_input
from worker.chat.turnstate import Draining, TurnBusy
from worker.fronts.base import Gateway
from worker.fronts.errors import REFUSED_BY_ENGINE, WireError
from worker.fronts.openai.wire import (
    ChatRequest,
    PartDeltas,
    chunk,
    completion,
    gather,
    new_id,
    usage,
    usage_chunk,
)
from worker.routing.lease import AllEnginesFull

__all__ = ["SESSION_HEADER", "authorize", "complete", "session_of"]

SESSION_HEADER = "X-Session-Id"
_USER_PREFIX = "session:"


def session_of(request: web.Request, req: ChatRequest) -> str | None:
    """The session the request names, or None; :class:`WireError` for a bad id."""
    raw = request.headers.get(SESSION_HEADER) or None
    if raw is None and req.user is not None and req.user.startswith(_USER_PREFIX):
        raw = req.user[len(_USER_PREFIX) :]
    if raw is None:
        return None
    try:
        return parse_session(raw)
    except InvalidSessionId as exc:
        raise WireError(400, f"bad session id: {exc}", param="session") from None


def authorize(gw: Gateway, request: web.Request, sid: str) -> WireError | None:
    """None when the request may run on ``sid``: it carries the session's write token."""
    if not gw.cfg.auth:
        return None
    if gw.cfg.keys and check_api_key(gw.cfg.keys, request.headers.get("Authorization")) is None:
        return WireError(403, "a gateway key cannot write into a session: send the session's "
                         "write token as the bearer", kind="permission_error",
                         code="session_token_required")  # fmt: skip
    if gw.access is None:
        return WireError(401, "no session tokens here", kind="authentication_error")
    try:
        gw.access.authorize(request, sid, "write")
    except AuthError as exc:
        return WireError(exc.status, exc.reason, kind="authentication_error", code=exc.error)
    return None


def _event(obj: dict[str, Any]) -> bytes:
    return sse.event(orjson.dumps(obj))


def _usage(meta: dict[str, Any], tokens: int) -> dict[str, Any]:
    prompt = meta.get("prompt_tokens")
    cached = meta.get("cached_tokens")
    return usage(
        prompt if isinstance(prompt, int) else None,
        int(meta.get("tokens") or tokens),
        cached if isinstance(cached, int) else None,
    )


async def complete(
    request: web.Request, gw: Gateway, req: ChatRequest, sid: str
) -> web.StreamResponse:
    """Run ``req`` as a turn of ``sid`` and answer it in OpenAI's format (the caller has
    authorized it: :func:`authorize` for the header's session, a gateway key for the
    ``user`` form)."""
    if gw.turns is None:
        return gw.error(WireError(400, "sessions are not available on this gateway"))
    convo = req.conversation
    new = new_input(convo)
    if new is None:
        return gw.error(WireError(400, "with a session, the last message must be the user's "
                                  "or a tool's result", param="messages"))  # fmt: skip
    viewer = DirectViewer()
    try:
        if await gw.turns.store.gone(sid):
            return gw.error(WireError(410, "the session was deleted", code="session_deleted"))
        await gw.turns.start_turn(
            sid, new.message, system=req.system, max_tokens=req.max_tokens,
            viewer=viewer, conversation=convo, options=req.options, tool_results=new.results,
        )  # fmt: skip
    except TurnBusy:
        return gw.error(WireError(409, "a turn of this session is generating; watch it",
                                  code="turn_in_progress"))  # fmt: skip
    except AllEnginesFull as exc:
        retry = str(max(1, round(exc.retry_after_s + 0.5)))
        return gw.error(WireError(429, "every engine is busy; retry", kind="rate_limit_error",
                                  code="engines_full"), {"Retry-After": retry})  # fmt: skip
    except (Draining, RelayError):
        busy = WireError(503, "the worker cannot take turns now; retry", kind="api_error",
                         code="unavailable")  # fmt: skip
        return gw.error(busy, {"Retry-After": "1"})
    cid, created = new_id(), int(time.time())
    resp: web.StreamResponse | None = None
    text: list[str] = []
    parts = PartDeltas()  # tool calls and reasoning: as deltas, or into the whole message
    extra: dict[str, Any] = {}
    try:
        if req.stream:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})  # fmt: skip
            await resp.prepare(request)
            first = {"role": "assistant", "content": ""}
            await resp.write(_event(chunk(cid, created, req.model, first, None)))
        async for _offset, kind, data in viewer.frames():
            frame = orjson.loads(data)
            if kind == "token":
                text.append(frame.get("text", ""))
                if resp is not None:
                    delta = {"content": frame.get("text", "")}
                    await resp.write(_event(chunk(cid, created, req.model, delta, None)))
            elif kind == "part":
                pd = parts.delta(frame.get("meta") or {}, frame.get("text", ""))
                if pd is not None and resp is not None:
                    await resp.write(_event(chunk(cid, created, req.model, pd, None)))
                elif pd is not None:
                    gather(extra, pd)
            elif kind == "done":
                meta = frame.get("meta") or {}
                finish = meta.get("finish_reason") or "stop"
                use = _usage(meta, len(text))
                if resp is None:
                    body = completion(cid, req.model, text, finish, use, extra)
                    return web.Response(body=orjson.dumps(body), content_type="application/json")
                await resp.write(_event(chunk(cid, created, req.model, {}, finish)))
                if req.include_usage:
                    await resp.write(_event(usage_chunk(cid, created, req.model, use)))
                await resp.write(sse.DONE)
                await resp.write_eof()
                return resp
            elif kind == "error":
                wire = WireError(502, f"the turn ended: {frame.get('text', '')}"[:300],
                                 kind="api_error", code="turn_error")  # fmt: skip
                refused = REFUSED_BY_ENGINE.get(str((frame.get("meta") or {}).get("code")))
                if refused is not None:  # the engine's reason, in OpenAI's code for it
                    wire = WireError(400, str(frame.get("text", ""))[:300], code=refused)
                if resp is None:
                    return gw.error(wire)
                await resp.write(_event(error_body(wire.message, wire.kind, wire.code)))
                return resp
    except (ConnectionResetError, web.HTTPException):
        return resp or web.StreamResponse()
    finally:
        viewer.detach()  # the turn goes on for the session's other screens
    wire = WireError(502, "the turn's stream ended early", kind="api_error", code="turn_error")
    if resp is None:
        return gw.error(wire)
    await resp.write(_event(error_body(wire.message, wire.kind, wire.code)))
    return resp
