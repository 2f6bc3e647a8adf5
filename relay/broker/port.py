"""The store port: everything tokenrelay keeps, said as intents, not as Redis commands.

The relay's edge reads through :class:`relay.broker.base.Broker` (live frames, a page of
the backlog with its generation and the session's tombstone in one answer, seal, reap,
presence and screen counts); everything that writes goes through the Protocols below, so
each rule of the store (a stale generation's append refused, offsets contiguous, one
result per job, ...) is written once per store and tested once for all of them
(tests/contract). Two stores implement it:

- :class:`relay.broker.memstore.MemoryStore`: this process's memory, no server (tests,
  benchmarks of the rules, code that embeds a producer and its readers);
- :class:`relay.broker.rediscluster.store.RedisStore` (with
  :class:`relay.broker.rediscluster.broker.RedisBroker` for the edge): Redis 7 Cluster,
  every write one Lua script of ``relay/broker/rediscluster/lua/`` or
  ``relay/durable/lua/`` (the same files the TypeScript producer runs).

The Protocols, by who uses them:

- :class:`TurnStore` (the producers, :mod:`relay.producer`): the turn lock (acquire,
  name the turn, refresh with the stop record, release), a fenced generation
  (:meth:`TurnStore.open_generation` -> :class:`TurnWriter`, whose
  :meth:`TurnWriter.publish` appends frames at contiguous offsets within the backlog's
  frame and byte bounds, or raises :class:`relay.broker.errors.Fenced`), the stopped
  turn's record, and how many relays have viewers of a session;
- :class:`HistoryStore` (the worker's sessions and fronts): the chat history and the
  session's state, the conversation's view at one instant, the tombstone, the session's
  owner, the backlog's frames read before or after an offset, a session's delete;
- :class:`StreamStore` (Durable Streams, :mod:`relay.durable`; its types are
  :mod:`relay.broker.streams`'s): a stream's write (create, append, close: its producers'
  and Stream-Seq rules), read, delete and the fork references;
- :class:`RecordStore` (idempotency keys, jobs): records claimed once, released by
  their owner only, and the job record's rules (one result per job).

Failures are :class:`relay.broker.errors.RelayError` subclasses, whatever the store.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import msgspec

from relay.broker.base import Broker
from relay.broker.errors import FrameTooLarge
from relay.broker.streams import (
    MESSAGE_OVERHEAD,
    SoftDeleted,
    StreamRef,
    StreamsBroker,
    StreamStore,
    StreamView,
    StreamWrite,
    StreamWriteResult,
    charge,
)
from relay.protocol.frame import MAX_FRAME_BYTES, Frame, Kind, encode
from relay.service.supervise import Supervisor

__all__ = [
    "MESSAGE_OVERHEAD",
    "Draft",
    "EdgeStore",
    "HistoryStore",
    "LockHolder",
    "LockState",
    "Messages",
    "RecordStore",
    "Registry",
    "ResponseReads",
    "SessionState",
    "SoftDeleted",
    "Store",
    "StreamRef",
    "StreamStore",
    "StreamView",
    "StreamWrite",
    "StreamWriteResult",
    "StreamsBroker",
    "TurnStore",
    "TurnWriter",
    "charge",
    "encode_drafts",
    "lock_value",
    "parse_lock",
]

# The edge's read side: the Broker is the store as the edge sees it.
EdgeStore = Broker


# ---- turns -------------------------------------------------------------------------------


class Draft(msgspec.Struct, frozen=True, kw_only=True):
    """What a producer says; the generation fills session, turn, offset, epoch and ts."""

    kind: Kind
    text: str = ""
    meta: dict[str, Any] | None = None


def encode_drafts(
    drafts: Sequence[Draft], *, session: str, turn: int, epoch: int, gen: str, base: int,
    ts: int,
) -> list[bytes]:  # fmt: skip
    """``drafts`` as the frames a generation appends after offset ``base`` (each encoded
    once; ``meta.gen`` in every one); :class:`FrameTooLarge` when one would be past
    :data:`MAX_FRAME_BYTES` (every reader would refuse it: nothing is written)."""
    payload = [
        encode(
            Frame(
                session=session,
                turn=turn,
                offset=base + i + 1,
                kind=d.kind,
                text=d.text,
                epoch=epoch,
                ts=ts,
                meta={**d.meta, "gen": gen} if d.meta else {"gen": gen},
            )
        )
        for i, d in enumerate(drafts)
    ]
    for data in payload:
        if len(data) > MAX_FRAME_BYTES:
            raise FrameTooLarge(session, len(data), MAX_FRAME_BYTES)
    return payload


@dataclass(frozen=True, slots=True)
class LockHolder:
    """Who holds a session's turn lock (``turn``/``offset`` are 0 while it starts)."""

    owner: str
    turn: int
    offset: int


