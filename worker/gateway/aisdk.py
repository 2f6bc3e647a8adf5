"""The Vercel AI SDK's chat POST on the worker: ``POST /v1/chat``.

``useChat`` with ``DefaultChatTransport({api: "/v1/chat", headers: {Authorization:
"Bearer <token>"}})`` and the chat's ``id`` = a tokenrelay session id works as is:

- the body is the SDK's ``{id, messages: [UI messages with parts], trigger, messageId}``;
  the last message must be the user's (its ``text`` parts joined) and starts a turn of
  session ``id`` exactly like ``POST /v1/sessions/{id}/turns`` (the session's history
  in Redis is the conversation: earlier messages of the body are not re-sent to the
  engine); a ``system`` message's text is the turn's ``system`` prompt;
- the answer is the turn in the AI SDK's UI message stream protocol
  (:mod:`relay.edge.conn.ui`, the same parts a relay's ``/v1/sessions/{id}/ui-stream``
  serves), read from the session's backlog with ``XREAD BLOCK`` from the turn's first
  offset;
- the SDK reconnects to ``GET /v1/chat/{id}/stream``, which a relay serves (any relay,
  any number of screens), so a page reloaded mid-reply resumes with ``resume: true``.

Refusals are JSON ``{"error", "reason"}`` with the turns POST's codes (400, 401/403, 409,
413, 415, 429, 503); ``trigger: "regenerate-message"`` is a 400 (a session's history
only grows).

Order of use: ``register(app)`` in :func:`worker.api.make_app`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Final

import orjson
from aiohttp import web

from relay.broker.errors import RelayError
from relay.broker.rediscluster.errors import map_redis_errors
from relay.protocol.auth import AuthError
from relay.protocol.codes import Refusal
from relay.protocol.frame import FrameError, decode
from relay.protocol.keys import InvalidSessionId, log_key, parse_session
from relay.protocol.uistream import DONE, UI_HEADERS, UiTurn, encode_chunk
from relay.service.errors import RETRY_AFTER, Reject, refusal, retry_after
from relay.service.httpguard import client_gone
from worker.access import RateLimited
from worker.chat.turnstate import Draining, IdempotencyPending, TurnBusy
from worker.routing.lease import AllEnginesFull
from worker.state import STATE

__all__ = ["ChatRequest", "parse_chat", "register"]

log = logging.getLogger(__name__)

_BLOCK_MS: Final = 1000  # below the worker's Redis socket timeout
_IDLE_S: Final = 120.0  # no frame of the turn for this long: end the stream with an error


class ChatError(Reject):
    """A chat body :func:`parse_chat` refuses: a :class:`Reject` whose ``code`` is its
    :class:`~relay.protocol.codes.Refusal`."""

    def __init__(self, status: int, code: Refusal, reason: str) -> None:
        super().__init__(status, code, reason)
        self.code = code


class ChatRequest:
    """What a chat POST asks for: a turn of ``session`` with ``message``."""

    __slots__ = ("message", "session", "system")

    def __init__(self, session: str, message: str, system: str | None) -> None:
        self.session, self.message, self.system = session, message, system


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


def parse_chat(raw: bytes, max_chars: int) -> ChatRequest:
    """The AI SDK's chat body -> :class:`ChatRequest`, or :class:`ChatError`."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ChatError(400, Refusal.MALFORMED_JSON, f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ChatError(400, Refusal.INVALID_BODY, "body must be a JSON object")
    try:
        sid = parse_session(body.get("id"))
    except InvalidSessionId as exc:
        reason = f"'id' must be a session id: {exc}"
        raise ChatError(400, Refusal.INVALID_SESSION, reason) from None
    if body.get("trigger", "submit-message") != "submit-message":
        reason = "only 'submit-message' is supported: a session's history only grows"
        raise ChatError(400, Refusal.UNSUPPORTED_TRIGGER, reason)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ChatError(400, Refusal.INVALID_MESSAGES, "'messages' must be a non-empty list")
    # The SDK sends the whole history, its last entry the new user message: the turn's
    # message is the last user message with text (the session keeps the history itself).
    message = next(
        (
            t
            for m in reversed(messages)
            if isinstance(m, dict) and m.get("role") == "user" and (t := _text(m)).strip()
        ),
        "",
    )
    if not message:
        raise ChatError(400, Refusal.INVALID_MESSAGE, "no user message with a text part")
    system = next(
        (_text(m) for m in messages if isinstance(m, dict) and m.get("role") == "system"), None
    )
    for name, value, code in (
        ("message", message, Refusal.MESSAGE_TOO_LARGE),
        ("system", system or "", Refusal.SYSTEM_TOO_LARGE),
    ):
        if len(value) > max_chars:
            raise ChatError(413, code, f"{name} longer than {max_chars} characters")
    return ChatRequest(sid, message, system or None)


def register(app: web.Application) -> None:
    """Add ``POST /v1/chat`` (the worker's state under :data:`worker.state.STATE`)."""

    async def chat(request: web.Request) -> web.StreamResponse:
        st = request.app[STATE]
        cfg = st.cfg
        if request.content_type != "application/json":
            return refusal(415, Refusal.UNSUPPORTED_MEDIA_TYPE, "send the body as application/json")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            reason = f"body larger than {cfg.max_body_bytes} bytes"
            return refusal(413, Refusal.BODY_TOO_LARGE, reason)
        except ConnectionResetError:  # the client left mid-body: counted by the HTTP guard
            return client_gone()
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
            await st.access.check_turn_rate(st.redis, req.session)
        except RateLimited as exc:
            return exc.response()
        except RelayError:
            return refusal(503, Refusal.REDIS_UNAVAILABLE, "redis did not answer", RETRY_AFTER)
        try:
            started = await st.turns.start_turn(
                req.session, req.message, system=req.system, max_tokens=cfg.default_max_tokens
            )
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
        await resp.prepare(request)
        ui = UiTurn(req.session, started.turn)
        last = started.offset - 1
        idle_since = time.monotonic()
        try:
            while not ui.finished:
                try:
                    with map_redis_errors():
                        reply: Any = await st.redis.xread(
                            {log_key(req.session): f"{last}-1"}, count=256, block=_BLOCK_MS
                        )
                except RelayError:
                    reply = None  # a failover: read again from the same offset
                out = bytearray()
                for _stream, entries in reply or []:
                    for _id, fields in entries:
                        try:
                            frame = decode(fields[b"f"])
                        except (FrameError, KeyError):
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
            await resp.write(DONE)
            await resp.write_eof()
        except (ConnectionError, RuntimeError):
            pass  # the page left; the turn goes on, and any relay resumes it
        return resp

    app.router.add_post("/v1/chat", chat)
