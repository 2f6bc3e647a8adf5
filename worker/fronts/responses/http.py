"""OpenAI's Responses API on the worker: a response is a turn of a session.

- ``POST /v1/responses``: without ``previous_response_id`` / ``conversation`` a new
  session (its first turn); with one, the next turn of that session, so the router's
  key (the session's system prompt and conversation head) keeps the conversation on
  the engine that holds its prefix. ``stream``: the events as the turn's frames are
  written (the closed loop, :mod:`worker.chat.direct`; past its bounded queue, the
  backlog); else the response object when the turn ends, or at once with
  ``background`` (the turn then runs to its end with nobody watching).
- ``GET /v1/responses/{id}``: the object as it stands (``in_progress`` while it runs),
  from the backlog (any worker), else from the session's stored history;
  ``?stream=true&starting_after=N``: the events after ``N``, replayed from the backlog
  and then live (:func:`backlog_frames`), on any worker, for as long as the backlog
  keeps the turn. The relays serve the same stream (:mod:`relay.fronts.responses.http`); both
  translate with :mod:`relay.fronts.responses.wire`, so both write the same events.
- ``POST /v1/responses/{id}/cancel``: :meth:`worker.chat.turn.TurnManager.stop` (any
  worker stops any turn), then the object once the turn ended (``cancelled``).
- ``DELETE /v1/responses/{id}``: the response's conversation is its session, and that
  session is deleted (:func:`worker.controls.delete_session`): every response of it.
- ``GET /v1/responses/{id}/input_items``: the turn's input: the tools' results it was
  sent (``function_call_output``) and the user's message.

Auth: a gateway key (``--gateway-key``). A response and its conversation belong to the
key that created them (their session's state hash holds the kit's owner tag,
:func:`relay.service.apikeys.owner_tag`: ``responses:`` and a keyed digest of the key):
another key, like a session of the session API (whose history belongs to its write
token's holder), gets a 404 as for an id that never existed, on every route and as a
``previous_response_id`` or ``conversation``.

Errors: OpenAI's body; 400 (``context_length_exceeded`` for too much text), 401, 404,
409 (a response of the conversation is still generating), 413 (a body past the
worker's bound), 429 + ``Retry-After`` (every engine busy, rate limits), 503 (no
engine reachable, Redis down, draining); a turn that fails after a non-streamed,
non-background create: 503 ``engine_unavailable`` when no engine could serve it, 504
on the engine's timeout, else 500.

Order of use: ``handlers()`` (``worker.api`` registers them on the route table).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Any, Final

import orjson
from aiohttp import ClientConnectionResetError, web

from relay.broker.errors import RelayError
from relay.fronts.responses.wire import (
    OWNER,
    OWNER_FIELD,
    SSE_HEADERS,
    InvalidResponseId,
    ResponseId,
    ResponseTurn,
    encode_event,
    parse_conversation_id,
    parse_response_id,
    response_object,
)
from relay.protocol.frame import Frame, FrameError, decode
from relay.protocol.keys import new_session_id
from relay.service import cors
from relay.service.apikeys import owner_tag, owns
from relay.service.errors import Reject
from relay.service.register import Handler
from worker.access import RateLimited
from worker.chat.cancel import StopStatus
from worker.chat.direct import DirectViewer
from worker.chat.prompt import as_entry
from worker.chat.turnstate import Draining, TurnBusy
from worker.controls import delete_session
from worker.fronts.base import GATEWAY
from worker.fronts.base import error_response as _error
from worker.fronts.errors import REFUSED_BY_ENGINE, WireError
from worker.fronts.responses.request import ResponsesRequest, parse_responses
from worker.routing.lease import AllEnginesFull
from worker.state import STATE, WorkerState

__all__ = ["backlog_frames", "handlers"]

log = logging.getLogger(__name__)

_POLL_MIN_S: Final = 0.02  # a backlog stream's wait between reads while frames come
_POLL_MAX_S: Final = 0.25  # ... and at most, while none does
_IDLE_S: Final = 120.0  # no frame of the turn for this long: the stream ends, failed
_PAGE: Final = 256
_CANCEL_WAIT_S: Final = 5.0


def _unknown(what: str) -> WireError:
    return WireError(404, f"no response with id {what[:80]!r}", param="response_id",
                     code="response_not_found")  # fmt: skip


def _unavailable(reason: str) -> WireError:
    return WireError(503, reason, kind="api_error", code="unavailable")


def _retry(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


async def _ours(st: WorkerState, sid: str, who: str) -> bool:
    """Whether ``sid`` is a live session this API created for the caller ``who`` (one
    round trip)."""
    tag, gone = await st.store.session_owner(sid)
    return not gone and owns(tag, OWNER, who, sid)


async def backlog_frames(
    st: WorkerState, sid: str, after: int, idle_s: float = _IDLE_S
) -> AsyncIterator[Frame]:
    """The session's frames after offset ``after``: the backlog, then its new frames as
    they come, until the caller stops, or ``idle_s`` without a frame. It polls (every
    :data:`_POLL_MIN_S` while frames come, backing off to :data:`_POLL_MAX_S`) rather
    than holding a blocking read: each read holds one of the worker's Redis permits,
    which its turns need; many resumed screens belong on the relays."""
    idle_since = time.monotonic()
    delay = _POLL_MIN_S
    while True:
        try:
            frames = await st.store.frames_after(sid, after, _PAGE)
        except RelayError:
            frames = []  # a failover: read again from the same offset
        n = len(frames)
        for data in frames:
            try:
                frame = decode(data)
            except FrameError:
                continue
            after = max(after, frame.offset)
            yield frame
        if n >= _PAGE:
            continue  # more is there: no wait
        if n:
            idle_since, delay = time.monotonic(), _POLL_MIN_S
        elif time.monotonic() - idle_since > idle_s:
            return
        await asyncio.sleep(delay)
        if not n:
            delay = min(delay * 2, _POLL_MAX_S)


async def _stored(st: WorkerState, rid: ResponseId) -> ResponseTurn | None:
    """The response as the backlog holds it now (None: its first frame is not there)."""
    rt = ResponseTurn(rid)
    top = rid.first + 100_000  # a reply longer than this is read no further for the object
    after = rid.first - 1
    while not rt.finished:
        frames = await st.store.frames_after(rid.session, after, _PAGE)
        for data in frames:
            try:
                frame = decode(data)
            except FrameError:
                continue
            if frame.offset > top:
                return rt if rt.started else None
            if not rt.started and (frame.offset != rid.first or frame.kind != "meta"
                                   or frame.turn != rid.turn):  # fmt: skip
                return None
            rt.feed(frame)
            after = frame.offset
        if len(frames) < _PAGE:
            break
    return rt if rt.started else None


async def _from_history(st: WorkerState, rid: ResponseId) -> dict[str, Any] | None:
    """The object of a finished response whose frames left the backlog: its history."""
    hist = await st.turns.store.load(rid.session)
    reply = next((e for e in hist.entries if e.get("turn") == rid.turn and e.get("from")
                  == rid.first and e.get("role") == "assistant"), None)  # fmt: skip
    if reply is None:
        return None
    finish = reply.get("finish")
    status = {"length": "incomplete", "cancelled": "cancelled"}.get(str(finish), "completed")
    return response_object(
        rid, status=status, text=str(reply.get("content", "")),
        params={"model": st.cfg.model}, created_at=0,
        incomplete="max_output_tokens" if finish == "length" else None,
    )  # fmt: skip


async def _lookup(request: web.Request) -> tuple[WorkerState, ResponseId] | web.Response:
    """The checked request for an existing response's route, or the error answer."""
    gw = request.app[GATEWAY]
    header = request.headers.get("Authorization")
    refused = gw.authorized(header)
    if refused is not None:
        return _error(refused)
    raw = request.match_info["rid"]
    try:
        rid = parse_response_id(raw)
    except InvalidResponseId:
        return _error(_unknown(raw))
    st = request.app[STATE]
    try:
        if not await _ours(st, rid.session, gw.caller(header)):
            return _error(_unknown(raw))
    except RelayError:
        return _error(_unavailable("redis did not answer; retry"), _retry(1))
    return st, rid