class LockState(enum.IntEnum):
    """What a refresh found."""

    LOST = 0  # the lock is no longer ours
    HELD = 1  # refreshed
    STOP_ASKED = 2  # refreshed, and a stop of the turn was asked


def lock_value(owner: str, turn: int, offset: int) -> str:
    """A turn lock's value: ``<owner> {"turn": N, "offset": M}`` (docs/PROTOCOL.md)."""
    return f"{owner} " + json.dumps({"turn": turn, "offset": offset})


def parse_lock(text: str) -> LockHolder:
    owner, _, rest = text.partition(" ")
    try:
        data = json.loads(rest)
        return LockHolder(owner, int(data.get("turn", 0)), int(data.get("offset", 0)))
    except (ValueError, AttributeError, TypeError):
        return LockHolder(owner, 0, 0)


class TurnWriter(Protocol):
    """One producer's right to append to a session, fenced by ``epoch`` (a turn's
    generation). ``offset`` is the last offset it wrote; the next frame gets
    ``offset + 1``."""

    session: str
    epoch: int
    turn: int
    offset: int
    gen: str
    # (offset, kind, encoded frame) of every frame once the store took it, in order
    observers: list[Callable[[int, str, bytes], None]]

    @property
    def next_offset(self) -> int: ...

    async def publish(self, drafts: Sequence[Draft]) -> list[int]:
        """Append ``drafts`` (backlog and live channel) at the next offsets, at once;
        their offsets. Raises ``Fenced`` (a newer generation exists: nothing written),
        ``FrameTooLarge`` (nothing written), ``OffsetConflict``, ``RedisUnavailable``."""
        ...

    async def error(self, reason: str) -> int: ...


@runtime_checkable
class TurnStore(Protocol):
    """What a producer writes a turn with (see the module docstring)."""

    ttl_s: int  # a session's lifetime after its last write

    async def open_generation(self, sid: str) -> TurnWriter:
        """Epoch + 1 and turn + 1 at once (the turn is open): every older generation of
        the session is fenced from now on."""
        ...

    async def acquire_lock(self, sid: str, owner: str, ttl_ms: int) -> LockHolder | None:
        """Take the session's turn lock; None when taken (also when ours already), else
        who holds it."""
        ...

    async def name_turn(self, sid: str, owner: str, ttl_ms: int, turn: int, offset: int) -> bool:
        """Name the turn in our lock (taken again if it expired and nobody took it);
        False when another owner holds it."""
        ...

    async def refresh_lock(self, sid: str, owner: str, ttl_ms: int, turn: int) -> LockState:
        """Extend our lock and read the stop record of ``turn``, at one instant."""
        ...

    async def release_lock(self, sid: str, owner: str) -> bool:
        """Give the lock back if it is still ours."""
        ...

    async def mark_stopped(self, sid: str, turn: int, offset: int, ttl_s: int) -> None:
        """A stopped turn ended at ``offset``: a later stop of it answers the same."""
        ...

    async def viewers(self, sid: str) -> int:
        """How many relays have viewers of ``sid`` now (their presence has not expired,
        by the store's clock)."""
        ...

    async def lock_holder(self, sid: str) -> LockHolder | None:
        """Who holds the session's turn lock now (None: nobody)."""
        ...

    async def ask_stop(self, sid: str, turn: int, ttl_s: int) -> tuple[str, int, str]:
        """Record a stop of ``turn`` (0: the one generating) at one instant with the
        session's state; what it found: ``stopping`` (marked: the turn's next lock
        refresh sees it; detail: the lock's value), ``admitting`` (no turn open but the
        lock is held; detail: its value), ``stopped`` (it ended stopped; detail: its
        terminal offset), ``finished``, ``unknown`` (no such turn yet), ``idle``
        (nothing runs; the turn is the last one)."""
        ...


