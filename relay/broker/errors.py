"""relay's own exceptions: what the relay and its producers raise on purpose.

The one exception tree of the transport: one class per cause, whoever raises it (the
edge, the broker, the producer API, the worker's turns). The tree::

    RelayError                   (the producer API's ProducerError is this class)
     +-- RedisUnavailable        the store cannot be reached / timed out (retry later);
     |                           the producer API's RedisUnreachable is this class
     +-- RedisCommandError       the store answered an error we did not expect
     +-- Fenced                  a stale generation tried to publish (nothing written);
     |                           the producer API's StaleEpoch is this class
     +-- OffsetConflict          the session's offset is not the one the generation expected
     +-- FrameTooLarge           a frame would encode past MAX_FRAME_BYTES (nothing written)
     +-- SubscribeError          a live channel could not be subscribed in time
     +-- SessionDeleted          the session was deleted (its tombstone exists)
     +-- WatchClosed             a watcher was dropped (``reason`` for humans, ``code``
     |                           for machines: "slow_consumer", "relay_shutdown", ...)
     +-- (relay.producer.errors) InvalidSession, TurnClosed, TurnBusy, LockLost: the
                                 causes only a producer meets

The engine client's errors (:mod:`worker.engines.errors`, ``EngineError``) are their own
tree: an engine's failure is not the store's, and the handlers that answer "the store is
unavailable" for a ``RelayError`` must not catch it.

A broker converts its client library's errors into these where it calls it
(:func:`relay.broker.rediscluster.errors.map_redis_errors` for redis-py), so nothing above
the broker sees a library's exception type.
"""

from __future__ import annotations

from relay.protocol.codes import CloseCode

__all__ = [
    "Fenced",
    "FrameTooLarge",
    "OffsetConflict",
    "RedisCommandError",
    "RedisUnavailable",
    "RelayError",
    "SessionDeleted",
    "SubscribeError",
    "WatchClosed",
]


class RelayError(Exception):
    """Base of every exception the relay raises on purpose."""


class RedisUnavailable(RelayError):
    """Redis could not be reached or did not answer in time; the call may be retried.

    Also importable as ``relay.producer.RedisUnreachable`` (the same class)."""


class RedisCommandError(RelayError):
    """Redis answered with an error reply that the caller did not anticipate."""


class Fenced(RelayError):
    """A generation whose epoch is no longer the session's current epoch tried to write
    (a newer producer opened the session, or a relay's reaper ended the turn): nothing
    was written.

    Also importable as ``relay.producer.StaleEpoch`` (the same class)."""

    def __init__(self, session: str, epoch: int, current: int) -> None:
        super().__init__(f"session {session}: generation epoch {epoch} fenced by epoch {current}")
        self.session = session
        self.epoch = epoch
        self.current = current


class OffsetConflict(RelayError):
    """The session's last offset differs from the one the generation expected."""

    def __init__(self, session: str, expected: int, current: int) -> None:
        super().__init__(f"session {session}: expected offset {expected}, found {current}")
        self.session = session
        self.expected = expected
        self.current = current


class FrameTooLarge(RelayError, ValueError):
    """A frame would encode past :data:`relay.protocol.frame.MAX_FRAME_BYTES`: every reader
    would refuse it, so it is never written (nothing of its batch is)."""

    def __init__(self, session: str, size: int, limit: int) -> None:
        super().__init__(f"session {session}: a frame of {size} bytes is over {limit} bytes")
        self.session = session
        self.size = size
        self.limit = limit


class SubscribeError(RelayError):
    """A shard channel could not be subscribed (no owner reachable before the deadline)."""


class SessionDeleted(RelayError):
    """The session was deleted: its tombstone (:func:`relay.protocol.keys.gone_key`)
    exists, so nothing of it may be read or watched until the tombstone expires."""

    def __init__(self, session: str) -> None:
        super().__init__(f"session {session} was deleted")
        self.session = session


class WatchClosed(RelayError):
    """The hub dropped a watcher. ``code`` (:class:`relay.protocol.codes.CloseCode`) is
    stable; ``reason`` is a sentence for logs and the client's final frame."""

    def __init__(self, reason: str, code: CloseCode) -> None:
        super().__init__(f"{code}: {reason}")
        self.reason = reason
        self.code = code
