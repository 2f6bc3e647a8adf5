"""Session ids and every Redis key / channel name, in one place.

Everything about one session lives in one hash slot: the session id is the hash tag
(``tr:{<sid>}:...``). A session id is validated before any name is built, so a client
can never pick a slot (or break out of the tag) by smuggling braces, CR/LF or NUL.

Order of use: :func:`parse_session` on every id that arrives from outside, then
:func:`key` (or the named helpers) to build names. The control plane's names (worker
load reports, engine heartbeats) are here too. Nothing else in the project formats
``tr:`` strings.

Retention, one setting each for every process that writes or reads a session
(``--backlog-maxlen``, ``--backlog-max-bytes`` and ``--session-ttl-s`` on relays and
workers alike, declared in :mod:`relay.service.settings`): :data:`BACKLOG_MAXLEN` frames
and :data:`BACKLOG_MAX_BYTES` bytes of frames kept per session's backlog,
:data:`SESSION_TTL_S` seconds a session lives after its last write.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from enum import StrEnum
from typing import Final

__all__ = [
    "BACKLOG_MAXLEN",
    "BACKLOG_MAX_BYTES",
    "ENGINES_REGISTRY",
    "LOCK_TTL_S",
    "MAX_LOCK_TTL_S",
    "OWNER_FIELD",
    "PRODUCER_LOST_S",
    "RELAYS_REGISTRY",
    "SESSION_ID_MAX_LEN",
    "SESSION_TTL_S",
    "WORKERS_REGISTRY",
    "InvalidSessionId",
    "KeyKind",
    "address_bytes_key",
    "address_sessions_key",
    "cancel_key",
    "control_channel",
    "engine_key",
    "gone_key",
    "hist_key",
    "idem_key",
    "key",
    "live_channel",
    "log_key",
    "meta_key",
    "new_session_id",
    "owner_key",
    "parse_session",
    "presence_key",
    "screens_key",
    "token_bytes_key",
    "turn_rate_key",
    "worker_key",
]

SESSION_ID_MAX_LEN = 64
BACKLOG_MAXLEN = 10_000  # frames a session's backlog keeps (XADD MAXLEN ~)
BACKLOG_MAX_BYTES = 4 << 20  # bytes of frames a session's backlog keeps (XTRIM MINID)
SESSION_TTL_S = 86_400  # a session's keys expire this long after its last write
# A producer's death (kill -9, a lost host) ends its open turn with an ``error`` frame on
# the screens within PRODUCER_LOST_S, for every producer (the worker, relay.producer, the
# TypeScript producer): the relays' reaper (--reap-after-s 2, one look a second) ends a
# silent turn once its turn lock has expired, so a producer's lock TTL (LOCK_TTL_S by
# default, refreshed about once a second) may be at most MAX_LOCK_TTL_S: that TTL + the
# reaper's second + round trips stay within the bound.
PRODUCER_LOST_S = 10.0
LOCK_TTL_S = 5.0
MAX_LOCK_TTL_S = 7.0
_SESSION_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_IDEM_RE = re.compile(r"[\x21-\x7e]{1,128}")


class InvalidSessionId(ValueError):
    """A session id outside ``[A-Za-z0-9_-]{1,64}``. The message says why."""


class KeyKind(StrEnum):
    """What a per-session name points at."""

    LIVE = "live"  # shard channel: SPUBLISH / SSUBSCRIBE
    LOG = "log"  # stream: the backlog of frames, for resume
    META = "meta"  # hash: epoch, next offset, turn counter
    HIST = "hist"  # list: the chat history (worker)
    PRESENCE = "presence"  # sorted set: relay id -> last seen (ms), who watches
    LOCK = "lock"  # string: the turn that currently generates
    IDEM = "idem"  # string: Idempotency-Key -> turn
    RATE = "rate"  # string: turn requests in one minute (worker abuse limit)
    CANCEL = "cancel"  # hash: turn -> a stop asked for it, or the offset it ended at
    SCREENS = "screens"  # hash: relay id -> how many screens it serves the session to
    GONE = "gone"  # string: the session was deleted; its tokens are refused (tombstone)


def parse_session(raw: object) -> str:
    """Return ``raw`` as a session id, or raise :class:`InvalidSessionId` with a reason."""
    if not isinstance(raw, str):
        raise InvalidSessionId("session id must be a string")
    if not raw:
        raise InvalidSessionId("session id is empty")
    if len(raw) > SESSION_ID_MAX_LEN:
        raise InvalidSessionId(f"session id longer than {SESSION_ID_MAX_LEN} characters")
    if _SESSION_RE.fullmatch(raw) is None:
        raise InvalidSessionId("session id may contain only A-Z a-z 0-9 _ -")
    return raw


def new_session_id() -> str:
    """A fresh random session id (128 bits, URL-safe, always valid)."""
    return secrets.token_urlsafe(16)


def key(sid: str, kind: KeyKind, suffix: str = "") -> str:
    """The one function that builds per-session names: ``tr:{sid}:kind[:suffix]``."""
    parse_session(sid)
    name = f"tr:{{{sid}}}:{kind.value}"
    return f"{name}:{suffix}" if suffix else name


def live_channel(sid: str) -> str:
    return key(sid, KeyKind.LIVE)


def log_key(sid: str) -> str:
    return key(sid, KeyKind.LOG)


def meta_key(sid: str) -> str:
    return key(sid, KeyKind.META)


def hist_key(sid: str) -> str:
    return key(sid, KeyKind.HIST)


def presence_key(sid: str) -> str:
    return key(sid, KeyKind.PRESENCE)


def cancel_key(sid: str) -> str:
    return key(sid, KeyKind.CANCEL)


def screens_key(sid: str) -> str:
    return key(sid, KeyKind.SCREENS)


# A session the Responses API created says so in its state hash (the worker's
# ``worker.chat.store.state_key``): a gateway key reads and writes only those.
OWNER_FIELD: Final = "api"


def owner_key(sid: str) -> str:
    """The session's state hash, whose :data:`OWNER_FIELD` names the API that created the
    session (``responses`` for the Responses API)."""
    return key(sid, KeyKind.HIST, "state")


def gone_key(sid: str) -> str:
    return key(sid, KeyKind.GONE)


def idem_key(sid: str, idempotency_key: str) -> str:
    """Name for a client's ``Idempotency-Key`` (printable ASCII, at most 128 characters)."""
    if _IDEM_RE.fullmatch(idempotency_key) is None:
        raise ValueError("Idempotency-Key must be 1-128 printable ASCII characters")
    return key(sid, KeyKind.IDEM, idempotency_key)


