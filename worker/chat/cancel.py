"""Stop: a client's request that ends a running turn, accepted by any worker.

A turn generates on the worker that admitted it; a stop request may reach any worker.
Two parts, both in the session's hash slot or the worker's own:

* **the record** (durable): :func:`request_stop` runs one script on the session's slot
  that reads the session's state (``meta``: the open turn and the last one; ``lock``:
  who runs it) and, when the turn is running, marks it in ``cancel_key(sid)`` (a hash:
  turn -> ``asked``; a stopped turn's field becomes its terminal offset when it ends).
  The running worker's lock refresh (about once a second) reads the mark too, so a stop
  is carried out even if its notification is lost;
* **the notification** (fast): the stopping worker SPUBLISHes ``{"sid", "turn",
  "owner"}`` on the running worker's control channel
  (:func:`relay.protocol.keys.control_channel`, the worker id from the lock's owner);
  every worker SSUBSCRIBEs its own channel (:class:`ControlChannel`) and aborts the
  turn at once. A stop the same worker takes is carried out without Redis in between.

What a request gets (:class:`StopVerdict`): ``stopping`` (the turn runs: it will end
with a ``done`` frame whose ``finish_reason`` is ``cancelled``, unless its engine's last
token wins the race: then its own), ``stopped`` (it already ended stopped: the same
answer again, with its terminal offset), ``finished`` (it ended otherwise -> 409),
``unknown`` (no such turn -> 404), ``admitting`` (the session's next turn is still
waiting for an engine slot: it is taken out of the wait) and ``idle`` (nothing runs).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import orjson
from redis.asyncio.cluster import RedisCluster

from relay.broker.rediscluster.errors import map_redis_errors
from relay.broker.rediscluster.subscriber import ShardedSubscriber
from relay.protocol.keys import KeyKind, cancel_key, control_channel, key
from relay.service.supervise import Supervisor

__all__ = [
    "ASKED",
    "ControlChannel",
    "StopStatus",
    "StopVerdict",
    "owner_worker",
    "request_stop",
]

log = logging.getLogger(__name__)

ASKED: Final = "asked"  # a cancel hash field: a stop was asked, the turn has not ended yet

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


_NOTIFY_LUA: Final = "return redis.call('SPUBLISH', KEYS[1], ARGV[1])"


class StopStatus(enum.StrEnum):
    STOPPING = "stopping"
    STOPPED = "stopped"
    FINISHED = "finished"
    UNKNOWN = "unknown"
    ADMITTING = "admitting"
    IDLE = "idle"


@dataclass(frozen=True, slots=True)
class StopVerdict:
    """What the stop script found: ``owner`` runs the turn (stopping, admitting);
    ``offset`` is a stopped turn's terminal offset."""

    status: StopStatus
    turn: int
    owner: str = ""
    offset: int | None = None


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def owner_worker(owner: str) -> str:
    """The worker id in a turn lock's owner (``<worker id>:<random>``)."""
    return owner.rpartition(":")[0]


async def request_stop(redis: RedisCluster, sid: str, turn: int, ttl_s: int) -> StopVerdict:
    """Record a stop of ``turn`` (0: the session's running turn) and say what it found."""
    keys = (key(sid, KeyKind.META), key(sid, KeyKind.LOCK), cancel_key(sid))
    with map_redis_errors():
        status, found, detail = await redis.eval(_STOP_LUA, 3, *keys, turn, ttl_s)
    st, text = StopStatus(_s(status)), _s(detail)
    if st in (StopStatus.STOPPING, StopStatus.ADMITTING):
        return StopVerdict(st, int(found), owner=text.partition(" ")[0])
    if st is StopStatus.STOPPED:
        return StopVerdict(st, int(found), offset=int(text))
    return StopVerdict(st, int(found))


StopHandler = Callable[[str, int, str], None]  # (sid, turn (0: admitting), owner)


class ControlChannel:
    """A worker's control channel: SSUBSCRIBEd once, read in the subscriber's callback,
    each stop request handed to ``on_stop``. :meth:`notify` sends one to a worker."""

    def __init__(self, redis: RedisCluster, worker_id: str, on_stop: StopHandler) -> None:
        self.redis = redis
        self.worker_id = worker_id
        self.channel = control_channel(worker_id)
        self.on_stop = on_stop
        self.received = 0
        self._sub: ShardedSubscriber | None = None

    async def start(self, supervisor: Supervisor) -> None:
        self._sub = ShardedSubscriber(
            self.redis,
            on_message=self._on_messages,
            on_resubscribed=lambda _channels: None,  # a stop missed meanwhile: the refresh
            relay_id=f"ctl-{self.worker_id}",
            supervisor=supervisor,
        )
        await self._sub.start()
        await self._sub.subscribe([self.channel])

    async def close(self) -> None:
        if self._sub is not None:
            await self._sub.close()

    async def notify(self, worker_id: str, sid: str, turn: int, owner: str) -> None:
        body = orjson.dumps({"sid": sid, "turn": turn, "owner": owner})
        with map_redis_errors():  # the channel as the script's key: routed to its shard
            await self.redis.eval(_NOTIFY_LUA, 1, control_channel(worker_id), body)

    def _on_messages(self, messages: list[list[bytes]]) -> None:
        for msg in messages:
            try:
                body = orjson.loads(msg[2])
                sid, turn, owner = str(body["sid"]), int(body["turn"]), str(body["owner"])
            except (IndexError, KeyError, TypeError, ValueError, orjson.JSONDecodeError):
                log.warning("control channel %s: a message that is not a stop", self.channel)
                continue
            self.received += 1
            self.on_stop(sid, turn, owner)