@runtime_checkable
class Messages(Protocol):
    """Messages to a named channel (a worker's control channel: a stop asked of a turn
    it runs): delivered at most once, in order per channel, to whoever listens then."""

    async def send(self, channel: str, body: bytes) -> None: ...

    async def listen(
        self, channel: str, handler: Callable[[bytes], None], supervisor: Supervisor
    ) -> None:
        """Hand every message of ``channel`` to ``handler`` (in the store's reader: it
        must not block) from when this returns; its loops run on ``supervisor``."""
        ...

    async def unlisten(self) -> None:
        """Stop listening (and close what listening opened)."""
        ...


@runtime_checkable
class Registry(Protocol):
    """The live members of a group, each with a report that expires by itself (the
    workers' load reports: a worker that dies drops out within the report's TTL)."""

    async def join(self, registry: str, member: str, now_s: float, forget_s: float) -> list[str]:
        """``member`` is live at ``now_s`` (the wall clock, which every member shares, in
        the unit the registry's users agree on); a member not seen for ``forget_s`` is
        forgotten; every member, at one instant."""
        ...

    async def members_since(self, registry: str, since: float) -> list[str]:
        """The members seen at ``since`` or later (nothing forgotten, nothing written)."""
        ...

    async def reports(self, keys: Sequence[str]) -> list[dict[str, str]]:
        """Each key's report (an empty one when it expired or never was)."""
        ...

    async def report(self, key: str, fields: Mapping[str, str], ttl_ms: int) -> None:
        """Write ``fields`` into the report ``key``, which expires ``ttl_ms`` from now."""
        ...

    async def leave(self, registry: str, member: str, key: str) -> None:
        """``member`` leaves at once, its report with it."""
        ...


# ---- sessions ---------------------------------------------------------------------------


class SessionState(NamedTuple):
    """A session read at one instant: its history (one JSON message per entry), the turn
    that is open ("" for none), the last turn and offset, the turn lock's value ("" for
    none), the generation id ("" before its first turn)."""

    history: list[str]
    open: str
    turn: int
    offset: int
    lock: str
    gen: str


@runtime_checkable
class HistoryStore(Protocol):
    """A chat session's history, state and lifetime."""

    async def history(self, sid: str) -> tuple[list[str], dict[str, str]]:
        """The stored messages (JSON, oldest first) and the session's state fields."""
        ...

    async def session_state(self, sid: str) -> SessionState:
        """The history and the turn state at one instant (see :class:`SessionState`)."""
        ...

    async def append_history(
        self, sid: str, messages: Sequence[str], *, max_messages: int, max_bytes: int,
        ttl_s: int,
    ) -> int:  # fmt: skip
        """Append ``messages``; the oldest go past ``max_messages`` or ``max_bytes`` (0:
        no byte bound) but never the ones appended; the history lives ``ttl_s`` from
        now. Its length."""
        ...

    async def truncate_history(self, sid: str, turn: int) -> int:
        """Drop the messages of ``turn`` and later turns; how many went."""
        ...

    async def set_state(self, sid: str, field: str, value: str, ttl_s: int) -> None:
        """One field of the session's state (the system prompt, the last engine)."""
        ...

    async def gone(self, sid: str) -> bool:
        """Whether the session was deleted (its tombstone is there)."""
        ...

    async def frames_before(self, sid: str, before: int | None, count: int) -> list[bytes]:
        """Up to ``count`` of the backlog's frames below offset ``before`` (None: from the
        newest), newest first (a turn's end or start found walking back)."""
        ...

    async def frames_after(
        self, sid: str, after: int, count: int, *, block_ms: int = 0
    ) -> list[bytes]:
        """Up to ``count`` of the backlog's frames above offset ``after``, oldest first;
        when there is none, wait up to ``block_ms`` (0: not at all) for the first ones
        written (a reader following the backlog). An empty list: none yet."""
        ...

    async def session_owner(self, sid: str) -> tuple[str, bool]:
        """The session's API owner tag (:data:`relay.protocol.keys.OWNER_FIELD` of its
        state, "" for none) and whether it was deleted (its tombstone), in one answer."""
        ...

    async def delete_session(self, sid: str, tombstone_ttl_s: int) -> int:
        """Every record of ``sid`` gone (backlog, history, lock, records), its tombstone
        set for ``tombstone_ttl_s`` and :func:`relay.protocol.frame.deleted_frame` sent
        on its live channel, at one instant; how many records went."""
        ...