def turn_rate_key(sid: str, minute: int) -> str:
    """Counter of turn requests of ``sid`` in the minute ``minute`` (Unix s // 60)."""
    return key(sid, KeyKind.RATE, str(minute))


# -- control plane (not per session) -------------------------------------------------

WORKERS_REGISTRY = "tr:workers"  # sorted set: worker id -> last load report (s)
ENGINES_REGISTRY = "tr:engines"  # sorted set: engine id -> last heartbeat (ms)
RELAYS_REGISTRY = "tr:relays"  # sorted set: relay id -> when its heartbeat expires (ms)


def _check_member_id(what: str, ident: str) -> str:
    """A worker or engine id is its own hash tag: no braces, no whitespace, <= 128."""
    if not ident or len(ident) > 128 or any(c in ident for c in "{} \t\r\n\x00"):
        raise ValueError(f"invalid {what} id {ident!r}")
    return ident


def worker_key(worker_id: str, namespace: str = "tr") -> str:
    """Per-worker load-report hash (worker.routing.loadshare); the worker id is its hash tag.
    ``namespace`` other than "tr" isolates tests sharing one cluster."""
    return f"{namespace}:workers:{{{_check_member_id('worker', worker_id)}}}"


def address_sessions_key(address: str) -> str:
    """Sorted set of the live sessions a client address created (session id -> when it
    stops counting, Redis ms; worker/access.py). The address is hashed: a key name holds
    no client address, and the tag holds no brace whatever the address text is."""
    digest = hashlib.sha256(address.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"tr:addr:{{{digest}}}:sessions"


def address_bytes_key(address: str) -> str:
    """The byte window of what a client address wrote (relay.service.budget), beside its
    session set (same hashed tag)."""
    digest = hashlib.sha256(address.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"tr:addr:{{{digest}}}:bytes"


def token_bytes_key(identity: str) -> str:
    """The byte window of what one token wrote (relay.service.budget); ``identity`` is the
    token's (:attr:`relay.protocol.auth.Claims.identity`, as text), hashed like an address."""
    digest = hashlib.sha256(identity.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"tr:tok:{{{digest}}}:bytes"


def control_channel(worker_id: str) -> str:
    """A worker's shard channel for requests about the turns it runs (stop); the worker
    id is its hash tag."""
    return f"tr:ctl:{{{_check_member_id('worker', worker_id)}}}"


def engine_key(engine_id: str) -> str:
    """Per-engine heartbeat hash (worker.routing.control); the engine id is its hash tag."""
    return f"{ENGINES_REGISTRY}:{{{_check_member_id('engine', engine_id)}}}"


def conversation_route_key(digest: str) -> str:
    """The engine a session-less conversation (the OpenAI gateway) was last routed to,
    under a digest of its routing key, so that any worker routes its next request there
    (worker/fronts/base.py); the digest is its hash tag."""
    if not re.fullmatch(r"[0-9a-f]{16,64}", digest):
        raise ValueError("a conversation digest is 16 to 64 hex digits")
    return f"tr:route:{{{digest}}}"
