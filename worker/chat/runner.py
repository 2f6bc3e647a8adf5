"""Running an admitted turn: the engine's reply into the session's stream, then its end.

:class:`worker.chat.turn.TurnManager` admits a turn (lock held, lease taken, generation
open, ``meta`` frame out), puts it in its table of running turns and spawns
:meth:`TurnRunner.run` for it; from there on the turn is this module's until its
terminal frame.

Generation (a supervised task per turn, ``turn:<sid>``, :meth:`TurnRunner.run`, on the
worker's :class:`relay.service.supervise.Supervisor`, like its three helpers): the turn
is written with the producer API (:class:`relay.producer.Turn`, the one producer
implementation): an engine-reader task (``reader:<sid>``) writes deltas into the turn,
whose pump task (``pump:<sid>``) publishes coalesced ``token`` frames; its guard task
(``presence:<sid>``, :func:`relay.producer.presence.follow_presence`) refreshes the lock and
tells the runner (``Turn.on_stop``) when nobody watched for the grace period, or when
its refresh finds a stop asked of the turn (:mod:`worker.chat.cancel`: the fallback of
a stop's notification, which aborts at once). The reader and the pump end with the
engine's or Redis' failure as their result (the turn's outcome), so the supervisor
logs only what nobody expected. A runner whose lock refresh finds the lock no longer
its own (expired during an outage and taken or reaped) stops: it aborts the engine
request and publishes nothing more, not even a terminal frame (the reaper or the newer
turn ends the stream; the epoch fencing stays as the second line).
The first token frame's meta carries the TTFT and the engine's cached-prefix tokens
(known only when the engine answers, so not in the ``meta`` frame); the TTFT is the
time to the first generated token of any kind (text, reasoning, a tool call's chunk), so
a reply of tool calls alone has one in its ``done`` frame.

End (:meth:`TurnRunner._end`): exactly one terminal frame (the outcomes:
:mod:`worker.chat.turnstate`); on every path the lease is released exactly once, the
lock given back, the turn taken out of the manager's table and its outcome recorded.
Aborts (:meth:`worker.chat.turnstate.RunningTurn.abort`) cancel only the engine reader
(closing the upstream response, so the engine stops); the pump is then closed and
drained, never cancelled mid-publish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final

from relay.broker.errors import Fenced, RelayError
from relay.producer import ChatParts, PartError, StopReason
from relay.service.supervise import Supervisor
from worker.chat.store import SessionStore
from worker.chat.turnstate import (
    CANCELLED_FINISH,
    AbortReason,
    RunningTurn,
    StreamChat,
    TurnConfig,
    TurnOutcome,
)
from worker.engines.client import REPLY_SEED_HEADER
from worker.engines.errors import (
    ENGINE_REFUSED,
    PROMPT_TOO_LONG,
    EngineError,
    EngineProtocolError,
    EngineTimeout,
    EngineUnavailable,
)
from worker.metrics import WorkerMetrics
from worker.routing.lease import AllEnginesFull, release_once
from worker.routing.router import Router

__all__ = ["TurnRunner"]

log = logging.getLogger(__name__)

_HELPER_EXIT_S: Final = 2.0
_ABORTS: Final = {
    StopReason.CANCELLED: AbortReason.CANCELLED,
    StopReason.NO_VIEWERS: AbortReason.NO_VIEWERS,
    StopReason.LOCK_LOST: AbortReason.LOCK_LOST,
}  # how long _end waits for the presence and pump tasks to stop
# an engine error's own code -> the turn's outcome (any other: engine_error)
_FAILED: Final = {
    PROMPT_TOO_LONG: TurnOutcome.PROMPT_TOO_LONG,
    ENGINE_REFUSED: TurnOutcome.ENGINE_REFUSED,
}


def _engine_parts(apply: Callable[[Any], None], extra: Any) -> None:
    """Apply an engine's parts to the turn; what would corrupt the reply (arguments that
    are not JSON) is the engine's broken answer: the turn ends with its error."""
    try:
        apply(extra)
    except PartError as exc:
        raise EngineProtocolError(f"the engine's tool call: {exc}") from None


def _is_part(extra: Any) -> bool:
    """Whether an engine delta's ``extra`` starts or carries a part (a tool call's chunk,
    reasoning): generated tokens, as text is."""
    return isinstance(extra, dict) and bool(
        extra.get("tool_calls") or extra.get("reasoning_content") or extra.get("reasoning")
    )


