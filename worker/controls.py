"""The chat controls of the worker's API: stop, load, delete (regenerate and edit are
turns: ``POST /v1/sessions/{sid}/turns`` with ``regenerate`` or ``replaces``).

Routes (the contract: docs/openapi.yaml; refusals ``{"error", "reason"}``):

* ``POST /v1/sessions/{sid}/turns/{turn}/cancel`` (write token) stops ``turn``,
  whichever worker runs it (:mod:`worker.chat.cancel`): ``202 {"session", "turn",
  "status": "stopping"}`` while it runs (it ends with a ``done`` frame whose
  ``finish_reason`` is ``cancelled``), the same with ``"stopped"`` and ``offset`` (its
  terminal frame) once it ended stopped; 409 ``turn_finished`` with ``offset`` when it
  ended otherwise (its engine finished first), 404 ``unknown_turn``;
* ``POST /v1/sessions/{sid}/cancel`` stops whichever turn runs or waits for an engine
  slot (what a Stop button sends): 202 as above (``turn`` 0 and ``"status":
  "stopping"`` for a turn still waiting: its POST answers 409 ``turn_cancelled``), 409
  ``no_turn_running``;
* ``GET /v1/sessions/{sid}/messages?limit=&before=&format=`` (watch token): the stored
  conversation, newest turns first by page, each page in order: ``{"session",
  "messages": [{"id", "turn", "role", "text", "finish_reason", "from", "to"}],
  and ``parts`` for a reply with parts (reasoning, tool calls and results, sources,
  data: text and parts in order, docs/PROTOCOL.md "Parts"),
  "resume_from", "gen", "running", "next_before"}``. ``resume_from`` (with ``gen``) is the
  offset to watch from (``Last-Event-ID`` / ``?from=``): the messages and the watch meet
  with no gap and no duplicate, even while a turn runs (``running`` names it; its
  messages are not in the page but in the watch). ``format=ui``: the messages as the
  AI SDK's UI messages (``useChat({messages})``);
* ``DELETE /v1/sessions/{sid}`` (write token): stops the running turn and waits for its
  end, removes every key of the session, leaves a tombstone (``gone_key``) for the
  longest token lifetime and tells the relays (``deleted_frame``), which close the
  session's streams; ``204``; the session's tokens are refused from then on (410
  ``session_deleted``; a second DELETE: 404 ``unknown_session``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Final

import orjson
from aiohttp import web

from relay.broker.errors import RelayError
from relay.protocol.auth import AuthError
from relay.protocol.codes import Refusal
from relay.protocol.frame import FrameError, decode
from relay.protocol.keys import (
    InvalidSessionId,
    parse_session,
)
from relay.protocol.parts import ui_parts
from relay.service.errors import RETRY_AFTER, Reject, refusal
from relay.service.register import Handler
from worker.chat.cancel import StopStatus, StopVerdict
from worker.chat.store import ConversationView, SessionStore
from worker.state import STATE, WorkerState

__all__ = ["check_gone", "conversation_page", "delete_session", "handlers", "session_of"]

log = logging.getLogger(__name__)

_JSON: Final = "application/json"
PAGE_DEFAULT: Final = 50  # turns per page of GET .../messages
PAGE_MAX: Final = 200
_DELETE_WAIT_S: Final = 5.0  # how long DELETE waits for a stopped turn to end
_SCAN: Final = 64  # backlog entries per read when finding a running turn's first frame


def _json(status: int, body: dict[str, Any]) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(body), content_type=_JSON)


def session_of(request: web.Request, need: str) -> str:
    """The path's session, which the request's token may ``need`` (watch / write); else
    Reject (400 for a malformed id, 401 / 403 for the token)."""
    try:
        sid = parse_session(request.match_info["sid"])
    except InvalidSessionId as exc:
        raise Reject(400, Refusal.INVALID_SESSION, str(exc)) from None
    try:
        request.app[STATE].access.authorize(request, sid, "write" if need == "write" else "watch")
    except AuthError as exc:
        raise Reject(exc.status, exc.error, exc.reason) from None
    return sid


async def check_gone(store: SessionStore, sid: str) -> None:
    """Reject (410 ``session_deleted``) a request for a deleted session."""
    if await store.gone(sid):
        raise Reject(410, Refusal.SESSION_DELETED, "the session was deleted")


def _redis_down(exc: RelayError) -> web.Response:
    log.warning("chat control refused, redis: %r", exc)
    return refusal(503, Refusal.REDIS_UNAVAILABLE, "redis did not answer", RETRY_AFTER)


# ---- stop ----------------------------------------------------------------------------------


def _stop_answer(sid: str, v: StopVerdict) -> web.Response:
    if v.status is StopStatus.STOPPING:
        return _json(202, {"session": sid, "turn": v.turn, "status": "stopping"})
    if v.status is StopStatus.ADMITTING:
        return _json(202, {"session": sid, "turn": 0, "status": "stopping"})
    if v.status is StopStatus.STOPPED:
        body = {"session": sid, "turn": v.turn, "status": "stopped", "offset": v.offset}
        return _json(202, body)
    if v.status is StopStatus.UNKNOWN:
        return refusal(404, Refusal.UNKNOWN_TURN, f"the session has no turn {v.turn}")
    if v.status is StopStatus.IDLE:
        reason = "no turn of this session is running"
        return refusal(409, Refusal.NO_TURN_RUNNING, reason, turn=v.turn)
    raise AssertionError(f"unhandled stop verdict {v.status}")  # FINISHED: the caller's


async def _cancel(request: web.Request, turn: int) -> web.Response:
    st = request.app[STATE]
    try:
        sid = session_of(request, "write")
        await check_gone(st.turns.store, sid)
        v = await st.turns.stop(sid, turn)
        if v.status is StopStatus.FINISHED:
            offset = await _terminal_offset(st, sid, v.turn)
            reason = f"turn {v.turn} has already ended"
            return refusal(409, Refusal.TURN_FINISHED, reason, turn=v.turn, offset=offset)
    except Reject as r:
        return r.response()
    except RelayError as exc:
        return _redis_down(exc)
    return _stop_answer(sid, v)


async def _cancel_turn(request: web.Request) -> web.Response:
    raw = request.match_info["turn"]
    if not raw.isdigit() or not 1 <= int(raw) <= 2**53 - 1:
        return refusal(400, Refusal.INVALID_TURN, "the turn must be a positive integer")
    return await _cancel(request, int(raw))


async def _cancel_running(request: web.Request) -> web.Response:
    return await _cancel(request, 0)


async def _terminal_offset(st: WorkerState, sid: str, turn: int) -> int | None:
    """Where ``turn`` ended: its history entry's ``to``, else its terminal frame in the
    backlog (a turn that ended with an error is not in the history); None if neither
    holds it any more."""
    hist = await st.turns.store.load(sid)
    for e in hist.entries:
        if e.get("turn") == turn and isinstance(e.get("to"), int):
            return int(e["to"])
    store = st.turns.store.store
    before: int | None = None
    for _ in range(16):  # bounded: a turn far back in a long backlog is not worth more
        frames = await store.frames_before(sid, before, _SCAN)
        for data in frames:
            try:
                f = decode(data)
            except (FrameError, TypeError):
                continue
            if f.turn == turn and f.kind in ("done", "error"):
                return f.offset
            if 0 < f.turn < turn:
                return None
            before = f.offset
        if len(frames) < _SCAN:
            break
    return None


# ---- load ----------------------------------------------------------------------------------


def _page_args(request: web.Request) -> tuple[int, int | None, bool]:
    q = request.query
    try:
        limit = int(q.get("limit", PAGE_DEFAULT))
        before = int(q["before"]) if "before" in q else None
    except ValueError:
        raise Reject(400, Refusal.INVALID_PAGE, "'limit' and 'before' must be integers") from None
    if not 1 <= limit <= PAGE_MAX:
        raise Reject(400, Refusal.INVALID_PAGE, f"'limit' must be between 1 and {PAGE_MAX}")
    if before is not None and before < 1:
        raise Reject(400, Refusal.INVALID_PAGE, "'before' must be a positive turn")
    fmt = q.get("format", "turns")
    if fmt not in ("turns", "ui"):
        raise Reject(400, Refusal.INVALID_PAGE, "'format' must be 'turns' or 'ui'")
    return limit, before, fmt == "ui"


async def _running_from(st: WorkerState, sid: str, view: ConversationView) -> int:
    """The first offset of the open turn: the lock names it once admitted; before that
    (its meta frame may be out already) the backlog's end is walked back to it."""
    turn = view.open_turn
    assert turn is not None
    if view.holder is not None and view.holder.turn == turn and view.holder.offset > 0:
        return view.holder.offset
    first = view.last_offset + 1
    for data in await st.turns.store.store.frames_before(sid, None, _SCAN):
        try:
            f = decode(data)
        except (FrameError, TypeError):
            continue
        if f.turn != turn:
            break
        first = f.offset
    return first


