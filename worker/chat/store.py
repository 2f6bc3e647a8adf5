"""The session store: everything a stateless worker keeps about a session, in Redis.

All keys are built by :mod:`relay.protocol.keys` and share the session's hash slot, so each
operation below is one round trip to one shard (pipelines and Lua stay single-slot):

* ``hist_key(sid)`` list: the chat history, one JSON object per message: ``role``,
  ``content``, and (since turns are numbered in it) ``turn``, ``id`` (the client's
  message id, or ``<sid>-<turn>`` for a reply), ``from`` (the turn's first offset) and,
  on replies, ``to`` (the turn's terminal offset) and ``finish`` (the finish reason;
  ``cancelled``: the reply was stopped and is partial); trimmed to the last
  ``max_messages`` and expiring ``ttl_s`` after the last write. A regenerate or an
  edit drops the messages of the turns it replaces (:meth:`SessionStore.truncate_from`);
* ``key(sid, HIST, "state")`` hash: ``system`` (the session's system prompt, replaced
  when a turn sends one) and ``engine`` (the engine that served the last turn, for the
  cache-affinity metric);
* ``key(sid, LOCK)`` string: the turn that currently generates (``<owner> <json>``),
  with a TTL the turn runner refreshes; one turn at a time per session;
* ``idem_key(sid, k)`` string: ``Idempotency-Key`` -> the 202 body of the turn it
  started and the request's fingerprint (``{"turn", "offset", "session", "fp"}``, kept
  ``idem_ttl_s``, an hour: long enough for any retry, short enough that a client posting
  a fresh key with every turn keeps at most an hour of turns' records per session);
  while that turn is being admitted, ``pending <owner> <fp>`` with the turn lock's TTL:
  a worker that dies between claim and resolve holds the key no longer than its lock,
  and a retry after that starts the turn.

Order of use for one turn: :meth:`SessionStore.claim_idempotency` (when the client sent
a key) -> :meth:`acquire_lock` -> :meth:`load` -> (route, open the generation) ->
:meth:`set_lock_turn` and :meth:`resolve_idempotency` -> ... the lock refreshed about
once a second (by the producer API's turn, which also sees a stop asked of it) ... ->
:meth:`append_exchange` on success -> :meth:`release_lock`.
redis-py errors become :mod:`relay.broker.rediscluster.errors` exceptions here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from redis.asyncio.cluster import RedisCluster

from relay.broker.rediscluster.errors import map_redis_errors
from relay.broker.rediscluster.scripts import LOCK_RELEASE
from relay.producer import lock as turnlock
from relay.producer.lock import LockHolder
from relay.protocol.keys import (
    SESSION_TTL_S,
    KeyKind,
    gone_key,
    hist_key,
    idem_key,
    key,
)

__all__ = ["IDEM_TTL_S", "ConversationView", "History", "LockHolder", "SessionStore", "state_key"]

IDEM_TTL_S: Final = 3600  # how long an Idempotency-Key's record answers a retry

# ARGV: max messages, TTL, max bytes (0: no byte bound), then the messages to append.
# The oldest messages go first past either bound; the newest exchange always stays.
# ARGV: the first turn to drop. Drops every message of that turn and later ones (their
# ``turn`` field; a message without one, from before turns were stored, is kept).
_TRUNCATE_LUA: Final = """
local items = redis.call('LRANGE', KEYS[1], 0, -1)
for i, v in ipairs(items) do
  local ok, m = pcall(cjson.decode, v)
  if ok and type(m) == 'table' and tonumber(m.turn) and tonumber(m.turn) >= tonumber(ARGV[1]) then
    if i == 1 then redis.call('DEL', KEYS[1]) else redis.call('LTRIM', KEYS[1], 0, i - 2) end
    return #items - i + 1
  end
end
return 0
"""

# KEYS: history, meta hash, lock. One read of what a conversation's view needs, at one
# instant: the history, the turn that is open (if any), the last turn and offset, and
# the lock (its value names the turn that holds it).
_VIEW_LUA: Final = """
local m = redis.call('HMGET', KEYS[2], 'open', 'turn', 'offset', 'gen')
return {redis.call('LRANGE', KEYS[1], 0, -1), m[1] or '', m[2] or '0', m[3] or '0',
        redis.call('GET', KEYS[3]) or '', m[4] or ''}
"""

_APPEND_LUA: Final = """
for i = 4, #ARGV do redis.call('RPUSH', KEYS[1], ARGV[i]) end
redis.call('LTRIM', KEYS[1], -tonumber(ARGV[1]), -1)
local maxb = tonumber(ARGV[3])
if maxb > 0 then
  local items = redis.call('LRANGE', KEYS[1], 0, -1)
  local total = 0
  for _, v in ipairs(items) do total = total + #v end
  local drop, keep = 0, #ARGV - 3
  while total > maxb and #items - drop > keep do
    drop = drop + 1
    total = total - #items[drop]
  end
  if drop > 0 then redis.call('LTRIM', KEYS[1], drop, -1) end