async def _write_events(
    request: web.Request, rt: ResponseTurn, frames: AsyncIterator[Frame]
) -> web.StreamResponse:
    resp = web.StreamResponse(headers=SSE_HEADERS)
    try:
        await resp.prepare(request)
        async for frame in frames:
            out = b"".join([encode_event(e) for e in rt.feed(frame)])
            if out:
                await resp.write(out)
            if rt.finished:
                break
        if not rt.finished:  # the backlog went quiet: nothing more will come
            failed = rt.fail(f"no event of the response for {_IDLE_S:.0f} s")
            await resp.write(b"".join(encode_event(e) for e in failed))
        await resp.write_eof()
    except (ConnectionResetError, ClientConnectionResetError):
        pass  # the client left; the turn goes on (any worker or relay resumes it)
    return resp


async def _closed_loop(
    st: WorkerState, viewer: DirectViewer, rid: ResponseId
) -> AsyncIterator[Frame]:
    """The turn's frames as its generation writes them, then (a viewer that fell
    behind) the backlog from the last one."""
    last = rid.first - 1
    async for offset, _kind, data in viewer.frames():
        try:
            frame = decode(data)
        except FrameError:
            continue
        last = offset
        yield frame
    async for frame in backlog_frames(st, rid.session, last):
        yield frame


