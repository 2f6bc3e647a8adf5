"""Stream from your own backend: the producer API of tokenrelay.

A producer writes a session's frames into Redis (docs/PROTOCOL.md); relays serve them
to any number of screens, with resume. This package is the one producer implementation
of this repository (the worker's turns are written with it) and a supported interface:
what ``__all__`` names here stays.

::

    from relay.producer import Producer, pipe

    async with await Producer.connect("redis://127.0.0.1:7000", keys=SECRET) as p:
        session = p.session()                      # a new id; or p.session("my-id")
        token = session.token()                    # the watch token for the browser
        turn = await session.start_turn("Hello?")  # lock, fenced generation, meta frame
        await pipe(turn, openai_stream)            # or turn.write(delta) ... turn.done()

Errors: :mod:`relay.producer.errors` (one type per cause). Conformance:
``tests/conformance`` drives any producer through the same vectors.
"""

from __future__ import annotations

from relay.producer.adapters import (
    ChatParts,
    pipe,
    pipe_chat_completion,
    pipe_langchain,
    pipe_responses,
    pipe_text,
)
from relay.producer.base import CANCELLED, MAX_DELTA_BYTES, StopReason, Usage
from relay.producer.coalesce import DEFAULT_POLICY, CoalescePolicy
from relay.producer.errors import (
    FrameTooLarge,
    InvalidSession,
    LockLost,
    ProducerError,
    RedisUnreachable,
    StaleEpoch,
    TurnBusy,
    TurnClosed,
)
from relay.producer.presence import PresencePolicy
from relay.producer.session import Claim, Producer, Session
from relay.producer.turn import Turn
from relay.protocol.parts import PartError

__all__ = [
    "CANCELLED",
    "DEFAULT_POLICY",
    "MAX_DELTA_BYTES",
    "ChatParts",
    "Claim",
    "CoalescePolicy",
    "FrameTooLarge",
    "InvalidSession",
    "LockLost",
    "PartError",
    "PresencePolicy",
    "Producer",
    "ProducerError",
    "RedisUnreachable",
    "Session",
    "StaleEpoch",
    "StopReason",
    "Turn",
    "TurnBusy",
    "TurnClosed",
    "Usage",
    "pipe",
    "pipe_chat_completion",
    "pipe_langchain",
    "pipe_responses",
    "pipe_text",
]
