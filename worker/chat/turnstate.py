"""A turn's data: its configuration, outcomes and abort reasons, the refusals of its
admission, and the state of a running turn. No I/O of its own (it holds a running turn's
tasks and events): :mod:`worker.chat.turn` (admission) and :mod:`worker.chat.runner`
(running and ending) do it.

Outcomes and abort reasons are :class:`enum.StrEnum`: the values are what the metrics
(``outcome``, ``reason`` labels) and the ``error`` frames (``code``, text) carry.

A turn ends with exactly one terminal frame:

====================  ==========  =============================================
exit path             outcome     terminal frame
====================  ==========  =============================================
engine finished       done        ``done`` (ttft, engine, cache hit/miss, finish
                                  reason, and the reply's integrity: ``tokens``,
                                  ``chars``, ``sha256``); history appended
stopped (a cancel)    cancelled   ``done`` with ``finish_reason`` "cancelled" and the
                                  partial reply's integrity; history appended, the
                                  reply marked stopped
engine error          engine_error ``error`` (the status and the engine's own reason,
                                  cleaned and bounded)
prompt over context   prompt_too_long ``error`` (the engine's reason)
engine refused it     engine_refused ``error`` (the engine's reason: a parameter it
                                  cannot take, a bad request; retrying will not help)
engine timeout        timeout     ``error``
nobody watching       no_viewers  ``error`` "no viewers"
engine left the ring  engine_down ``error`` "engine down"
worker shutdown       shutdown    ``error`` "worker shutdown"
fenced                fenced      none: a newer generation owns the stream and the
                                  publisher refuses our writes by design
turn lock lost        lock_lost   none: the lock is no longer ours (the relay's
                                  reaper or the newer turn ends the stream)
Redis unavailable     redis_error ``error`` if Redis takes it
====================  ==========  =============================================
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import json
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from relay.producer.coalesce import DEFAULT_POLICY, CoalescePolicy
from relay.producer.errors import LockLost, TurnBusy
from relay.producer.integrity import reply_integrity
from relay.producer.presence import PresencePolicy
from relay.producer.turn import Turn
from worker.chat.direct import DirectViewer
from worker.engines.client import Delta, Usage
from worker.engines.errors import EngineError
from worker.routing.key import DEFAULT_PREFIX_CHARS
from worker.routing.lease import Lease

__all__ = [
    "CANCELLED_FINISH",
    "AbortReason",
    "Draining",
    "IdempotencyKeyReused",
    "IdempotencyPending",
    "LockLost",
    "RunningTurn",
    "StreamChat",
    "TurnBusy",
    "TurnCancelled",
    "TurnConfig",
    "TurnOutcome",
    "TurnStarted",
    "reply_integrity",
    "request_fingerprint",
]


class TurnOutcome(enum.StrEnum):
    """How a turn ended: the ``outcome`` label of ``tokenrelay_worker_turns_total`` and
    the ``code`` of the ``error`` frame (see the module's table)."""

    DONE = "done"
    ENGINE_ERROR = "engine_error"
    PROMPT_TOO_LONG = "prompt_too_long"  # the engine refused a prompt over its context
    ENGINE_REFUSED = "engine_refused"  # the engine refused the request (4xx): not retryable
    TIMEOUT = "timeout"
    NO_VIEWERS = "no_viewers"
    ENGINE_DOWN = "engine_down"
    SHUTDOWN = "shutdown"
    FENCED = "fenced"
    LOCK_LOST = "lock_lost"
    REDIS_ERROR = "redis_error"
    INTERNAL_ERROR = "internal_error"
    CANCELLED = "cancelled"

    @property
    def publishes_nothing(self) -> bool:
        """No terminal frame: the stream is no longer this turn's to end."""
        return self in (TurnOutcome.FENCED, TurnOutcome.LOCK_LOST)

    @property
    def is_cancellation(self) -> bool:
        """Counted in ``tokenrelay_worker_cancellations_total{reason}`` too."""
        return self in (
            TurnOutcome.NO_VIEWERS,
            TurnOutcome.ENGINE_DOWN,
            TurnOutcome.SHUTDOWN,
            TurnOutcome.CANCELLED,
        )

    @property
    def keeps_reply(self) -> bool:
        """Ends with a ``done`` frame and the exchange in the history."""
        return self in (TurnOutcome.DONE, TurnOutcome.CANCELLED)


class AbortReason(enum.StrEnum):
    """Why a running turn was stopped from outside its engine stream. The value is the
    text of the turn's ``error`` frame (part of the wire)."""

    LOCK_LOST = "lock lost"
    NO_VIEWERS = "no viewers"
    ENGINE_DOWN = "engine down"
    SHUTDOWN = "worker shutdown"
    CANCELLED = "cancelled"  # a client stopped the turn (its done frame says so)

    @property
    def outcome(self) -> TurnOutcome:
        return _ABORT_OUTCOME[self]


_ABORT_OUTCOME: Final = {
    AbortReason.LOCK_LOST: TurnOutcome.LOCK_LOST,
    AbortReason.NO_VIEWERS: TurnOutcome.NO_VIEWERS,
    AbortReason.ENGINE_DOWN: TurnOutcome.ENGINE_DOWN,
    AbortReason.SHUTDOWN: TurnOutcome.SHUTDOWN,
    AbortReason.CANCELLED: TurnOutcome.CANCELLED,
}

CANCELLED_FINISH: Final = "cancelled"  # the finish_reason of a stopped turn's done frame


class StreamChat(Protocol):
    """What the runner needs from :class:`worker.engines.client.EngineClient`."""

    def stream_chat(
        self,
        engine_url: str,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        max_tokens: int | None = None,
        *,
        extra_body: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        first_token_timeout_s: float | None = None,
    ) -> AsyncIterator[Delta]: ...


class IdempotencyPending(Exception):
    """A request with the same Idempotency-Key is being admitted right now (-> 409)."""


class IdempotencyKeyReused(Exception):
    """The Idempotency-Key was used before with a different request (-> 422)."""


def request_fingerprint(
    message: str,
    system: str | None,
    max_tokens: int | None,
    replaces: str | None = None,
    options: Mapping[str, Any] | None = None,
    inputs: Sequence[Mapping[str, Any]] = (),
) -> str:
    """What identifies a turn request for its Idempotency-Key: the same key with another
    message, system prompt, max_tokens, replaced turn, engine options (tools, sampling,
    ...) or tool results is a different request. (A request without options or tool
    results keeps the fingerprint it had before they were part of it.)"""
    fields: list[object] = [message, system, max_tokens]
    if replaces is not None:
        fields.append(replaces)
    if options or inputs:
        fields.append({"options": dict(options or {}), "inputs": [dict(m) for m in inputs]})
    raw = json.dumps(fields, ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()[:32]


class TurnCancelled(Exception):
    """The turn was stopped while it waited for an engine slot (-> 409)."""


class Draining(Exception):
    """The worker is shutting down and takes no new turns (-> 503)."""


@dataclass(frozen=True, slots=True)
class TurnConfig:
    model: str = "tokenrelay-mock"
    coalesce: CoalescePolicy = DEFAULT_POLICY
    presence: PresencePolicy = field(default_factory=PresencePolicy)
    lock_retry: int = 3  # a turn that is ending may still hold the lock for a round trip
    lock_retry_s: float = 0.05
    # How long a turn waits for an engine slot before 429. This worker's share of the
    # engines' caps follows its demand one load-exchange round (~250 ms) behind: a worker
    # that just started, or one of more workers than an engine has slots, holds no share
    # until its refused routes are reported. A full cluster still answers 429 after it.
    admit_wait_s: float = 2.0
    prefix_chars: int = DEFAULT_PREFIX_CHARS  # of the conversation in the routing key


@dataclass(frozen=True, slots=True)
class TurnStarted:
    """The 202 body: ``turn`` and ``offset`` (``replayed`` for an idempotent retry)."""

    session: str
    turn: int
    offset: int
    replayed: bool = False

    def body(self) -> dict[str, Any]:
        return {"session": self.session, "turn": self.turn, "offset": self.offset}


@dataclass(slots=True, eq=False)
class RunningTurn:
    sid: str
    gen: Turn  # the producer API's turn: its frames, pump and watch
    lease: Lease
    owner: str
    prompt: list[dict[str, Any]]
    message: str
    max_tokens: int | None
    t0: float
    route_key: str = ""
    reader: asyncio.Task[EngineError | None] | None = None  # its result: how the engine failed
    task: asyncio.Task[None] | None = None
    abort_reason: AbortReason | None = None
    lock_lost: bool = False  # the turn lock is no longer ours: publish nothing more
    reply: list[str] = field(default_factory=list)
    first_meta: dict[str, Any] | None = None
    sent_first_meta: bool = False
    finish_reason: str | None = None
    ttft_s: float | None = None
    cached_tokens: int | None = None
    prompt_tokens: int | None = None
    computed_tokens: int | None = None  # the prompt tokens the engine prefilled
    engine_reported: str | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # stops the presence loop
    viewer: DirectViewer | None = None  # the closed-loop client, while it is attached
    first_offset: int = 0  # the turn's meta frame
    user_id: str = ""  # the user message's id (the client's, or made from the turn)
    background: bool = False  # runs to its end unwatched (a Responses background turn)
    reply_seed: int | None = None  # a turn that replaces another: its number, to the engine
    options: dict[str, Any] = field(default_factory=dict)  # the engine's: tools, stop, ...
    trimmed: int = 0  # oldest messages left out of the prompt (the engine's context)
    tool_results: list[dict[str, Any]] = field(default_factory=list)  # sent before message

    def local_watchers(self) -> int:
        if self.background:
            return 1
        return 1 if self.viewer is not None and self.viewer.attached else 0

    def done_meta(self) -> dict[str, Any]:
        """The ``done`` frame's meta: route, cache, TTFT (the producer adds the reply's
        integrity and the finish reason)."""
        cached = self.cached_tokens
        cache = "unknown" if cached is None else ("hit" if cached > 0 else "miss")
        return {
            "engine": self.lease.engine.id,
            "engine_reported": self.engine_reported,
            "preferred": self.lease.preferred,
            "spilled": self.lease.spilled,
            "ttft_ms": round(self.ttft_s * 1000, 1) if self.ttft_s is not None else None,
            "cache": cache,  # "unknown": the engine did not report cached tokens
            "cached_tokens": self.cached_tokens,
            "prompt_tokens": self.prompt_tokens,
            "computed_tokens": self.computed_tokens,
            "trimmed_messages": self.trimmed,
            "duration_ms": round((time.monotonic() - self.t0) * 1000, 1),
        }

    def take_usage(self, usage: Usage) -> None:
        """The engine's final report: it fills what the first chunk did not say (the
        engine's own count wins for the prompt)."""
        if usage.cached_tokens is not None:
            self.cached_tokens = usage.cached_tokens
        if usage.prompt_tokens is not None:
            self.prompt_tokens = usage.prompt_tokens
        if usage.computed_tokens is not None:
            self.computed_tokens = usage.computed_tokens
        elif self.prompt_tokens is not None and self.cached_tokens is not None:
            self.computed_tokens = max(0, self.prompt_tokens - self.cached_tokens)

    def exchange(self, to: int) -> list[dict[str, Any]]:
        """The turn's history entries (the store's fields): the tools' results it was
        sent, the user's message, the reply; its terminal frame at offset ``to``."""
        turn = self.gen.turn
        reply: dict[str, Any] = {
            "role": "assistant", "content": "".join(self.reply), "turn": turn,
            "id": f"{self.sid}-{turn}", "from": self.first_offset, "to": to,
            "finish": self.finish_reason,
        }  # fmt: skip
        if parts := self.gen.parts.stored():  # a reply with tool calls, reasoning, data
            reply["parts"] = parts
        inputs: list[dict[str, Any]] = [
            {"role": "tool", "content": str(m.get("content", "")), "turn": turn,
             "tool_call_id": str(m.get("tool_call_id", "")),
             "id": f"{self.sid}-{turn}-tool-{i}", "from": self.first_offset}
            for i, m in enumerate(self.tool_results)
        ]  # fmt: skip
        if self.message or not inputs:  # a turn after tools alone has no user message
            inputs.append({"role": "user", "content": self.message, "turn": turn,
                           "id": self.user_id or f"{self.sid}-{turn}-user",
                           "from": self.first_offset})  # fmt: skip
        return [*inputs, reply]

    def abort(self, reason: AbortReason) -> None:
        if self.abort_reason is None:
            self.abort_reason = reason
        if self.reader is not None and not self.reader.done():
            self.reader.cancel()
