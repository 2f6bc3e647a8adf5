"""The worker's HTTP API (aiohttp): sessions, turns, health and metrics.

Routes (the contract: docs/openapi.yaml):

* ``POST /v1/sessions`` -> ``201 {"session": sid, "token": token, "expires_at"}`` (a
  ``write`` token: it lets the holder post turns, mint tokens and watch the session on
  any relay); 429 + Retry-After when this client address creates sessions too fast;
* ``POST /v1/sessions/{sid}/tokens`` with a write token and ``{"scope": "watch"|"write",
  "ttl_s"?: int}`` -> ``201 {"session", "token", "scope", "expires_at"}`` (the lifetime
  capped by ``max_token_ttl_s`` and the session's; see :mod:`worker.access`);
* ``POST /v1/sessions/{sid}/turns`` with ``{"message": str, "system"?: str,
  "max_tokens"?: int}`` and the engine's options (``tools``, ``tool_choice``, ``stop``,
  sampling, ...: :mod:`worker.fronts.options`, as the gateway takes them) and the token
  (``Authorization: Bearer`` or ``?token=``) -> ``202 {"session", "turn", "offset"}``;
  then frames flow on the session's channel. Errors, each with a JSON body ``{"error":
  code, "reason": sentence}``: 400 (malformed JSON, missing/empty ``message``, wrong
  types, a field neither read nor forwarded (``unsupported_parameter``, named), an option
  of the wrong type (``invalid_option``), ``max_tokens`` out of range, bad session id
  or Idempotency-Key), 401/403 (token), 409 (a turn is generating: the body names it,
  ``turn`` and ``offset``, so the client can watch it; we answer 409 rather than
  queueing because a queued turn would be generated against a history that does not yet
  hold the running turn's reply, and a queue hides load from the client), 413 (body or
  message too large), 415 (not ``application/json``), 429 + Retry-After (every engine
  full, or ``turns_per_minute`` of this session used), 503 (draining, or Redis
  unavailable). Without ``max_tokens`` the turn gets ``default_max_tokens``.
* ``/v1/responses`` (create, retrieve and resume, cancel, delete, input items): OpenAI's
  Responses API, each response a turn of a session (:mod:`worker.fronts.responses.http`);
* ``POST /v1/chat/completions`` and ``GET /v1/models``: the OpenAI-compatible gateway
  (:mod:`worker.fronts.openai.http`), routed by the same router, no session;
* ``POST /v1/jobs``, ``GET /v1/jobs/{id}``: offline jobs on RabbitMQ when ``--amqp`` is
  given (:mod:`worker.jobs.api`; ``tokenrelay jobworker`` runs them);
* ``GET /healthz`` (the process lives), ``GET /readyz`` (Redis answers, some engine is
  routable, no critical background loop failing, not draining), ``GET /metrics``
  (Prometheus text) and ``GET /v1/router`` (engines and recent placements), both for the
  operator: the admin key, or a local request without one (:mod:`relay.service.admin`);
  ``GET /openapi.json`` (docs/openapi.yaml, the worker's part).

Order of use: ``app = make_app(WorkerConfig(...))`` (optionally with an existing Redis
store); the app's startup (:mod:`worker.lifecycle`) builds the router, engine client,
control plane, load exchange and :class:`worker.chat.turn.TurnManager` and runs the
background loops on one supervisor; :func:`begin_drain` + the app's cleanup end it (see
``worker.cli``). The configuration is :class:`worker.config.WorkerConfig`, the shared
state :class:`worker.state.WorkerState` (both re-exported here).
"""

from __future__ import annotations

import logging
from typing import Any, Final

import orjson
from aiohttp import web

