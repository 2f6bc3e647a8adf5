"""A session's turn lock, ``tr:{sid}:lock``: one turn generates at a time per session,
and a relay's reaper ends an open turn only once its lock has expired.

The value is ``<owner> <json {"turn", "offset"}>`` (``turn`` 0 while the turn is being
started), with a TTL its producer refreshes well within it (:func:`refresh`, which also
reads the session's stop record, ``tr:{sid}:cancel``: a stop asked of the turn). The
scripts are files of ``relay/broker/rediscluster/lua/`` (``lock_*.lua``), the same the
TypeScript producer runs.

Order of use: :func:`acquire` -> (open the generation) -> :func:`name_turn` ->
:func:`refresh` about once a second -> :func:`release`.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from redis.asyncio.cluster import RedisCluster

from relay.broker.rediscluster.errors import map_redis_errors
from relay.broker.rediscluster.scripts import LOCK_NAME, LOCK_REFRESH, LOCK_RELEASE
from relay.protocol.keys import KeyKind, cancel_key, key

__all__ = [
    "LockHolder",
    "LockState",
    "acquire",
    "lock_value",
    "name_turn",
    "parse_lock",
    "refresh",
    "release",
]


@dataclass(frozen=True, slots=True)
class LockHolder:
    """Who holds a session's turn lock (``turn``/``offset`` are 0 while it starts)."""

    owner: str
    turn: int
    offset: int


class LockState(enum.IntEnum):
    """What a refresh found (the script's reply)."""

    LOST = 0  # the lock is no longer ours
    HELD = 1  # refreshed
    STOP_ASKED = 2  # refreshed, and a stop of the turn was asked


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def lock_value(owner: str, turn: int, offset: int) -> str:
    return f"{owner} " + json.dumps({"turn": turn, "offset": offset})


def parse_lock(text: str) -> LockHolder:
    owner, _, rest = text.partition(" ")
    try:
        data = json.loads(rest)
        return LockHolder(owner, int(data.get("turn", 0)), int(data.get("offset", 0)))
    except (ValueError, AttributeError, TypeError):
        return LockHolder(owner, 0, 0)


async def acquire(redis: RedisCluster, sid: str, owner: str, ttl_ms: int) -> LockHolder | None:
    """Take the lock (SET NX PX); ``None`` on success, else who holds it."""
    value = lock_value(owner, 0, 0)
    lk = key(sid, KeyKind.LOCK)
    with map_redis_errors():
        if await redis.set(lk, value, nx=True, px=ttl_ms):
            return None
        cur = await redis.get(lk)
    if cur is not None and _s(cur).startswith(owner + " "):
        # our own SET landed but its reply was lost and the client sent it again
        return None
    if cur is None:  # expired in between: try once more
        with map_redis_errors():
            ok = await redis.set(lk, value, nx=True, px=ttl_ms)
        return None if ok else LockHolder("?", 0, 0)
    return parse_lock(_s(cur))


async def name_turn(
    redis: RedisCluster, sid: str, owner: str, ttl_ms: int, turn: int, offset: int
) -> bool:
    """Name the turn in our lock; False if another owner holds it (a lock that expired
    meanwhile and nobody took is taken again: the new generation fences older ones)."""
    args = (owner + " ", ttl_ms, lock_value(owner, turn, offset))
    return bool(int(await LOCK_NAME(redis, (key(sid, KeyKind.LOCK),), args)))


async def refresh(redis: RedisCluster, sid: str, owner: str, ttl_ms: int, turn: int) -> LockState:
    """Extend the lock and look for a stop of ``turn``, in one round trip."""
    keys = (key(sid, KeyKind.LOCK), cancel_key(sid))
    return LockState(int(await LOCK_REFRESH(redis, keys, (owner + " ", ttl_ms, turn))))


async def release(redis: RedisCluster, sid: str, owner: str) -> bool:
    """Give the lock back if it is still ours."""
    return bool(int(await LOCK_RELEASE(redis, (key(sid, KeyKind.LOCK),), (owner + " ",))))
