"""The store port (:mod:`relay.broker.port`) on a Redis 7 Cluster: turns, sessions and
records (Durable Streams: :mod:`relay.broker.rediscluster.streams`).

Every key of a session is built by :mod:`relay.protocol.keys` and shares the session's
hash slot, so each call below is one round trip to one shard. The turn's writes are the
scripts of ``lua/`` (the ones the TypeScript producer runs: ``open``, ``publish``,
``lock_*``, ``stopped``, ``presence_count``) through
:class:`relay.broker.rediscluster.publisher.Publisher`; the history's and the job
record's rules are the short scripts below (one slot each). redis-py errors become
:class:`relay.broker.errors.RelayError` here (:func:`map_redis_errors`).

Order of use::

    store = RedisStore(redis, maxlen=..., ttl_s=...)   # or RedisStore(redis, publisher=pub)
    holder = await store.acquire_lock(sid, owner, ttl_ms)
    gen = await store.open_generation(sid); await gen.publish([Draft(kind="meta", ...)])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from redis.asyncio.cluster import RedisCluster

from relay.broker.errors import RedisUnavailable
from relay.broker.port import LockHolder, LockState, SessionState, lock_value, parse_lock
from relay.broker.rediscluster.connect import RedisTLS, connect
from relay.broker.rediscluster.errors import map_redis_errors
from relay.broker.rediscluster.messages import RedisMessages
from relay.broker.rediscluster.presence import count_present
from relay.broker.rediscluster.publisher import Generation, Publisher
from relay.broker.rediscluster.scripts import LOCK_NAME, LOCK_REFRESH, LOCK_RELEASE, STOPPED
from relay.broker.rediscluster.streams import RedisStreams
from relay.protocol.frame import deleted_frame, encode
from relay.protocol.keys import (
    BACKLOG_MAX_BYTES,
    BACKLOG_MAXLEN,
    OWNER_FIELD,
    SESSION_TTL_S,
    KeyKind,
    cancel_key,
    gone_key,
    hist_key,
    key,
    live_channel,
    log_key,
)
from relay.protocol.slotmap import slot_of

__all__ = ["RedisStore", "state_key"]

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

# ARGV: max messages, TTL, max bytes (0: no byte bound), then the messages to append.
# The oldest messages go first past either bound; the newest exchange always stays.
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

# KEYS: the tombstone, the live channel, then every key of the session. ARGV: the
# tombstone's TTL (s), the deleted frame. Deletes the keys, sets the tombstone and tells
# the relays, in one step on the session's slot.
_DELETE_LUA: Final = """
for i = 3, #KEYS do redis.call('DEL', KEYS[i]) end
redis.call('SET', KEYS[1], '1', 'EX', ARGV[1])
redis.call('SPUBLISH', KEYS[2], ARGV[2])
return #KEYS - 2
"""

# KEYS: meta hash, lock, cancel hash. ARGV: the turn (0: whichever runs), the record's
# TTL (s). Returns {status, turn, detail}: detail is the lock's value (stopping,
# admitting), the terminal offset (stopped) or ''.
_STOP_LUA: Final = """
local m = redis.call('HMGET', KEYS[1], 'open', 'turn')
local open, last = tonumber(m[1] or ''), tonumber(m[2] or '0')
local lock = redis.call('GET', KEYS[2]) or ''
local want = tonumber(ARGV[1])
if want == 0 then
  if open then want = open
  elseif lock ~= '' then return {'admitting', 0, lock}
  else return {'idle', last, ''} end
end
if want > last then return {'unknown', want, ''} end
local rec = redis.call('HGET', KEYS[3], tostring(want))
if rec and rec ~= 'asked' then return {'stopped', want, rec} end
if open == want then
  redis.call('HSET', KEYS[3], tostring(want), 'asked')
  redis.call('EXPIRE', KEYS[3], ARGV[2])
  return {'stopping', want, lock}
end
return {'finished', want, ''}
"""

# One key's counted members (member -> when it stops counting, Redis ms): drop the
# expired, refuse past ARGV[1] (answering the wait for the oldest), else add ARGV[3] for
# ARGV[2] ms. Returns {1, 0} or {0, wait_ms}.
_TAKE_SLOT: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return {0, math.max(tonumber(oldest[2]) - now, 1000)}
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {1, 0}
"""

