"""The producer API's exceptions: one type per cause, each with a one-line message.

The tree (every one is a :class:`relay.broker.errors.RelayError`)::

    ProducerError
     +-- InvalidSession      the session id is not [A-Za-z0-9_-]{1,64} (also a ValueError)
     +-- FrameTooLarge       a delta or a frame over MAX_FRAME_BYTES (also a ValueError);
                             nothing of it was written
     +-- TurnClosed          a turn that ended (done, error, closed) was written again
     +-- RedisUnreachable    Redis did not answer for the retry window (the write may or
                             may not have landed: a retry of the same turn is safe)
     +-- StaleEpoch          a newer producer opened the session (or a relay's reaper
                             ended this turn): nothing was written
     +-- TurnBusy            another producer holds the session's turn lock
     +-- LockLost            the turn lock expired and is no longer this producer's

:class:`StaleEpoch` is a :class:`relay.broker.errors.Fenced`, :class:`RedisUnreachable` a
:class:`relay.broker.errors.RedisUnavailable` and :class:`FrameTooLarge` the broker's own,
so code that handles the transport's errors handles these too.
"""

from __future__ import annotations

from relay.broker.errors import Fenced, RedisUnavailable, RelayError
from relay.broker.errors import FrameTooLarge as _BrokerFrameTooLarge
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


class ProducerError(RelayError):
    """Base of the producer API's exceptions."""


class InvalidSession(ProducerError, InvalidSessionId):
    """The session id is not ``[A-Za-z0-9_-]{1,64}``."""


class FrameTooLarge(ProducerError, _BrokerFrameTooLarge):
    """A delta or a frame would encode past ``MAX_FRAME_BYTES``; nothing of it was written."""


class TurnClosed(ProducerError):
    """The turn ended (its terminal frame is out, or it was closed): nothing more goes."""

    def __init__(self, session: str, turn: int, how: str) -> None:
        super().__init__(f"session {session}: turn {turn} is closed ({how}); start a new turn")
        self.session = session
        self.turn = turn


class RedisUnreachable(ProducerError, RedisUnavailable):
    """Redis could not be reached within the retry window."""


class StaleEpoch(ProducerError, Fenced):
    """A newer generation owns the session: this turn may write nothing more."""

    def __init__(self, session: str, epoch: int, current: int) -> None:
        Fenced.__init__(self, session, epoch, current)


class TurnBusy(ProducerError):
    """Another producer's turn holds the session's turn lock."""

    def __init__(self, holder: LockHolder) -> None:
        super().__init__(f"turn {holder.turn} is generating")
        self.holder = holder


class LockLost(ProducerError):
    """The turn lock is no longer this producer's (it expired and was taken or reaped)."""