class TurnRunner:
    """Runs admitted turns to their terminal frame; one per
    :class:`worker.chat.turn.TurnManager`.

    ``running`` and ``outcomes`` are the manager's: a turn leaves ``running`` and its
    outcome joins ``outcomes`` when it ends."""

    def __init__(
        self,
        *,
        store: SessionStore,
        router: Router,
        engine: StreamChat,
        metrics: WorkerMetrics,
        config: TurnConfig,
        supervisor: Supervisor,
        running: dict[str, RunningTurn],
        outcomes: deque[tuple[str, int, TurnOutcome]],
    ) -> None:
        self.store = store
        self.router = router
        self.engine = engine
        self.metrics = metrics
        self.cfg = config
        self.supervisor = supervisor
        self.running = running
        self.outcomes = outcomes

    async def run(self, t: RunningTurn) -> None:
        outcome = TurnOutcome.DONE
        error: str | None = None
        # Supervised like every task (a bug is logged; stop(), after the drain, cancels
        # what is left); run and _end await them. An engine's or Redis' failure is their
        # result: the turn's outcome, not a crash for the supervisor to log.
        t.reader = self.supervisor.spawn(f"reader:{t.sid}", self._read_engine(t))
        if t.abort_reason is not None:  # stopped before it ran (a stop during admission)
            t.reader.cancel()
        pump_task = t.gen.pump_task  # the producer's pump publishes the coalesced deltas

        def on_stop(reason: StopReason) -> None:
            if reason is StopReason.LOCK_LOST:
                log.warning("turn %s/%d: turn lock lost; stopping", t.sid, t.gen.turn)
                t.lock_lost = True
            t.abort(_ABORTS[reason])

        t.gen.on_stop(on_stop)  # the lock refresh (a stop's record, a lost lock), presence
        t.gen.guard(self.cfg.presence, local_watchers=t.local_watchers)
        try:
            done, _ = await asyncio.wait({t.reader, pump_task}, return_when=asyncio.FIRST_COMPLETED)
            if pump_task in done:  # the pump only ends early on an error: stop the engine
                t.reader.cancel()
                with contextlib.suppress(BaseException):
                    await t.reader
                release_once(t.lease)
                stopped = await pump_task  # the pump only ends early on a failure
                raise stopped or RuntimeError("token pump stopped early")
            try:
                failed = await t.reader
            except asyncio.CancelledError:
                if t.abort_reason is None:
                    raise  # we are being cancelled ourselves
                outcome, error = t.abort_reason.outcome, t.abort_reason
            else:
                if isinstance(failed, EngineTimeout):  # its request was closed: the engine aborts
                    log.warning("turn %s/%d: %s on %s (%s); its request aborted", t.sid,
                                t.gen.turn, failed.message, t.lease.engine.id,
                                failed.engine_url)  # fmt: skip
                    outcome, error = TurnOutcome.TIMEOUT, failed.message
                elif failed is not None:  # the frame gets a short reason, the log the URL
                    log.warning("turn %s/%d: %s", t.sid, t.gen.turn, failed.message)
                    outcome = _FAILED.get(failed.code or "", TurnOutcome.ENGINE_ERROR)
                    error = failed.public_reason
            finally:
                release_once(t.lease)  # the engine is done with us, whatever happens next
            await t.gen.flush(60.0)  # raises what stopped the pump (publishes retry 10 s)
        except Fenced as exc:
            outcome, error = TurnOutcome.FENCED, None
            log.warning("turn %s/%d fenced: %s", t.sid, t.gen.turn, exc)
        except RelayError as exc:
            log.warning("turn %s/%d: redis: %r", t.sid, t.gen.turn, exc)
            outcome, error = TurnOutcome.REDIS_ERROR, "redis unavailable"
        except asyncio.CancelledError:
            outcome, error = TurnOutcome.SHUTDOWN, AbortReason.SHUTDOWN
            t.abort(AbortReason.SHUTDOWN)
            await self._end(t, outcome, error)
            raise
        except Exception as exc:
            log.exception("turn %s/%d failed", t.sid, t.gen.turn)
            outcome, error = TurnOutcome.INTERNAL_ERROR, f"internal error: {type(exc).__name__}"
        await self._end(t, outcome, error)

    async def _end(self, t: RunningTurn, outcome: TurnOutcome, error: str | None) -> None:
        if t.lock_lost and outcome is not TurnOutcome.FENCED:
            outcome, error = TurnOutcome.LOCK_LOST, None
        t.ended.set()
        guard = t.gen.guard_task
        if guard is not None:
            guard.cancel()
        if t.reader is not None and not t.reader.done():
            t.reader.cancel()
        # let a publish in flight land: never cancel mid-publish (flush waits, then cancels)
        with contextlib.suppress(BaseException):
            await t.gen.flush(5.0)
        # Bounded: a helper task that swallowed its cancellation must not keep the turn
        # from its terminal frame and its lock from being released.
        helpers = {t.gen.pump_task, *([guard] if guard is not None else [])}
        _, stuck = await asyncio.wait(helpers, timeout=_HELPER_EXIT_S)
        for task in stuck:
            log.warning("turn %s/%d: %s did not stop", t.sid, t.gen.turn, task.get_name())
        # (what a helper raised is the supervisor's to retrieve and log: they are its tasks)
        release_once(t.lease)
        try:
            if outcome.keeps_reply:
                if outcome is TurnOutcome.CANCELLED:
                    t.finish_reason = CANCELLED_FINISH
                # the done frame's offset: this turn's next (the pump has stopped), so
                # the history can name it
                to = t.gen.next_offset
                await self.store.append_exchange(t.sid, t.exchange(to), t.lease.engine.id)
                # the producer writes the reply's integrity and, for a stopped turn, the
                # stop record's terminal offset
                await t.gen.done(finish_reason=t.finish_reason, meta=t.done_meta())
            elif not outcome.publishes_nothing:
                meta = {"engine": t.lease.engine.id, "tokens": len(t.reply)}
                await t.gen.error(error or outcome, code=outcome, meta=meta)
        except Fenced:
            outcome = TurnOutcome.FENCED
        except RelayError as exc:
            log.warning("turn %s/%d: terminal frame lost: %s", t.sid, t.gen.turn, exc)
        finally:
            with contextlib.suppress(RelayError):
                await t.gen.close()  # no-op after a terminal frame; gives the lock back
            with contextlib.suppress(RelayError):
                await self.store.release_lock(t.sid, t.owner)
            if self.running.get(t.sid) is t:
                del self.running[t.sid]
            self.metrics.turns.labels(outcome=outcome).inc()
            if outcome.is_cancellation:
                self.metrics.cancellations.labels(reason=outcome).inc()
            self.outcomes.append((t.sid, t.gen.turn, outcome))

    async def _read_engine(self, t: RunningTurn) -> EngineError | None:
        """Stream the reply; return how the engine failed (None: it finished). An engine
        that refuses the connection before answering (killed, restarting; the control
        plane has not seen it leave yet) is skipped once: the lease moves to the next
        engine for the routing key."""
        try:
            await self._read_engine_once(t)
        except EngineUnavailable as exc:
            if exc.mid_stream or t.reply:
                return exc
            try:
                lease = self.router.route(t.route_key, avoid=t.lease.engine.id)
            except AllEnginesFull:
                return exc
            log.warning("turn %s/%d: %s; retrying on %s", t.sid, t.gen.turn, exc, lease.engine.id)
            release_once(t.lease)
            t.lease = lease
            try:
                await self._read_engine_once(t)
            except EngineError as again:
                return again
        except EngineError as exc:
            return exc
        return None

    async def _read_engine_once(self, t: RunningTurn) -> None:
        seed = None if t.reply_seed is None else {REPLY_SEED_HEADER: str(t.reply_seed)}
        profile = self.router.profiles.get(t.lease.engine.id)
        stream = self.engine.stream_chat(
            t.lease.engine.url, self.cfg.model, t.prompt, t.max_tokens,
            extra_body=t.options or None, headers=seed,
            first_token_timeout_s=profile.first_token_timeout_s or None,
        )  # fmt: skip
        parts = ChatParts(t.gen)  # tool calls and reasoning, as the turn's parts
        try:
            async for d in stream:
                if d.meta is not None and t.first_meta is None:
                    t.engine_reported = d.meta.engine_id
                    t.cached_tokens = d.meta.cached_tokens
                    t.prompt_tokens = d.meta.prompt_tokens
                if d.usage is not None:  # the final delta: all the engine said, anywhere
                    t.take_usage(d.usage)
                    self.router.profiles.learn_turn(
                        t.lease.engine.id, computed_tokens=d.usage.computed_tokens,
                        prefill_s=d.usage.prefill_s, completion_tokens=d.usage.completion_tokens,
                        decode_s=d.usage.decode_s,
                    )  # fmt: skip
                    if t.cached_tokens is not None and t.prompt_tokens:
                        t.lease.cached(t.cached_tokens, t.prompt_tokens)  # what it kept
                if t.ttft_s is None and (d.text or _is_part(d.extra)):
                    # the first token of any kind: a reply of tool calls alone has one too
                    t.lease.first_token()  # cost_aware: this engine's prefill is done
                    t.ttft_s = time.monotonic() - t.t0
                    self.metrics.ttft.observe(t.ttft_s)
                    t.first_meta = {
                        "ttft_ms": round(t.ttft_s * 1000, 1),
                        "cached_tokens": t.cached_tokens,
                        "prompt_tokens": t.prompt_tokens,
                        "engine_reported": t.engine_reported,
                    }
                if d.text:
                    first = t.first_meta if not t.sent_first_meta else None
                    t.sent_first_meta = True
                    t.reply.append(d.text)
                    t.gen.write(d.text, first)  # the first token's frame carries its meta
                if d.extra:
                    _engine_parts(parts.feed, d.extra)
                if d.finish_reason is not None:
                    t.finish_reason = d.finish_reason
            _engine_parts(lambda _: parts.end(), None)
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:  # closes the upstream response: the engine aborts
                await aclose()
        if t.cached_tokens:
            self.metrics.cached_tokens.inc(t.cached_tokens)
        if t.prompt_tokens:
            self.metrics.prompt_tokens.inc(t.prompt_tokens)
