"""The Vercel AI SDK's chat POST on the worker: ``POST /v1/chat``.

``useChat`` with ``DefaultChatTransport({api: "/v1/chat", headers: {Authorization:
"Bearer <token>"}})`` and the chat's ``id`` = a tokenrelay session id works as is:

- the body is the SDK's ``{id, messages: [UI messages with parts], trigger, messageId}``
  and what the page adds with useChat's ``body`` (or ``sendMessage``'s): the engine's
  options (``tools``, ``tool_choice``, ``stop``, sampling, ...), checked by every front's
  one checker (:mod:`worker.fronts.options`), which refuses any other field by name
  (400 ``unsupported_parameter``; ``invalid_option`` for a wrong type);
  the last message must be the user's (its ``text`` parts joined) and starts a turn of
  session ``id`` exactly like ``POST /v1/sessions/{id}/turns`` (the session's history
  in Redis is the conversation: earlier messages of the body are not re-sent to the
  engine); a ``system`` message's text is the turn's ``system`` prompt;
- the answer is the turn in the AI SDK's UI message stream protocol
  (:mod:`relay.fronts.aisdk.conn`, the same parts a relay's ``/v1/sessions/{id}/ui-stream``
  serves), fed by the turn's generation as it writes (the closed loop,
  :mod:`worker.chat.direct`: the response counts as a watcher of the session, so the
  "nobody watches" rule does not stop a turn its own page is reading), or, past the
  closed loop's bounded queue, read from the backlog with ``XREAD BLOCK``;
- the SDK reconnects to ``GET /v1/chat/{id}/stream``, which a relay serves (any relay,
  any number of screens), so a page reloaded mid-reply resumes with ``resume: true``.

``trigger: "regenerate-message"`` regenerates the reply ``messageId`` names (the newest
without one): the turn replaces that turn and every later one (:mod:`worker.chat.replace`);
a ``submit-message`` whose ``messageId`` is a stored message's id edits it (its turn and
every later one are replaced, the new text asked); the user message's own ``id`` is
kept in the history, so a page reloaded from ``GET /v1/sessions/{id}/messages?format=ui``
edits with the ids it was given.

When the page ran the tools itself (``addToolOutput``, then ``sendAutomaticallyWhen``),
the last message is the assistant's, its tool parts with their outputs: the turn goes on
after them (its input: the outputs the history does not hold yet, as ``role: tool``
messages, stored with the turn), whatever ``messageId`` says.

Refusals are JSON ``{"error", "reason"}`` with the turns POST's codes (400, 401/403, 404
``unknown_message``, 409 (``nothing_to_regenerate`` too), 413, 415, 429, 503).

Order of use: ``handlers()`` in :func:`worker.api.make_app`, which registers it on the
route table.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Final

from aiohttp import web

from relay.broker.errors import RelayError
from relay.fronts.aisdk.wire import DONE, UI_HEADERS, UiTurn, encode_chunk
from relay.protocol.auth import AuthError
from relay.protocol.codes import Refusal
from relay.protocol.frame import FrameError, decode
from relay.protocol.keys import InvalidSessionId, parse_session
from relay.service.errors import RETRY_AFTER, Reject, refusal, retry_after
from relay.service.httpbody import read_body, refused
from relay.service.jsonbody import BodyRefused, parse_json
from relay.service.register import Handler
from worker.access import RateLimited
from worker.chat.direct import DirectViewer
from worker.chat.prompt import tool_message
from worker.chat.replace import NothingToRegenerate, Replace, UnknownReplaced
from worker.chat.turnstate import Draining, IdempotencyPending, TurnBusy, TurnCancelled
from worker.controls import check_gone
from worker.fronts.errors import WireError
from worker.fronts.options import engine_options, refusal_code
from worker.routing.lease import AllEnginesFull
from worker.state import STATE, WorkerState

__all__ = ["ChatRequest", "handlers", "parse_chat"]

log = logging.getLogger(__name__)

_BLOCK_MS: Final = 1000  # below the worker's Redis socket timeout
_IDLE_S: Final = 120.0  # no frame of the turn for this long: end the stream with an error
_OWN: Final = frozenset(("id", "messages", "trigger", "messageId"))  # the SDK's own fields


class ChatError(Reject):
    """A chat body :func:`parse_chat` refuses: a :class:`Reject` whose ``code`` is its
    :class:`~relay.protocol.codes.Refusal`."""

    def __init__(self, status: int, code: Refusal, reason: str) -> None:
        super().__init__(status, code, reason)
        self.code = code


class ChatRequest:
    """What a chat POST asks for: a turn of ``session`` with ``message`` (None: a
    regenerate), replacing ``replaces`` (None: a new turn); ``message_id`` is the user
    message's id; ``options`` the engine's (tools, ``stop``, sampling)."""

    __slots__ = (
        "message", "message_id", "options", "replaces", "session", "system", "tool_results",
    )  # fmt: skip

    def __init__(
        self,
        session: str,
        message: str | None,
        system: str | None,
        replaces: Replace | None = None,
        message_id: str | None = None,
        options: dict[str, Any] | None = None,
        tool_results: list[dict[str, Any]] | None = None,
    ) -> None:
        self.session, self.message, self.system = session, message, system
        self.replaces, self.message_id = replaces, message_id
        self.options: dict[str, Any] = options or {}
        self.tool_results: list[dict[str, Any]] = tool_results or []


def _text(msg: dict[str, Any]) -> str:
    """A UI message's text: its ``text`` parts joined (``content`` for older clients)."""
    parts = msg.get("parts")
    if isinstance(parts, list):
        return "".join(
            p["text"]
            for p in parts
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        )
    content = msg.get("content")
    return content if isinstance(content, str) else ""