def conversation_page(
    sid: str,
    view: ConversationView,
    running_from: int | None,
    limit: int,
    before: int | None,
) -> dict[str, Any]:
    """The body of GET .../messages from one view (pure): the turns before ``before``
    (and before the running turn), the newest ``limit`` of them, in order."""
    upto = view.open_turn if view.open_turn is not None else None
    msgs = []
    for e in view.entries:
        turn = e.get("turn")
        if upto is not None and isinstance(turn, int) and turn >= upto:
            continue  # the running turn (its history entries may be written already)
        m = {
            "id": e.get("id"),
            "turn": turn,
            "role": e.get("role"),
            "text": e.get("content", ""),
            "finish_reason": e.get("finish"),
            "from": e.get("from"),
            "to": e.get("to"),
        }
        if isinstance(e.get("parts"), list):
            m["parts"] = e["parts"]
        if e.get("role") == "tool":  # a tool's result a client sent back: its call's id
            m["tool_call_id"] = e.get("tool_call_id")
        msgs.append(m)
    if before is not None:
        msgs = [m for m in msgs if isinstance(m["turn"], int) and m["turn"] < before]
    turns = sorted({m["turn"] for m in msgs if isinstance(m["turn"], int)})
    keep = set(turns[-limit:])
    older = [t for t in turns if t not in keep]
    page = [m for m in msgs if m["turn"] in keep or (not isinstance(m["turn"], int) and not older)]
    if running_from is not None:
        resume = running_from - 1
        running: dict[str, int] | None = {"turn": view.open_turn or 0, "offset": running_from}
    else:
        resume, running = view.last_offset, None
    return {
        "session": sid,
        "messages": page,
        "resume_from": resume,
        "gen": view.gen or None,
        "running": running,
        "next_before": min(keep) if older else None,
    }


