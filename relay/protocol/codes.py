"""The machine-readable codes of the relay's wire contract (docs/PROTOCOL.md), as enums.

Every one is a :class:`enum.StrEnum` or :class:`enum.IntEnum`: it compares equal to, and
serialises as, the string or number on the wire, so clients and the docs see the same
values as before; code compares members instead of bare strings.

- :class:`CloseCode`: why a stream ended (the SSE ``: close <code> <reason>`` comment,
  :attr:`relay.broker.errors.WatchClosed.code`, the ``code`` label of
  ``tokenrelay_relay_closes_total``);
- :class:`WsClose`: the WebSocket close code sent for each :class:`CloseCode`;
- :class:`Refusal`: the ``error`` of a JSON refusal before a stream starts (relay and
  worker; the token errors of :mod:`relay.protocol.auth` are among them);
- :class:`Readiness`: the ``status`` of a relay's ``/readyz``.
"""

from __future__ import annotations

import enum

__all__ = ["CloseCode", "Readiness", "Refusal", "WsClose"]


class CloseCode(enum.StrEnum):
    CLOSED = "closed"  # the stream ended normally
    RELAY_SHUTDOWN = "relay_shutdown"  # the relay drains: reconnect (jittered retry)
    SLOW_CONSUMER = "slow_consumer"  # the client did not read fast enough
    TOKEN_EXPIRED = "token_expired"  # the stream's token expired
    BAD_MESSAGE = "bad_message"  # WebSocket: a client message other than a ping
    BINARY = "binary"  # WebSocket: a binary message
    TOO_BIG = "too_big"  # WebSocket: a message over ws_max_message_bytes
    INTERNAL = "internal"  # a bug of the relay
    SESSION_DELETED = "session_deleted"  # the session was deleted (its streams end)
    CLIENT_GONE = "client_gone"  # the client went away (never sent: a metrics label)


class WsClose(enum.IntEnum):
    NORMAL = 1000
    UNSUPPORTED_DATA = 1003
    MESSAGE_TOO_BIG = 1009
    INTERNAL_ERROR = 1011
    SERVICE_RESTART = 1012
    SLOW_CONSUMER = 4008
    BAD_MESSAGE = 4400
    TOKEN_EXPIRED = 4401
    SESSION_DELETED = 4410