# ---- records ----------------------------------------------------------------------------


@runtime_checkable
class RecordStore(Protocol):
    """Small records with a lifetime: idempotency keys and job records."""

    async def claim(self, key: str, value: str, ttl_ms: int) -> str | None:
        """Set ``key`` to ``value`` unless it exists: None when set, else its value
        ("" when it expired between the two steps: claim again)."""
        ...

    async def put(self, key: str, value: str, ttl_s: int) -> None: ...

    async def get(self, key: str) -> str | None: ...

    async def release(self, key: str, prefix: str) -> bool:
        """Delete ``key`` when its value starts with ``prefix`` (its owner's)."""
        ...

    async def drop(self, key: str) -> None:
        """Delete ``key`` (a record or a job record), whoever holds it."""
        ...

    async def take_slot(self, key: str, member: str, limit: int, ttl_ms: int) -> int:
        """Count ``member`` in ``key``'s set for ``ttl_ms`` (by the store's clock) unless
        ``limit`` members count already: 0 when taken, else the milliseconds until the
        oldest stops counting (at least 1000)."""
        ...

    async def count(self, key: str, ttl_s: int) -> int:
        """One more in the counter ``key`` (which lives ``ttl_s`` from now); its count."""
        ...

    async def job_create(self, key: str, fields: Mapping[str, str], ttl_s: int) -> None:
        """A fresh job record (``status`` among ``fields``)."""
        ...

    async def job_start(self, key: str, worker: str, now_ms: int) -> tuple[str, int]:
        """``running`` and the delivery's attempt number, unless the job is ``done`` or
        ``failed`` (that status, 0) or ``missing``."""
        ...

    async def job_progress(self, key: str, tokens: int, now_ms: int) -> None:
        """Tokens so far, only while ``running``."""
        ...

    async def job_finish(self, key: str, fields: Mapping[str, str], ttl_s: int) -> bool:
        """``done`` with the result's fields unless a result is stored (False)."""
        ...

    async def job_fail(self, key: str, reason: str, now_ms: int) -> bool:
        """``failed`` with the reason, unless ``done`` or missing (False)."""
        ...

    async def job_note(self, key: str, fields: Mapping[str, str]) -> None:
        """Extra fields on a record that exists."""
        ...

    async def job_get(self, key: str) -> dict[str, str] | None: ...


@runtime_checkable
class ResponseReads(Protocol):
    """What the Responses API's resume reads of a session at one instant."""

    async def response_head(self, sid: str, offset: int) -> tuple[str, bytes | None]:
        """The session's API owner tag (:data:`relay.protocol.keys.OWNER_FIELD` of
        its state hash, "" for none) and the frame at ``offset`` (None: not held).
        Raises ``SessionDeleted`` when the session was deleted."""
        ...


@runtime_checkable
class Store(TurnStore, HistoryStore, RecordStore, Registry, StreamStore, Protocol):
    """Every write side at once (both stores implement all of it), with what a process
    holding one store asks of it besides."""

    async def ping(self) -> None:
        """Answer when the store does (readiness); ``RedisUnavailable`` when not."""
        ...

    def messages(self, name: str) -> Messages:
        """Messages on this store; ``name`` names what listening opens (its
        connections, its logs)."""
        ...
