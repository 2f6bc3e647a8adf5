"""Supervised background work: one type for every loop a process runs beside its requests.

A process (relay, worker, engine, job worker) makes one :class:`Supervisor` and starts
every background loop through it:

- :meth:`Supervisor.every` calls ``step()`` every ``interval_s`` (presence refresh, reaper,
  engine probes, load exchange, heartbeats);
- :meth:`Supervisor.forever` runs ``run()`` and starts it again when it returns or fails
  (a subscriber's read loop);
- :meth:`Supervisor.spawn` runs a one-off task whose failure is logged, never lost;
- :meth:`Supervisor.stop` cancels and awaits all of them, and never raises.

What every loop gets, so no loop has to write it again:

- **the one error mapper**: each step runs inside
  :func:`relay.broker.rediscluster.errors.map_redis_errors`, so a redis-py exception (and the
  ``AttributeError``/``TypeError`` redis-py leaks on a closed connection) arrives as
  :class:`~relay.broker.errors.RedisUnavailable` or :class:`~relay.broker.errors.RedisCommandError`;
- **logged failures**: a :class:`~relay.broker.errors.RelayError` (an expected outage)
  is one warning line with its reason; anything else is a bug and is logged with its
  traceback; the loop goes on either way;
- **jittered exponential backoff** after a failure (:class:`Backoff`), reset by a success;
- **health**: a loop that has failed ``unhealthy_after`` times in a row is unhealthy until
  its next success (``every``) or until it has run ``stable_s`` without failing
  (``forever``); a *critical* unhealthy loop makes :meth:`Supervisor.not_ready` name it,
  and ``/readyz`` answers 503 with that reason instead of serving from a frozen view;
- **conditions**: :meth:`Supervisor.set_condition` raises or clears a named reason of
  its own (``redis_unreachable`` while start-up retries its first connection);
- **metrics**: ``tokenrelay_loop_failures_total{loop}``, ``tokenrelay_loop_restarts_total{loop}``
  (a ``forever`` loop started again) and ``tokenrelay_loop_healthy{loop}`` (1 or 0), in the
  registry the process passes.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Gauge

from relay.broker.errors import RelayError
from relay.broker.rediscluster.errors import map_redis_errors

__all__ = ["QUICK_BACKOFF", "Backoff", "Loop", "LoopMetrics", "Supervisor", "retrieve"]

log = logging.getLogger(__name__)

STOP_TIMEOUT_S: Final = 5.0


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff with "equal jitter": half the delay fixed, half random.

    ``delay(n)`` for the n-th consecutive failure (n >= 1) lies in ``[d/2, d]`` with
    ``d = min(cap_s, base_s * 2**(n-1))``: it grows, it is bounded, and processes that
    failed together do not retry together.
    """

    base_s: float = 0.2
    cap_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0 < self.base_s <= self.cap_s:
            raise ValueError("backoff needs 0 < base_s <= cap_s")

    def delay(self, failures: int, rng: random.Random | None = None) -> float:
        if failures < 1:
            return 0.0
        d = min(self.cap_s, self.base_s * 2.0 ** min(failures - 1, 60))
        return d / 2 + (rng or random).uniform(0, d / 2)


# The relay's loops and retries: short (the loops are cheap, and a resubscribe or a
# backlog read after a failover should not wait long), capped at a second.
QUICK_BACKOFF: Final = Backoff(base_s=0.05, cap_s=1.0)


def retrieve(fut: asyncio.Future[Any]) -> BaseException | None:
    """The outcome of a finished future nobody awaits (a task whose result only matters
    if it failed, a readiness future several waiters share): its exception, marked as
    retrieved, so asyncio logs no "exception was never retrieved"; None if it was
    cancelled, is not done, or succeeded."""
    if not fut.done() or fut.cancelled():
        return None
    return fut.exception()


