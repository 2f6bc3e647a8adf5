"""Token coalescing: fewer Redis round trips per token, a bounded added delay.

An engine decodes one token every 10-50 ms per stream. Publishing each token is one Redis
round trip (a Lua EVALSHA: XADD + SPUBLISH) per token per stream; a worker with hundreds
of streams spends its Redis budget on round-trip overhead. Coalescing holds a session's
pending token texts and flushes them as *one* token frame (text only appends, so the
concatenation of the frames is still the reply) when either

* ``max_tokens`` texts are pending (N), or
* the oldest pending text has waited ``max_delay_s`` (T),

whichever comes first. A reply's parts (:mod:`relay.protocol.parts`) go through the same
pump, so that every frame of a turn keeps the order it was written in: one part's deltas
coalesce like text (a run of them is one frame), and a change of what is pending (text
to a part's deltas, one part to another) or a part's ``start``, ``end`` or whole frame
first flushes what is pending. ``first_immediate`` flushes the first token of a turn at once, so
coalescing never adds to the time to first token. ``bench/pubsub/coalesce.py`` measures Redis
operations per token against the added delay; docs/WORKER.md has the numbers and the
reason for :data:`DEFAULT_POLICY`.

Two layers:

* :class:`Coalescer` — the pure core (no I/O, no clock of its own): ``push(text, now)``
  returns a :class:`Batch` when N is reached, ``deadline()`` says when T expires,
  ``poll(now)`` returns the batch once it has, ``flush(now)`` empties it at the end.
* :class:`TokenPump` — the small async driver around it: the engine reader calls
  ``push(text)`` (never blocks, never awaits Redis); ``run()`` is a task that publishes
  batches through a callback; ``close()`` makes ``run()`` flush the rest and return.
  Publishing errors (Fenced, RedisUnavailable) propagate out of ``run()``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = [
    "DEFAULT_POLICY",
    "Batch",
    "CoalescePolicy",
    "Coalescer",
    "TokenPump",
]


@dataclass(frozen=True, slots=True)
class CoalescePolicy:
    """Flush at ``max_tokens`` pending texts or after ``max_delay_s``, whichever first.
    ``max_tokens=1`` disables coalescing (one frame per token)."""

    max_tokens: int = 8
    max_delay_s: float = 0.05
    first_immediate: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.max_delay_s < 0:
            raise ValueError("max_delay_s must be >= 0")


# Chosen from bench/pubsub/coalesce.py (docs/WORKER.md): N=8 / T=50 ms cuts publish round trips
# per token from 1.0 to 0.35 at 40 tok/s per stream (0.14 at 150 tok/s) and the worker's
# CPU per token by about 40 %, for a delay bounded by T plus one Redis round trip (mean
# ~27 ms, p99 ~58 ms), well under what a reader notices. T=100 ms saves little more
# (0.22) for twice the delay; N matters only for fast decoders, where it caps the batch.
DEFAULT_POLICY: Final = CoalescePolicy(max_tokens=8, max_delay_s=0.05)


@dataclass(frozen=True, slots=True)
class Batch:
    """Texts to publish as one frame: ``text`` is their concatenation, ``count`` how many
    engine tokens it holds, ``waits`` how long each text sat in the buffer (seconds).
    ``part``: the part frame's meta for a part's deltas or frame (None: the reply's
    text); ``count`` is 0 for a part's ``start``, ``end`` or whole frame."""

    text: str
    count: int
    waits: tuple[float, ...]
    part: dict[str, Any] | None = None


