"""Offline jobs on RabbitMQ: the queue topology, the submitter and the job runner.

Why a queue here and Pub/Sub for tokens: a job must survive a crash of whoever runs it,
wait its turn when engines are busy (peak shaving), and be delivered once as a whole;
none of that is what Pub/Sub is for, and all of it is what a durable queue does.

Topology (declared idempotently by submitters and runners alike):

- ``<queue>``: a durable **quorum** queue (replicated, survives a broker restart) with
  ``x-delivery-limit`` (:data:`BROKER_DELIVERY_LIMIT`) and a dead-letter exchange;
- ``<queue>.dlx`` (fanout) -> ``<queue>.dead``: where a poison job lands after
  ``max_attempts`` deliveries, for an operator to look at.

A message is ``{"v": 1, "job": <id>}`` (persistent); the job's inputs and state live in
its Redis record (:class:`worker.jobs.record.JobStore`), so a redelivery reads the same inputs.

:class:`JobRunner` consumes with a bounded prefetch. Per delivery: ``start`` the record
(a finished job's duplicate is acked and skipped); past ``max_attempts`` the job is
marked failed and rejected to the dead-letter queue; else it is routed by the same
prefix-aware router as chat, taking a slot only while the engine's load (every worker's,
through the load exchange) stays below its cap less a reserve that only chat may use,
generated, its result stored, a whole-reply message published on its session when it
has one, and only then acked. A runner killed mid-job never acks: the broker redelivers
to another runner, and the record keeps exactly one result.

Order of use: ``JobSubmitter(url, names)`` in the worker (``submit`` after the record is
created; ``close``); ``JobRunner(...).start(supervisor)`` / ``stop()`` in ``tokenrelay
jobworker`` (the consumer is the supervised loop ``job_consumer``, each job a supervised
task).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import orjson

from relay.broker.errors import Fenced, RelayError
from relay.broker.port import Draft, TurnStore
from relay.producer.integrity import message_meta
from relay.service.supervise import Backoff, Supervisor
from worker.chat.store import SessionStore
from worker.engines.client import EngineClient
from worker.engines.errors import EngineError
from worker.jobs.record import JobSpec, JobStore, within_reserve
from worker.routing.key import routing_key
from worker.routing.lease import AllEnginesFull, Lease, release_once
from worker.routing.router import Router
from worker.routing.wait import route_wait

if TYPE_CHECKING:  # aio-pika is the jobs extra: imported when a queue is first used
    from aio_pika.abc import (
        AbstractChannel,
        AbstractIncomingMessage,
        AbstractQueue,
        AbstractQueueIterator,
        AbstractRobustConnection,
    )

__all__ = ["JobRunner", "JobSubmitter", "QueueNames", "RunnerConfig", "declare"]

log = logging.getLogger(__name__)
BROKER_DELIVERY_LIMIT: Final = 20
_BACKOFF_CAP_S: Final = 10.0  # the longest pause before a failed attempt is handed back
_FRAME_TEXT: Final = 64 * 1024  # a whole reply goes out in token frames of at most this


@dataclass(frozen=True, slots=True)
class QueueNames:
    queue: str = "tokenrelay.jobs"
    max_attempts: int = 3

    @property
    def dlx(self) -> str:
        return f"{self.queue}.dlx"

    @property
    def dead(self) -> str:
        return f"{self.queue}.dead"


async def declare(channel: AbstractChannel, names: QueueNames) -> AbstractQueue:
    """The queue, its dead-letter exchange and queue; returns the work queue."""
    import aio_pika  # the jobs extra (the worker and the job worker refuse to start without it)

    dlx = await channel.declare_exchange(names.dlx, aio_pika.ExchangeType.FANOUT, durable=True)
    dead = await channel.declare_queue(
        names.dead, durable=True, arguments={"x-queue-type": "quorum"}
    )
    await dead.bind(dlx)
    return await channel.declare_queue(
        names.queue,
        durable=True,
        arguments={
            "x-queue-type": "quorum",
            # The broker's own bound, above any runner's --max-attempts (which dead-letters
            # first, with the reason in the record): it catches a runner that crashes on
            # the message before it can count the attempt. Fixed, so that every submitter
            # and runner declares the queue with the same arguments.
            "x-delivery-limit": BROKER_DELIVERY_LIMIT,
            "x-dead-letter-exchange": names.dlx,
        },
    )


class JobSubmitter:
    """Publishes job messages with publisher confirms; connects on first use."""

    def __init__(self, url: str, names: QueueNames, connect_timeout_s: float = 5.0) -> None:
        self.url = url
        self.names = names
        self.connect_timeout_s = connect_timeout_s
        self._conn: AbstractRobustConnection | None = None
        self._channel: AbstractChannel | None = None
        self._lock = asyncio.Lock()

    async def _ready(self) -> AbstractChannel:
        import aio_pika

        async with self._lock:
            if self._channel is None or self._channel.is_closed:
                if self._conn is None:
                    self._conn = await asyncio.wait_for(
                        aio_pika.connect_robust(self.url), self.connect_timeout_s
                    )
                self._channel = await self._conn.channel(publisher_confirms=True)
                await declare(self._channel, self.names)
            return self._channel

    async def submit(self, job_id: str) -> None:
        """Returns once the broker confirmed the (persistent) message."""
        import aio_pika

        channel = await self._ready()
        body = orjson.dumps({"v": 1, "job": job_id})
        msg = aio_pika.Message(
            body,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=job_id,
            content_type="application/json",
        )
        await channel.default_exchange.publish(msg, routing_key=self.names.queue)

    async def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.close()
        self._conn = self._channel = None


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    worker_id: str = "jobworker"
    model: str = "tokenrelay-mock"
    prefetch: int = 2
    route_wait_s: float = 30.0  # then the job goes back to the queue
    chat_reserve: int = 0  # slots per engine that only chat may use
    # a failed attempt is handed back after a jittered backoff (relay.service.supervise)
    # that starts at backoff_s (> 0) and grows with the job's attempts, up to 10 s
    backoff_s: float = 1.0
    progress_every_s: float = 1.0
    notify_lock_wait_s: float = 30.0  # waiting for a session's running chat turn to end
    lock_owner_ttl_s: float = 5.0


def _whole_reply_frames(text: str) -> list[str]:
    return [text[i : i + _FRAME_TEXT] for i in range(0, len(text), _FRAME_TEXT)] or [""]


class JobRunner:
    """Consumes jobs and runs them on the engines (see the module docstring)."""

    def __init__(
        self,
        url: str,
        names: QueueNames,
        *,
        jobs: JobStore,
        router: Router,
        engine: EngineClient,
        turns: TurnStore,
        sessions: SessionStore,
        cfg: RunnerConfig,
    ) -> None:
        self.url = url
        self.names = names
        self.jobs = jobs
        self.router = router
        self.engine = engine
        self.turns = turns
        self.sessions = sessions
        self.cfg = cfg
        self.outcomes: list[tuple[str, str]] = []  # (job, outcome), for tests and logs
        self._conn: AbstractRobustConnection | None = None
        self._channel: AbstractChannel | None = None
        self._queue: AbstractQueue | None = None
        self._messages: AbstractQueueIterator | None = None
        self._supervisor: Supervisor | None = None
        self._own_supervisor = False
        self._stopping = asyncio.Event()
        self._running: set[asyncio.Task[Any]] = set()
        self._backoff = Backoff(base_s=cfg.backoff_s, cap_s=max(cfg.backoff_s, _BACKOFF_CAP_S))

    async def start(self, supervisor: Supervisor | None = None) -> None:
        """Connect and declare (raises when the broker cannot be reached), then consume on
        ``supervisor`` (or one of its own): the loop ``job_consumer`` reads deliveries
        and runs each job as a supervised task. Critical: a runner whose consumer died
        takes no job while it looks alive; the supervisor starts it again."""
        import aio_pika

        self._conn = await aio_pika.connect_robust(self.url)
        await self._open()
        self._own_supervisor = supervisor is None
        self._supervisor = supervisor or Supervisor()
        self._supervisor.forever("job_consumer", self._consume, critical=True)

    async def _open(self) -> AbstractQueue:
        """The work queue on a channel that is open: a new channel when the last one was
        closed (the robust connection reopens channels it lost, not ones closed on it)."""
        if self._queue is None or self._channel is None or self._channel.is_closed:
            assert self._conn is not None
            self._channel = await self._conn.channel()
            await self._channel.set_qos(prefetch_count=self.cfg.prefetch)
            self._queue = await declare(self._channel, self.names)
        return self._queue

    async def _consume(self) -> None:
        """Read deliveries until the iterator ends or fails (the supervisor starts it
        again, on a new channel if need be) or the runner stops (then wait to be
        cancelled)."""
        if self._stopping.is_set():
            await asyncio.Event().wait()  # stopped: nothing to consume, never restart
        queue = await self._open()
        assert self._supervisor is not None
        async with queue.iterator() as messages:
            self._messages = messages
            async for message in messages:
                task = self._supervisor.spawn(
                    f"job:{message.message_id}", self._on_message(message)
                )
                self._running.add(task)
                task.add_done_callback(self._running.discard)
        self._messages = None
        if self._stopping.is_set():
            await asyncio.Event().wait()

    @property
    def connected(self) -> bool:
        """The broker connection is up (the robust connection reconnects by itself)."""
        return self._conn is not None and not self._conn.is_closed and self._conn.connected.is_set()

    async def stop(self, deadline_s: float = 10.0) -> None:
        """Stop taking jobs; let running ones finish for ``deadline_s``; never raises,
        and a second call does nothing. A job still running after the deadline is not
        acked: the broker redelivers it."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        self._stopping.set()
        messages = self._messages
        if messages is not None:  # cancels the consumer: no new deliveries
            with contextlib.suppress(Exception):
                await asyncio.wait_for(messages.close(), 5.0)
        if self._running:
            await asyncio.wait(self._running, timeout=deadline_s)
        for t in list(self._running):
            t.cancel()
        if self._running:
            await asyncio.wait(self._running, timeout=5.0)
        sup, self._supervisor = self._supervisor, None
        if sup is not None and self._own_supervisor:
            await sup.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(conn.close(), 5.0)

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        try:
            outcome = await self._handle(message)
        except asyncio.CancelledError:
            raise  # not acked: redelivered
        except Exception:
            log.exception("job message %s failed", message.message_id)
            outcome = "crashed"
            await asyncio.sleep(self._backoff.delay(1))
            with contextlib.suppress(Exception):
                await message.nack(requeue=True)
        self.outcomes.append((message.message_id or "?", outcome))

    async def _handle(self, message: AbstractIncomingMessage) -> str:
        try:
            job_id = str(orjson.loads(message.body)["job"])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            await message.reject(requeue=False)  # not ours to run: dead-lettered
            return "malformed"
        status, attempt = await self.jobs.start(job_id, self.cfg.worker_id)
        if status != "running":
            await message.ack()  # finished (a duplicate delivery) or expired: nothing to do
            return f"skipped_{status}"
        if attempt > self.names.max_attempts:
            await self.jobs.fail(job_id, f"gave up after {attempt - 1} attempts")
            await message.reject(requeue=False)
            return "dead_lettered"
        rec = await self.jobs.get(job_id) or {}
        try:
            spec = JobSpec(
                prompt=rec["prompt"],
                system=rec.get("system") or None,
                max_tokens=int(rec.get("max_tokens", "1024")),
                session=rec.get("session") or None,
            )
        except (KeyError, ValueError) as exc:
            await self.jobs.fail(job_id, f"invalid job record: {exc}")
            await message.reject(requeue=False)
            return "invalid"
        try:
            result = await self._generate(job_id, spec)
        except (EngineError, AllEnginesFull, RelayError) as exc:
            log.warning("job %s attempt %d: %s", job_id, attempt, exc)
            await asyncio.sleep(self._backoff.delay(attempt))
            await message.nack(requeue=True)
            return "retry"
        if await self.jobs.finish(job_id, result) and spec.session is not None:
            await self._notify(job_id, spec, result)
        await message.ack()  # only now: a crash before this redelivers the job
        return "done"

    async def _generate(self, job_id: str, spec: JobSpec) -> dict[str, Any]:
        msgs = spec.messages()
        key = routing_key(spec.system, msgs[-1:], prefix_chars=2048)
        lease = await self._lease(key)
        parts: list[str] = []
        finish: str | None = None
        last = time.monotonic()
        try:
            stream = self.engine.stream_chat(
                lease.engine.url, self.cfg.model, msgs, spec.max_tokens
            )
            try:
                async for d in stream:
                    if d.text:
                        parts.append(d.text)
                    if d.finish_reason is not None:
                        finish = d.finish_reason
                    if time.monotonic() - last >= self.cfg.progress_every_s:
                        last = time.monotonic()
                        await self.jobs.progress(job_id, len(parts))
            finally:
                await stream.aclose()
        finally:
            release_once(lease)
        text = "".join(parts)
        return {
            "result": text,
            "tokens": len(parts),
            "chars": len(text),
            "sha256": hashlib.sha256(text.encode()).hexdigest(),
            "engine": lease.engine.id,
            "finish_reason": finish,
        }

    async def _lease(self, key: str) -> Lease:
        """A lease on an engine with room above the chat reserve (the router sees every
        worker's load through the load exchange), waiting up to ``route_wait_s``; else
        :class:`AllEnginesFull` (the job goes back to the queue)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.cfg.route_wait_s
        while True:
            lease = await route_wait(self.router, key, max(0.0, end - loop.time()))
            e = self.router.snapshot()["engines"].get(lease.engine.id, {})
            held, others = int(e.get("in_flight", 0)), int(e.get("others", 0))
            if within_reserve(held, others, lease.engine.cap, self.cfg.chat_reserve):
                return lease
            lease.release()  # chat's reserve: wait for room, do not take it
            if loop.time() >= end:
                raise AllEnginesFull(self.router.retry_after(), "engines busy with chat")
            await asyncio.sleep(min(0.25, max(0.0, end - loop.time())))

    async def _notify(self, job_id: str, spec: JobSpec, result: dict[str, Any]) -> None:
        """The whole report on the job's session: meta, the text, done. Waits for a
        running chat turn of that session to end (its turn lock), never fences it."""
        assert spec.session is not None
        sid = spec.session
        owner = f"{self.cfg.worker_id}:job:{uuid.uuid4().hex[:12]}"
        deadline = time.monotonic() + self.cfg.notify_lock_wait_s
        while (holder := await self.sessions.acquire_lock(sid, owner)) is not None:
            if time.monotonic() > deadline:
                log.warning("job %s: session %s busy (turn %d); not notified", job_id, sid,
                             holder.turn)  # fmt: skip
                await self.jobs.note(job_id, {"notified": 0, "notify_error": "session busy"})
                return
            await asyncio.sleep(0.2)
        try:
            gen = await self.turns.open_generation(sid)
            done = {k: result[k] for k in ("tokens", "chars", "sha256", "engine", "finish_reason")}
            asked = {"role": "user", **message_meta(spec.prompt), "job": job_id}
            drafts = [
                Draft(kind="meta", meta=asked),
                *(Draft(kind="token", text=t) for t in _whole_reply_frames(str(result["result"]))),
                Draft(kind="done", meta={**done, "job": job_id}),
            ]
            await gen.publish(drafts)
            await self.sessions.append_exchange(
                sid,
                [
                    {"role": "user", "content": spec.prompt},
                    {"role": "assistant", "content": str(result["result"])},
                ],
                str(result["engine"]),
            )
            await self.jobs.note(job_id, {"notified": 1})
        except (Fenced, RelayError) as exc:
            log.warning("job %s: session %s not notified: %s", job_id, sid, exc)
            with contextlib.suppress(RelayError):
                await self.jobs.note(job_id, {"notified": 0, "notify_error": type(exc).__name__})
        finally:
            with contextlib.suppress(RelayError):
                await self.sessions.release_lock(sid, owner)
