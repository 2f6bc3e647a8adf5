"""The producer: sessions, their tokens, and turns written with the worker's rules.

A turn, as every producer of docs/PROTOCOL.md writes it:

1. **claim** the session's turn lock (:mod:`relay.producer.lock`; a second producer gets
   :class:`TurnBusy`);
2. **open** a fenced generation (the publisher's ``open_generation``: epoch + 1, turn +
   1) and publish the turn's ``meta`` frame (``role`` user, ``message``, ``message_id``
   and the caller's fields), then name the turn in the lock;
3. **write** text deltas: :meth:`Turn.write` never blocks; the turn's pump coalesces
   them (:mod:`relay.producer.coalesce`, the worker's defaults) into ``token`` frames;
   a guard task refreshes the lock about once a second, reads the stop record and
   counts the relays with viewers (:mod:`relay.producer.presence`), and tells the caller
   when the turn was stopped or nobody watches any more (:meth:`Turn.stopped`,
   :meth:`Turn.on_stop`);
4. **end** with exactly one terminal frame: :meth:`Turn.done` (``tokens``, ``chars``,
   ``sha256`` of the reply, usage, ``finish_reason``) or :meth:`Turn.error`; then the
   lock is given back.

A stop (``POST /v1/sessions/{sid}/turns/{turn}/cancel`` on any worker) writes the stop
record ``tr:{sid}:cancel``; the worker's fast notification goes to a worker's control
channel, which a library producer does not read, so a library producer sees the stop at
its next lock refresh (within ``presence.interval_s``, 1 s). Retries are safe: a publish
whose reply was lost is recognised by the publish script's offset check and never
written twice. Bad input raises one type per cause (:mod:`relay.producer.errors`).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from relay.broker.errors import RedisUnavailable, RelayError
from relay.broker.port import Draft, TurnStore, TurnWriter
from relay.broker.rediscluster.publisher import Publisher
from relay.broker.rediscluster.store import RedisStore
from relay.producer.base import (
    LOCK_TTL_S,
    Observer,
    Spawn,
    default_spawn,
)
from relay.producer.coalesce import DEFAULT_POLICY, Batch, CoalescePolicy
from relay.producer.errors import (
    InvalidSession,
    LockLost,
    RedisUnreachable,
    TurnBusy,
)
from relay.producer.integrity import message_meta
from relay.producer.lock import acquire as lock_acquire
from relay.producer.lock import name_turn as lock_name_turn
from relay.producer.lock import release as lock_release
from relay.producer.presence import PresencePolicy
from relay.producer.turn import Turn
from relay.protocol.auth import KeySet, Scope, issue_token
from relay.protocol.keys import (
    BACKLOG_MAXLEN,
    MAX_LOCK_TTL_S,
    PRODUCER_LOST_S,
    SESSION_TTL_S,
    InvalidSessionId,
    parse_session,
)

__all__ = ["Claim", "Producer", "Session"]


class Producer:
    """Opens sessions and their turns on one store (a
    :class:`relay.broker.port.TurnStore`; a Redis Cluster client is wrapped in a
    :class:`relay.broker.rediscluster.store.RedisStore`, on ``publisher`` when given).
    One per process; safe to share between tasks.

    ``keys``: the token key set (or the shared secret) relays verify tokens with, for
    :meth:`Session.token`. ``producer_id`` names this process in lock owners
    (``<producer_id>:<random>``) and in the ``meta`` frame's ``worker``.
    ``coalesce``: the worker's defaults (8 deltas or 50 ms, the first at once);
    ``CoalescePolicy(max_tokens=1)`` writes one frame per delta. ``lock_ttl_s``: the turn
    lock's TTL (:data:`relay.protocol.keys.LOCK_TTL_S`, 5 s, at most 7 s: a turn of a
    producer that died ends with an ``error`` frame on the screens within
    :data:`relay.protocol.keys.PRODUCER_LOST_S`, 10 s; ValueError beyond).
    """

    def __init__(
        self,
        store: TurnStore | Any,
        *,
        keys: KeySet | str | bytes | None = None,
        producer_id: str | None = None,
        ttl_s: int = SESSION_TTL_S,
        maxlen: int = BACKLOG_MAXLEN,
        retry_s: float = 10.0,
        lock_ttl_s: float = LOCK_TTL_S,
        coalesce: CoalescePolicy = DEFAULT_POLICY,
        presence: PresencePolicy | None = None,
        publisher: Publisher | None = None,
        spawn: Spawn | None = None,
    ) -> None:
        if not isinstance(store, TurnStore):  # a cluster client (the API before the port)
            store = RedisStore(store, publisher=publisher, maxlen=maxlen, ttl_s=ttl_s,
                               retry_s=retry_s)  # fmt: skip
        self.store: TurnStore = store
        self.keys = keys
        self.producer_id = producer_id or f"producer-{secrets.token_hex(4)}"
        self.ttl_s = store.ttl_s
        if not 0 < lock_ttl_s <= MAX_LOCK_TTL_S:  # a dead producer's turn ends in the bound
            raise ValueError(f"lock_ttl_s must be in (0, {MAX_LOCK_TTL_S:g}] s: a turn of a "
                             f"dead producer must end within {PRODUCER_LOST_S:g} s")  # fmt: skip
        self.lock_ttl_ms = max(1, int(lock_ttl_s * 1000))
        self.coalesce = coalesce
        self.presence = presence or PresencePolicy()
        self.spawn: Spawn = spawn or default_spawn
        self._owned: RedisStore | None = None

    @classmethod
    async def connect(cls, url: str, **kwargs: Any) -> Producer:
        """A producer on its own cluster client for ``url`` (closed by :meth:`aclose`)."""
        try:
            store = await RedisStore.connect(url)
        except RedisUnavailable as exc:
            raise RedisUnreachable(f"redis unreachable at start: {exc}") from None
        p = cls(store.redis, **kwargs)
        p._owned = store
        return p

    async def aclose(self) -> None:
        if self._owned is not None:
            await self._owned.aclose()

    async def __aenter__(self) -> Producer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def session(self, sid: str | None = None) -> Session:
        """The session ``sid`` (a new random id when None); :class:`InvalidSession` when
        it is not ``[A-Za-z0-9_-]{1,64}``."""
        if sid is None:
            sid = secrets.token_urlsafe(12)
        try:
            sid = parse_session(sid)
        except InvalidSessionId as exc:
            raise InvalidSession(f"invalid session id: {exc}") from None
        return Session(self, sid)


class Session:
    """One session: its tokens and its turns."""

    def __init__(self, producer: Producer, sid: str) -> None:
        self.producer = producer
        self.id = sid

    def token(
        self, *, scope: Scope = "watch", ttl_s: float = 3600, now: float | None = None
    ) -> str:
        """A token a client watches the session with (``scope`` "watch"), signed with the
        producer's key set; at most the session's lifetime."""
        if self.producer.keys is None:
            raise ValueError("the producer has no token keys (Producer(keys=...))")
        ttl = min(ttl_s, self.producer.ttl_s)
        return issue_token(self.producer.keys, self.id, ttl, time.time() if now is None else now,
                           scope=scope)  # fmt: skip

    async def claim(
        self, *, owner: str | None = None, retries: int = 3, retry_s: float = 0.05
    ) -> Claim:
        """Take the session's turn lock (trying ``retries`` more times, ``retry_s`` apart:
        a turn that is ending may hold it for a round trip); :class:`TurnBusy` else."""
        p = self.producer
        owner = owner or f"{p.producer_id}:{uuid.uuid4().hex[:16]}"
        for attempt in range(retries + 1):
            holder = await lock_acquire(p.store, self.id, owner, p.lock_ttl_ms)
            if holder is None:
                return Claim(self, owner)
            if attempt == retries:
                raise TurnBusy(holder)
            await asyncio.sleep(retry_s)
        raise AssertionError("unreachable")

    async def start_turn(
        self,
        message: str = "",
        *,
        message_id: str | None = None,
        meta: Mapping[str, Any] | None = None,
        observers: Sequence[Observer] = (),
        watch: bool = True,
    ) -> Turn:
        """Claim the lock and open a turn (its ``meta`` frame is out when this returns);
        ``watch``: refresh the lock and look for stops and viewers while it runs."""
        claim = await self.claim()
        return await claim.open(
            message, message_id=message_id, meta=meta, observers=observers, watch=watch
        )


class Claim:
    """The session's turn lock, held, before its turn opens."""

    def __init__(self, session: Session, owner: str) -> None:
        self.session = session
        self.owner = owner

    async def release(self) -> None:
        p = self.session.producer
        with contextlib.suppress(RelayError):
            await lock_release(p.store, self.session.id, self.owner)

    async def open(
        self,
        message: str = "",
        *,
        message_id: str | None = None,
        meta: Mapping[str, Any] | None = None,
        observers: Sequence[Observer] = (),
        watch: bool = True,
        on_batch: Callable[[Batch], None] | None = None,
    ) -> Turn:
        """Open the generation, publish the ``meta`` frame, name the turn in the lock.
        A failure gives everything back: an ``error`` frame ends a generation whose
        ``meta`` frame is out, and the lock is released."""
        p, sid = self.session.producer, self.session.id
        t0 = time.monotonic()
        gen: TurnWriter | None = None
        meta_out = False
        try:
            gen = await p.store.open_generation(sid)
            gen.observers.extend(observers)
            # the message bounded (message_meta): the history keeps it whole
            body = {"role": "user", **message_meta(message), "worker": p.producer_id,
                    **(meta or {})}  # fmt: skip
            body["message_id"] = message_id or f"{sid}-{gen.turn}-user"
            first = (await gen.publish([Draft(kind="meta", meta=body)]))[0]
            meta_out = True
            if not await lock_name_turn(p.store, sid, self.owner, p.lock_ttl_ms,
                                        gen.turn, first):  # fmt: skip
                raise LockLost("the turn lock expired while the turn was started")
        except BaseException:
            if gen is not None and meta_out:
                with contextlib.suppress(RelayError):
                    await gen.error("turn failed to start")
            await self.release()
            raise
        turn = Turn(p, sid, self.owner, gen, first, t0, on_batch)
        if watch:
            turn.guard()
        return turn
