"""The Lua scripts of the relay and its producers, as files, run by hash.

Each script is a file of ``lua/`` (its KEYS and ARGV are said at its top); a script that
writes a frame of its own starts with ``lua/frame.lua``, the one template of a frame
written in Lua (the reap's ``error``, the seal's ``gap``, the screen count's
``presence``, outside the session's order: in no backlog), so that the frames the
scripts write cannot drift apart, and every script that appends to a backlog starts with
``lua/backlog.lua``, the one rule of its bounds (frames and bytes). The files ship inside
the package (package data).

A :class:`Script` runs with ``EVALSHA`` and falls back to ``EVAL`` once on ``NOSCRIPT``
(a node that restarted or a new replica promoted has an empty script cache); redis-py
errors become :mod:`relay.broker.errors` exceptions. :func:`run_batch` does the same for
many calls in one pipeline (a relay's presence entries and screen counts): each call by
``EVALSHA``, only the ones a node answers ``NOSCRIPT`` again by ``EVAL``, so the script's
source crosses the network and is hashed by Redis once per node, not once per call.

Order of use::

    reply = await REAP(redis, keys, args)
    replies = await run_batch(redis, [(PRESENCE_WRITE, keys, args), ...], [("ZREM", k, m)])
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from importlib import resources
from typing import Any, Final, TypeAlias

import redis.exceptions as rex
from redis.asyncio.cluster import RedisCluster

from relay.broker.rediscluster.errors import convert, map_redis_errors

__all__ = [
    "LOCK_NAME",
    "LOCK_REFRESH",
    "LOCK_RELEASE",
    "OPEN",
    "PRESENCE_COUNT",
    "PRESENCE_WRITE",
    "PUBLISH",
    "READ",
    "REAP",
    "RELAYS",
    "SCREENS",
    "SEAL",
    "STOPPED",
    "Call",
    "Script",
    "lua",
    "run_batch",
]


def lua(name: str) -> str:
    """The source of ``lua/<name>.lua``."""
    return resources.files(__package__).joinpath("lua", f"{name}.lua").read_text()


class Script:
    """``lua/<name>.lua`` (after the files it ``uses``), run with EVALSHA."""

    def __init__(self, name: str, *, uses: Sequence[str] = ()) -> None:
        self.name = name
        self.source = "".join(lua(u) + "\n" for u in uses) + lua(name)
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    async def __call__(self, redis: RedisCluster, keys: Sequence[str], args: Sequence[Any]) -> Any:
        with map_redis_errors():
            try:
                return await redis.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
            except rex.NoScriptError:
                return await redis.execute_command("EVAL", self.source, len(keys), *keys, *args)


OPEN: Final = Script("open", uses=("frame", "backlog", "failover"))
PUBLISH: Final = Script("publish", uses=("backlog",))
READ: Final = Script("read")
REAP: Final = Script("reap", uses=("frame", "backlog", "failover"))
SEAL: Final = Script("seal", uses=("frame", "backlog"))
PRESENCE_WRITE: Final = Script("presence_write", uses=("frame",))
SCREENS: Final = Script("screens", uses=("frame",))
PRESENCE_COUNT: Final = Script("presence_count")
RELAYS: Final = Script("relays")
LOCK_NAME: Final = Script("lock_name")
LOCK_REFRESH: Final = Script("lock_refresh")
LOCK_RELEASE: Final = Script("lock_release")
STOPPED: Final = Script("stopped")


Call: TypeAlias = tuple[Script, Sequence[str], Sequence[Any]]


async def run_batch(
    redis: RedisCluster, calls: Sequence[Call], plain: Sequence[tuple[Any, ...]] = ()
) -> list[Any]:
    """``calls`` (each by ``EVALSHA``), then the ``plain`` commands, in one pipeline:
    redis-py sends each node its share at once. A call a node answers ``NOSCRIPT`` is sent
    again by ``EVAL`` (which loads the script there). Each command's reply, in order, or
    the error it got as a :class:`relay.broker.errors.RelayError`; raises one when the
    pipeline fails as a whole."""
    with map_redis_errors():
        async with redis.pipeline(transaction=False) as p:
            for script, keys, args in calls:
                p.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
            for command in plain:
                p.execute_command(*command)
            out: list[Any] = list(await p.execute(raise_on_error=False))
        again = [i for i, r in enumerate(out[: len(calls)]) if isinstance(r, rex.NoScriptError)]
        if again:
            async with redis.pipeline(transaction=False) as p:
                for i in again:
                    script, keys, args = calls[i]
                    p.execute_command("EVAL", script.source, len(keys), *keys, *args)
                for i, r in zip(again, await p.execute(raise_on_error=False), strict=True):
                    out[i] = r
    return [convert(r) if isinstance(r, BaseException) else r for r in out]
