"""The producer API's exceptions: one type per cause, each with a one-line message.

There is one exception tree, :mod:`relay.broker.errors` (root
:class:`relay.broker.errors.RelayError`); the producer's names are that tree's classes,
and the causes only a producer meets are added to it here::

    ProducerError           = RelayError (the root: ``except ProducerError`` catches
                              every cause below, as it always did)
     +-- InvalidSession      the session id is not [A-Za-z0-9_-]{1,64} (also a ValueError
                             and a relay.protocol.keys.InvalidSessionId)
     +-- FrameTooLarge       = relay.broker.errors.FrameTooLarge: a delta or a frame over
                             MAX_FRAME_BYTES (also a ValueError); nothing of it was written
     +-- TurnClosed          a turn that ended (done, error, closed) was written again
     +-- RedisUnreachable    = relay.broker.errors.RedisUnavailable: Redis did not answer
                             for the retry window (the write may or may not have landed:
                             a retry of the same turn is safe)
     +-- StaleEpoch          = relay.broker.errors.Fenced: a newer producer opened the
                             session (or a relay's reaper ended this turn): nothing was
                             written
     +-- TurnBusy            another producer holds the session's turn lock
     +-- LockLost            the turn lock expired and is no longer this producer's

``StaleEpoch``, ``RedisUnreachable``, ``FrameTooLarge`` and ``ProducerError`` are
aliases (the same class object under the producer's public name), kept so that an
application's ``except StaleEpoch`` / ``except RedisUnreachable`` / ``except
ProducerError`` keeps working: ``except StaleEpoch`` and ``except Fenced`` catch the
same errors, whoever raised them.
"""

from __future__ import annotations

from relay.broker.errors import Fenced, FrameTooLarge, RedisUnavailable, RelayError
from relay.producer.lock import LockHolder
from relay.protocol.keys import InvalidSessionId

__all__ = [
    "FrameTooLarge",
    "InvalidSession",
    "LockLost",
    "ProducerError",
    "RedisUnreachable",
    "StaleEpoch",
    "TurnBusy",
    "TurnClosed",
]

ProducerError = RelayError
"""The producer API's base: the one tree's root (an alias, see the module docstring)."""
StaleEpoch = Fenced
"""A newer generation owns the session: an alias of :class:`relay.broker.errors.Fenced`."""
RedisUnreachable = RedisUnavailable
"""Redis did not answer in time: an alias of :class:`relay.broker.errors.RedisUnavailable`."""


class InvalidSession(RelayError, InvalidSessionId):
    """The session id is not ``[A-Za-z0-9_-]{1,64}``."""


class TurnClosed(RelayError):
    """The turn ended (its terminal frame is out, or it was closed): nothing more goes."""

    def __init__(self, session: str, turn: int, how: str) -> None:
        super().__init__(f"session {session}: turn {turn} is closed ({how}); start a new turn")
        self.session = session
        self.turn = turn


class TurnBusy(RelayError):
    """Another producer's turn holds the session's turn lock."""

    def __init__(self, holder: LockHolder) -> None:
        super().__init__(f"turn {holder.turn} is generating")
        self.holder = holder


class LockLost(RelayError):
    """The turn lock is no longer this producer's (it expired and was taken or reaped)."""