@dataclass(slots=True)
class Coalescer:
    """Pending texts of one stream. Pure: the caller passes the time."""

    policy: CoalescePolicy = DEFAULT_POLICY
    _texts: list[str] = field(default_factory=list)
    _arrivals: list[float] = field(default_factory=list)
    _seen: int = 0
    _part: dict[str, Any] | None = None  # what is pending: None text, else a part's delta
    flushes: int = 0
    tokens: int = 0

    @property
    def pending(self) -> int:
        return len(self._texts)

    def switch(self, part: dict[str, Any] | None, now: float) -> Batch | None:
        """The next texts are ``part``'s deltas (None: the reply's text): what is pending
        of anything else, as a batch to publish first."""
        if part == self._part:
            return None
        batch = self._take(now) if self._texts else None
        self._part = part
        return batch

    def push(self, text: str, now: float) -> Batch | None:
        """Add one engine token; return the batch to publish if the count rule fired."""
        self._texts.append(text)
        self._arrivals.append(now)
        self._seen += 1
        if len(self._texts) >= self.policy.max_tokens:
            return self._take(now)
        if self.policy.first_immediate and self._seen == 1:
            return self._take(now)
        if self.policy.max_delay_s == 0:
            return self._take(now)
        return None

    def deadline(self) -> float | None:
        """When the oldest pending text must go out (``None`` when nothing is pending)."""
        if not self._arrivals:
            return None
        return self._arrivals[0] + self.policy.max_delay_s

    def poll(self, now: float) -> Batch | None:
        """The batch if the time rule has fired by ``now``."""
        d = self.deadline()
        if d is None or now < d:
            return None
        return self._take(now)

    def flush(self, now: float) -> Batch | None:
        """Everything pending (end of stream), or ``None``."""
        return self._take(now) if self._texts else None

    def _take(self, now: float) -> Batch:
        batch = Batch(
            "".join(self._texts),
            len(self._texts),
            tuple(now - t for t in self._arrivals),
            self._part,
        )
        self._texts.clear()
        self._arrivals.clear()
        self.flushes += 1
        self.tokens += batch.count
        return batch


class TokenPump:
    """Drives a :class:`Coalescer` for one stream: ``push`` from the engine reader,
    ``run`` as a task that calls ``publish(batch)`` (one Redis round trip per batch)."""

    def __init__(
        self,
        publish: Callable[[Batch], Awaitable[object]],
        policy: CoalescePolicy = DEFAULT_POLICY,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._publish = publish
        self._core = Coalescer(policy)
        self._clock = clock
        self._ready: list[Batch] = []
        self._wake = asyncio.Event()
        self._closed = False
        self.published_tokens = 0
        self.published_batches = 0
        self.waits: list[float] = []

    def push(self, text: str, part: dict[str, Any] | None = None) -> None:
        """Queue one token text, or one delta of ``part`` (never blocks)."""
        if self._closed:
            raise RuntimeError("push after close")
        now = self._clock()
        if (before := self._core.switch(part, now)) is not None:
            self._ready.append(before)
        batch = self._core.push(text, now)
        if batch is not None:
            self._ready.append(batch)
        self._wake.set()

    def put(self, part: dict[str, Any], text: str = "") -> None:
        """Queue one frame of a part as it is (a ``start``, an ``end``, a whole part),
        after everything pending (never blocks)."""
        if self._closed:
            raise RuntimeError("push after close")
        if (before := self._core.flush(self._clock())) is not None:
            self._ready.append(before)
        self._ready.append(Batch(text, 0, (), part))
        self._wake.set()

    def close(self) -> None:
        """No more tokens: ``run`` publishes what is pending and returns."""
        self._closed = True
        self._wake.set()

    async def run(self) -> None:
        """Publish batches until closed and empty. Exceptions of ``publish`` propagate."""
        while True:
            now = self._clock()
            batch = self._core.poll(now)
            if batch is not None:
                self._ready.append(batch)
            if self._closed:
                tail = self._core.flush(now)
                if tail is not None:
                    self._ready.append(tail)
            if self._ready:
                ready, self._ready = self._ready, []
                for b in ready:
                    await self._publish(b)
                    self.published_batches += 1
                    self.published_tokens += b.count
                    self.waits.extend(b.waits)
                continue
            if self._closed:
                return
            self._wake.clear()
            deadline = self._core.deadline()
            if deadline is None:
                await self._wake.wait()
            else:
                timeout = max(0.0, deadline - self._clock())
                try:
                    async with asyncio.timeout(timeout):
                        await self._wake.wait()
                except TimeoutError:
                    pass