async def _session_for(
    st: WorkerState, request: web.Request, req: ResponsesRequest, who: str
) -> str:
    """The session the response is a turn of: the previous response's or the
    conversation's (WireError 404 unless this API created it for ``who``), else a new
    one, owned by ``who``."""
    named = req.previous_response_id or req.conversation
    if named is not None:
        try:
            if req.previous_response_id is not None:
                sid = parse_response_id(req.previous_response_id).session
                param = "previous_response_id"
            else:
                sid, param = parse_conversation_id(named), "conversation"
        except InvalidResponseId as exc:
            raise WireError(404, str(exc), param="previous_response_id"
                            if req.previous_response_id else "conversation",
                            code="not_found") from None  # fmt: skip
        if not await _ours(st, sid, who):
            raise WireError(404, f"no such {param.replace('_', ' ')}: {named[:80]!r}",
                            param=param, code="not_found")  # fmt: skip
        return sid
    sid = new_session_id()
    await st.access.take_session(st.store, request, sid)
    await st.store.set_state(sid, OWNER_FIELD, owner_tag(OWNER, who, sid), st.turns.store.ttl_s)
    if req.earlier:  # the earlier items become the stored conversation
        await st.turns.store.append_exchange(sid, [as_entry(m) for m in req.earlier], None)
    return sid


async def create(request: web.Request) -> web.StreamResponse:
    gw, st = request.app[GATEWAY], request.app[STATE]
    header = request.headers.get("Authorization")
    refused = gw.authorized(header)
    if refused is not None:
        return _error(refused)
    body = await gw.create_body(request)
    if isinstance(body, web.Response):
        return body
    try:
        req = parse_responses(
            body, model=gw.cfg.model, default_max_tokens=gw.cfg.default_max_tokens,
            max_tokens_limit=gw.cfg.max_tokens_limit, max_chars=st.cfg.max_message_chars,
        )  # fmt: skip
        sid = await _session_for(st, request, req, gw.caller(header))
        await st.access.check_turn_rate(st.store, sid)
        viewer = DirectViewer()
        continued = req.previous_response_id or req.conversation
        convo = None
        if continued and req.earlier:  # with earlier items: history + items are the prompt
            hist = await st.turns.store.load(sid)
            convo = [*hist.messages, *req.messages]
        params = req.params()
        started = await st.turns.start_turn(
            sid, req.message, system=req.instructions, max_tokens=req.max_tokens,
            viewer=viewer, conversation=convo, response=params, background=req.background,
            options=req.options, tool_results=req.tool_results,
        )  # fmt: skip
    except WireError as exc:
        return _error(exc)
    except RateLimited as exc:
        wire = WireError(429, exc.reason, kind="rate_limit_error", code=str(exc.error))
        return _error(wire, dict(exc.headers))
    except TurnBusy:
        return _error(WireError(409, "a response of this conversation is still generating",
                                code="conversation_busy"))  # fmt: skip
    except AllEnginesFull as exc:
        return _error(WireError(429, f"every engine is busy ({exc.reason}); retry",
                                kind="rate_limit_error", code="engines_full"),
                      _retry(exc.retry_after_s))  # fmt: skip
    except Draining:
        return _error(WireError(503, "the worker is shutting down; retry", kind="api_error",
                                code="draining"), _retry(1))  # fmt: skip
    except Reject as exc:
        return _error(WireError(exc.status, exc.reason, code=str(exc.error)), dict(exc.headers))
    except RelayError as exc:
        log.warning("response refused, redis: %r", exc)
        return _error(_unavailable("redis did not answer; retry"), _retry(1))
    rid = ResponseId(sid, started.turn, started.offset)
    rt = ResponseTurn(rid)
    frames = _closed_loop(st, viewer, rid)
    try:
        if req.stream:
            return await _write_events(request, rt, frames)
        async for frame in frames:
            rt.feed(frame)
            if rt.finished or (req.background and rt.started):
                break
    finally:
        viewer.detach()  # the turn goes on for its other screens (and a background one alone)
    if rt.status == "failed" and not req.background:
        return _error(_failed(rt))
    return _json(rt.response())


def _failed(rt: ResponseTurn) -> WireError:
    """The answer to a whole (not background) response whose turn failed: 503 when no
    engine could serve it (the client may retry), 504 on the engine's timeout, 400 when
    the engine refused the request itself (its reason in the message), else 500."""
    status, code = {"engine_error": (503, "engine_unavailable"),
                    "engine_down": (503, "engine_unavailable"),
                    "timeout": (504, "engine_timeout"),
                    **{c: (400, o) for c, o in REFUSED_BY_ENGINE.items()},
                    }.get(rt.error_code or "", (500, "server_error"))  # fmt: skip
    return WireError(status, f"the response failed: {rt.error}"[:300], kind="api_error", code=code)