class Refusal(enum.StrEnum):
    """The ``error`` of a JSON refusal (:mod:`relay.service.errors`), relay and worker."""

    # -- any route that names a session (relay and worker) ------------------------------
    INVALID_SESSION = "invalid_session"  # the session id is not [A-Za-z0-9_-]{1,64}
    DRAINING = "draining"  # the process drains or has not started: go to another one
    # -- the relay's streams ----------------------------------------------------------------
    INVALID_OFFSET = "invalid_offset"  # Last-Event-ID / last_event_id / from: not an offset
    INVALID_GEN = "invalid_gen"  # the stream's ``gen`` parameter is not a generation id
    INVALID_COMPACT = "invalid_compact"  # the stream's ``compact`` parameter is not 0 / 1
    NOT_WEBSOCKET = "not_websocket"
    OVERLOADED = "overloaded"  # max_connections reached
    UNAVAILABLE = "unavailable"  # Redis could not be read: connect again
    TOO_MANY_STREAMS = "too_many_streams"  # per-token / per-address stream limit
    INVALID_FORWARDED_FOR = "invalid_forwarded_for"  # a trusted proxy's entry: no address
    # the operator's endpoints (/metrics, /v1/router): relay.service.admin
    ADMIN_KEY_MISSING = "admin_key_missing"  # 401: no Bearer admin key
    ADMIN_KEY_INVALID = "admin_key_invalid"  # 403: another key
    ADMIN_LOOPBACK_ONLY = "admin_loopback_only"  # 403: no admin key set, not a local request
    HEAD_TIMEOUT = "head_timeout"  # the request head did not arrive in time (408)
    # -- any path: no route (relay.service.register; the front doors answer the same) -------
    NOT_FOUND = "not_found"  # 404: no route has the path
    METHOD_NOT_ALLOWED = "method_not_allowed"  # 405: the path's routes lack the method (Allow)
    # -- any route: the HTTP guard (relay.service.httpguard) --------------------------------
    TOO_MANY_CONNECTIONS = "too_many_connections"  # the peer address's connection cap (429)
    UNSUPPORTED_WS_VERSION = "unsupported_ws_version"  # Sec-WebSocket-Version is not 13 (426)
    # -- token checks (relay.protocol.auth) ---------------------------------------------------
    FORBIDDEN = "forbidden"
    TOKEN_MISSING = "token_missing"
    TOKEN_INVALID = "token_invalid"
    TOKEN_UNKNOWN_KEY = "token_unknown_key"
    TOKEN_EXPIRED = "token_expired"
    TOKEN_NOT_YET_VALID = "token_not_yet_valid"
    TOKEN_WRONG_SESSION = "token_wrong_session"
    TOKEN_WRONG_SCOPE = "token_wrong_scope"
    # -- the worker: a request it cannot read (400, 413, 415) ---------------------------------
    MALFORMED_JSON = "malformed_json"  # the body is not JSON
    INVALID_BODY = "invalid_body"  # JSON, but not an object
    INVALID_MESSAGE = "invalid_message"  # a turn's message: not a string, empty, or none
    INVALID_SYSTEM = "invalid_system"  # a turn's system prompt is not a string
    INVALID_MAX_TOKENS = "invalid_max_tokens"  # not an integer in 1..--max-tokens-limit
    INVALID_STREAM = "invalid_stream"  # a turn's ``stream`` is not a boolean
    UNSUPPORTED_PARAMETER = "unsupported_parameter"  # a field no front reads nor forwards
    INVALID_OPTION = "invalid_option"  # an engine option (tools, stop, ...) of the wrong type
    INVALID_IDEMPOTENCY_KEY = "invalid_idempotency_key"
    INVALID_TOKEN_REQUEST = "invalid_token_request"  # POST .../tokens: scope or ttl_s
    INVALID_MESSAGES = "invalid_messages"  # the AI SDK chat: no list of messages
    UNSUPPORTED_TRIGGER = "unsupported_trigger"  # the AI SDK chat: only submit-message
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"  # the body is not application/json
    BODY_TOO_LARGE = "body_too_large"
    MESSAGE_TOO_LARGE = "message_too_large"
    SYSTEM_TOO_LARGE = "system_too_large"
    # -- the worker: the session's one running turn (409, 422) --------------------------------
    TURN_IN_PROGRESS = "turn_in_progress"  # the body names the running turn
    IDEMPOTENCY_PENDING = "idempotency_pending"  # the same key's request is being admitted
    IDEMPOTENCY_KEY_REUSED = "idempotency_key_reused"  # the key came with another body
    # -- the worker: the chat controls (stop, regenerate, edit, load, delete) -----------------
    INVALID_TURN = "invalid_turn"  # a turn number in the path or body is not one
    UNKNOWN_TURN = "unknown_turn"  # 404: the session has no such turn (yet)
    UNKNOWN_MESSAGE = "unknown_message"  # 404: an edit of a message id the history lacks
    TURN_FINISHED = "turn_finished"  # 409 on a stop: the turn ended; the body has its offset
    NO_TURN_RUNNING = "no_turn_running"  # 409 on a stop of "the running turn": none runs
    TURN_CANCELLED = "turn_cancelled"  # 409: the turn was stopped before it started
    NOTHING_TO_REGENERATE = "nothing_to_regenerate"  # 409: no reply stored yet
    INVALID_PAGE = "invalid_page"  # GET .../messages: limit or before out of range
    UNKNOWN_SESSION = "unknown_session"  # 404: nothing stored for the session (a delete)
    SESSION_DELETED = "session_deleted"  # 410: the session was deleted; its tokens too
    # -- the worker: limits and availability (429, 503) ---------------------------------------
    ENGINES_FULL = "engines_full"  # no engine slot within --admit-wait-s
    SESSION_RATE = "session_rate"  # new sessions per client address
    TOO_MANY_SESSIONS = "too_many_sessions"  # live sessions per client address
    TURN_RATE = "turn_rate"  # turns per session per minute
    BYTE_BUDGET = "byte_budget"  # bytes written per token / client address (relay.service.budget)
    REDIS_UNAVAILABLE = "redis_unavailable"  # Redis did not take the request: retry
    # -- the gateway keys (relay.service.apikeys): the session-less routes ------------------
    GATEWAY_DISABLED = "gateway_disabled"  # the worker has no --gateway-key
    MISSING_API_KEY = "missing_api_key"
    INVALID_API_KEY = "invalid_api_key"
    SESSION_TOKEN_REQUIRED = "session_token_required"  # a gateway key naming a session
    # -- the worker's jobs (worker.jobs.api) --------------------------------------------------
    JOBS_DISABLED = "jobs_disabled"  # started without --amqp (404)
    INVALID_JOB = "invalid_job"  # the job's body
    INVALID_JOB_ID = "invalid_job_id"
    PROMPT_TOO_LARGE = "prompt_too_large"
    JOB_NOT_FOUND = "job_not_found"  # no such job, or it expired
    QUEUE_UNAVAILABLE = "queue_unavailable"  # the broker did not take the job: retry


class Readiness(enum.StrEnum):
    READY = "ready"
    STARTING = "starting"
    DRAINING = "draining"
    REDIS_UNREACHABLE = "redis_unreachable"
    NOT_READY = "not_ready"  # a critical background loop keeps failing (see ``reasons``)
