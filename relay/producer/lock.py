"""A session's turn lock, ``tr:{sid}:lock``: one turn generates at a time per session,
and a relay's reaper ends an open turn only once its lock has expired.

The value is ``<owner> <json {"turn", "offset"}>`` (``turn`` 0 while the turn is being
started), with a TTL its producer refreshes well within it (:func:`refresh`, which also
reads the session's stop record, ``tr:{sid}:cancel``: a stop asked of the turn), kept by
the store (:class:`relay.broker.port.TurnStore`; on Redis the scripts of
``relay/broker/rediscluster/lua/``, ``lock_*.lua``, the same the TypeScript producer runs).

Order of use: :func:`acquire` -> (open the generation) -> :func:`name_turn` ->
:func:`refresh` about once a second -> :func:`release`.
"""

from __future__ import annotations

from relay.broker.port import LockHolder, LockState, TurnStore, lock_value, parse_lock

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


async def acquire(store: TurnStore, sid: str, owner: str, ttl_ms: int) -> LockHolder | None:
    """Take the lock (SET NX PX); ``None`` on success, else who holds it."""
    return await store.acquire_lock(sid, owner, ttl_ms)


async def name_turn(
    store: TurnStore, sid: str, owner: str, ttl_ms: int, turn: int, offset: int
) -> bool:
    """Name the turn in our lock; False if another owner holds it (a lock that expired
    meanwhile and nobody took is taken again: the new generation fences older ones)."""
    return await store.name_turn(sid, owner, ttl_ms, turn, offset)


async def refresh(store: TurnStore, sid: str, owner: str, ttl_ms: int, turn: int) -> LockState:
    """Extend the lock and look for a stop of ``turn``, in one round trip."""
    return await store.refresh_lock(sid, owner, ttl_ms, turn)


async def release(store: TurnStore, sid: str, owner: str) -> bool:
    """Give the lock back if it is still ours."""
    return await store.release_lock(sid, owner)