def _json(obj: dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


def _starting_after(request: web.Request) -> int:
    raw = request.query.get("starting_after")
    if raw is None or raw == "":
        return -1
    if not raw.isdigit() or int(raw) > 2**53:
        raise WireError(400, "'starting_after' must be a non-negative integer",
                        param="starting_after")  # fmt: skip
    return int(raw)


async def retrieve(request: web.Request) -> web.StreamResponse:
    found = await _lookup(request)
    if isinstance(found, web.Response):
        return found
    st, rid = found
    stream = request.query.get("stream", "false").lower()
    if stream not in ("true", "false", "1", "0"):
        return _error(WireError(400, "'stream' must be true or false", param="stream"))
    try:
        after = _starting_after(request)
        if stream in ("true", "1"):
            rt = ResponseTurn(rid, starting_after=after)
            head = await _stored(st, rid)  # its first frame must still be in the backlog
            if head is None:
                raise WireError(400, "this response's events are no longer stored; GET it "
                                "without stream", code="response_not_streamable")  # fmt: skip
            return await _write_events(request, rt, backlog_frames(st, rid.session, rid.first - 1))
        stored = await _stored(st, rid)
        obj = stored.response() if stored is not None else await _from_history(st, rid)
    except WireError as exc:
        return _error(exc)
    except RelayError:
        return _error(_unavailable("redis did not answer; retry"), _retry(1))
    if obj is None:
        return _error(_unknown(str(rid)))
    return _json(obj)


async def cancel(request: web.Request) -> web.StreamResponse:
    found = await _lookup(request)
    if isinstance(found, web.Response):
        return found
    st, rid = found
    try:
        v = await st.turns.stop(rid.session, rid.turn)
        if v.status is StopStatus.UNKNOWN:
            return _error(_unknown(str(rid)))
        end = time.monotonic() + _CANCEL_WAIT_S
        while True:  # the object once the turn has ended (its worker writes the end)
            stored = await _stored(st, rid)
            if stored is None or stored.finished or time.monotonic() > end:
                break
            await asyncio.sleep(0.05)
        obj = stored.response() if stored is not None else await _from_history(st, rid)
    except RelayError:
        return _error(_unavailable("redis did not answer; retry"), _retry(1))
    return _error(_unknown(str(rid))) if obj is None else _json(obj)


async def delete(request: web.Request) -> web.StreamResponse:
    found = await _lookup(request)
    if isinstance(found, web.Response):
        return found
    st, rid = found
    try:
        await delete_session(st, rid.session)
    except Reject as exc:
        return _error(_unavailable(exc.reason), dict(exc.headers))
    except RelayError:
        return _error(_unavailable("redis did not answer; retry"), _retry(1))
    return _json({"id": str(rid), "object": "response", "deleted": True})


async def input_items(request: web.Request) -> web.StreamResponse:
    found = await _lookup(request)
    if isinstance(found, web.Response):
        return found
    st, rid = found
    try:
        hist = await st.turns.store.load(rid.session)
        entries = [e for e in hist.entries if e.get("turn") == rid.turn
                   and e.get("role") in ("user", "tool")]  # fmt: skip
        if not entries:
            stored = await _stored(st, rid)  # a running turn: its meta frame holds it
            if stored is not None:
                entries = [{"role": "user", "content": stored.message}]
    except RelayError:
        return _error(_unavailable("redis did not answer; retry"), _retry(1))
    if not entries:
        return _error(_unknown(str(rid)))
    items = [_input_item(rid, i, e) for i, e in enumerate(entries)]
    return _json({"object": "list", "data": items, "first_id": items[0]["id"],
                  "last_id": items[-1]["id"], "has_more": False})  # fmt: skip


def _input_item(rid: ResponseId, i: int, entry: dict[str, Any]) -> dict[str, Any]:
    """A turn's stored input as the Responses API's input item: the user's message, or a
    tool's result (``function_call_output``)."""
    base = f"{rid.session}_{rid.turn}"
    if entry.get("role") == "tool":
        return {"id": f"fco_{base}_{i}", "type": "function_call_output", "status": "completed",
                "call_id": str(entry.get("tool_call_id", "")),
                "output": str(entry.get("content", ""))}  # fmt: skip
    return {
        "id": f"msg_{base}_input",
        "type": "message",
        "role": "user",
        "status": "completed",
        "content": [{"type": "input_text", "text": str(entry.get("content", ""))}],
    }


def handlers(cors_origin: str) -> dict[str, Handler | dict[str, Handler]]:
    """The Responses handlers, by their names in relay/service/routes.py; a response's
    ``OPTIONS``: the relays' preflight of its stream, allowing ``cors_origin``."""
    return {
        "responses.create": create,
        "responses.get": {"GET": retrieve, "OPTIONS": cors.preflight(cors_origin)},
        "responses.cancel": cancel,
        "responses.delete": delete,
        "responses.input_items": input_items,
    }