from relay.broker.errors import RedisCommandError, RelayError
from relay.broker.rediscluster.store import RedisStore
from relay.protocol.codes import Refusal
from relay.protocol.keys import idem_key, new_session_id
from relay.service import cors, openapi, settings
from relay.service.clientaddr import parse_networks
from relay.service.errors import RETRY_AFTER, Reject, admin_refused, refusal, retry_after
from relay.service.httpbody import read_body, read_json, refused
from relay.service.httpguard import ConnLimits, guard_app
from relay.service.jsonbody import BodyRefused, ClientGone
from relay.service.register import add_routes
from worker import controls
from worker.access import BadTokenRequest, RateLimited, parse_token_request
from worker.chat import direct
from worker.chat.replace import NothingToRegenerate, Replace, UnknownReplaced
from worker.chat.turnstate import (
    Draining,
    IdempotencyKeyReused,
    IdempotencyPending,
    TurnBusy,
    TurnCancelled,
)
from worker.config import WorkerConfig
from worker.controls import check_gone
from worker.fronts.aisdk import http as aisdk
from worker.fronts.errors import WireError
from worker.fronts.openai import http as openai
from worker.fronts.options import engine_options, refusal_code
from worker.fronts.responses import http as responses
from worker.jobs import api as jobs_api
from worker.lifecycle import CFG, REDIS_UNREACHABLE, STORE, lifecycle
from worker.metrics import CONTENT_TYPE_LATEST
from worker.routing.lease import AllEnginesFull
from worker.state import STATE, WorkerState

__all__ = [
    "begin_drain",
    "make_app",
]

log = logging.getLogger(__name__)
_JSON: Final = "application/json"
ADMIN_KEY: Final = web.AppKey("tokenrelay_admin_key", bytes)  # b"": none set
# /readyz: a sentence for each reason not to be ready (a failing loop: its own sentence)
_NOT_READY: Final = {
    "draining": "worker is shutting down",
    REDIS_UNREACHABLE: "redis has not been reached since start-up",
    "no_engines": "no engine is routable",
    "redis_unavailable": "redis did not answer a ping",
}


def _json(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(body), content_type=_JSON,
                        headers=headers)  # fmt: skip


def _redis_refusal(st: WorkerState, sid: str, exc: RelayError) -> web.Response:
    """503 for a turn Redis did not take: a code and a short reason; details to the log."""
    st.metrics.rejected.labels(status="503").inc()
    log.warning("request on session %s refused, redis: %r", sid, exc)
    refused = isinstance(exc, RedisCommandError)  # e.g. out of memory, noeviction
    reason = "redis refused the command" if refused else "redis did not answer"
    return refusal(503, Refusal.REDIS_UNAVAILABLE, reason, RETRY_AFTER)


def _refused(st: WorkerState, exc: Reject) -> web.Response:
    """A refused request, counted in the metrics by its status."""
    st.metrics.rejected.labels(status=str(exc.status)).inc()
    return exc.response()


async def _create_session(request: web.Request) -> web.Response:
    st = request.app[STATE]
    if st.turns.draining:
        return refusal(503, Refusal.DRAINING, "worker is shutting down", RETRY_AFTER)
    try:
        st.access.check_creation(request)
    except Reject as exc:  # RateLimited, or an unreadable X-Forwarded-For
        return _refused(st, exc)
    sid = new_session_id()
    try:
        await st.access.take_session(st.turns.store.store, request, sid)
    except Reject as exc:
        return _refused(st, exc)
    except RelayError as exc:
        return _redis_refusal(st, sid, exc)
    minted = st.access.mint(sid, "write", st.cfg.token_ttl_s)
    return _json(201, {"session": sid, "token": minted.token, "expires_at": minted.expires_at})


async def _mint_token(request: web.Request) -> web.Response:
    """A watch (share link) or write (refresh) token for a session, given a write token."""
    st = request.app[STATE]
    try:
        sid = controls.session_of(request, "write")
    except Reject as r:
        return r.response()
    try:
        await check_gone(st.turns.store, sid)
    except Reject as r:
        return r.response()
    except RelayError as exc:
        return _redis_refusal(st, sid, exc)
    try:
        raw = await read_body(request, st.cfg.max_body_bytes, content_type=None)
        scope, ttl_s = parse_token_request(raw)
    except BodyRefused as r:  # too large, or the client left mid-body
        return refused(r)
    except BadTokenRequest as exc:
        return refusal(400, Refusal.INVALID_TOKEN_REQUEST, str(exc))
    return _json(201, st.access.mint(sid, scope, ttl_s).body(sid))