def _tool_outputs(msg: object) -> list[dict[str, Any]]:
    """The tools' results of an assistant UI message (its tool parts in state
    ``output-available`` or ``output-error``), as ``role: tool`` messages; none for any
    other message."""
    if not isinstance(msg, dict) or msg.get("role") != "assistant":
        return []
    out = []
    for p in msg.get("parts") or ():
        if not isinstance(p, dict) or not isinstance(p.get("toolCallId"), str):
            continue
        kind, state = str(p.get("type", "")), p.get("state")
        if not (kind.startswith("tool-") or kind == "dynamic-tool"):
            continue
        if state == "output-available":
            value = p.get("output")
            text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        elif state == "output-error":
            text = str(p.get("errorText", ""))
        else:
            continue
        out.append(tool_message(p["toolCallId"], text))
    return out


async def _new_results(st: WorkerState, req: ChatRequest) -> list[dict[str, Any]]:
    """The tools' results the session's history does not hold yet (the page sends its
    whole assistant message, whose earlier steps' results are stored already)."""
    hist = await st.turns.store.load(req.session)
    seen = {m.get("tool_call_id") for m in hist.messages if m.get("role") == "tool"}
    return [r for r in req.tool_results if r["tool_call_id"] not in seen]


def parse_chat(raw: bytes, max_chars: int) -> ChatRequest:
    """The AI SDK's chat body -> :class:`ChatRequest`, or :class:`ChatError`."""
    try:
        body = parse_json(raw)
    except BodyRefused as exc:
        raise ChatError(exc.status, exc.code, exc.reason) from None
    try:
        options = engine_options(body, _OWN)
    except WireError as exc:
        raise ChatError(400, refusal_code(exc), exc.message) from None
    try:
        sid = parse_session(body.get("id"))
    except InvalidSessionId as exc:
        reason = f"'id' must be a session id: {exc}"
        raise ChatError(400, Refusal.INVALID_SESSION, reason) from None
    trigger = body.get("trigger", "submit-message")
    if trigger not in ("submit-message", "regenerate-message"):
        reason = "'trigger' must be 'submit-message' or 'regenerate-message'"
        raise ChatError(400, Refusal.UNSUPPORTED_TRIGGER, reason)
    target = body.get("messageId")
    if target is not None and (not isinstance(target, str) or not 0 < len(target) <= 256):
        raise ChatError(400, Refusal.INVALID_MESSAGES, "'messageId' must be a message id")
    if trigger == "regenerate-message":
        return ChatRequest(sid, None, None, Replace(message_id=target), options=options)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ChatError(400, Refusal.INVALID_MESSAGES, "'messages' must be a non-empty list")
    results = _tool_outputs(messages[-1])
    if results:  # the page ran the tools (addToolOutput): the reply goes on after them
        if sum(len(r["content"]) for r in results) > max_chars:
            raise ChatError(413, Refusal.MESSAGE_TOO_LARGE,
                            f"tool outputs longer than {max_chars} characters")  # fmt: skip
        return ChatRequest(sid, "", None, options=options, tool_results=results)
    # The SDK sends the whole history, its last entry the new user message: the turn's
    # message is the last user message with text (the session keeps the history itself).
    last = next(
        (
            (t, m.get("id"))
            for m in reversed(messages)
            if isinstance(m, dict) and m.get("role") == "user" and (t := _text(m)).strip()
        ),
        None,
    )
    if last is None:
        raise ChatError(400, Refusal.INVALID_MESSAGE, "no user message with a text part")
    message, mid = last
    mid = mid if isinstance(mid, str) and 0 < len(mid) <= 256 else None
    system = next(
        (_text(m) for m in messages if isinstance(m, dict) and m.get("role") == "system"), None
    )
    for name, value, code in (
        ("message", message, Refusal.MESSAGE_TOO_LARGE),
        ("system", system or "", Refusal.SYSTEM_TOO_LARGE),
    ):
        if len(value) > max_chars:
            raise ChatError(413, code, f"{name} longer than {max_chars} characters")
    replaces = Replace(message_id=target) if target is not None else None
    return ChatRequest(sid, message, system or None, replaces, mid, options)


