"""The producer's shared pieces: its settings as a turn sees them, why a turn should
stop, usage, and the transport's errors as the producer's types."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Final, Protocol

from relay.broker.port import TurnStore
from relay.producer.coalesce import CoalescePolicy
from relay.producer.presence import PresencePolicy
from relay.protocol.frame import MAX_FRAME_BYTES
from relay.protocol.keys import LOCK_TTL_S  # the turn lock of every producer (its bound)

__all__ = [
    "CANCELLED",
    "LOCK_TTL_S",
    "MAX_DELTA_BYTES",
    "Observer",
    "ProducerSettings",
    "Spawn",
    "StopReason",
    "Usage",
    "chunks",
    "default_spawn",
]

Spawn = Callable[[str, Coroutine[Any, Any, Any]], "asyncio.Task[Any]"]
Observer = Callable[[int, str, bytes], None]

CANCELLED: Final = "cancelled"  # the finish_reason of a stopped turn's done frame
# The largest delta one token frame carries: the frame's other fields fit in the rest.
MAX_DELTA_BYTES: Final = MAX_FRAME_BYTES - 4096


class StopReason(enum.StrEnum):
    """Why the caller should stop generating (:meth:`Turn.stopped`)."""

    CANCELLED = "cancelled"  # a client stopped the turn: end it with done(finish_reason=CANCELLED)
    NO_VIEWERS = "no viewers"  # nobody watched for the grace period: end it (error or done)
    LOCK_LOST = "lock lost"  # the turn is no longer ours: write nothing more


@dataclass(frozen=True, slots=True)
class Usage:
    """Token usage as an engine reports it; carried into the ``done`` frame."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None
    cached_tokens: int | None = None

    def meta(self) -> dict[str, Any]:
        """The ``done`` frame's fields: ``usage`` (what is known), ``prompt_tokens`` and
        ``cached_tokens`` beside it as the worker writes them."""
        usage = {
            k: v
            for k, v in (
                ("prompt_tokens", self.prompt_tokens),
                ("completion_tokens", self.completion_tokens),
                ("total_tokens", self.total_tokens),
                ("cached_tokens", self.cached_tokens),
            )
            if v is not None
        }
        out: dict[str, Any] = {"usage": usage}
        if self.prompt_tokens is not None:
            out["prompt_tokens"] = self.prompt_tokens
        if self.cached_tokens is not None:
            out["cached_tokens"] = self.cached_tokens
        return out


def default_spawn(name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
    return asyncio.create_task(coro, name=name)


class ProducerSettings(Protocol):
    """What a turn needs of its producer (:class:`relay.producer.session.Producer`)."""

    store: TurnStore
    coalesce: CoalescePolicy
    presence: PresencePolicy
    spawn: Spawn
    lock_ttl_ms: int
    ttl_s: int


def chunks(text: str) -> list[str]:
    """``text`` cut into pieces of at most :data:`MAX_DELTA_BYTES` UTF-8 bytes."""
    out: list[str] = []
    cur: list[str] = []
    size = 0
    for ch in text:
        n = len(ch.encode("utf-8", "surrogatepass"))
        if size + n > MAX_DELTA_BYTES:
            out.append("".join(cur))
            cur, size = [], 0
        cur.append(ch)
        size += n
    if cur:
        out.append("".join(cur))
    return out
