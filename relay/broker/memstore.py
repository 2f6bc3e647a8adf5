"""The store port (:mod:`relay.broker.port`) in this process's memory: the
:class:`relay.broker.memory.MemoryBroker` (the edge's side) grown by the write side, so a
producer, the worker's sessions, Durable Streams and records run with no server, under
the rules the Redis store's scripts keep (tests/contract runs both against one suite).

Records with a lifetime (locks, idempotency keys, stop records, job records, histories)
expire by ``clock`` (monotonic seconds; a test passes its own to make time pass).

Order of use::

    store = MemoryStore()                 # also the Broker a Hub reads from
    holder = await store.acquire_lock(sid, owner, ttl_ms)
    gen = await store.open_generation(sid); await gen.publish([Draft(kind="meta", ...)])
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from relay.broker.base import SUPERSEDED, SUPERSEDED_TEXT, ReapResult, ReapStatus
from relay.broker.errors import Fenced, OffsetConflict
from relay.broker.memory import MemoryBroker
from relay.broker.memstreams import MemoryStreams
from relay.broker.port import (
    Draft,
    LockHolder,
    LockState,
    SessionState,
    encode_drafts,
    lock_value,
    parse_lock,
)
from relay.protocol.frame import Frame, encode, now_ms
from relay.protocol.keys import (
    BACKLOG_MAX_BYTES,
    BACKLOG_MAXLEN,
    OWNER_FIELD,
    SESSION_TTL_S,
    KeyKind,
    key,
    owner_key,
    parse_session,
)
from relay.service.supervise import Supervisor

__all__ = ["MemoryGeneration", "MemoryStore"]

Observer = Callable[[int, str, bytes], None]
_V = TypeVar("_V")


@dataclass(slots=True)
class MemoryGeneration:
    """A fenced generation of a :class:`MemoryStore` session (see
    :class:`relay.broker.port.TurnWriter`)."""

    store: MemoryStore
    session: str
    epoch: int
    turn: int
    offset: int
    gen: str
    observers: list[Observer] = field(default_factory=list)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def next_offset(self) -> int:
        return self.offset + 1

    async def publish(self, drafts: Sequence[Draft]) -> list[int]:
        if not drafts:
            return []
        async with self._lock:
            base = self.offset
            payload = encode_drafts(
                drafts, session=self.session, turn=self.turn, epoch=self.epoch, gen=self.gen,
                base=base, ts=now_ms(),
            )  # fmt: skip
            last = self.store._append(self, base, payload, drafts[-1].kind in ("done", "error"))
            self.offset = last
            for obs in self.observers:
                for i, data in enumerate(payload):
                    obs(base + i + 1, drafts[i].kind, data)
            return list(range(base + 1, last + 1))

    async def token(self, text: str) -> int:
        return (await self.publish([Draft(kind="token", text=text)]))[0]

    async def done(self, meta: Mapping[str, object] | None = None) -> int:
        return (await self.publish([Draft(kind="done", meta=dict(meta) if meta else None)]))[0]

    async def error(self, reason: str) -> int:
        return (await self.publish([Draft(kind="error", text=reason)]))[0]


class MemoryStore(MemoryStreams, MemoryBroker):
    """Every Protocol of the port, in memory (see the module docstring)."""

    def __init__(
        self,
        relay_id: str = "memory",
        *,
        maxlen: int = BACKLOG_MAXLEN,
        max_bytes: int = BACKLOG_MAX_BYTES,
        ttl_s: int = SESSION_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        MemoryBroker.__init__(self, relay_id, maxlen=maxlen, max_bytes=max_bytes)
        MemoryStreams.__init__(self, clock)
        self.ttl_s = ttl_s
        self.clock = clock
        # key -> (value, expires at by clock, None: never)
        self._kv: dict[str, tuple[str, float | None]] = {}
        self._hashes: dict[str, tuple[dict[str, str], float | None]] = {}
        self._lists: dict[str, list[str]] = {}
        self._slots: dict[str, dict[str, float]] = {}  # key -> member -> counts until
        self._listeners: dict[str, Callable[[bytes], None]] = {}
        self._members: dict[str, dict[str, float]] = {}  # registry -> member -> last seen

    @property
    def streams(self) -> MemoryStore:
        """Durable Streams in the same memory (:class:`relay.broker.port.StreamsBroker`)."""
        return self

    async def response_head(self, sid: str, offset: int) -> tuple[str, bytes | None]:
        self._check()
        self._exists(sid)
        owner = (self._hash(owner_key(sid)) or {}).get(OWNER_FIELD, "")
        s = self.sessions.get(sid)
        frame = next((d for o, d in s.log if o == offset), None) if s is not None else None
        return owner, frame

    async def session_owner(self, sid: str) -> tuple[str, bool]:
        self._check()
        return (self._hash(owner_key(sid)) or {}).get(OWNER_FIELD, ""), sid in self.tombstones

    # ---- messages (one listener per channel) -------------------------------------------

    def messages(self, name: str) -> MemoryStore:
        """This store itself (its messages need nothing opened)."""
        return self

    async def send(self, channel: str, body: bytes) -> None:
        self._check()
        handler = self._listeners.get(channel)
        if handler is not None:
            asyncio.get_running_loop().call_soon(handler, body)

    async def listen(
        self, channel: str, handler: Callable[[bytes], None], supervisor: Supervisor
    ) -> None:
        self._listeners[channel] = handler

    async def unlisten(self) -> None:
        self._listeners.clear()

    # ---- lifetimes ----------------------------------------------------------------------

    def _at(self, ttl_s: float | None) -> float | None:
        return None if ttl_s is None else self.clock() + ttl_s

    def _live(self, table: dict[str, tuple[_V, float | None]], k: str) -> _V | None:
        """``table[k]``'s value while it has not expired (an expired one is dropped)."""
        item = table.get(k)
        if item is None:
            return None
        if item[1] is not None and item[1] <= self.clock():
            del table[k]
            return None
        return item[0]

    def _value(self, k: str) -> str | None:
        return self._live(self._kv, k)

    def _hash(self, k: str) -> dict[str, str] | None:
        return self._live(self._hashes, k)

    def _set_hash(self, k: str, values: dict[str, str], ttl_s: float | None) -> None:
        self._hashes[k] = (values, self._at(ttl_s))

    # ---- turns --------------------------------------------------------------------------

    async def open_generation(self, sid: str) -> MemoryGeneration:
        self._check()
        sid = parse_session(sid)
        s = self._session(sid)
        s.epoch += 1
        s.turn += 1
        if s.open:  # the open script's rule: a turn still open ends, fenced, superseded
            meta = {"code": SUPERSEDED, "by_turn": s.turn, "gen": s.gen}
            ended = Frame(session=sid, turn=s.open, offset=s.offset + 1, kind="error",
                          text=SUPERSEDED_TEXT, epoch=s.epoch, ts=now_ms(), meta=meta)  # fmt: skip
            self._write(s, sid, ended.offset, encode(ended))
        s.open = s.turn
        return MemoryGeneration(self, sid, s.epoch, s.turn, s.offset, s.gen)

    def _append(self, g: MemoryGeneration, base: int, payload: list[bytes], terminal: bool) -> int:
        """The publish script's rules: fenced by epoch and generation, then the offset."""
        self._check()
        s = self.sessions.get(g.session)
        if s is None:  # the keys expired or were deleted: what a restored hash finds
            s = self._session(g.session)
            s.gen = g.gen
        if s.epoch > g.epoch or s.gen != g.gen:
            raise Fenced(g.session, g.epoch, s.epoch)
        if s.offset != base:
            raise OffsetConflict(g.session, base, s.offset)
        if s.epoch < g.epoch:  # what a failover lost: restored
            s.epoch, s.open, s.turn = g.epoch, g.turn, max(s.turn, g.turn)
        for i, data in enumerate(payload):
            self._write(s, g.session, base + i + 1, data)
        if terminal:
            s.open = 0
        return base + len(payload)

    async def reap(self, sid: str) -> ReapResult:
        s = self.sessions.get(sid)
        if s is not None:
            s.locked = self._value(key(sid, KeyKind.LOCK)) is not None
        result = await super().reap(sid)
        if result.status is ReapStatus.REAPED and s is not None:
            s.epoch += 1  # the dead producer, should it wake up, is fenced
        return result

    async def acquire_lock(self, sid: str, owner: str, ttl_ms: int) -> LockHolder | None:
        self._check()
        lk = key(sid, KeyKind.LOCK)
        cur = self._value(lk)
        if cur is None:
            self._kv[lk] = (lock_value(owner, 0, 0), self._at(ttl_ms / 1000))
            return None
        return None if cur.startswith(owner + " ") else parse_lock(cur)

    async def name_turn(self, sid: str, owner: str, ttl_ms: int, turn: int, offset: int) -> bool:
        self._check()
        lk = key(sid, KeyKind.LOCK)
        cur = self._value(lk)
        if cur is not None and not cur.startswith(owner + " "):
            return False
        self._kv[lk] = (lock_value(owner, turn, offset), self._at(ttl_ms / 1000))
        return True

    async def refresh_lock(self, sid: str, owner: str, ttl_ms: int, turn: int) -> LockState:
        self._check()
        lk = key(sid, KeyKind.LOCK)
        cur = self._value(lk)
        if cur is None or not cur.startswith(owner + " "):
            return LockState.LOST
        self._kv[lk] = (cur, self._at(ttl_ms / 1000))
        stops = self._hash(key(sid, KeyKind.CANCEL)) or {}
        return LockState.STOP_ASKED if stops.get(str(turn)) == "asked" else LockState.HELD

    async def release_lock(self, sid: str, owner: str) -> bool:
        return await self.release(key(sid, KeyKind.LOCK), owner + " ")

    async def mark_stopped(self, sid: str, turn: int, offset: int, ttl_s: int) -> None:
        self._check()
        k = key(sid, KeyKind.CANCEL)
        self._set_hash(k, {**(self._hash(k) or {}), str(turn): str(offset)}, ttl_s)

    async def viewers(self, sid: str) -> int:
        self._check()
        return int(sid in self.presence) + len(self.live_peers.get(sid, ()))

    async def lock_holder(self, sid: str) -> LockHolder | None:
        self._check()
        cur = self._value(key(sid, KeyKind.LOCK))
        return None if cur is None else parse_lock(cur)

    async def ask_stop(self, sid: str, turn: int, ttl_s: int) -> tuple[str, int, str]:
        self._check()
        s = self.sessions.get(sid)
        opened, last = (s.open, s.turn) if s is not None else (0, 0)
        lock = self._value(key(sid, KeyKind.LOCK)) or ""
        want = turn
        if want == 0:
            if opened:
                want = opened
            elif lock:
                return "admitting", 0, lock
            else:
                return "idle", last, ""
        if want > last:
            return "unknown", want, ""
        k = key(sid, KeyKind.CANCEL)
        stops = self._hash(k) or {}
        rec = stops.get(str(want))
        if rec is not None and rec != "asked":
            return "stopped", want, rec
        if opened == want:
            self._set_hash(k, {**stops, str(want): "asked"}, ttl_s)
            return "stopping", want, lock
        return "finished", want, ""

    # ---- the registry of live members ------------------------------------------------------

    async def join(self, registry: str, member: str, now_s: float, forget_s: float) -> list[str]:
        self._check()
        seen = self._members.setdefault(registry, {})
        seen[member] = now_s
        for m in [m for m, at in seen.items() if at <= now_s - forget_s]:
            del seen[m]
        return sorted(seen, key=lambda m: (seen[m], m))

    async def members_since(self, registry: str, since: float) -> list[str]:
        self._check()
        seen = self._members.get(registry, {})
        return sorted((m for m in seen if seen[m] >= since), key=lambda m: (seen[m], m))

    async def reports(self, keys: Sequence[str]) -> list[dict[str, str]]:
        self._check()
        return [dict(self._hash(k) or {}) for k in keys]

    async def report(self, key: str, fields: Mapping[str, str], ttl_ms: int) -> None:
        self._check()
        self._set_hash(key, {**(self._hash(key) or {}), **fields}, ttl_ms / 1000)

    async def leave(self, registry: str, member: str, key: str) -> None:
        self._check()
        self._hashes.pop(key, None)
        self._members.get(registry, {}).pop(member, None)

    # ---- sessions -----------------------------------------------------------------------

    def _history(self, sid: str) -> list[str]:
        if self._value(key(sid, KeyKind.HIST)) is None:  # the history's lifetime
            self._lists.pop(sid, None)
        return self._lists.get(sid, [])

    async def history(self, sid: str) -> tuple[list[str], dict[str, str]]:
        self._check()
        state = self._hash(key(sid, KeyKind.HIST, "state")) or {}
        return list(self._history(sid)), dict(state)

    async def session_state(self, sid: str) -> SessionState:
        self._check()
        s = self.sessions.get(sid)
        lock = self._value(key(sid, KeyKind.LOCK)) or ""
        if s is None:
            return SessionState(list(self._history(sid)), "", 0, 0, lock, "")
        opened = str(s.open) if s.open else ""
        return SessionState(list(self._history(sid)), opened, s.turn, s.offset, lock, s.gen)

    async def append_history(
        self, sid: str, messages: Sequence[str], *, max_messages: int, max_bytes: int,
        ttl_s: int,
    ) -> int:  # fmt: skip
        self._check()
        items = [*self._history(sid), *messages][-max_messages:]
        if max_bytes > 0:
            total = sum(len(m.encode()) for m in items)
            while total > max_bytes and len(items) > len(messages):
                total -= len(items.pop(0).encode())
        self._lists[sid] = items
        self._kv[key(sid, KeyKind.HIST)] = ("1", self._at(ttl_s))
        return len(items)

    async def truncate_history(self, sid: str, turn: int) -> int:
        self._check()
        import json

        items = self._history(sid)
        for i, raw in enumerate(items):
            try:
                m = json.loads(raw)
            except ValueError:
                continue
            t = m.get("turn") if isinstance(m, dict) else None
            if isinstance(t, (int, float)) and not isinstance(t, bool) and t >= turn:
                self._lists[sid] = items[:i]
                return len(items) - i
        return 0

    async def set_state(self, sid: str, field: str, value: str, ttl_s: int) -> None:
        self._check()
        k = key(sid, KeyKind.HIST, "state")
        self._set_hash(k, {**(self._hash(k) or {}), field: value}, ttl_s)

    async def gone(self, sid: str) -> bool:
        self._check()
        return sid in self.tombstones

    async def frames_before(self, sid: str, before: int | None, count: int) -> list[bytes]:
        self._check()
        s = self.sessions.get(sid)
        log = [] if s is None else [d for o, d in s.log if before is None or o < before]
        return log[::-1][:count]

    async def delete_session(self, sid: str, tombstone_ttl_s: int) -> int:
        self._check()
        prefix = f"tr:{{{sid}}}:"
        names = [k for k in [*self._kv, *self._hashes] if k.startswith(prefix)]
        for k in names:
            self._kv.pop(k, None)
            self._hashes.pop(k, None)
        removed = len(names) + (sid in self.sessions) + bool(self._lists.pop(sid, None))
        self.delete(sid)  # the backlog and the screen counts, the tombstone, the notice
        return removed

    # ---- records ------------------------------------------------------------------------

    async def claim(self, key: str, value: str, ttl_ms: int) -> str | None:
        self._check()
        cur = self._value(key)
        if cur is None:
            self._kv[key] = (value, self._at(ttl_ms / 1000))
            return None
        return cur

    async def put(self, key: str, value: str, ttl_s: int) -> None:
        self._check()
        self._kv[key] = (value, self._at(ttl_s))

    async def get(self, key: str) -> str | None:
        self._check()
        return self._value(key)

    async def release(self, key: str, prefix: str) -> bool:
        self._check()
        cur = self._value(key)
        if cur is not None and cur.startswith(prefix):
            del self._kv[key]
            return True
        return False

    async def drop(self, key: str) -> None:
        self._check()
        self._kv.pop(key, None)
        self._hashes.pop(key, None)

    async def take_slot(self, key: str, member: str, limit: int, ttl_ms: int) -> int:
        self._check()
        now = self.clock()
        live = {m: at for m, at in self._slots.get(key, {}).items() if at > now}
        if len(live) >= limit:
            self._slots[key] = live
            return max(round((min(live.values()) - now) * 1000), 1000)
        live[member] = now + ttl_ms / 1000
        self._slots[key] = live
        return 0

    async def count(self, key: str, ttl_s: int) -> int:
        self._check()
        n = int(self._value(key) or "0") + 1
        self._kv[key] = (str(n), self._at(ttl_s))
        return n

    async def job_create(self, key: str, fields: Mapping[str, str], ttl_s: int) -> None:
        self._check()
        self._set_hash(key, {**(self._hash(key) or {}), **fields}, ttl_s)

    async def job_start(self, key: str, worker: str, now_ms: int) -> tuple[str, int]:
        self._check()
        rec = self._hash(key)
        if rec is None:
            return "missing", 0
        if rec.get("status") in ("done", "failed"):
            return rec["status"], 0
        n = int(rec.get("attempts", "0")) + 1
        rec.update(attempts=str(n), status="running", worker=worker, updated_ms=str(now_ms))
        return "running", n

    async def job_progress(self, key: str, tokens: int, now_ms: int) -> None:
        self._check()
        rec = self._hash(key)
        if rec is not None and rec.get("status") == "running":
            rec.update(progress_tokens=str(tokens), updated_ms=str(now_ms))

    async def job_finish(self, key: str, fields: Mapping[str, str], ttl_s: int) -> bool:
        self._check()
        rec = self._hash(key)
        if rec is None or rec.get("status") == "done":
            return False
        rec.update(status="done", **fields)
        rec.pop("error", None)
        self._set_hash(key, rec, ttl_s)
        return True

    async def job_fail(self, key: str, reason: str, now_ms: int) -> bool:
        self._check()
        rec = self._hash(key)
        if rec is None or rec.get("status") == "done":
            return False
        rec.update(status="failed", error=reason, updated_ms=str(now_ms))
        return True

    async def job_note(self, key: str, fields: Mapping[str, str]) -> None:
        self._check()
        rec = self._hash(key)
        if rec is not None:
            rec.update(fields)

    async def job_get(self, key: str) -> dict[str, str] | None:
        self._check()
        rec = self._hash(key)
        return dict(rec) if rec else None