# The job record's rules (worker/jobs/record.py says them): one result per job.
_JOB_CREATE: Final = """
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""
_JOB_START: Final = """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return {'missing', 0} end
if st == 'done' or st == 'failed' then return {st, 0} end
local n = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
redis.call('HSET', KEYS[1], 'status', 'running', 'worker', ARGV[1], 'updated_ms', ARGV[2])
return {'running', n}
"""
_JOB_PROGRESS: Final = """
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then return 0 end
redis.call('HSET', KEYS[1], 'progress_tokens', ARGV[1], 'updated_ms', ARGV[2])
return 1
"""
_JOB_FINISH: Final = """
local st = redis.call('HGET', KEYS[1], 'status')
if not st or st == 'done' then return 0 end
redis.call('HSET', KEYS[1], 'status', 'done', unpack(ARGV, 2))
redis.call('HDEL', KEYS[1], 'error')
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""
_JOB_FAIL: Final = """
local st = redis.call('HGET', KEYS[1], 'status')
if not st or st == 'done' then return 0 end
redis.call('HSET', KEYS[1], 'status', 'failed', 'error', ARGV[1], 'updated_ms', ARGV[2])
return 1
"""
_JOB_NOTE: Final = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""


def state_key(sid: str) -> str:
    """The per-session hash with the system prompt and the last engine."""
    return key(sid, KeyKind.HIST, "state")


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _flat(fields: Mapping[str, str]) -> list[str]:
    return [x for k, v in fields.items() for x in (k, v)]