async def _tail(st: WorkerState, sid: str, ui: UiTurn, last: int, resp: web.StreamResponse) -> None:
    """The rest of the turn from the backlog (the frames after ``last``, waiting up to
    :data:`_BLOCK_MS` for each next one), for a response that fell behind the closed
    loop's bounded queue."""
    idle_since = time.monotonic()
    while not ui.finished:
        try:
            frames = await st.store.frames_after(sid, last, 256, block_ms=_BLOCK_MS)
        except RelayError:
            frames = []  # a failover: read again from the same offset
        out = bytearray()
        for data in frames:
            try:
                frame = decode(data)
            except FrameError:
                continue
            last = max(last, frame.offset)
            for chunk in ui.feed(frame):
                out += encode_chunk(chunk)
        if out:
            idle_since = time.monotonic()
            await resp.write(bytes(out))
        elif time.monotonic() - idle_since > _IDLE_S:
            for chunk in ui.fail(f"no frame of the turn for {_IDLE_S:.0f} s"):
                await resp.write(encode_chunk(chunk))


def handlers() -> dict[str, Handler]:
    """The handler of ``POST /v1/chat`` (the worker's state under
    :data:`worker.state.STATE`), by its name in relay/service/routes.py."""

    async def chat(request: web.Request) -> web.StreamResponse:
        st = request.app[STATE]
        cfg = st.cfg
        try:
            raw = await read_body(request, cfg.max_body_bytes)
        except BodyRefused as r:  # 415, 413, or the client gone (counted by the HTTP guard)
            return refused(r)
        try:
            req = parse_chat(raw, cfg.max_message_chars)
        except ChatError as exc:
            st.metrics.rejected.labels(status=str(exc.status)).inc()
            return exc.response()
        try:
            st.access.authorize(request, req.session, "write")
        except AuthError as exc:
            return refusal(exc.status, exc.error, exc.reason)
        try:
            await st.access.check_turn_rate(st.store, req.session)
        except RateLimited as exc:
            return exc.response()
        except RelayError:
            return refusal(503, Refusal.REDIS_UNAVAILABLE, "redis did not answer", RETRY_AFTER)
        try:
            await check_gone(st.turns.store, req.session)
            results = await _new_results(st, req) if req.tool_results else []
            if req.tool_results and not results:
                reason = "every tool output of the last message is in the history already"
                return refusal(400, Refusal.INVALID_MESSAGE, reason)
            viewer = DirectViewer()
            started = await st.turns.start_turn(
                req.session, req.message, system=req.system, max_tokens=cfg.default_max_tokens,
                replaces=req.replaces, message_id=req.message_id, viewer=viewer,
                options=req.options, tool_results=results,
            )  # fmt: skip
        except Reject as exc:
            return exc.response()
        except TurnCancelled as exc:
            return refusal(409, Refusal.TURN_CANCELLED, str(exc))
        except NothingToRegenerate as exc:
            return refusal(409, Refusal.NOTHING_TO_REGENERATE, str(exc))
        except UnknownReplaced as exc:
            code = Refusal.UNKNOWN_MESSAGE if exc.what == "message" else Refusal.UNKNOWN_TURN
            return refusal(404, code, str(exc))
        except Draining:
            return refusal(503, Refusal.DRAINING, "worker is shutting down", RETRY_AFTER)
        except TurnBusy:
            reason = "a turn of this session is generating; resume its stream"
            return refusal(409, Refusal.TURN_IN_PROGRESS, reason)
        except IdempotencyPending as exc:
            return refusal(409, Refusal.IDEMPOTENCY_PENDING, str(exc))
        except AllEnginesFull as exc:
            return refusal(429, Refusal.ENGINES_FULL, exc.reason, retry_after(exc.retry_after_s))
        except RelayError as exc:
            log.warning("chat of %s refused, redis: %r", req.session, exc)
            return refusal(503, Refusal.REDIS_UNAVAILABLE, "redis did not answer", RETRY_AFTER)
        resp = web.StreamResponse(headers=UI_HEADERS)
        ui = UiTurn(req.session, started.turn)
        last = started.offset - 1
        try:
            await resp.prepare(request)
            # the closed loop: the frames as the generation writes them (this response
            # counts as a watcher meanwhile); the backlog only if it fell behind
            async for offset, _kind, data in viewer.frames():
                last = offset
                try:
                    out = b"".join(encode_chunk(c) for c in ui.feed(decode(data)))
                except FrameError:
                    continue
                if out:
                    await resp.write(out)
            if not ui.finished:
                await _tail(st, req.session, ui, last, resp)
            await resp.write(DONE)
            await resp.write_eof()
        except (ConnectionError, RuntimeError):
            pass  # the page left; the turn goes on, and any relay resumes it
        finally:
            viewer.detach()
        return resp

    return {"aisdk.chat": chat}
