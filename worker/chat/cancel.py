"""Stop: a client's request that ends a running turn, accepted by any worker.

A turn generates on the worker that admitted it; a stop request may reach any worker.
Two parts, both in the session's hash slot or the worker's own:

* **the record** (durable): :func:`request_stop` (the store's
  :meth:`relay.broker.port.TurnStore.ask_stop`: on Redis one script on the session's slot)
  reads the session's state (``meta``: the open turn and the last one; ``lock``:
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

from relay.broker.port import Messages, TurnStore
from relay.broker.rediscluster.messages import RedisMessages
from relay.protocol.keys import control_channel
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


def owner_worker(owner: str) -> str:
    """The worker id in a turn lock's owner (``<worker id>:<random>``)."""
    return owner.rpartition(":")[0]


async def request_stop(store: TurnStore, sid: str, turn: int, ttl_s: int) -> StopVerdict:
    """Record a stop of ``turn`` (0: the session's running turn) and say what it found."""
    status, found, text = await store.ask_stop(sid, turn, ttl_s)
    st = StopStatus(status)
    if st in (StopStatus.STOPPING, StopStatus.ADMITTING):
        return StopVerdict(st, int(found), owner=text.partition(" ")[0])
    if st is StopStatus.STOPPED:
        return StopVerdict(st, int(found), offset=int(text))
    return StopVerdict(st, int(found))


StopHandler = Callable[[str, int, str], None]  # (sid, turn (0: admitting), owner)


class ControlChannel:
    """A worker's control channel: listened to once, each stop request handed to
    ``on_stop``. :meth:`notify` sends one to a worker. ``messages``: the store's
    :class:`relay.broker.port.Messages` (a cluster client is wrapped in a
    :class:`relay.broker.rediscluster.messages.RedisMessages`)."""

    def __init__(self, messages: Messages | Any, worker_id: str, on_stop: StopHandler) -> None:
        if not isinstance(messages, Messages):
            messages = RedisMessages(messages, f"ctl-{worker_id}")
        self.messages: Messages = messages
        self.worker_id = worker_id
        self.channel = control_channel(worker_id)
        self.on_stop = on_stop
        self.received = 0

    async def start(self, supervisor: Supervisor) -> None:
        await self.messages.listen(self.channel, self._on_message, supervisor)

    async def close(self) -> None:
        await self.messages.unlisten()

    async def notify(self, worker_id: str, sid: str, turn: int, owner: str) -> None:
        body = orjson.dumps({"sid": sid, "turn": turn, "owner": owner})
        await self.messages.send(control_channel(worker_id), body)

    def _on_message(self, data: bytes) -> None:
        try:
            body = orjson.loads(data)
            sid, turn, owner = str(body["sid"]), int(body["turn"]), str(body["owner"])
        except (KeyError, TypeError, ValueError, orjson.JSONDecodeError):
            log.warning("control channel %s: a message that is not a stop", self.channel)
            return
        self.received += 1
        self.on_stop(sid, turn, owner)