def _parse_replace(body: dict[str, Any]) -> Replace | None:
    """``regenerate: true`` (the newest turn) or ``replaces: <turn>``; else None."""
    regen, replaces = body.get("regenerate", False), body.get("replaces")
    if isinstance(replaces, float) and replaces.is_integer():
        replaces = int(replaces)  # JSON has one number type: 2.0 is the turn 2
    if not isinstance(regen, bool):
        raise Reject(400, Refusal.INVALID_TURN, "'regenerate' must be a boolean")
    if replaces is not None and (
        isinstance(replaces, bool) or not isinstance(replaces, int) or replaces < 1
    ):
        raise Reject(400, Refusal.INVALID_TURN, "'replaces' must be a positive turn number")
    if regen and replaces is not None:
        raise Reject(400, Refusal.INVALID_TURN, "send 'regenerate' or 'replaces', not both")
    if regen:
        if body.get("message") is not None:
            reason = "'regenerate' asks the replaced turn's message again: send no 'message'"
            raise Reject(400, Refusal.INVALID_MESSAGE, reason)
        return Replace()
    return Replace(turn=replaces) if replaces is not None else None


# what a turn's body holds besides the engine's options (worker.fronts.options)
_TURN_FIELDS: Final = frozenset(
    ("message", "system", "max_tokens", "regenerate", "replaces", "stream")
)


def _parse_turn(
    body: dict[str, Any], cfg: WorkerConfig
) -> tuple[str | None, str | None, int, Replace | None, dict[str, Any]]:
    """The turn's message (None: a regenerate), system prompt, max_tokens, the turn it
    replaces and the engine's options (tools, ``stop``, sampling: the one checker of
    every front, which refuses a field it does not know by name), or :class:`Reject`
    (400, 413)."""
    replace = _parse_replace(body)
    message = body.get("message")
    if message is None and replace is not None:
        pass  # a regenerate: the replaced turn's message
    elif not isinstance(message, str):
        raise Reject(400, Refusal.INVALID_MESSAGE, "'message' must be a string")
    elif not message.strip():
        raise Reject(400, Refusal.INVALID_MESSAGE, "'message' must not be empty")
    limit = cfg.max_message_chars
    if message is not None and len(message) > limit:
        raise Reject(413, Refusal.MESSAGE_TOO_LARGE, f"'message' longer than {limit} characters")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise Reject(400, Refusal.INVALID_SYSTEM, "'system' must be a string")
    if system is not None and len(system) > limit:
        raise Reject(413, Refusal.SYSTEM_TOO_LARGE, f"'system' longer than {limit} characters")
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, float) and max_tokens.is_integer():
        max_tokens = int(max_tokens)  # JSON has one number type: 256.0 is the integer 256
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            raise Reject(400, Refusal.INVALID_MAX_TOKENS, "'max_tokens' must be an integer")
        if not 1 <= max_tokens <= cfg.max_tokens_limit:
            raise Reject(
                400,
                Refusal.INVALID_MAX_TOKENS,
                f"'max_tokens' must be between 1 and {cfg.max_tokens_limit}",
            )
    try:  # after the turn's own fields: a body without its message says so first
        options = engine_options(body, _TURN_FIELDS)
    except WireError as exc:
        raise Reject(400, refusal_code(exc), exc.message) from None
    return message, system or None, max_tokens or cfg.default_max_tokens, replace, options