def ui_messages(page: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The AI SDK's UI messages of a page (``useChat({messages})``): a reply with parts
    gets each in order (:func:`relay.protocol.parts.ui_parts`); a tool's result a client
    sent back is folded into its call's part (``output-available``), as the SDK holds it."""
    out: list[dict[str, Any]] = []
    calls: dict[Any, dict[str, Any]] = {}
    for m in page:
        if m["role"] == "tool":
            call = calls.get(m.get("tool_call_id"))
            if call is not None:
                call["state"], call["output"] = "output-available", _json_or_text(m["text"])
            continue
        if m["role"] not in ("user", "assistant"):
            continue
        parts = ui_parts(m["parts"]) if m.get("parts") else [{"type": "text", "text": m["text"]}]
        calls.update((p["toolCallId"], p) for p in parts if "toolCallId" in p)
        out.append({
            "id": m["id"], "role": m["role"], "parts": parts,
            "metadata": {"turn": m["turn"], "finish_reason": m["finish_reason"]},
        })  # fmt: skip
    return out


def _json_or_text(text: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return text


async def _messages(request: web.Request) -> web.Response:
    st = request.app[STATE]
    try:
        sid = session_of(request, "watch")
        limit, before, ui = _page_args(request)
        await check_gone(st.turns.store, sid)
        view = await st.turns.store.view(sid)
        running = await _running_from(st, sid, view) if view.open_turn is not None else None
    except Reject as r:
        return r.response()
    except RelayError as exc:
        return _redis_down(exc)
    body = conversation_page(sid, view, running, limit, before)
    if ui:
        body["messages"] = ui_messages(body["messages"])
    return _json(200, body)


# ---- delete --------------------------------------------------------------------------------


async def delete_session(st: WorkerState, sid: str) -> int:
    """Stop the running turn, then remove every key of ``sid`` and leave its tombstone
    (its tokens are refused, its screens told); how many keys went. :class:`Reject` 503
    when the running turn did not stop in time (nothing was deleted); RelayError."""
    v = await st.turns.stop(sid, 0)
    stopping = v.status in (StopStatus.STOPPING, StopStatus.ADMITTING)
    if stopping and not await _wait_idle(st, sid):
        reason = "the running turn did not stop in time; nothing was deleted, retry"
        raise Reject(503, Refusal.REDIS_UNAVAILABLE, reason, RETRY_AFTER)
    removed = await st.turns.store.store.delete_session(sid, st.access.max_ttl_s)
    log.info("session %s deleted (%d keys)", sid, removed)
    return removed


async def _delete(request: web.Request) -> web.Response:
    st = request.app[STATE]
    try:
        sid = session_of(request, "write")
        if await st.turns.store.gone(sid):
            return refusal(404, Refusal.UNKNOWN_SESSION, "the session was already deleted")
        await delete_session(st, sid)
    except Reject as r:
        return r.response()
    except RelayError as exc:
        return _redis_down(exc)
    return web.Response(status=204)


async def _wait_idle(st: WorkerState, sid: str) -> bool:
    """Wait until no turn of ``sid`` holds its lock (the stopped turn ended)."""
    end = time.monotonic() + _DELETE_WAIT_S
    store = st.turns.store.store
    while time.monotonic() < end:
        if await store.lock_holder(sid) is None:
            return True
        await asyncio.sleep(0.02)
    return False


def handlers() -> dict[str, Handler]:
    """The chat controls' handlers, by their names in relay/service/routes.py."""
    return {
        "sessions.cancel_turn": _cancel_turn,
        "sessions.cancel": _cancel_running,
        "sessions.messages": _messages,
        "sessions.delete": _delete,
    }