class RedisStore(RedisStreams):
    """The write side of the port on a Redis Cluster (see the module docstring).
    ``publisher``: the one whose settings (backlog bounds, TTL, retries) the turns use;
    a new one from ``maxlen``/``ttl_s``/``retry_s``/``max_bytes`` when None."""

    def __init__(
        self,
        redis: RedisCluster,
        *,
        publisher: Publisher | None = None,
        maxlen: int = BACKLOG_MAXLEN,
        ttl_s: int = SESSION_TTL_S,
        retry_s: float = 10.0,
        max_bytes: int = BACKLOG_MAX_BYTES,
    ) -> None:
        super().__init__(redis)
        self.publisher = publisher or Publisher(
            redis, maxlen=maxlen, ttl_s=ttl_s, retry_s=retry_s, max_bytes=max_bytes
        )
        self.ttl_s = self.publisher.ttl_s

    @classmethod
    def at(cls, url: str, tls: RedisTLS | None, timeout_s: float | None, **kw: Any) -> RedisStore:
        """A store on its own cluster client for ``url``, not reached yet (:meth:`reach`;
        closed by :meth:`aclose`); ``timeout_s`` bounds each connect and each reply."""
        client = connect(url, tls=tls, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        return cls(client, **kw)

    @classmethod
    async def connect(cls, url: str, **kwargs: Any) -> RedisStore:
        """:meth:`at`, then :meth:`reach` (``RedisUnavailable``: the client closed)."""
        store = cls.at(url, None, None, **kwargs)
        try:
            await store.reach()
        except RedisUnavailable:
            await store.aclose()
            raise
        return store

    async def reach(self) -> None:
        """The client's first connection (again after a failure); a ``RelayError``."""
        with map_redis_errors():
            await self.redis.initialize()

    async def ping(self) -> None:
        with map_redis_errors():
            await self.redis.ping()

    def messages(self, name: str) -> RedisMessages:
        return RedisMessages(self.redis, name)

    async def aclose(self) -> None:
        await self.redis.aclose()

    # ---- turns --------------------------------------------------------------------------

    async def open_generation(self, sid: str) -> Generation:
        return await self.publisher.open_generation(sid)

    async def acquire_lock(self, sid: str, owner: str, ttl_ms: int) -> LockHolder | None:
        """SET NX PX; a SET whose reply was lost and that the client sent again finds
        our own value (taken); an expired lock is tried once more."""
        value = lock_value(owner, 0, 0)
        lk = key(sid, KeyKind.LOCK)
        with map_redis_errors():
            if await self.redis.set(lk, value, nx=True, px=ttl_ms):
                return None
            cur = await self.redis.get(lk)
        if cur is not None and _s(cur).startswith(owner + " "):
            return None
        if cur is None:  # expired in between: try once more
            with map_redis_errors():
                ok = await self.redis.set(lk, value, nx=True, px=ttl_ms)
            return None if ok else LockHolder("?", 0, 0)
        return parse_lock(_s(cur))

    async def name_turn(self, sid: str, owner: str, ttl_ms: int, turn: int, offset: int) -> bool:
        args = (owner + " ", ttl_ms, lock_value(owner, turn, offset))
        return bool(int(await LOCK_NAME(self.redis, (key(sid, KeyKind.LOCK),), args)))

    async def refresh_lock(self, sid: str, owner: str, ttl_ms: int, turn: int) -> LockState:
        keys = (key(sid, KeyKind.LOCK), cancel_key(sid))
        return LockState(int(await LOCK_REFRESH(self.redis, keys, (owner + " ", ttl_ms, turn))))

    async def release_lock(self, sid: str, owner: str) -> bool:
        return await self.release(key(sid, KeyKind.LOCK), owner + " ")

    async def mark_stopped(self, sid: str, turn: int, offset: int, ttl_s: int) -> None:
        await STOPPED(self.redis, (cancel_key(sid),), (turn, offset, ttl_s))

    async def viewers(self, sid: str) -> int:
        return await count_present(self.redis, sid)

    async def lock_holder(self, sid: str) -> LockHolder | None:
        with map_redis_errors():
            cur = await self.redis.get(key(sid, KeyKind.LOCK))
        return None if cur is None else parse_lock(_s(cur))

    async def ask_stop(self, sid: str, turn: int, ttl_s: int) -> tuple[str, int, str]:
        keys = (key(sid, KeyKind.META), key(sid, KeyKind.LOCK), cancel_key(sid))
        with map_redis_errors():
            status, found, detail = await self.redis.eval(_STOP_LUA, 3, *keys, turn, ttl_s)
        return _s(status), int(found), _s(detail)

    # ---- the registry of live members ------------------------------------------------------

    async def join(self, registry: str, member: str, now_s: float, forget_s: float) -> list[str]:
        with map_redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            pipe.zadd(registry, {member: now_s})
            pipe.zremrangebyscore(registry, "-inf", now_s - forget_s)
            pipe.zrange(registry, 0, -1)
            results = await pipe.execute()
        return [_s(x) for x in results[-1]]

    async def members_since(self, registry: str, since: float) -> list[str]:
        with map_redis_errors():
            ids = await self.redis.zrangebyscore(registry, since, "+inf")
        return [_s(x) for x in ids]

    async def reports(self, keys: Sequence[str]) -> list[dict[str, str]]:
        if not keys:
            return []
        with map_redis_errors():
            read = self.redis.pipeline(transaction=False)
            for k in keys:
                read.hgetall(k)
            raws = await read.execute()
        return [{_s(k): _s(v) for k, v in (raw or {}).items()} for raw in raws]

    async def report(self, key: str, fields: Mapping[str, str], ttl_ms: int) -> None:
        with map_redis_errors():
            write = self.redis.pipeline(transaction=False)
            mapping: dict[Any, Any] = dict(fields)
            write.hset(key, mapping=mapping)
            write.pexpire(key, ttl_ms)
            await write.execute()

    async def leave(self, registry: str, member: str, key: str) -> None:
        with map_redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            pipe.delete(key)
            pipe.zrem(registry, member)
            await pipe.execute()

    # ---- sessions -----------------------------------------------------------------------

    async def history(self, sid: str) -> tuple[list[str], dict[str, str]]:
        with map_redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            pipe.lrange(hist_key(sid), 0, -1)
            pipe.hgetall(state_key(sid))
            raw_hist, raw_state = await pipe.execute()
        return [_s(x) for x in raw_hist], {_s(k): _s(v) for k, v in raw_state.items()}

    async def session_state(self, sid: str) -> SessionState:
        keys = (hist_key(sid), key(sid, KeyKind.META), key(sid, KeyKind.LOCK))
        with map_redis_errors():
            hist, opened, turn, offset, lock, gen = await self.redis.eval(_VIEW_LUA, 3, *keys)
        return SessionState(
            [_s(x) for x in hist], _s(opened), int(_s(turn)), int(_s(offset)), _s(lock), _s(gen)
        )

    async def append_history(
        self, sid: str, messages: Sequence[str], *, max_messages: int, max_bytes: int,
        ttl_s: int,
    ) -> int:  # fmt: skip
        args: list[Any] = [max_messages, ttl_s, max_bytes, *messages]
        with map_redis_errors():
            return int(await self.redis.eval(_APPEND_LUA, 1, hist_key(sid), *args))

    async def truncate_history(self, sid: str, turn: int) -> int:
        with map_redis_errors():
            return int(await self.redis.eval(_TRUNCATE_LUA, 1, hist_key(sid), turn))

    async def set_state(self, sid: str, field: str, value: str, ttl_s: int) -> None:
        with map_redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            pipe.hset(state_key(sid), field, value)
            pipe.expire(state_key(sid), ttl_s)
            await pipe.execute()

    async def gone(self, sid: str) -> bool:
        with map_redis_errors():
            return bool(await self.redis.exists(gone_key(sid)))

    async def frames_before(self, sid: str, before: int | None, count: int) -> list[bytes]:
        top = "+" if before is None else f"({before}-1"  # entry ids are "<offset>-1"
        with map_redis_errors():
            entries: Any = await self.redis.xrevrange(log_key(sid), max=top, count=count)
        return [f for _id, fields in entries or [] if (f := fields.get(b"f")) is not None]

    async def frames_after(
        self, sid: str, after: int, count: int, *, block_ms: int = 0
    ) -> list[bytes]:
        with map_redis_errors():  # entry ids are "<offset>-1"
            reply: Any = await self.redis.xread(
                {log_key(sid): f"{after}-1"}, count=count, block=block_ms or None
            )
        return [f for _k, entries in reply or [] for _id, fields in entries
                if (f := fields.get(b"f")) is not None]  # fmt: skip

    async def session_owner(self, sid: str) -> tuple[str, bool]:
        with map_redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            pipe.hget(state_key(sid), OWNER_FIELD)
            pipe.exists(gone_key(sid))
            owner, gone = await pipe.execute()
        return _s(owner or b""), bool(gone)

    async def _session_keys(self, sid: str) -> list[str]:
        """Every key of ``sid`` but its tombstone: they share its hash slot, so the
        slot's keys (sessions share slots), filtered by the session's prefix."""
        slot = slot_of(key(sid, KeyKind.META))
        prefix = f"tr:{{{sid}}}:"
        with map_redis_errors():
            n = int(await self.redis.cluster_countkeysinslot(slot))
            names: list[Any] = await self.redis.cluster_get_keys_in_slot(slot, n) if n else []
        return [k for k in map(_s, names) if k.startswith(prefix) and k != gone_key(sid)]

    async def delete_session(self, sid: str, tombstone_ttl_s: int) -> int:
        removed = 0
        for _ in range(2):  # a key written meanwhile (a rate counter) goes in the second
            names = await self._session_keys(sid)
            keys = [gone_key(sid), live_channel(sid), *names]
            frame = encode(deleted_frame(sid))
            with map_redis_errors():
                removed += int(
                    await self.redis.eval(_DELETE_LUA, len(keys), *keys, tombstone_ttl_s, frame)
                )
            if not names:
                break
        return removed

    # ---- records ------------------------------------------------------------------------

    async def claim(self, key: str, value: str, ttl_ms: int) -> str | None:
        with map_redis_errors():
            if await self.redis.set(key, value, nx=True, px=ttl_ms):
                return None
            cur = await self.redis.get(key)
        return "" if cur is None else _s(cur)

    async def put(self, key: str, value: str, ttl_s: int) -> None:
        with map_redis_errors():
            await self.redis.set(key, value, ex=ttl_s)

    async def get(self, key: str) -> str | None:
        with map_redis_errors():
            cur = await self.redis.get(key)
        return None if cur is None else _s(cur)

    async def release(self, key: str, prefix: str) -> bool:
        return bool(int(await LOCK_RELEASE(self.redis, (key,), (prefix,))))

    async def drop(self, key: str) -> None:
        with map_redis_errors():
            await self.redis.delete(key)

    async def take_slot(self, key: str, member: str, limit: int, ttl_ms: int) -> int:
        with map_redis_errors():
            taken, wait_ms = await self.redis.eval(_TAKE_SLOT, 1, key, limit, ttl_ms, member)
        return 0 if int(taken) else int(wait_ms)

    async def count(self, key: str, ttl_s: int) -> int:
        with map_redis_errors():
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.incr(key)
                pipe.expire(key, ttl_s)
                n, _ = await pipe.execute()
        return int(n)

    async def job_create(self, key: str, fields: Mapping[str, str], ttl_s: int) -> None:
        with map_redis_errors():
            await self.redis.eval(_JOB_CREATE, 1, key, ttl_s, *_flat(fields))

    async def job_start(self, key: str, worker: str, now_ms: int) -> tuple[str, int]:
        with map_redis_errors():
            st, n = await self.redis.eval(_JOB_START, 1, key, worker, now_ms)
        return _s(st), int(n)

    async def job_progress(self, key: str, tokens: int, now_ms: int) -> None:
        with map_redis_errors():
            await self.redis.eval(_JOB_PROGRESS, 1, key, tokens, now_ms)

    async def job_finish(self, key: str, fields: Mapping[str, str], ttl_s: int) -> bool:
        with map_redis_errors():
            return bool(await self.redis.eval(_JOB_FINISH, 1, key, ttl_s, *_flat(fields)))

    async def job_fail(self, key: str, reason: str, now_ms: int) -> bool:
        with map_redis_errors():
            return bool(await self.redis.eval(_JOB_FAIL, 1, key, reason, now_ms))

    async def job_note(self, key: str, fields: Mapping[str, str]) -> None:
        with map_redis_errors():
            await self.redis.eval(_JOB_NOTE, 1, key, *_flat(fields))

    async def job_get(self, key: str) -> dict[str, str] | None:
        with map_redis_errors():
            raw = await self.redis.hgetall(key)
        return {_s(k): _s(v) for k, v in raw.items()} if raw else None
