"""The worker's HTTP API (aiohttp): sessions, turns, health and metrics.

Routes (the contract: docs/openapi.yaml):

* ``POST /v1/sessions`` -> ``201 {"session": sid, "token": token, "expires_at"}`` (a
  ``write`` token: it lets the holder post turns, mint tokens and watch the session on
  any relay); 429 + Retry-After when this client address creates sessions too fast;
* ``POST /v1/sessions/{sid}/tokens`` with a write token and ``{"scope": "watch"|"write",
  "ttl_s"?: int}`` -> ``201 {"session", "token", "scope", "expires_at"}`` (the lifetime
  capped by ``max_token_ttl_s`` and the session's; see :mod:`worker.access`);
* ``POST /v1/sessions/{sid}/turns`` with ``{"message": str, "system"?: str,
  "max_tokens"?: int}`` and the token (``Authorization: Bearer`` or ``?token=``) ->
  ``202 {"session", "turn", "offset"}``; then frames flow on the session's channel.
  Errors, each with a JSON body ``{"error": code, "reason": sentence}``: 400 (malformed
  JSON, missing/empty ``message``, wrong types, ``max_tokens`` out of range, bad
  session id or Idempotency-Key), 401/403 (token), 409 (a turn is generating: the body
  names it, ``turn`` and ``offset``, so the client can watch it; we answer 409 rather
  than queueing because a queued turn would be generated against a history that does
  not yet hold the running turn's reply, and a queue hides load from the client),
  413 (body or message too large), 415 (not ``application/json``), 429 + Retry-After
  (every engine full, or ``turns_per_minute`` of this session used), 503 (draining, or
  Redis unavailable). Without ``max_tokens`` the turn gets ``default_max_tokens``.
* ``POST /v1/chat/completions`` and ``GET /v1/models``: the OpenAI-compatible gateway
  (:mod:`worker.gateway.openai`), routed by the same router, no session;
* ``POST /v1/jobs``, ``GET /v1/jobs/{id}``: offline jobs on RabbitMQ when ``--amqp`` is
  given (:mod:`worker.jobs.api`; ``tokenrelay jobworker`` runs them);
* ``GET /healthz`` (the process lives), ``GET /readyz`` (Redis answers, some engine is
  routable, no critical background loop failing, not draining), ``GET /metrics``
  (Prometheus text), ``GET /openapi.json`` (docs/openapi.yaml, the worker's part).

Order of use: ``app = make_app(WorkerConfig(...))`` (optionally with an existing Redis
client); the app's startup (:mod:`worker.lifecycle`) builds the router, engine client,
control plane, load exchange and :class:`worker.chat.turn.TurnManager` and runs the
background loops on one supervisor; :func:`begin_drain` + the app's cleanup end it (see
``worker.cli``). The configuration is :class:`worker.config.WorkerConfig`, the shared
state :class:`worker.state.WorkerState` (both re-exported here).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Final

import orjson
from aiohttp import web
from redis.asyncio.cluster import RedisCluster

from relay.broker.errors import RedisCommandError, RelayError
from relay.broker.rediscluster.errors import map_redis_errors
from relay.protocol.auth import AuthError
from relay.protocol.keys import InvalidSessionId, idem_key, new_session_id, parse_session
from relay.service import openapi
from worker.access import BadTokenRequest, Refusal, parse_token_request
from worker.chat import direct
from worker.chat.turnstate import Draining, IdempotencyKeyReused, IdempotencyPending, TurnBusy
from worker.config import WorkerConfig
from worker.gateway import aisdk
from worker.gateway import openai as gateway
from worker.jobs import api as jobs_api
from worker.lifecycle import CFG, REDIS, REDIS_UNREACHABLE, lifecycle
from worker.metrics import CONTENT_TYPE_LATEST
from worker.routing.lease import AllEnginesFull
from worker.state import STATE, WorkerState

__all__ = [
    "begin_drain",
    "make_app",
]

log = logging.getLogger(__name__)
_JSON: Final = "application/json"
# /readyz: a sentence for each reason not to be ready (a failing loop: its own sentence)
_NOT_READY: Final = {
    "draining": "worker is shutting down",
    REDIS_UNREACHABLE: "redis has not been reached since start-up",
    "no_engines": "no engine is routable",
    "redis_unavailable": "redis did not answer a ping",
}


def _err(status: int, code: str, reason: str, **extra: Any) -> web.Response:
    headers = extra.pop("headers", None)
    body = {"error": code, "reason": reason, **extra}
    return web.Response(status=status, body=orjson.dumps(body), content_type=_JSON,
                        headers=headers)  # fmt: skip


def _json(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(body), content_type=_JSON,
                        headers=headers)  # fmt: skip


def _redis_refusal(st: WorkerState, sid: str, exc: RelayError) -> web.Response:
    """503 for a turn Redis did not take: a code and a short reason; details to the log."""
    st.metrics.rejected.labels(status="503").inc()
    log.warning("turn of %s refused, redis: %r", sid, exc)
    refused = isinstance(exc, RedisCommandError)  # e.g. out of memory, noeviction
    reason = "redis refused the command" if refused else "redis did not answer"
    return _err(503, "redis_unavailable", reason, headers={"Retry-After": "1"})


def _refused(st: WorkerState, exc: Refusal) -> web.Response:
    st.metrics.rejected.labels(status="429").inc()
    return _err(429, exc.code, exc.reason, headers={"Retry-After": exc.retry_after})


async def _create_session(request: web.Request) -> web.Response:
    st = request.app[STATE]
    if st.turns.draining:
        return _err(503, "draining", "worker is shutting down", headers={"Retry-After": "1"})
    try:
        st.access.check_creation(request)
    except Refusal as exc:
        return _refused(st, exc)
    sid = new_session_id()
    minted = st.access.mint(sid, "write", st.cfg.token_ttl_s)
    return _json(201, {"session": sid, "token": minted.token, "expires_at": minted.expires_at})


async def _mint_token(request: web.Request) -> web.Response:
    """A watch (share link) or write (refresh) token for a session, given a write token."""
    st = request.app[STATE]
    try:
        sid = parse_session(request.match_info["sid"])
    except InvalidSessionId as exc:
        return _err(400, "invalid_session", str(exc))
    try:
        st.access.authorize(request, sid, "write")
    except AuthError as exc:
        return _err(exc.status, exc.error, exc.reason)
    try:
        scope, ttl_s = parse_token_request(await request.read())
    except BadTokenRequest as exc:
        return _err(400, "invalid_token_request", str(exc))
    except web.HTTPRequestEntityTooLarge:
        return _err(413, "body_too_large", f"body larger than {st.cfg.max_body_bytes} bytes")
    return _json(201, st.access.mint(sid, scope, ttl_s).body(sid))


class _BadRequest(Exception):
    def __init__(self, status: int, code: str, reason: str) -> None:
        super().__init__(reason)
        self.status, self.code, self.reason = status, code, reason


def _parse_turn(raw: bytes, cfg: WorkerConfig) -> tuple[str, str | None, int]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _BadRequest(400, "malformed_json", f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise _BadRequest(400, "invalid_body", "body must be a JSON object")
    message = body.get("message")
    if not isinstance(message, str):
        raise _BadRequest(400, "invalid_message", "'message' must be a string")
    if not message.strip():
        raise _BadRequest(400, "invalid_message", "'message' must not be empty")
    if len(message) > cfg.max_message_chars:
        raise _BadRequest(
            413, "message_too_large", f"'message' longer than {cfg.max_message_chars} characters"
        )
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise _BadRequest(400, "invalid_system", "'system' must be a string")
    if system is not None and len(system) > cfg.max_message_chars:
        raise _BadRequest(
            413, "system_too_large", f"'system' longer than {cfg.max_message_chars} characters"
        )
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, float) and max_tokens.is_integer():
        max_tokens = int(max_tokens)  # JSON has one number type: 256.0 is the integer 256
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            raise _BadRequest(400, "invalid_max_tokens", "'max_tokens' must be an integer")
        if not 1 <= max_tokens <= cfg.max_tokens_limit:
            raise _BadRequest(
                400,
                "invalid_max_tokens",
                f"'max_tokens' must be between 1 and {cfg.max_tokens_limit}",
            )
    return message, system or None, max_tokens or cfg.default_max_tokens


async def _post_turn(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    cfg = st.cfg
    try:
        sid = parse_session(request.match_info["sid"])
    except InvalidSessionId as exc:
        return _err(400, "invalid_session", str(exc))
    try:
        st.access.authorize(request, sid, "write")
    except AuthError as exc:
        return _err(exc.status, exc.error, exc.reason)
    if request.content_type != _JSON:
        return _err(415, "unsupported_media_type", "send the body as application/json")
    if request.content_length is not None and request.content_length > cfg.max_body_bytes:
        return _err(413, "body_too_large", f"body larger than {cfg.max_body_bytes} bytes")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return _err(413, "body_too_large", f"body larger than {cfg.max_body_bytes} bytes")
    try:
        message, system, max_tokens = _parse_turn(raw, cfg)
        stream = direct.wants_stream(request.headers.get("Accept"), orjson.loads(raw))
    except _BadRequest as exc:
        st.metrics.rejected.labels(status=str(exc.status)).inc()
        return _err(exc.status, exc.code, exc.reason)
    except ValueError as exc:  # 'stream' of the wrong type
        st.metrics.rejected.labels(status="400").inc()
        return _err(400, "invalid_stream", str(exc))
    viewer = direct.DirectViewer() if stream else None
    idem = request.headers.get("Idempotency-Key")
    if idem is not None:
        try:
            idem_key(sid, idem)
        except ValueError as exc:
            return _err(400, "invalid_idempotency_key", str(exc))
    if not st.turns.redis_ready:  # start-up has not reached Redis yet: refuse at once
        st.metrics.rejected.labels(status="503").inc()
        return _err(503, "redis_unavailable", "redis has not been reached yet",
                    headers={"Retry-After": "1"})  # fmt: skip
    try:
        await st.access.check_turn_rate(st.redis, sid)
    except Refusal as exc:
        return _refused(st, exc)
    except RelayError as exc:
        return _redis_refusal(st, sid, exc)
    try:
        started = await st.turns.start_turn(
            sid, message, system=system, max_tokens=max_tokens, idempotency_key=idem,
            viewer=viewer,
        )  # fmt: skip
    except Draining:
        st.metrics.rejected.labels(status="503").inc()
        return _err(503, "draining", "worker is shutting down", headers={"Retry-After": "1"})
    except TurnBusy as exc:
        st.metrics.rejected.labels(status="409").inc()
        return _err(
            409,
            "turn_in_progress",
            "a turn of this session is generating; watch it, then post again",
            turn=exc.holder.turn,
            offset=exc.holder.offset,
        )
    except IdempotencyPending as exc:
        st.metrics.rejected.labels(status="409").inc()
        return _err(409, "idempotency_pending", str(exc))
    except IdempotencyKeyReused as exc:
        st.metrics.rejected.labels(status="422").inc()
        return _err(422, "idempotency_key_reused", str(exc))
    except AllEnginesFull as exc:
        st.metrics.rejected.labels(status="429").inc()
        retry = str(max(1, math.ceil(exc.retry_after_s)))
        return _err(429, "engines_full", exc.reason, headers={"Retry-After": retry},
                    retry_after_s=round(exc.retry_after_s, 3))  # fmt: skip
    except RelayError as exc:
        return _redis_refusal(st, sid, exc)
    if viewer is not None and not started.replayed:  # the closed loop: frames right here
        hello = {"type": "hello", "worker": cfg.worker_id, "from": started.offset - 1,
                 **started.body()}  # fmt: skip
        return await direct.respond(request, viewer, orjson.dumps(hello))
    headers = {"Idempotent-Replayed": "true"} if started.replayed else None
    return _json(202, started.body(), headers)


async def _healthz(request: web.Request) -> web.Response:
    return _json(200, {"status": "ok", "worker": request.app[STATE].cfg.worker_id})


async def _router_view(request: web.Request) -> web.Response:
    """The router as this worker sees it: engines (in-flight, caps, health) and recent
    placements of sessions on the ring. Read by the demo's live panel."""
    st = request.app[STATE]
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
            with map_redis_errors():
                await st.redis.ping()
        except RelayError as exc:
            log.warning("readyz: redis ping failed: %r", exc)
            reasons.append("redis_unavailable")
    if reasons:
        sentence = "; ".join(_not_ready_sentence(r) for r in reasons)
        return _err(503, reasons[0], sentence, reasons=reasons)
    return _json(200, {"status": "ready", "engines": [s.id for s in st.router.engines()]})


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def begin_drain(app: web.Application) -> None:
    """Stop taking turns (POSTs get 503, /readyz 503); the cleanup finishes the drain."""
    app[STATE].turns.draining = True


def make_app(cfg: WorkerConfig, *, redis: RedisCluster | None = None) -> web.Application:
    """The worker application. Pass ``redis`` to share a client (it is not closed)."""
    app = web.Application(client_max_size=cfg.max_body_bytes)
    app[CFG] = cfg
    if redis is not None:
        app[REDIS] = redis
    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/sessions", _create_session)
    app.router.add_post("/v1/sessions/{sid:[^/]+}/turns", _post_turn)  # a bad id: 400, not 404
    app.router.add_post("/v1/sessions/{sid:[^/]+}/tokens", _mint_token)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/v1/router", _router_view)
    gateway.add_routes(app)  # POST /v1/chat/completions, GET /v1/models
    jobs_api.add_routes(app)  # POST /v1/jobs, GET /v1/jobs/{id} (404 without --amqp)
    app.router.add_get("/openapi.json", openapi.handler("worker"))  # docs/openapi.yaml
    aisdk.register(app)  # POST /v1/chat: the Vercel AI SDK's chat (worker/gateway/aisdk.py)
    return app