class LoopMetrics:
    """The supervisor's metrics, declared once per registry."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.failures = Counter(
            "tokenrelay_loop_failures",
            "Failed steps (or crashes) of a background loop.",
            ["loop"],
            registry=registry,
        )
        self.restarts = Counter(
            "tokenrelay_loop_restarts",
            "Times a long-running background loop was started again after it ended.",
            ["loop"],
            registry=registry,
        )
        self.healthy = Gauge(
            "tokenrelay_loop_healthy",
            "1 while a background loop is healthy, 0 while it keeps failing.",
            ["loop"],
            registry=registry,
        )


@dataclass(slots=True)
class Loop:
    """One supervised loop: its state as /readyz and the metrics see it."""

    name: str
    critical: bool
    unhealthy_after: int
    failures_in_row: int = 0
    failures: int = 0
    restarts: int = 0
    last_error: str = ""
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def healthy(self) -> bool:
        return self.failures_in_row < self.unhealthy_after


def _being_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class Supervisor:
    """Owns a process's background loops and one-off tasks; see the module docstring."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        backoff: Backoff = Backoff(),
        unhealthy_after: int = 3,
        stable_s: float = 5.0,
        rng: random.Random | None = None,
    ) -> None:
        if unhealthy_after < 1:
            raise ValueError("unhealthy_after must be >= 1")
        self.metrics = LoopMetrics(registry)
        self.backoff = backoff
        self.unhealthy_after = unhealthy_after
        self.stable_s = stable_s
        self._rng = rng or random.Random()
        self.loops: dict[str, Loop] = {}
        self._spawned: set[asyncio.Task[Any]] = set()
        self._conditions: dict[str, bool] = {}
        self._stopping = False

    # -- readiness --------------------------------------------------------------------

    def set_condition(self, reason: str, active: bool) -> None:
        """Raise (``active=True``) or clear a named reason not to be ready."""
        self._conditions[reason] = active

    def not_ready(self) -> list[str]:
        """Why the process must not take traffic: active conditions, then ``<loop>_failing``
        for each critical loop that keeps failing. Empty when ready."""
        reasons = [r for r, on in self._conditions.items() if on]
        reasons += [
            f"{lp.name}_failing" for lp in self.loops.values() if lp.critical and not lp.healthy
        ]
        return reasons

    # -- starting -----------------------------------------------------------------------

    def every(
        self,
        name: str,
        interval_s: float,
        step: Callable[[], Awaitable[object]],
        *,
        critical: bool = True,
        first_delay_s: float = 0.0,
    ) -> Loop:
        """Call ``step()`` every ``interval_s`` seconds (after a failure: after the backoff
        delay, if longer). Returns at once; the loop runs until :meth:`stop`."""
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        loop = self._add(name, critical)
        loop.task = asyncio.create_task(
            self._every(loop, interval_s, step, first_delay_s), name=name
        )
        return loop

    def forever(
        self, name: str, run: Callable[[], Awaitable[object]], *, critical: bool = True
    ) -> Loop:
        """Run ``run()``; whenever it returns or raises, log it and run it again after the
        backoff delay. Returns at once; the loop runs until :meth:`stop`."""
        loop = self._add(name, critical)
        loop.task = asyncio.create_task(self._forever(loop, run), name=name)
        return loop

    def spawn(self, name: str, coro: Coroutine[Any, Any, object]) -> asyncio.Task[Any]:
        """Run a one-off task; if it fails, its exception is logged (never lost). The
        task is cancelled by :meth:`stop` if still running."""
        task = asyncio.create_task(coro, name=name)
        self._spawned.add(task)
        task.add_done_callback(self._spawn_done)
        return task

    def _add(self, name: str, critical: bool) -> Loop:
        if name in self.loops and self.loops[name].task is not None:
            raise ValueError(f"a loop named {name!r} is already running")
        loop = Loop(name, critical, self.unhealthy_after)
        self.loops[name] = loop
        self.metrics.healthy.labels(name).set(1)
        return loop

    # -- the loops ---------------------------------------------------------------------

    async def _every(
        self,
        loop: Loop,
        interval_s: float,
        step: Callable[[], Awaitable[object]],
        first_delay_s: float,
    ) -> None:
        if first_delay_s > 0:
            await asyncio.sleep(first_delay_s)
        while True:
            started = time.monotonic()
            ok = await self._attempt(loop, step)
            if self._stopping:
                return
            if ok:
                self._succeeded(loop)
                wait = interval_s - (time.monotonic() - started)
            else:
                wait = max(interval_s - (time.monotonic() - started), self._delay(loop))
            await asyncio.sleep(max(wait, 0.0))

    async def _forever(self, loop: Loop, run: Callable[[], Awaitable[object]]) -> None:
        while True:
            started = time.monotonic()
            # running stable_s without failing makes the loop healthy again, while it runs
            timer = asyncio.get_running_loop().call_later(self.stable_s, self._succeeded, loop)
            try:
                ok = await self._attempt(loop, run)
            finally:
                timer.cancel()
            if self._stopping:  # a run that swallowed its cancellation still ends here
                return
            if ok:  # a run that returns is a loop that stopped on its own: start it again
                log.warning("background loop %s ended; starting it again", loop.name)
                self._failed(loop, "ended")
            if time.monotonic() - started >= self.stable_s:
                loop.failures_in_row = min(loop.failures_in_row, 1)  # back off from the start
            await asyncio.sleep(self._delay(loop))
            loop.restarts += 1
            self.metrics.restarts.labels(loop.name).inc()

    async def _attempt(self, loop: Loop, call: Callable[[], Awaitable[object]]) -> bool:
        """Run one step (or one run); False when it failed. Cancellation passes through."""
        try:
            with map_redis_errors():
                await call()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self._stopping or _being_cancelled():
                # the step turned its own cancellation into another exception: the loop
                # still stops (it would otherwise run on after stop()), and says what
                log.warning("background loop %s raised while stopping", loop.name, exc_info=exc)
                raise asyncio.CancelledError from exc
            return self._caught(loop, exc)
        return True

    def _caught(self, loop: Loop, exc: Exception) -> bool:
        """Log and count a failed step; always False."""
        if isinstance(exc, RelayError):  # an outage the code expects: one line, no traceback
            log.warning("background loop %s: %s: %s", loop.name, type(exc).__name__, exc)
            self._failed(loop, f"{type(exc).__name__}: {exc}")
            return False
        # a bug: keep the traceback, keep the loop
        log.error("background loop %s failed", loop.name, exc_info=exc)
        self._failed(loop, f"{type(exc).__name__}: {exc}")
        return False

    def _failed(self, loop: Loop, why: str) -> None:
        loop.failures += 1
        loop.failures_in_row += 1
        loop.last_error = why[:200]
        self.metrics.failures.labels(loop.name).inc()
        if not loop.healthy:
            self.metrics.healthy.labels(loop.name).set(0)

    def _succeeded(self, loop: Loop) -> None:
        if loop.failures_in_row and not loop.healthy:
            log.info("background loop %s is healthy again", loop.name)
        loop.failures_in_row = 0
        self.metrics.healthy.labels(loop.name).set(1)

    def _delay(self, loop: Loop) -> float:
        return self.backoff.delay(max(loop.failures_in_row, 1), self._rng)

    def _spawn_done(self, task: asyncio.Task[Any]) -> None:
        self._spawned.discard(task)
        exc = retrieve(task)
        if exc is None:
            return
        if isinstance(exc, RelayError):
            log.warning("task %s: %s: %s", task.get_name(), type(exc).__name__, exc)
        else:
            log.error("task %s failed", task.get_name(), exc_info=exc)

    # -- stopping ---------------------------------------------------------------------

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Cancel every loop and spawned task and wait for them (bounded). Never raises:
        what a task raises while it stops is logged."""
        self._stopping = True
        tasks = [lp.task for lp in self.loops.values() if lp.task is not None]
        tasks += list(self._spawned)
        for t in tasks:
            t.cancel()
        if not tasks:
            return
        try:
            done, pending = await asyncio.wait(tasks, timeout=timeout_s)
        except asyncio.CancelledError:
            raise  # the caller itself is being cancelled: let it be
        for t in done:
            exc = retrieve(t)
            if exc is not None:
                log.error("task %s raised while stopping", t.get_name(), exc_info=exc)
        for t in pending:
            log.error("task %s did not stop within %.1f s", t.get_name(), timeout_s)
        for lp in self.loops.values():
            lp.task = None
