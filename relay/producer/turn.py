"""One turn being written: its deltas and parts through the coalescing pump, its guard
(lock refresh, stop record, viewers), its one terminal frame. Opened by
:meth:`relay.producer.session.Claim.open`; the rules are :mod:`relay.producer.session`'s."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from typing import Any

from relay.broker.errors import RelayError
from relay.broker.port import Draft, TurnWriter
from relay.producer.base import (
    CANCELLED,
    MAX_DELTA_BYTES,
    ProducerSettings,
    StopReason,
    Usage,
    chunks,
)
from relay.producer.coalesce import Batch, TokenPump
from relay.producer.errors import (
    FrameTooLarge,
    LockLost,
    RedisUnreachable,
    StaleEpoch,
    TurnClosed,
)
from relay.producer.integrity import reply_integrity
from relay.producer.lock import LockState
from relay.producer.lock import refresh as lock_refresh
from relay.producer.lock import release as lock_release
from relay.producer.parts import TurnParts
from relay.producer.presence import PresencePolicy, follow_presence

__all__ = ["Turn"]


class Turn(TurnParts):
    """One turn being written. :meth:`write` the deltas, then :meth:`done` or
    :meth:`error` (or use it as ``async with``: an exception ends it with ``error``, a
    clean exit with ``done``)."""

    def __init__(
        self,
        producer: ProducerSettings,
        sid: str,
        owner: str,
        generation: TurnWriter,
        first_offset: int,
        t0: float,
        on_batch: Callable[[Batch], None] | None = None,
    ) -> None:
        p = producer
        self.producer = producer
        self._sid = sid
        self.owner = owner
        self.generation = generation
        self.first_offset = first_offset  # the turn's meta frame
        self.t0 = t0
        self.deltas: list[str] = []
        self.stop_reason: StopReason | None = None
        self.lock_lost = False
        self._closed: str | None = None  # how it ended
        self._pending_meta: dict[str, Any] | None = None
        self._on_batch = on_batch
        self._stop_callbacks: list[Callable[[StopReason], None]] = []
        self._stopped = asyncio.Event()
        self._ended = asyncio.Event()
        self._pump = TokenPump(self._publish_batch, p.coalesce)
        TurnParts.__init__(self, self._pump, self._check_writable)
        # the task that publishes coalesced deltas; its result is the failure that
        # stopped it (None: it finished)
        self.pump_task: asyncio.Task[RelayError | None] = p.spawn(f"pump:{sid}", self._run_pump())
        self.guard_task: asyncio.Task[None] | None = None

    # ---- what it is ---------------------------------------------------------------------

    @property
    def sid(self) -> str:
        return self._sid

    @property
    def turn(self) -> int:
        return self.generation.turn

    @property
    def epoch(self) -> int:
        return self.generation.epoch

    @property
    def next_offset(self) -> int:
        """The offset of the next frame this turn writes (once its pump is drained:
        the terminal frame's)."""
        return self.generation.next_offset

    @property
    def text(self) -> str:
        """The reply so far (every delta written)."""
        return "".join(self.deltas)

    @property
    def closed(self) -> bool:
        return self._closed is not None

    # ---- writing ------------------------------------------------------------------------

    def write(self, text: str, meta: Mapping[str, Any] | None = None) -> None:
        """Append one text delta (never blocks: the pump publishes it, coalesced); ends
        the reasoning part :meth:`reasoning` was writing, if any.
        ``meta`` goes into the ``token`` frame that carries this delta (the first token's
        ``ttft_ms``, say). Raises :class:`TurnClosed`, :class:`FrameTooLarge` (a delta
        over :data:`MAX_DELTA_BYTES`), :class:`LockLost`, or the failure that stopped
        the pump (:class:`StaleEpoch`, :class:`RedisUnreachable`)."""
        self._check_writable()
        if not isinstance(text, str):
            raise TypeError("a delta is a str")
        if not text:
            return
        self.end_reasoning()  # the text follows the reasoning :meth:`reasoning` was writing
        self.parts.text(text)
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > MAX_DELTA_BYTES:
            raise FrameTooLarge(self.sid, size, MAX_DELTA_BYTES)
        if meta:
            self._pending_meta = {**(self._pending_meta or {}), **meta}
        self.deltas.append(text)
        self._pump.push(text)

    def _check_writable(self) -> None:
        self._check_open()
        if self.pump_task.done() and not self.pump_task.cancelled():
            failed = self.pump_task.result()
            if failed is not None:
                raise failed

    async def flush(self, timeout_s: float = 5.0) -> None:
        """Close the turn's pump and wait until every delta written is in Redis (a
        publish in flight is never cancelled: after ``timeout_s`` the pump is). Raises
        what stopped the pump."""
        if not self.pump_task.done():
            self._pump.close()
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self.pump_task), timeout_s)
            if not self.pump_task.done():
                self.pump_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self.pump_task
                raise RedisUnreachable("the deltas were not written in time")
        if not self.pump_task.cancelled():
            failed = self.pump_task.result()
            if failed is not None:
                raise failed

    async def done(
        self,
        *,
        finish_reason: str | None = "stop",
        usage: Usage | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> int:
        """End the turn with ``done``: ``meta`` (the caller's fields), ``usage``, then the
        reply's ``tokens``, ``chars``, ``sha256``, its parts' ``parts`` and
        ``parts_sha256`` (when it has parts) and ``finish_reason`` (:data:`CANCELLED` for a
        stopped turn). A streamed part still open is ended first (a stopped turn's stay
        as they are: the reply is partial); a tool call whose arguments are not JSON then
        raises :class:`relay.protocol.parts.PartError` and the turn stays open (end it
        with :meth:`error`). Returns its offset; the lock is given back."""
        self._check_open()
        if finish_reason != CANCELLED:
            self.end_open_parts()
        try:
            await self.flush()
            body: dict[str, Any] = {
                "duration_ms": round((time.monotonic() - self.t0) * 1000, 1),
                **(usage.meta() if usage is not None else {}),
                **(meta or {}),
                **reply_integrity(self.text, len(self.deltas)),
                **self.parts_integrity(),
                "finish_reason": finish_reason,
            }
            at = await self._terminal(Draft(kind="done", meta=body), "done")
            if finish_reason == CANCELLED:
                p = self.producer
                with contextlib.suppress(RelayError):
                    await p.store.mark_stopped(self.sid, self.turn, at, p.ttl_s)
            return at
        finally:
            await self.close()

    async def error(
        self,
        reason: str,
        *,
        code: str | None = "producer_error",
        meta: Mapping[str, Any] | None = None,
    ) -> int:
        """End the turn with ``error`` (``text`` = ``reason``; ``meta.code``, ``tokens``
        written before it). Returns its offset; the lock is given back."""
        self._check_open()
        try:
            with contextlib.suppress(RelayError):
                await self.flush()  # what was written goes first; the error frame says why
            body: dict[str, Any] | None = None
            if code is not None:
                body = {"code": code, "tokens": len(self.deltas), **(meta or {})}
            elif meta:
                body = dict(meta)
            return await self._terminal(Draft(kind="error", text=reason, meta=body), "error")
        finally:
            await self.close()

    async def _terminal(self, draft: Draft, how: str) -> int:
        if self.lock_lost:
            raise LockLost(f"session {self.sid}: turn {self.turn} lost its turn lock")
        self._closed = how
        self.close_parts()
        return (await self.generation.publish([draft]))[0]

    async def close(self) -> None:
        """Stop the turn's helpers and give the lock back (no terminal frame: a turn
        closed without one is ended by a relay's reaper once its lock expires... which
        this releases, so the reaper may end it at once)."""
        if self._closed is None:
            self._closed = "closed"
        self._ended.set()
        if not self.pump_task.done():
            self._pump.close()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(self.pump_task), 5.0)
            self.pump_task.cancel()
        if self.guard_task is not None and not self.guard_task.done():
            self.guard_task.cancel()
        p = self.producer
        with contextlib.suppress(RelayError):
            await lock_release(p.store, self.sid, self.owner)

    def _check_open(self) -> None:
        if self._closed is not None:
            raise TurnClosed(self.sid, self.turn, self._closed)
        if self.lock_lost:
            raise LockLost(f"session {self.sid}: turn {self.turn} lost its turn lock")

    async def _run_pump(self) -> RelayError | None:
        try:
            await self._pump.run()
        except RelayError as exc:
            return exc
        return None

    async def _publish_batch(self, b: Batch) -> None:
        if self.lock_lost:
            return  # the stream is no longer ours: publish nothing more
        text = b.text
        if b.part is not None:  # a part's frame, or a run of one part's deltas
            big = len(text.encode("utf-8", "surrogatepass")) > MAX_DELTA_BYTES
            drafts = [Draft(kind="part", text=c, meta=b.part)
                      for c in (chunks(text) if big else [text])]  # fmt: skip
            await self.generation.publish(drafts)
            return
        meta, self._pending_meta = self._pending_meta, None
        if b.count > 1:
            meta = {**(meta or {}), "n": b.count}
        drafts = [Draft(kind="token", text=text, meta=meta)]
        if len(text.encode("utf-8", "surrogatepass")) > MAX_DELTA_BYTES:
            drafts = [Draft(kind="token", text=c, meta=meta if i == 0 else None)
                      for i, c in enumerate(chunks(text))]  # fmt: skip
        await self.generation.publish(drafts)
        if self._on_batch is not None:
            self._on_batch(b)

    # ---- being told to stop ---------------------------------------------------------------

    def on_stop(self, callback: Callable[[StopReason], None]) -> None:
        """Call ``callback(reason)`` (once) when the turn should stop; at once if it has."""
        self._stop_callbacks.append(callback)
        if self.stop_reason is not None:
            callback(self.stop_reason)

    async def stopped(self) -> StopReason:
        """Wait until the turn should stop: a client stopped it, nobody watches, or its
        lock was lost."""
        await self._stopped.wait()
        assert self.stop_reason is not None
        return self.stop_reason

    def signal(self, reason: StopReason) -> None:
        """Record that the turn should stop (the guard task does; a caller may too)."""
        if reason is StopReason.LOCK_LOST:
            self.lock_lost = True
        if self.stop_reason is not None:
            return
        self.stop_reason = reason
        self._stopped.set()
        for cb in self._stop_callbacks:
            cb(reason)

    async def refresh(self) -> LockState:
        """Extend the turn lock and read the stop record (one round trip); signals
        :attr:`StopReason.LOCK_LOST` or :attr:`StopReason.CANCELLED` as found."""
        p = self.producer
        state = await lock_refresh(p.store, self.sid, self.owner, p.lock_ttl_ms, self.turn)
        if state is LockState.LOST:
            self.signal(StopReason.LOCK_LOST)
        elif state is LockState.STOP_ASKED:
            self.signal(StopReason.CANCELLED)
        return state

    def guard(
        self,
        policy: PresencePolicy | None = None,
        *,
        local_watchers: Callable[[], int] | None = None,
    ) -> asyncio.Task[None]:
        """Start the guard task: every ``policy.interval_s`` refresh the lock (see
        :meth:`refresh`) and count the relays with viewers; none for ``grace_s``:
        :attr:`StopReason.NO_VIEWERS`. ``local_watchers``: viewers in this process that
        no relay reports. Ends with the turn."""
        if self.guard_task is not None:
            return self.guard_task
        p = self.producer

        async def tick() -> None:
            if self._ended.is_set():
                return
            with contextlib.suppress(RelayError):  # Redis away: keep going
                await self.refresh()

        self.guard_task = p.spawn(
            f"presence:{self.sid}",
            follow_presence(
                p.store,
                self.sid,
                policy or p.presence,
                lambda: self.signal(StopReason.NO_VIEWERS),
                on_tick=tick,
                stop=self._ended,
                local_watchers=local_watchers,
            ),
        )
        return self.guard_task

    # ---- async with ---------------------------------------------------------------------------

    async def __aenter__(self) -> Turn:
        return self

    async def __aexit__(self, typ: type[BaseException] | None, exc: BaseException | None,
                        tb: object) -> None:  # fmt: skip
        if self.closed:
            return
        if exc is None:
            reason: str | None = CANCELLED if self.stop_reason is StopReason.CANCELLED else "stop"
            await self.done(finish_reason=reason)
        elif isinstance(exc, (StaleEpoch, LockLost)):
            await self.close()  # the stream is no longer ours: no terminal frame
        else:
            with contextlib.suppress(RelayError):
                await self.error("producer failed", code="producer_error")
