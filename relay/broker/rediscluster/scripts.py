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
errors become :mod:`relay.broker.errors` exceptions.

Order of use::

    reply = await REAP(redis, keys, args)
    pipeline.eval(PRESENCE_WRITE.source, len(keys), *keys, *args)
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from importlib import resources
from typing import Any, Final

import redis.exceptions as rex
from redis.asyncio.cluster import RedisCluster

from relay.broker.rediscluster.errors import map_redis_errors

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
    "SCREENS",
    "SEAL",
    "STOPPED",
    "Script",
    "lua",
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


OPEN: Final = Script("open")
PUBLISH: Final = Script("publish", uses=("backlog",))
READ: Final = Script("read")
REAP: Final = Script("reap", uses=("frame", "backlog"))
SEAL: Final = Script("seal", uses=("frame", "backlog"))
PRESENCE_WRITE: Final = Script("presence_write", uses=("frame",))
SCREENS: Final = Script("screens", uses=("frame",))
PRESENCE_COUNT: Final = Script("presence_count")
LOCK_NAME: Final = Script("lock_name")
LOCK_REFRESH: Final = Script("lock_refresh")
LOCK_RELEASE: Final = Script("lock_release")
STOPPED: Final = Script("stopped")
