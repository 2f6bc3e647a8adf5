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


class Refusal(enum.StrEnum):
    BAD_SESSION = "bad_session"
    BAD_OFFSET = "bad_offset"
    BAD_GEN = "bad_gen"  # the stream's ``gen`` parameter is not a generation id
    NOT_WEBSOCKET = "not_websocket"
    DRAINING = "draining"  # the relay drains or has not started: connect again
    OVERLOADED = "overloaded"  # max_connections reached
    UNAVAILABLE = "unavailable"  # Redis could not be read: connect again
    TOO_MANY_STREAMS = "too_many_streams"  # per-token / per-address stream limit
    HEAD_TIMEOUT = "head_timeout"  # the request head did not arrive in time (408)
    # token checks (relay.protocol.auth)
    FORBIDDEN = "forbidden"
    TOKEN_MISSING = "token_missing"
    TOKEN_INVALID = "token_invalid"
    TOKEN_UNKNOWN_KEY = "token_unknown_key"
    TOKEN_EXPIRED = "token_expired"
    TOKEN_NOT_YET_VALID = "token_not_yet_valid"
    TOKEN_WRONG_SESSION = "token_wrong_session"
    TOKEN_WRONG_SCOPE = "token_wrong_scope"


class Readiness(enum.StrEnum):
    READY = "ready"
    STARTING = "starting"
    DRAINING = "draining"
    REDIS_UNREACHABLE = "redis_unreachable"
    NOT_READY = "not_ready"  # a critical background loop keeps failing (see ``reasons``)