async def _post_turn(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    cfg = st.cfg
    try:
        sid = controls.session_of(request, "write")
    except Reject as r:
        return r.response()
    try:
        body = await read_json(request, cfg.max_body_bytes)
    except ClientGone as r:  # counted by the guard
        return refused(r)
    except BodyRefused as r:  # an unreadable body (400) is counted, as a bad field is
        return _refused(st, Reject(r.status, r.code, r.reason)) if r.status == 400 else refused(r)
    try:
        message, system, max_tokens, replace, options = _parse_turn(body, cfg)
        stream = direct.wants_stream(request.headers.get("Accept"), body)
    except Reject as exc:
        return _refused(st, exc)
    except ValueError as exc:  # 'stream' of the wrong type
        return _refused(st, Reject(400, Refusal.INVALID_STREAM, str(exc)))
    viewer = direct.DirectViewer() if stream else None
    idem = request.headers.get("Idempotency-Key")
    if idem is not None:
        try:
            idem_key(sid, idem)
        except ValueError as exc:
            return refusal(400, Refusal.INVALID_IDEMPOTENCY_KEY, str(exc))
    if not st.turns.redis_ready:  # start-up has not reached Redis yet: refuse at once
        reason = "redis has not been reached yet"
        return _refused(st, Reject(503, Refusal.REDIS_UNAVAILABLE, reason, RETRY_AFTER))
    try:
        await check_gone(st.turns.store, sid)
        await st.access.check_turn_rate(st.turns.store.store, sid)
    except (RateLimited, Reject) as exc:
        return _refused(st, exc)
    except RelayError as exc:
        return _redis_refusal(st, sid, exc)
    try:
        started = await st.turns.start_turn(
            sid, message, system=system, max_tokens=max_tokens, idempotency_key=idem,
            viewer=viewer, replaces=replace, options=options,
        )  # fmt: skip
    except (TurnCancelled, NothingToRegenerate, UnknownReplaced) as exc:
        return _refused(st, _control_refusal(exc))
    except Draining:
        return _refused(st, Reject(503, Refusal.DRAINING, "worker is shutting down", RETRY_AFTER))
    except TurnBusy as exc:
        reason = "a turn of this session is generating; watch it, then post again"
        busy = Reject(409, Refusal.TURN_IN_PROGRESS, reason, turn=exc.holder.turn,
                      offset=exc.holder.offset)  # fmt: skip
        return _refused(st, busy)
    except IdempotencyPending as exc:
        return _refused(st, Reject(409, Refusal.IDEMPOTENCY_PENDING, str(exc)))
    except IdempotencyKeyReused as exc:
        return _refused(st, Reject(422, Refusal.IDEMPOTENCY_KEY_REUSED, str(exc)))
    except AllEnginesFull as exc:
        full = Reject(429, Refusal.ENGINES_FULL, exc.reason, retry_after(exc.retry_after_s),
                      retry_after_s=round(exc.retry_after_s, 3))  # fmt: skip
        return _refused(st, full)
    except RelayError as exc:
        return _redis_refusal(st, sid, exc)
    if viewer is not None and not started.replayed:  # the closed loop: frames right here
        hello = {"type": "hello", "worker": cfg.worker_id, "from": started.offset - 1,
                 **started.body()}  # fmt: skip
        return await direct.respond(request, viewer, orjson.dumps(hello))
    headers = {"Idempotent-Replayed": "true"} if started.replayed else None
    return _json(202, started.body(), headers)


def _control_refusal(exc: Exception) -> Reject:
    """The refusal of a turn the chat controls turned down (stopped while it waited, a
    regenerate or edit of what the history lacks)."""
    if isinstance(exc, TurnCancelled):
        return Reject(409, Refusal.TURN_CANCELLED, str(exc))
    if isinstance(exc, NothingToRegenerate):
        return Reject(409, Refusal.NOTHING_TO_REGENERATE, str(exc))
    if isinstance(exc, UnknownReplaced):
        code = Refusal.UNKNOWN_MESSAGE if exc.what == "message" else Refusal.UNKNOWN_TURN
        return Reject(404, code, str(exc))
    raise TypeError(exc)


async def _healthz(request: web.Request) -> web.Response:
    return _json(200, {"status": "ok", "worker": request.app[STATE].cfg.worker_id})


async def _router_view(request: web.Request) -> web.Response:
    """The router as this worker sees it: engines (in-flight, caps, health) and recent
    placements on the ring (where a turn's routing key fell, no session id). For the
    operator (:func:`relay.service.errors.admin_refused`); the demo's live panel reads
    it with the demo's admin key."""
    st = request.app[STATE]
    refused = admin_refused(request, request.app[ADMIN_KEY] or None)
    if refused is not None:
        return _refused(st, refused)
    snap = st.router.snapshot()
    alive = {s.id for s in st.control.alive()}
    engines = [
        {"id": eid, "healthy": eid in alive, **view} for eid, view in snap["engines"].items()
    ]
    body = {
        "worker": st.cfg.worker_id,
        "engines": engines,
        "counters": snap["counters"],
        "spill": snap["spill"],
        "placements": list(st.turns.placements),
    }
    return _json(200, body)


def _not_ready_sentence(reason: str) -> str:
    if reason in _NOT_READY:
        return _NOT_READY[reason]
    loop = reason.removesuffix("_failing")
    return f"background loop {loop} keeps failing"


async def _readyz(request: web.Request) -> web.Response:
    """200 when the worker can take turns; else 503 ``{"error": <first reason>, "reason":
    <sentences>, "reasons": [...]}``: draining, the supervisor's reasons (Redis not yet
    reached, a critical loop failing), no routable engine, Redis not answering a ping."""
    st = request.app[STATE]
    reasons = ["draining"] if st.turns.draining else []
    reasons += st.supervisor.not_ready()
    if not st.router.engines():
        reasons.append("no_engines")
    if REDIS_UNREACHABLE not in reasons:
        try:
            await st.store.ping()
        except RelayError as exc:
            log.warning("readyz: redis ping failed: %r", exc)
            reasons.append("redis_unavailable")
    if reasons:  # the supervisor's names and the worker's own, not Refusal codes
        sentence = "; ".join(_not_ready_sentence(r) for r in reasons)
        return refusal(503, reasons[0], sentence, reasons=reasons)
    return _json(200, {"status": "ready", "engines": [s.id for s in st.router.engines()]})


async def _metrics(request: web.Request) -> web.Response:
    refused = admin_refused(request, request.app[ADMIN_KEY] or None)
    if refused is not None:
        return _refused(request.app[STATE], refused)
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def begin_drain(app: web.Application) -> None:
    """Stop taking turns (POSTs get 503, /readyz 503); the cleanup finishes the drain."""
    app[STATE].turns.draining = True


def make_app(cfg: WorkerConfig, *, store: RedisStore | None = None) -> web.Application:
    """The worker application. Pass ``store`` to share one (it is not closed)."""
    app = web.Application(client_max_size=cfg.max_body_bytes)
    app[CFG] = cfg
    app[ADMIN_KEY] = settings.check_admin_key(cfg.admin_key) or b""
    if store is not None:
        app[STORE] = store
    app.cleanup_ctx.append(lifecycle)
    add_routes(app, "worker", {  # the route table: relay/service/routes.py
        "sessions.create": _create_session,
        "sessions.turn": _post_turn,  # a bad id: 400, not 404
        "sessions.token": _mint_token,
        **controls.handlers(),  # stop, messages, delete (worker/controls.py)
        **openai.handlers(),  # POST /v1/chat/completions, GET /v1/models
        **responses.handlers(cfg.cors_origin),  # /v1/responses: OpenAI's Responses API
        **jobs_api.handlers(),  # POST /v1/jobs, GET /v1/jobs/{id} (404 without --amqp)
        **aisdk.handlers(),  # POST /v1/chat: the Vercel AI SDK's chat
        "healthz": _healthz,
        "readyz": _readyz,
        "metrics": _metrics,
        "router": _router_view,
        "openapi": openapi.handler("worker"),  # docs/openapi.yaml
    })  # fmt: skip
    # the routes a browser reads from another origin (a resumed Responses stream through
    # a door that routes by path): their answers name the allowed origin, as a relay's
    app.on_response_prepare.append(cors.allow_on(cors.paths("worker"), cfg.cors_origin))
    limits = ConnLimits(
        head_timeout_s=cfg.head_timeout_s,
        body_timeout_s=cfg.body_timeout_s,
        keepalive_timeout_s=cfg.keepalive_timeout_s,
        max_per_address=cfg.max_connections_per_address,
        exempt=parse_networks(cfg.trusted_proxies),
    )

    def count(reason: str) -> None:  # the metrics exist once the app has started
        st = app.get(STATE)
        if st is not None:
            st.metrics.http_guard.labels(reason).inc()

    guard_app(app, limits, count)  # app[GUARD], for the site that serves the app
    return app