end
redis.call('EXPIRE', KEYS[1], ARGV[2])
return redis.call('LLEN', KEYS[1])
"""


def state_key(sid: str) -> str:
    """The per-session hash with the system prompt and the last engine."""
    return key(sid, KeyKind.HIST, "state")


@dataclass(frozen=True, slots=True)
class History:
    """What the prompt is assembled from: ``messages`` (role and content) and, in the
    same order, ``entries`` (every stored field: turn, id, offsets, finish)."""

    system: str | None
    messages: list[dict[str, str]]
    last_engine: str | None
    entries: list[dict[str, Any]] = field(default_factory=list)

    def before(self, turn: int) -> list[dict[str, str]]:
        """The messages of the turns before ``turn`` (what a regenerate or an edit of
        ``turn`` sends to the engine)."""
        return [
            m
            for m, e in zip(self.messages, self.entries, strict=True)
            if not isinstance(e.get("turn"), int) or e["turn"] < turn
        ]

    def last_turn(self) -> int | None:
        """The newest turn with a stored reply, or None."""
        for e in reversed(self.entries):
            if e.get("role") == "assistant" and isinstance(e.get("turn"), int):
                return int(e["turn"])
        return None

    def user_message(self, turn: int) -> dict[str, Any] | None:
        return next(
            (e for e in self.entries if e.get("turn") == turn and e.get("role") == "user"), None
        )

    def turn_of_message(self, message_id: str) -> int | None:
        """The turn of the stored message with id ``message_id`` (user or reply)."""
        for e in self.entries:
            if e.get("id") == message_id and isinstance(e.get("turn"), int):
                return int(e["turn"])
        return None


@dataclass(frozen=True, slots=True)
class ConversationView:
    """The stored conversation and, read at the same instant, the session's state:
    ``open_turn`` (the turn generating, or None), ``last_turn``, ``last_offset``, the
    turn lock's ``holder`` and the generation ``gen``."""

    entries: list[dict[str, Any]]
    open_turn: int | None
    last_turn: int
    last_offset: int
    holder: LockHolder | None
    gen: str  # the session's generation id ("" before its first turn)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class SessionStore:
    """History, turn lock and idempotency records of sessions. Safe to share."""

    def __init__(
        self,
        redis: RedisCluster,
        *,
        max_messages: int = 64,
        max_bytes: int = 0,
        ttl_s: int = SESSION_TTL_S,
        lock_ttl_s: float = 15.0,
        idem_ttl_s: int = IDEM_TTL_S,
    ) -> None:
        if max_messages < 2:
            raise ValueError("max_messages must be >= 2")
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0 (0: no byte bound)")
        self.redis = redis
        self.max_messages = max_messages
        self.max_bytes = max_bytes  # the history's stored size; 0: messages only
        self.ttl_s = ttl_s
        self.lock_ttl_ms = max(1, int(lock_ttl_s * 1000))
        self.idem_ttl_s = idem_ttl_s

    # ---- history -----------------------------------------------------------------------

    async def load(self, sid: str) -> History:
        """The system prompt, the bounded history and the last engine, in one round trip."""
        with map_redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            pipe.lrange(hist_key(sid), 0, -1)
            pipe.hgetall(state_key(sid))
            raw_hist, raw_state = await pipe.execute()
        entries = _entries(raw_hist)
        messages = [{"role": str(e.get("role", "user")), "content": e["content"]} for e in entries]
        state = {_s(k): _s(v) for k, v in raw_state.items()}
        return History(state.get("system") or None, messages, state.get("engine") or None, entries)

    async def gone(self, sid: str) -> bool:
        """Whether the session was deleted (its tombstone, ``gone_key``, is there)."""
        with map_redis_errors():
            return bool(await self.redis.exists(gone_key(sid)))

    async def truncate_from(self, sid: str, turn: int) -> int:
        """Drop the messages of ``turn`` and every later turn (a regenerate or an edit
        replaces them); return how many went."""
        with map_redis_errors():
            return int(await self.redis.eval(_TRUNCATE_LUA, 1, hist_key(sid), turn))

    async def view(self, sid: str) -> ConversationView:
        """The history and the session's turn state, read in one script (one instant)."""
        keys = (hist_key(sid), key(sid, KeyKind.META), key(sid, KeyKind.LOCK))
        with map_redis_errors():
            raw = await self.redis.eval(_VIEW_LUA, 3, *keys)
        hist, opened, turn, offset, lock, gen = raw
        holder = turnlock.parse_lock(_s(lock)) if lock else None
        open_turn = int(_s(opened)) if opened else None
        return ConversationView(
            _entries(hist), open_turn, int(_s(turn)), int(_s(offset)), holder, _s(gen)
        )

    async def save_system(self, sid: str, system: str) -> None:
        with map_redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            pipe.hset(state_key(sid), "system", system)
            pipe.expire(state_key(sid), self.ttl_s)
            await pipe.execute()

    async def append_exchange(
        self, sid: str, messages: Sequence[Mapping[str, Any]], engine: str | None
    ) -> None:
        """Append messages (the user's and the assistant's) and remember the engine. The
        oldest messages are dropped past ``max_messages`` or ``max_bytes`` (stored JSON);
        the appended exchange itself always stays."""
        args: list[Any] = [self.max_messages, self.ttl_s, self.max_bytes]
        args += [json.dumps(dict(m)) for m in messages]
        with map_redis_errors():
            await self.redis.eval(_APPEND_LUA, 1, hist_key(sid), *args)
            if engine is not None:
                pipe = self.redis.pipeline(transaction=False)
                pipe.hset(state_key(sid), "engine", engine)
                pipe.expire(state_key(sid), self.ttl_s)
                await pipe.execute()

    # ---- the turn lock -------------------------------------------------------------------

    async def acquire_lock(self, sid: str, owner: str) -> LockHolder | None:
        """Take the session's turn lock; ``None`` on success, else the current holder."""
        return await turnlock.acquire(self.redis, sid, owner, self.lock_ttl_ms)

    async def set_lock_turn(self, sid: str, owner: str, turn: int, offset: int) -> bool:
        """Name the turn in our lock; False if another owner holds it. A lock that
        expired during a slow admission (nobody took it) is taken again: the generation
        just opened fences every older producer anyway."""
        return await turnlock.name_turn(self.redis, sid, owner, self.lock_ttl_ms, turn, offset)

    async def refresh_lock(self, sid: str, owner: str) -> bool:
        """Extend the lock's TTL; False if it is no longer ours."""
        with map_redis_errors():
            state = await turnlock.refresh(self.redis, sid, owner, self.lock_ttl_ms, 0)
        return state is not turnlock.LockState.LOST

    async def release_lock(self, sid: str, owner: str) -> bool:
        return await turnlock.release(self.redis, sid, owner)

    # ---- idempotency ---------------------------------------------------------------------

    async def claim_idempotency(
        self, sid: str, idem: str, owner: str, fp: str = ""
    ) -> dict[str, Any] | str | None:
        """SET NX a pending record (expiring with the turn lock's TTL). ``None``: claimed,
        go ahead; a dict: the stored 202 body of the turn this key already started;
        ``"pending"``: another request with this key is being admitted right now;
        ``"reused"``: the key was used with another request (fingerprint ``fp``)."""
        k = idem_key(sid, idem)
        for _ in range(3):  # the record may expire between SET NX and GET
            with map_redis_errors():
                ok = await self.redis.set(k, f"pending {owner} {fp}", nx=True, px=self.lock_ttl_ms)
                if ok:
                    return None
                cur = await self.redis.get(k)
            if cur is not None:
                return _idem_state(_s(cur), owner, fp)
        return "pending"

    async def resolve_idempotency(
        self, sid: str, idem: str, body: Mapping[str, Any], fp: str = ""
    ) -> None:
        record = json.dumps({**dict(body), "fp": fp})
        with map_redis_errors():
            await self.redis.set(idem_key(sid, idem), record, ex=self.idem_ttl_s)

    async def drop_idempotency(self, sid: str, idem: str, owner: str) -> None:
        """Forget a pending claim (the turn was not admitted: 409, 429, 503)."""
        with map_redis_errors():
            await self.redis.eval(LOCK_RELEASE.source, 1, idem_key(sid, idem), f"pending {owner} ")


def _idem_state(text: str, owner: str, fp: str) -> dict[str, Any] | str | None:
    """What a stored Idempotency-Key record means for a request (see claim_idempotency)."""
    if text.startswith("pending "):
        _, who, theirs = [*text.split(" ", 2), ""][:3]
        if theirs and fp and theirs != fp:
            return "reused"
        return None if who == owner else "pending"  # ours: the SET was sent again
    try:
        body = json.loads(text)
    except ValueError:
        return "pending"
    if not isinstance(body, dict):
        return "pending"
    theirs = body.pop("fp", "")
    if theirs and fp and theirs != fp:
        return "reused"
    return body


def _entries(raw: list[Any]) -> list[dict[str, Any]]:
    """The stored messages that decode (``role``, ``content`` and whatever else is kept)."""
    out: list[dict[str, Any]] = []
    for item in raw:
        try:
            m = json.loads(item)
        except ValueError:
            continue
        if isinstance(m, dict) and isinstance(m.get("content"), str):
            m.setdefault("role", "user")
            out.append(m)
    return out
